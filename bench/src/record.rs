//! What the benchmark reads from `tracing`: the statements sqlx sends (a counting
//! executor, in effect) and idem's own claim timings from its `idem.request` spans.
//! Off, it costs one atomic load per callsite; it records only while asked to.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use idem_tests::{ClosedSpans, SpanFields};
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::dynamic_filter_fn;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

static RECORDING: AtomicBool = AtomicBool::new(false);
static STATEMENTS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static SPANS: LazyLock<ClosedSpans> = LazyLock::new(ClosedSpans::default);

pub(crate) fn install() {
    let recording = dynamic_filter_fn(|metadata, _| {
        RECORDING.load(Ordering::Relaxed)
            && (metadata.target() == "sqlx::query" || metadata.name() == "idem.request")
    });
    tracing_subscriber::registry()
        .with(Statements.and_then(SPANS.clone()).with_filter(recording))
        .init();
}

/// Runs `request` and returns the statements sent meanwhile, in order.
pub(crate) async fn statements_of<F: std::future::Future>(request: F) -> (Vec<String>, F::Output) {
    STATEMENTS.lock().unwrap().clear();
    RECORDING.store(true, Ordering::SeqCst);
    let output = request.await;
    // The server finishes its log after the response is on its way.
    tokio::time::sleep(Duration::from_millis(50)).await;
    RECORDING.store(false, Ordering::SeqCst);
    (std::mem::take(&mut *STATEMENTS.lock().unwrap()), output)
}

pub(crate) fn claims_start() {
    SPANS.take();
    RECORDING.store(true, Ordering::SeqCst);
}

/// The claim of each fresh request since [`claims_start`] (BEGIN + claim statement), and
/// of each replay, which is nothing but its claim, its whole time.
pub(crate) fn claims_take() -> Vec<Duration> {
    std::thread::sleep(Duration::from_millis(50));
    RECORDING.store(false, Ordering::SeqCst);
    SPANS
        .take()
        .iter()
        .filter_map(|span| match span.get("outcome") {
            Some("fresh") => span.number("claim_ms"),
            Some("replayed") => span.number("total_ms"),
            _ => None,
        })
        .map(|ms| Duration::from_secs_f64(ms / 1000.0))
        .collect()
}

/// Keeps the first words of each statement sqlx logs.
struct Statements;

impl<S: Subscriber> Layer<S> for Statements {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        if event.metadata().target() != "sqlx::query" {
            return;
        }
        let mut fields = SpanFields::default();
        event.record(&mut fields);
        // `db.statement` has the whole text when it is long; `summary` otherwise.
        let statement = fields
            .get("db.statement")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .or_else(|| fields.get("summary").map(str::trim));
        if let Some(statement) = statement {
            let first_words: String = statement
                .split_whitespace()
                .take(8)
                .collect::<Vec<_>>()
                .join(" ");
            STATEMENTS.lock().unwrap().push(first_words);
        }
    }
}

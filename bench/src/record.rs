//! What the benchmark reads from `tracing`: the statements sqlx sends (a counting
//! executor, in effect) and idem's own claim timings from its `idem.request` spans.
//! Off, it costs one atomic load per callsite; it records only while asked to.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;
use tracing_subscriber::registry::LookupSpan;

static RECORDING: AtomicBool = AtomicBool::new(false);
static STATEMENTS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static CLAIMS: Mutex<Vec<Duration>> = Mutex::new(Vec::new());

pub fn install() {
    tracing_subscriber::registry().with(Recorder).init();
}

/// Runs `request` and returns the statements sent meanwhile, in order.
pub async fn statements_of<F: std::future::Future>(request: F) -> (Vec<String>, F::Output) {
    STATEMENTS.lock().unwrap().clear();
    RECORDING.store(true, Ordering::SeqCst);
    let output = request.await;
    // The server finishes its log after the response is on its way.
    tokio::time::sleep(Duration::from_millis(50)).await;
    RECORDING.store(false, Ordering::SeqCst);
    (std::mem::take(&mut *STATEMENTS.lock().unwrap()), output)
}

pub fn claims_start() {
    CLAIMS.lock().unwrap().clear();
    RECORDING.store(true, Ordering::SeqCst);
}

pub fn claims_take() -> Vec<Duration> {
    std::thread::sleep(Duration::from_millis(50));
    RECORDING.store(false, Ordering::SeqCst);
    std::mem::take(&mut *CLAIMS.lock().unwrap())
}

pub fn percentiles(values: &mut [Duration]) -> (f64, f64) {
    values.sort_unstable();
    let at = |q: f64| {
        values
            .get(((values.len() as f64 - 1.0) * q).round() as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    (at(0.50), at(0.99))
}

struct Recorder;

#[derive(Default)]
struct Fields {
    statement: Option<String>,
    outcome: Option<String>,
    claim_ms: Option<f64>,
    total_ms: Option<f64>,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.record_str(field, &format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            // `db.statement` has the whole text when it is long; `summary` otherwise.
            "db.statement" if !value.trim().is_empty() => {
                self.statement = Some(value.trim().to_owned())
            }
            "summary" if self.statement.is_none() => self.statement = Some(value.trim().to_owned()),
            "outcome" => self.outcome = Some(value.to_owned()),
            _ => {}
        }
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        match field.name() {
            "claim_ms" => self.claim_ms = Some(value),
            "total_ms" => self.total_ms = Some(value),
            _ => {}
        }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Recorder {
    fn register_callsite(&self, _: &'static Metadata<'static>) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::sometimes()
    }

    fn enabled(&self, metadata: &Metadata<'_>, _: Context<'_, S>) -> bool {
        RECORDING.load(Ordering::Relaxed)
            && (metadata.target() == "sqlx::query" || metadata.name() == "idem.request")
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        if event.metadata().target() == "sqlx::query" {
            let mut fields = Fields::default();
            event.record(&mut fields);
            if let Some(statement) = fields.statement {
                let first_line: String = statement
                    .split_whitespace()
                    .take(8)
                    .collect::<Vec<_>>()
                    .join(" ");
                STATEMENTS.lock().unwrap().push(first_line);
            }
        }
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            let mut fields = Fields::default();
            attrs.record(&mut fields);
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(fields) = span.extensions_mut().get_mut::<Fields>() {
                values.record(fields);
            }
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let extensions = span.extensions();
        let Some(fields) = extensions.get::<Fields>() else {
            return;
        };
        // The claim of a fresh request (BEGIN + claim statement); a replay is nothing
        // but its claim, so its whole time.
        let ms = match fields.outcome.as_deref() {
            Some("fresh") => fields.claim_ms,
            Some("replayed") => fields.total_ms,
            _ => None,
        };
        if let Some(ms) = ms {
            CLAIMS
                .lock()
                .unwrap()
                .push(Duration::from_secs_f64(ms / 1000.0));
        }
    }
}

//! What idem tells operators: one `tracing` span per idempotent request, and, with the
//! `metrics` feature, counters and a latency histogram through the `metrics` facade.
//!
//! The span, `idem.request`, carries `scope`, `outcome`, `status` and the timings
//! `claim_ms`, `handler_ms` and `total_ms`; when the request ends, an INFO event in it,
//! `idem request done`, repeats `outcome`, `status` and `total_ms`, so a plain log
//! subscriber at the default level shows how every request ended. Neither ever carries
//! a key, a principal or a body: logs are read by people who must not learn one
//! tenant's keys or payloads.
//!
//! Metrics (feature `metrics`; install any `metrics` recorder, such as
//! `metrics-exporter-prometheus`, and they appear under these names):
//!
//! | name | kind | labels | meaning |
//! |---|---|---|---|
//! | `idem_requests_total` | counter | `scope`, `outcome` | idempotent requests by [`Outcome`] |
//! | `idem_request_duration_seconds` | histogram | `scope`, `outcome` | time from the claim to the answer |
//! | `idem_swept_rows_total` | counter | | expired rows deleted by purges and sweepers |
//! | `idem_steps_total` | counter | `scope`, `step`, `outcome` | steps (`Tx::step`) by outcome: `recorded` (called, then recorded), `replayed` (a recorded result, no call), `failed` (the call's `Err`), `timed_out`, `mismatch`, `lost` (called, the request no longer held its key), `unrecorded` (called, the record failed), `unkeyed` (called, nothing to record) |
//! | `idem_step_duration_seconds` | histogram | `scope`, `step`, `outcome` | a step's time, its call and its record included |
//!
//! A metrics backend keeps a series per label value, so `scope` stays a bounded set: an
//! endpoint's scope (written in its code) is always its own label, and so are the first
//! 64 distinct scopes a process makes at run time ([`Store::run_once`](crate::Store::run_once)'s, which a caller
//! may build from data, one per tenant); later ones count under `other`, with one WARN
//! the first time. The span carries every scope as it is.
//!
//! [`Store::run_once`](crate::Store::run_once): crate::Store::run_once

use std::borrow::Cow;
use std::fmt;
use std::time::{Duration, Instant};

use tracing::field::Empty;
use tracing::Span;

/// How an idempotent request ended, as recorded in the span's `outcome` field and in
/// the metrics' `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its response was committed with the key.
    Fresh,
    /// A stored response was replayed; the handler did not run.
    Replayed,
    /// The key was in use by a request in flight: 409.
    Conflict,
    /// The key was used before with another payload or target: 422.
    Mismatch,
    /// The handler ran and everything was rolled back (`Err`, 5xx, a response that
    /// could not be stored).
    RolledBack,
    /// The key was missing or malformed: 400.
    RejectedKey,
    /// The database could not be reached: 503.
    Unavailable,
    /// An endpoint with `required = false` ran without a key: nothing was recorded.
    Unkeyed,
    /// idem could not complete the request: a database error that is not about
    /// reachability, or a handler that ended the transaction itself: 500.
    Failed,
    /// The request was dropped before it finished: the client went away, or a timeout
    /// layer gave up on it. Everything was rolled back.
    Cancelled,
}

impl Outcome {
    /// The label value: `fresh`, `replayed`, `conflict`, `mismatch`, `rolled_back`,
    /// `rejected_key`, `unavailable`, `unkeyed`, `failed` or `cancelled`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fresh => "fresh",
            Self::Replayed => "replayed",
            Self::Conflict => "conflict",
            Self::Mismatch => "mismatch",
            Self::RolledBack => "rolled_back",
            Self::RejectedKey => "rejected_key",
            Self::Unavailable => "unavailable",
            Self::Unkeyed => "unkeyed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One request under observation. Dropped without [`Observation::finish`] (its future
/// was dropped), it records [`Outcome::Cancelled`].
pub(crate) struct Observation {
    span: Span,
    scope: Cow<'static, str>,
    started: Instant,
    claimed: Option<Instant>,
    finished: bool,
}

impl Observation {
    pub(crate) fn start(scope: Cow<'static, str>) -> Self {
        let span = tracing::info_span!(
            "idem.request",
            scope = &*scope,
            outcome = Empty,
            status = Empty,
            claim_ms = Empty,
            handler_ms = Empty,
            total_ms = Empty,
        );
        Self {
            span,
            scope,
            started: Instant::now(),
            claimed: None,
            finished: false,
        }
    }

    pub(crate) fn span(&self) -> &Span {
        &self.span
    }

    /// The claim is done; the handler starts.
    pub(crate) fn claimed(&mut self) {
        let now = Instant::now();
        self.span.record("claim_ms", millis(now - self.started));
        self.claimed = Some(now);
    }

    /// Records how the request ended; `status` is the HTTP status of an HTTP request.
    pub(crate) fn finish(mut self, outcome: Outcome, status: Option<u16>) {
        self.record(outcome, status);
    }

    fn record(&mut self, outcome: Outcome, status: Option<u16>) {
        self.finished = true;
        let now = Instant::now();
        let total = now - self.started;
        if let Some(claimed) = self.claimed {
            self.span.record("handler_ms", millis(now - claimed));
        }
        self.span.record("total_ms", millis(total));
        self.span.record("outcome", outcome.as_str());
        if let Some(status) = status {
            self.span.record("status", status);
        }
        // INFO, like the span: an operator at the default level sees how each request
        // ended (a 422 or a 409 is what a support ticket asks about), without a key, a
        // principal or a body.
        tracing::info!(
            parent: &self.span,
            outcome = outcome.as_str(),
            status,
            total_ms = millis(total),
            "idem request done"
        );
        metrics::request(self.scope.clone(), outcome, total);
    }
}

impl Drop for Observation {
    fn drop(&mut self) {
        if !self.finished {
            self.record(Outcome::Cancelled, None);
        }
    }
}

/// Milliseconds to the microsecond: `1.61`, not `1.6098480000000002`, in a log line.
fn millis(d: Duration) -> f64 {
    // A duration of a request is far below 2^53 µs, which f64 holds exactly.
    d.as_micros() as f64 / 1000.0
}

#[cfg(feature = "metrics")]
pub(crate) mod metrics {
    use std::borrow::Cow;
    use std::collections::{HashMap, HashSet};
    use std::sync::{Mutex, OnceLock};
    use std::time::Duration;

    use super::Outcome;

    /// How many distinct scopes made at run time get a label of their own.
    const RUNTIME_SCOPE_LABELS: usize = 64;

    /// The requests this process counted, by label, as [`counted`] reads them.
    type Counts = HashMap<(String, Outcome), u64>;

    fn counts() -> std::sync::MutexGuard<'static, Counts> {
        static COUNTS: OnceLock<Mutex<Counts>> = OnceLock::new();
        COUNTS
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// What `idem_requests_total` counted in this process, per scope label and outcome,
    /// sorted (the console's overview, `crate::operate::request_counts`).
    pub(crate) fn counted() -> Vec<(String, Outcome, u64)> {
        let mut all: Vec<_> = counts()
            .iter()
            .map(|((scope, outcome), n)| (scope.clone(), *outcome, *n))
            .collect();
        all.sort_by(|a, b| (&a.0, a.1.as_str()).cmp(&(&b.0, b.1.as_str())));
        all
    }

    pub(crate) fn request(scope: Cow<'static, str>, outcome: Outcome, duration: Duration) {
        let scope = label(scope);
        *counts().entry((scope.to_string(), outcome)).or_default() += 1;
        let labels = vec![
            ::metrics::Label::new("scope", scope),
            ::metrics::Label::new("outcome", outcome.as_str()),
        ];
        ::metrics::counter!("idem_requests_total", labels.clone()).increment(1);
        ::metrics::histogram!("idem_request_duration_seconds", labels)
            .record(duration.as_secs_f64());
    }

    /// The `scope` label (see the module's docs): a `&'static` scope is written in code
    /// (an endpoint's) and is its own label; an owned one was made at run time
    /// (`run_once`'s, possibly from data) and is its own label only among the first
    /// [`RUNTIME_SCOPE_LABELS`] distinct ones, `other` after them.
    fn label(scope: Cow<'static, str>) -> Cow<'static, str> {
        let Cow::Owned(scope) = scope else {
            return scope;
        };
        static LABELLED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
        let mut labelled = LABELLED
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if labelled.contains(&scope) {
            return Cow::Owned(scope);
        }
        if labelled.len() < RUNTIME_SCOPE_LABELS {
            labelled.insert(scope.clone());
            return Cow::Owned(scope);
        }
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!(
                "idem: more than {RUNTIME_SCOPE_LABELS} run_once scopes; the metrics count the later ones under scope=\"other\" (spans keep every scope)"
            );
        });
        Cow::Borrowed("other")
    }

    pub(crate) fn swept(rows: u64) {
        ::metrics::counter!("idem_swept_rows_total").increment(rows);
    }

    /// The requests abandoned after their steps, as the sweeper last counted them.
    pub(crate) fn abandoned(requests: u64) {
        ::metrics::gauge!("idem_abandoned_requests").set(requests as f64);
    }

    /// A step ended (`Tx::step`): `scope` `None` for a request without a key.
    pub(crate) fn step(
        scope: Option<Cow<'static, str>>,
        step: &str,
        outcome: &'static str,
        duration: Duration,
    ) {
        let labels = vec![
            ::metrics::Label::new("scope", scope.map_or(Cow::Borrowed(""), label)),
            ::metrics::Label::new("step", step.to_owned()),
            ::metrics::Label::new("outcome", outcome),
        ];
        ::metrics::counter!("idem_steps_total", labels.clone()).increment(1);
        ::metrics::histogram!("idem_step_duration_seconds", labels).record(duration.as_secs_f64());
    }

    /// A completer's run of an abandoned request ended (`idem::complete`): `outcome` is
    /// `completed`, `abandoned`, `retrying` or `parked`.
    pub(crate) fn completion(scope: &str, outcome: &'static str) {
        let labels = vec![
            ::metrics::Label::new("scope", label(Cow::Owned(scope.to_owned()))),
            ::metrics::Label::new("outcome", outcome),
        ];
        ::metrics::counter!("idem_completions_total", labels).increment(1);
    }
}

#[cfg(not(feature = "metrics"))]
pub(crate) mod metrics {
    use std::borrow::Cow;
    use std::time::Duration;

    use super::Outcome;

    pub(crate) fn request(_: Cow<'static, str>, _: Outcome, _: Duration) {}

    pub(crate) fn swept(_: u64) {}

    pub(crate) fn abandoned(_: u64) {}

    pub(crate) fn step(_: Option<Cow<'static, str>>, _: &str, _: &'static str, _: Duration) {}

    pub(crate) fn completion(_: &str, _: &'static str) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_are_logged_to_the_microsecond() {
        assert_eq!(millis(Duration::from_nanos(1_609_848)).to_string(), "1.609");
        assert_eq!(millis(Duration::from_nanos(31_520)).to_string(), "0.031");
        assert_eq!(millis(Duration::from_secs(2)).to_string(), "2000");
    }
}

//! Steps: a call to another service that happens once per request, across crashes,
//! failures and retries ([`Tx::step`]).
//!
//! The request's transaction cannot roll back a call to a payment processor, and a charge
//! endpoint cannot wait for the outbox: it needs the processor's answer to answer its own
//! client. A step runs such a call and records its result *outside* the request's
//! transaction, durably, before the handler goes on: a retry of the same request (same
//! scope, principal, key and payload) that reaches the step gets the recorded result and
//! calls nobody. The request's COMMIT deletes its steps (from then on its stored response
//! answers every retry); a request that never commits leaves them until they expire with
//! its key.
//!
//! Where each failure leaves the request, for a handler that calls the processor in a
//! step and then writes its charge:
//!
//! | the request stops | the processor was called | its retry |
//! |---|---|---|
//! | before the step's call | no | calls it (once) |
//! | during the call (crash, [timeout](crate::StoreBuilder::step_timeout), the call's `Err`) | maybe | calls again, with the same key |
//! | after the call, before its record commits | yes | calls again, with the same key |
//! | after the record, before COMMIT (the handler fails, a crash) | yes | resumes: no call |
//! | after COMMIT | yes | replays the stored response |
//!
//! The second and third rows are what remains: a call that ended without an answer to
//! record (its `Err`, the timeout, a crash during it), and the milliseconds between the
//! processor's answer and the record's commit. A processor that honours idempotency keys
//! answers the repeated call with its first answer (exactly once); one that ignores them
//! is called once more after each such failure, which is why a definitive answer (a
//! declined card) belongs in the `Ok`, recorded.
//!
//! A step runs only while its request holds the key: a duplicate in flight waits or is
//! answered 409 before its handler runs, so two copies never run a step at once; and the
//! record is fenced (invariant 11): written only while the request's transaction is
//! still in progress, so a request that lost its transaction (its connection dropped
//! while the call ran) records nothing, and answers [`StepError::Lost`].

use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tracing::field::Empty;
use tracing::Instrument;

use crate::failpoint::Point;
use crate::fingerprint::hex;
use crate::identity::KeyInScope;
use crate::observe;
use crate::store::Store;
use crate::table::steps::{StepWrite, StepsTable};
use crate::tx::{AttemptState, Request, Tx};

impl Store {
    /// The store's steps table, its statements rendered.
    pub(crate) fn steps(&self) -> &StepsTable {
        &self.inner.steps
    }
}

impl Tx<'_> {
    /// Runs `call`, a call to another service, once per request: its `Ok` is recorded
    /// durably, outside the request's transaction, before `step` returns it, and a retry
    /// of the same request that reaches this step gets it back without calling again.
    ///
    /// `name` names the call within the request (a request's steps are told apart by
    /// name, and the same name again in one request answers the first call's result);
    /// it is also the `step` label of the metrics, so write it in code. `call` gets a
    /// key to forward to the service (its `Idempotency-Key`): [`Tx::derived_key`] of
    /// `name`, the same for every retry of this request, so a service that honours keys
    /// answers a repeated call with its first answer.
    ///
    /// - `Ok(value)` is recorded (as JSON) and returned. A definitive outcome that is
    ///   not a success (a declined card) belongs there too, so that the retry answers
    ///   the same: make `T` say it (`Result<Charge, Declined>`, an enum).
    /// - `Err(e)` is not recorded: `step` answers [`StepError::Call`], the handler
    ///   returns it as its `Err` (everything rolls back) and the retry calls again, with
    ///   the same key.
    /// - A call that takes longer than the store's
    ///   [`step_timeout`](crate::StoreBuilder::step_timeout) is dropped:
    ///   [`StepError::Timeout`].
    /// - An earlier attempt of this key that ran steps with another payload:
    ///   [`StepError::Mismatch`] (422), and no call.
    ///
    /// The request's transaction, and its connection, stay open while the call runs.
    /// Without a key (an endpoint with `required = false` called without one) there is
    /// nothing to resume: the call runs every time, with a random key.
    ///
    /// ```no_run
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct Charge { id: String }
    /// # async fn charge(key: &str) -> Result<Charge, std::io::Error> { Ok(Charge { id: format!("ch_{key}") }) }
    /// # async fn f(mut tx: idem::Tx<'_>) -> Result<(), Box<dyn std::error::Error>> {
    /// let charge: Charge = tx
    ///     .step("processor", |key| async move {
    ///         // POST /v1/charges with `Idempotency-Key: {key}`
    ///         charge(&key).await
    ///     })
    ///     .await?;
    /// sqlx::query("INSERT INTO charges (processor_id) VALUES ($1)")
    ///     .bind(&charge.id)
    ///     .execute(&mut *tx)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn step<T, E, F, Fut>(&mut self, name: &str, call: F) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let store = self.store();
        let timeout = store.inner.step_timeout;
        let (Some(key), Some(request)) = (self.key_in_scope(), self.request()) else {
            return unkeyed(name, call, timeout).await;
        };
        let derived = self.derived_key(name).unwrap_or_default();
        let span = tracing::info_span!(
            "idem.step",
            scope = &*key.scope,
            step = name,
            outcome = Empty,
            call_ms = Empty,
        );
        async move {
            let steps = store.steps();
            let outside = store.outside();
            let started = Instant::now();
            let done = |outcome: &'static str| {
                finished(Some(key.scope.clone()), name, outcome, started.elapsed());
            };
            // The transaction's id (on its own connection) and the steps recorded so far
            // (outside it: a fresh snapshot, whatever the request's isolation), at once.
            let (conn, state) = self.parts();
            let known = state.txid;
            let fence = async {
                match known {
                    Some(txid) => Ok(txid),
                    None => steps.fence(conn).await,
                }
            };
            let (fence, found) = tokio::join!(fence, steps.read(outside, key));
            let fence = fence.map_err(StepError::Database)?;
            state.txid = Some(fence);
            let found = found.map_err(StepError::Database)?;
            // Steps of this key recorded by a request with another payload: the key was
            // used for another request, which a retry cannot resume. Compared as the
            // keys' rows are: after a deploy that reordered or added `fields`, on the
            // fields both versions share.
            if found.iter().any(|step| {
                !request
                    .fingerprint
                    .matches(&step.fingerprint, &step.field_hashes)
            }) {
                done("mismatch");
                return Err(StepError::Mismatch);
            }
            let forget = steps.forgetting(store.inner.table.prepared(), key);
            // A completable request's stored copy goes with its steps.
            let forget_request = state
                .completable
                .then(|| store.inner.requests.forgetting(key));
            if let Some(step) = found.into_iter().find(|step| step.step == name) {
                let value = serde_json::from_str(&step.result).map_err(StepError::Json)?;
                state.ride(forget);
                if let Some(forget_request) = forget_request {
                    state.ride(forget_request);
                }
                done("replayed");
                return Ok(value);
            }

            let called = Instant::now();
            let ran = run(call, derived, timeout).await;
            store.failpoint(Point::StepCalled).await;
            tracing::Span::current().record("call_ms", millis(called.elapsed()));
            let value = match ran {
                Ok(value) => value,
                Err(error) => {
                    done(match error {
                        StepError::Timeout(_) => "timed_out",
                        _ => "failed",
                    });
                    return Err(error);
                }
            };
            let recorded = Recorded {
                store,
                key,
                request: &request,
                name,
                fence,
                forget,
                forget_request,
            };
            let kept = recorded.keep(state, &value).await;
            done(match &kept {
                Ok(()) => "recorded",
                Err(StepError::Lost) => "lost",
                Err(_) => "unrecorded",
            });
            kept.map(|()| value)
        }
        .instrument(span)
        .await
    }
}

/// A step that runs outside any keyed request: called once, with a random key, and not
/// recorded.
async fn unkeyed<T, E, F, Fut>(name: &str, call: F, timeout: Duration) -> Result<T, StepError<E>>
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let span = tracing::info_span!("idem.step", step = name, outcome = Empty);
    async {
        let started = Instant::now();
        let ran = run(call, random_key(), timeout).await;
        let outcome = match &ran {
            Ok(_) => "unkeyed",
            Err(StepError::Timeout(_)) => "timed_out",
            Err(_) => "failed",
        };
        finished(None, name, outcome, started.elapsed());
        ran
    }
    .instrument(span)
    .await
}

/// A step's call that answered, to be recorded under its request's fence.
struct Recorded<'a> {
    store: &'a Store,
    key: &'a KeyInScope,
    request: &'a Request<'a>,
    name: &'a str,
    fence: i64,
    /// What deletes the key's steps when the request commits.
    forget: String,
    /// What deletes the stored request with them (a completable request's).
    forget_request: Option<String>,
}

impl Recorded<'_> {
    /// Records `value` outside the request's transaction, with the request itself on its
    /// first step when it is completable; then the deletes ride the request's COMMIT.
    async fn keep<T: Serialize, E>(
        self,
        state: &mut AttemptState,
        value: &T,
    ) -> Result<(), StepError<E>> {
        let store = self.store;
        let result = ascii_json(value).map_err(StepError::Json)?;
        let fingerprint = self.request.fingerprint.combined();
        let parts = self.request.fingerprint.parts();
        // The request itself, with its first step: from then on the service can
        // complete it ([`crate::complete`]).
        let also = match &state.capture {
            Some(captured) if !state.request_stored => Some(store.inner.requests.recording(
                self.key,
                fingerprint.as_slice(),
                &parts,
                captured,
                self.request.ttl,
            )),
            _ => None,
        };
        let write = StepWrite {
            key: self.key,
            step: self.name,
            fingerprint: fingerprint.as_slice(),
            field_hashes: &parts,
            result: &result,
            ttl: self.request.ttl,
            fence: self.fence,
            also: also.as_deref(),
        };
        match store.steps().record(store.outside(), &write).await {
            Ok(true) => {
                store.failpoint(Point::StepRecorded).await;
                state.ride(self.forget);
                if also.is_some() {
                    state.request_stored = true;
                }
                if let Some(forget_request) = self.forget_request {
                    state.ride(forget_request);
                }
                Ok(())
            }
            Ok(false) => {
                tracing::warn!(
                    step = self.name,
                    "idem: a step's call ran, but its request no longer holds its key: \
                     the result is not recorded"
                );
                Err(StepError::Lost)
            }
            Err(error) => Err(StepError::Database(error)),
        }
    }
}

/// `call` with `key`, bounded by `timeout`.
async fn run<T, E, F, Fut>(call: F, key: String, timeout: Duration) -> Result<T, StepError<E>>
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    match tokio::time::timeout(timeout, call(key)).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(StepError::Call(error)),
        Err(_) => Err(StepError::Timeout(timeout)),
    }
}

/// A key for a step without an idempotency key: 64 hex characters from the process's
/// random hasher keys, the time and a counter.
fn random_key() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut hasher = Sha256::new();
    hasher.update(b"idem.step-key.v1");
    for _ in 0..2 {
        hasher.update(RandomState::new().hash_one(count).to_be_bytes());
    }
    hasher.update(nanos.to_be_bytes());
    hasher.update(count.to_be_bytes());
    hex(&hasher.finalize())
}

/// Milliseconds to the microsecond, as the request's span writes them.
fn millis(d: Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

/// The end of a step, in its span (the current one) and its metrics.
fn finished(
    scope: Option<std::borrow::Cow<'static, str>>,
    step: &str,
    outcome: &'static str,
    elapsed: Duration,
) {
    tracing::Span::current().record("outcome", outcome);
    tracing::info!(outcome, total_ms = millis(elapsed), "idem step done");
    observe::metrics::step(scope, step, outcome, elapsed);
}

/// Why [`Tx::step`] returned no result. Return it as the handler's `Err` (with the
/// `axum` adapter it is a response: the call's own error answers as itself, the others
/// as idem's problems); everything the request wrote rolls back, and the retry runs the
/// step again, or resumes after it.
#[derive(Debug)]
#[non_exhaustive]
pub enum StepError<E> {
    /// The call answered `Err`: nothing was recorded, and the retry calls again with the
    /// same key.
    Call(E),
    /// The call took longer than the store's step timeout and was dropped: nothing was
    /// recorded (the service may have acted; the retry calls again with the same key).
    /// 504 over HTTP.
    Timeout(Duration),
    /// An earlier request with this key and another payload ran steps that it never
    /// committed: the key names that request, and this one cannot resume it. No call
    /// was made. 422 over HTTP, as any reuse of a key with another payload.
    Mismatch,
    /// The call ran, but the request no longer holds its key (its transaction ended
    /// while the call ran: its connection dropped, a server timeout), so its result was
    /// not recorded: the request cannot commit either. 503 over HTTP; the retry calls
    /// again with the same key.
    Lost,
    /// The result could not be written as JSON, or a recorded result could not be read
    /// back as the step's type (it changed between two versions of the service).
    Json(serde_json::Error),
    /// Reading or recording the step failed: the call's result, if it ran, was not
    /// recorded. See [`is_unavailable`](crate::sqlstate::is_unavailable).
    Database(sqlx::Error),
}

impl<E: std::fmt::Display> std::fmt::Display for StepError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Call(e) => write!(f, "the step's call failed: {e}"),
            Self::Timeout(after) => write!(f, "the step's call took longer than {after:?}"),
            Self::Mismatch => f.write_str(
                "an earlier request with this idempotency key and another payload ran steps",
            ),
            Self::Lost => f.write_str(
                "the request no longer holds its idempotency key: the step's result was not recorded",
            ),
            Self::Json(e) => write!(f, "the step's result is not JSON of its type: {e}"),
            Self::Database(e) => write!(f, "the step could not be recorded: {e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for StepError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Call(e) => Some(e),
            Self::Json(e) => Some(e),
            Self::Database(e) => Some(e),
            Self::Timeout(_) | Self::Mismatch | Self::Lost => None,
        }
    }
}

/// `value` as JSON in ASCII alone: every other character written as its `\u` escape
/// (a surrogate pair above the Basic Multilingual Plane), which any JSON parser reads back
/// as the same string. A step's result is written into a statement's text, and a database
/// whose encoding is not UTF-8 refuses or cannot hold some characters there (`SQL_ASCII`
/// refuses every escape above 127, `LATIN1` has no `€`): the record failed, and every
/// retry called again (invariant 12). ASCII means the same in every server encoding.
fn ascii_json<T: Serialize>(value: &T) -> serde_json::Result<String> {
    let mut out = Vec::new();
    value.serialize(&mut serde_json::Serializer::with_formatter(
        &mut out, AsciiOnly,
    ))?;
    // Only ASCII was written.
    Ok(String::from_utf8(out).unwrap_or_default())
}

/// serde_json's compact output with every character outside ASCII escaped.
struct AsciiOnly;

impl serde_json::ser::Formatter for AsciiOnly {
    fn write_string_fragment<W>(&mut self, writer: &mut W, fragment: &str) -> std::io::Result<()>
    where
        W: ?Sized + std::io::Write,
    {
        let mut units = [0_u16; 2];
        for (at, c) in fragment.char_indices() {
            if c.is_ascii() {
                writer.write_all(&fragment.as_bytes()[at..at + 1])?;
            } else {
                for unit in c.encode_utf16(&mut units) {
                    write!(writer, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    /// Regression (issue 37, 3): a result with characters outside ASCII is written in
    /// ASCII and read back as itself.
    #[test]
    fn results_are_written_in_ascii() {
        let value =
            serde_json::json!({ "name": "Zo\u{eb}", "price": "\u{20ac}5", "\u{1f600}": ["\"\n"] });
        let written = ascii_json(&value).unwrap();
        assert!(written.is_ascii(), "{written}");
        assert!(
            written.contains(r"Zo\u00eb") && written.contains(r"\ud83d\ude00"),
            "{written}"
        );
        let read: serde_json::Value = serde_json::from_str(&written).unwrap();
        assert_eq!(read, value);
        assert_eq!(
            ascii_json(&"plain").unwrap(),
            serde_json::to_string("plain").unwrap()
        );
    }

    use super::*;

    #[test]
    fn random_keys_differ_and_are_hex() {
        let (a, b) = (random_key(), random_key());
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn a_statement_rides_commit_once() {
        let mut state = crate::tx::AttemptState::default();
        state.ride("DELETE 1".to_owned());
        state.ride("DELETE 1".to_owned());
        state.ride("DELETE 2".to_owned());
        assert_eq!(state.rides_commit, ["DELETE 1", "DELETE 2"]);
    }
}

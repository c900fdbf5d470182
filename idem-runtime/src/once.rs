//! Exactly once without HTTP: queue consumers and jobs run their work through the same
//! claim / run / store cycle, keyed by the message's own id.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use axum::response::Response;
use http::StatusCode;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::cycle::{self, Answer};
use crate::fingerprint::Fingerprint;
use crate::key::IdempotencyKey;
use crate::observe::{Observation, Outcome};
use crate::tx::{KeyInScope, Tx};
use crate::Idempotency;

/// The work of [`Idempotency::run_once`]: given the transaction, a future of its result.
pub type Work<'t, R, E> = Pin<Box<dyn Future<Output = Result<R, E>> + Send + 't>>;

/// Why [`Idempotency::run_once`] did not return a result.
#[derive(Debug)]
#[non_exhaustive]
pub enum OnceError<E> {
    /// The work failed; everything it wrote was rolled back; redeliver to retry.
    Work(E),
    /// The key is malformed (see [`IdempotencyKey`]).
    Key(crate::KeyError),
    /// Another delivery of this key is running right now; redeliver later.
    InUse,
    /// This key was used before with another payload: the messages differ.
    Mismatch,
    /// The database could not be reached; nothing ran; redeliver later.
    Unavailable,
    /// idem could not complete (a database error, an unreadable stored result).
    Failed(String),
}

impl<E: std::fmt::Display> std::fmt::Display for OnceError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Work(e) => write!(f, "the work failed and was rolled back: {e}"),
            Self::Key(e) => write!(f, "bad key: {e}"),
            Self::InUse => f.write_str("another delivery of this key is running"),
            Self::Mismatch => f.write_str("this key was used before with another payload"),
            Self::Unavailable => f.write_str("the database is unavailable"),
            Self::Failed(why) => write!(f, "idem failed: {why}"),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for OnceError<E> {}

impl Idempotency {
    /// Runs `work` once per (`scope`, `key`) within `ttl`, inside a transaction that also
    /// stores its result; a redelivery of the same key gets the stored result back
    /// without running `work`. `payload` is fingerprinted: the same key with another
    /// payload is [`OnceError::Mismatch`]. An `Err` from `work` rolls everything back
    /// and can be retried. Keys are global to the scope (there is no principal).
    ///
    /// ```no_run
    /// # async fn f(store: idem_runtime::Idempotency) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    ///
    /// let message_id = "msg-42";
    /// let amount = 500_i64;
    /// let credited: i64 = store
    ///     .run_once("ledger-credits", message_id, Duration::from_secs(7 * 86_400), &amount, |mut tx| {
    ///         Box::pin(async move {
    ///             sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = 1")
    ///                 .bind(amount)
    ///                 .execute(&mut *tx)
    ///                 .await?;
    ///             Ok::<_, sqlx::Error>(amount)
    ///         })
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn run_once<R, E, P, F>(
        &self,
        scope: &'static str,
        key: &str,
        ttl: Duration,
        payload: &P,
        work: F,
    ) -> Result<R, OnceError<E>>
    where
        R: Serialize + DeserializeOwned,
        P: Serialize + ?Sized,
        F: for<'t> FnOnce(Tx<'t>) -> Work<'t, R, E>,
    {
        let observation = Observation::start(scope);
        let key = match IdempotencyKey::parse(key.as_bytes()) {
            Ok(key) => key,
            Err(e) => {
                observation.finish(Outcome::RejectedKey, StatusCode::BAD_REQUEST);
                return Err(OnceError::Key(e));
            }
        };
        let mut fingerprint = Fingerprint::builder(scope, "", "", []);
        if let Err(e) = fingerprint.whole_body(payload) {
            observation.finish(Outcome::Failed, StatusCode::INTERNAL_SERVER_ERROR);
            return Err(OnceError::Failed(e.to_string()));
        }
        let request = cycle::Request {
            key: KeyInScope {
                scope,
                principal: String::new(),
                key,
            },
            ttl,
            fingerprint: fingerprint.finish(),
            conflict_wait: None,
        };
        let mut claimed = match cycle::claim(self.clone(), Some(request), observation).await {
            Ok(claimed) => claimed,
            Err(answer) => return stored_result(answer).await,
        };
        let result = work(claimed.tx()).await;
        let (answer, result) = match result {
            Ok(value) => match serde_json::to_vec(&value) {
                Ok(json) => (Answer::ok((StatusCode::OK, json)), Ok(value)),
                Err(e) => {
                    return Err(OnceError::Failed(format!(
                        "the result cannot be stored: {e}"
                    )))
                }
            },
            // The status only says "roll back"; nobody sees this response.
            Err(e) => (
                Answer::err(StatusCode::INTERNAL_SERVER_ERROR),
                Err(OnceError::Work(e)),
            ),
        };
        let finished = claimed.finish(answer).await;
        match (finished.status(), result) {
            (StatusCode::OK, result)
            | (StatusCode::INTERNAL_SERVER_ERROR, result @ Err(OnceError::Work(_))) => result,
            (_, _) => Err(error_of(finished)),
        }
    }
}

/// The answer of a claim that did not run the work: the stored result, or why not.
async fn stored_result<R: DeserializeOwned, E>(answer: Response) -> Result<R, OnceError<E>> {
    if answer.status() != StatusCode::OK {
        return Err(error_of(answer));
    }
    let body = axum::body::to_bytes(answer.into_body(), usize::MAX)
        .await
        .map_err(|e| OnceError::Failed(e.to_string()))?;
    serde_json::from_slice(&body)
        .map_err(|e| OnceError::Failed(format!("the stored result cannot be read: {e}")))
}

fn error_of<E>(answer: Response) -> OnceError<E> {
    match answer.status() {
        StatusCode::CONFLICT => OnceError::InUse,
        StatusCode::UNPROCESSABLE_ENTITY => OnceError::Mismatch,
        StatusCode::SERVICE_UNAVAILABLE => OnceError::Unavailable,
        other => OnceError::Failed(format!("answered {other}")),
    }
}

//! Exactly once without HTTP: queue consumers and jobs run their work on the engine,
//! keyed by the message's own id.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::engine::{self, Begun, Claim, CommitError, Committed, Refusal};
use crate::fingerprint::{Fingerprint, FingerprintError};
use crate::identity::KeyInScope;
use crate::key::{IdempotencyKey, KeyError, KeyOrigin};
use crate::observe::{Observation, Outcome};
use crate::spread::Spread;
use crate::store::{Store, DEFAULT_TTL};
use crate::table::{Isolation, Record};
use crate::tx::Tx;

/// One piece of work to run once per key; see [`Store::run_once`](crate::Store::run_once).
#[must_use = "a `RunOnce` does nothing until `.run(..)` is awaited"]
#[derive(Debug)]
pub struct RunOnce<'s> {
    store: &'s Store,
    scope: Cow<'static, str>,
    key: Result<IdempotencyKey, KeyError>,
    ttl: Duration,
    payload: Result<Fingerprint, FingerprintError>,
    spread: Spread,
}

impl Store {
    /// Work to run once per (`scope`, `key`): a redelivery of the same key gets the
    /// stored result back without running it. Keys are global to the scope (there is no
    /// principal). The key is the message's id as plain text
    /// ([`IdempotencyKey::from_text`]): any non-empty id works, one over 255 characters
    /// or with spaces or non-ASCII is stored hashed, as `sha256:<64 hex digits>`. Set the [ttl](RunOnce::ttl) and the [payload](RunOnce::payload), then
    /// [run](RunOnce::run) it.
    ///
    /// The work runs inside a transaction that also stores its result: an `Err` rolls
    /// everything back and can be retried; an `Ok` commits its writes with its result.
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    ///
    /// let message_id = "msg-42";
    /// let amount = 500_i64;
    /// let credited: i64 = store
    ///     .run_once("ledger-credits", message_id)
    ///     .ttl(Duration::from_secs(7 * 86_400))
    ///     .payload(&amount)
    ///     .run(async |mut tx| {
    ///         sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = 1")
    ///             .bind(amount)
    ///             .execute(&mut *tx)
    ///             .await?;
    ///         Ok::<_, sqlx::Error>(amount)
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn run_once(&self, scope: &str, key: &str) -> RunOnce<'_> {
        let scope: Cow<'static, str> = Cow::Owned(scope.to_owned());
        RunOnce {
            store: self,
            payload: Ok(Fingerprint::builder(&scope, "", "", []).finish()),
            scope,
            // A message id is plain text, not a header value: never unquoted, and
            // hashed rather than refused when it is long or not visible ASCII.
            key: IdempotencyKey::from_text(key),
            ttl: DEFAULT_TTL,
            spread: Spread::None,
        }
    }
}

impl RunOnce<'_> {
    /// How long the result is kept for redeliveries (default one day).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Keeps this key under `tenant`, the tenant the message concerns (an account id of
    /// the principal column's type), instead of the one value all keys without a
    /// principal share: on a distributed engine the key then lives on the tenant's shard,
    /// beside the rows `work` writes for that tenant (give them [`Tx::principal`]), and
    /// the message commits on one node. The tenant is part of the key's identity: name it
    /// from the message itself, so that every redelivery names the same one. An empty
    /// tenant, or one not of the column's type, spreads by the key
    /// ([`RunOnce::spread_by_key`]). Without either call, a
    /// [portable](crate::StoreBuilder::portable) store keeps the key under a hash of
    /// itself, and the other modes under the principal column's one "nobody" value, as
    /// before (the guide's "Topologies", "Keys without a principal").
    pub fn spread_by(mut self, tenant: &str) -> Self {
        self.spread = Spread::Tenant(Some(tenant.to_owned()));
        self
    }

    /// Keeps this key under a hash of itself instead of the one value all keys without
    /// a principal share, so that a consumer's keys spread over a distributed engine's
    /// shards; keys stay global to the scope. A portable store does so without the call.
    /// [`Tx::principal`] gives the value, for the rows `work` writes.
    pub fn spread_by_key(mut self) -> Self {
        self.spread = Spread::Key;
        self
    }

    /// The message's payload: the same key with another payload is
    /// [`OnceError::Mismatch`]. Without one, only the key identifies the work.
    pub fn payload<P: Serialize + ?Sized>(mut self, payload: &P) -> Self {
        let mut fingerprint = Fingerprint::builder(&self.scope, "", "", []);
        self.payload = fingerprint
            .whole_body(payload)
            .map(|()| fingerprint.finish());
        self
    }

    /// Runs `work` in the transaction, unless this key's result is stored already; then
    /// that result is returned and `work` does not run.
    pub async fn run<F, R, E>(self, work: F) -> Result<R, OnceError<E>>
    where
        F: AsyncFnOnce(Tx<'_>) -> Result<R, E>,
        R: Serialize + DeserializeOwned,
    {
        let observation = Observation::start(self.scope.clone());
        if !crate::identity::valid_scope(&self.scope) {
            let scope = self.scope.into_owned();
            return Err(observation.refuse(Outcome::RejectedKey, OnceError::Scope(scope)));
        }
        let key = match self.key {
            Ok(key) => key,
            Err(error) => {
                return Err(observation.refuse(Outcome::RejectedKey, OnceError::Key(error)))
            }
        };
        let fingerprint = match self.payload {
            Ok(fingerprint) => fingerprint,
            Err(error) => {
                return Err(observation.refuse(Outcome::Failed, OnceError::Payload(error)))
            }
        };
        let (place, principal) = self.spread.place(self.store.inner.dialect, key.as_str());
        let claim = Claim {
            key: KeyInScope {
                scope: self.scope,
                principal,
                key,
                place,
            },
            ttl: self.ttl,
            fingerprint,
            conflict_wait: None,
            statement_timeout: None,
        };
        let mut attempt =
            match engine::begin(self.store, Some(claim), Isolation::ReadCommitted).await {
                Ok(Begun::Run(attempt)) => attempt,
                Ok(Begun::Replay(record)) => {
                    return match serde_json::from_slice(&record.body) {
                        Ok(result) => {
                            observation.finish(Outcome::Replayed, None);
                            Ok(result)
                        }
                        Err(error) => {
                            Err(observation.refuse(Outcome::Failed, OnceError::Result(error)))
                        }
                    }
                }
                Err(refusal) => {
                    let (outcome, error) = refused(refusal);
                    return Err(observation.refuse(outcome, error));
                }
            };
        let mut observation = observation;
        observation.claimed();
        let value = match work(attempt.tx()).await {
            Ok(value) => value,
            Err(error) => {
                // A failed rollback leaves nothing either: the connection is gone, and
                // the transaction with it.
                if let Err(e) = attempt.rollback().await {
                    tracing::warn!(parent: observation.span(), error = %e, "idem: rollback failed");
                }
                return Err(observation.refuse(Outcome::RolledBack, OnceError::Work(error)));
            }
        };
        let body = match serde_json::to_vec(&value) {
            Ok(body) => body,
            Err(error) => {
                return Err(observation.refuse(Outcome::RolledBack, OnceError::Result(error)))
            }
        };
        let record = Record {
            status: 200,
            headers: Vec::new(),
            body: body.into(),
        };
        match attempt.commit(&record).await {
            Ok(Committed::Stored) => {
                observation.finish(Outcome::Fresh, None);
                Ok(value)
            }
            // Another attempt with this key committed first: its result is the key's.
            Ok(Committed::Superseded(record)) => match serde_json::from_slice(&record.body) {
                Ok(result) => {
                    observation.finish(Outcome::Replayed, None);
                    Ok(result)
                }
                Err(error) => Err(observation.refuse(Outcome::Failed, OnceError::Result(error))),
            },
            Err(error) => {
                let (outcome, error) = match error {
                    CommitError::Escaped => (Outcome::Failed, OnceError::Escaped),
                    CommitError::Aborted(_) => (Outcome::Failed, OnceError::Aborted),
                    CommitError::Unavailable(e) => {
                        (Outcome::Unavailable, OnceError::Unavailable(e))
                    }
                    CommitError::Serialization(e) => (Outcome::RolledBack, OnceError::Database(e)),
                    CommitError::Database(e) => (Outcome::Failed, OnceError::Database(e)),
                    CommitError::Refused(refusal) => refused(refusal),
                };
                Err(observation.refuse(outcome, error))
            }
        }
    }
}

/// How a refusal is observed, and what [`RunOnce::run`] returns for it.
fn refused<E>(refusal: Refusal) -> (Outcome, OnceError<E>) {
    match refusal {
        Refusal::InUse | Refusal::Abandoning => (Outcome::Conflict, OnceError::InUse),
        Refusal::Mismatch => (Outcome::Mismatch, OnceError::Mismatch),
        Refusal::Unavailable(e) => (Outcome::Unavailable, OnceError::Unavailable(e)),
        Refusal::Database(e) => (Outcome::Failed, OnceError::Database(e)),
        Refusal::Unreadable => (Outcome::Failed, OnceError::Unreadable),
    }
}

impl Observation {
    fn refuse<E>(self, outcome: Outcome, error: OnceError<E>) -> OnceError<E> {
        self.finish(outcome, None);
        error
    }
}

/// Why [`RunOnce::run`] did not return a result.
#[derive(Debug)]
#[non_exhaustive]
pub enum OnceError<E> {
    /// The work failed; everything it wrote was rolled back; redeliver to retry.
    Work(E),
    /// The key is empty (see [`IdempotencyKey::from_text`]).
    Key(KeyError),
    /// The scope has a control character, which idem reserves to keep keys without a
    /// principal apart from every principal's (the scope is given back).
    Scope(String),
    /// The payload cannot be fingerprinted: its `Serialize` implementation failed.
    Payload(FingerprintError),
    /// Another delivery of this key is running right now; redeliver later.
    InUse,
    /// This key was used before with another payload: the messages differ.
    Mismatch,
    /// The database could not be reached; nothing was committed; redeliver later.
    Unavailable(sqlx::Error),
    /// A database error; nothing was committed.
    Database(sqlx::Error),
    /// The result cannot be stored (it does not serialize to JSON) or a stored result
    /// cannot be read back as `R`; nothing was committed.
    Result(serde_json::Error),
    /// The stored record is unreadable.
    Unreadable,
    /// The work ran `COMMIT` or `ROLLBACK` itself: its writes escaped, nothing was
    /// stored.
    Escaped,
    /// One of the work's statements failed and the work returned `Ok` all the same:
    /// PostgreSQL rolled back everything it wrote, and nothing was stored. Return the
    /// failure as `Err` (redelivered), or recover inside a savepoint of your own.
    Aborted,
}

impl<E: fmt::Display> fmt::Display for OnceError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Work(e) => write!(f, "the work failed and was rolled back: {e}"),
            Self::Key(e) => write!(f, "bad key: {}", e.describe(&KeyOrigin::Message)),
            Self::Scope(scope) => write!(f, "bad scope {scope:?}: it has a control character"),
            Self::Payload(e) => write!(f, "bad payload: {e}"),
            Self::InUse => f.write_str("another delivery of this key is running"),
            Self::Mismatch => f.write_str("this key was used before with another payload"),
            Self::Unavailable(e) => write!(f, "the database is unavailable: {e}"),
            Self::Database(e) => write!(f, "database error: {e}"),
            Self::Result(e) => write!(f, "the result cannot be stored or read back: {e}"),
            Self::Unreadable => f.write_str("the stored result is unreadable"),
            Self::Escaped => f.write_str(
                "the work ended idem's transaction itself; its writes escaped, nothing was stored",
            ),
            Self::Aborted => f.write_str(
                "the work returned Ok after one of its statements failed; PostgreSQL rolled back its writes, nothing was stored",
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for OnceError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Work(e) => Some(e),
            Self::Key(e) => Some(e),
            Self::Payload(e) => Some(e),
            Self::Unavailable(e) | Self::Database(e) => Some(e),
            Self::Result(e) => Some(e),
            Self::Scope(_)
            | Self::InUse
            | Self::Mismatch
            | Self::Unreadable
            | Self::Escaped
            | Self::Aborted => None,
        }
    }
}

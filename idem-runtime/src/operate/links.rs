//! What links a key's record to the events its request wrote, and back.
//!
//! An outbox row does not record its key. Its id does, one way: `Tx::emit` derives it from
//! the writing attempt (its scope, the value its key is kept under in the principal
//! column, the key as stored, the event's topic and its place among the attempt's events)
//! and the transaction's start, and the key's row and the event's row both take that start
//! as their `created_at` (`now()`, one instant for the whole transaction). So the events of
//! a key are the outbox rows created at the instant its record was, whose id the key
//! derives for some place ([`Operate::key_events`](crate::operate::Operate::key_events)); and the request of an event is the
//! record created at the event's instant that derives its id ([`Operate::event_request`](crate::operate::Operate::event_request)).
//! Each link is checked by the id, so two transactions that began in the same microsecond
//! are told apart.

use super::Operate;
use sqlx::Row;

use super::keys::owner;
use crate::table::outbox::{attempt_hash, attempt_prefix, event_id};

/// How many of a request's events a link tries: an event is found by its place among
/// them, which its row does not record.
const MAX_PLACE: u32 = 4_096;

/// A committed record's instant and stored identity. $1 its stored scope, $2 its
/// principal, $3 the key.
const RECORD_AT: &str = "\
SELECT scope, principal::text AS principal, key,
       (extract(epoch FROM created_at) * 1000000)::bigint AS created_us,
       extract(epoch FROM created_at)::float8 AS began
  FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND status IS NOT NULL";

/// The outbox's rows written at an instant, $1 in microseconds since the epoch: the
/// candidates of a record's events. The outbox holds what is not yet published (and the
/// dead), so this reads a small table.
const EVENTS_AT: &str = "\
SELECT id, topic, ordering_key, attempts, last_error, dead_at IS NOT NULL AS dead
  FROM {table}
 WHERE created_at = timestamptz 'epoch' + $1::bigint * interval '1 microsecond'
 ORDER BY seq";

/// One outbox row's topic and instant. $1 its id.
const EVENT_AT: &str = "\
SELECT topic, (extract(epoch FROM created_at) * 1000000)::bigint AS created_us,
       extract(epoch FROM created_at)::float8 AS began
  FROM {table}
 WHERE id = $1";

/// The committed records created at an instant, $1 in microseconds since the epoch: the
/// candidates of an event's request. No index leads with `created_at`: this reads the
/// whole table (an operator's question, asked one event at a time).
const RECORDS_AT: &str = "\
SELECT scope, principal::text AS principal, key
  FROM {table}
 WHERE created_at = timestamptz 'epoch' + $1::bigint * interval '1 microsecond'
   AND status IS NOT NULL";

/// An event a request wrote that is still in the outbox ([`Operate::key_events`](crate::operate::Operate::key_events)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyEvent {
    /// The event's id.
    pub id: String,
    /// Its topic.
    pub topic: String,
    /// Its ordering key.
    pub ordering_key: Option<String>,
    /// Whether the relay parked it as dead (else it is pending).
    pub dead: bool,
    /// How many times a relay took it.
    pub attempts: i32,
    /// Its last failure.
    pub last_error: Option<String>,
}

/// The key of the request that wrote an event ([`Operate::event_request`](crate::operate::Operate::event_request)), as
/// [`Operate::key`](crate::operate::Operate::key) looks it up.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestKey {
    /// The scope.
    pub scope: String,
    /// For a key without a principal kept under a spread value: `key` or `tenant`
    /// ([`KeySummary::spread`](super::KeySummary::spread)).
    pub spread: Option<String>,
    /// The principal (or the spread value); empty for none.
    pub principal: String,
    /// The key, as stored.
    pub key: String,
}

/// Whether `id` is the id `Tx::emit` gives an event of `topic` written by the attempt of
/// `key` in `scope` (the endpoint's, without a spread), kept under `principal` (the
/// column's value, as text), in a transaction that began at `began`, for a place below
/// [`MAX_PLACE`]. The attempt's hash is `Tx::emit`'s: each part length-prefixed, under
/// `idem.event.v1`.
fn derives(id: &str, scope: &str, principal: &str, key: &str, topic: &str, began: f64) -> bool {
    let prefix = attempt_prefix(scope, principal, key, topic);
    (0..MAX_PLACE).any(|place| event_id(&attempt_hash(&prefix, place), began) == id)
}

/// The endpoint's scope of a stored scope: without its spread.
fn unspread(stored: &str) -> &str {
    stored.split('\u{1f}').next().unwrap_or(stored)
}

impl Operate<'_> {
    /// The events the committed request of `key` for `principal` (`""` for none) in
    /// `scope` wrote that are still in the outbox, pending or dead, in the order they
    /// were written. `key` as [`Operate::key`](crate::operate::Operate::key) takes it.
    ///
    /// An outbox row does not record its key; its id does, one way: `Tx::emit` derives it
    /// from the writing attempt (scope, principal, key, the event's topic and its place
    /// among the attempt's events) and the transaction's start, which is also the
    /// `created_at` of the key's record and of the event's row. So these are the rows
    /// created at the record's instant whose id the key derives, each checked by its id.
    ///
    /// What no link reaches: events already published (the relay deletes them), an event
    /// written without a key (its id is random), an event whose record expired and was
    /// swept, was purged, or was taken over by a later request with the key (a new
    /// `created_at`), and a request's events past its 4 096th. A request that has not
    /// committed wrote no event: its recorded steps are [`Operate::key_steps`](crate::operate::Operate::key_steps).
    ///
    /// It reads the outbox's rows (no index leads with `created_at`): what is pending and
    /// dead, a small table while the relay keeps up.
    pub async fn key_events(
        self,
        scope: &str,
        principal: &str,
        key: &str,
    ) -> Result<Vec<KeyEvent>, sqlx::Error> {
        let principal_type = self.store.inner.dialect.principal_type;
        let sql = self.key_sql(RECORD_AT);
        for (spelling, stored, place) in self.spelled_places(scope, principal, key) {
            let mut conn = self
                .store
                .inner
                .table
                .single(&self.store.inner.pool)
                .await?;
            let row = self
                .operator_query(sql.clone())
                .bind(stored)
                .bind(principal_type.bound(&place))
                .bind(spelling)
                .fetch_optional(&mut *conn)
                .await?;
            conn.finish().await?;
            let Some(row) = row else { continue };
            let stored_scope: String = row.try_get("scope")?;
            let principal: String = row.try_get("principal")?;
            let key: String = row.try_get("key")?;
            let created_us: i64 = row.try_get("created_us")?;
            let began: f64 = row.try_get("began")?;
            let rows = self.outbox_rows(EVENTS_AT, |q| q.bind(created_us)).await?;
            let mut events = Vec::new();
            for row in rows {
                let event = KeyEvent {
                    id: row.try_get("id")?,
                    topic: row.try_get("topic")?,
                    ordering_key: row.try_get("ordering_key")?,
                    dead: row.try_get("dead")?,
                    attempts: row.try_get("attempts")?,
                    last_error: row.try_get("last_error")?,
                };
                let scope = unspread(&stored_scope);
                if derives(&event.id, scope, &principal, &key, &event.topic, began) {
                    events.push(event);
                }
            }
            return Ok(events);
        }
        Ok(Vec::new())
    }

    /// The key of the committed request that wrote the outbox event `id` (pending or
    /// dead): the record created at the event's instant whose key derives its id
    /// ([`Operate::key_events`](crate::operate::Operate::key_events) says how); `None` when no record is left to say (when no
    /// link reaches, it says too). It reads
    /// the whole idempotency table (no index leads with `created_at`): an operator's
    /// question, asked one event at a time.
    pub async fn event_request(self, id: &str) -> Result<Option<RequestKey>, sqlx::Error> {
        let id = id.to_owned();
        let found = self.outbox_rows(EVENT_AT, |q| q.bind(id.clone())).await?;
        let Some(event) = found.first() else {
            return Ok(None);
        };
        let topic: String = event.try_get("topic")?;
        let created_us: i64 = event.try_get("created_us")?;
        let began: f64 = event.try_get("began")?;
        let mut conn = self
            .store
            .inner
            .table
            .single(&self.store.inner.pool)
            .await?;
        let rows = self
            .operator_query(self.key_sql(RECORDS_AT))
            .bind(created_us)
            .fetch_all(&mut *conn)
            .await?;
        conn.finish().await?;
        let principal_type = self.store.inner.dialect.principal_type;
        for row in rows {
            let stored_scope: String = row.try_get("scope")?;
            let principal: String = row.try_get("principal")?;
            let key: String = row.try_get("key")?;
            let scope = unspread(&stored_scope);
            if derives(&id, scope, &principal, &key, &topic, began) {
                let (scope, spread, principal) = owner(&row, principal_type)?;
                return Ok(Some(RequestKey {
                    scope,
                    spread,
                    principal,
                    key,
                }));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use sha2::{Digest, Sha256};

    use super::*;

    #[test]
    fn an_id_is_derived_from_its_attempt_and_place() {
        // What `Tx::emit` computes for the third event (place 2) of key `k` of `acct_1`
        // in `jobs`, written in a transaction that began at `began`.
        let began = 1_795_860_530.123_456;
        let mut attempt = Sha256::new();
        for part in [
            "idem.event.v1",
            "jobs",
            "acct_1",
            "k",
            "charge.created",
            "2",
        ] {
            attempt.update((part.len() as u64).to_be_bytes());
            attempt.update(part.as_bytes());
        }
        let id = crate::table::outbox::event_id(&attempt.finalize(), began);
        assert!(derives(&id, "jobs", "acct_1", "k", "charge.created", began));
        assert!(!derives(
            &id,
            "jobs",
            "acct_1",
            "k",
            "charge.refunded",
            began
        ));
        assert!(!derives(
            &id,
            "jobs",
            "acct_2",
            "k",
            "charge.created",
            began
        ));
        assert!(!derives(
            &id,
            "jobs",
            "acct_1",
            "k",
            "charge.created",
            began + 1e-6
        ));
        assert_eq!(unspread("jobs\u{1f}key"), "jobs");
        assert_eq!(unspread("jobs"), "jobs");
    }
}

//! The outbox as an operator sees it: what is pending per topic, what is held and by
//! whom, which ordering keys wait behind which event, and the dead events, grouped by
//! the reason they failed, re-driven (within the re-drive window unless forced) or
//! discarded by id, by reason or all at once.

use super::Operate;
use std::fmt;
use std::time::{Duration, SystemTime};

use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row, SqlStr};

use super::events::{DeadBound, EventFilter};
use super::{count, format_age, instant, rfc3339, seconds, secs, DEAD_LIST};
use crate::outbox::DeadEvent;
use crate::table::statement;

/// Pending events per topic: how many, the age of the oldest, and how many are held
/// (under a lease, or waiting out the backoff after a failed attempt).
const PENDING: &str = "\
SELECT topic, count(*)::bigint AS events,
       extract(epoch FROM now() - min(created_at))::float8 AS oldest,
       sum(CASE WHEN available_at > now() THEN 1 ELSE 0 END)::bigint AS held
  FROM {table}
 WHERE dead_at IS NULL
 GROUP BY topic
 ORDER BY topic";

/// Held events, the soonest free first. $1 how many.
const HELD: &str = "\
SELECT id, topic, ordering_key, attempts, lease_owner, last_error,
       extract(epoch FROM available_at)::float8 AS until
  FROM {table}
 WHERE dead_at IS NULL AND available_at > now()
 ORDER BY available_at
 LIMIT $1";

/// Ordering keys with pending events waiting behind their first one, when that one has
/// been taken at least once (it is leased, backing off, or failing): the first is what
/// holds the others (the relay publishes one event of a key at a time). Its `attempts`
/// alone does not tell: a destination that was unavailable gives the attempt back
/// (invariant 10), so a head waiting out an outage has none, a lease or a backoff
/// (`available_at` ahead) and its error. $1 how many.
const BLOCKED: &str = "\
SELECT h.ordering_key, h.id, h.topic, h.attempts, h.lease_owner, h.last_error,
       extract(epoch FROM h.available_at)::float8 AS until, w.waiting
  FROM (SELECT ordering_key, min(seq) AS head, count(*) - 1 AS waiting
          FROM {table}
         WHERE dead_at IS NULL AND ordering_key IS NOT NULL
         GROUP BY ordering_key
        HAVING count(*) > 1) AS w
  JOIN {table} AS h ON h.seq = w.head
 WHERE h.attempts > 0 OR h.available_at > now() OR h.last_error IS NOT NULL
 ORDER BY h.seq
 LIMIT $1";

/// Dead events per reason (their last error): how many, their topics, and how long the
/// oldest and the newest have been parked. The most numerous first.
const DEAD_REASONS: &str = "\
SELECT coalesce(last_error, '') AS reason, count(*)::bigint AS events,
       array_agg(DISTINCT topic) AS topics,
       extract(epoch FROM now() - min(dead_at))::float8 AS oldest,
       extract(epoch FROM now() - max(dead_at))::float8 AS newest
  FROM {table}
 WHERE dead_at IS NOT NULL
 GROUP BY 1
 ORDER BY events DESC, reason";

/// The events an [`EventFilter`] names, $1 to $7 ([`EventFilter::bind`]): $1 ids or NULL,
/// $2 the last error (a dead event's reason) or NULL, $3 a topic or NULL, $4 an ordering
/// key's prefix or NULL, $5 a least age in seconds or NULL, and a bound ([`DeadBound`]) or
/// NULL: $6 the highest `seq`, $7 the instant it was taken (microseconds since the epoch),
/// which ages count from and which no event of the bound was parked after. All NULL: every
/// event. Dead events are `{selected}`, pending ones `{pending}`.
pub(super) const MATCHES: &str = "\
($1::text[] IS NULL OR id = ANY($1))
   AND ($2::text IS NULL OR coalesce(last_error, '') = $2)
   AND ($3::text IS NULL OR topic = $3)
   AND ($4::text IS NULL OR left(ordering_key, length($4)) = $4)
   AND ($5::float8 IS NULL
        OR created_at <= coalesce(timestamptz 'epoch' + $7::bigint * interval '1 microsecond', now())
                         - $5::float8 * interval '1 second')
   AND ($6::bigint IS NULL OR seq <= $6)
   AND ($7::bigint IS NULL OR dead_at <= timestamptz 'epoch' + $7::bigint * interval '1 microsecond')";

/// How many dead events the selection names.
const DEAD_COUNT: &str = "SELECT count(*)::bigint FROM {table} WHERE {selected}";

/// The selected dead events made pending again, their attempts reset, unless one of them
/// is outside the re-drive window and the re-drive is not forced, or the selection holds
/// more than a confirmation counted: then none. $8 the window in seconds, $9 whether
/// forced, $10 the count confirmed or NULL. One statement: the checks and the move read
/// one snapshot, and `now()` is one instant for them, so no event ages between them and
/// none the checks did not count is moved. Answers how many moved, how many were
/// selected, how many of those are outside the window and the oldest's age.
const REDRIVE: &str = "\
WITH selected AS (
  SELECT count(*)::bigint AS events,
         coalesce(sum(CASE WHEN age >= $8 THEN 1 ELSE 0 END), 0)::bigint AS outside,
         max(CASE WHEN age >= $8 THEN age END) AS oldest
    FROM (SELECT extract(epoch FROM now() - created_at)::float8 AS age
            FROM {table}
           WHERE {selected}) AS s
), moved AS (
  UPDATE {table} SET dead_at = NULL, attempts = 0, available_at = now(), lease_owner = NULL
   WHERE {selected} AND ($9::bool OR (SELECT outside FROM selected) = 0)
     AND ($10::bigint IS NULL OR (SELECT events FROM selected) <= $10)
  RETURNING 1
)
SELECT (SELECT count(*) FROM moved)::bigint AS moved, events, outside, oldest
  FROM selected";

/// The selected dead events deleted, unless the selection holds more than a confirmation
/// counted ($8, or NULL): then none. Answers how many went and how many were selected,
/// read in one snapshot.
const DISCARD: &str = "\
WITH selected AS (
  SELECT count(*)::bigint AS events FROM {table} WHERE {selected}
), gone AS (
  DELETE FROM {table}
   WHERE {selected} AND ($8::bigint IS NULL OR (SELECT events FROM selected) <= $8)
  RETURNING 1
)
SELECT (SELECT count(*) FROM gone)::bigint AS moved, events FROM selected";

/// One dead event: $1 its id, $2 whether to read its payload.
const DEAD_ONE: &str = "\
SELECT id, topic, ordering_key, attempts, coalesce(last_error, '') AS last_error,
       extract(epoch FROM now() - dead_at)::float8 AS dead_for,
       extract(epoch FROM now() - created_at)::float8 AS age,
       extract(epoch FROM created_at)::float8 AS created_at, headers,
       CASE WHEN $2::bool THEN payload END AS payload
  FROM {table}
 WHERE id = $1 AND dead_at IS NOT NULL";

/// The age in seconds of the oldest pending event, NULL when none is pending.
const LAG: &str = "\
SELECT extract(epoch FROM now() - min(created_at))::float8 FROM {table} WHERE dead_at IS NULL";

/// The pending events of one topic ([`Operate::outbox_pending`](crate::operate::Operate::outbox_pending)).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct TopicPending {
    /// The topic.
    pub topic: String,
    /// How many events are pending.
    pub events: u64,
    /// The age of the oldest: the topic's lag.
    #[serde(rename = "oldest_secs", serialize_with = "secs")]
    pub oldest: Duration,
    /// How many of them are held: under a relay's lease, or in the backoff after a
    /// failed attempt.
    pub held: u64,
}

/// A pending event that no relay may take before `until` ([`Operate::outbox_leases`](crate::operate::Operate::outbox_leases)):
/// a relay leases it, or it waits out the backoff after a failed attempt
/// (`last_error` then says why).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Lease {
    /// The event's id.
    pub id: String,
    /// Its topic.
    pub topic: String,
    /// Its ordering key.
    pub ordering_key: Option<String>,
    /// How many times a relay took it.
    pub attempts: i32,
    /// The owner number of the relay whose session holds the lease, while it holds it;
    /// `None` for a lease that only its time ends (portable mode, behind a transaction
    /// pooler without a direct session) and for a backoff.
    pub owner: Option<i32>,
    /// The last failure, if it failed before.
    pub last_error: Option<String>,
    /// When it is free again.
    #[serde(serialize_with = "rfc3339")]
    pub until: SystemTime,
}

/// An ordering key whose pending events wait behind its first one
/// ([`Operate::outbox_blocked`](crate::operate::Operate::outbox_blocked)).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct BlockedKey {
    /// The ordering key.
    pub ordering_key: String,
    /// The event that holds the others: the key's first pending one.
    pub blocking: Lease,
    /// How many events wait behind it.
    pub waiting: u64,
}

/// The dead events that failed for one reason ([`Operate::dead_reasons`](crate::operate::Operate::dead_reasons)).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DeadReason {
    /// Their last error, as the publisher reported it.
    pub reason: String,
    /// How many.
    pub events: u64,
    /// Their topics.
    pub topics: Vec<String>,
    /// How long the oldest has been parked.
    #[serde(rename = "oldest_secs", serialize_with = "secs")]
    pub oldest: Duration,
    /// How long the newest has been parked.
    #[serde(rename = "newest_secs", serialize_with = "secs")]
    pub newest: Duration,
}

/// A dead event with what it carries ([`Operate::dead_event`](crate::operate::Operate::dead_event)).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeadDetail {
    /// The event as listed.
    pub event: DeadEvent,
    /// When it was written.
    pub created_at: SystemTime,
    /// Its headers, one `name: value` per line.
    pub headers: String,
    /// Its payload, when asked for.
    pub payload: Option<Vec<u8>>,
}

impl Serialize for DeadDetail {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Detail<'a> {
            #[serde(flatten)]
            event: DeadJson<'a>,
            created_at: String,
            headers: &'a str,
            payload: Option<std::borrow::Cow<'a, str>>,
        }
        Detail {
            event: DeadJson(&self.event),
            created_at: super::format_time(self.created_at),
            headers: &self.headers,
            payload: self.payload.as_deref().map(String::from_utf8_lossy),
        }
        .serialize(s)
    }
}

/// A [`DeadEvent`] as JSON: its fields, `dead_for` as `dead_for_secs`, `age` as
/// `age_secs`.
#[derive(Debug, Clone, Copy)]
pub struct DeadJson<'a>(pub &'a DeadEvent);

impl Serialize for DeadJson<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Dead<'a> {
            id: &'a str,
            topic: &'a str,
            ordering_key: Option<&'a str>,
            attempts: i32,
            last_error: &'a str,
            #[serde(serialize_with = "secs")]
            dead_for_secs: Duration,
            #[serde(serialize_with = "secs")]
            age_secs: Duration,
        }
        let e = self.0;
        Dead {
            id: &e.id,
            topic: &e.topic,
            ordering_key: e.ordering_key.as_deref(),
            attempts: e.attempts,
            last_error: &e.last_error,
            dead_for_secs: e.dead_for,
            age_secs: e.age,
        }
        .serialize(s)
    }
}

/// Which dead events an operation acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadSelection {
    /// Those with these ids.
    Ids(Vec<String>),
    /// Those whose last error is exactly this ([`DeadReason::reason`]).
    Reason(String),
    /// All of them.
    All,
}

impl fmt::Display for DeadSelection {
    /// As the audit trail and the logs write it: `all`, `reason "..."`, or `ids a,b`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::All => f.write_str("all"),
            Self::Reason(reason) => write!(f, "reason {reason:?}"),
            Self::Ids(ids) => write!(f, "ids {}", ids.join(",")),
        }
    }
}

/// Why [`Audited::redrive_dead`](crate::operate::Audited::redrive_dead) re-drove nothing.
#[derive(Debug)]
#[non_exhaustive]
pub enum RedriveError {
    /// Some of the selected events are outside the re-drive window: written at least
    /// [`Operate::redrive_max_age`](crate::operate::Operate::redrive_max_age) ago, so their consumers may have forgotten a first
    /// delivery of them and would apply a second. None of the selection was re-driven;
    /// [`Audited::redrive_dead_forced`](crate::operate::Audited::redrive_dead_forced) re-drives it anyway.
    OutsideWindow {
        /// How many events the selection named.
        selected: u64,
        /// How many of them are outside the window.
        outside: u64,
        /// The age of the oldest of them, since it was written.
        oldest: Duration,
        /// The window: [`Operate::redrive_max_age`](crate::operate::Operate::redrive_max_age).
        max_age: Duration,
    },
    /// The database failed; nothing was re-driven.
    Database(sqlx::Error),
}

impl fmt::Display for RedriveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OutsideWindow {
                selected,
                outside,
                oldest,
                max_age,
            } => write!(
                f,
                "{outside} of the {selected} selected dead event(s) were written more than \
                 the re-drive window ({}) ago, the oldest {} ago: their consumers may have \
                 forgotten a first delivery and would apply them again; nothing was re-driven",
                format_age(*max_age),
                format_age(*oldest),
            ),
            Self::Database(e) => write!(f, "the dead events could not be re-driven: {e}"),
        }
    }
}

impl std::error::Error for RedriveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Database(e) => Some(e),
            Self::OutsideWindow { .. } => None,
        }
    }
}

impl From<sqlx::Error> for RedriveError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}

impl Operate<'_> {
    fn outbox_statement(self, sql: &str) -> SqlStr {
        statement(
            sql.replace("{selected}", &format!("dead_at IS NOT NULL AND {MATCHES}"))
                .replace("{pending}", &format!("dead_at IS NULL AND {MATCHES}"))
                .replace("{table}", self.store.inner.outbox.qualified()),
        )
    }

    /// The rows `sql` (a statement of this module or of [`super::events`]) answers, its
    /// parameters bound by `bind`, on a connection of its own.
    pub(super) async fn outbox_rows(
        self,
        sql: &str,
        bind: impl FnOnce(
            sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>,
        )
            -> sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>,
    ) -> Result<Vec<PgRow>, sqlx::Error> {
        let query =
            sqlx::query(self.outbox_statement(sql)).persistent(self.store.inner.table.persistent());
        let mut conn = self
            .store
            .inner
            .table
            .single(&self.store.inner.pool)
            .await?;
        let rows = bind(query).fetch_all(&mut *conn).await?;
        conn.finish().await?;
        Ok(rows)
    }

    /// The age of the oldest pending event (dead ones aside), `None` when none is
    /// pending: what the relay reports as `idem_outbox_lag_seconds`.
    pub async fn outbox_lag(self) -> Result<Option<Duration>, sqlx::Error> {
        let rows = self.outbox_rows(LAG, |q| q).await?;
        let age: Option<f64> = match rows.first() {
            Some(row) => row.try_get(0)?,
            None => None,
        };
        Ok(age.map(seconds))
    }

    /// Pending events per topic (dead ones aside), by topic.
    pub async fn outbox_pending(self) -> Result<Vec<TopicPending>, sqlx::Error> {
        let rows = self.outbox_rows(PENDING, |q| q).await?;
        rows.iter()
            .map(|row| {
                Ok(TopicPending {
                    topic: row.try_get("topic")?,
                    events: count(row, "events")?,
                    oldest: seconds(row.try_get("oldest")?),
                    held: count(row, "held")?,
                })
            })
            .collect()
    }

    /// Pending events no relay may take now, the soonest free first, at most `limit`:
    /// which relay leases what until when, and what waits out a backoff.
    pub async fn outbox_leases(self, limit: u32) -> Result<Vec<Lease>, sqlx::Error> {
        let rows = self.outbox_rows(HELD, |q| q.bind(i64::from(limit))).await?;
        rows.iter().map(lease).collect()
    }

    /// Ordering keys whose later events wait behind a first one that a relay has taken
    /// and not yet published (leased, or backing off after failures), oldest first, at
    /// most `limit`: each with the event that holds it.
    pub async fn outbox_blocked(self, limit: u32) -> Result<Vec<BlockedKey>, sqlx::Error> {
        let rows = self
            .outbox_rows(BLOCKED, |q| q.bind(i64::from(limit)))
            .await?;
        rows.iter()
            .map(|row| {
                Ok(BlockedKey {
                    ordering_key: row.try_get("ordering_key")?,
                    blocking: lease(row)?,
                    waiting: count(row, "waiting")?,
                })
            })
            .collect()
    }

    /// Dead events grouped by the reason they failed (their last error), the most
    /// numerous first.
    pub async fn dead_reasons(self) -> Result<Vec<DeadReason>, sqlx::Error> {
        let rows = self.outbox_rows(DEAD_REASONS, |q| q).await?;
        rows.iter()
            .map(|row| {
                let mut topics: Vec<String> = row.try_get("topics")?;
                topics.sort();
                Ok(DeadReason {
                    reason: row.try_get("reason")?,
                    events: count(row, "events")?,
                    topics,
                    oldest: seconds(row.try_get("oldest")?),
                    newest: seconds(row.try_get("newest")?),
                })
            })
            .collect()
    }

    /// The dead events `selection` names, oldest first, at most `limit`
    /// ([`Operate::dead_page`](crate::operate::Operate::dead_page) filters more, a page at a time).
    pub async fn dead_events_in(
        self,
        selection: &DeadSelection,
        limit: u32,
    ) -> Result<Vec<DeadEvent>, sqlx::Error> {
        let filter = EventFilter::from(selection);
        let rows = self
            .outbox_rows(DEAD_LIST, |q| {
                filter
                    .bind(q, None)
                    .bind(None::<i64>)
                    .bind(i64::from(limit))
            })
            .await?;
        rows.iter().map(DeadEvent::from_row).collect()
    }

    /// How many dead events `selection` names: what a re-drive or a discard of it would
    /// move now.
    pub async fn dead_count(self, selection: &DeadSelection) -> Result<u64, sqlx::Error> {
        self.dead_matching(&EventFilter::from(selection)).await
    }

    /// How many dead events `filter` names now.
    pub async fn dead_matching(self, filter: &EventFilter) -> Result<u64, sqlx::Error> {
        let rows = self
            .outbox_rows(DEAD_COUNT, |q| filter.bind(q, None))
            .await?;
        match rows.first() {
            Some(row) => Ok(u64::try_from(row.try_get::<i64, _>(0)?).unwrap_or(0)),
            None => Ok(0),
        }
    }

    /// One dead event, with its headers, and its payload when `with_payload` (it may
    /// carry personal data: ask only when needed).
    pub async fn dead_event(
        self,
        id: &str,
        with_payload: bool,
    ) -> Result<Option<DeadDetail>, sqlx::Error> {
        let id = id.to_owned();
        let rows = self
            .outbox_rows(DEAD_ONE, |q| q.bind(id).bind(with_payload))
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let headers: Option<Vec<u8>> = row.try_get("headers")?;
        Ok(Some(DeadDetail {
            event: DeadEvent::from_row(row)?,
            created_at: instant(row.try_get("created_at")?),
            headers: String::from_utf8_lossy(&headers.unwrap_or_default()).into_owned(),
            payload: row.try_get("payload")?,
        }))
    }

    /// [`REDRIVE`] on `conn`: the dead events `filter` names, within `bound` if any (and
    /// then none if the bound holds more than it counted).
    pub(super) async fn redrive_on(
        self,
        conn: &mut PgConnection,
        filter: &EventFilter,
        bound: Option<&DeadBound>,
        force: bool,
    ) -> Result<Redriven, sqlx::Error> {
        let max_age = self.store.inner.redrive_max_age.as_secs_f64();
        let query = sqlx::query(self.outbox_statement(REDRIVE))
            .persistent(self.store.inner.table.persistent());
        let row = filter
            .bind(query, bound)
            .bind(max_age)
            .bind(force)
            .bind(bound.map(|b| i64::try_from(b.events()).unwrap_or(i64::MAX)))
            .fetch_optional(conn)
            .await?;
        // An aggregate without GROUP BY: always one row.
        let Some(row) = row else {
            return Ok(Redriven::default());
        };
        Ok(Redriven {
            moved: count(&row, "moved")?,
            selected: count(&row, "events")?,
            outside: count(&row, "outside")?,
            oldest: seconds(row.try_get::<Option<f64>, _>("oldest")?.unwrap_or(0.0)),
        })
    }

    /// [`DISCARD`] on `conn`: the dead events `filter` names, within `bound` if any (and
    /// then none if the bound holds more than it counted). How many went, and how many
    /// were selected.
    pub(super) async fn discard_on(
        self,
        conn: &mut PgConnection,
        filter: &EventFilter,
        bound: Option<&DeadBound>,
    ) -> Result<(u64, u64), sqlx::Error> {
        let query = sqlx::query(self.outbox_statement(DISCARD))
            .persistent(self.store.inner.table.persistent());
        let row = filter
            .bind(query, bound)
            .bind(bound.map(|b| i64::try_from(b.events()).unwrap_or(i64::MAX)))
            .fetch_optional(conn)
            .await?;
        // An aggregate without GROUP BY: always one row.
        let Some(row) = row else {
            return Ok((0, 0));
        };
        Ok((count(&row, "moved")?, count(&row, "events")?))
    }
}

/// What [`REDRIVE`] answered.
#[derive(Debug, Default)]
pub(super) struct Redriven {
    /// How many events it made pending again.
    pub(super) moved: u64,
    /// How many the selection named.
    pub(super) selected: u64,
    /// How many of those are outside the re-drive window.
    pub(super) outside: u64,
    /// The age of the oldest of those.
    pub(super) oldest: Duration,
}

impl Redriven {
    /// A re-drive that was not forced, with the window `max_age`: how many moved, or
    /// why none did.
    pub(super) fn unforced(self, max_age: Duration) -> Result<u64, RedriveError> {
        if self.outside > 0 {
            return Err(RedriveError::OutsideWindow {
                selected: self.selected,
                outside: self.outside,
                oldest: self.oldest,
                max_age,
            });
        }
        Ok(self.moved)
    }
}

fn lease(row: &PgRow) -> Result<Lease, sqlx::Error> {
    Ok(Lease {
        id: row.try_get("id")?,
        topic: row.try_get("topic")?,
        ordering_key: row.try_get("ordering_key")?,
        attempts: row.try_get("attempts")?,
        owner: row.try_get("lease_owner")?,
        last_error: row.try_get("last_error")?,
        until: instant(row.try_get("until")?),
    })
}

//! The outbox table: its DDL and every statement the outbox runs on it, each written
//! whole beside the function that binds it. Only the table's name is filled in, once per
//! store, through [`crate::table::statement`], the one place idem asserts dynamic SQL
//! safe.
//!
//! A row is written by a request's (or a `run_once` work's) own transaction, beside the
//! key's row and the stored response, so it commits with them or not at all. The relay
//! deletes a row once the broker has acknowledged it, and parks it (`dead_at`) after too
//! many failed attempts (a take counts one; a failure of an unavailable destination gives
//! it back, invariant 10).
//!
//! # Several relays, one order per key
//!
//! A relay takes rows with [`CLAIM_TIED`] ([`CLAIM`] in portable mode): it pushes their
//! `available_at` a lease ahead, so no other relay takes them until the lease runs out,
//! and only a row with no earlier pending row of its ordering key (the key's head) is
//! eligible. So at most one event of a key is in flight, across every relay, and the next
//! one waits until it is published (deleted) or parked. A take may also lease the events
//! behind a ready head (its `chain`); the relay that took them publishes them one after
//! another, each once the one before it was acknowledged, and gives back the rest of the
//! chain when one fails. The statement takes no
//! `FOR UPDATE` or `SKIP LOCKED` (refused across shards by distributed engines): two
//! relays that pick the same row serialize on its row lock, and the loser's re-check of
//! the lease drops it.
//!
//! # A take's cost does not grow with the backlog (invariant 13)
//!
//! [`CLAIM_TIED`] walks the heads of the ordering keys, and the events without a key, one
//! index step each, and stops after a batch or a bounded number of steps; the relay's
//! next take goes on from where it stopped, and starts again from the first once a walk
//! went past the last. A row behind where a walk stopped (a late commit, a backoff that
//! ran out, a key's next event) is found when the walk comes round again, within one pass
//! over the pending keys. The portable mode's [`CLAIM`] still tests every pending row
//! (a distributed engine runs no recursive statement over a distributed table): its drain
//! slows as its backlog grows.
//!
//! # Whoever marks holds (invariant 11)
//!
//! Each take writes a `lease_token` of its own to the rows it took, and every mark
//! ([`DONE`], [`FAILED`]) is conditional on it: a relay that stalled past its lease, whose
//! events another relay took since, marks nothing. Without it, the stalled relay's delete
//! freed the ordering key while the other relay was still publishing its event, and its
//! retry un-parked an event the other relay had parked.
//!
//! # A dead relay's leases end with its session
//!
//! Outside the portable mode, a relay holds a session advisory lock (`pg_try_advisory_lock`
//! of [`lock_class`], a hash of the table's name, and its owner number) on a connection of its own, and a
//! take writes that owner number to the rows as `lease_owner` while the lock is held. A
//! take treats the lease of an owner whose lock is no longer held (its process was killed,
//! its connection dropped) as ended ([`CLAIM_TIED`], which reads `pg_locks`), so a crash
//! costs the other relays about one poll, not the lease. Where a relay cannot hold a
//! session of its own (behind a transaction pooler, unless it is given a direct
//! connection; in the portable mode, whose engine has no cluster-wide advisory lock and
//! refuses `pg_locks` beside a distributed table) `lease_owner` stays NULL and the lease
//! runs out by its time, as before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{PgConnection, PgPool, Postgres, Row, SqlStr};

use super::{statement, Dialect, Pooler, Single, TableName};
use crate::literal::{self, Literal};
use crate::transaction::Prepared;

/// The default name of the outbox table, in the schema of the store's idempotency table.
pub(crate) const DEFAULT_OUTBOX_TABLE: &str = "idem_outbox";

/// The SQL that creates the outbox table (under its default name) and its indexes, for
/// services that run their own migrations. [`Store::migrate`](crate::Store::migrate)
/// runs it for a store with the default tables;
/// [`Store::outbox_schema_sql`](crate::Store::outbox_schema_sql) gives it for any.
pub(crate) const OUTBOX_SCHEMA_SQL: &str = include_str!("../../sql/idem_outbox.sql");

/// The DDL, with `{create_schema}`, `{table}` and `{name}` to fill in.
const DDL: &str = "-- idem: the outbox table, for users who run their own migrations.
-- `Store::migrate` runs exactly this; it is safe to run again.
--
-- A row is written in a request's own transaction and commits with its business writes,
-- or not at all. The relay deletes it once the broker acknowledged it, or parks it
-- (`dead_at`) after too many attempts. Rows come and go quickly: keep autovacuum on for
-- this table and no transaction open for long on the database (an old snapshot keeps
-- every deleted row, and slows the relay's scans).
{create_schema}CREATE TABLE IF NOT EXISTS {table} (
    -- the order events are written in; the relay keeps it per ordering key
    seq          bigserial   NOT NULL,
    -- stable: derived from the writing attempt's key and the event's place in it
    id           text        NOT NULL,
    topic        text        NOT NULL,
    ordering_key text,
    -- one \"name: value\" per line
    headers      bytea,
    payload      bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- not before: a relay's lease, or the backoff after a failed attempt
    available_at timestamptz NOT NULL DEFAULT now(),
    -- the relay holding the lease, while its session holds its advisory lock (NULL: none,
    -- or a lease that only its time ends)
    lease_owner  integer,
    -- written by each take, checked by each mark: a relay whose lease was taken over
    -- marks nothing
    lease_token  bigint,
    attempts     integer     NOT NULL DEFAULT 0,
    last_error   text,
    -- set when the relay gave up; `Store::redrive_dead_events` clears it
    dead_at      timestamptz,
    CONSTRAINT \"{name}_pkey\" PRIMARY KEY (seq),
    CONSTRAINT \"{name}_id_key\" UNIQUE (id)
);

-- Pending rows in order (the lag, the portable mode's relay).
CREATE INDEX IF NOT EXISTS \"{name}_pending_idx\" ON {table} (seq) WHERE dead_at IS NULL;
-- The relay's walk: the first pending row of each ordering key, key after key, and the
-- rows without a key (NULL, last) in order. It replaced `{name}_ordering_idx`
-- (without those rows), which the relay's take read for every pending row.
CREATE INDEX IF NOT EXISTS \"{name}_heads_idx\" ON {table} (ordering_key, seq)
    WHERE dead_at IS NULL;
DROP INDEX IF EXISTS \"{name}_ordering_idx\";
-- Half of each page left free: a take's lease is an update of every row it takes, and
-- rows written together share a page, so only a page half empty holds each one's new
-- version beside it (a HOT update: no new index entries). Full pages cost the drain two
-- and a half times the database's work per event (issue 36).
ALTER TABLE {table} SET (fillfactor = 50);
-- The last ten failed publishes of each event, oldest first: when (`error_at`) and why
-- (`errors`), the same place in both. A re-drive keeps them.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS error_at timestamptz[];
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS errors text[];
";

/// Writes one event. The id is a SHA-256 over what identifies the writing attempt ($1:
/// its scope, principal, key, the event's topic and its place among the attempt's
/// events, hashed by the caller) and the transaction's start time (its `float8`, as 8
/// bytes), so that a key taken over after it expired writes new ids ([`event_id`]
/// computes the same in Rust); an attempt without a key ($1 NULL) gets a
/// random id. A NOTIFY on the table's channel wakes the relays when the transaction
/// commits (sent only then, by PostgreSQL, and not at all on rollback).
///
/// $1 the attempt's hash or NULL, $2 topic, $3 ordering key, $4 headers, $5 payload.
const WRITE: &str = "\
WITH written AS (
    INSERT INTO {table} (id, topic, ordering_key, headers, payload)
    VALUES (CASE WHEN $1::bytea IS NULL THEN replace(gen_random_uuid()::text, '-', '')
                 ELSE left(encode(sha256($1::bytea || float8send(extract(epoch FROM now())::float8)), 'hex'), 32)
            END,
            $2, $3, $4, $5)
    RETURNING id
)
SELECT id, pg_notify('{channel}', '') FROM written";

/// [`WRITE`] without NOTIFY: in portable mode (a distributed engine refuses a volatile
/// function there) and when the store's `outbox_notify` is off; relays then poll.
const WRITE_QUIET: &str = "\
INSERT INTO {table} (id, topic, ordering_key, headers, payload)
VALUES (CASE WHEN $1::bytea IS NULL THEN replace(gen_random_uuid()::text, '-', '')
             ELSE left(encode(sha256($1::bytea || float8send(extract(epoch FROM now())::float8)), 'hex'), 32)
        END,
        $2, $3, $4, $5)
RETURNING id";

/// [`WRITE`]'s insert with its id computed by the caller ([`event_id`]), written into
/// the request's COMMIT message ([`crate::literal`]): the event rides the round trip COMMIT
/// needs anyway. $1 id, $2 topic, $3 ordering key, $4 headers, $5 payload.
const RIDE: &str = "\
INSERT INTO {table} (id, topic, ordering_key, headers, payload) VALUES ($1, $2, $3, $4, $5)";

/// [`RIDE`]'s role in the store's prepared set ([`crate::transaction::Prepared`]).
const RIDE_ROLE: &str = "ride";

/// The relays' wake-up, riding the COMMIT message after [`RIDE`]: sent by PostgreSQL at
/// the commit, not at all on rollback.
const RIDE_NOTIFY: &str = "SELECT pg_notify('{channel}', '')";

/// Takes up to $1 events for $2 seconds under the token $3 (see the module's docs):
/// pending, available, and first of their ordering key among the pending rows. The outer
/// `available_at` test is re-checked on a row another relay took while this statement
/// waited for its lock. The candidates go through `ANY (ARRAY(..))`, so the update finds
/// them by the primary key; `IN (..)` made PostgreSQL 15 scan the whole table for a hash
/// join (18 ms at 100 000 pending rows, against 3 ms). In portable mode: leases end by
/// their time only.
const CLAIM: &str = "\
UPDATE {table} AS o
   SET available_at = now() + $2::float8 * interval '1 second', attempts = o.attempts + 1,
       lease_owner = NULL, lease_token = $3
 WHERE o.seq = ANY (ARRAY(
        SELECT e.seq FROM {table} AS e
         WHERE e.dead_at IS NULL AND e.available_at <= now()
           AND NOT EXISTS (SELECT 1 FROM {table} AS p
                            WHERE p.ordering_key = e.ordering_key AND p.seq < e.seq
                              AND p.dead_at IS NULL)
         ORDER BY e.seq
         LIMIT $1))
   AND o.dead_at IS NULL AND o.available_at <= now()
RETURNING o.seq, o.id, o.topic, o.ordering_key, o.headers, o.payload, o.attempts,
          extract(epoch FROM now() - o.created_at)::float8 AS age, false AS tied,
          NULL::bigint AS prev";

/// [`CLAIM`] outside the portable mode, at a cost per event that does not grow with the
/// backlog (invariant 13). [`CLAIM`] tests every pending row for an earlier row of its
/// ordering key, and the planner, misled by a table that had no statistics yet (or a
/// generic plan), sorted every pending row on each take: a drain quadratic in its backlog
/// (issue 36). This statement walks instead, one index descent per step, so that no plan
/// can read more than it needs:
///
/// - `heads`: the first pending row of each ordering key (the head: the only one of its
///   key that may be in flight), key after key through `{name}_heads_idx` from $5 (the key
///   the relay's previous walk stopped at; NULL: from the first), until $1 of them are
///   ready or $6 keys were looked at. A key whose head is leased or waiting out a backoff
///   costs one step, and its other rows none.
/// - `loose`: events without an ordering key, oldest first from $7 (the `seq` the previous
///   walk of them stopped at; NULL: from the first), until $1 are ready or $6 were looked
///   at.
///
/// - `chain`: when fewer than $1 heads are ready, the events behind each ready head, in
///   order, as many as fill the take when shared among them, up to the first that is not
///   ready. Each chain is one index range behind its head. A key with a backlog then
///   drains many events per take, published in order by one task ([`crate::outbox`]),
///   not one event per round trip of take, publish and delete (issue 36).
///
/// The oldest $1 of all three are taken. A row is ready when it is available, or leased by an
/// owner whose session no longer holds its advisory lock (`live`, read once from
/// `pg_locks`); the rows taken are leased to $4 (the taking relay's owner number, or NULL)
/// only if its own lock is held: a relay whose lock connection dropped leases by time
/// until it has a new one (`tied` tells it). The outer test is re-checked on a row another
/// relay took while this statement waited for its lock.
///
/// Each row taken comes with `prev`: for a row of a chain, the `seq` of the row before it
/// (its head, or the chain's row before it); NULL for a head and an event without a key.
/// The relay publishes a chain's row only when it also took the row before it: a row
/// whose predecessor another relay took first (between this statement's snapshot and its
/// row locks) is given back unpublished, so that no key has two events in flight.
///
/// The last row (its `seq` NULL) says where the walks stopped: `walked`, the last key
/// looked at, and `ended`, whether no key came after it; `loose_walked` and `loose_ended`
/// the same of the events without a key. The relay's next take starts there
/// ([`OutboxTable::claim`]), so that successive takes go round, and a row behind where a
/// walk stopped (a late commit, a backoff that ran out) is found when it comes round
/// again.
const CLAIM_TIED: &str = "\
WITH RECURSIVE live AS MATERIALIZED (
    SELECT l.objid::bigint AS owner FROM pg_locks AS l
     WHERE l.locktype = 'advisory' AND l.classid = {lock_class}::oid AND l.objsubid = 2
       AND l.granted
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
), heads AS (
    SELECT h.ordering_key, h.seq, h.ready, 1 AS steps, h.ready::integer AS found
      FROM (SELECT e.ordering_key, e.seq,
                   {ready_e} AS ready
              FROM {table} AS e
             WHERE e.dead_at IS NULL AND e.ordering_key >= coalesce($5::text, '')
             ORDER BY e.ordering_key, e.seq LIMIT 1) AS h
    UNION ALL
    SELECT h.ordering_key, h.seq, h.ready, w.steps + 1, w.found + h.ready::integer
      FROM heads AS w
     CROSS JOIN LATERAL (
            SELECT e.ordering_key, e.seq,
                   {ready_e} AS ready
              FROM {table} AS e
             WHERE e.dead_at IS NULL AND e.ordering_key > w.ordering_key
             ORDER BY e.ordering_key, e.seq LIMIT 1) AS h
     WHERE w.found < $1 AND w.steps < $6
), loose AS (
    SELECT l.seq, l.ready, 1 AS steps, l.ready::integer AS found
      FROM (SELECT e.seq,
                   {ready_e} AS ready
              FROM {table} AS e
             WHERE e.dead_at IS NULL AND e.ordering_key IS NULL AND e.seq >= coalesce($7::bigint, 0)
             ORDER BY e.ordering_key, e.seq LIMIT 1) AS l
    UNION ALL
    SELECT l.seq, l.ready, w.steps + 1, w.found + l.ready::integer
      FROM loose AS w
     CROSS JOIN LATERAL (
            SELECT e.seq,
                   {ready_e} AS ready
              FROM {table} AS e
             WHERE e.dead_at IS NULL AND e.ordering_key IS NULL AND e.seq > w.seq
             ORDER BY e.ordering_key, e.seq LIMIT 1) AS l
     WHERE w.found < $1 AND w.steps < $6
), ready_heads AS (
    SELECT count(*) AS n FROM heads WHERE ready
), chain AS (
    SELECT c.seq, c.prev
      FROM heads AS h
     CROSS JOIN LATERAL (
            SELECT s.seq, lag(s.seq, 1, h.seq) OVER (ORDER BY s.seq) AS prev,
                   bool_and(s.ready) OVER (ORDER BY s.seq) AS run
              FROM (SELECT e.seq,
                           {ready_e} AS ready
                      FROM {table} AS e
                     WHERE e.dead_at IS NULL AND e.ordering_key = h.ordering_key
                       AND e.seq > h.seq
                     ORDER BY e.ordering_key, e.seq
                     LIMIT (SELECT greatest($1 - n + greatest(n, 1) - 1, 0) / greatest(n, 1)
                              FROM ready_heads)) AS s) AS c
     WHERE h.ready AND c.run AND (SELECT n FROM ready_heads) < $1
), taken AS (
    UPDATE {table} AS o
       SET available_at = now() + $2::float8 * interval '1 second', attempts = o.attempts + 1,
           lease_owner = CASE WHEN $4::integer IN (SELECT owner FROM live) THEN $4::integer END,
           lease_token = $3
     WHERE o.seq = ANY (ARRAY(
            SELECT r.seq FROM (SELECT seq FROM heads WHERE ready
                               UNION ALL SELECT seq FROM chain
                               UNION ALL SELECT seq FROM loose WHERE ready) AS r
             ORDER BY r.seq LIMIT $1))
       AND o.dead_at IS NULL
       AND {ready_o}
    RETURNING o.seq, o.id, o.topic, o.ordering_key, o.headers, o.payload, o.attempts,
              extract(epoch FROM now() - o.created_at)::float8 AS age,
              o.lease_owner IS NOT NULL AS tied
)
SELECT t.seq, t.id, t.topic, t.ordering_key, t.headers, t.payload, t.attempts, t.age, t.tied,
       c.prev, NULL::text AS walked, NULL::boolean AS ended,
       NULL::bigint AS loose_walked, NULL::boolean AS loose_ended
  FROM taken AS t LEFT JOIN chain AS c ON c.seq = t.seq
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       (SELECT h.ordering_key FROM heads AS h ORDER BY h.steps DESC LIMIT 1),
       coalesce((SELECT max(h.steps) < $6 AND max(h.found) < $1 FROM heads AS h), true),
       (SELECT l.seq FROM loose AS l ORDER BY l.steps DESC LIMIT 1),
       coalesce((SELECT max(l.steps) < $6 AND max(l.found) < $1 FROM loose AS l), true)";

/// Whether the pending row `{row}` may be taken now (in [`CLAIM_TIED`], as `{ready_e}` and
/// `{ready_o}`): available, or leased by an owner whose session no longer holds its lock
/// (`live`).
const READY: &str = "({row}.available_at <= now()
     OR ({row}.lease_owner IS NOT NULL AND {row}.lease_owner NOT IN (SELECT owner FROM live)))";

/// The relays whose sessions hold their locks now (see [`CLAIM_TIED`]'s `live`): each
/// one's owner number, its session's `application_name` (the relay's host and process),
/// client address and start.
const RELAYS: &str = "\
SELECT l.objid::bigint AS owner, a.application_name, host(a.client_addr) AS client_addr,
       extract(epoch FROM a.backend_start)::float8 AS since
  FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.classid = {lock_class}::oid AND l.objsubid = 2
   AND l.granted
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
 ORDER BY a.backend_start, l.objid";

/// Takes the session lock that ties a relay's leases to its connection: $1 its owner
/// number. False when another session holds that number.
const LOCK: &str = "SELECT pg_try_advisory_lock({lock_class}, $1)";

/// Published: the rows go, those still under this relay's lease. $1 their `seq`s, $2
/// the lease's token.
const DONE: &str = "DELETE FROM {table} WHERE seq = ANY($1) AND lease_token = $2";

/// Given back unpublished, if still under this relay's lease: available now, and the
/// attempt the take counted given back. $1 their `seq`s, $2 the lease's token. For the
/// rows of a chain behind an event that failed, or that the relay did not reach before
/// its lease would end, or whose predecessor it did not take.
const RELEASE: &str = "\
UPDATE {table}
   SET available_at = now(), attempts = greatest(attempts - 1, 0), lease_owner = NULL
 WHERE seq = ANY($1) AND lease_token = $2";

/// The failed publishes of one event, oldest first, a row each (none for an event that
/// never failed, or is gone). $1 its id.
const ERRORS: &str = "\
SELECT extract(epoch FROM e.at)::float8 AS at, e.error
  FROM {table} AS o, unnest(o.error_at, o.errors) WITH ORDINALITY AS e(at, error, n)
 WHERE o.id = $1
 ORDER BY e.n";

/// Failed: available again after a backoff, or parked, if still under this relay's
/// lease. $1 seq, $2 the error, $3 the backoff in seconds, $4 whether to park it, $5
/// whether to give back the attempt the take counted (the destination was unavailable:
/// invariant 10), $6 the lease's token. The backoff is no lease: no owner. The give-back
/// is conditional on the token like the rest of the mark: only the take that counted the
/// attempt gives it back, once.
const FAILED: &str = "\
UPDATE {table}
   SET last_error = $2,
       error_at = (coalesce(error_at, ARRAY[]::timestamptz[]) || now())
                  [greatest(cardinality(error_at) - 8, 1):],
       errors = (coalesce(errors, ARRAY[]::text[]) || $2::text)[greatest(cardinality(errors) - 8, 1):],
       available_at = now() + $3::float8 * interval '1 second',
       dead_at = CASE WHEN $4 THEN now() END,
       attempts = CASE WHEN $5 THEN greatest(attempts - 1, 0) ELSE attempts END,
       lease_owner = NULL
 WHERE seq = $1 AND lease_token = $6";

/// The age in seconds of the oldest pending event, NULL when none is pending.
const LAG: &str = "\
SELECT extract(epoch FROM now() - created_at)::float8 FROM {table}
 WHERE dead_at IS NULL ORDER BY seq LIMIT 1";

/// Parked events, oldest first. $1 how many.
/// The outbox table of one store: its statements, rendered once.
pub(crate) struct OutboxTable {
    dialect: Dialect,
    notify: bool,
    /// Which of this store's commits carry the NOTIFY: at most one per interval.
    wake: WakeGate,
    /// The table as written in SQL, for the operators' statements ([`crate::operate`]).
    qualified: String,
    channel: String,
    ddl: SqlStr,
    write: SqlStr,
    write_quiet: SqlStr,
    ride: String,
    ride_notify: String,
    claim: SqlStr,
    lock: SqlStr,
    done: SqlStr,
    release: SqlStr,
    failed: SqlStr,
    errors: SqlStr,
    relays: SqlStr,
    lag: SqlStr,
}

/// What becomes of an event whose publish failed ([`OutboxTable::failed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failed {
    /// Available again after its backoff; the attempt counts.
    Retry,
    /// Available again after its backoff; the attempt is given back (the destination was
    /// unavailable, invariant 10).
    Uncounted,
    /// Parked.
    Park,
}

/// An event as the relay took it from the table.
#[derive(Debug, Clone)]
pub(crate) struct ClaimedRow {
    pub(crate) seq: i64,
    pub(crate) id: String,
    pub(crate) topic: String,
    pub(crate) ordering_key: Option<String>,
    pub(crate) headers: Vec<u8>,
    pub(crate) payload: Vec<u8>,
    pub(crate) attempts: i32,
    pub(crate) age: Duration,
    /// Whether its lease ends with the taking relay's session (else by its time only).
    pub(crate) tied: bool,
    /// The row of its ordering key it was taken behind, in the same take ([`CLAIM_TIED`]'s
    /// `chain`); `None` for a head and an event without a key.
    pub(crate) prev: Option<i64>,
}

/// Where a take's walks stopped ([`CLAIM_TIED`]); the next take starts there. `None`:
/// from the first (the walk went past the last, or the take does not walk).
#[derive(Debug, Default)]
pub(crate) struct Walk {
    /// The ordering key the walk of heads stopped at.
    pub(crate) key: Option<String>,
    /// The `seq` the walk of events without a key stopped at.
    pub(crate) loose: Option<i64>,
}

impl Walk {
    /// Whether both walks start from the first: the last take went all the way round.
    pub(crate) fn round(&self) -> bool {
        self.key.is_none() && self.loose.is_none()
    }
}

/// A parked event, for operators ([`crate::operate::Operate::dead_page`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeadEvent {
    /// The event's id.
    pub id: String,
    /// Where it was to go.
    pub topic: String,
    /// Its ordering key.
    pub ordering_key: Option<String>,
    /// How many times the relay tried it.
    pub attempts: i32,
    /// The last failure, as the publisher reported it.
    pub last_error: String,
    /// How long it has been parked.
    pub dead_for: Duration,
    /// How long ago it was written (its `created_at`), by the database's clock: what the
    /// re-drive window counts ([`DeadEvent::outside_window`]).
    pub age: Duration,
}

impl DeadEvent {
    /// Whether it is outside a re-drive window of `max_age`
    /// ([`Operate::redrive_max_age`](crate::operate::Operate::redrive_max_age)): written at least
    /// `max_age` ago, so that a re-drive of it that is not forced is refused. As of when
    /// it was listed: a re-drive checks again.
    pub fn outside_window(&self, max_age: Duration) -> bool {
        self.age >= max_age
    }

    /// A row with the columns of that name, `dead_for` and `age` in seconds.
    pub(crate) fn from_row(row: &PgRow) -> Result<Self, sqlx::Error> {
        let seconds = |column: &str| -> Result<Duration, sqlx::Error> {
            Ok(Duration::from_secs_f64(
                row.try_get::<f64, _>(column)?.max(0.0),
            ))
        };
        Ok(Self {
            id: row.try_get("id")?,
            topic: row.try_get("topic")?,
            ordering_key: row.try_get("ordering_key")?,
            attempts: row.try_get("attempts")?,
            last_error: row.try_get("last_error")?,
            dead_for: seconds("dead_for")?,
            age: seconds("age")?,
        })
    }
}

impl OutboxTable {
    /// The table `name` in `dialect`; its writes NOTIFY the relays when `notify` (never in
    /// portable mode), at most once per `notify_every`.
    pub(crate) fn new(
        name: TableName,
        dialect: Dialect,
        notify: bool,
        notify_every: Duration,
    ) -> Self {
        let notify = notify && !dialect.portable;
        let table = name.qualified();
        let channel = channel(&name);
        let lock_class = lock_class(&name);
        let render = |sql: &str| {
            statement(
                sql.replace("{ready_e}", &READY.replace("{row}", "e"))
                    .replace("{ready_o}", &READY.replace("{row}", "o"))
                    .replace("{table}", &table)
                    .replace("{channel}", &channel)
                    .replace("{lock_class}", &lock_class.to_string()),
            )
        };
        let create_schema = name.create_schema();
        let ddl = statement(
            DDL.replace("{create_schema}", &create_schema)
                .replace("{table}", &table)
                .replace("{name}", name.name()),
        );
        Self {
            dialect,
            notify,
            wake: WakeGate::new(notify_every),
            ddl,
            write: render(if notify { WRITE } else { WRITE_QUIET }),
            write_quiet: render(WRITE_QUIET),
            ride: RIDE.replace("{table}", &table),
            ride_notify: RIDE_NOTIFY.replace("{channel}", &channel),
            claim: render(if dialect.portable { CLAIM } else { CLAIM_TIED }),
            lock: render(LOCK),
            done: render(DONE),
            release: render(RELEASE),
            failed: render(FAILED),
            errors: render(ERRORS),
            relays: render(RELAYS),
            lag: render(LAG),
            channel,
            qualified: table,
        }
    }

    /// The table as written in SQL (`"schema"."name"`).
    pub(crate) fn qualified(&self) -> &str {
        &self.qualified
    }

    /// The channel its writes notify and relays listen on.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// Whether a relay's leases can end with its session: outside the portable mode (see
    /// the module's docs).
    pub(crate) fn can_tie(&self) -> bool {
        !self.dialect.portable
    }

    /// The DDL.
    pub(crate) fn ddl(&self) -> &SqlStr {
        &self.ddl
    }

    /// Whether writes notify the relays.
    pub(crate) fn notifies(&self) -> bool {
        self.notify
    }

    /// Whether a relay can `LISTEN`: not behind a transaction pooler, nor in portable
    /// mode, whose writes do not notify.
    pub(crate) fn can_listen(&self) -> bool {
        self.notifies() && self.dialect.pooler == Pooler::Session
    }

    fn query(&self, sql: &SqlStr) -> Query<'static, Postgres, PgArguments> {
        sqlx::query(sql.clone()).persistent(self.dialect.pooler == Pooler::Session)
    }

    /// [`WRITE`]: the new event's id.
    pub(crate) async fn write(
        &self,
        conn: &mut PgConnection,
        attempt: Option<&[u8]>,
        topic: &str,
        ordering_key: Option<&str>,
        headers: &[u8],
        payload: &[u8],
    ) -> Result<String, sqlx::Error> {
        let sql = if self.wakes() {
            &self.write
        } else {
            &self.write_quiet
        };
        let row = self
            .query(sql)
            .bind(attempt)
            .bind(topic)
            .bind(ordering_key)
            .bind((!headers.is_empty()).then_some(headers))
            .bind(payload)
            .fetch_one(conn)
            .await?;
        row.try_get("id")
    }

    /// [`RIDE`], written for the request's COMMIT message; [`OutboxTable::wake`] says
    /// whether that message also wakes the relays.
    ///
    /// Executed by name where the store prepares [`Self::prepared_ride`] with its claim
    /// (the default mode: an event rides only a message whose claim ran on the same
    /// connection, which prepared the set).
    pub(crate) fn riding(
        &self,
        prepared: Option<&Prepared>,
        id: &str,
        topic: &str,
        ordering_key: Option<&str>,
        headers: &[u8],
        payload: &[u8],
    ) -> String {
        let values = [
            Literal::Text(id),
            Literal::Text(topic),
            ordering_key.map_or(Literal::Null, Literal::Text),
            if headers.is_empty() {
                Literal::Null
            } else {
                Literal::Bytes(headers)
            },
            Literal::Bytes(payload),
        ];
        literal::executed(prepared, RIDE_ROLE, &values)
            .unwrap_or_else(|| literal::render(&self.ride, &values))
    }

    /// [`RIDE`] as the store prepares it with its claim: role, parameter types, text.
    pub(crate) fn prepared_ride(&self) -> (&'static str, &'static str, &str) {
        (RIDE_ROLE, "text, text, text, bytea, bytea", &self.ride)
    }

    /// Whether this commit (or write) of an event is the one that wakes the relays: writes
    /// notify, and no other of this store's did within its interval.
    fn wakes(&self) -> bool {
        self.notify && self.wake.open()
    }

    /// [`RIDE_NOTIFY`], for a COMMIT message that carries events, when it is the one that
    /// wakes the relays ([`WakeGate`]). Asked as the message is written, so that the
    /// commits it lets go without a NOTIFY follow it closely (a relay it woke lingers,
    /// [`crate::outbox::RelayBuilder::linger`]).
    pub(crate) fn wake(&self) -> Option<&str> {
        self.wakes().then_some(self.ride_notify.as_str())
    }

    /// [`CLAIM`] (or [`CLAIM_TIED`]), in a short transaction of its own: the rows taken
    /// under `token`, leased to `owner` while its session lock is held. The walks start
    /// where `walk` says the previous take's stopped, and leave in it where they stopped;
    /// each looks at no more than four times `limit` rows.
    pub(crate) async fn claim(
        &self,
        single: Single,
        limit: i64,
        lease: Duration,
        token: i64,
        owner: Option<i32>,
        walk: &mut Walk,
    ) -> Result<Vec<ClaimedRow>, sqlx::Error> {
        let mut single = single;
        let mut query = self
            .query(&self.claim)
            .bind(limit)
            .bind(lease.as_secs_f64())
            .bind(token);
        if self.can_tie() {
            query = query
                .bind(owner)
                .bind(walk.key.clone())
                .bind(limit.saturating_mul(4).max(64))
                .bind(walk.loose);
        }
        let rows = query.fetch_all(&mut *single).await?;
        single.finish().await?;
        *walk = Walk::default();
        let mut claimed = Vec::with_capacity(rows.len());
        for row in &rows {
            if row.try_get::<Option<i64>, _>("seq")?.is_some() {
                claimed.push(decode_claimed(row)?);
            } else {
                let ended = |column| {
                    row.try_get::<Option<bool>, _>(column)
                        .map(|e| e.unwrap_or(true))
                };
                if !ended("ended")? {
                    walk.key = row.try_get("walked")?;
                }
                if !ended("loose_ended")? {
                    walk.loose = row.try_get("loose_walked")?;
                }
            }
        }
        Ok(claimed)
    }

    /// [`LOCK`] on `conn`, a connection of the relay's own that runs nothing else: whether
    /// it now holds the lock of `owner`.
    pub(crate) async fn lock(
        &self,
        conn: &mut PgConnection,
        owner: i32,
    ) -> Result<bool, sqlx::Error> {
        sqlx::query(self.lock.clone())
            .bind(owner)
            .fetch_one(conn)
            .await?
            .try_get(0)
    }

    /// [`DONE`]: how many of the rows were still this relay's to delete.
    pub(crate) async fn done(
        &self,
        single: Single,
        seqs: &[i64],
        token: i64,
    ) -> Result<u64, sqlx::Error> {
        self.mark_rows(&self.done, single, seqs, token).await
    }

    /// [`RELEASE`]: how many of the rows were still this relay's to give back.
    pub(crate) async fn release(
        &self,
        single: Single,
        seqs: &[i64],
        token: i64,
    ) -> Result<u64, sqlx::Error> {
        self.mark_rows(&self.release, single, seqs, token).await
    }

    /// `sql` ([`DONE`] or [`RELEASE`]) over the rows `seqs` still under `token`: how many
    /// it marked.
    async fn mark_rows(
        &self,
        sql: &SqlStr,
        single: Single,
        seqs: &[i64],
        token: i64,
    ) -> Result<u64, sqlx::Error> {
        let mut single = single;
        let marked = self
            .query(sql)
            .bind(seqs)
            .bind(token)
            .execute(&mut *single)
            .await?;
        single.finish().await?;
        Ok(marked.rows_affected())
    }

    /// [`FAILED`]: whether the row was still this relay's to mark.
    pub(crate) async fn failed(
        &self,
        single: Single,
        seq: i64,
        error: &str,
        backoff: Duration,
        then: Failed,
        token: i64,
    ) -> Result<bool, sqlx::Error> {
        let mut single = single;
        let marked = self
            .query(&self.failed)
            .bind(seq)
            .bind(error)
            .bind(backoff.as_secs_f64())
            .bind(then == Failed::Park)
            .bind(then == Failed::Uncounted)
            .bind(token)
            .execute(&mut *single)
            .await?;
        single.finish().await?;
        Ok(marked.rows_affected() > 0)
    }

    /// [`ERRORS`]: the failed publishes of the event `id`, oldest first, as (seconds since
    /// the epoch, error).
    pub(crate) async fn errors(
        &self,
        single: Single,
        id: &str,
    ) -> Result<Vec<(f64, String)>, sqlx::Error> {
        let mut single = single;
        let rows = self
            .query(&self.errors)
            .bind(id)
            .fetch_all(&mut *single)
            .await?;
        single.finish().await?;
        rows.iter()
            .map(|row| Ok((row.try_get("at")?, row.try_get("error")?)))
            .collect()
    }

    /// [`RELAYS`], as (owner, application name, client address, seconds since the epoch
    /// of the session's start, if the role may see it). Only where leases are tied to
    /// sessions ([`OutboxTable::can_tie`]).
    pub(crate) async fn relays(
        &self,
        single: Single,
    ) -> Result<Vec<(i64, String, Option<String>, Option<f64>)>, sqlx::Error> {
        let mut single = single;
        let rows = self.query(&self.relays).fetch_all(&mut *single).await?;
        single.finish().await?;
        rows.iter()
            .map(|row| {
                Ok((
                    row.try_get("owner")?,
                    row.try_get::<Option<String>, _>("application_name")?
                        .unwrap_or_default(),
                    row.try_get("client_addr")?,
                    row.try_get("since")?,
                ))
            })
            .collect()
    }

    /// [`LAG`].
    pub(crate) async fn lag(&self, single: Single) -> Result<Option<Duration>, sqlx::Error> {
        let mut single = single;
        let age: Option<f64> = self
            .query(&self.lag)
            .fetch_optional(&mut *single)
            .await?
            .map(|row| row.try_get(0))
            .transpose()?;
        single.finish().await?;
        Ok(age.map(|s| Duration::from_secs_f64(s.max(0.0))))
    }

    /// Creates the table (see [`crate::table::create`]).
    pub(crate) async fn create(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        crate::table::create(pool, &self.ddl).await
    }
}

/// At most one NOTIFY per interval from one store (issue 28). PostgreSQL serializes the
/// commits of the transactions that sent a NOTIFY (one lock on the database, held through
/// the commit's WAL flush), so a NOTIFY per event made concurrent emitting requests
/// commit one at a time. One commit per interval carries it; the commits the gate lets go
/// without one follow it within the interval (and their own commit's time), and a relay
/// it woke keeps looking for that long ([`crate::outbox::RelayBuilder::linger`]). An
/// event no relay saw that way is taken at the next poll: later, never lost.
pub(crate) struct WakeGate {
    every: Duration,
    origin: Instant,
    /// When the last NOTIFY was let through, in nanoseconds after `origin` (at least 1);
    /// 0 for never.
    last: AtomicU64,
}

impl WakeGate {
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            origin: Instant::now(),
            last: AtomicU64::new(0),
        }
    }

    /// Whether this NOTIFY goes: the first, and then one per interval. Two callers at the
    /// same moment do not both get it.
    pub(crate) fn open(&self) -> bool {
        if self.every.is_zero() {
            return true;
        }
        let now = u64::try_from(self.origin.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .max(1);
        let last = self.last.load(Ordering::Relaxed);
        let every = u64::try_from(self.every.as_nanos()).unwrap_or(u64::MAX);
        if last != 0 && now.saturating_sub(last) < every {
            return false;
        }
        self.last
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

/// What identifies the events of one writing attempt, before their place among its
/// events: `idem.event.v1`, the key's scope, principal and key, and the event's topic,
/// each length-prefixed. [`attempt_hash`] finishes it for one place; `Tx::emit` and the
/// operators' links from an event to its request both derive ids so.
pub(crate) fn attempt_prefix(scope: &str, principal: &str, key: &str, topic: &str) -> Sha256 {
    let mut hasher = Sha256::new();
    for part in ["idem.event.v1", scope, principal, key, topic] {
        length_prefixed(&mut hasher, part);
    }
    hasher
}

/// The hash of the attempt whose [`attempt_prefix`] is `prefix`, for its event at `place`
/// (0 for its first event): what [`event_id`] takes.
pub(crate) fn attempt_hash(prefix: &Sha256, place: u32) -> Vec<u8> {
    let mut hasher = prefix.clone();
    length_prefixed(&mut hasher, &place.to_string());
    hasher.finalize().to_vec()
}

fn length_prefixed(hasher: &mut Sha256, part: &str) {
    hasher.update((part.len() as u64).to_be_bytes());
    hasher.update(part.as_bytes());
}

/// The id [`WRITE`] gives an event of `attempt` (its hash) in a transaction that began
/// at `began` (`extract(epoch FROM now())::float8`): 32 hex digits of a SHA-256.
pub(crate) fn event_id(attempt: &[u8], began: f64) -> String {
    let mut hasher = Sha256::new();
    hasher.update(attempt);
    hasher.update(began.to_bits().to_be_bytes());
    let mut id = crate::fingerprint::hex(&hasher.finalize());
    id.truncate(32);
    id
}

fn decode_claimed(row: &PgRow) -> Result<ClaimedRow, sqlx::Error> {
    Ok(ClaimedRow {
        seq: row.try_get("seq")?,
        id: row.try_get("id")?,
        topic: row.try_get("topic")?,
        ordering_key: row.try_get("ordering_key")?,
        headers: row
            .try_get::<Option<Vec<u8>>, _>("headers")?
            .unwrap_or_default(),
        payload: row.try_get("payload")?,
        attempts: row.try_get("attempts")?,
        age: Duration::from_secs_f64(row.try_get::<f64, _>("age")?.max(0.0)),
        tied: row.try_get("tied")?,
        prev: row.try_get("prev")?,
    })
}

/// The NOTIFY channel of the outbox `name`: the name as written (`schema.name`) when it
/// fits a PostgreSQL identifier (63 bytes; `pg_notify` refuses a longer channel, and
/// every write with it), else `idem_outbox_` and 32 hex digits of the name's SHA-256.
/// Derived from the name alone, so every instance of a service writes and listens on the
/// same one.
fn channel(name: &TableName) -> String {
    let written = name.to_string();
    if written.len() <= 63 {
        return written;
    }
    let digest = Sha256::digest(written.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("idem_outbox_{hex}")
}

/// The first key of the relays' session locks on the outbox `name`: 31 bits of the
/// SHA-256 of its name, positive so that `pg_locks.classid` (an `oid`) reads it back as
/// the same number.
fn lock_class(name: &TableName) -> i32 {
    let digest = Sha256::digest(format!("idem.relay.v1 {name}").as_bytes());
    i32::from_be_bytes([digest[0] & 0x7f, digest[1], digest[2], digest[3]])
}

#[cfg(test)]
mod tests;

/// Invariant 13, gated by counting work: the buffers the relay's take reads, at a small
/// and at a large backlog, on a real PostgreSQL (`DATABASE_URL`). Buffers, not time: a
/// slower machine reads the same. Each test has a schema of its own.
#[cfg(test)]
mod cost;

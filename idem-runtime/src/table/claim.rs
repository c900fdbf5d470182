//! What a request reads and writes in the key table: the claim (the lock and the row
//! in the default mode and behind a pooler, the row itself in the portable mode), the
//! waits, and the key row's insert or update that rides COMMIT, with the rows they
//! read back.

use super::*;

/// The claim of the default mode (and behind a transaction pooler), first statement: tries
/// the key's lock ([`Table::lock_id`], a transaction-scoped advisory lock: released by
/// COMMIT, ROLLBACK, a crash or a dropped connection, like an uncommitted row), and reads
/// what the request needs of its session. It writes nothing: the key's row is written
/// once, complete, by [`INSERT`] just before COMMIT.
///
/// The lock is tried before the key's row is read, by a statement of its own: a
/// statement reads in a snapshot taken when it starts, and one that read the row first
/// and then took the lock would miss a duplicate that committed (and let go of the lock)
/// in between, and run the work again beside its record. Holding the lock first,
/// [`TAKE`]'s new snapshot (READ COMMITTED, invariant 4) sees what any earlier holder
/// committed.
///
/// $1 the lock, $2 the request's statement timeout (NULL: the session's own), which stays
/// set for the rest of the transaction: it bounds [`TAKE`] and the handler's statements.
/// `began_us` is the transaction's start (`now()`, in microseconds since the epoch), which
/// [`INSERT`] checks; `statement_timeout` the one the session had, which a [`WAIT`] gives
/// back.
///
/// Invariant 12: the statement rides BEGIN, so its row comes back as text, in the formats
/// of the session: the start is an integer (a float's text depends on
/// `extra_float_digits`: rounded, it no longer matched [`INSERT`]'s check, and every
/// keyed request on the connection failed). `search_path` is the session's, which
/// resolves the store's tables where they are named without their schema
/// ([`Table::pinned_path`]).
pub(super) const TRY: &str = "\
SELECT pg_try_advisory_xact_lock($1) AS locked,
       (extract(epoch FROM now()) * 1000000)::bigint AS began_us,
       current_setting('statement_timeout') AS statement_timeout,
       current_setting('search_path') AS search_path,
       CASE WHEN current_setting('in_hot_standby', true) = 'on' THEN 'standby'
            ELSE current_setting('transaction_read_only') END AS read_only,
       CASE WHEN $2::text IS NOT NULL THEN set_config('statement_timeout', $2, true) END AS bounded";

/// The claim's read: the key's committed row, if any, in a snapshot taken after [`TRY`]
/// (and, after a [`WAIT`], after the lock was held). One index probe; no row for a fresh
/// key. Its bytea columns come back as hex (`encode`, whatever `bytea_output`: invariant
/// 12).
///
/// $1..$3 the key.
pub(super) const TAKE: &str = "\
SELECT encode(fingerprint, 'hex') AS fingerprint, encode(field_hashes, 'hex') AS field_hashes,
       status, encode(headers, 'hex') AS headers, encode(body, 'hex') AS body,
       expires_at <= now() AS expired
  FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3";

/// The prepared [`TRY`]'s and [`TAKE`]'s roles in their set ([`Prepared`]) and their
/// parameters' types.
pub(super) const TRY_ROLE: &str = "try";

pub(super) const TRY_TYPES: &str = "bigint, text";

pub(super) const TAKE_ROLE: &str = "take";

pub(super) const TAKE_TYPES: &str = "text, text, text";

/// The prepared [`INSERT`]'s and [`OVERWRITE`]'s roles (the latter with the check of
/// [`checked_overwrite`]) and their parameters' types.
pub(super) const INSERT_ROLE: &str = "insert";

pub(super) const OVERWRITE_ROLE: &str = "overwrite";

pub(super) const INSERT_TYPES: &str =
    "text, text, text, bytea, bytea, smallint, bytea, bytea, float8, float8";

/// Waits for the key's lock for at most the claim's wait (`concurrency = wait(..)`),
/// then gives the session's `lock_timeout` back, and the statement timeout lifted for the
/// wait ([`Table::wait`]). The settings are read and set in the first CTE, which the lock's
/// CTE depends on, and restored in the result, computed after both: the handler never
/// inherits the wait. 55P03 when the wait expires.
///
/// $1 the lock, $2 the wait, $3 the statement timeout to give back (the request's, else
/// `statement_timeout` of [`TRY`]).
pub(super) const WAIT: &str = "\
WITH wait AS MATERIALIZED (
    SELECT current_setting('lock_timeout') AS saved, set_config('lock_timeout', $2, true) AS waits
), held AS MATERIALIZED (
    SELECT pg_advisory_xact_lock($1) IS NULL AS held FROM wait WHERE waits IS NOT NULL
)
SELECT set_config('lock_timeout', wait.saved, true) AS restored,
       set_config('statement_timeout', $3, true) AS bounded
  FROM wait, held";

/// The key's row, written once and complete, in the transaction that holds its lock,
/// just before COMMIT. `now()` is the transaction's start: if the handler ran a raw
/// COMMIT or ROLLBACK, this runs in another transaction, and its check fails with
/// [`ESCAPED`] in the message (22P02: text that no integer reads, cast to one), so that
/// PostgreSQL skips the rest of the message and the escape is caught instead of stored
/// (invariant 6). A unique violation of the primary key means another attempt committed
/// the key first (invariant 3). One node: no CTE, no aggregate (the claim's cost is the
/// floor's, issue 36).
///
/// The check casts the CASE, not its branches: PostgreSQL folds a cast of a constant
/// when it plans the statement, whatever branch it stands in.
///
/// The record's lifetime counts from here, just before COMMIT, not from the claim: a
/// handler that runs longer than its ttl must not commit a record that is already
/// expired, which the next retry would run again.
///
/// $1..$3 the key, $4 fingerprint, $5 field hashes, $6 status, $7 headers, $8 body,
/// $9 ttl in seconds, $10 `began` from [`TRY`].
pub(super) const INSERT: &str = "\
INSERT INTO {table} (scope, principal, key, fingerprint, field_hashes, status, headers, body,
                     created_at, expires_at)
SELECT $1, {p2}, $3, $4, $5, $6, $7, $8, now(),
       statement_timestamp() + $9::float8 * interval '1 second'
 WHERE CAST(CASE WHEN extract(epoch FROM now())::float8 = $10 THEN '1' ELSE '{escaped}' END
            AS integer) = 1";

/// [`INSERT`] over an expired row (or a row without a response, which only a handler
/// that ended its transaction itself could commit, in an earlier version): the claim
/// saw it and holds the key's lock. If the row turned live meanwhile (an attempt that
/// took no lock: an instance of an earlier version during a rolling upgrade), it is
/// left alone and nothing is written: that attempt won. A sweeper deleting the row
/// is waited for. Binds as [`INSERT`].
pub(super) const OVERWRITE: &str = "\
INSERT INTO {table} AS k (scope, principal, key, fingerprint, field_hashes, status, headers, body,
                          created_at, expires_at)
SELECT $1, {p2}, $3, $4, $5, $6, $7, $8, now(),
       statement_timestamp() + $9::float8 * interval '1 second'
 WHERE extract(epoch FROM now())::float8 = $10
ON CONFLICT (scope, principal, key) DO UPDATE
   SET fingerprint = excluded.fingerprint, field_hashes = excluded.field_hashes,
       status = excluded.status, headers = excluded.headers, body = excluded.body,
       created_at = excluded.created_at, expires_at = excluded.expires_at
 WHERE k.expires_at <= now() OR k.status IS NULL";

/// The status of a key's row while its request is being abandoned ([`crate::complete`]):
/// no HTTP status, so that no answer is ever replayed from it. An abandon commits it
/// under the key before its first undo runs (invariant 14), and from then on every claim
/// of the key is refused ([`crate::engine::Refusal::Abandoning`]: 409) until the
/// abandon's last undo commits the key's 410 over it ([`ABANDONED`]).
pub(crate) const ABANDONING: u16 = 0;

/// Holds a key being abandoned, for its undos: a lock on its row, which must still be the
/// abandoning marker. One row or none; single-shard on a distributed engine. $1..$3 the
/// key.
pub(super) const HOLD_ABANDONING: &str = "\
SELECT 1 AS held FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND status = 0
   FOR UPDATE";

/// The abandon's answer over the marker, in its COMMIT message: the row is held
/// ([`HOLD_ABANDONING`]), so it is the marker still; when it is not (the transaction
/// was lost), a statement between this and COMMIT fails with [`ESCAPED`]. $1..$3 the
/// key, $4 status, $5 headers, $6 body.
pub(super) const ABANDONED: &str = "\
UPDATE {table} SET status = $4, headers = $5, body = $6
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND status = 0";

/// What [`Table::inserting_commit`] raises when another attempt's record holds the key,
/// and when the handler ended the transaction itself: text that no integer reads, cast to
/// one (22P02), so that the message names it.
pub(crate) const LOST: &str = "idem: lost to another attempt";

pub(crate) const ESCAPED: &str = "idem: the handler ended its transaction";

/// Portable mode: the response, stored in the row the claim inserted. `created_at =
/// now()` holds only inside the transaction that claimed the row (`now()` is the
/// transaction's start time): if the handler ran a raw COMMIT or ROLLBACK, this matches
/// nothing and the escape is caught instead of stored.
///
/// The record's lifetime counts from here, just before COMMIT, not from the claim: a
/// handler that runs longer than its ttl must not commit a record that is already
/// expired, which the next retry would run again. (`statement_timestamp()` is stable,
/// so a distributed engine evaluates it once, as it does `now()`.)
///
/// $1..$3 the key, $4 status, $5 headers, $6 body, $7 ttl in seconds.
pub(super) const STORE: &str = "\
UPDATE {table}
   SET status = $4, headers = $5, body = $6,
       expires_at = statement_timestamp() + $7::float8 * interval '1 second'
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND status IS NULL AND created_at = now()";

/// Portable mode: whether the committed row of a key is expired, read without waiting
/// for locks: tells a sweeper's (or a reclaim's) lock on an expired row from a
/// request's on a live one.
pub(super) const EXPIRED: &str = "\
SELECT expires_at <= now() FROM {table} WHERE scope = $1 AND principal = {p2} AND key = $3";

/// Portable mode: removes a claim that committed without its response (a handler's raw
/// COMMIT).
pub(super) const FORGET: &str = "\
DELETE FROM {table} WHERE scope = $1 AND principal = {p2} AND key = $3 AND status IS NULL";

/// Whether a scope ($1) has a live record under the nobody value ($2, bound `""`), where
/// earlier versions and configurations kept keys without a principal
/// ([`crate::spread`]). The primary key's prefix (scope, principal) finds them; on a
/// distributed engine, in one shard.
pub(super) const EARLIER_LIVE: &str = "\
SELECT EXISTS (SELECT 1 FROM {table}
                WHERE scope = $1 AND principal = {p2} AND expires_at > now())";

/// Whether a spread place has a live record: $1 its stored scope
/// ([`crate::identity::stored_scope`]), the primary key's prefix.
pub(super) const SPREAD_LIVE: &str = "\
SELECT EXISTS (SELECT 1 FROM {table} WHERE scope = $1 AND expires_at > now())";

/// The claim of portable mode: one statement that inserts the key's row (its response
/// still NULL), or returns the stored row. A distributed engine has no cluster-wide
/// advisory lock, so the uncommitted row is the key's lock here: a duplicate's insert
/// waits for it, and `lock_timeout` (set by `SET LOCAL` before, [`Table::begin_waiting`])
/// turns the wait into 55P03. `ON CONFLICT DO NOTHING` takes no lock on a live row, so
/// concurrent replays do not serialize. When the conflicting row was committed after
/// this statement's snapshot began (it waited for it), neither branch returns a row and
/// [`READ_PORTABLE`] follows. It reads and writes no setting.
///
/// $1..$3 the key, $4 fingerprint, $5 field hashes, $6 ttl in seconds.
pub(super) const CLAIM_PORTABLE: &str = "\
WITH claimed AS (
    INSERT INTO {table} (scope, principal, key, fingerprint, field_hashes, expires_at)
    VALUES ($1, {p2}, $3, $4, $5, now() + $6::float8 * interval '1 second')
    ON CONFLICT (scope, principal, key) DO NOTHING
    RETURNING 1
)
SELECT true AS fresh, NULL::bytea AS fingerprint, NULL::bytea AS field_hashes,
       NULL::smallint AS status, NULL::bytea AS headers, NULL::bytea AS body,
       false AS expired
  FROM claimed
UNION ALL
SELECT false, fingerprint, field_hashes, status, headers, body, expires_at <= now()
  FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND NOT EXISTS (SELECT 1 FROM claimed)";

/// [`CLAIM_PORTABLE`] written whole, for a simple-query message of its own that also
/// declares idem's guard ([`Table::claim_guarded`]): its bytea columns as hex (`encode`,
/// whatever `bytea_output`: invariant 12).
pub(super) const CLAIM_PORTABLE_TEXT: &str = "\
WITH claimed AS (
    INSERT INTO {table} (scope, principal, key, fingerprint, field_hashes, expires_at)
    VALUES ($1, {p2}, $3, $4, $5, now() + $6::float8 * interval '1 second')
    ON CONFLICT (scope, principal, key) DO NOTHING
    RETURNING 1
)
SELECT true AS fresh, NULL::text AS fingerprint, NULL::text AS field_hashes,
       NULL::smallint AS status, NULL::text AS headers, NULL::text AS body,
       false AS expired
  FROM claimed
UNION ALL
SELECT false, encode(fingerprint, 'hex'), encode(field_hashes, 'hex'), status,
       encode(headers, 'hex'), encode(body, 'hex'), expires_at <= now()
  FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND NOT EXISTS (SELECT 1 FROM claimed)";

/// Portable mode: the row a claim waited for, read by a new statement, which sees it
/// committed.
pub(super) const READ_PORTABLE: &str = "\
SELECT false AS fresh, fingerprint, field_hashes, status, headers, body,
       expires_at <= now() AS expired
  FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3";

/// Portable mode: an expired row is taken over in place. A committed row with no status
/// can only be left by a handler that ended the transaction itself; it is taken over
/// too, so that key is never stuck. It waits like the claim does. Binds as
/// [`CLAIM_PORTABLE`].
pub(super) const RECLAIM_PORTABLE: &str = "\
UPDATE {table}
   SET fingerprint = $4, field_hashes = $5, status = NULL, headers = NULL, body = NULL,
       created_at = now(), expires_at = now() + $6::float8 * interval '1 second'
 WHERE scope = $1 AND principal = {p2} AND key = $3
   AND (expires_at <= now() OR status IS NULL)
RETURNING 1";

/// What a claim found.
pub(crate) enum Found {
    /// The row was inserted: this transaction holds the key.
    Claimed,
    /// A row exists.
    Stored(StoredRow),
}

/// Why a claim's session cannot take fresh work ([`Table::writable`]).
pub(crate) enum Unwritable {
    /// A standby: the database unavailable for writes, for now.
    Standby(sqlx::Error),
    /// A read-only setting.
    ReadOnly(sqlx::Error),
}

/// What [`TRY`] found.
pub(crate) struct Tried {
    /// The transaction's start, as [`INSERT`] checks it.
    pub(crate) began: f64,
    /// Whether this transaction holds the key's lock.
    pub(crate) locked: bool,
    /// The statement timeout the session had, which [`WAIT`] gives back when the request
    /// has none of its own.
    pub(crate) statement_timeout: String,
    /// The session's `search_path` ([`Table::pinned_path`]).
    pub(crate) search_path: String,
    /// `on` where the transaction is read-only, `standby` on a standby, else `off`
    /// ([`Table::writable`]).
    pub(crate) access: String,
}

/// A held key, as [`Table::insert`] writes its row.
pub(crate) struct Inserting<'a> {
    pub(crate) key: &'a KeyInScope,
    pub(crate) fingerprint: &'a Fingerprint,
    pub(crate) ttl: Duration,
    /// `began` from [`TRY`].
    pub(crate) began: f64,
    /// Whether the claim saw a row to write over (expired, or without a response).
    pub(crate) over: bool,
}

/// A row of the table as the claim reads it.
pub(crate) struct StoredRow {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) field_hashes: Vec<u8>,
    /// `None` only for a row whose transaction ended without storing a response.
    pub(crate) status: Option<i16>,
    pub(crate) headers: Option<Vec<u8>>,
    pub(crate) body: Option<Vec<u8>>,
    pub(crate) expired: bool,
}

impl StoredRow {
    /// Whether the row is a live record: a response, not expired. Replayed without the
    /// key's lock.
    pub(crate) fn live(&self) -> bool {
        self.status.is_some() && !self.expired
    }
}

/// What is stored with a key: the answer's status, its allow-listed headers (one
/// `name: value` per line) and its body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) status: u16,
    pub(crate) headers: Vec<u8>,
    pub(crate) body: Bytes,
}

impl Table {
    /// Invariant 12 for tables named without their schema: the session's `search_path`
    /// resolves them, and a handler may change it (`SET LOCAL search_path = tenant2`, or
    /// session-wide on its connection). So the store pins the path of its first claim:
    /// each claim's `path` must be that one (a claim under another is refused, rolled
    /// back, with one line that names the setting: its key row would land in another
    /// table). What the handler sets after the claim changes nothing: the statements a
    /// connection prepared name their tables with their schemas ([`Prepared`]), and
    /// where they are written whole, the key row's COMMIT message sets the path again
    /// before them ([`Table::inserting_commit`]).
    pub(crate) fn pinned_path(&self, path: &str) -> Result<(), sqlx::Error> {
        let Some(pinned) = &self.path else {
            return Ok(());
        };
        let pinned = pinned.get_or_init(|| path.to_owned());
        if pinned == path {
            return Ok(());
        }
        Err(sqlx::Error::Configuration(
            format!(
                "idem: this connection's search_path is {path:?}, not {pinned:?} as at the \
                 store's first claim, and the store's tables are named without their schema \
                 (here {}): they would resolve to other tables, so the request is refused; \
                 name them with their schema (StoreBuilder::table, outbox_table, \
                 steps_table) or leave search_path as it is",
                self.qualified
            )
            .into(),
        ))
    }

    /// Invariant 12 for a read-only session (`default_transaction_read_only` set by the
    /// database, the role, or a handler session-wide on its connection) or a standby
    /// (`access` as the claim read it: `on`, `standby` or `off`): idem could not write the
    /// key's row, so a request that would run its handler is refused before it runs, with
    /// one line that names the setting. (In the default mode and behind a pooler a stored
    /// answer still replays: that writes nothing.) A standby is [`Unwritable::Standby`]:
    /// what a failover leaves for a while, answered as the database unavailable (503,
    /// and not counted against a consumer's deliveries). A standby is known by the
    /// setting `in_hot_standby` (PostgreSQL 14 and later; a function such as
    /// `pg_is_in_recovery()` would leave invariant 5's portable SQL): before 14 it reads
    /// as read-only, a 500.
    pub(crate) fn writable(access: &str) -> Result<(), Unwritable> {
        let why = match access {
            "off" => return Ok(()),
            "standby" => "this connection reaches a standby (in_hot_standby is on)",
            _ => {
                "this connection's transactions are read-only (transaction_read_only is on: \
                 default_transaction_read_only set by the database, the role or a handler's SET)"
            }
        };
        let error = sqlx::Error::Configuration(
            format!(
                "idem: {why}, and idem writes the key's row: the request is refused before its \
                 handler runs"
            )
            .into(),
        );
        Err(if access == "standby" {
            Unwritable::Standby(error)
        } else {
            Unwritable::ReadOnly(error)
        })
    }

    /// A statement whose first three parameters are the key: (scope, principal, key).
    pub(super) fn keyed(
        &self,
        sql: &SqlStr,
        key: &KeyInScope,
    ) -> Query<'static, Postgres, PgArguments> {
        self.query(sql)
            .bind(key.stored_scope().into_owned())
            .bind(self.dialect.principal_type.bound(&key.principal))
            .bind(key.key.as_str())
    }

    /// [`CLAIM_PORTABLE`] and [`RECLAIM_PORTABLE`], bound.
    pub(super) fn claiming(
        &self,
        sql: &SqlStr,
        key: &KeyInScope,
        fingerprint: &Fingerprint,
        ttl: Duration,
    ) -> Query<'static, Postgres, PgArguments> {
        self.keyed(sql, key)
            .bind(fingerprint.combined().as_slice())
            .bind(fingerprint.parts())
            .bind(ttl.as_secs_f64())
    }

    /// The advisory lock that holds `key` in the default mode: the first 8 bytes of a
    /// SHA-256 over the table and the key, so that keys spread over the whole `bigint`
    /// space and two stores' tables never share a lock.
    pub(crate) fn lock_id(&self, key: &KeyInScope) -> i64 {
        let mut hasher = Sha256::new();
        for part in [
            "idem key lock v1",
            &self.qualified,
            &key.stored_scope(),
            self.dialect.principal_type.bound(&key.principal),
            key.key.as_str(),
        ] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        let digest = hasher.finalize();
        let mut first = [0; 8];
        first.copy_from_slice(&digest[..8]);
        i64::from_be_bytes(first)
    }

    /// [`TAKE`] on its own: the key's committed row, read after a [`WAIT`] held the lock.
    pub(crate) async fn take(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
    ) -> Result<Option<StoredRow>, sqlx::Error> {
        let row = self.keyed(&self.take, key).fetch_optional(conn).await?;
        row.as_ref().map(stored).transpose()
    }

    /// `begin`, [`TRY`] and [`TAKE`], in one message ([`crate::literal`]): the
    /// transaction and the claim in one round trip ([`crate::transaction`]). Its rows:
    /// [`TRY`]'s ([`tried`]), then the key's row, if it has one ([`stored`]).
    pub(crate) fn begin_taking(
        &self,
        begin: &str,
        key: &KeyInScope,
        lock: i64,
        statement_timeout: Option<Duration>,
    ) -> String {
        let timeout = statement_timeout.map(lock_timeout);
        let tried = [
            Literal::Int(lock),
            timeout.as_deref().map_or(Literal::Null, Literal::Text),
        ];
        let scope = key.stored_scope();
        let keyed = [
            Literal::Text(&scope),
            Literal::Text(self.dialect.principal_type.bound(&key.principal)),
            Literal::Text(key.key.as_str()),
        ];
        let written = |role: &str, sql: &SqlStr, values: &[Literal<'_>]| {
            literal::executed(self.prepared(), role, values)
                .unwrap_or_else(|| literal::render(sql.as_str(), values))
        };
        format!(
            "{begin};\n{};\n{}",
            written(TRY_ROLE, &self.try_lock, &tried),
            written(TAKE_ROLE, &self.take, &keyed)
        )
    }

    /// [`WAIT`]: holds the key's lock once it is free, waiting at most `wait` (55P03),
    /// then gives the handler `statement_timeout`. The statement timeout is lifted for the
    /// wait by a statement before it, in the same message (PostgreSQL arms a statement's
    /// timeout when the statement starts): the wait is bounded by the endpoint's
    /// conflict wait alone. Were it not, a statement timeout shorter than the wait (the
    /// request's, or the session's, by its role, say) would cancel the wait (57014) and
    /// turn a duplicate into an error instead of a replay or a 409.
    pub(crate) async fn wait(
        &self,
        conn: &mut PgConnection,
        lock: i64,
        wait: Duration,
        statement_timeout: &str,
    ) -> Result<(), sqlx::Error> {
        let wait = lock_timeout(wait);
        let sql = literal::render(
            self.wait.as_str(),
            &[
                Literal::Int(lock),
                Literal::Text(&wait),
                Literal::Text(statement_timeout),
            ],
        );
        // Asserted safe: idem's own statement, its values written by `literal`.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SELECT set_config('statement_timeout', '0', true);\n{sql}"
        )))
        .execute(conn)
        .await
        .map(drop)
    }

    /// [`INSERT`] (or [`OVERWRITE`] over the row the claim saw) and `COMMIT`, in one
    /// message ([`crate::literal`]): the key's row rides the round trip COMMIT needs
    /// anyway. When nothing was written, a statement between the two fails, so that
    /// PostgreSQL skips the COMMIT: with [`LOST`] in its message when this transaction
    /// is still the one that claimed (another attempt's record holds the key, invariant
    /// 3), with [`ESCAPED`] when the handler ended it itself (invariant 6).
    pub(crate) fn inserting_commit(
        &self,
        claim: &Inserting<'_>,
        record: &Record,
        riders: &[String],
    ) -> String {
        let scope = claim.key.stored_scope();
        let parts = claim.fingerprint.parts();
        let values = [
            Literal::Text(&scope),
            Literal::Text(self.dialect.principal_type.bound(&claim.key.principal)),
            Literal::Text(claim.key.key.as_str()),
            Literal::Bytes(claim.fingerprint.combined().as_slice()),
            Literal::Bytes(&parts),
            Literal::Int(i64::from(record.status)),
            Literal::Bytes(&record.headers),
            Literal::Bytes(&record.body),
            Literal::Float(claim.ttl.as_secs_f64()),
            Literal::Float(claim.began),
        ];
        let written = if claim.over {
            literal::executed(self.prepared(), OVERWRITE_ROLE, &values).unwrap_or_else(|| {
                literal::render(&checked_overwrite(self.overwrite.as_str()), &values)
            })
        } else {
            literal::executed(self.prepared(), INSERT_ROLE, &values)
                .unwrap_or_else(|| literal::render(self.insert.as_str(), &values))
        };
        format!("{}{written};\n{}COMMIT", self.path_again(), rides(riders))
    }

    /// What a COMMIT message sends before its statements, so that they name the tables
    /// the claim read: where the statements are prepared, each connection prepared them
    /// with their tables' schemas resolved ([`Prepared`]), and what the handler did to
    /// `search_path` since changes nothing they name (nothing is sent). Written whole,
    /// they resolve their names when they run: the path they were pinned to is set first.
    pub(super) fn path_again(&self) -> String {
        match (&self.prepared, &self.path) {
            (None, Some(path)) => path.get().map_or_else(String::new, |path| {
                literal::render(
                    "SELECT set_config('search_path', $1, true);\n",
                    &[Literal::Text(path)],
                )
            }),
            _ => String::new(),
        }
    }

    /// Portable mode: `begin` and the claim's waits by `SET LOCAL`, in one message; its
    /// one row is the settings the waits replace (read it with [`Self::saved`]). A
    /// distributed engine forwards `SET LOCAL` to the nodes that run the claim (Citus,
    /// told so by `citus.propagate_set_commands = 'local'` first, so that no database or
    /// role setting is needed; elsewhere an unused placeholder setting, gone at COMMIT).
    /// The claim itself follows as a statement of its own, with bound parameters: Citus
    /// refuses [`CLAIM_PORTABLE`] with its values written in ("cannot execute a
    /// distributed query from a query on a shard"), and routes it by a bound one.
    ///
    /// The claim is bounded by its wait alone: the statement timeout (the request's, or
    /// the session's, by its role, say) is lifted until the claim ends. Were it not, a
    /// statement timeout shorter than the wait would cancel the claim (57014) and turn a
    /// duplicate into an error instead of a replay or a 409.
    pub(crate) fn begin_waiting(begin: &str, timeouts: Timeouts) -> String {
        // The wait is whole milliseconds written by `lock_timeout`: digits and "ms".
        format!(
            "{begin};\nSET LOCAL citus.propagate_set_commands = 'local';\n\
             SELECT current_setting('lock_timeout'), current_setting('statement_timeout'), \
             current_setting('search_path'), \
             CASE WHEN current_setting('in_hot_standby', true) = 'on' THEN 'standby' \
                  ELSE current_setting('transaction_read_only') END, \
             (extract(epoch FROM now()) * 1000000)::bigint;\n\
             SET LOCAL lock_timeout = '{}';\nSET LOCAL statement_timeout = 0",
            lock_timeout(timeouts.wait)
        )
    }

    /// The settings [`Self::begin_waiting`] replaced, from its row, for
    /// [`Self::restore_wait`]: the request's statement timeout wins over the one before.
    pub(crate) fn saved(row: &PgRow, timeouts: Timeouts) -> Result<Saved, sqlx::Error> {
        Ok(Saved {
            lock_timeout: row.try_get(0)?,
            statement_timeout: match timeouts.statement {
                Some(statement) => lock_timeout(statement),
                None => row.try_get(1)?,
            },
            search_path: row.try_get(2)?,
            access: row.try_get(3)?,
            // Exact, as `tried` reads the default mode's (`began_us`).
            began: row.try_get::<i64, _>(4)? as f64 / 1e6,
        })
    }

    /// Portable mode: after a successful claim, gives the handler the settings
    /// [`Self::begin_waiting`] replaced: the `lock_timeout` the transaction had before the
    /// claim (the session's, by its role, database, connection options or a `SET` of its
    /// own), and the request's statement timeout, else the one it had before.
    pub(crate) async fn restore_wait(
        &self,
        conn: &mut PgConnection,
        saved: &Saved,
    ) -> Result<(), sqlx::Error> {
        // The values are PostgreSQL's own spellings of a duration ("0", "300ms", "1min")
        // or `lock_timeout`'s: letters and digits. Anything else (never seen) gives the
        // session's default back rather than reach the SQL.
        let value = |setting: &str| {
            if !setting.is_empty() && setting.bytes().all(|b| b.is_ascii_alphanumeric()) {
                format!("'{setting}'")
            } else {
                "DEFAULT".to_owned()
            }
        };
        let sql = format!(
            "SET LOCAL lock_timeout TO {}; SET LOCAL statement_timeout TO {}",
            value(&saved.lock_timeout),
            value(&saved.statement_timeout)
        );
        // Asserted safe: both values are letters and digits (above) or DEFAULT.
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(conn)
            .await
            .map(drop)
    }

    /// [`CLAIM_PORTABLE`]: `None` when the row it waited for committed after its snapshot.
    pub(crate) async fn claim(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
        fingerprint: &Fingerprint,
        timeouts: Timeouts,
    ) -> Result<Option<Found>, sqlx::Error> {
        let query = self.claiming(&self.claim, key, fingerprint, timeouts.ttl);
        decode_found(query.fetch_optional(conn).await?)
    }

    /// [`CLAIM_PORTABLE_TEXT`], its values written in, with idem's guard declared after
    /// it in the same message ([`crate::transaction::with_guard`]): the portable mode's
    /// first claim. The message that begins the transaction cannot carry the guard there
    /// (its `SET LOCAL`s reach Citus's workers with the message's whole text); this one
    /// sets nothing. One message, as the bound claim is.
    pub(crate) async fn claim_guarded(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
        fingerprint: &Fingerprint,
        timeouts: Timeouts,
    ) -> Result<Option<Found>, sqlx::Error> {
        let scope = key.stored_scope();
        let parts = fingerprint.parts();
        let claim = literal::render(
            self.claim_text.as_str(),
            &[
                Literal::Text(&scope),
                Literal::Text(self.dialect.principal_type.bound(&key.principal)),
                Literal::Text(key.key.as_str()),
                Literal::Bytes(fingerprint.combined().as_slice()),
                Literal::Bytes(&parts),
                Literal::Float(timeouts.ttl.as_secs_f64()),
            ],
        );
        let sql = crate::transaction::with_guard(claim);
        let rows = sqlx::raw_sql(AssertSqlSafe(sql)).fetch_all(conn).await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        if row.try_get::<bool, _>("fresh")? {
            return Ok(Some(Found::Claimed));
        }
        Ok(Some(Found::Stored(stored(row)?)))
    }

    /// [`READ_PORTABLE`].
    pub(crate) async fn read(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
    ) -> Result<Option<Found>, sqlx::Error> {
        let query = self.keyed(&self.read, key);
        decode_found(query.fetch_optional(conn).await?)
    }

    /// [`RECLAIM_PORTABLE`]: whether the row was taken over.
    pub(crate) async fn reclaim(
        &self,
        conn: &mut PgConnection,
        key: &KeyInScope,
        fingerprint: &Fingerprint,
        timeouts: Timeouts,
    ) -> Result<bool, sqlx::Error> {
        let query = self.claiming(&self.reclaim, key, fingerprint, timeouts.ttl);
        Ok(query.fetch_optional(conn).await?.is_some())
    }

    /// [`STORE`] and `COMMIT` in one message ([`crate::literal`]): the response rides
    /// the round trip COMMIT needs anyway. When nothing was stored (the handler ended
    /// the transaction itself, invariant 6), nothing commits ([`Table::checked_commit`]).
    pub(crate) fn storing_commit(
        &self,
        key: &KeyInScope,
        ttl: Duration,
        record: &Record,
        riders: &[String],
    ) -> String {
        let scope = key.stored_scope();
        let [a, b, c, d, e, f] = self.answer_values(&scope, key, record);
        let store = literal::render(
            self.store.as_str(),
            &[a, b, c, d, e, f, Literal::Float(ttl.as_secs_f64())],
        );
        self.checked_commit(&store, riders)
    }

    /// The key's and its answer's values, as [`STORE`] and [`ABANDONED`] take them: $1
    /// scope (`scope`, as stored), $2 principal, $3 key, $4 status, $5 headers, $6 body.
    fn answer_values<'a>(
        &'a self,
        scope: &'a str,
        key: &'a KeyInScope,
        record: &'a Record,
    ) -> [Literal<'a>; 6] {
        [
            Literal::Text(scope),
            Literal::Text(self.dialect.principal_type.bound(&key.principal)),
            Literal::Text(key.key.as_str()),
            Literal::Int(i64::from(record.status)),
            Literal::Bytes(&record.headers),
            Literal::Bytes(&record.body),
        ]
    }

    /// `write`, an update of the key's row, and `COMMIT` in one message, with what rides
    /// it. When `write` updated no row, a statement between the two fails with
    /// [`ESCAPED`] in its message, so that PostgreSQL skips the COMMIT. As in
    /// [`Table::inserting_commit`], the CASE is cast, so that it is not folded.
    fn checked_commit(&self, write: &str, riders: &[String]) -> String {
        format!(
            "{}WITH stored AS ({write}\n RETURNING 1)\n\
             SELECT CAST(CASE WHEN count(*) = 0 THEN '{ESCAPED}' END AS integer) FROM stored;\n{}COMMIT",
            self.path_again(),
            rides(riders)
        )
    }

    /// The message that opens a transaction holding `key`'s abandoning marker
    /// ([`HOLD_ABANDONING`]), its values written in.
    pub(crate) fn holding_abandoning(&self, key: &KeyInScope) -> String {
        let scope = key.stored_scope();
        let hold = literal::render(
            self.hold_abandoning.as_str(),
            &[
                Literal::Text(&scope),
                Literal::Text(self.dialect.principal_type.bound(&key.principal)),
                Literal::Text(key.key.as_str()),
            ],
        );
        format!(
            "{};\n{}{hold}",
            Isolation::ReadCommitted.begin(),
            self.path_again()
        )
    }

    /// [`ABANDONED`] and `COMMIT` in one message, with what rides it: nothing commits
    /// when the marker was not replaced ([`Table::checked_commit`]).
    pub(crate) fn abandoned_commit(
        &self,
        key: &KeyInScope,
        record: &Record,
        riders: &[String],
    ) -> String {
        let scope = key.stored_scope();
        let update = literal::render(
            self.abandoned.as_str(),
            &self.answer_values(&scope, key, record),
        );
        self.checked_commit(&update, riders)
    }

    /// [`EXPIRED`]: `None` when no committed row exists.
    pub(crate) async fn expired(
        &self,
        pool: &PgPool,
        key: &KeyInScope,
    ) -> Result<Option<bool>, sqlx::Error> {
        let mut conn = self.single(pool).await?;
        let row = self
            .keyed(&self.expired, key)
            .fetch_optional(&mut *conn)
            .await?;
        conn.finish().await?;
        row.map(|row| row.try_get(0)).transpose()
    }

    /// Whether `place` of `scope` has a live record: [`EARLIER_LIVE`] under the nobody
    /// value, [`SPREAD_LIVE`] in a spread place.
    pub(crate) async fn earlier_live(
        &self,
        pool: &PgPool,
        scope: &str,
        place: Place,
    ) -> Result<bool, sqlx::Error> {
        let query = match place {
            Place::Nobody => self
                .query(&self.earlier_live)
                .bind(scope.to_owned())
                .bind(self.dialect.principal_type.bound("")),
            place => self
                .query(&self.spread_live)
                .bind(stored_scope(scope, place).into_owned()),
        };
        let mut conn = self.single(pool).await?;
        let live = query.fetch_one(&mut *conn).await?.try_get(0)?;
        conn.finish().await?;
        Ok(live)
    }

    /// [`READ_PORTABLE`] of a key where an earlier configuration kept it
    /// ([`crate::spread`]), in a statement of its own: in every mode, a read of what is
    /// committed.
    pub(crate) async fn earlier(
        &self,
        pool: &PgPool,
        key: &KeyInScope,
    ) -> Result<Option<Found>, sqlx::Error> {
        let mut conn = self.single(pool).await?;
        let found = self.read(&mut conn, key).await?;
        conn.finish().await?;
        Ok(found)
    }

    /// [`FORGET`].
    pub(crate) async fn forget(&self, pool: &PgPool, key: &KeyInScope) -> Result<(), sqlx::Error> {
        let mut conn = self.single(pool).await?;
        self.keyed(&self.forget, key).execute(&mut *conn).await?;
        conn.finish().await
    }
}

/// [`OVERWRITE`] (`overwrite`), and a statement that fails when it wrote nothing: with
/// [`LOST`] in its message when the transaction's start is `$10` (the claim's `began`),
/// with [`ESCAPED`] otherwise. (An [`INSERT`] checks itself: a key another attempt
/// committed fails it on the primary key.)
pub(super) fn checked_overwrite(overwrite: &str) -> String {
    // The text is cast, not the CASE's branches: PostgreSQL folds a cast of a constant
    // when it plans the statement, whatever branch it stands in.
    format!(
        "WITH written AS ({overwrite}\n RETURNING 1)\n\
         SELECT CAST(CASE WHEN count(*) = 0 THEN \
         CASE WHEN extract(epoch FROM now())::float8 = $10 THEN '{LOST}' ELSE '{ESCAPED}' END \
         END AS integer) FROM written"
    )
}

/// Statements that ride a COMMIT message after the key's row, each ended by `;` and a
/// line break: PostgreSQL runs them only when the key's row was written (a failed
/// statement skips the rest of the message), in the same round trip.
pub(super) fn rides(riders: &[String]) -> String {
    riders.iter().map(|sql| format!("{sql};\n")).collect()
}

/// The durations a claim binds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timeouts {
    /// How long the record lives.
    pub(crate) ttl: Duration,
    /// How long the claim waits for another request's lock on the key.
    pub(crate) wait: Duration,
    /// The bound on each of the handler's statements; `None` for the session's own.
    pub(crate) statement: Option<Duration>,
}

/// The settings a portable claim replaced for its wait ([`Table::begin_waiting`]), and gives
/// back when it holds the key ([`Table::restore_wait`]).
pub(crate) struct Saved {
    lock_timeout: String,
    statement_timeout: String,
    /// The session's `search_path` ([`Table::pinned_path`]).
    pub(crate) search_path: String,
    /// `on` where the transaction is read-only, `standby` on a standby, else `off`
    /// ([`Table::writable`]).
    pub(crate) access: String,
    /// The transaction's start: the events' ids, which ride the COMMIT message.
    pub(crate) began: f64,
}

/// The row of [`TRY`].
pub(crate) fn tried(row: &PgRow) -> Result<Tried, sqlx::Error> {
    Ok(Tried {
        // Exact: both sides of the division are exact doubles (under 2^53), and the
        // quotient is rounded once, as PostgreSQL rounds `extract(epoch FROM now())`'s
        // decimal to the float8 that [`INSERT`] and the event ids read.
        began: row.try_get::<i64, _>("began_us")? as f64 / 1e6,
        locked: row.try_get("locked")?,
        statement_timeout: row.try_get("statement_timeout")?,
        search_path: row.try_get("search_path")?,
        access: row.try_get("read_only")?,
    })
}

/// A row of [`TAKE`].
pub(crate) fn stored(row: &PgRow) -> Result<StoredRow, sqlx::Error> {
    Ok(StoredRow {
        fingerprint: unhex(row.try_get("fingerprint")?)?.unwrap_or_default(),
        field_hashes: unhex(row.try_get("field_hashes")?)?.unwrap_or_default(),
        status: row.try_get("status")?,
        headers: unhex(row.try_get("headers")?)?,
        body: unhex(row.try_get("body")?)?,
        expired: row.try_get("expired")?,
    })
}

pub(super) fn decode_found(row: Option<PgRow>) -> Result<Option<Found>, sqlx::Error> {
    let Some(row) = row else { return Ok(None) };
    if row.try_get::<bool, _>("fresh")? {
        return Ok(Some(Found::Claimed));
    }
    Ok(Some(Found::Stored(StoredRow {
        fingerprint: row.try_get("fingerprint")?,
        field_hashes: row.try_get("field_hashes")?,
        status: row.try_get("status")?,
        headers: row.try_get("headers")?,
        body: row.try_get("body")?,
        expired: row.try_get("expired")?,
    })))
}

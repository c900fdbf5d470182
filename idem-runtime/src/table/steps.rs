//! The steps table: its DDL and every statement steps run on it, each written whole
//! beside the function that binds it. Only the table's name (and the principal's type)
//! is filled in, through [`crate::table::statement`].
//!
//! A step's row is written on a connection of its own, outside the request's
//! transaction, so that it outlives the request's rollback and its process's death. Its
//! write is fenced (invariant 11): it inserts only while the request's transaction is
//! still in progress, read by `txid_status` of the transaction's id, so a request whose
//! transaction has ended (its connection dropped, a timeout) records nothing after
//! another attempt took the key over.

use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Row, SqlStr};

use super::{statement, Dialect, Pooler, TableName};
use crate::identity::KeyInScope;
use crate::literal::{self, Literal};
use crate::sqlstate;
use crate::transaction::Prepared;

/// The SQL that creates the steps table (under its default name) and its index, for
/// services that run their own migrations. [`Store::migrate`](crate::Store::migrate)
/// runs it for a store with the default tables;
/// [`Store::steps_schema_sql`](crate::Store::steps_schema_sql) gives it for any.
pub(crate) const STEPS_SCHEMA_SQL: &str = include_str!("../../sql/idempotency_steps.sql");

/// The DDL, with `{create_schema}`, `{table}`, `{name}` and `{principal_type}` to fill
/// in.
const DDL: &str = "-- idem: the steps table, for users who run their own migrations.
-- `Store::migrate` runs exactly this; it is safe to run again.
--
-- A row is the recorded result of one outside call (`Tx::step`) of a request that has
-- not committed yet, written outside that request's transaction so that a retry resumes
-- after it. The request's COMMIT deletes its rows; a request that never commits leaves
-- them until they expire with its key, and the sweeper removes them.
{create_schema}CREATE TABLE IF NOT EXISTS {table} (
    scope       text        NOT NULL,
    principal   {principal_type} NOT NULL,
    key         text        NOT NULL,
    step        text        NOT NULL,
    -- SHA-256 of the request's canonical fingerprint: a retry with another payload
    -- never sees the step
    fingerprint bytea       NOT NULL,
    -- the call's result, as JSON
    result      text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    CONSTRAINT \"{name}_pkey\" PRIMARY KEY (scope, principal, key, step)
);

-- The sweeper deletes expired rows.
CREATE INDEX IF NOT EXISTS \"{name}_expires_at_idx\" ON {table} (expires_at);

-- The request's per-field hashes (`Fingerprint::parts`, as the keys' rows keep them),
-- added after the table's first migration: after a deploy that reorders or adds `fields`,
-- a retry is compared on the fields both versions share.
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS field_hashes bytea;
";

/// The request's transaction id, for the fence of its steps' writes. On a distributed
/// engine it runs on the coordinator, which owns the request's transaction.
const FENCE: &str = "SELECT txid_current()";

/// The live steps of a key, in the order they were recorded: an abandon undoes them
/// last first. $1 scope, $2 principal, $3 key. Sent as a simple query, its
/// row comes back as text: the fingerprint as hex, whatever `bytea_output` (invariant 12).
const READ: &str = "\
SELECT step, encode(fingerprint, 'hex') AS fingerprint,
       encode(field_hashes, 'hex') AS field_hashes, result FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND expires_at > now()
 ORDER BY created_at, step";

/// What [`RECORD`] raises when the request's transaction has ended: text that no integer
/// reads, cast to one (22P02), so that the message names it.
const LOST: &str = "idem: the request no longer holds its key";

/// Records a step's result, in one message of two statements: the fence, which fails
/// (skipping the insert) unless the request's transaction ($8, its `txid_current()`) is
/// still in progress, then the insert, over an expired row of the same step (an earlier
/// request with this key, which never committed), not over a live one (`{keep_live}`:
/// left out on a distributed engine, which refuses a function that is not immutable
/// there; the read before found no live row, and only the key's holder writes). The
/// fence's statement reads no table, so a distributed engine runs it on the coordinator,
/// which owns the request's transaction.
///
/// $1 scope, $2 principal, $3 key, $4 step, $5 fingerprint, $6 result, $7 ttl in
/// seconds, $8 the request's transaction id, $9 the request's per-field hashes.
const RECORD: &str = "\
SELECT CAST(CASE WHEN txid_status($8) = 'in progress' THEN NULL ELSE '{lost}' END AS integer);
INSERT INTO {table} AS s (scope, principal, key, step, fingerprint, field_hashes, result,
                          expires_at)
VALUES ($1, {p2}, $3, $4, $5, $9, $6, now() + $7 * interval '1 second')
ON CONFLICT (scope, principal, key, step) DO UPDATE
   SET fingerprint = excluded.fingerprint, field_hashes = excluded.field_hashes,
       result = excluded.result,
       created_at = excluded.created_at, expires_at = excluded.expires_at{keep_live}
RETURNING true AS recorded";

/// The steps of a key, deleted by the request's COMMIT message: the key's record
/// answers its retries from then on. $1 scope, $2 principal, $3 key.
const FORGET: &str = "DELETE FROM {table} WHERE scope = $1 AND principal = {p2} AND key = $3";

/// The prepared [`FORGET`]'s role in the claim's set ([`Prepared`]).
const FORGET_ROLE: &str = "forget_steps";

/// Expired steps, oldest first, in a batch. $1 the batch size, $2 where the previous
/// batch of the same purge stopped (microseconds since the epoch; NULL for the first):
/// each batch starts there, so that it reads what it deletes, not the index entries of
/// the rows the batches before it deleted (and of every step its request's COMMIT
/// deleted), which stay until a vacuum (issue 36, as the keys' [`crate::table`] purge).
const PURGE: &str = "\
WITH gone AS (
DELETE FROM {table}
 WHERE (scope, principal, key, step) IN (
        SELECT scope, principal, key, step FROM {table}
         WHERE expires_at <= now() AND expires_at >= {reached}
         ORDER BY expires_at
         LIMIT $1)
   AND expires_at <= now()
RETURNING expires_at)
SELECT count(*) AS deleted, {reaches} FROM gone";

/// [`PURGE`] for a distributed engine, which refuses a `LIMIT` in a subquery of a
/// multi-shard statement and makes a multi-shard delete a two-phase commit: a read of
/// expired rows (a batch), then [`SWEEP_ONE_PORTABLE`] for each, on its own shard. $1 the
/// batch size, $2 as for [`PURGE`].
const EXPIRED_PORTABLE: &str = "\
SELECT scope, principal::text AS principal, key, step,
       (extract(epoch FROM expires_at) * 1000000)::bigint AS reached
  FROM {table}
 WHERE expires_at <= now() AND expires_at >= {reached}
 ORDER BY expires_at LIMIT $1";

/// One expired step, by its primary key. $1 scope, $2 principal, $3 key, $4 step.
const SWEEP_ONE_PORTABLE: &str = "\
DELETE FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND step = $4 AND expires_at <= now()";

/// The steps table of one store. Its statements run by the simple query protocol with
/// their values written in ([`crate::literal`]): one round trip each, also behind a
/// transaction pooler (where a bound statement is two, in a transaction of its own).
pub(crate) struct StepsTable {
    dialect: Dialect,
    ddl: String,
    read: String,
    record: String,
    forget: String,
    purge: SqlStr,
    sweep_one: SqlStr,
}

/// A step as [`StepsTable::read`] found it.
pub(crate) struct RecordedStep {
    pub(crate) step: String,
    pub(crate) fingerprint: Vec<u8>,
    /// Its request's per-field hashes (empty for a step recorded before they were kept).
    pub(crate) field_hashes: Vec<u8>,
    pub(crate) result: String,
}

impl StepsTable {
    /// The table `name` in `dialect`.
    pub(crate) fn new(name: &TableName, dialect: Dialect) -> Self {
        let table = name.qualified();
        let render = |sql: &str| {
            sql.replace("{table}", &table)
                .replace("{p2}", dialect.principal_type.parameter())
                .replace("{reached}", crate::table::REACHED)
                .replace("{reaches}", crate::table::REACHES)
        };
        let create_schema = name.create_schema();
        let ddl = DDL
            .replace("{create_schema}", &create_schema)
            .replace("{table}", &table)
            .replace("{name}", name.name())
            .replace(
                "{principal_type}",
                &format!("{:<11}", dialect.principal_type.sql()),
            );
        let keep_live = if dialect.portable {
            ""
        } else {
            "\n WHERE s.expires_at <= now()"
        };
        let purge = if dialect.portable {
            EXPIRED_PORTABLE
        } else {
            PURGE
        };
        Self {
            dialect,
            ddl,
            read: render(READ),
            record: render(RECORD)
                .replace("{lost}", LOST)
                .replace("{keep_live}", keep_live),
            forget: render(FORGET),
            purge: statement(render(purge)),
            sweep_one: statement(render(SWEEP_ONE_PORTABLE)),
        }
    }

    /// The DDL.
    pub(crate) fn ddl(&self) -> &str {
        &self.ddl
    }

    /// The key's three literals: scope, principal, key.
    fn key<'a>(&self, key: &'a KeyInScope, scope: &'a str) -> [Literal<'a>; 3] {
        [
            Literal::Text(scope),
            Literal::Text(self.dialect.principal_type.bound(&key.principal)),
            Literal::Text(key.key.as_str()),
        ]
    }

    /// [`FENCE`], on the request's own connection.
    pub(crate) async fn fence(&self, conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
        sqlx::raw_sql(FENCE).fetch_one(conn).await?.try_get(0)
    }

    /// [`READ`], outside the request's transaction (`outside`: a fresh snapshot, whatever
    /// the request's isolation level).
    pub(crate) async fn read(
        &self,
        outside: &PgPool,
        key: &KeyInScope,
    ) -> Result<Vec<RecordedStep>, sqlx::Error> {
        let scope = key.stored_scope();
        let sql = literal::render(&self.read, &self.key(key, &scope));
        let rows = sqlx::raw_sql(statement(sql)).fetch_all(outside).await?;
        rows.iter().map(decode).collect()
    }

    /// [`RECORD`], outside the request's transaction: whether the result was recorded
    /// (`false`: the request's transaction has ended).
    pub(crate) async fn record(
        &self,
        outside: &PgPool,
        write: &StepWrite<'_>,
    ) -> Result<bool, sqlx::Error> {
        let scope = write.key.stored_scope();
        let [scope, principal, key] = self.key(write.key, &scope);
        let sql = literal::render(
            &self.record,
            &[
                scope,
                principal,
                key,
                Literal::Text(write.step),
                Literal::Bytes(write.fingerprint),
                Literal::Text(write.result),
                Literal::Float(write.ttl.as_secs_f64()),
                Literal::Int(write.fence),
                Literal::Bytes(write.field_hashes),
            ],
        );
        let sql = match write.also {
            Some(also) => format!("{sql};\n{also}"),
            None => sql,
        };
        match sqlx::raw_sql(statement(sql)).fetch_all(outside).await {
            Ok(rows) => Ok(rows
                .iter()
                .any(|row| row.try_get::<bool, _>("recorded").unwrap_or(false))),
            Err(sqlx::Error::Database(e))
                if e.code().as_deref() == Some(sqlstate::INVALID_TEXT_REPRESENTATION)
                    && e.message().contains(LOST) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// [`FORGET`] for `key`, written for the request's COMMIT message: executed by name
    /// where the store prepares [`Self::prepared_forget`] with its claim (the default
    /// mode).
    pub(crate) fn forgetting(&self, prepared: Option<&Prepared>, key: &KeyInScope) -> String {
        let scope = key.stored_scope();
        let values = self.key(key, &scope);
        literal::executed(prepared, FORGET_ROLE, &values)
            .unwrap_or_else(|| literal::render(&self.forget, &values))
    }

    /// [`FORGET`] as the store prepares it with its claim: role, parameter types, text.
    pub(crate) fn prepared_forget(&self) -> (&'static str, &'static str, &str) {
        (FORGET_ROLE, "text, text, text", &self.forget)
    }

    /// [`PURGE`]: how many rows one batch deleted (in portable mode [`EXPIRED_PORTABLE`],
    /// then [`SWEEP_ONE_PORTABLE`] for each row it found); `reached` is where the batch
    /// started, and becomes where it stopped.
    pub(crate) async fn purge(
        &self,
        conn: &mut PgConnection,
        batch_size: i64,
        reached: &mut Option<i64>,
    ) -> Result<u64, sqlx::Error> {
        let persistent = self.dialect.pooler == Pooler::Session;
        let query = sqlx::query(self.purge.clone())
            .persistent(persistent)
            .bind(batch_size)
            .bind(*reached);
        if !self.dialect.portable {
            return super::purged(&query.fetch_one(conn).await?, reached);
        }
        let expired = query.fetch_all(&mut *conn).await?;
        let mut deleted = 0;
        for row in expired {
            let [scope, principal, key, step]: [String; 4] = [
                row.try_get("scope")?,
                row.try_get("principal")?,
                row.try_get("key")?,
                row.try_get("step")?,
            ];
            *reached = Some(row.try_get("reached")?);
            deleted += sqlx::query(self.sweep_one.clone())
                .persistent(persistent)
                .bind(scope)
                .bind(principal)
                .bind(key)
                .bind(step)
                .execute(&mut *conn)
                .await?
                .rows_affected();
        }
        Ok(deleted)
    }
}

/// What [`StepsTable::record`] writes.
pub(crate) struct StepWrite<'a> {
    pub(crate) key: &'a KeyInScope,
    pub(crate) step: &'a str,
    pub(crate) fingerprint: &'a [u8],
    /// The request's per-field hashes ([`Fingerprint::parts`](crate::fingerprint::Fingerprint::parts)).
    pub(crate) field_hashes: &'a [u8],
    pub(crate) result: &'a str,
    pub(crate) ttl: Duration,
    /// The request's transaction id ([`StepsTable::fence`]).
    pub(crate) fence: i64,
    /// A statement to run after the insert, in the same message (fenced with it): the
    /// request's stored copy ([`crate::table::requests`]).
    pub(crate) also: Option<&'a str>,
}

fn decode(row: &PgRow) -> Result<RecordedStep, sqlx::Error> {
    Ok(RecordedStep {
        step: row.try_get("step")?,
        fingerprint: crate::table::unhex(row.try_get("fingerprint")?)?.unwrap_or_default(),
        field_hashes: crate::table::unhex(row.try_get("field_hashes")?)?.unwrap_or_default(),
        result: row.try_get("result")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::DEFAULT_STEPS_TABLE;

    #[test]
    fn the_shipped_schema_is_the_default_table_s() {
        let name = TableName::parse(DEFAULT_STEPS_TABLE).expect("a valid name");
        assert_eq!(
            StepsTable::new(&name, Dialect::default()).ddl(),
            STEPS_SCHEMA_SQL
        );
    }

    #[test]
    fn the_commit_s_delete_writes_the_key_as_literals() {
        let name = TableName::parse("app.steps").expect("a valid name");
        let table = StepsTable::new(&name, Dialect::default());
        let key = KeyInScope {
            scope: "charges".into(),
            principal: "acct_1".to_owned(),
            key: crate::key::IdempotencyKey::from_text("k'1").expect("a key"),
            place: crate::identity::Place::Principal,
        };
        let sql = table.forgetting(None, &key);
        assert!(
            sql.starts_with("DELETE FROM \"app\".\"steps\" WHERE scope = E'"),
            "{sql}"
        );
        assert!(!sql.contains("k'1") && !sql.contains('$'), "{sql}");
    }

    /// Issue 36: a steps purge reads what it deletes, as the keys' does
    /// (`table::cost`). Its 150th batch of 1 000 touches no more than 1.2 times (and 50)
    /// the buffers of its first; from the oldest expiry each batch walked the index
    /// entries of every row the batches before it had deleted (today 4 153 and 4 154
    /// buffers; the 150th from the oldest read 6 818).
    #[tokio::test(flavor = "multi_thread")]
    async fn a_steps_purge_reads_as_much_in_its_last_batches_as_in_its_first() {
        use crate::table::cost::{drop_schema, pool, purge_buffers, schema};
        use sqlx::AssertSqlSafe;

        let pool = pool().await;
        let schema = schema("steps_purge");
        let name = TableName::parse(&format!("{schema}.steps")).unwrap();
        let table = StepsTable::new(&name, Dialect::default());
        crate::table::create(&pool, &statement(table.ddl().to_owned()))
            .await
            .expect("the steps table");
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (scope, principal, key, step, fingerprint, result, expires_at)
             SELECT 'charges', '', 'k' || g, 'processor', sha256(g::text::bytea), '{{}}',
                    now() - interval '1 hour' + g * interval '1 microsecond'
               FROM generate_series(1, 160000) AS g",
            name.qualified()
        )))
        .execute(&pool)
        .await
        .expect("the steps");
        sqlx::query(AssertSqlSafe(format!("ANALYZE {}", name.qualified())))
            .execute(&pool)
            .await
            .expect("the statistics");
        let first = purge_buffers(&pool, table.purge.as_str(), None).await;
        let mut reached = None;
        let mut conn = pool.acquire().await.unwrap();
        for _ in 0..149 {
            let deleted = table.purge(&mut conn, 1_000, &mut reached).await.unwrap();
            assert_eq!(deleted, 1_000);
        }
        drop(conn);
        let last = purge_buffers(&pool, table.purge.as_str(), reached).await;
        drop_schema(&pool, &schema).await;
        assert!(
            last as f64 <= first as f64 * 1.2 + 50.0,
            "buffers of a steps purge's first batch of 1 000 and of its 150th: {first}, \
             {last}"
        );
    }
}

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

use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{Postgres, Row, SqlStr};

use crate::identity::KeyInScope;
use crate::literal::{self, Literal};
use crate::table::{statement, Dialect, Pooler, TableName};

/// The SQL that creates the steps table (under its default name) and its index, for
/// services that run their own migrations. [`Store::migrate`](crate::Store::migrate)
/// runs it for a store with the default tables;
/// [`Store::steps_schema_sql`](crate::Store::steps_schema_sql) gives it for any.
pub const STEPS_SCHEMA_SQL: &str = include_str!("../../sql/idempotency_steps.sql");

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
";

/// The request's transaction id, for the fence of its steps' writes. On a distributed
/// engine it runs on the coordinator, which owns the request's transaction.
const FENCE: &str = "SELECT txid_current()";

/// The live steps of a key. $1 scope, $2 principal, $3 key.
const READ: &str = "\
SELECT step, fingerprint, result FROM {table}
 WHERE scope = $1 AND principal = {p2} AND key = $3 AND expires_at > now()";

/// Records a step's result while the request's transaction ($8, its `txid_current()`)
/// is still in progress; over an expired row of the same step (an earlier request with
/// this key, which never committed), not over a live one. No row back: not recorded.
///
/// $1 scope, $2 principal, $3 key, $4 step, $5 fingerprint, $6 result, $7 ttl in
/// seconds, $8 the request's transaction id.
const RECORD: &str = "\
INSERT INTO {table} AS s (scope, principal, key, step, fingerprint, result, expires_at)
SELECT $1, {p2}, $3, $4, $5, $6, now() + $7::float8 * interval '1 second'
 WHERE txid_status($8::bigint) = 'in progress'
ON CONFLICT (scope, principal, key, step) DO UPDATE
   SET fingerprint = excluded.fingerprint, result = excluded.result,
       created_at = excluded.created_at, expires_at = excluded.expires_at
 WHERE s.expires_at <= now()
RETURNING 1";

/// A distributed engine routes [`RECORD`] to the key's shard, where `txid_status` would
/// read the shard's own transactions: there the fence is its own statement, on the
/// coordinator, which also reads the time for [`RECORD_UNFENCED`] (Citus refuses a
/// function that is not immutable in `ON CONFLICT .. WHERE`). $1 the request's
/// transaction id.
const FENCE_STATUS: &str = "\
SELECT txid_status($1::bigint) = 'in progress' AS holds, extract(epoch FROM now())::float8 AS now";

/// [`RECORD`] without its fence, for the portable mode ([`FENCE_STATUS`]): $8 is the
/// time the fence read, in seconds since the epoch.
const RECORD_UNFENCED: &str = "\
INSERT INTO {table} AS s (scope, principal, key, step, fingerprint, result, created_at, expires_at)
VALUES ($1, {p2}, $3, $4, $5, $6, to_timestamp($8::float8),
        to_timestamp($8::float8 + $7::float8))
ON CONFLICT (scope, principal, key, step) DO UPDATE
   SET fingerprint = excluded.fingerprint, result = excluded.result,
       created_at = excluded.created_at, expires_at = excluded.expires_at
 WHERE s.expires_at <= to_timestamp($8::float8)
RETURNING 1";

/// The steps of a key, deleted by the request's COMMIT message: the key's record
/// answers its retries from then on. $1 scope, $2 principal, $3 key.
const FORGET: &str = "DELETE FROM {table} WHERE scope = $1 AND principal = {p2} AND key = $3";

/// Expired steps, oldest first, in a batch. $1 the batch size.
const PURGE: &str = "\
DELETE FROM {table}
 WHERE (scope, principal, key, step) IN (
        SELECT scope, principal, key, step FROM {table}
         WHERE expires_at <= now()
         ORDER BY expires_at
         LIMIT $1)
   AND expires_at <= now()";

/// [`PURGE`] for a distributed engine, which refuses a `LIMIT` in a subquery of a
/// multi-shard statement: every expired row at once (a step row is written only for a
/// request that then failed, so there are few).
const PURGE_PORTABLE: &str = "DELETE FROM {table} WHERE expires_at <= now()";

/// The steps table of one store.
pub(crate) struct StepsTable {
    dialect: Dialect,
    ddl: String,
    read: SqlStr,
    record: SqlStr,
    forget: String,
    purge: SqlStr,
}

/// A step as [`StepsTable::read`] found it.
pub(crate) struct RecordedStep {
    pub(crate) step: String,
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) result: String,
}

impl StepsTable {
    /// The table `name` in `dialect`.
    pub(crate) fn new(name: &TableName, dialect: Dialect) -> Self {
        let table = name.qualified();
        let render = |sql: &str| {
            sql.replace("{table}", &table)
                .replace("{p2}", dialect.principal_type.parameter())
        };
        let create_schema = match name.schema() {
            Some(schema) => format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\";\n\n"),
            None => String::new(),
        };
        let ddl = DDL
            .replace("{create_schema}", &create_schema)
            .replace("{table}", &table)
            .replace("{name}", name.name())
            .replace(
                "{principal_type}",
                &format!("{:<11}", dialect.principal_type.sql()),
            );
        let record = if dialect.portable {
            RECORD_UNFENCED
        } else {
            RECORD
        };
        let purge = if dialect.portable {
            PURGE_PORTABLE
        } else {
            PURGE
        };
        Self {
            dialect,
            ddl,
            read: statement(render(READ)),
            record: statement(render(record)),
            forget: render(FORGET),
            purge: statement(render(purge)),
        }
    }

    /// The DDL.
    pub(crate) fn ddl(&self) -> &str {
        &self.ddl
    }

    fn query(&self, sql: &SqlStr) -> Query<'static, Postgres, PgArguments> {
        sqlx::query(sql.clone()).persistent(self.dialect.pooler == Pooler::Session)
    }

    fn keyed(&self, sql: &SqlStr, key: &KeyInScope) -> Query<'static, Postgres, PgArguments> {
        self.query(sql)
            .bind(key.stored_scope().into_owned())
            .bind(self.dialect.principal_type.bound(&key.principal).to_owned())
            .bind(key.key.as_str().to_owned())
    }

    /// [`FENCE`], on the request's own connection.
    pub(crate) async fn fence(&self, conn: &mut sqlx::PgConnection) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(FENCE)
            .persistent(self.dialect.pooler == Pooler::Session)
            .fetch_one(conn)
            .await
    }

    /// [`READ`], on a connection outside the request's transaction: a fresh snapshot,
    /// whatever the request's isolation level.
    pub(crate) async fn read(
        &self,
        conn: &mut sqlx::PgConnection,
        key: &KeyInScope,
    ) -> Result<Vec<RecordedStep>, sqlx::Error> {
        let rows = self.keyed(&self.read, key).fetch_all(conn).await?;
        rows.iter().map(decode).collect()
    }

    /// [`RECORD`] (in portable mode [`FENCE_STATUS`], then [`RECORD_UNFENCED`]), on a
    /// connection outside the request's transaction: whether the result was recorded.
    pub(crate) async fn record(
        &self,
        conn: &mut sqlx::PgConnection,
        write: &StepWrite<'_>,
    ) -> Result<bool, sqlx::Error> {
        let mut fenced = None;
        if self.dialect.portable {
            let row = self
                .query(&statement(FENCE_STATUS.to_owned()))
                .bind(write.fence)
                .fetch_one(&mut *conn)
                .await?;
            let holds: Option<bool> = row.try_get("holds")?;
            if holds != Some(true) {
                return Ok(false);
            }
            fenced = Some(row.try_get::<f64, _>("now")?);
        }
        let query = self
            .keyed(&self.record, write.key)
            .bind(write.step.to_owned())
            .bind(write.fingerprint.to_vec())
            .bind(write.result.to_owned())
            .bind(write.ttl.as_secs_f64());
        let query = match fenced {
            Some(now) => query.bind(now),
            None => query.bind(write.fence),
        };
        Ok(query.fetch_optional(conn).await?.is_some())
    }

    /// [`FORGET`] for `key`, written for the request's COMMIT message
    /// ([`crate::literal`]).
    pub(crate) fn forgetting(&self, key: &KeyInScope) -> String {
        let scope = key.stored_scope();
        literal::render(
            &self.forget,
            &[
                Literal::Text(&scope),
                Literal::Text(self.dialect.principal_type.bound(&key.principal)),
                Literal::Text(key.key.as_str()),
            ],
        )
    }

    /// [`PURGE`]: how many rows one batch deleted.
    pub(crate) async fn purge(
        &self,
        conn: &mut sqlx::PgConnection,
        batch_size: i64,
    ) -> Result<u64, sqlx::Error> {
        let query = self.query(&self.purge);
        let query = if self.dialect.portable {
            query
        } else {
            query.bind(batch_size)
        };
        Ok(query.execute(conn).await?.rows_affected())
    }
}

/// What [`StepsTable::record`] writes.
pub(crate) struct StepWrite<'a> {
    pub(crate) key: &'a KeyInScope,
    pub(crate) step: &'a str,
    pub(crate) fingerprint: &'a [u8],
    pub(crate) result: &'a str,
    pub(crate) ttl: Duration,
    /// The request's transaction id ([`StepsTable::fence`]).
    pub(crate) fence: i64,
}

fn decode(row: &PgRow) -> Result<RecordedStep, sqlx::Error> {
    Ok(RecordedStep {
        step: row.try_get("step")?,
        fingerprint: row.try_get("fingerprint")?,
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
        let sql = table.forgetting(&key);
        assert!(
            sql.starts_with("DELETE FROM \"app\".\"steps\" WHERE scope = E'"),
            "{sql}"
        );
        assert!(!sql.contains("k'1") && !sql.contains('$'), "{sql}");
    }
}

//! The audit table: its DDL, the row an operator's action writes in its own transaction,
//! and the trail read back, newest first. Only the table's name is filled in, through
//! [`crate::table::statement`]; values go as binds.
//!
//! The table is never distributed: on a distributed engine it stays a local table of the
//! coordinator, which owns every transaction, so an action's row commits with the
//! action's writes on the shards.

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, SqlStr};

use super::{statement, TableName};

/// The default name of the audit table, in the schema of the store's idempotency table.
pub(crate) const DEFAULT_AUDIT_TABLE: &str = "idem_audit";

/// The SQL that creates the audit table (under its default name), for services that run
/// their own migrations. [`Store::migrate`](crate::Store::migrate) runs it for a store
/// with the default tables; [`Store::audit_schema_sql`](crate::Store::audit_schema_sql)
/// gives it for any.
pub(crate) const AUDIT_SCHEMA_SQL: &str = include_str!("../../sql/idem_audit.sql");

/// The DDL, with `{create_schema}`, `{table}` and `{name}` to fill in.
const DDL: &str = "-- idem: the audit table, for users who run their own migrations.
-- `Store::migrate` runs exactly this; it is safe to run again.
--
-- A row is one action an operator took on idem's tables (a purge, a sweep, a re-drive,
-- a discard), from the console, the command line or the service's own code. It is
-- written in the transaction of the action itself, so a row says what was done and an
-- action rolled back leaves none; a sweep, which commits batch by batch, writes its row
-- after its last batch. idem never updates or deletes a row.
{create_schema}CREATE TABLE IF NOT EXISTS {table} (
    id       bigserial   NOT NULL,
    at       timestamptz NOT NULL DEFAULT now(),
    -- who: the console's operator header, the command line's --operator
    operator text        NOT NULL,
    -- through what: console, cli, or what the service names
    via      text        NOT NULL,
    -- purge, sweep, redrive, redrive_forced or discard
    action   text        NOT NULL,
    -- what the action selected: a key with its scope and principal, event ids, a
    -- reason, all, a batch size
    filter   text        NOT NULL,
    -- how many rows it moved
    rows     bigint      NOT NULL,
    CONSTRAINT \"{name}_pkey\" PRIMARY KEY (id)
);
";

/// One action's row. $1 operator, $2 via, $3 action, $4 filter, $5 rows.
const INSERT: &str = "\
INSERT INTO {table} (operator, via, action, filter, rows) VALUES ($1, $2, $3, $4, $5)";

/// The trail, newest first: $1 how many, $2 only rows older than this id (NULL: from the
/// newest).
const LIST: &str = "\
SELECT id, extract(epoch FROM at)::float8 AS at, operator, via, action, filter, rows
  FROM {table}
 WHERE $2::bigint IS NULL OR id < $2
 ORDER BY id DESC
 LIMIT $1";

/// The audit table of one store, its statements rendered.
pub(crate) struct AuditTable {
    ddl: SqlStr,
    insert: SqlStr,
    list: SqlStr,
}

/// What one action's row says ([`INSERT`]).
pub(crate) struct AuditWrite<'a> {
    pub(crate) operator: &'a str,
    pub(crate) via: &'a str,
    pub(crate) action: &'a str,
    pub(crate) filter: &'a str,
    pub(crate) rows: u64,
}

impl AuditTable {
    /// The table `name`.
    pub(crate) fn new(name: &TableName) -> Self {
        let table = name.qualified();
        let create_schema = name.create_schema();
        let ddl = DDL
            .replace("{create_schema}", &create_schema)
            .replace("{table}", &table)
            .replace("{name}", name.name());
        Self {
            ddl: statement(ddl),
            insert: statement(INSERT.replace("{table}", &table)),
            list: statement(LIST.replace("{table}", &table)),
        }
    }

    /// The DDL.
    pub(crate) fn ddl(&self) -> &SqlStr {
        &self.ddl
    }

    /// [`INSERT`] on `conn`, inside the action's transaction; `persistent`: whether the
    /// store names its statements ([`super::Table::persistent`]).
    pub(crate) async fn write(
        &self,
        conn: &mut PgConnection,
        persistent: bool,
        row: &AuditWrite<'_>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(self.insert.clone())
            .persistent(persistent)
            .bind(row.operator)
            .bind(row.via)
            .bind(row.action)
            .bind(row.filter)
            .bind(i64::try_from(row.rows).unwrap_or(i64::MAX))
            .execute(conn)
            .await?;
        Ok(())
    }

    /// [`LIST`] on `conn`: at most `limit` rows, newest first, older than `before`.
    pub(crate) async fn list(
        &self,
        conn: &mut PgConnection,
        persistent: bool,
        limit: u32,
        before: Option<i64>,
    ) -> Result<Vec<PgRow>, sqlx::Error> {
        sqlx::query(self.list.clone())
            .persistent(persistent)
            .bind(i64::from(limit))
            .bind(before)
            .fetch_all(conn)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_schema_is_the_default_table_s() {
        let name = TableName::parse(DEFAULT_AUDIT_TABLE).expect("a valid name");
        assert_eq!(AuditTable::new(&name).ddl().as_str(), AUDIT_SCHEMA_SQL);
    }

    #[test]
    fn a_named_table_is_created_in_its_schema() {
        let name = TableName::parse("ops.trail").expect("a valid name");
        let ddl = AuditTable::new(&name).ddl().as_str().to_owned();
        assert!(
            ddl.contains("CREATE SCHEMA IF NOT EXISTS \"ops\";"),
            "{ddl}"
        );
        assert!(
            ddl.contains("CREATE TABLE IF NOT EXISTS \"ops\".\"trail\" ("),
            "{ddl}"
        );
        assert!(ddl.contains("CONSTRAINT \"trail_pkey\""), "{ddl}");
    }
}

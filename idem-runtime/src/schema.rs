//! idem's tables: their names and the SQL that creates them ([`Schema`]), the migrations
//! that bring them up to date ([`MIGRATIONS`]), the principal column's type, and what a
//! distributed engine made of them ([`Distribution`]).
//!
//! [`Store::migrate`](crate::Store::migrate) creates and updates every table for a store;
//! a service that runs its migrations with its own tool takes [`MIGRATIONS`] (sqlx's
//! `Migrator`) or a store's [`Schema`] ([`Store::schema`](crate::Store::schema)).

pub use crate::distribution::Distribution;
pub use crate::migrate::MIGRATIONS;
pub use crate::table::PrincipalType;

use crate::table::audit::{AUDIT_SCHEMA_SQL, DEFAULT_AUDIT_TABLE};
use crate::table::outbox::{DEFAULT_OUTBOX_TABLE, OUTBOX_SCHEMA_SQL};
use crate::table::requests::{DEFAULT_REQUESTS_TABLE, REQUESTS_SCHEMA_SQL};
use crate::table::steps::STEPS_SCHEMA_SQL;
use crate::table::{DEFAULT_STEPS_TABLE, DEFAULT_TABLE, SCHEMA_SQL};

/// idem's five tables, each by its name and the SQL that creates it (`CREATE TABLE IF
/// NOT EXISTS`, its indexes, a comment; safe to run again): the defaults ([`DEFAULT`]),
/// or a store's, with the names and the principal type it was built with
/// ([`Store::schema`](crate::Store::schema)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Schema<'a> {
    /// The keys' table (`StoreBuilder::table`): a row per committed request.
    pub keys_table: &'a str,
    /// Its SQL.
    pub keys_sql: &'a str,
    /// The steps' table (`StoreBuilder::steps_table`): a row per recorded step.
    pub steps_table: &'a str,
    /// Its SQL.
    pub steps_sql: &'a str,
    /// The stored requests' table (`StoreBuilder::requests_table`): completable requests
    /// with a step.
    pub requests_table: &'a str,
    /// Its SQL.
    pub requests_sql: &'a str,
    /// The outbox (`StoreBuilder::outbox_table`): events committed with their requests.
    pub outbox_table: &'a str,
    /// Its SQL.
    pub outbox_sql: &'a str,
    /// The operators' audit log (`StoreBuilder::audit_table`).
    pub audit_table: &'a str,
    /// Its SQL.
    pub audit_sql: &'a str,
}

/// The tables of a store built with every default.
pub const DEFAULT: Schema<'static> = Schema {
    keys_table: DEFAULT_TABLE,
    keys_sql: SCHEMA_SQL,
    steps_table: DEFAULT_STEPS_TABLE,
    steps_sql: STEPS_SCHEMA_SQL,
    requests_table: DEFAULT_REQUESTS_TABLE,
    requests_sql: REQUESTS_SCHEMA_SQL,
    outbox_table: DEFAULT_OUTBOX_TABLE,
    outbox_sql: OUTBOX_SCHEMA_SQL,
    audit_table: DEFAULT_AUDIT_TABLE,
    audit_sql: AUDIT_SCHEMA_SQL,
};

impl Schema<'_> {
    /// Every table's SQL, in the order [`Store::migrate`](crate::Store::migrate) runs
    /// it.
    pub fn sql(&self) -> [&str; 5] {
        [
            self.keys_sql,
            self.steps_sql,
            self.requests_sql,
            self.outbox_sql,
            self.audit_sql,
        ]
    }
}

impl crate::Store {
    /// This store's tables: their names and the SQL that creates them, with the names
    /// and the principal type it was built with. [`Store::migrate`](crate::Store::migrate) runs that SQL.
    pub fn schema(&self) -> Schema<'_> {
        let settings = &self.inner;
        Schema {
            keys_table: settings.table_name.as_str(),
            keys_sql: settings.table.ddl(),
            steps_table: settings.steps_table.as_str(),
            steps_sql: settings.steps.ddl(),
            requests_table: settings.requests_table.as_str(),
            requests_sql: settings.requests.ddl(),
            outbox_table: settings.outbox_table.as_str(),
            outbox_sql: settings.outbox.ddl().as_str(),
            audit_table: settings.audit_table.as_str(),
            audit_sql: settings.audit.ddl().as_str(),
        }
    }
}

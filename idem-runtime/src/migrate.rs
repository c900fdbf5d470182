//! The idempotency table's migrations, and [`Store::verify`](crate::Store::verify), the startup check that the
//! table is there and up to date.
//!
//! # Three ways to create the table
//!
//! - [`Store::migrate`](crate::Store::migrate) at startup: creates the table and its index if missing.
//! - **sqlx migrations**: copy the files of `idem-runtime/migrations/` (also
//!   [`MIGRATIONS`]: the idempotency table, the outbox table, the steps table, the
//!   outbox's walk index and free space, the operators' audit table, then the outbox's
//!   attempt history) into your own
//!   `migrations/` directory. One directory, one
//!   migrator: `sqlx migrate run`, `sqlx::migrate!()` and
//!   `#[sqlx::test(migrations = "./migrations")]` all create the table with your own tables.
//! - Your own tool: the same SQL is [`schema::DEFAULT`](crate::schema::DEFAULT)'s, or a store's [`Store::schema`](crate::Store::schema).
//!
//! sqlx records every migrator's versions in one table, `_sqlx_migrations`, and a migrator
//! that finds a version it does not know stops with `VersionMissing`. Two migrators, yours
//! and a second one for idem, work only if both call `Migrator::set_ignore_missing(true)`,
//! which also hides a migration that really went missing, or if one of them keeps its
//! versions elsewhere (sqlx 0.9's `Migrator::dangerous_set_table_name`, which sqlx warns
//! re-runs every migration when changed on a live database). That is why idem ships files
//! for your directory and not a migrator of its own.
//!
//! # Upgrades across idem versions
//!
//! A release of idem that changes the table adds a new file to `migrations/`, named with a
//! later version, never edits a shipped one (sqlx refuses a changed checksum), and writes
//! it so that it is safe to run again, e.g.
//! `ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS ...`. [`Store::migrate`](crate::Store::migrate) runs the
//! same statements, and [`Store::verify`](crate::Store::verify) then also checks the new column, so a service
//! deployed with the new idem before its migration ran says so at startup.

use std::fmt;

use crate::deployment;
use crate::store::Store;
use crate::table::statement;

/// The migrations of the idempotency table, oldest first, as `(file name, SQL)`: the files
/// in `idem-runtime/migrations/`, for users who write them out themselves.
pub const MIGRATIONS: &[(&str, &str)] = &[
    (
        "20261123000000_idempotency_keys.sql",
        include_str!("../migrations/20261123000000_idempotency_keys.sql"),
    ),
    // The outbox table (`idem::outbox`), created whether or not the service emits events:
    // an empty table costs nothing, and a service that starts emitting needs no new step.
    (
        "20261124000000_idem_outbox.sql",
        include_str!("../migrations/20261124000000_idem_outbox.sql"),
    ),
    // The steps table (`Tx::step`): a call to another service recorded once per request.
    (
        "20261125000000_idempotency_steps.sql",
        include_str!("../migrations/20261125000000_idempotency_steps.sql"),
    ),
    // The outbox's walk index (issue 36): the relay's take reads as much at a backlog of
    // a million events as at a thousand; and its pages half free, so that a take's lease
    // is a HOT update.
    (
        "20261127000000_idem_outbox_heads.sql",
        include_str!("../migrations/20261127000000_idem_outbox_heads.sql"),
    ),
    // The audit table (`Operate::audited`): who purged, swept, re-drove or discarded what,
    // written in the action's own transaction.
    (
        "20261128000000_idem_audit.sql",
        include_str!("../migrations/20261128000000_idem_audit.sql"),
    ),
    // The outbox's attempt history: the last ten failed publishes of each event.
    (
        "20261128000001_idem_outbox_errors.sql",
        include_str!("../migrations/20261128000001_idem_outbox_errors.sql"),
    ),
    // The requests table (`completable = true`): what a request that made a step needs
    // to be completed by the service when its client went away.
    (
        "20261128000002_idempotency_requests.sql",
        include_str!("../migrations/20261128000002_idempotency_requests.sql"),
    ),
    // The request's per-field hashes beside its steps and its stored copy: a deploy
    // that reorders or adds `fields` still resumes a request that recorded a step.
    (
        "20261129000000_idem_field_hashes.sql",
        include_str!("../migrations/20261129000000_idem_field_hashes.sql"),
    ),
];

/// The columns idem reads and writes, with the types it accepts for each, as PostgreSQL's
/// `format_type` names them.
const COLUMNS: &[(&str, &[&str])] = &[
    ("scope", &["text"]),
    ("principal", &["text", "uuid", "bigint"]),
    ("key", &["text"]),
    ("fingerprint", &["bytea"]),
    ("field_hashes", &["bytea"]),
    ("status", &["smallint"]),
    ("headers", &["bytea"]),
    ("body", &["bytea"]),
    ("created_at", &["timestamp with time zone"]),
    ("expires_at", &["timestamp with time zone"]),
];

/// Why [`Store::verify`](crate::Store::verify) failed. Each message names the table and what is wrong with it.
#[derive(Debug)]
#[non_exhaustive]
pub enum VerifyError {
    /// The database could not be asked.
    Database(sqlx::Error),
    /// One of idem's tables (the idempotency table, the outbox, the steps table, the
    /// audit table) does not exist.
    MissingTable {
        /// The table, as configured.
        table: String,
    },
    /// The table lacks a column this version of idem uses: a migration has not run.
    MissingColumn {
        /// The table, as configured.
        table: String,
        /// The missing column.
        column: &'static str,
    },
    /// A column has a type idem cannot use.
    WrongType {
        /// The table, as configured.
        table: String,
        /// The column.
        column: &'static str,
        /// Its type in the database.
        found: String,
        /// The types idem accepts for it.
        expected: &'static [&'static str],
    },
    /// The primary key idem's claim relies on is missing or named differently.
    MissingPrimaryKey {
        /// The table, as configured.
        table: String,
        /// The constraint idem expects.
        constraint: String,
    },
    /// PostgreSQL is reached through a pooler in transaction mode, and the store names
    /// its statements ([`Pooler::Session`](crate::Pooler::Session)): the first requests
    /// would fail on another client's `sqlx_s_1`.
    TransactionPooler {
        /// What showed it: server processes that changed under one client connection, or
        /// PostgreSQL refusing a named prepared statement.
        evidence: String,
    },
    /// The database is a distributed engine (Citus), and the store is not portable: its
    /// claim sets custom settings that the nodes running it never see.
    NotPortable {
        /// The engine and its version, as it reports them.
        engine: String,
    },
    /// The session is read-only (`default_transaction_read_only` set for the database or
    /// the role, or a standby): idem could not write a key's row.
    ReadOnly,
    /// The role the store connects as lacks privileges idem needs on its tables.
    Privileges {
        /// The role (`current_user`), quoted as SQL writes it where it must be.
        role: String,
        /// Each table (as the store names it) or sequence (as the database does), with the
        /// privileges missing on it.
        missing: Vec<(String, Vec<String>)>,
    },
    /// The store is portable on a distributed engine, but its table is not distributed by
    /// `principal`: a request's claim and its business writes are not one node's
    /// transaction.
    NotDistributed {
        /// The table, as configured.
        table: String,
        /// How the engine keeps it: "a local table", "a reference table", "distributed
        /// by `x`".
        found: String,
    },
}

const FIX: &str = "run `Store::migrate()` at startup, or add idem's migrations \
                   (`idem::schema::MIGRATIONS`, idem-runtime/migrations/) to your own";

/// Where the guide explains the production settings.
const PRODUCTION: &str = "the guide's \"Topologies\"";

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Database(e) => write!(f, "cannot check the idempotency table: {e}"),
            Self::MissingTable { table } => {
                write!(f, "idem's table `{table}` does not exist: {FIX}")
            }
            Self::MissingColumn { table, column } => write!(
                f,
                "idem's table `{table}` has no column `{column}` (it is older than this \
                 version of idem): {FIX}"
            ),
            Self::WrongType {
                table,
                column,
                found,
                expected,
            } => write!(
                f,
                "column `{column}` of the idempotency table `{table}` is `{found}`, \
                 expected {}",
                expected.join(" or ")
            ),
            Self::MissingPrimaryKey { table, constraint } => write!(
                f,
                "the idempotency table `{table}` lacks its primary key `{constraint}` on \
                 (scope, principal, key): {FIX}"
            ),
            Self::TransactionPooler { evidence } => write!(
                f,
                "PostgreSQL is reached through a pooler in transaction mode (PgBouncer \
                 `pool_mode = transaction` or alike: {evidence}), but the store names its \
                 prepared statements: build it with `.pooler(Pooler::Transaction)` and give \
                 the pool `statement_cache_capacity(0)` ({PRODUCTION}, \"Behind a transaction \
                 pooler\")"
            ),
            Self::ReadOnly => write!(
                f,
                "the store's sessions are read-only (transaction_read_only is on: \
                 default_transaction_read_only set for the database or the role, or a \
                 standby), and idem writes a key's row for each request: connect to a \
                 writable primary, or set default_transaction_read_only = off for the \
                 service's role"
            ),
            Self::Privileges { role, missing } => {
                let lacks: Vec<String> = missing
                    .iter()
                    .map(|(object, privileges)| format!("{} on {object}", privileges.join(", ")))
                    .collect();
                // One GRANT per set of missing privileges, each naming every object
                // that lacks that set (a sequence lacks USAGE, and is granted it as one).
                let mut grants: Vec<(String, Vec<&str>)> = Vec::new();
                for (object, privileges) in missing {
                    let on = if privileges.iter().any(|p| p == "USAGE") {
                        "USAGE ON SEQUENCE".to_owned()
                    } else {
                        format!("{} ON", privileges.join(", "))
                    };
                    match grants.iter_mut().find(|(what, _)| *what == on) {
                        Some((_, objects)) => objects.push(object),
                        None => grants.push((on, vec![object])),
                    }
                }
                let grants: Vec<String> = grants
                    .iter()
                    .map(|(on, objects)| format!("GRANT {on} {} TO {role}", objects.join(", ")))
                    .collect();
                write!(
                    f,
                    "the role {role} lacks privileges idem needs: {}; grant them with `{}`",
                    lacks.join("; "),
                    grants.join("; ")
                )
            }
            Self::NotPortable { engine } => write!(
                f,
                "the database is distributed ({engine}), but the store is not portable: build \
                 it with `.portable(true)` and distribute its table by principal ({PRODUCTION}, \
                 \"Distributed PostgreSQL (Citus)\")"
            ),
            Self::NotDistributed { table, found } => write!(
                f,
                "the idempotency table `{table}` is {found}, not distributed by `principal`: \
                 call `store.distribute(Some(\"<your tenant table>\"))` after \
                 `store.migrate()` ({PRODUCTION}, \"Distributed PostgreSQL (Citus)\")"
            ),
        }
    }
}

impl std::error::Error for VerifyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Database(e) => Some(e),
            _ => None,
        }
    }
}

impl From<sqlx::Error> for VerifyError {
    fn from(e: sqlx::Error) -> Self {
        Self::Database(e)
    }
}

impl Store {
    /// Creates idem's tables and their indexes, if they do not exist, and brings them up
    /// to date ([`Store::schema`](crate::Store::schema)). Safe to call from several processes starting at
    /// once.
    pub async fn migrate(&self) -> Result<(), sqlx::Error> {
        let pool = &self.inner.pool;
        self.inner.table.create(pool).await?;
        self.inner.outbox.create(pool).await?;
        crate::table::create(pool, &statement(self.steps().ddl().to_owned())).await?;
        crate::table::create(pool, &statement(self.inner.requests.ddl().to_owned())).await?;
        crate::table::create(pool, self.inner.audit.ddl()).await
    }

    /// Checks that this store suits the database it reaches: call it at startup after
    /// your migrations, so that a mistake stops the service with one line naming it and
    /// its fix, instead of failing its first idempotent request. It checks, in order:
    ///
    /// - a store in the default [`Pooler::Session`](crate::Pooler::Session) mode is not
    ///   behind a pooler in transaction mode ([`VerifyError::TransactionPooler`]): two
    ///   connections of its own ask for their server process with `pg_backend_pid()`,
    ///   and one client's transactions landing on different server processes (or two
    ///   clients' on one) gives the pooler away; so does PostgreSQL refusing one of the
    ///   checks' named statements ("prepared statement \"sqlx_s_1\" already exists",
    ///   42P05, or "does not exist", 26000);
    /// - the table exists with every column this version of idem uses, of a usable type,
    ///   and its primary key (the catalog: `to_regclass`, `pg_attribute`,
    ///   `pg_constraint`); the outbox, the steps table (on the step pool, if it has its
    ///   own) and the audit table exist too ([`VerifyError::MissingTable`]), and the
    ///   outbox has the columns of its later migrations ([`VerifyError::MissingColumn`]);
    /// - the session is writable ([`VerifyError::ReadOnly`]: `default_transaction_read_only`
    ///   set for the database or the role, or a standby), and the role it connects as may
    ///   read, insert, update and delete in each of idem's tables, and read and
    ///   insert in the audit table, whose rows are never changed
    ///   ([`VerifyError::Privileges`], `has_table_privilege`); a
    ///   [`step_pool`](crate::StoreBuilder::step_pool) of its own is checked the same for
    ///   the steps table;
    /// - on a distributed engine, found by Citus's function `citus_version()`, the store
    ///   is portable ([`VerifyError::NotPortable`]) and its table is hash-distributed by
    ///   `principal` ([`VerifyError::NotDistributed`]), as Citus's metadata table
    ///   `pg_dist_partition` and its function `column_to_column_name` say.
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store) -> Result<(), Box<dyn std::error::Error>> {
    /// store.verify().await?; // "idem's table `idempotency_keys` does not exist: ..."
    /// # Ok(()) }
    /// ```
    pub async fn verify(&self) -> Result<(), VerifyError> {
        // Behind a transaction pooler: unnamed statements, in a transaction of their own
        // (a named one collides with another client's of the same name on a shared server
        // connection: "prepared statement \"sqlx_s_1\" already exists").
        let persistent = self.inner.table.persistent();
        if persistent {
            // First, before any named statement could fail for the same reason.
            let options = self.inner.pool.connect_options();
            if let Some(evidence) = deployment::transaction_pooler(&options).await? {
                return Err(VerifyError::TransactionPooler { evidence });
            }
        }
        self.verify_table(persistent).await.map_err(|e| match e {
            VerifyError::Database(e)
                if persistent && deployment::is_prepared_statement_clash(&e) =>
            {
                VerifyError::TransactionPooler {
                    evidence: format!("PostgreSQL answered {e}"),
                }
            }
            e => e,
        })
    }

    /// [`Store::verify`](crate::Store::verify) past the pooler probe: the table, and the distributed engine.
    async fn verify_table(&self, persistent: bool) -> Result<(), VerifyError> {
        let name = &self.inner.table_name;
        let table = name.to_string();
        let qualified = name.qualified();
        let mut conn = self.inner.table.single(&self.inner.pool).await?;
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(&qualified)
            .persistent(persistent)
            .fetch_one(&mut *conn)
            .await?;
        if !exists {
            return Err(VerifyError::MissingTable { table });
        }
        let found: Vec<(String, String)> = sqlx::query_as(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) \
             FROM pg_attribute a \
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
        )
        .bind(&qualified)
        .persistent(persistent)
        .fetch_all(&mut *conn)
        .await?;
        for &(column, expected) in COLUMNS {
            match found.iter().find(|(name, _)| name == column) {
                None => {
                    return Err(VerifyError::MissingColumn { table, column });
                }
                Some((_, ty)) if !expected.contains(&ty.as_str()) => {
                    return Err(VerifyError::WrongType {
                        table,
                        column,
                        found: ty.clone(),
                        expected,
                    });
                }
                Some(_) => {}
            }
        }
        let constraint = format!("{}_pkey", name.name());
        let has_key: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_constraint \
             WHERE conrelid = to_regclass($1) AND contype = 'p' AND conname = $2)",
        )
        .bind(&qualified)
        .bind(&constraint)
        .persistent(persistent)
        .fetch_one(&mut *conn)
        .await?;
        if !has_key {
            return Err(VerifyError::MissingPrimaryKey { table, constraint });
        }
        // idem's other tables, each created by a migration of its own: without one, the
        // first event, step or operator action fails. A step pool of its own may reach
        // another database: its table is looked for there, below.
        let mut others = vec![
            (
                self.inner.outbox.qualified().to_owned(),
                self.inner.outbox.qualified().replace('"', ""),
            ),
            (
                self.inner.audit_table.qualified(),
                self.inner.audit_table.to_string(),
            ),
        ];
        if !self.inner.step_pool_given {
            others.extend(self.step_tables());
        }
        missing_table(&mut conn, persistent, &others).await?;
        // The outbox's later columns: without them, the relay's mark of a failed publish
        // fails (a migration that has not run).
        let outbox = self.inner.outbox.qualified().to_owned();
        missing_column(&mut conn, persistent, &outbox, &OUTBOX_COLUMNS).await?;
        if !self.inner.step_pool_given {
            self.step_columns(&mut conn, persistent).await?;
        }
        let audit = self.inner.audit_table.qualified();
        let tables = [
            (self.inner.table_name.qualified(), &PRIVILEGES[..]),
            (self.inner.outbox.qualified().to_owned(), &PRIVILEGES[..]),
            (self.inner.steps_table.qualified(), &PRIVILEGES[..]),
            (self.inner.requests_table.qualified(), &PRIVILEGES[..]),
            (audit.clone(), &AUDIT_PRIVILEGES[..]),
        ];
        let sequences = [
            (self.inner.outbox.qualified().to_owned(), "seq"),
            (audit, "id"),
        ];
        self.verify_session(&mut conn, persistent, &tables, &sequences)
            .await?;
        // A step pool of its own (another role, or another host) records the steps.
        if self.inner.step_pool_given {
            let mut steps = self.inner.table.single(self.outside()).await?;
            missing_table(&mut steps, persistent, &self.step_tables()).await?;
            self.step_columns(&mut steps, persistent).await?;
            let tables = [
                (self.inner.steps_table.qualified(), &PRIVILEGES[..]),
                (self.inner.requests_table.qualified(), &PRIVILEGES[..]),
            ];
            self.verify_session(&mut steps, persistent, &tables, &[])
                .await?;
            steps.finish().await?;
        }
        let outcome = match deployment::distributed_engine(&mut conn, persistent).await? {
            None => Ok(()),
            Some(engine) if !self.inner.table.portable() => {
                Err(VerifyError::NotPortable { engine })
            }
            Some(_) => match deployment::distribution(&mut conn, persistent, &qualified).await? {
                Some((method, Some(column))) if method == "h" && column == "principal" => Ok(()),
                found => Err(VerifyError::NotDistributed {
                    table,
                    found: deployment::describe(found),
                }),
            },
        };
        conn.finish().await?;
        outcome
    }
}

/// The first of `tables` (each as qualified, and as configured) that does not exist, as
/// [`VerifyError::MissingTable`].
impl Store {
    /// The tables written beside the steps, on the step pool: the steps and the stored
    /// requests. Each as (qualified, as named).
    fn step_tables(&self) -> [(String, String); 2] {
        [
            (
                self.inner.steps_table.qualified(),
                self.inner.steps_table.to_string(),
            ),
            (
                self.inner.requests_table.qualified(),
                self.inner.requests_table.to_string(),
            ),
        ]
    }
}

impl Store {
    /// The steps' and stored requests' columns added after their first migrations
    /// ([`STEP_COLUMNS`]), as [`VerifyError::MissingColumn`].
    async fn step_columns(
        &self,
        conn: &mut crate::table::Single,
        persistent: bool,
    ) -> Result<(), VerifyError> {
        for (qualified, _) in self.step_tables() {
            missing_column(conn, persistent, &qualified, &STEP_COLUMNS).await?;
        }
        Ok(())
    }
}

/// The first of `columns` that `table` (qualified) lacks, if it exists, as
/// [`VerifyError::MissingColumn`]: a later migration has not run.
async fn missing_column(
    conn: &mut crate::table::Single,
    persistent: bool,
    table: &str,
    columns: &[&'static str],
) -> Result<(), VerifyError> {
    let missing: Option<String> = sqlx::query_scalar(COLUMN_MISSING)
        .bind(table)
        .bind(columns.iter().map(|c| (*c).to_owned()).collect::<Vec<_>>())
        .persistent(persistent)
        .fetch_optional(&mut **conn)
        .await?;
    match missing.and_then(|name| columns.iter().find(|c| **c == name)) {
        Some(column) => Err(VerifyError::MissingColumn {
            table: table.to_owned(),
            column,
        }),
        None => Ok(()),
    }
}

async fn missing_table(
    conn: &mut crate::table::Single,
    persistent: bool,
    tables: &[(String, String)],
) -> Result<(), VerifyError> {
    for (qualified, table) in tables {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(qualified)
            .persistent(persistent)
            .fetch_one(&mut **conn)
            .await?;
        if !exists {
            return Err(VerifyError::MissingTable {
                table: table.clone(),
            });
        }
    }
    Ok(())
}

/// The outbox's columns added after its first migration, which [`Store::verify`](crate::Store::verify) checks.
const OUTBOX_COLUMNS: [&str; 2] = ["error_at", "errors"];

/// The steps' and the stored requests' columns added after their first migrations.
const STEP_COLUMNS: [&str; 1] = ["field_hashes"];

/// The first of the columns $2 that the table $1 lacks, if it exists and lacks one.
const COLUMN_MISSING: &str = "\
SELECT c.name FROM unnest($2::text[]) WITH ORDINALITY AS c(name, i)
 WHERE to_regclass($1) IS NOT NULL
   AND NOT EXISTS (SELECT 1 FROM pg_attribute AS a
                    WHERE a.attrelid = to_regclass($1) AND a.attname = c.name
                      AND a.attnum > 0 AND NOT a.attisdropped)
 ORDER BY c.i LIMIT 1";

/// Each of idem's tables that exists, and the privileges on it that the store's role
/// lacks, in the order given: $1 the tables and $2 the privileges, pair by pair.
const MISSING_PRIVILEGES: &str = "\
SELECT t.name::text, t.privilege
  FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS t(name, privilege, i)
 WHERE to_regclass(t.name) IS NOT NULL
   AND NOT has_table_privilege(to_regclass(t.name), t.privilege)
 ORDER BY t.i";

/// The sequences of serial columns ($1 the tables, $2 their columns, pair by pair) of the
/// tables that exist, which the role may not use: an insert takes their next value (an
/// event's `seq`, an audit row's `id`).
const MISSING_SEQUENCE_USAGE: &str = "\
SELECT seq FROM (SELECT CASE WHEN to_regclass(t.name) IS NOT NULL
                             THEN pg_get_serial_sequence(t.name, t.col) END AS seq, t.i
                   FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS t(name, col, i)) s
 WHERE seq IS NOT NULL AND NOT has_sequence_privilege(seq, 'USAGE')
 ORDER BY i";

/// What idem does to each of its tables: claims and replays read, requests insert and
/// complete their rows, sweeps and the relay delete.
const PRIVILEGES: [&str; 4] = ["SELECT", "INSERT", "UPDATE", "DELETE"];

/// What idem does to the audit table: actions insert their rows, the trail is read; no
/// row is changed or deleted.
const AUDIT_PRIVILEGES: [&str; 2] = ["SELECT", "INSERT"];

impl Store {
    /// [`Store::verify`](crate::Store::verify)'s checks of a session (invariant 12): writable, and its role
    /// allowed what idem does to each of `tables` that exists (each with its privileges),
    /// and to use the sequences of the serial columns `sequences` (each a table and its
    /// column).
    async fn verify_session(
        &self,
        conn: &mut crate::table::Single,
        persistent: bool,
        tables: &[(String, &[&str])],
        sequences: &[(String, &str)],
    ) -> Result<(), VerifyError> {
        let (role, read_only): (String, String) = sqlx::query_as(
            "SELECT quote_ident(current_user), current_setting('transaction_read_only')",
        )
        .persistent(persistent)
        .fetch_one(&mut **conn)
        .await?;
        if read_only == "on" {
            return Err(VerifyError::ReadOnly);
        }
        let (names, privileges): (Vec<String>, Vec<String>) = tables
            .iter()
            .flat_map(|(table, privileges)| {
                privileges
                    .iter()
                    .map(move |privilege| (table.clone(), (*privilege).to_owned()))
            })
            .unzip();
        let rows: Vec<(String, String)> = sqlx::query_as(MISSING_PRIVILEGES)
            .bind(names)
            .bind(privileges)
            .persistent(persistent)
            .fetch_all(&mut **conn)
            .await?;
        let sequences: Vec<String> = if sequences.is_empty() {
            Vec::new()
        } else {
            let (tables, columns): (Vec<String>, Vec<String>) = sequences
                .iter()
                .map(|(table, column)| (table.clone(), (*column).to_owned()))
                .unzip();
            sqlx::query_scalar(MISSING_SEQUENCE_USAGE)
                .bind(tables)
                .bind(columns)
                .persistent(persistent)
                .fetch_all(&mut **conn)
                .await?
        };
        let mut missing: Vec<(String, Vec<String>)> = Vec::new();
        let sequences = sequences.into_iter().map(|name| (name, "USAGE".to_owned()));
        for (table, privilege) in rows.into_iter().chain(sequences) {
            match missing.last_mut() {
                Some((last, privileges)) if *last == table => privileges.push(privilege),
                _ => missing.push((table, vec![privilege])),
            }
        }
        if missing.is_empty() {
            Ok(())
        } else {
            Err(VerifyError::Privileges { role, missing })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_migrations_are_the_schema_store_migrate_runs() {
        let [(_, keys), (_, outbox), (_, steps), (_, heads), (_, audit), (_, errors), (_, requests), (_, hashes)] =
            MIGRATIONS
        else {
            panic!("eight migrations so far")
        };
        assert_eq!(*keys, crate::table::SCHEMA_SQL);
        // The steps' and the requests' schemas are their first files, then the later
        // file's column.
        for (schema, first, table) in [
            (
                crate::table::steps::STEPS_SCHEMA_SQL,
                steps,
                "\"idempotency_steps\"",
            ),
            (
                crate::table::requests::REQUESTS_SCHEMA_SQL,
                requests,
                "\"idempotency_requests\"",
            ),
        ] {
            assert!(schema.starts_with(first), "{table}");
            let alter = format!("ALTER TABLE {table} ADD COLUMN IF NOT EXISTS field_hashes bytea;");
            assert!(
                hashes.contains(&alter) && schema.trim_end().ends_with(&alter),
                "{table}"
            );
        }
        assert_eq!(*audit, crate::table::audit::AUDIT_SCHEMA_SQL);
        // The outbox's schema is its first file with the later one's index in place of
        // the index it replaced.
        let first_index = outbox
            .find("-- The relay's scan")
            .expect("the first file's indexes");
        let upgrade = heads.find("CREATE INDEX").expect("the later file's index");
        assert!(crate::table::outbox::OUTBOX_SCHEMA_SQL.starts_with(&outbox[..first_index]));
        assert!(crate::table::outbox::OUTBOX_SCHEMA_SQL.contains(&heads[upgrade..]));
        let history = errors.find("ALTER TABLE").expect("the history's columns");
        assert!(crate::table::outbox::OUTBOX_SCHEMA_SQL.ends_with(&errors[history..]));
    }

    #[test]
    fn every_shipped_file_is_listed() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .expect("migrations/")
            .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
            .collect();
        files.sort();
        let listed: Vec<&str> = MIGRATIONS.iter().map(|(name, _)| *name).collect();
        assert_eq!(files, listed);
    }
}

//! The request's transaction, opened with idem's first statement in the same message.
//!
//! sqlx's `Transaction` sends `BEGIN` as a message of its own and reads no rows from it,
//! so the claim would cost a round trip after it. An [`OpenTransaction`] sends `BEGIN`
//! and the claim in one simple-query message ([`OpenTransaction::begin`]), and the key's
//! row with `COMMIT` in another ([`OpenTransaction::finish`]): idem's work rides the two
//! round trips the transaction needs anyway.
//!
//! In the default mode those statements are prepared once per connection ([`Prepared`],
//! SQL `PREPARE`) and the messages `EXECUTE` them with their values written in: the
//! server plans them once per connection instead of once per request. A connection that
//! has not prepared them (new, or reset by a session pooler's `DISCARD ALL`) answers the
//! first message with 26000; it is prepared then and the message sent again.
//!
//! Invariant 7 (cancellation-safe) holds as with sqlx's `Transaction`: dropped before it
//! ends (a client gone, a timeout, a panic), it rolls back, in a task of its own so that
//! no drop waits; the connection returns to the pool only after its `ROLLBACK`, and is
//! closed instead when that fails or no runtime is left to send it.

use crate::sqlstate;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row};

/// SQLSTATE of an `EXECUTE` of a statement the connection has not prepared.
const NOT_PREPARED: &str = sqlstate::INVALID_SQL_STATEMENT_NAME;

/// What a `COMMIT` that idem did not send answers, in the message of its error: one line
/// that says what to write instead.
pub(crate) const REFUSED_COMMIT: &str = "idem refused this COMMIT: an idempotent request's \
transaction commits when its handler returns, with its key; run this unit of work on the \
connection it is given, without begin() and commit()";

/// The guard against a `COMMIT` that idem did not send (invariant 6), declared in the
/// message that begins the transaction. A holdable cursor is run to its end by the
/// `COMMIT` of its transaction; this one's only row casts text to an integer, so that
/// `COMMIT` fails (22P02, [`REFUSED_COMMIT`] in its message) and rolls everything back
/// instead: the handler's writes never commit without the key's record. `random()` keeps
/// PostgreSQL from folding the cast when it plans the cursor. idem's own `COMMIT`
/// closes the guard first ([`guarded`]).
///
/// This is what turns sqlx's nested unit of work into an error before anything commits:
/// idem's `BEGIN` is its own SQL, so sqlx's transaction depth on the connection reads 0,
/// and `conn.begin()` on the request's connection sends `BEGIN` (a warning inside a
/// transaction) and then a real `COMMIT`, not `SAVEPOINT` and `RELEASE`. Making sqlx count
/// idem's transaction would cost a round trip per request ([`crate::engine`]'s budget).
/// The cursor costs none: it rides the two messages the transaction sends anyway (a
/// transaction pooler keeps it with the transaction). In the portable mode it rides the
/// claim's message instead ([`crate::table::Table::claim_guarded`]), not the one that
/// begins the transaction: that one sets its waits with `SET LOCAL`, which Citus
/// propagates to the workers (`citus.propagate_set_commands = 'local'`) by sending them
/// the message's whole text, so a worker would declare the cursor too and end its
/// transaction (Citus's own `COMMIT`) without idem's `CLOSE`: its session kept the cursor,
/// and its next message failed ("cursor already exists"; seen on Citus 13).
const GUARD: &str = "DECLARE idem_guard CURSOR WITH HOLD FOR \
SELECT CAST(CASE WHEN random() >= 0 THEN $refused$";

/// `sql`, which ends with `COMMIT`, with the guard closed before its `COMMIT`. A
/// transaction the work ended itself has no guard left: `CLOSE` fails (34000), and
/// PostgreSQL skips the `COMMIT`.
fn guarded(sql: &str) -> String {
    let head = sql.strip_suffix("COMMIT");
    debug_assert!(
        head.is_some(),
        "a finishing message ends with COMMIT: {sql}"
    );
    format!("{}CLOSE idem_guard;\nCOMMIT", head.unwrap_or(sql))
}

/// `sql` with the guard's `DECLARE` after it, its message written in.
pub(crate) fn with_guard(mut sql: String) -> String {
    for part in [";\n", GUARD, REFUSED_COMMIT, "$refused$ END AS integer)"] {
        sql.push_str(part);
    }
    sql
}

/// A set of statements that messages `EXECUTE` by name on connections that prepare them
/// the first time they lack them. Their names are `idem_` and a hash of the whole set, so
/// that two stores whose statements differ (another table, another principal type) never
/// share a name, and two that are the same share the set.
pub(crate) struct Prepared {
    /// The names' common beginning: `idem_`, the set's hash in hex, `_`.
    prefix: String,
    /// Each statement's role, name and `PREPARE`.
    statements: Vec<(String, String, String)>,
    /// How many of `statements`, from the first, the messages cannot do without; the
    /// others are prepared each on its own, and one that cannot be (its table is not
    /// there: a store that never writes an event need not have an outbox table) is left
    /// out, as its first use would fail anyway.
    required: usize,
    /// The tables the statements name without their schema, quoted (`"idempotency_keys"`):
    /// each connection prepares the statements with the schema its `search_path` finds
    /// them in written before them ([`qualify`]), so that no later change of the path
    /// (a handler's `SET LOCAL search_path = tenant2`) changes what they name. A prepared
    /// statement is otherwise analyzed again under the new path (invariant 12).
    unqualified: Vec<String>,
}

impl Prepared {
    /// The set of `statements`: each a role (the last part of its name), its parameters'
    /// types and its text. Only idem's own statements, whose text has no request data.
    /// The first `required` are prepared together; a failure to prepare them fails the
    /// message that needed them.
    pub(crate) fn new(statements: &[(&str, &str, &str)], required: usize) -> Self {
        let mut hasher = Sha256::new();
        for (role, types, sql) in statements {
            for part in [role, types, sql] {
                hasher.update((part.len() as u64).to_be_bytes());
                hasher.update(part.as_bytes());
            }
        }
        let digest = hasher.finalize();
        let set: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        let prefix = format!("idem_{set}_");
        Self {
            statements: statements
                .iter()
                .map(|(role, types, sql)| {
                    let name = format!("{prefix}{role}");
                    let prepare = format!("PREPARE {name} ({types}) AS\n{sql}");
                    ((*role).to_owned(), name, prepare)
                })
                .collect(),
            prefix,
            required,
            unqualified: Vec::new(),
        }
    }

    /// The set, its statements' tables named without their schema being `tables` (each
    /// quoted, as the statements write it).
    pub(crate) fn qualifying(mut self, tables: Vec<String>) -> Self {
        self.unqualified = tables;
        self
    }

    /// The name of the statement of `role`, if the set has one.
    pub(crate) fn get(&self, role: &str) -> Option<&str> {
        self.statements
            .iter()
            .find(|(r, _, _)| r == role)
            .map(|(_, name, _)| name.as_str())
    }

    /// Prepares on `conn` those of the set it lacks, after a message that needed them
    /// failed (its transaction is rolled back first): asked, not assumed, so that a
    /// connection holding part of the set (another store's, or one whose handler let go
    /// of some) does not fail on a name it has.
    async fn prepare(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        self.prepare_after(conn, "ROLLBACK;\n").await
    }

    /// Prepares on `conn`, which is in no transaction, those of the set it lacks: for a
    /// transaction whose first message executes none of them, but whose later ones
    /// may (an abandon's undos, [`crate::engine::hold_abandoning`]).
    pub(crate) async fn ensure(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        self.prepare_after(conn, "").await
    }

    /// [`Prepared::prepare`], its first message beginning with `head`.
    async fn prepare_after(&self, conn: &mut PgConnection, head: &str) -> Result<(), sqlx::Error> {
        // The prefix is letters, digits and `_`.
        let sql = format!(
            "{head}SELECT name FROM pg_prepared_statements WHERE starts_with(name, '{}')",
            self.prefix
        );
        let held: Vec<String> = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()?;
        let schemas = self.schemas(conn).await?;
        let missing = |statements: &[(String, String, String)]| -> Vec<String> {
            statements
                .iter()
                .filter(|(_, name, _)| !held.contains(name))
                .map(|(_, _, prepare)| {
                    schemas
                        .iter()
                        .fold(prepare.clone(), |sql, (table, schema)| {
                            qualify(&sql, table, schema)
                        })
                })
                .collect()
        };
        let (required, optional) = self
            .statements
            .split_at(self.required.min(self.statements.len()));
        let required = missing(required);
        if !required.is_empty() {
            sqlx::raw_sql(AssertSqlSafe(required.join(";\n")))
                .execute(&mut *conn)
                .await?;
        }
        for prepare in missing(optional) {
            if let Err(error) = sqlx::raw_sql(AssertSqlSafe(prepare))
                .execute(&mut *conn)
                .await
            {
                tracing::debug!(%error, "idem: a statement riding the claim's messages was not prepared");
            }
        }
        Ok(())
    }

    /// The schema, quoted, of each table of [`Self::unqualified`] that `conn`'s
    /// `search_path` finds, in one statement. A table it does not find is left out: the
    /// statements that name it fail to prepare, as they would fail to run.
    async fn schemas(&self, conn: &mut PgConnection) -> Result<Vec<(String, String)>, sqlx::Error> {
        if self.unqualified.is_empty() {
            return Ok(Vec::new());
        }
        sqlx::query_as(
            "SELECT t.name, format('%I', n.nspname) FROM unnest($1::text[]) AS t (name) \
               JOIN pg_class c ON c.oid = to_regclass(t.name) \
               JOIN pg_namespace n ON n.oid = c.relnamespace",
        )
        .bind(&self.unqualified)
        .fetch_all(conn)
        .await
    }
}

/// `sql` with `schema` and a `.` written before each `table` (quoted) that has no schema
/// of its own there.
fn qualify(sql: &str, table: &str, schema: &str) -> String {
    let mut out = String::with_capacity(sql.len() + schema.len() * 2);
    let mut rest = sql;
    while let Some(at) = rest.find(table) {
        out.push_str(&rest[..at]);
        if !out.ends_with('.') {
            out.push_str(schema);
            out.push('.');
        }
        out.push_str(table);
        rest = &rest[at + table.len()..];
    }
    out.push_str(rest);
    out
}

/// Whether `error` is an `EXECUTE` of a statement the connection has not prepared.
fn not_prepared(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.code().as_deref() == Some(NOT_PREPARED))
}

/// Whether `error` answered a finishing message whose transaction had lost its guard: the
/// work ended the transaction itself (a raw `ROLLBACK`), or closed idem's cursor.
pub(crate) fn is_unguarded(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if e.code().as_deref() == Some(INVALID_CURSOR))
}

/// SQLSTATE of a `CLOSE` of a cursor the session does not have.
const INVALID_CURSOR: &str = sqlstate::INVALID_CURSOR_NAME;

/// An open transaction on a connection of the pool; rolled back unless it ends.
pub(crate) struct OpenTransaction {
    conn: Option<PoolConnection<Postgres>>,
    /// Whether its first message declared the guard ([`GUARD`]), which its finishing
    /// message closes.
    guarded: bool,
}

impl OpenTransaction {
    /// Sends `sql`, which begins a transaction and may go on with more statements, in one
    /// message on `conn`, with the guard against a `COMMIT` idem did not send after them
    /// where `guard` ([`GUARD`]), and returns the rows they return. When `sql` executes
    /// statements of `prepared` and the connection lacks them, they are prepared and
    /// `sql` is sent again (once per connection). On an error the transaction is rolled
    /// back (by the drop).
    pub(crate) async fn begin(
        conn: PoolConnection<Postgres>,
        sql: String,
        prepared: Option<&Prepared>,
        guard: bool,
    ) -> Result<(Self, Vec<PgRow>), sqlx::Error> {
        let mut open = Self {
            conn: Some(conn),
            guarded: guard,
        };
        // Shared, not copied: sent again only when the connection lacked the statements.
        let sql = Arc::new(if guard { with_guard(sql) } else { sql });
        let rows = match sqlx::raw_sql(AssertSqlSafe(Arc::clone(&sql)))
            .fetch_all(&mut *open)
            .await
        {
            Err(error) if not_prepared(&error) => {
                let Some(prepared) = prepared else {
                    return Err(error);
                };
                prepared.prepare(&mut open).await?;
                sqlx::raw_sql(AssertSqlSafe(sql))
                    .fetch_all(&mut *open)
                    .await?
            }
            rows => rows?,
        };
        Ok((open, rows))
    }

    /// Sends `sql`, which ends the transaction (with `COMMIT`, after what must commit
    /// with it), in one message, the guard closed just before its `COMMIT` ([`guarded`]);
    /// the transaction is over whatever it answers: on an error PostgreSQL skipped the
    /// rest of the message, and the drop of what is left rolls back.
    ///
    /// When `sql` executes a statement of `prepared` that the connection no longer has
    /// (the handler let go of it: `DEALLOCATE`), this request fails, rolled back and
    /// retryable, and the connection is prepared again for the next.
    pub(crate) async fn finish(
        mut self,
        sql: String,
        prepared: Option<&Prepared>,
    ) -> Result<(), sqlx::Error> {
        let sql = if self.guarded { guarded(&sql) } else { sql };
        let result = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *self).await;
        match &result {
            // Committed: the connection goes back to the pool as it is.
            Ok(_) => drop(self.conn.take()),
            Err(error) if not_prepared(error) => {
                if let Some(prepared) = prepared {
                    // Rolled back and prepared: the connection goes back as it is.
                    if prepared.prepare(&mut self).await.is_ok() {
                        drop(self.conn.take());
                    }
                }
            }
            Err(_) => {}
        }
        result.map(drop)
    }

    /// Records that a later message of the transaction declared the guard (the portable
    /// mode's claim, [`crate::table::Table::claim_guarded`]): its finishing message closes
    /// it.
    pub(crate) fn guarded_since_claim(&mut self) {
        self.guarded = true;
    }

    /// `COMMIT`.
    pub(crate) async fn commit(self) -> Result<(), sqlx::Error> {
        self.finish("COMMIT".to_owned(), None).await
    }

    /// `ROLLBACK`, answered.
    pub(crate) async fn rollback(mut self) -> Result<(), sqlx::Error> {
        let result = sqlx::raw_sql("ROLLBACK").execute(&mut *self).await;
        if result.is_ok() {
            self.conn.take();
        }
        result.map(drop)
    }
}

impl Deref for OpenTransaction {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        // Only `finish`, `rollback` and the drop take the connection, and each consumes
        // the transaction.
        self.conn
            .as_deref()
            .expect("an open transaction has its connection")
    }
}

impl DerefMut for OpenTransaction {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn
            .as_deref_mut()
            .expect("an open transaction has its connection")
    }
}

impl Drop for OpenTransaction {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    // A statement dropped mid-flight is drained first by sqlx. A failed
                    // ROLLBACK leaves the connection in doubt: it is closed, and the
                    // server rolls back what it held.
                    if sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.is_err() {
                        conn.close_on_drop();
                    }
                });
            }
            Err(_) => conn.close_on_drop(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_is_named_by_its_text() {
        let a = Prepared::new(
            &[("take", "text", "SELECT $1"), ("ride", "text", "SELECT 2")],
            1,
        );
        let same = Prepared::new(
            &[("take", "text", "SELECT $1"), ("ride", "text", "SELECT 2")],
            1,
        );
        let other = Prepared::new(
            &[("take", "text", "SELECT $1"), ("ride", "text", "SELECT 3")],
            1,
        );
        let take = a.get("take").unwrap();
        assert!(
            take.starts_with("idem_") && take.ends_with("_take"),
            "{take}"
        );
        assert!(take.len() <= 63, "an identifier PostgreSQL keeps whole");
        assert!(take
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'));
        assert_eq!(Some(take), same.get("take"));
        // Another statement anywhere in the set: every name changes, so that a
        // connection never holds half of one set under the other's names.
        assert_ne!(Some(take), other.get("take"));
        assert_eq!(a.get("insert"), None);
        assert_eq!(
            a.statements[0].2,
            format!("PREPARE {take} (text) AS\nSELECT $1")
        );
    }

    #[test]
    fn a_table_without_its_schema_gets_the_one_found() {
        assert_eq!(
            qualify(
                r#"INSERT INTO "k" SELECT 1 FROM "k", "s"."k", "k_other", "kk""#,
                r#""k""#,
                r#""app""#
            ),
            r#"INSERT INTO "app"."k" SELECT 1 FROM "app"."k", "s"."k", "k_other", "kk""#
        );
    }
}

//! What sits between a store and its data, found at [`Store::verify`](crate::Store::verify): a pooler in
//! transaction mode, a distributed engine. Either one needs a setting of the store
//! ([`Pooler::Transaction`], [`StoreBuilder::portable`](crate::StoreBuilder::portable)); without it, the service
//! answers 500 to ordinary requests instead of refusing to start.
//!
//! [`Store::verify`](crate::Store::verify): crate::Store::verify
//! [`Pooler::Transaction`]: crate::Pooler::Transaction
//! [`StoreBuilder::portable`](crate::StoreBuilder::portable): crate::StoreBuilder::portable

use crate::sqlstate;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection, Row};

/// Whether consecutive transactions of one client connection run on different server
/// processes, as behind a pooler in transaction mode (PgBouncer's `pool_mode =
/// transaction`, and the like); `Some` with what shows it.
///
/// Two client connections of their own (not the pool's, so a pool of one connection
/// does not wait on itself) ask for their server process (`pg_backend_pid()`): `a`,
/// then `b`, then `a` again, each asking in a transaction of its own. Reaching PostgreSQL
/// directly or through a pooler in session mode, each client keeps its own server
/// process: `b` differs from `a`, and `a` answers the same twice. A pooler in transaction
/// mode lends whichever server connection is free: `b` gets the one `a` just gave back,
/// or `a` gets another one the second time. Every statement goes by the simple
/// protocol, so the probe prepares nothing, whatever the pooler does with names.
pub(crate) async fn transaction_pooler(
    options: &PgConnectOptions,
) -> Result<Option<String>, sqlx::Error> {
    let mut a = PgConnection::connect_with(options).await?;
    let mut b = PgConnection::connect_with(options).await?;
    let first = backend(&mut a).await?;
    let other = backend(&mut b).await?;
    let again = backend(&mut a).await?;
    a.close().await.ok();
    b.close().await.ok();
    Ok(if other == first {
        Some(format!(
            "two client connections ran on one server process, {first}"
        ))
    } else if again != first {
        Some(format!(
            "one client connection ran on server process {first}, then on {again}"
        ))
    } else {
        None
    })
}

/// The server process of `conn`'s next transaction.
async fn backend(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
    let row = sqlx::raw_sql("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await?;
    row.try_get(0)
}

/// Whether `error` is PostgreSQL refusing a named prepared statement: one of that name
/// exists already (42P05) or none does (26000). Through a pooler in transaction mode
/// that is another client's statement on a shared server connection, or a statement
/// prepared on a server connection this client no longer has.
pub(crate) fn is_prepared_statement_clash(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e) if matches!(e.code().as_deref(), Some(sqlstate::DUPLICATE_PREPARED_STATEMENT | sqlstate::INVALID_SQL_STATEMENT_NAME)))
}

/// The distributed engine this connection reaches, if any: Citus, found by its
/// `citus_version()` function (in `pg_catalog` where the extension is installed).
pub(crate) async fn distributed_engine(
    conn: &mut PgConnection,
    persistent: bool,
) -> Result<Option<String>, sqlx::Error> {
    let present: bool = sqlx::query_scalar("SELECT to_regprocedure('citus_version()') IS NOT NULL")
        .persistent(persistent)
        .fetch_one(&mut *conn)
        .await?;
    if !present {
        return Ok(None);
    }
    let version: String = sqlx::query_scalar("SELECT citus_version()::text")
        .persistent(persistent)
        .fetch_one(&mut *conn)
        .await?;
    Ok(Some(version))
}

/// How Citus distributes `qualified`: `None` when it does not (a local table), else the
/// method (`h` hash, `n` reference ...) and the distribution column, from its metadata
/// table `pg_dist_partition` and its function `column_to_column_name`.
pub(crate) async fn distribution(
    conn: &mut PgConnection,
    persistent: bool,
    qualified: &str,
) -> Result<Option<(String, Option<String>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT partmethod::text, column_to_column_name(logicalrelid, partkey) \
         FROM pg_dist_partition WHERE logicalrelid = to_regclass($1)",
    )
    .bind(qualified)
    .persistent(persistent)
    .fetch_optional(&mut *conn)
    .await
}

/// [`distribution`]'s answer in words, for [`VerifyError::NotDistributed`]: "a local
/// table", "a reference table", "distributed by `x`".
///
/// [`VerifyError::NotDistributed`]: crate::VerifyError::NotDistributed
pub(crate) fn describe(found: Option<(String, Option<String>)>) -> String {
    match found {
        None => "a local table".into(),
        Some((method, _)) if method == "n" => "a reference table".into(),
        Some((_, Some(column))) => format!("distributed by `{column}`"),
        Some((method, None)) => format!("distributed (method {method:?})"),
    }
}

//! A database of one's own per test, made and dropped around the test as
//! `#[sqlx::test]` does.
//!
//! Not `#[sqlx::test]` itself: it runs each test on a current-thread runtime (these tests
//! race requests on a multi-threaded one), makes every pool of a test binary share 20
//! connections, requires `DATABASE_URL`, and names a database after its test, so that two
//! checkouts running the suite against one server drop each other's databases.

use std::panic::AssertUnwindSafe;
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::FutureExt;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgConnection, PgPool};

/// `DATABASE_URL`, or a local trust-auth PostgreSQL.
fn server_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// The server tests run against, connected to the database `DATABASE_URL` names.
pub fn admin_options() -> PgConnectOptions {
    PgConnectOptions::from_str(&server_url())
        .unwrap_or_else(|e| panic!("DATABASE_URL is not a PostgreSQL URL: {e}"))
        .disable_statement_logging()
}

/// An empty database on the server, until [`TestDb::drop_database`].
#[derive(Debug)]
pub struct TestDb {
    /// The database's name.
    pub name: String,
    /// Options that connect to it.
    pub options: PgConnectOptions,
}

impl TestDb {
    /// Creates an empty database under a name no other test, process or checkout uses.
    pub async fn create() -> Self {
        Self::create_with("").await
    }

    /// [`TestDb::create`] with the server encoding `encoding` (`SQL_ASCII`, `LATIN1`: from
    /// `template0`, with the C locale, which fits every encoding).
    pub async fn create_encoded(encoding: &str) -> Self {
        Self::create_with(&format!(
            " ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"
        ))
        .await
    }

    /// `CREATE DATABASE <a new name><options>`.
    async fn create_with(options: &str) -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(
            "idem_test_{}_{}_{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = PgConnection::connect_with(&admin_options())
            .await
            .expect("cannot reach PostgreSQL: is it running, and DATABASE_URL right?");
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE DATABASE {name}{options}")))
            .execute(&mut admin)
            .await
            .expect("create test database");
        admin.close().await.ok();
        let options = admin_options().database(&name);
        Self { name, options }
    }

    /// Drops the database, ending any connection still open on it.
    pub async fn drop_database(self) -> Result<(), sqlx::Error> {
        let mut admin = PgConnection::connect_with(&admin_options()).await?;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&mut admin)
        .await?;
        admin.close().await
    }

    /// `DATABASE_URL` with this database in its path, for processes of their own.
    pub fn url(&self) -> String {
        let mut url = reqwest::Url::parse(&server_url())
            .unwrap_or_else(|e| panic!("DATABASE_URL is not a URL: {e}"));
        url.set_path(&self.name);
        url.into()
    }

    /// `ALTER DATABASE .. SET setting = 'value'`: the default of the connections opened
    /// after it, as a database's owner sets it.
    pub async fn set_default(&self, setting: &str, value: &str) {
        let mut admin = PgConnection::connect_with(&self.options)
            .await
            .expect("connect to test database");
        sqlx::raw_sql(AssertSqlSafe(format!(
            "ALTER DATABASE {} SET {setting} = '{value}'",
            self.name
        )))
        .execute(&mut admin)
        .await
        .unwrap_or_else(|e| panic!("SET {setting} = '{value}' on the database: {e}"));
        admin.close().await.ok();
    }

    /// A pool on this database, with the given size and a short acquire timeout.
    pub async fn pool(&self, max_connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(3))
            .connect_with(self.options.clone())
            .await
            .expect("connect to test database")
    }
}

/// Runs `test` on a fresh database, then drops the database, also when `test` panics.
///
/// The drop waits for the test, on the test's own runtime: a `Drop` impl could only
/// block on a runtime of its own.
pub async fn with_test_db(test: impl AsyncFnOnce(&TestDb)) {
    with_db(TestDb::create().await, test).await;
}

/// [`with_test_db`] on a database of the server encoding `encoding`
/// ([`TestDb::create_encoded`]).
pub async fn with_test_db_encoded(encoding: &str, test: impl AsyncFnOnce(&TestDb)) {
    with_db(TestDb::create_encoded(encoding).await, test).await;
}

async fn with_db(db: TestDb, test: impl AsyncFnOnce(&TestDb)) {
    let outcome = AssertUnwindSafe(test(&db)).catch_unwind().await;
    let name = db.name.clone();
    if let Err(e) = db.drop_database().await {
        eprintln!("warning: could not drop test database {name}: {e}");
    }
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// Counts the rows of a table (or any `FROM` clause).
pub async fn count(pool: &PgPool, from: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {from}")))
        .fetch_one(pool)
        .await
        .expect("count")
}

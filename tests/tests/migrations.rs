//! The idempotency table the sqlx way: idem's shipped migrations run by sqlx's own
//! `Migrator` and `#[sqlx::test(migrations = ..)]`, and `Store::verify` naming what is
//! wrong with a missing or outdated table, against a real PostgreSQL.

use std::path::Path;

use axum::extract::FromRef;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use idem::schema;
use idem::schema::MIGRATIONS;
use idem::{idempotent, Store, Tx, VerifyError};
use idem_tests::{with_test_db, TestApp};
use sqlx::migrate::Migrator;
use sqlx::{AssertSqlSafe, PgPool};

/// idem's migrations, as a user's `#[sqlx::test]` names its own `migrations/` directory.
#[sqlx::test(migrations = "../idem-runtime/migrations")]
async fn sqlx_test_with_idems_migrations_serves_idempotent_requests(pool: PgPool) {
    let store = Store::new(pool.clone());
    store.verify().await.expect("the migrated table verifies");

    #[derive(Clone, FromRef)]
    struct AppState {
        idempotency: Store,
    }
    #[idempotent(scope = "notes")]
    async fn create(mut tx: Tx) -> Result<StatusCode, String> {
        sqlx::query("SELECT 1")
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        Ok(StatusCode::CREATED)
    }
    let app = Router::new()
        .route("/notes", post(create))
        .with_state(AppState { idempotency: store });
    let app = TestApp::serve(pool, app).await;
    let first = app.post("/notes", Some("k"), &serde_json::json!({})).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = app.post("/notes", Some("k"), &serde_json::json!({})).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(app.keys().await, 1);
}

/// A user's `migrations/` directory with idem's file copied in beside their own: one
/// sqlx migrator creates both, and `Store::migrate` afterwards changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn idems_file_in_a_users_migrations_directory() {
    with_test_db(async |db| {
        let dir = std::env::temp_dir().join(format!("idem-migrations-{}", db.name));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::write(
            dir.join("20250101000000_orders.sql"),
            "CREATE TABLE orders (id bigserial PRIMARY KEY);",
        )
        .expect("write");
        for (name, sql) in MIGRATIONS {
            std::fs::write(dir.join(name), sql).expect("write");
        }
        let pool = db.pool(2).await;
        let migrator = Migrator::new(Path::new(&dir)).await.expect("read dir");
        migrator.run(&pool).await.expect("run migrations");
        std::fs::remove_dir_all(&dir).ok();

        let store = Store::new(pool.clone());
        store.verify().await.expect("verifies");
        store.migrate().await.expect("migrate after the migrator");
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
            .fetch_one(&pool)
            .await
            .expect("count");
        assert_eq!(
            applied, 9,
            "the user's, idem's table, idem's outbox, idem's steps, the outbox's walk index, \
             idem's audit trail, the outbox's attempt history, idem's stored requests and \
             the steps' and requests' field hashes"
        );
        for table in [
            "idem_outbox",
            "idempotency_steps",
            "idem_audit",
            "idempotency_requests",
        ] {
            let rows: i64 =
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
                    .fetch_one(&pool)
                    .await
                    .expect(table);
            assert_eq!(rows, 0, "{table}");
        }
    })
    .await;
}

/// `keys` (the idempotency table's DDL, as a test made it), then idem's other tables, as
/// their migrations make them.
fn with_the_rest(keys: &str) -> String {
    let rest: Vec<&str> = MIGRATIONS[1..].iter().map(|(_, sql)| *sql).collect();
    format!("{keys}\n{}", rest.join("\n"))
}

/// `verify` on `setup`'s table, of a store with the default settings.
async fn verify_after(setup: &str) -> Result<(), VerifyError> {
    verify_with(setup, Store::new).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_table_is_named() {
    let error = verify_after("SELECT 1").await.expect_err("no table");
    assert!(
        matches!(error, VerifyError::MissingTable { .. }),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("`idempotency_keys` does not exist") && message.contains("migrate"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_column_is_named() {
    let setup = format!(
        "{}\nALTER TABLE idempotency_keys DROP COLUMN field_hashes;",
        schema::DEFAULT.keys_sql
    );
    let error = verify_after(&setup).await.expect_err("no column");
    assert!(
        matches!(
            error,
            VerifyError::MissingColumn {
                column: "field_hashes",
                ..
            }
        ),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("no column `field_hashes`"),
        "{error}"
    );
}

/// An outbox made by the migrations before its attempt history: the relay would fail
/// to mark its first failed publish, so `verify` names the column.
#[tokio::test(flavor = "multi_thread")]
async fn an_outbox_without_its_attempt_history_is_named() {
    let without: String = MIGRATIONS
        .iter()
        .filter(|(name, _)| !name.ends_with("_idem_outbox_errors.sql"))
        .map(|(_, sql)| *sql)
        .collect::<Vec<_>>()
        .join("\n");
    let error = verify_after(&without).await.expect_err("no history");
    assert!(
        matches!(
            error,
            VerifyError::MissingColumn {
                column: "error_at",
                ..
            }
        ),
        "{error:?}"
    );
    assert!(error.to_string().contains("idem_outbox"), "{error}");
    let all: Vec<&str> = MIGRATIONS.iter().map(|(_, sql)| *sql).collect();
    verify_after(&all.join("\n"))
        .await
        .expect("every migration");
}

/// A store deployed before the migrations of idem's other tables ran: its first event,
/// step or audited action would fail, so `verify` names the table.
#[tokio::test(flavor = "multi_thread")]
async fn a_missing_audit_or_outbox_table_is_named() {
    let error = verify_after(schema::DEFAULT.keys_sql)
        .await
        .expect_err("no outbox");
    assert!(
        error.to_string().contains("`idem_outbox` does not exist"),
        "{error}"
    );
    let without_audit: Vec<&str> = MIGRATIONS
        .iter()
        .filter(|(name, _)| !name.ends_with("_idem_audit.sql"))
        .map(|(_, sql)| *sql)
        .collect();
    let error = verify_after(&without_audit.join("\n"))
        .await
        .expect_err("no audit table");
    assert!(
        matches!(&error, VerifyError::MissingTable { table } if table == "idem_audit"),
        "{error:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_column_of_the_wrong_type_is_named() {
    let setup = schema::DEFAULT
        .keys_sql
        .replace("status       smallint", "status       text");
    let error = verify_after(&setup).await.expect_err("wrong type");
    match &error {
        VerifyError::WrongType { column, found, .. } => {
            assert_eq!((*column, found.as_str()), ("status", "text"));
        }
        other => panic!("{other:?}"),
    }
    assert!(error.to_string().contains("expected smallint"), "{error}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_primary_key_is_named() {
    let setup = format!(
        "{}\nALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey;",
        schema::DEFAULT.keys_sql
    );
    let error = verify_after(&setup).await.expect_err("no primary key");
    assert!(
        matches!(error, VerifyError::MissingPrimaryKey { .. }),
        "{error:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_principal_of_type_uuid_or_bigint_verifies() {
    for ty in ["uuid", "bigint", "text"] {
        let setup = schema::DEFAULT
            .keys_sql
            .replace("principal    text", &format!("principal    {ty}"));
        assert!(setup.contains(&format!("principal    {ty}")));
        verify_after(&with_the_rest(&setup))
            .await
            .unwrap_or_else(|e| panic!("{ty}: {e}"));
    }
}

/// What `verify` reads of Citus, made by hand on plain PostgreSQL, so that these cases
/// run where Citus is not installed (`tests/tests/citus.rs` runs a real cluster): its `citus_version()` function, its metadata
/// table `pg_dist_partition` (one row per distributed table: method `h` hash or `n`
/// reference, and the distribution column in `partkey`) and `column_to_column_name`,
/// which here reads the column's name from `partkey` as given.
const SIMULATED_CITUS: &str = "
CREATE FUNCTION citus_version() RETURNS text LANGUAGE sql
    AS $$ SELECT 'Citus 13.0.1 (simulated)' $$;
CREATE TABLE pg_dist_partition (logicalrelid regclass, partmethod \"char\", partkey text);
CREATE FUNCTION column_to_column_name(regclass, text) RETURNS text LANGUAGE sql
    AS $$ SELECT $2 $$;
";

/// `verify` of `store` (built on a pool of a fresh database) after `setup`.
async fn verify_with(
    setup: &str,
    store: impl FnOnce(sqlx::PgPool) -> Store,
) -> Result<(), VerifyError> {
    let mut outcome = None;
    with_test_db(async |db| {
        let pool = db.pool(2).await;
        sqlx::raw_sql(AssertSqlSafe(setup))
            .execute(&pool)
            .await
            .expect("setup");
        outcome = Some(store(pool).verify().await);
    })
    .await;
    outcome.expect("ran")
}

fn portable(pool: sqlx::PgPool) -> Store {
    Store::builder(pool).portable(true).build().unwrap()
}

/// Issue 20: on Citus, a store that is not portable stops at `verify` with one line
/// naming the engine, the setting and the README section.
#[tokio::test(flavor = "multi_thread")]
async fn a_store_that_is_not_portable_on_citus_is_refused() {
    let setup = format!(
        "{}\n{SIMULATED_CITUS}",
        with_the_rest(schema::DEFAULT.keys_sql)
    );
    let error = verify_with(&setup, Store::new)
        .await
        .expect_err("not portable on Citus");
    assert!(
        matches!(error, VerifyError::NotPortable { .. }),
        "{error:?}"
    );
    assert_eq!(
        error.to_string(),
        "the database is distributed (Citus 13.0.1 (simulated)), but the store is not \
         portable: build it with `.portable(true)` and distribute its table by principal \
         (the guide's \"Topologies\", \"Distributed PostgreSQL (Citus)\")"
    );
}

/// Issue 20: a portable store on Citus whose table is not distributed by `principal`
/// (local, a reference table, or by another column) stops at `verify`; distributed as
/// `Store::schema().keys_sql` says, it verifies. Without Citus, a portable store verifies.
#[tokio::test(flavor = "multi_thread")]
async fn a_portable_store_on_citus_needs_its_table_distributed_by_principal() {
    let citus = format!(
        "{}\n{SIMULATED_CITUS}",
        with_the_rest(schema::DEFAULT.keys_sql)
    );
    let distributed = |method: &str, column: &str| {
        format!(
            "{citus}\nINSERT INTO pg_dist_partition \
             VALUES ('idempotency_keys', '{method}', '{column}');"
        )
    };
    for (setup, found) in [
        (citus.clone(), "a local table"),
        (distributed("n", ""), "a reference table"),
        (distributed("h", "key"), "distributed by `key`"),
    ] {
        let error = verify_with(&setup, portable)
            .await
            .expect_err("not distributed by principal");
        assert!(
            matches!(error, VerifyError::NotDistributed { .. }),
            "{error:?}"
        );
        let message = error.to_string();
        assert!(
            message.starts_with(&format!(
                "the idempotency table `idempotency_keys` is {found}, not distributed by \
                 `principal`: call `store.distribute(Some(\"<your tenant table>\"))` \
                 after `store.migrate()`"
            )) && message.ends_with("\"Distributed PostgreSQL (Citus)\")"),
            "{message}"
        );
    }
    verify_with(&distributed("h", "principal"), portable)
        .await
        .expect("distributed by principal");
    verify_with(&with_the_rest(schema::DEFAULT.keys_sql), portable)
        .await
        .expect("portable on plain PostgreSQL");
}

/// Issue 23: `Store::distribute` does nothing on plain PostgreSQL, so a service can call
/// it at every start whatever it runs on; on Citus it refuses a store that is not
/// portable, as `verify` does (the real distribution is tested on a Citus cluster,
/// `tests/tests/citus.rs`).
#[tokio::test(flavor = "multi_thread")]
async fn distribute_is_a_no_op_on_plain_postgres_and_refuses_a_store_not_portable() {
    with_test_db(async |db| {
        let pool = db.pool(2).await;
        let store = portable(pool.clone());
        store.migrate().await.unwrap();
        assert_eq!(
            store.distribute(Some("accounts")).await.unwrap(),
            idem::schema::Distribution::SingleNode
        );
        store.verify().await.expect("portable on plain PostgreSQL");
        sqlx::raw_sql(AssertSqlSafe(SIMULATED_CITUS))
            .execute(&pool)
            .await
            .expect("simulate Citus");
        let error = Store::new(pool).distribute(None).await.unwrap_err();
        assert!(
            matches!(error, VerifyError::NotPortable { .. }),
            "{error:?}"
        );
    })
    .await;
}

//! The ledger the outbox tests consume into: a `credits` table, and a consumer's work
//! that books each credit once through `run_once`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idem::outbox::Received;
use idem::{OnceError, Pooler, Store};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::TestDb;

/// A credit the ledger consumer books.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Credit {
    /// The charge it credits.
    pub charge: i64,
    /// How much.
    pub amount: i64,
}

/// A pool of 10 on `db`, idem's tables, the `credits` table, and a store.
pub async fn ledger(db: &TestDb) -> (PgPool, Store) {
    let pool = db.pool(10).await;
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE credits (charge bigint NOT NULL, amount bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    (pool, store)
}

/// Books `credit` once (scope `ledger`); a negative amount fails the work.
pub async fn book(store: &Store, credit: &Received<Credit>) -> Result<(), OnceError<sqlx::Error>> {
    credit
        .once(store, "ledger")
        .run(async |mut tx| {
            if credit.payload().amount < 0 {
                return Err(sqlx::Error::Protocol("a negative credit".into()));
            }
            // Unnamed behind a transaction pooler (see `Store::pooler`).
            sqlx::query("INSERT INTO credits (charge, amount) VALUES ($1, $2)")
                .bind(credit.payload().charge)
                .bind(credit.payload().amount)
                .persistent(store.pooler() == Pooler::Session)
                .execute(&mut *tx)
                .await?;
            Ok::<_, sqlx::Error>(())
        })
        .await
}

/// The ledger's credits per charge, waited for until `n` charges are credited.
pub async fn credits(pool: &PgPool, n: usize, within: Duration) -> HashMap<i64, i64> {
    let deadline = Instant::now() + within;
    loop {
        let rows: Vec<(i64, i64)> =
            sqlx::query_as("SELECT charge, count(*) FROM credits GROUP BY charge")
                .fetch_all(pool)
                .await
                .unwrap();
        if rows.len() >= n || Instant::now() > deadline {
            return rows.into_iter().collect();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

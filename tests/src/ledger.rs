//! The ledger the outbox tests consume into: a `credits` table, a consumer's work that
//! books each credit once through `run_once`, and a database outage while it books.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::jobs::OnceError;
use idem::outbox::Received;
use idem::{Pooler, Store};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::{outage, TestDb};

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

/// The ids [`book`] booked (the keys of its scope), sorted.
pub async fn booked(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT key FROM idempotency_keys WHERE scope = 'ledger' ORDER BY key")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// What [`through_an_outage`] saw.
#[derive(Debug)]
pub struct Outage {
    /// Charges credited when the gate shut.
    pub credited_at_cut: usize,
    /// The work's attempts while it was shut.
    pub attempts: u64,
    /// From the gate's opening to the last credit.
    pub recovered_in: Duration,
}

/// Shuts the database away (`cut(true)`, a gate's `shut`) once `first` charges are
/// credited, keeps it away for [`outage`], brings it back (`cut(false)`), and waits for
/// charges `0..n` to be credited, each once (checked); `attempts` counts the work's
/// attempts.
pub async fn through_an_outage(
    pool: &PgPool,
    mut cut: impl AsyncFnMut(bool),
    attempts: &AtomicU64,
    first: usize,
    n: i64,
) -> Outage {
    let before = credits(pool, first, Duration::from_secs(20)).await;
    assert!(
        before.len() >= first,
        "credited before the outage: {before:?}"
    );
    cut(true).await;
    let credited_at_cut = credits(pool, 0, Duration::ZERO).await.len();
    let tried = attempts.load(Ordering::SeqCst);
    tokio::time::sleep(outage()).await;
    let attempts = attempts.load(Ordering::SeqCst) - tried;
    cut(false).await;
    let opened = Instant::now();
    let after = credits(pool, n as usize, Duration::from_secs(60)).await;
    let recovered_in = opened.elapsed();
    assert_eq!(
        after,
        (0..n).map(|c| (c, 1)).collect::<HashMap<_, _>>(),
        "each charge credited once after the outage"
    );
    Outage {
        credited_at_cut,
        attempts,
        recovered_in,
    }
}

//! A queue consumer: the same exactly-once guarantee without HTTP. Queues redeliver
//! (at least once); each message credits the ledger once, whatever the redeliveries.

use std::time::Duration;

use idem::jobs::OnceError;
use idem::Store;
use serde::{Deserialize, Serialize};

use crate::persistent;

/// A message on the ledger queue.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Credit {
    /// The message id, stable across redeliveries: the idempotency key.
    pub message_id: String,
    /// The account to credit.
    pub account: String,
    /// How much.
    pub amount: i64,
}

/// What handling a message produced, stored and returned again on redelivery.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Credited {
    /// The account's balance right after this credit.
    pub balance: i64,
}

/// Handles one delivery of `message`: credits once, then answers every redelivery with
/// the stored result. A redelivery that races the first waits for it (up to the store's
/// `conflict_wait`), or fails with [`OnceError::InUse`] and should be redelivered later.
pub async fn handle(store: &Store, message: &Credit) -> Result<Credited, OnceError<sqlx::Error>> {
    let week = Duration::from_secs(7 * 24 * 3600);
    // Named statements only where the store may prepare its own (see `Config::pooler`).
    let named = persistent(store.pooler());
    store
        .run_once("ledger_credits", &message.message_id)
        .ttl(week)
        .payload(message)
        // Kept on the account's shard, beside its ledger rows: one node's transaction.
        .spread_by(&message.account)
        .run(async |mut tx| {
            sqlx::query(
                "INSERT INTO ledger_entries (account, message_id, amount) VALUES ($1, $2, $3)",
            )
            .bind(&message.account)
            .bind(&message.message_id)
            .bind(message.amount)
            .persistent(named)
            .execute(&mut *tx)
            .await?;
            let balance: i64 = sqlx::query_scalar(
                "SELECT sum(amount)::bigint FROM ledger_entries WHERE account = $1",
            )
            .bind(&message.account)
            .persistent(named)
            .fetch_one(&mut *tx)
            .await?;
            Ok(Credited { balance })
        })
        .await
}

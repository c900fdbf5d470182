//! The request's transaction, opened with idem's first statement in the same message.
//!
//! sqlx's `Transaction` sends `BEGIN` as a message of its own and reads no rows from it,
//! so the claim would cost a round trip after it. An [`OpenTransaction`] sends `BEGIN`
//! and the claim in one simple-query message ([`OpenTransaction::begin`]), and the key's
//! row with `COMMIT` in another ([`OpenTransaction::finish`]): idem's work rides the two
//! round trips the transaction needs anyway.
//!
//! Invariant 7 (cancellation-safe) holds as with sqlx's `Transaction`: dropped before it
//! ends (a client gone, a timeout, a panic), it rolls back, in a task of its own so that
//! no drop waits; the connection returns to the pool only after its `ROLLBACK`, and is
//! closed instead when that fails or no runtime is left to send it.

use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, PgConnection, Postgres};

/// An open transaction on a connection of the pool; rolled back unless it ends.
pub(crate) struct OpenTransaction {
    conn: Option<PoolConnection<Postgres>>,
}

impl OpenTransaction {
    /// Sends `sql`, which begins a transaction and may go on with more statements, in one
    /// message on `conn`, and returns the rows they return. On an error the transaction
    /// is rolled back (by the drop).
    pub(crate) async fn begin(
        conn: PoolConnection<Postgres>,
        sql: String,
    ) -> Result<(Self, Vec<PgRow>), sqlx::Error> {
        let mut open = Self { conn: Some(conn) };
        let rows = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&mut *open)
            .await?;
        Ok((open, rows))
    }

    /// Sends `sql`, which ends the transaction (with `COMMIT`, after what must commit
    /// with it), in one message; the transaction is over whatever it answers: on an
    /// error PostgreSQL skipped the rest of the message, and the drop of what is left
    /// rolls back.
    pub(crate) async fn finish(mut self, sql: String) -> Result<(), sqlx::Error> {
        let result = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut *self).await;
        if result.is_ok() {
            // Committed: the connection goes back to the pool as it is.
            self.conn.take();
        }
        result.map(drop)
    }

    /// `COMMIT`.
    pub(crate) async fn commit(self) -> Result<(), sqlx::Error> {
        self.finish("COMMIT".to_owned()).await
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

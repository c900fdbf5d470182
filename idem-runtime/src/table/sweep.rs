//! The sweeper's statements: expired rows deleted in batches, each from where the last
//! stopped, in the default mode in one statement, in the portable mode one row at a time.

use super::*;
use crate::sqlstate;

/// Expired rows, oldest first, skipping rows a request is reclaiming. The outer
/// `expires_at` test is not redundant: it is re-checked on a row that changed while we
/// waited, which the subquery's is not. $1 the batch size, $2 where the previous batch of
/// the same purge stopped (`reached`, microseconds since the epoch; NULL for the first).
///
/// Issue 36: a deleted row's index entries stay until a vacuum, and each batch that
/// started from the oldest expiry walked every entry the batches before it had deleted:
/// at a million records the 200th batch read 7 470 buffers of the index against the
/// first's 40, and the purge slowed as it went. Each batch starts where the previous one
/// stopped, so it reads what it deletes. A row skipped there (a request holds it) waits
/// for the next purge, which starts from the oldest again.
pub(super) const PURGE: &str = "\
WITH gone AS (
DELETE FROM {table}
 WHERE (scope, principal, key) IN (
        SELECT scope, principal, key FROM {table}
         WHERE expires_at <= now() AND expires_at >= {reached}
         ORDER BY expires_at
         LIMIT $1
           FOR UPDATE SKIP LOCKED)
   AND expires_at <= now()
RETURNING expires_at)
SELECT count(*) AS deleted, {reaches} FROM gone";

/// Where a purge's batch starts: the expiry its previous batch reached ($2, microseconds
/// since the epoch, exact), or the oldest.
pub(crate) const REACHED: &str =
    "coalesce(timestamptz 'epoch' + $2::bigint * interval '1 microsecond', '-infinity')";

/// The latest expiry a purge's batch deleted, exactly, for the next [`REACHED`].
pub(crate) const REACHES: &str =
    "(extract(epoch FROM max(expires_at)) * 1000000)::bigint AS reached";

/// The oldest expired rows, read without locks: the candidates of a portable sweep. $1
/// the batch size.
pub(super) const EXPIRED_BATCH_PORTABLE: &str = "\
SELECT scope, principal::text AS principal, key,
       (extract(epoch FROM expires_at) * 1000000)::bigint AS reached
  FROM {table}
 WHERE expires_at <= now() AND expires_at >= {reached}
 ORDER BY expires_at
 LIMIT $1";

/// One expired row, by its primary key, in a transaction of its own, after `SET LOCAL
/// lock_timeout` ([`SWEEP_WAIT`]): the portable sweep. A distributed engine refuses row
/// locks across shards (`FOR UPDATE SKIP LOCKED`), and one `DELETE` of the whole batch
/// that waits for a row a request is taking over holds the locks of every row it already
/// deleted, so claims of those keys would wait behind it and be answered 409. One row
/// per statement holds no other row's lock; a row a request holds is skipped when the
/// wait expires, as `SKIP LOCKED` would skip it, and is not expired any more once that
/// request commits. Binds as [`FORGET`].
pub(super) const SWEEP_ONE_PORTABLE: &str = "\
DELETE FROM {table} WHERE scope = $1 AND principal = {p2} AND key = $3 AND expires_at <= now()";

/// How long a portable sweep waits for a row's lock before it leaves the row to a
/// later sweep: far below a claim's wait for an expired row (one second), so that no
/// claim waits for a sweep long enough to be answered 409.
pub(super) const SWEEP_WAIT: &str = "SET LOCAL lock_timeout = '50ms'";

impl Table {
    /// [`PURGE`]: how many rows one batch deleted, starting where the purge's previous
    /// batch stopped (`reached`, which it moves on; `None` for the first).
    /// In portable mode, [`EXPIRED_BATCH_PORTABLE`] and then [`SWEEP_ONE_PORTABLE`] for each
    /// row it found: one statement and one short transaction a row.
    pub(crate) async fn purge(
        &self,
        pool: &PgPool,
        batch_size: i64,
        reached: &mut Option<i64>,
    ) -> Result<u64, sqlx::Error> {
        if self.dialect.portable {
            return self.purge_portable(pool, batch_size, reached).await;
        }
        let mut conn = self.single(pool).await?;
        let row = self
            .query(&self.purge)
            .bind(batch_size)
            .bind(*reached)
            .fetch_one(&mut *conn)
            .await?;
        conn.finish().await?;
        purged(&row, reached)
    }

    pub(super) async fn purge_portable(
        &self,
        pool: &PgPool,
        batch_size: i64,
        reached: &mut Option<i64>,
    ) -> Result<u64, sqlx::Error> {
        let mut conn = self.single(pool).await?;
        let candidates = self
            .query(&self.purge)
            .bind(batch_size)
            .bind(*reached)
            .fetch_all(&mut *conn)
            .await?;
        conn.finish().await?;
        let mut deleted = 0;
        for row in candidates {
            let [scope, principal, key]: [String; 3] =
                [row.try_get(0)?, row.try_get(1)?, row.try_get(2)?];
            *reached = Some(row.try_get("reached")?);
            let mut tx = self.single_transaction(pool).await?;
            sqlx::Executor::execute(&mut *tx, SWEEP_WAIT).await?;
            let done = self
                .query(&self.sweep_one)
                .bind(&scope)
                .bind(&principal)
                .bind(&key)
                .execute(&mut *tx)
                .await;
            match done {
                Ok(done) => {
                    tx.commit().await?;
                    deleted += done.rows_affected();
                }
                // 55P03: a request holds the row; it is left for a later sweep.
                Err(sqlx::Error::Database(e))
                    if e.code().as_deref() == Some(sqlstate::LOCK_NOT_AVAILABLE) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(deleted)
    }

    /// A transaction of `pool`, waited for no longer than the store's `acquire_timeout`.
    pub(super) async fn single_transaction(
        &self,
        pool: &PgPool,
    ) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        self.bounded(pool.begin()).await
    }
}

/// A purge batch's row (`deleted`, and `reached` as [`REACHES`] writes it): how many rows
/// it deleted; `reached` becomes where it stopped, if it deleted any.
pub(crate) fn purged(row: &PgRow, reached: &mut Option<i64>) -> Result<u64, sqlx::Error> {
    if let Some(at) = row.try_get("reached")? {
        *reached = Some(at);
    }
    Ok(u64::try_from(row.try_get::<i64, _>("deleted")?).unwrap_or(0))
}

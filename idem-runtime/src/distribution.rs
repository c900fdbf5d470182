//! Distribution as code: [`Store::distribute`](crate::Store::distribute) spreads idem's table over a distributed
//! engine's nodes (Citus), so that a portable service starts on a fresh distributed
//! database with no SQL run by hand.

use crate::deployment;
use crate::migrate::VerifyError;
use crate::store::Store;

/// What [`Store::distribute`](crate::Store::distribute) found, or did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Distribution {
    /// The database is not distributed (plain PostgreSQL): nothing to do.
    SingleNode,
    /// The table was distributed by `principal` already (by another instance, or an
    /// earlier start).
    Existing,
    /// This call distributed the table by `principal`.
    Created,
}

impl Store {
    /// On a distributed engine (Citus, found by its function `citus_version()`),
    /// hash-distributes idem's table by `principal` (and its steps table, colocated with
    /// it), colocated with `colocate_with` (a
    /// distributed table whose distribution column has the [principal's
    /// type](crate::StoreBuilder::principal_type); `None`: Citus's default group for that
    /// type, which tables of one type and shard count share), so that a request's claim
    /// and its business writes keyed by the same value are one node's transaction. Run it
    /// after [`Store::migrate`](crate::Store::migrate); on plain PostgreSQL it does nothing
    /// ([`Distribution::SingleNode`]).
    ///
    /// Idempotent and safe from several instances starting at once: a transaction takes
    /// an advisory lock on the coordinator, reads Citus's metadata (`pg_dist_partition`),
    /// and calls `create_distributed_table` only if the table is still local. A store
    /// that is not [portable](crate::StoreBuilder::portable) is refused
    /// ([`VerifyError::NotPortable`]), and so is a table already distributed some other
    /// way ([`VerifyError::NotDistributed`]).
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store) -> Result<(), Box<dyn std::error::Error>> {
    /// store.migrate().await?;
    /// store.distribute(Some("accounts")).await?; // colocated with your tenant table
    /// store.verify().await?;
    /// # Ok(()) }
    /// ```
    pub async fn distribute(
        &self,
        colocate_with: Option<&str>,
    ) -> Result<Distribution, VerifyError> {
        let persistent = self.inner.table.persistent();
        let mut tx = self.inner.pool.begin().await?;
        if deployment::distributed_engine(&mut tx, persistent)
            .await?
            .is_none()
        {
            tx.commit().await?;
            return Ok(Distribution::SingleNode);
        }
        if !self.inner.table.portable() {
            let engine = deployment::distributed_engine(&mut tx, persistent)
                .await?
                .unwrap_or_default();
            return Err(VerifyError::NotPortable { engine });
        }
        let table = self.inner.table_name.to_string();
        let qualified = self.inner.table_name.qualified();
        // Instances starting at once take turns; the second finds the table distributed.
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem: distribute ' || $1))")
            .bind(&qualified)
            .persistent(persistent)
            .execute(&mut *tx)
            .await?;
        let done = match deployment::distribution(&mut tx, persistent, &qualified).await? {
            None => {
                sqlx::query(
                    "SELECT create_distributed_table(CAST($1 AS regclass), 'principal', \
                     colocate_with => coalesce($2, 'default'))",
                )
                .bind(&qualified)
                .bind(colocate_with)
                .persistent(persistent)
                .execute(&mut *tx)
                .await?;
                Distribution::Created
            }
            Some((method, Some(column))) if method == "h" && column == "principal" => {
                Distribution::Existing
            }
            found => {
                return Err(VerifyError::NotDistributed {
                    table,
                    found: deployment::describe(found),
                })
            }
        };
        // The steps and stored requests, colocated with the keys: a request's COMMIT
        // deletes its steps and its stored request on the node that holds its key.
        for beside in [
            self.inner.steps_table.qualified(),
            self.inner.requests_table.qualified(),
        ] {
            if deployment::distribution(&mut tx, persistent, &beside)
                .await?
                .is_none()
            {
                sqlx::query(
                    "SELECT create_distributed_table(CAST($1 AS regclass), 'principal', \
                     colocate_with => $2)",
                )
                .bind(&beside)
                .bind(&table)
                .persistent(persistent)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(done)
    }
}

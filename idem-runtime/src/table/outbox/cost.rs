//! Invariant 13, gated by counting work: the buffers the relay's take reads, at a small
//! and at a large backlog, on a real PostgreSQL (`DATABASE_URL`). Buffers, not time: a
//! slower machine reads the same. Each test has a schema of its own.

use sqlx::{AssertSqlSafe, PgPool};

use super::*;
use crate::table::cost::{buffers, drop_schema, pool, schema};

/// Pending events of the backlog, by how their ordering keys are spread.
#[derive(Debug, Clone, Copy)]
enum Keys {
    /// `k0` … `k{n-1}`, round-robin.
    Spread(u32),
    /// None: every event may go at once.
    Without,
}

/// An outbox table of its own holding `events` pending events.
async fn backlog(pool: &PgPool, events: i64, keys: Keys) -> (OutboxTable, String) {
    let schema = schema("outbox");
    let table = OutboxTable::new(
        TableName::parse(&format!("{schema}.outbox")).unwrap(),
        Dialect::default(),
        false,
        Duration::ZERO,
    );
    table.create(pool).await.expect("the outbox table");
    let key = match keys {
        Keys::Spread(n) => format!("'k' || (g % {n})"),
        Keys::Without => "NULL".into(),
    };
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (id, topic, ordering_key, payload)
         SELECT md5(g::text), 't', {key}, '\\x7b7d'::bytea FROM generate_series(1, $1) AS g",
        table.qualified()
    )))
    .bind(events)
    .execute(pool)
    .await
    .expect("the backlog");
    (table, schema)
}

/// `sql` (the take, or a plan of it) bound as the relay binds its take of `limit`
/// events, from the first key, in a transaction rolled back: the table is as it was.
async fn first_take(pool: &PgPool, sql: SqlStr, limit: i64) -> Vec<PgRow> {
    let mut tx = pool.begin().await.unwrap();
    let rows = sqlx::query(sql)
        .bind(limit)
        .bind(30.0_f64)
        .bind(1_i64)
        .bind(None::<i32>)
        .bind(None::<String>)
        .bind(limit * 4)
        .bind(None::<i64>)
        .fetch_all(&mut *tx)
        .await
        .expect("a take");
    tx.rollback().await.unwrap();
    rows
}

/// The shared buffers (hit or read) one take of `limit` events reads, from its plan
/// as `EXPLAIN (ANALYZE, BUFFERS)` counts them (the top node counts its children).
async fn take_buffers(pool: &PgPool, table: &OutboxTable, limit: i64) -> (u64, usize) {
    let sql = format!(
        "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) {}",
        table.claim.as_str()
    );
    let plan: Vec<String> = first_take(pool, statement(sql), limit)
        .await
        .iter()
        .map(|row| row.get(0))
        .collect();
    buffers(&plan)
}

/// Regression (issue 36): the take sorted every pending row, so that 20 000 events
/// drained four times slower per event than 5 000. Per event taken, a take at a
/// backlog of 50 000 reads no more than 1.5 times what it reads at 2 000, whatever the
/// spread of ordering keys: a thousand keys, one, a hundred thousand, none.
#[tokio::test(flavor = "multi_thread")]
async fn a_take_reads_as_much_at_a_large_backlog_as_at_a_small_one() {
    let pool = pool().await;
    for keys in [
        Keys::Spread(1_000),
        Keys::Spread(1),
        Keys::Spread(100_000),
        Keys::Without,
    ] {
        let mut per_event = Vec::new();
        for events in [2_000, 50_000] {
            let (table, schema) = backlog(&pool, events, keys).await;
            let (buffers, rows) = take_buffers(&pool, &table, 256).await;
            drop_schema(&pool, &schema).await;
            // The summary row is one of the rows.
            let taken = rows.saturating_sub(1).max(1);
            per_event.push((events, buffers, taken, buffers as f64 / taken as f64));
        }
        let [(_, _, _, small), (_, _, _, large)] = per_event[..] else {
            unreachable!()
        };
        assert!(
            large <= small * 1.5 + 2.0,
            "{keys:?}: buffers per event taken at 2 000 and 50 000 pending events \
             (events, buffers, taken, per event): {per_event:?}"
        );
    }
}

/// One take as the relay runs it, from the first key, rolled back: each row taken as
/// `(seq, ordering key, prev)`.
async fn take(pool: &PgPool, table: &OutboxTable, limit: i64) -> Vec<(i64, String, Option<i64>)> {
    let rows = first_take(pool, table.claim.clone(), limit).await;
    let mut taken: Vec<_> = rows
        .iter()
        .filter_map(|row| {
            let seq = row.get::<Option<i64>, _>("seq")?;
            Some((seq, row.get("ordering_key"), row.get("prev")))
        })
        .collect();
    taken.sort();
    taken
}

/// Regression (issue 36): a key with a backlog drained one event per round (a take, a
/// publish and a delete: 900 events/s for one key). A take now leases the events
/// behind each ready head, as many as fill it when shared among the keys, each linked
/// to the one before it, and stops a key's chain at its first row that is not ready.
#[tokio::test(flavor = "multi_thread")]
async fn a_take_leases_a_keys_events_behind_its_head_in_order() {
    let pool = pool().await;
    let (table, schema) = backlog(&pool, 1_000, Keys::Spread(2)).await;
    let taken = take(&pool, &table, 100).await;
    assert_eq!(taken.len(), 100, "{taken:?}");
    for key in ["k0", "k1"] {
        let chain: Vec<_> = taken.iter().filter(|(_, k, _)| k == key).collect();
        assert_eq!(chain.len(), 50, "{key}: {taken:?}");
        assert_eq!(chain[0].2, None, "{key}'s head");
        for pair in chain.windows(2) {
            assert_eq!(pair[1].2, Some(pair[0].0), "{key}: {chain:?}");
        }
    }
    // The 21st event of k0 leased elsewhere: k0's chain ends before it.
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET available_at = now() + interval '1 minute'
          WHERE seq = (SELECT seq FROM {0} WHERE ordering_key = 'k0' ORDER BY seq OFFSET 20 LIMIT 1)",
        table.qualified()
    )))
    .execute(&pool)
    .await
    .unwrap();
    let taken = take(&pool, &table, 100).await;
    let k0 = taken.iter().filter(|(_, k, _)| k == "k0").count();
    assert_eq!(k0, 20, "{taken:?}");
    // A thousand ready heads fill a take of 256 alone: no chains.
    drop_schema(&pool, &schema).await;
    let (table, schema) = backlog(&pool, 5_000, Keys::Spread(1_000)).await;
    let taken = take(&pool, &table, 256).await;
    assert_eq!(taken.len(), 256);
    assert!(taken.iter().all(|(_, _, prev)| prev.is_none()), "{taken:?}");
    drop_schema(&pool, &schema).await;
}

/// The rows of `table` updated, and of those HOT, as the transaction's backend counts
/// them so far (its counts not yet reported; they grow within a transaction).
async fn counts(tx: &mut sqlx::PgConnection, table: &OutboxTable) -> (i64, i64) {
    sqlx::query_as(
        "SELECT pg_stat_get_xact_tuples_updated(CAST($1 AS regclass)),
                pg_stat_get_xact_tuples_hot_updated(CAST($1 AS regclass))",
    )
    .bind(table.qualified())
    .fetch_one(tx)
    .await
    .unwrap()
}

/// Regression (issue 36): on full pages a take's lease wrote each row's new version
/// to another page, with an entry in each of the table's four indexes, and then its
/// delete left them all to vacuum: two and a half times the database's work per event
/// drained. With the pages half free (the DDL's `fillfactor`), nine in ten of a take's
/// updates stay on their page (HOT), takes after takes, as a relay drains.
#[tokio::test(flavor = "multi_thread")]
async fn a_takes_lease_updates_rows_in_place() {
    let pool = pool().await;
    let (table, schema) = backlog(&pool, 5_000, Keys::Spread(1_000)).await;
    let (mut updated, mut hot) = (0_i64, 0_i64);
    for token in 0..8_i64 {
        let mut tx = pool.begin().await.unwrap();
        let before = counts(&mut tx, &table).await;
        // The take as the relay runs it, each from the first key (its walk is the
        // relay's business), then the mark of what it took.
        let rows = sqlx::query(table.claim.clone())
            .bind(256_i64)
            .bind(30.0_f64)
            .bind(token)
            .bind(None::<i32>)
            .bind(None::<String>)
            .bind(1_024_i64)
            .bind(None::<i64>)
            .fetch_all(&mut *tx)
            .await
            .expect("a take");
        // The last row says where the walks stopped; its `seq` is NULL.
        let seqs: Vec<i64> = rows
            .iter()
            .filter_map(|row| row.get::<Option<i64>, _>("seq"))
            .collect();
        assert!(!seqs.is_empty(), "take {token} took nothing");
        let (all, in_place) = counts(&mut tx, &table).await;
        updated += all - before.0;
        hot += in_place - before.1;
        sqlx::query(table.done.clone())
            .bind(&seqs)
            .bind(token)
            .execute(&mut *tx)
            .await
            .expect("the mark");
        tx.commit().await.unwrap();
    }
    drop_schema(&pool, &schema).await;
    assert_eq!(updated, 8 * 256, "rows leased");
    assert!(
        hot * 10 >= updated * 9,
        "{hot} of {updated} leases were HOT updates"
    );
}

//! The outbox's figures (BENCHMARKS.md, "The outbox"), in one run on a database of its
//! own and a JetStream stream of its own (`NATS_URL`, default the machine's):
//!
//! 1. the cost of one event on a fresh request: the charges example over HTTP, fresh
//!    keys at a fixed concurrency, without events and with `charge.created` written to
//!    the outbox (a relay to JetStream running, as in production);
//! 2. the drain's cost curve: a pre-filled outbox drained by one relay to JetStream, at
//!    each backlog and spread of ordering keys;
//! 3. commit-to-consumer-commit latency: events written one by one at a steady rate, the
//!    relay woken by LISTEN/NOTIFY, the ledger consumer's `run_once` commit timed;
//! 4. the consumers' throughput: a backlog already in the stream, consumed by 1, 4 ...
//!    [`JetStreamConsumer`]s on one durable consumer, each event's work a `run_once`
//!    insert into a ledger.
//!
//! `cargo run --release -p idem-bench --bin outbox -- [--seconds N] [--batch N]
//! [--backlogs 5000,50000,500000 | --events N] [--keys 1000,1,100000,0]` (keys 0: events without an
//! ordering key; one key's curve stops at 50 000, a round per event) [--consume N]
//! [--consumers 1,4] (0: none) [--consumer-batch 1,32] [--fillfactor 50] (the outbox's) [--drain-only] (figures 2
//! and 4 only).

#[path = "../args.rs"]
mod args;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, stream};
use futures::stream::StreamExt;
use idem::outbox::nats::{JetStreamConsumer, JetStreamPublisher};
use idem::outbox::{Event, Received};
use idem::Store;
use idem_tests::{nats_url, percentiles, unique, TestApp, TestDb};
use serde::{Deserialize, Serialize};
use serde_json::json;

use args::{arg, list};

#[derive(Serialize, Deserialize)]
struct Stamp {
    /// Microseconds since the Unix epoch when the event's transaction was about to commit.
    sent_us: u64,
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Writes `events` pending events to the outbox in one statement, over `keys` ordering
/// keys round-robin (`None`: without one), after emptying it. Emptied by `TRUNCATE`, not
/// `DELETE`: each cell starts from a table and indexes without the dead entries of the
/// cells before it, as a table that autovacuum keeps does. (Without it, the index entries
/// of the million events drained before, not yet vacuumed, were walked by each take of a
/// later cell's: one ordering key drained at 45 events/s instead of 950.)
async fn fill(pool: &sqlx::PgPool, topic: &str, events: i64, keys: Option<i64>) {
    sqlx::query("TRUNCATE idem_outbox")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO idem_outbox (id, topic, ordering_key, payload)
         SELECT md5(random()::text || g), $1, 'k' || (g % $3), convert_to('{\"n\":' || g || '}', 'UTF8')
           FROM generate_series(1, $2) AS g",
    )
    .bind(topic)
    .bind(events)
    .bind(keys)
    .execute(pool)
    .await
    .unwrap();
}

const CONCURRENCY: usize = 16;

/// Figure 4: `events` events put in the stream by the relay, then, for each count in
/// `consumers`, a durable consumer of its own read by that many [`JetStreamConsumer`]s,
/// each event's work a `run_once` insert into a ledger, timed until every event committed.
async fn consume(
    pool: &sqlx::PgPool,
    store: &Store,
    js: &jetstream::Context,
    prefix: &str,
    events: u64,
    consumers: &[i64],
    batches: &[usize],
) {
    let subject = format!("{prefix}.consume");
    fill(pool, &subject, events as i64, Some(1_000)).await;
    let relayed = store
        .relay(JetStreamPublisher::new(js.clone()))
        .run_until_idle()
        .await
        .unwrap();
    assert_eq!(relayed.published, events, "every event in the stream");
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS consumed_credits (id text, run integer, PRIMARY KEY (run, id))",
    )
    .execute(pool)
    .await
    .unwrap();
    let stream = js.get_stream(prefix).await.unwrap();
    println!("\n4. JetStream consumers, {events} events already in the stream, each one `run_once` insert");
    println!("| consumers | fetched at once | events/s | µs per event |");
    println!("|---|---|---|---|");
    for (run, (&count, &batch)) in consumers
        .iter()
        .flat_map(|c| batches.iter().map(move |b| (c, b)))
        .enumerate()
    {
        let run = run as i32;
        let durable = format!("consume{run}");
        let consumer = stream
            .create_consumer(async_nats::jetstream::consumer::pull::Config {
                durable_name: Some(durable.clone()),
                filter_subject: subject.clone(),
                ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
                ..Default::default()
            })
            .await
            .unwrap();
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let started = Instant::now();
        let tasks: Vec<_> = (0..count)
            .map(|_| {
                let (store, js, consumer) = (store.clone(), js.clone(), consumer.clone());
                let (done, durable) = (Arc::clone(&done), durable.clone());
                tokio::spawn(async move {
                    JetStreamConsumer::new(js, consumer)
                        .batch(batch)
                        .run(async |event: Received<serde_json::Value>| {
                            let result = event
                                .once(&store, &durable)
                                .run(async |mut tx| {
                                    sqlx::query(
                                        "INSERT INTO consumed_credits (id, run) VALUES ($1, $2)",
                                    )
                                    .bind(event.id())
                                    .bind(run)
                                    .execute(&mut *tx)
                                    .await?;
                                    Ok::<_, sqlx::Error>(())
                                })
                                .await;
                            if result.is_ok() {
                                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            result
                        })
                        .await
                        .unwrap();
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(300);
        while done.load(std::sync::atomic::Ordering::Relaxed) < events && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let elapsed = started.elapsed().as_secs_f64();
        tasks.iter().for_each(tokio::task::JoinHandle::abort);
        let consumed: i64 =
            sqlx::query_scalar("SELECT count(*) FROM consumed_credits WHERE run = $1")
                .bind(run)
                .fetch_one(pool)
                .await
                .unwrap();
        assert_eq!(consumed as u64, events, "every event's work committed once");
        println!(
            "| {count} | {batch} | {:.0} | {:.1} |",
            events as f64 / elapsed,
            elapsed * 1e6 / events as f64
        );
    }
}

/// Fresh charges for `seconds` at `CONCURRENCY`: requests per second, p50 and p99 ms.
async fn fresh_charges(app: &TestApp, seconds: u64, tag: &str) -> (f64, f64, f64) {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    futures::stream::iter(0..CONCURRENCY)
        .for_each_concurrent(CONCURRENCY, |worker| {
            let latencies = Arc::clone(&latencies);
            async move {
                let mut n = 0;
                while Instant::now() < deadline {
                    let key = format!("{tag}-{worker}-{n}");
                    n += 1;
                    let body = json!({ "amount": 100, "currency": "usd", "customer": key });
                    let t = Instant::now();
                    let answer = app
                        .post_with(
                            "/charges",
                            Some(&key),
                            &body,
                            &[("authorization", "Bearer acct_1")],
                        )
                        .await;
                    assert_eq!(
                        answer.status,
                        201,
                        "{}",
                        String::from_utf8_lossy(&answer.body)
                    );
                    latencies.lock().unwrap().push(t.elapsed());
                }
            }
        })
        .await;
    let elapsed = started.elapsed().as_secs_f64();
    let mut latencies = latencies.lock().unwrap().clone();
    let rate = latencies.len() as f64 / elapsed;
    let (p50, p99) = percentiles(&mut latencies);
    (rate, p50, p99)
}

#[tokio::main]
async fn main() {
    let seconds = arg("--seconds", 5);
    let batch = arg("--batch", 256) as u32;
    // `--events N`, as the bench took before its curve, is one backlog.
    let backlogs = list("--backlogs", &list("--events", &[5_000, 50_000]));
    // Ordering keys: 0 stands for none.
    let spreads: Vec<Option<i64>> = list("--keys", &[1_000, 1, 100_000, 0])
        .into_iter()
        .map(|n| (n > 0).then_some(n))
        .collect();
    let db = TestDb::create().await;
    let pool = db.pool(24).await;
    charges::migrate(&pool).await.expect("migrate");
    // The outbox's pages half free (its migration) unless told otherwise: `--fillfactor
    // 100` measures the drain as it was before (full pages, no HOT lease updates).
    let fillfactor = arg("--fillfactor", 50);
    // A number: nothing to quote.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE idem_outbox SET (fillfactor = {fillfactor})"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let store = Store::new(pool.clone());
    let js = jetstream::new(async_nats::connect(nats_url()).await.expect("NATS"));
    let prefix = unique("bench");
    js.create_stream(stream::Config {
        name: prefix.clone(),
        subjects: vec![format!("{prefix}.>")],
        ..Default::default()
    })
    .await
    .expect("the stream");
    println!(
        "load average at start: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );

    // 2. The drain's cost curve: a backlog written by one statement, drained by one relay,
    //    at each size and spread of ordering keys (invariant 13: the rate is the same at
    //    every size).
    println!("\n2. relay to JetStream, batch {batch}: the drain at each backlog");
    println!("| ordering keys | backlog | events/s | µs per event | / smallest |");
    println!("|---|---|---|---|---|");
    for keys in spreads.iter().copied() {
        let mut smallest = None;
        for &size in &backlogs {
            // One ordering key's events are published one at a time, each after the one
            // before was acknowledged (per-key order), 256 a round: its curve stops at
            // 50 000.
            if keys == Some(1) && size > 50_000 {
                continue;
            }
            fill(&pool, &format!("{prefix}.throughput"), size, keys).await;
            let started = Instant::now();
            let stats = store
                .relay(JetStreamPublisher::new(js.clone()))
                .batch(batch)
                .run_until_idle()
                .await
                .unwrap();
            let elapsed = started.elapsed().as_secs_f64();
            let per_event = elapsed * 1e6 / stats.published.max(1) as f64;
            let first = *smallest.get_or_insert(per_event);
            println!(
                "| {} | {size} | {:.0} | {per_event:.1} | {:.2} |",
                keys.map_or("none".to_string(), |n| n.to_string()),
                stats.published as f64 / elapsed,
                per_event / first
            );
            assert_eq!(stats.published, size as u64, "every event published");
        }
    }

    // 4. The consumers' throughput.
    let consumers: Vec<i64> = list("--consumers", &[1, 4])
        .into_iter()
        .filter(|&n| n > 0)
        .collect();
    if !consumers.is_empty() {
        let events = arg("--consume", 5_000);
        // 1: one message at a time, as the consumer pulled before issue 36.
        let batches: Vec<usize> = list("--consumer-batch", &[1, 32])
            .into_iter()
            .map(|n| n.max(1) as usize)
            .collect();
        consume(&pool, &store, &js, &prefix, events, &consumers, &batches).await;
    }

    if args::flag("--drain-only") {
        js.delete_stream(&prefix).await.ok();
        pool.close().await;
        db.drop_database().await.ok();
        return;
    }

    // 3. Commit to consumer commit, 100 events/s for `seconds` s.
    sqlx::query("CREATE TABLE IF NOT EXISTS latency_credits (id text PRIMARY KEY)")
        .execute(&pool)
        .await
        .unwrap();
    let stream = js.get_stream(&prefix).await.unwrap();
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("latency".into()),
            filter_subject: format!("{prefix}.latency"),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let consumer_task = {
        let store = store.clone();
        let latencies = Arc::clone(&latencies);
        let js = js.clone();
        tokio::spawn(async move {
            JetStreamConsumer::new(js, consumer)
                .run(async |event: Received<Stamp>| {
                    let result = event
                        .once(&store, "latency")
                        .run(async |mut tx| {
                            sqlx::query("INSERT INTO latency_credits (id) VALUES ($1)")
                                .bind(event.id())
                                .execute(&mut *tx)
                                .await?;
                            Ok::<_, sqlx::Error>(())
                        })
                        .await;
                    let us = now_us().saturating_sub(event.payload().sent_us);
                    latencies.lock().unwrap().push(Duration::from_micros(us));
                    result
                })
                .await
                .unwrap();
        })
    };
    let relay = store
        .relay(JetStreamPublisher::new(js.clone()))
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let total = seconds * 100;
    let mut ticks = tokio::time::interval(Duration::from_millis(10));
    let subject = format!("{prefix}.latency");
    for i in 0..total {
        ticks.tick().await;
        store
            .run_once("latency-writer", &format!("w{i}"))
            .run(async |mut tx| {
                tx.emit(Event::new(&subject, &Stamp { sent_us: now_us() }))
                    .await?;
                Ok::<_, sqlx::Error>(())
            })
            .await
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while (latencies.lock().unwrap().len() as u64) < total && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut measured = latencies.lock().unwrap().clone();
    let (p50, p99) = percentiles(&mut measured);
    println!(
        "3. commit to consumer commit (LISTEN/NOTIFY), {} events at 100/s: p50 {p50:.1} ms, p99 {p99:.1} ms",
        measured.len()
    );
    relay.stopped().await;
    consumer_task.abort();

    // 1. Fresh requests without and with an event, each twice, interleaved.
    let plain = charges::app(pool.clone(), charges::Config::default());
    let plain = TestApp::serve(pool.clone(), plain).await;
    let config = charges::Config {
        events: Some(prefix.clone()),
        ..charges::Config::default()
    };
    let evented = TestApp::serve(pool.clone(), charges::app(pool.clone(), config)).await;
    let config = charges::Config {
        events: Some(prefix.clone()),
        events_notify: false,
        ..charges::Config::default()
    };
    let quiet = TestApp::serve(pool.clone(), charges::app(pool.clone(), config)).await;
    // A NOTIFY per commit, as before issue 28 let one through per 5 ms.
    let config = charges::Config {
        events: Some(prefix.clone()),
        events_notify_interval: Some(Duration::ZERO),
        ..charges::Config::default()
    };
    let each = TestApp::serve(pool.clone(), charges::app(pool.clone(), config)).await;
    fresh_charges(&plain, 1, "warm").await;
    println!("\n1. fresh POST /charges, {CONCURRENCY} concurrent, {seconds} s per cell");
    println!("| round | cell | req/s | p50 ms | p99 ms | / without |");
    println!("|---|---|---|---|---|---|");
    for round in 1..=2 {
        let (r0, a50, a99) = fresh_charges(&plain, seconds, &format!("plain{round}")).await;
        println!("| {round} | without event | {r0:.0} | {a50:.1} | {a99:.1} | 1.00 |");
        // The write alone: no relay takes the rows during the cell.
        let (r1, b50, b99) = fresh_charges(&evented, seconds, &format!("event{round}")).await;
        println!(
            "| {round} | with event, no relay | {r1:.0} | {b50:.1} | {b99:.1} | {:.2} |",
            r1 / r0
        );
        sqlx::query("DELETE FROM idem_outbox")
            .execute(&pool)
            .await
            .unwrap();
        let (r4, e50, e99) = fresh_charges(&each, seconds, &format!("each{round}")).await;
        println!(
            "| {round} | with event, a NOTIFY per commit, no relay | {r4:.0} | {e50:.1} | {e99:.1} | {:.2} |",
            r4 / r0
        );
        sqlx::query("DELETE FROM idem_outbox")
            .execute(&pool)
            .await
            .unwrap();
        // Steady state: a relay to JetStream on the same two cores.
        let relay = store
            .relay(JetStreamPublisher::new(js.clone()))
            .spawn()
            .unwrap();
        let (r2, c50, c99) = fresh_charges(&evented, seconds, &format!("relayed{round}")).await;
        relay.stopped().await;
        println!(
            "| {round} | with event, relay running | {r2:.0} | {c50:.1} | {c99:.1} | {:.2} |",
            r2 / r0
        );
        // Without the NOTIFY each event sends (`outbox_notify(false)`), a relay polling
        // every 50 ms.
        let quiet_store = Store::builder(pool.clone())
            .outbox_notify(false)
            .build()
            .unwrap();
        let relay = quiet_store
            .relay(JetStreamPublisher::new(js.clone()))
            .every(Duration::from_millis(50))
            .spawn()
            .unwrap();
        let (r3, d50, d99) = fresh_charges(&quiet, seconds, &format!("quiet{round}")).await;
        relay.stopped().await;
        println!(
            "| {round} | with event, no NOTIFY, relay polling 50 ms | {r3:.0} | {d50:.1} | {d99:.1} | {:.2} |",
            r3 / r0
        );
    }

    println!(
        "load average at end: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    js.delete_stream(&prefix).await.ok();
    drop((plain, evented, quiet, each));
    pool.close().await;
    db.drop_database().await.ok();
}

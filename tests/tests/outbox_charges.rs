//! The charges example's events end to end: `POST /charges` and refunds write
//! `charge.created` / `charge.refunded` to idem's outbox in their own transactions, the
//! relay publishes them to JetStream, and the example's ledger consumer books them.
//! Under a storm of duplicate requests each committed charge yields one event in the
//! stream and one ledger entry; the same on PgBouncer in transaction mode (the relay
//! polls) and in portable mode.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use charges::events::ChargeEvent;
use charges::Config;
use futures::future::join_all;
use futures::stream::{self, StreamExt};
use idem::outbox::nats::MSG_ID;
use idem::testing::Gate;
use idem::{Pooler, Store};
use idem_tests::{gated_store, nats_url, outage, unique, with_test_db, Pgbouncer, TestApp};
use serde_json::json;
use sqlx::PgPool;

/// Keys and concurrent copies per key of the storm: small in the README's test command,
/// 500 × 20 with `OUTBOX_FULL=1` (RELIABILITY.md).
fn storm_size() -> (usize, usize) {
    if std::env::var_os("OUTBOX_FULL").is_some() {
        (500, 20)
    } else {
        (30, 6)
    }
}

/// The example with events under `prefix`, its relay and ledger consumer running.
async fn service(pool: PgPool, pooler: Pooler, portable: bool, prefix: &str) -> (TestApp, Store) {
    charges::migrate(&pool).await.expect("migrate");
    let config = Config {
        pooler,
        portable,
        processor_delay: Duration::from_millis(10),
        events: Some(prefix.to_owned()),
        ..Config::default()
    };
    let mut store = Store::builder(pool.clone()).pooler(pooler);
    if portable {
        store = store.portable(true);
    }
    let store = store.build().unwrap();
    (
        TestApp::serve(pool.clone(), charges::app(pool, config)).await,
        store,
    )
}

/// A storm of duplicate charges and one refund per charge; then the stream and the
/// ledger are checked.
async fn storm_through_the_outbox(app: &TestApp, store: &Store, direct: &PgPool, prefix: &str) {
    let (relay, ledger) = charges::events::start(store, &nats_url(), prefix)
        .await
        .expect("start the events");
    let (keys, copies) = storm_size();
    let keys: Vec<String> = (0..keys).map(|i| format!("storm-{i:03}")).collect();
    let started = Instant::now();
    let answers: Vec<(String, Vec<u16>, Option<String>)> = stream::iter(&keys)
        .map(|key| async move {
            let body = json!({ "amount": 100, "currency": "usd", "customer": key });
            let answers = join_all((0..copies).map(|_| {
                app.post_with(
                    "/charges",
                    Some(key),
                    &body,
                    &[("authorization", "Bearer acct_1")],
                )
            }))
            .await;
            let id = answers
                .iter()
                .find(|a| a.status == 201)
                .map(|a| a.json()["id"].as_str().unwrap().to_owned());
            (key.clone(), answers.iter().map(|a| a.status).collect(), id)
        })
        .buffer_unordered(10)
        .collect()
        .await;
    let requests = answers.len() * copies;
    let mut charged = Vec::new();
    for (key, statuses, id) in answers {
        assert!(
            statuses.iter().all(|s| [201, 409].contains(s)),
            "{key}: {statuses:?}"
        );
        charged.extend(id);
    }
    // One refund of 30 per charge, sent twice.
    for id in &charged {
        for _ in 0..2 {
            let refund = app
                .post_with(
                    &format!("/charges/{id}/refunds"),
                    Some(&format!("refund-{id}")),
                    &json!({ "amount": 30 }),
                    &[("authorization", "Bearer acct_1")],
                )
                .await;
            assert_eq!(refund.status, 201);
        }
    }
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(direct)
        .await
        .unwrap();
    assert_eq!(charges as usize, charged.len());
    // The ledger: one entry per event, 100 - 30 per charge.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (entries, total): (i64, Option<i64>) = sqlx::query_as(
            "SELECT count(*), sum(amount)::bigint FROM ledger_entries WHERE account = 'acct_1'",
        )
        .fetch_one(direct)
        .await
        .unwrap();
        if entries == 2 * charges {
            assert_eq!(total, Some(70 * charges));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{entries} ledger entries for {charges} charges"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The stream: one message per charge event, each id once.
    let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
    let mut stream = js.get_stream(prefix).await.unwrap();
    let state = stream.info().await.unwrap().state.clone();
    let mut per_subject: HashMap<String, usize> = HashMap::new();
    let mut ids = Vec::new();
    for seq in state.first_sequence..=state.last_sequence {
        let m = stream.get_raw_message(seq).await.unwrap();
        *per_subject.entry(m.subject.to_string()).or_default() += 1;
        ids.push(m.headers.get(MSG_ID).unwrap().as_str().to_owned());
    }
    let created = format!("{prefix}.charge.created");
    let refunded = format!("{prefix}.charge.refunded");
    assert_eq!(
        per_subject,
        HashMap::from([(created, charged.len()), (refunded, charged.len())])
    );
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 2 * charged.len());
    println!(
        "{requests} charge requests and {} refunds: {} charges, {} events in the stream once \
         each, {} ledger entries, in {:.2} s",
        2 * charged.len(),
        charged.len(),
        ids.len(),
        2 * charged.len(),
        started.elapsed().as_secs_f64()
    );
    relay.stopped().await;
    ledger.abort();
    js.delete_stream(prefix).await.ok();
    js.delete_stream(charges::events::dead_letters(prefix).0)
        .await
        .ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storm_yields_one_event_and_one_ledger_entry_per_charge() {
    with_test_db(async |db| {
        let pool = db.pool(20).await;
        let prefix = unique("charges");
        let (app, store) = service(pool.clone(), Pooler::Session, false, &prefix).await;
        storm_through_the_outbox(&app, &store, &pool, &prefix).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_behind_pgbouncer_in_transaction_mode() {
    with_test_db(async |db| {
        let direct = db.pool(2).await;
        let bouncer = Pgbouncer::start(db);
        let pool = charges::connect_with(bouncer.options(), Pooler::Transaction, 20)
            .await
            .expect("connect through pgbouncer");
        let prefix = unique("charges");
        let (app, store) = service(pool, Pooler::Transaction, false, &prefix).await;
        storm_through_the_outbox(&app, &store, &direct, &prefix).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_in_portable_mode() {
    with_test_db(async |db| {
        let pool = db.pool(20).await;
        let prefix = unique("charges");
        let (app, store) = service(pool.clone(), Pooler::Session, true, &prefix).await;
        storm_through_the_outbox(&app, &store, &pool, &prefix).await;
    })
    .await;
}

/// The example's own binary (`charges::main_from_env`) with `NATS_URL` set: a charge and
/// its refund reach the ledger through JetStream; a bad `NATS_SUBJECT_PREFIX` stops it
/// at start with one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_example_binary_books_its_events_through_jetstream() {
    with_test_db(async |db| {
        let prefix = unique("charges");
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap();
        let mut server = std::process::Command::new(env!("CARGO_BIN_EXE_charges-server"))
            .env("BIND_ADDR", addr.to_string())
            .env("DATABASE_URL", db.url())
            .env("NATS_URL", nats_url())
            .env("NATS_SUBJECT_PREFIX", &prefix)
            .env("RUST_LOG", "error")
            .spawn()
            .expect("start the charges server");
        let client = reqwest::Client::new();
        let url = format!("http://{addr}/charges");
        let deadline = Instant::now() + Duration::from_secs(20);
        let charge = loop {
            let sent = client
                .post(&url)
                .header("authorization", "Bearer acct_bin")
                .header("idempotency-key", "bin-1")
                .json(&json!({ "amount": 500, "currency": "usd", "customer": "c" }))
                .send()
                .await;
            if let Ok(response) = sent {
                assert_eq!(response.status(), 201);
                break response.json::<serde_json::Value>().await.unwrap();
            }
            assert!(Instant::now() < deadline, "the server never answered");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let id = charge["id"].as_str().unwrap();
        let refund = client
            .post(format!("{url}/{id}/refunds"))
            .header("authorization", "Bearer acct_bin")
            .header("idempotency-key", "bin-refund-1")
            .json(&json!({ "amount": 200 }))
            .send()
            .await
            .unwrap();
        assert_eq!(refund.status(), 201);
        let pool = db.pool(2).await;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (entries, total): (i64, Option<i64>) = sqlx::query_as(
                "SELECT count(*), sum(amount)::bigint FROM ledger_entries WHERE account = 'acct_bin'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            if entries == 2 {
                assert_eq!(total, Some(300), "credited 500, debited 200");
                break;
            }
            assert!(Instant::now() < deadline, "{entries} ledger entries");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        server.kill().ok();
        server.wait().ok();
        pool.close().await;
        let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
        js.delete_stream(&prefix).await.ok();
        js.delete_stream(charges::events::dead_letters(&prefix).0).await.ok();

        let refused = std::process::Command::new(env!("CARGO_BIN_EXE_charges-server"))
            .env("BIND_ADDR", "127.0.0.1:0")
            .env("DATABASE_URL", db.url())
            .env("NATS_URL", nats_url())
            .env("NATS_SUBJECT_PREFIX", "has.dots")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains("NATS_SUBJECT_PREFIX must be"), "{stderr}");
    })
    .await;
}

/// Issue 27, finding 6: the example's dead letters go where its ledger consumer does not
/// read them. An event with an id the ledger booked before with another payload, and one
/// whose body does not decode, are dead-lettered once each; the ledger books only the
/// good events, under their own ids. Before, the dead-letter subject
/// (`<prefix>.dead.ledger`) was in the example's own stream (`<prefix>.>`): a dead letter
/// came back to the ledger as an event of its own and was booked under `dead-<id>`, and
/// the undecodable one looped for ever (`dead-dead-<id>` ...).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_examples_dead_letters_are_not_read_by_its_ledger() {
    with_test_db(async |db| {
        let pool = db.pool(10).await;
        charges::migrate(&pool).await.expect("migrate");
        let store = Store::new(pool.clone());
        let prefix = unique("charges");
        let (relay, ledger) = charges::events::start(&store, &nats_url(), &prefix)
            .await
            .expect("start the events");
        let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
        let created = |charge: &str, amount| ChargeEvent {
            kind: "charge.created".into(),
            charge_id: charge.into(),
            refund_id: None,
            account: "acct_dead".into(),
            amount,
        };
        // Booked before with another payload.
        store
            .run_once("ledger_events", "evt-seen")
            .payload(&created("ch_seen", 1))
            .run(async |_tx| Ok::<_, sqlx::Error>(()))
            .await
            .unwrap();
        let subject = format!("{prefix}.charge.created");
        let publish = async |id: &str, body: Vec<u8>| {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(MSG_ID, id);
            js.publish_with_headers(subject.clone(), headers, body.into())
                .await
                .unwrap()
                .await
                .unwrap();
        };
        let json = |event: ChargeEvent| serde_json::to_vec(&event).unwrap();
        publish("evt-seen", json(created("ch_seen", 999))).await;
        publish("evt-bad", b"{not json".to_vec()).await;
        publish("evt-good-1", json(created("ch_1", 10))).await;
        // The ids the ledger booked for the account, once it booked `id`.
        let booked_with = async |id: &str| {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let ids: Vec<String> = sqlx::query_scalar(
                    "SELECT message_id FROM ledger_entries WHERE account = 'acct_dead' ORDER BY message_id",
                )
                .fetch_all(&pool)
                .await
                .unwrap();
                if ids.iter().any(|booked| booked == id) {
                    return ids;
                }
                assert!(Instant::now() < deadline, "{id} never booked: {ids:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        booked_with("evt-good-1").await;
        // Published after any dead letter of the three above: once it is booked, the
        // ledger has read whatever came before it in its stream.
        publish("evt-good-2", json(created("ch_2", 20))).await;
        let ids = booked_with("evt-good-2").await;
        assert_eq!(ids, ["evt-good-1", "evt-good-2"], "booked only the good events");
        let mut events = js.get_stream(&prefix).await.unwrap();
        assert_eq!(
            events.info().await.unwrap().state.messages,
            4,
            "the events' stream holds the four events and no dead letter"
        );
        let (dead_stream, _) = charges::events::dead_letters(&prefix);
        let mut dead = js.get_stream(&dead_stream).await.expect("the dead letters' stream");
        let state = dead.info().await.unwrap().state.clone();
        let mut dead_ids = Vec::new();
        for seq in state.first_sequence..=state.last_sequence {
            let m = dead.get_raw_message(seq).await.unwrap();
            dead_ids.push(m.headers.get("Idem-Event-Id").unwrap().as_str().to_owned());
        }
        assert_eq!(dead_ids, ["evt-seen", "evt-bad"]);
        relay.stopped().await;
        ledger.abort();
        js.delete_stream(&prefix).await.ok();
        js.delete_stream(&dead_stream).await.ok();
    })
    .await;
}

/// Issue 27, finding 6: the example's database refusing connections
/// (`OUTBOX_OUTAGE_SECS`, 15 s by default; RELIABILITY.md has a 90 s run) while its
/// ledger consumer has events in JetStream. Every delivery meanwhile fails because the
/// database is away: after the outage each event is booked once, under its own id, the
/// server delivered each once, and nothing is dead-lettered. Before, each failed delivery
/// counted toward the ledger's `max_deliver` (10), and the events went to the dead-letter
/// subject, from where the ledger booked them again as `dead-<id>`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_example_books_each_event_once_through_a_database_outage() {
    with_test_db(async |db| {
        let pool = db.pool(4).await;
        charges::migrate(&pool).await.expect("migrate");
        let mut gate = Gate::start(&db.options).await;
        let prefix = unique("charges");
        let (relay, ledger) = charges::events::start(&gated_store(gate.options(db.options.clone())), &nats_url(), &prefix)
            .await
            .expect("start the events");
        let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
        gate.shut().await;
        // Written before the outage, published meanwhile: in JetStream, in the ledger's
        // way, while PostgreSQL refuses it.
        let ids: Vec<String> = (0..20).map(|i| format!("evt-{i:02}")).collect();
        for (i, id) in (0_i64..).zip(&ids) {
            let event = ChargeEvent {
                kind: "charge.created".into(),
                charge_id: format!("ch_{i}"),
                refund_id: None,
                account: "acct_outage".into(),
                amount: 100 + i,
            };
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(MSG_ID, id.as_str());
            js.publish_with_headers(
                format!("{prefix}.charge.created"),
                headers,
                serde_json::to_vec(&event).unwrap().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        }
        tokio::time::sleep(outage()).await;
        gate.open().await;
        let opened = Instant::now();
        let booked = loop {
            let booked: Vec<String> = sqlx::query_scalar(
                "SELECT message_id FROM ledger_entries WHERE account = 'acct_outage' ORDER BY message_id",
            )
            .fetch_all(&pool)
            .await
            .unwrap();
            if booked.len() >= ids.len() || opened.elapsed() > Duration::from_secs(60) {
                break booked;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let recovered_in = opened.elapsed();
        assert_eq!(booked, ids, "each event once, under its own id");
        let (dead_stream, _) = charges::events::dead_letters(&prefix);
        let dead = js.get_stream(&dead_stream).await.unwrap().info().await.unwrap().state.messages;
        assert_eq!(dead, 0, "dead letters");
        let mut consumer: jetstream::consumer::PullConsumer = js
            .get_stream(&prefix)
            .await
            .unwrap()
            .get_consumer("ledger")
            .await
            .unwrap();
        let delivered = consumer.info().await.unwrap().delivered.consumer_sequence;
        assert_eq!(delivered, 20, "deliveries");
        println!(
            "the example, a {} s outage with 20 events in JetStream: all booked {:.1} s after \
             it, each once under its own id; {delivered} deliveries, no dead letter",
            outage().as_secs(),
            recovered_in.as_secs_f64()
        );
        relay.stop();
        ledger.abort();
        js.delete_stream(&prefix).await.ok();
        js.delete_stream(&dead_stream).await.ok();
    })
    .await;
}

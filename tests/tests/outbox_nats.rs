//! The outbox end to end on a real NATS JetStream: the relay publishes each event with
//! its id as `Nats-Msg-Id`, JetStream drops a republish inside its duplicate window, and
//! the consumer credits a ledger once per event through `run_once`, acknowledging only
//! after its commit, past the window too. Processes are killed with SIGKILL between
//! publish and mark (relay, and one of two relays holding an ordering key) and between
//! commit and ack (consumer); a broker is killed and restarted mid-stream; a relay whose
//! settings outlive the stream's duplicate window says so. Each test has a stream and subjects of its own.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{pull, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, stream, Context};
use idem::outbox::nats::{JetStreamConsumer, JetStreamPublisher, MSG_ID};
use idem::outbox::{Event, OutboxEvent, PublishError, Publisher, Received};
use idem::testing::Gate;
use idem::Store;
use idem_tests::ledger::{book, booked, credits, ledger, through_an_outage, Credit};
use idem_tests::{
    count, gated_store, nats_url, unique, with_test_db, ClosedSpans, Pgbouncer, PrivateNats, TestDb,
};
use sqlx::PgPool;
use tracing_subscriber::prelude::*;

struct Broker {
    js: Context,
    stream: String,
    subject: String,
}

impl Broker {
    /// A stream of its own capturing `<name>.>`, with the given duplicate window.
    async fn new(url: &str, window: Duration) -> Self {
        let client = async_nats::connect(url).await.expect("connect to NATS");
        let js = jetstream::new(client);
        let stream = unique("idem");
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{stream}.>")],
            duplicate_window: window,
            ..Default::default()
        })
        .await
        .expect("create the stream");
        let subject = format!("{stream}.credit");
        Self {
            js,
            stream,
            subject,
        }
    }

    async fn consumer(&self, name: &str, ack_wait: Duration, max_deliver: i64) -> PullConsumer {
        let stream = self.js.get_stream(&self.stream).await.unwrap();
        stream
            .create_consumer(pull::Config {
                durable_name: Some(name.to_owned()),
                ack_policy: AckPolicy::Explicit,
                ack_wait,
                max_deliver,
                filter_subject: self.subject.clone(),
                ..Default::default()
            })
            .await
            .expect("create the consumer")
    }

    /// A stream of its own for dead letters, `<stream>_dead` capturing `<stream>_dead.>`,
    /// outside the events' stream; the dead-letter subject in it.
    async fn dead_letter_subject(&self) -> String {
        let name = self.dead_stream();
        self.js
            .get_or_create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![format!("{name}.>")],
                ..Default::default()
            })
            .await
            .expect("create the dead letters' stream");
        format!("{name}.ledger")
    }

    fn dead_stream(&self) -> String {
        format!("{}_dead", self.stream)
    }

    /// Every message in the stream, in order: (Nats-Msg-Id, subject, payload).
    async fn messages(&self) -> Vec<(String, String, Vec<u8>)> {
        messages_of(&self.js, &self.stream).await
    }

    /// Every message in the dead letters' stream, in order.
    async fn dead_letters(&self) -> Vec<(String, String, Vec<u8>)> {
        messages_of(&self.js, &self.dead_stream()).await
    }
    async fn wait_for(&self, n: usize, within: Duration) -> Vec<(String, String, Vec<u8>)> {
        let deadline = Instant::now() + within;
        loop {
            let messages = self.messages().await;
            if messages.len() >= n || Instant::now() > deadline {
                return messages;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn delete(self) {
        self.js.delete_stream(&self.stream).await.ok();
        self.js.delete_stream(self.dead_stream()).await.ok();
    }
}

/// Every message in `stream` (none if there is no such stream), in order:
/// (Nats-Msg-Id, subject, payload).
async fn messages_of(js: &Context, stream: &str) -> Vec<(String, String, Vec<u8>)> {
    let Ok(mut stream) = js.get_stream(stream).await else {
        return Vec::new();
    };
    let state = stream.info().await.unwrap().state.clone();
    let mut out = Vec::new();
    for seq in state.first_sequence..=state.last_sequence {
        if state.messages == 0 {
            break;
        }
        if let Ok(m) = stream.get_raw_message(seq).await {
            let id = m
                .headers
                .get(MSG_ID)
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default();
            out.push((id, m.subject.to_string(), m.payload.to_vec()));
        }
    }
    out
}

/// Credits `0..n` emitted and relayed: in the stream, for a consumer to read.
async fn in_stream(store: &Store, broker: &Broker, n: i64) {
    emit_credits(store, &broker.subject, 0, n).await;
    store
        .relay(JetStreamPublisher::new(broker.js.clone()))
        .run_until_idle()
        .await
        .unwrap();
}

/// Writes `n` credits to the outbox through `run_once` (charge i, amount 100 + i).
async fn emit_credits(store: &Store, subject: &str, from: i64, n: i64) {
    for charge in from..from + n {
        store
            .run_once("charges", &format!("charge-{charge}"))
            .run(async |mut tx| {
                tx.emit(
                    Event::new(
                        subject,
                        &Credit {
                            charge,
                            amount: 100 + charge,
                        },
                    )
                    .ordering_key(charge.to_string()),
                )
                .await?;
                Ok::<_, sqlx::Error>(())
            })
            .await
            .unwrap();
    }
}

/// Runs a ledger consumer on `consumer` until dropped (aborted).
fn spawn_ledger(
    store: &Store,
    js: &Context,
    consumer: PullConsumer,
    dead_letters: Option<String>,
) -> tokio::task::JoinHandle<()> {
    let store = store.clone();
    let mut ledger =
        JetStreamConsumer::new(js.clone(), consumer).retry_delay(Duration::from_millis(100));
    if let Some(subject) = dead_letters {
        ledger = ledger.dead_letter_subject(subject);
    }
    tokio::spawn(async move {
        ledger
            .run(async |credit: Received<Credit>| book(&store, &credit).await)
            .await
            .expect("consume");
    })
}

/// A publisher that publishes, then reports a failure the first time: the relay retries,
/// and the republish carries the same `Nats-Msg-Id`, which JetStream drops.
struct FailsAfterFirstPublish {
    inner: JetStreamPublisher,
    failed: AtomicU64,
}

impl Publisher for FailsAfterFirstPublish {
    async fn publish(&self, event: &OutboxEvent) -> Result<(), PublishError> {
        self.inner.publish(event).await?;
        if event.attempt == 1 {
            self.failed.fetch_add(1, Ordering::SeqCst);
            return Err(PublishError::retry("lost the acknowledgement"));
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_relay_publishes_each_event_with_its_id_and_a_republish_is_dropped() {
    with_test_db(async |db| {
        let (pool, store) = ledger(db).await;
        let broker = Broker::new(&nats_url(), Duration::from_secs(120)).await;
        emit_credits(&store, &broker.subject, 0, 20).await;
        let ids: Vec<String> = sqlx::query_scalar("SELECT id FROM idem_outbox ORDER BY seq")
            .fetch_all(&pool)
            .await
            .unwrap();
        let publisher = FailsAfterFirstPublish {
            inner: JetStreamPublisher::new(broker.js.clone()),
            failed: AtomicU64::new(0),
        };
        let stats = store
            .relay(publisher)
            .backoff(Duration::from_millis(1), Duration::from_millis(1))
            .run_until_idle()
            .await
            .unwrap();
        // The retries wait out their backoff; drain again.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let again = store
            .relay(JetStreamPublisher::new(broker.js.clone()))
            .run_until_idle()
            .await
            .unwrap();
        assert_eq!(stats.retried, 20);
        assert_eq!(stats.published + again.published, 20);
        // Events of different charges (ordering keys) are published concurrently, in any
        // order.
        let messages = broker.messages().await;
        let mut stored: Vec<&str> = messages.iter().map(|(id, _, _)| id.as_str()).collect();
        stored.sort_unstable();
        let mut ids = ids;
        ids.sort();
        assert_eq!(stored, ids, "each event once, its id as Nats-Msg-Id");
        assert_eq!(count(&pool, "idem_outbox").await, 0);
        broker.delete().await;
    })
    .await;
}

/// Regression (issue 27, finding 11): the relay's defaults (lease 30 s, backoff up to
/// 5 min) let a copy arrive after JetStream's default duplicate window (2 min), against
/// the guide's own rule ("Broker settings"), and nothing said so. The defaults now fit; settings that do not
/// are named at the relay's start, with the stream, its window and what to lower.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_relay_says_when_its_copies_can_outlive_the_duplicate_window() {
    static SEEN: OnceLock<ClosedSpans> = OnceLock::new();
    let seen = SEEN.get_or_init(|| {
        let seen = ClosedSpans::named("idem.relay");
        tracing_subscriber::registry().with(seen.clone()).init();
        seen
    });
    with_test_db(async |db| {
        let (_, store) = ledger(db).await;
        // JetStream's default window.
        let broker = Broker::new(&nats_url(), Duration::from_secs(120)).await;
        let publisher = || JetStreamPublisher::new(broker.js.clone()).stream(&broker.stream);
        let said = || -> Vec<String> {
            seen.errors()
                .iter()
                .filter(|e| {
                    e.get("destination")
                        .is_some_and(|d| d.contains(&broker.stream))
                })
                .map(|e| e.get("message").unwrap_or_default().to_owned())
                .collect()
        };
        store.relay(publisher()).run_until_idle().await.unwrap();
        assert_eq!(said(), Vec::<String>::new(), "the defaults fit");
        store
            .relay(publisher())
            .backoff(Duration::from_millis(500), Duration::from_secs(300))
            .run_until_idle()
            .await
            .unwrap();
        let said_now = said();
        assert_eq!(said_now.len(), 1, "{said_now:?}");
        for part in [
            "lease (30s) + publish timeout (10s) + longest backoff (300s) = 340s",
            "duplicate window (120s)",
            "lower the relay's longest backoff to 80s or less",
        ] {
            assert!(said_now[0].contains(part), "{part:?} in {}", said_now[0]);
        }
        // A spawned relay checks too, beside its first rounds.
        let relay = store
            .relay(publisher())
            .lease(Duration::from_secs(150))
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while said().len() < 2 {
            assert!(Instant::now() < deadline, "{:?}", said());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            said()[1].contains("shorten the relay's lease"),
            "{}",
            said()[1]
        );
        relay.stopped().await;
        broker.delete().await;
    })
    .await;
}

/// Past JetStream's duplicate window a republish is a second message: the consumer's
/// `run_once` keyed by the id credits once all the same, and acknowledges both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_consumer_credits_once_past_the_duplicate_window() {
    with_test_db(async |db| {
        let (pool, store) = ledger(db).await;
        let broker = Broker::new(&nats_url(), Duration::from_millis(100)).await;
        for _ in 0..2 {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(MSG_ID, "evt-1");
            let payload = serde_json::to_vec(&Credit {
                charge: 1,
                amount: 5,
            })
            .unwrap();
            broker
                .js
                .publish_with_headers(broker.subject.clone(), headers, payload.into())
                .await
                .unwrap()
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        assert_eq!(
            broker.messages().await.len(),
            2,
            "outside the window: two messages"
        );
        let consumer = broker.consumer("ledger", Duration::from_secs(5), 5).await;
        let task = spawn_ledger(&store, &broker.js, consumer, None);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut stream = broker.js.get_stream(&broker.stream).await.unwrap();
            let info = stream
                .get_consumer::<pull::Config>("ledger")
                .await
                .unwrap()
                .info()
                .await
                .unwrap()
                .clone();
            let _ = stream.info().await;
            if info.num_ack_pending == 0
                && info.num_pending == 0
                && info.delivered.stream_sequence >= 2
            {
                break;
            }
            assert!(Instant::now() < deadline, "both acknowledged: {info:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            credits(&pool, 1, Duration::from_secs(1)).await,
            HashMap::from([(1, 1)])
        );
        task.abort();
        broker.delete().await;
    })
    .await;
}

/// What can never succeed goes to the dead-letter subject with its reason, and the rest
/// flow: a body that does not decode, an id seen before with another payload, and a
/// delivery that reached `max_deliver`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn what_can_never_succeed_goes_to_the_dead_letter_subject() {
    with_test_db(async |db| {
        let (pool, store) = ledger(db).await;
        let broker = Broker::new(&nats_url(), Duration::from_secs(120)).await;
        let dead_subject = broker.dead_letter_subject().await;
        let send = async |id: &str, body: Vec<u8>| {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(MSG_ID, id);
            broker
                .js
                .publish_with_headers(broker.subject.clone(), headers, body.into())
                .await
                .unwrap()
                .await
                .unwrap();
        };
        let json = |c: Credit| serde_json::to_vec(&c).unwrap();
        send(
            "good-1",
            json(Credit {
                charge: 1,
                amount: 5,
            }),
        )
        .await;
        send("undecodable", b"{not json".to_vec()).await;
        send(
            "good-2",
            json(Credit {
                charge: 2,
                amount: 7,
            }),
        )
        .await;
        // An id the ledger has processed before, with another payload.
        store
            .run_once("ledger", "mismatch")
            .payload(&Credit {
                charge: 3,
                amount: 1,
            })
            .run(async |_tx| Ok::<_, sqlx::Error>(()))
            .await
            .unwrap();
        send(
            "mismatch",
            json(Credit {
                charge: 3,
                amount: 999,
            }),
        )
        .await;
        // Work that fails every time (`book` refuses a negative amount).
        send(
            "failing",
            json(Credit {
                charge: 4,
                amount: -1,
            }),
        )
        .await;
        let consumer = broker.consumer("ledger", Duration::from_secs(5), 3).await;
        let task = spawn_ledger(&store, &broker.js, consumer, Some(dead_subject.clone()));
        assert_eq!(
            credits(&pool, 2, Duration::from_secs(10)).await,
            HashMap::from([(1, 1), (2, 1)])
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        let dead = loop {
            let dead = broker.dead_letters().await;
            if dead.len() >= 3 || Instant::now() > deadline {
                break dead;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // A dead letter's own Nats-Msg-Id is not the event's (a stream of dead letters
        // from several consumers would drop it as a duplicate); `Idem-Event-Id` carries
        // the event's.
        let ids: Vec<&str> = dead.iter().map(|(id, _, _)| id.as_str()).collect();
        assert_eq!(ids, ["dead-undecodable", "dead-mismatch", "dead-failing"]);
        assert!(dead.iter().all(|(_, subject, _)| *subject == dead_subject));
        let stream = broker.js.get_stream(broker.dead_stream()).await.unwrap();
        let reason = |seq| {
            let stream = stream.clone();
            async move {
                let m = stream.get_raw_message(seq).await.unwrap();
                m.headers
                    .get("Idem-Dead-Reason")
                    .unwrap()
                    .as_str()
                    .to_owned()
            }
        };
        let last = stream.cached_info().state.last_sequence;
        let reasons = [
            reason(last - 2).await,
            reason(last - 1).await,
            reason(last).await,
        ];
        assert!(reasons[0].contains("does not decode"), "{reasons:?}");
        assert!(reasons[1].contains("another payload"), "{reasons:?}");
        assert!(
            reasons[2].contains("the work failed 3 times"),
            "{reasons:?}"
        );
        // Read back for operators: newest first, each with its event, subject and reason.
        let letters = idem::outbox::nats::dead_letters(&broker.js, &broker.dead_stream(), 10)
            .await
            .unwrap();
        let read: Vec<(&str, &str)> = letters
            .iter()
            .map(|l| (l.event_id.as_str(), l.subject.as_str()))
            .collect();
        assert_eq!(
            read,
            [
                ("failing", broker.subject.as_str()),
                ("mismatch", broker.subject.as_str()),
                ("undecodable", broker.subject.as_str())
            ]
        );
        assert!(letters[0].reason.contains("the work failed 3 times"));
        assert_eq!(letters[0].sequence, last);
        assert!(letters[0].at <= std::time::SystemTime::now());
        let newest = idem::outbox::nats::dead_letters(&broker.js, &broker.dead_stream(), 1)
            .await
            .unwrap();
        assert_eq!(newest, letters[..1]);
        let missing = idem::outbox::nats::dead_letters(&broker.js, "no_such_stream", 1).await;
        assert!(missing
            .unwrap_err()
            .to_string()
            .contains("\"no_such_stream\""),);
        assert_eq!(count(&pool, "credits WHERE amount < 0").await, 0);
        task.abort();
        broker.delete().await;
    })
    .await;
}

/// Issue 27, finding 6: a dead-letter subject whose dead letters would come back as
/// events (captured by the stream the consumer reads, as the example's was) or be refused
/// (no stream captures it) stops the consumer at start, saying why, before it consumes
/// anything. Before, it ran, and its dead letters were read again as new events.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_subject_that_would_come_back_is_refused_at_start() {
    with_test_db(async |db| {
        let (pool, store) = ledger(db).await;
        let broker = Broker::new(&nats_url(), Duration::from_secs(120)).await;
        in_stream(&store, &broker, 1).await;
        let refusal = async |dead_letters: String| {
            let consumer = broker.consumer("ledger", Duration::from_secs(5), 3).await;
            let run = JetStreamConsumer::new(broker.js.clone(), consumer)
                .dead_letter_subject(dead_letters)
                .run(async |credit: Received<Credit>| book(&store, &credit).await);
            tokio::time::timeout(Duration::from_secs(10), run)
                .await
                .expect("refused at once")
                .expect_err("refused")
                .to_string()
        };
        // In the consumed stream, even outside this consumer's filter: every other
        // consumer of the stream would read them.
        let captured = refusal(format!("{}.dead", broker.stream)).await;
        assert!(
            captured.contains(&format!(
                "captured by the stream {:?}, the one this consumer reads",
                broker.stream
            )),
            "{captured}"
        );
        let nowhere = refusal(format!("{}_nowhere.dead", broker.stream)).await;
        assert!(nowhere.contains("no stream captures"), "{nowhere}");
        let wildcard = refusal(format!("{}_dead.>", broker.stream)).await;
        assert!(wildcard.contains("one subject"), "{wildcard}");
        assert_eq!(count(&pool, "credits").await, 0, "nothing consumed");
        broker.delete().await;
    })
    .await;
}

/// `outbox-worker` (a relay or a consumer in a process of its own) on `db` and `nats`.
fn worker(mode: &str, db: &TestDb, nats: &str, env: &[(&str, String)]) -> Child {
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-worker"));
    command
        .arg(mode)
        .env("DATABASE_URL", db.url())
        .env("NATS_URL", nats)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (name, value) in env {
        command.env(name, value);
    }
    command.spawn().expect("start outbox-worker")
}

/// A worker killed with SIGKILL when dropped, so that a test that fails leaves no
/// process behind.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        self.0.kill().ok();
        self.0.wait().ok();
    }
}

/// Waits for the worker to print `HUNG`.
fn wait_hung(child: &mut Child) {
    let stdout = child.stdout.take().unwrap();
    let hung = std::thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line == "HUNG")
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while !hung.is_finished() {
        assert!(
            Instant::now() < deadline,
            "the worker never reached its fault point"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        hung.join().unwrap(),
        "the worker exited before its fault point"
    );
}

/// Waits for the worker to print `HUNG`, then kills it with SIGKILL.
fn kill_when_hung(mut child: Child) {
    wait_hung(&mut child);
    // SIGKILL: no destructor, no rollback of its own, no last ack.
    child.kill().unwrap();
    child.wait().unwrap();
}

/// SIGKILL of the relay after JetStream acknowledged events and before it marked them:
/// after a restart every event is in the stream once (the republish is dropped by its
/// `Nats-Msg-Id`), none is lost, and the outbox is empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_killed_between_publish_and_mark_loses_and_doubles_nothing() {
    with_test_db(async |db| {
        let (pool, store) = ledger(db).await;
        let broker = Broker::new(&nats_url(), Duration::from_secs(120)).await;
        emit_credits(&store, &broker.subject, 0, 30).await;
        let relay = worker("relay", db, &nats_url(), &[("HANG_AFTER", "5".into())]);
        kill_when_hung(relay);
        let published = broker.messages().await.len();
        assert!(published >= 5, "published before the kill: {published}");
        assert_eq!(count(&pool, "idem_outbox").await, 30, "none marked");
        // The restarted relay takes the killed one's events: their leases ended with its
        // session.
        let restarted = worker("relay", db, &nats_url(), &[]);
        let messages = broker.wait_for(30, Duration::from_secs(20)).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while count(&pool, "idem_outbox").await > 0 {
            assert!(Instant::now() < deadline, "the outbox never emptied");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut child = restarted;
        child.kill().ok();
        child.wait().ok();
        let mut ids: Vec<&str> = messages.iter().map(|(id, _, _)| id.as_str()).collect();
        assert_eq!(ids.len(), 30, "each event once");
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 30);
        broker.delete().await;
    })
    .await;
}

/// Regression (issue 27, finding 10): after `kill -9` of one of two relay processes, the
/// events of an ordering key it held waited out its whole lease (25 s seen with the 30 s
/// default). Its leases end with its session: the other relay publishes the key's events
/// within a few seconds, each once in the stream, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_relays_ordering_key_is_published_by_the_other_within_seconds() {
    with_test_db(async |db| {
        let (pool, store) = ledger(db).await;
        let broker = Broker::new(&nats_url(), Duration::from_secs(120)).await;
        for step in 0..5_i64 {
            store
                .run_once("charges", &format!("step-{step}"))
                .run(async |mut tx| {
                    let credit = Credit {
                        charge: 7,
                        amount: step,
                    };
                    tx.emit(Event::new(&broker.subject, &credit).ordering_key("7"))
                        .await?;
                    Ok::<_, sqlx::Error>(())
                })
                .await
                .unwrap();
        }
        // A publish still waiting for its acknowledgement when the process is killed:
        // the lease outlives it, and nothing but the kill frees the key.
        let settings = [
            ("LEASE_MS", "30000".to_owned()),
            ("PUBLISH_TIMEOUT_MS", "20000".to_owned()),
        ];
        let mut holder = Killed(worker(
            "relay",
            db,
            &nats_url(),
            &[settings.as_slice(), &[("HANG_AFTER", "1".into())]].concat(),
        ));
        // It published the key's first event and hangs before marking it.
        wait_hung(&mut holder.0);
        let _other = Killed(worker("relay", db, &nats_url(), &settings));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            broker.messages().await.len(),
            1,
            "the other relay waits while the key is held"
        );
        drop(holder);
        let killed = Instant::now();
        let messages = broker.wait_for(5, Duration::from_secs(20)).await;
        let took = killed.elapsed();
        let steps: Vec<i64> = messages
            .iter()
            .map(|(_, _, payload)| serde_json::from_slice::<Credit>(payload).unwrap().amount)
            .collect();
        assert_eq!(steps, [0, 1, 2, 3, 4], "each once, in order");
        assert!(
            took < Duration::from_secs(5),
            "published {took:?} after the kill, with a 30 s lease"
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while count(&pool, "idem_outbox").await > 0 {
            assert!(Instant::now() < deadline, "the outbox never emptied");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        broker.delete().await;
    })
    .await;
}

/// SIGKILL of the consumer after its commit and before its ack: the redelivery replays
/// the stored result, is acknowledged, and the ledger is credited once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_killed_between_commit_and_ack_credits_once() {
    with_test_db(async |db| {
        let (pool, store) = ledger(db).await;
        let broker = Broker::new(&nats_url(), Duration::from_secs(120)).await;
        in_stream(&store, &broker, 10).await;
        let consumer = broker.consumer("ledger", Duration::from_secs(1), 10).await;
        let env = [
            ("HANG_AFTER", "3".to_owned()),
            ("STREAM", broker.stream.clone()),
            ("CONSUMER", "ledger".to_owned()),
        ];
        kill_when_hung(worker("consume", db, &nats_url(), &env));
        let before = credits(&pool, 0, Duration::ZERO).await;
        assert_eq!(
            before.len(),
            3,
            "three committed before the kill: {before:?}"
        );
        let task = spawn_ledger(&store, &broker.js, consumer, None);
        let after = credits(&pool, 10, Duration::from_secs(20)).await;
        assert_eq!(
            after,
            (0..10).map(|c| (c, 1)).collect::<HashMap<_, _>>(),
            "once each"
        );
        task.abort();
        broker.delete().await;
    })
    .await;
}

/// The broker killed and restarted mid-stream: the relay retries, and once it is back
/// every event is in the stream once; nothing lost, nothing doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_restart_mid_stream_loses_and_doubles_nothing() {
    with_test_db(async |db| {
        let (pool, store) = ledger(db).await;
        let mut nats = PrivateNats::start();
        let broker = Broker::new(&nats.url(), Duration::from_secs(120)).await;
        let relay = store
            .relay(JetStreamPublisher::new(broker.js.clone()))
            .every(Duration::from_millis(50))
            .backoff(Duration::from_millis(50), Duration::from_millis(200))
            .publish_timeout(Duration::from_secs(1))
            .max_attempts(1000)
            .spawn()
            .unwrap();
        emit_credits(&store, &broker.subject, 0, 20).await;
        broker.wait_for(20, Duration::from_secs(10)).await;
        nats.stop();
        // Written while the broker is down: the service's writes do not depend on it.
        emit_credits(&store, &broker.subject, 20, 20).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        while relay.stats().retried == 0 {
            assert!(Instant::now() < deadline, "{:?}", relay.stats());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        nats.restart();
        let messages = broker.wait_for(40, Duration::from_secs(30)).await;
        let mut ids: Vec<&str> = messages.iter().map(|(id, _, _)| id.as_str()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!((messages.len(), ids.len()), (40, 40));
        let deadline = Instant::now() + Duration::from_secs(10);
        while count(&pool, "idem_outbox").await > 0 {
            assert!(Instant::now() < deadline, "the outbox never emptied");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(relay.stats().dead, 0);
        relay.stop();
    })
    .await;
}

/// Two relays and two consumers at once: the stream holds each event once, in per-key
/// order, and the ledger credits each charge once.
async fn two_relays_and_two_consumers(store: &Store, pool: &PgPool) {
    let broker = Broker::new(&nats_url(), Duration::from_secs(120)).await;
    let relays: Vec<_> = (0..2)
        .map(|_| {
            store
                .relay(JetStreamPublisher::new(broker.js.clone()))
                .batch(8)
                .spawn()
                .unwrap()
        })
        .collect();
    let consumer = broker.consumer("ledger", Duration::from_secs(5), 10).await;
    let consumers: Vec<_> = (0..2)
        .map(|_| spawn_ledger(store, &broker.js, consumer.clone(), None))
        .collect();
    // Five charges, each with an event per step (created, then refunds), written in
    // order by one writer per charge.
    let writers: Vec<_> = (0..5)
        .map(|charge: i64| {
            let store = store.clone();
            let subject = broker.subject.clone();
            tokio::spawn(async move {
                for step in 0..10_i64 {
                    store
                        .run_once("charges", &format!("c{charge}-s{step}"))
                        .run(async |mut tx| {
                            tx.emit(
                                Event::new(
                                    &subject,
                                    &Credit {
                                        charge: charge * 100 + step,
                                        amount: step,
                                    },
                                )
                                .ordering_key(charge.to_string()),
                            )
                            .await?;
                            Ok::<_, sqlx::Error>(())
                        })
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    let credited = credits(pool, 50, Duration::from_secs(20)).await;
    assert_eq!(credited.len(), 50);
    assert!(credited.values().all(|&n| n == 1), "{credited:?}");
    let messages = broker.messages().await;
    assert_eq!(messages.len(), 50);
    let mut per_key: HashMap<i64, Vec<i64>> = HashMap::new();
    for (_, _, payload) in &messages {
        let c: Credit = serde_json::from_slice(payload).unwrap();
        per_key.entry(c.charge / 100).or_default().push(c.amount);
    }
    for (key, steps) in per_key {
        assert_eq!(steps, (0..10).collect::<Vec<_>>(), "charge {key}");
    }
    // A relay counts an event once its mark commits, after the broker's ack, which the
    // consumer may already have credited: the last marks may still be on their way.
    let deadline = Instant::now() + Duration::from_secs(10);
    let published = loop {
        let published: Vec<u64> = relays.iter().map(|r| r.stats().published).collect();
        if published.iter().sum::<u64>() >= 50 || Instant::now() > deadline {
            break published;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(published.iter().sum::<u64>(), 50, "{published:?}");
    for r in relays {
        r.stop();
    }
    for c in consumers {
        c.abort();
    }
    broker.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_and_two_consumers_by_default() {
    with_test_db(async |db| {
        let (pool, store) = ledger(db).await;
        two_relays_and_two_consumers(&store, &pool).await;
    })
    .await;
}

/// Behind PgBouncer in transaction mode: the relays poll, every statement unnamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_and_two_consumers_behind_pgbouncer() {
    with_test_db(async |db| {
        let (direct, _) = ledger(db).await;
        let bouncer = Pgbouncer::start(db);
        let store = bouncer.store(12).await;
        two_relays_and_two_consumers(&store, &direct).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_and_two_consumers_in_portable_mode() {
    with_test_db(async |db| {
        let (pool, _) = ledger(db).await;
        let store = Store::builder(pool.clone()).portable(true).build().unwrap();
        two_relays_and_two_consumers(&store, &pool).await;
    })
    .await;
}

/// A fetched batch waits behind slow work without its ack waits running out (issue 36:
/// the consumer fetches the messages waiting, instead of pulling one at a time): ten
/// events fetched together, each one's work 400 ms, an ack wait of 1 s, so 4 s for the
/// batch, while a second consumer waits for messages. Every message still held is
/// reported in progress, counted from the fetch, so the server delivers each one once;
/// reporting only the one being worked on, the later ones went to the second consumer
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fetched_batch_waits_behind_slow_work_without_a_redelivery() {
    with_test_db(async |db| {
        let (pool, store) = ledger(db).await;
        let broker = Broker::new(&nats_url(), Duration::from_secs(120)).await;
        in_stream(&store, &broker, 10).await;
        let mut consumer = broker.consumer("ledger", Duration::from_secs(1), 5).await;
        let worked = Arc::new(AtomicU64::new(0));
        let run = |worked: Arc<AtomicU64>| {
            let store = store.clone();
            tokio::spawn(
                JetStreamConsumer::new(broker.js.clone(), consumer.clone()).run(
                    move |credit: Received<Credit>| {
                        let store = store.clone();
                        worked.fetch_add(1, Ordering::SeqCst);
                        async move {
                            tokio::time::sleep(Duration::from_millis(400)).await;
                            book(&store, &credit).await
                        }
                    },
                ),
            )
        };
        let first = run(Arc::clone(&worked));
        // The first consumer fetched all ten before it started on one; a second one on
        // the same durable consumer waits on the server, where a message whose ack wait
        // ran out would be sent again.
        while worked.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let second = run(Arc::clone(&worked));
        let after = credits(&pool, 10, Duration::from_secs(30)).await;
        assert_eq!(
            after,
            (0..10).map(|c| (c, 1)).collect::<HashMap<_, _>>(),
            "once each"
        );
        let delivered = consumer.info().await.unwrap().delivered.consumer_sequence;
        assert_eq!(delivered, 10, "deliveries");
        first.abort();
        second.abort();
        broker.delete().await;
    })
    .await;
}

/// Issue 27, finding 6: PostgreSQL refusing connections while the consumer has events in
/// JetStream (`OUTBOX_OUTAGE_SECS`, 15 s by default; RELIABILITY.md has a 90 s run), with
/// `max_deliver` 3 and an ack wait of 2 s. Every delivery that fails meanwhile fails
/// because the database is away, which can pass: after the outage each event is credited
/// once, under its own id, and none is dead-lettered. Before, each failed delivery
/// counted toward `max_deliver`, and the events in flight went to the dead-letter subject
/// within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_outage_dead_letters_nothing() {
    with_test_db(async |db| {
        let (pool, store) = ledger(db).await;
        let broker = Broker::new(&nats_url(), Duration::from_secs(120)).await;
        let dead_letters = broker.dead_letter_subject().await;
        in_stream(&store, &broker, 20).await;
        let mut ids: Vec<String> = broker.messages().await.into_iter().map(|m| m.0).collect();
        ids.sort();
        let mut gate = Gate::start(&db.options).await;
        let consumer = broker.consumer("ledger", Duration::from_secs(2), 3).await;
        let attempts = Arc::new(AtomicU64::new(0));
        // Two on one durable consumer: while one holds a message through the outage, the
        // other would be sent it again once its ack wait ran out.
        let tasks: Vec<_> = (0..2)
            .map(|_| {
                let store = gated_store(gate.options(db.options.clone()));
                let tried = Arc::clone(&attempts);
                tokio::spawn(
                    JetStreamConsumer::new(broker.js.clone(), consumer.clone())
                        .dead_letter_subject(dead_letters.clone())
                        .run(move |credit: Received<Credit>| {
                            let store = store.clone();
                            let tried = Arc::clone(&tried);
                            async move {
                                tried.fetch_add(1, Ordering::SeqCst);
                                // Slow enough that the outage starts with events in flight.
                                tokio::time::sleep(Duration::from_millis(50)).await;
                                book(&store, &credit).await
                            }
                        }),
                )
            })
            .collect();
        let outage = through_an_outage(
            &pool,
            async |shut| {
                if shut {
                    gate.shut().await
                } else {
                    gate.open().await
                }
            },
            &attempts,
            3,
            20,
        )
        .await;
        assert!(outage.attempts > 0, "nothing was tried during the outage");
        assert_eq!(booked(&pool).await, ids, "each event under its own id");
        let dead = broker.dead_letters().await;
        assert!(dead.is_empty(), "dead-lettered: {dead:?}");
        // The messages held through the outage were never sent again: the server
        // counted one delivery per event.
        let mut consumer = consumer;
        let delivered = consumer.info().await.unwrap().delivered.consumer_sequence;
        assert_eq!(delivered, 20, "deliveries");
        println!(
            "JetStream, a {} s outage: {} of 20 credited at the cut, {} attempts during it, \
             the rest credited {:.1} s after it; 20 credits, {delivered} deliveries, none \
             dead-lettered",
            idem_tests::outage().as_secs(),
            outage.credited_at_cut,
            outage.attempts,
            outage.recovered_in.as_secs_f64()
        );
        for task in tasks {
            task.abort();
        }
        broker.delete().await;
    })
    .await;
}

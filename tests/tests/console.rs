//! idem's console as the charges example mounts it (`ADMIN_TOKEN`, `/admin/idem`, behind
//! its bearer-token layer, actions on): every page renders and every action acts on the
//! three topologies (PostgreSQL directly, behind PgBouncer in transaction mode, on
//! Citus); and an operator, in headless Chromium, finds a dead event the example's relay
//! parked for real (its subject captured by no JetStream stream), re-drives it once the
//! stream exists, and sees it delivered and gone from the dead list. The browser test
//! saves a screenshot of each page under `target/console/`.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use charges::events::Delivery;
use charges::Config;
use fantoccini::wd::WebDriverCompatibleCommand;
use fantoccini::{Client, ClientBuilder, Locator};
use idem::outbox::nats::MSG_ID;
use idem::outbox::{Event, OutboxEvent, PublishError, Publisher};
use idem::{Pooler, Store};
use idem_tests::{nats_url, unique, with_test_db, Citus, Pgbouncer, TestApp};
use serde_json::{json, Value};
use sqlx::PgPool;

const TOKEN: &str = "console-test-token-0123456789";

/// A publisher that never delivers: `nowhere.*` fails for good, anything else for now.
struct Refusing;

impl Publisher for Refusing {
    async fn publish(&self, event: &OutboxEvent) -> Result<(), PublishError> {
        if event.topic.starts_with("nowhere.") {
            Err(PublishError::permanent("no stream captures the subject"))
        } else {
            Err(PublishError::retry("broker unavailable"))
        }
    }
}

/// Two keys of scope `jobs`; two dead events, and two of ordering key `acct-1` held in a
/// backoff.
async fn seed(store: &Store) {
    store
        .run_once("jobs", "job-1")
        .run(async |mut tx| {
            for topic in ["nowhere.a", "nowhere.b", "slow.x", "slow.x"] {
                let mut event = Event::new(topic, &json!({ "secret": "4111 1111 1111 1111" }));
                if topic == "slow.x" {
                    event = event.ordering_key("acct-1");
                }
                tx.emit(event).await?;
            }
            Ok::<_, sqlx::Error>("done".to_owned())
        })
        .await
        .expect("run job-1");
    store
        .run_once("jobs", "job-2")
        .run(async |_| Ok::<_, sqlx::Error>("done".to_owned()))
        .await
        .expect("run job-2");
    store
        .relay(Refusing)
        .max_attempts(2)
        .backoff(Duration::from_secs(3_600), Duration::from_secs(3_600))
        .run_until_idle()
        .await
        .expect("run the relay");
}

/// GET `path` of the app with `token` as the bearer: status and body.
async fn get(app: &TestApp, path: &str, token: Option<&str>) -> (u16, String) {
    let mut request = app.client.get(app.url(path));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("GET");
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

/// POST a form to `path` as the operator; follows the redirect to the page.
async fn post(app: &TestApp, path: &str, form: &[(&str, &str)]) -> (u16, String) {
    let response = app
        .client
        .post(app.url(path))
        .bearer_auth(TOKEN)
        .form(form)
        .send()
        .await
        .expect("POST");
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

/// The CSRF token of a page's forms.
fn csrf(page: &str) -> String {
    let at = page
        .find("name=\"csrf\" value=\"")
        .expect("a form with a CSRF token")
        + 19;
    page[at..at + 64].to_owned()
}

/// Every page and action of the console, on the example's app over `store`'s database.
async fn every_page(app: &TestApp, store: &Store) {
    seed(store).await;
    let (status, _) = get(app, "/admin/idem", None).await;
    assert_eq!(status, 401, "no token, no console");
    let (status, _) = get(app, "/admin/idem", Some("wrong-token-0123456789")).await;
    assert_eq!(status, 401);

    let (status, overview) = get(app, "/admin/idem", Some(TOKEN)).await;
    assert_eq!(status, 200, "{overview}");
    for expected in [
        "<code>jobs</code>",
        "no stream captures the subject",
        "<svg",
        "replayed",
        "2 pending",
    ] {
        assert!(overview.contains(expected), "{expected:?} in {overview}");
    }
    let (status, keys) = get(app, "/admin/idem/keys?scope=jobs", Some(TOKEN)).await;
    assert_eq!(status, 200, "{keys}");
    assert!(keys.contains("job-1") && keys.contains("job-2"), "{keys}");
    let (status, key) = get(app, "/admin/idem/key?scope=jobs&key=job-1", Some(TOKEN)).await;
    assert_eq!(status, 200, "{key}");
    assert!(
        key.contains("fingerprint") && key.contains("hidden: bodies carry personal data"),
        "{key}"
    );
    assert!(
        !key.contains("&quot;done&quot;"),
        "the body stays hidden: {key}"
    );
    let (status, _) = get(app, "/admin/idem/key?scope=jobs&key=job-9", Some(TOKEN)).await;
    assert_eq!(status, 404);
    let (status, outbox) = get(app, "/admin/idem/outbox", Some(TOKEN)).await;
    assert_eq!(status, 200, "{outbox}");
    assert!(
        outbox.contains("slow.x") && outbox.contains("<code>acct-1</code>"),
        "{outbox}"
    );
    assert!(outbox.contains("broker unavailable"), "{outbox}");
    let (status, dead) = get(app, "/admin/idem/dead", Some(TOKEN)).await;
    assert_eq!(status, 200, "{dead}");
    let dead_events = store.dead_events(10).await.unwrap();
    assert_eq!(dead_events.len(), 2);
    for event in &dead_events {
        assert!(dead.contains(&event.id), "{dead}");
    }
    let (status, one) = get(
        app,
        &format!("/admin/idem/dead/event?id={}", dead_events[0].id),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{one}");
    assert!(
        one.contains("hidden: payloads carry personal data") && !one.contains("4111"),
        "{one}"
    );

    // Actions: refused without this operator's token, done with it.
    let reason = "no stream captures the subject";
    let (status, _) = post(app, "/admin/idem/dead/redrive", &[("reason", reason)]).await;
    assert_eq!(status, 403);
    let (status, _) = post(
        app,
        "/admin/idem/dead/redrive",
        &[("reason", reason), ("csrf", &"0".repeat(64))],
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(
        store.dead_events(10).await.unwrap().len(),
        2,
        "nothing moved"
    );
    let token = csrf(&dead);
    let (status, page) = post(
        app,
        "/admin/idem/dead/redrive",
        &[("reason", reason), ("csrf", &token)],
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("Re-drove 2 dead event(s)"), "{page}");
    assert!(store.dead_events(10).await.unwrap().is_empty());
    let (status, page) = post(
        app,
        "/admin/idem/key/purge",
        &[("scope", "jobs"), ("key", "job-2"), ("csrf", &token)],
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("Purged 1 record(s)"), "{page}");
    assert!(store.inspect("jobs", "", "job-2").await.unwrap().is_none());
    let (status, page) = post(app, "/admin/idem/sweep", &[("csrf", &token)]).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("Swept 0 expired record(s)"), "{page}");

    // Issue 39: each action is in the audit trail, newest first, as the operator the
    // admin layer named took it, with what it selected and how many rows it moved; the
    // refused posts are not.
    let (status, audit) = get(app, "/admin/idem/audit", Some(TOKEN)).await;
    assert_eq!(status, 200, "{audit}");
    assert!(audit.contains("href=\"/admin/idem/audit\""), "{audit}");
    let rows: Vec<usize> = [
        "<td>sweep</td><td><code>expired, batch 1000</code></td><td class=\"n\">0</td>",
        "<td>purge</td><td><code>scope &quot;jobs&quot;, key &quot;job-2&quot;</code></td><td class=\"n\">1</td>",
        "<td>redrive</td><td><code>reason &quot;no stream captures the subject&quot;</code></td><td class=\"n\">2</td>",
    ]
    .iter()
    .map(|row| {
        let cells = format!("<td><code>admin</code></td><td>console</td>{row}");
        audit.find(&cells).unwrap_or_else(|| panic!("{cells} in {audit}"))
    })
    .collect();
    assert!(rows.is_sorted(), "newest first: {audit}");
    assert_eq!(audit.matches("<td>console</td>").count(), 3, "{audit}");
    let entries = store.audit_log(10, None).await.unwrap();
    let (status, older) = get(
        app,
        &format!("/admin/idem/audit?before={}", entries[0].id),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{older}");
    assert!(
        !older.contains("<td>sweep</td>") && older.contains("<td>redrive</td>"),
        "{older}"
    );
}

fn config(pooler: Pooler, portable: bool) -> Config {
    Config {
        pooler,
        portable,
        admin_token: Some(TOKEN.into()),
        ..Config::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_on_postgresql() {
    with_test_db(async |db| {
        let pool = db.pool(10).await;
        charges::migrate(&pool).await.unwrap();
        // Without ADMIN_TOKEN nothing is mounted there.
        let bare =
            TestApp::serve(pool.clone(), charges::app(pool.clone(), Config::default())).await;
        assert_eq!(get(&bare, "/admin/idem", Some(TOKEN)).await.0, 404);
        let config = config(Pooler::Session, false);
        let store = charges::store(pool.clone(), &config);
        let app = TestApp::serve(pool.clone(), charges::app(pool.clone(), config)).await;
        every_page(&app, &store).await;

        // Read-only by default (no form, no action route), bodies and payloads shown
        // only when the service turns them on.
        let console = idem::console::Console::new(store.clone())
            .show_bodies(true)
            .router();
        let open = TestApp::serve(pool, axum::Router::new().nest("/ops", console)).await;
        let (status, key) = get(&open, "/ops/key?scope=jobs&key=job-1", None).await;
        assert_eq!(status, 200, "{key}");
        assert!(
            key.contains("&quot;done&quot;") && !key.contains("<form method=\"post\""),
            "{key}"
        );
        seed(&store).await;
        let parked = store.dead_events(10).await.unwrap();
        let (status, event) =
            get(&open, &format!("/ops/dead/event?id={}", parked[0].id), None).await;
        assert_eq!(status, 200, "{event}");
        assert!(event.contains("4111 1111 1111 1111"), "{event}");
        let refused = open
            .client
            .post(open.url("/ops/dead/redrive"))
            .form(&[("all", "1")])
            .send()
            .await
            .unwrap();
        assert_eq!(
            refused.status().as_u16(),
            404,
            "no action without .actions(true)"
        );
        assert_eq!(store.dead_events(10).await.unwrap().len(), parked.len());
    })
    .await;
}

/// Issue 37: the dead events' pages show each event's age beside the re-drive window and
/// mark those outside it; a re-drive that selects one moves nothing and answers a page
/// that says why, whose form (`force=1`) re-drives the same selection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_past_the_window_asks_first() {
    with_test_db(async |db| {
        let pool = db.pool(10).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        seed(&store).await;
        let parked = store.dead_events(10).await.unwrap();
        let (old, young) = (&parked[0].id, &parked[1].id);
        sqlx::query("UPDATE idem_outbox SET created_at = now() - interval '3 days' WHERE id = $1")
            .bind(old)
            .execute(&pool)
            .await
            .unwrap();
        let console = idem::console::Console::new(store.clone())
            .actions(true)
            .router();
        let app = TestApp::serve(pool, axum::Router::new().nest("/ops", console)).await;
        let marker = "outside the re-drive window</span>";
        let (status, dead) = get(&app, "/ops/dead", None).await;
        assert_eq!(status, 200, "{dead}");
        assert!(dead.contains("Re-drive window: 24 h"), "{dead}");
        assert_eq!(dead.matches(marker).count(), 1, "{dead}");
        let (_, page) = get(&app, &format!("/ops/dead/event?id={old}"), None).await;
        assert!(page.contains("3 d ago") && page.contains(marker), "{page}");
        let (_, page) = get(&app, &format!("/ops/dead/event?id={young}"), None).await;
        assert!(!page.contains(marker), "{page}");

        let token = csrf(&dead);
        let (status, page) = post(
            &app,
            "/ops/dead/redrive",
            &[("id", old), ("id", young), ("csrf", &token)],
        )
        .await;
        assert_eq!(status, 409, "{page}");
        assert!(
            page.contains("Nothing was re-driven.")
                && page.contains("1 of the 2 selected dead event(s)"),
            "{page}"
        );
        for field in [
            format!("name=\"id\" value=\"{old}\""),
            format!("name=\"id\" value=\"{young}\""),
            "name=\"force\" value=\"1\"".to_owned(),
            "name=\"expected\" value=\"2\"".to_owned(),
        ] {
            assert!(page.contains(&field), "{field} in {page}");
        }
        assert_eq!(
            store.dead_events(10).await.unwrap().len(),
            2,
            "nothing moved"
        );

        let (status, page) = post(
            &app,
            "/ops/dead/redrive",
            &[("id", young), ("csrf", &token)],
        )
        .await;
        assert_eq!(status, 200, "{page}");
        assert!(page.contains("Re-drove 1 dead event(s)"), "{page}");
        // The confirmation of two, sent when the selection holds one: shown again.
        let (status, page) = post(
            &app,
            "/ops/dead/redrive",
            &[
                ("id", old),
                ("id", young),
                ("force", "1"),
                ("expected", "2"),
                ("csrf", &token),
            ],
        )
        .await;
        assert_eq!(status, 200, "{page}");
        assert!(
            page.contains("Nothing was re-driven: the selection holds 1 dead event(s) now"),
            "{page}"
        );
        assert_eq!(store.dead_events(10).await.unwrap().len(), 1);
        let (status, page) = post(
            &app,
            "/ops/dead/redrive",
            &[("id", old), ("id", young), ("force", "1"), ("csrf", &token)],
        )
        .await;
        assert_eq!(status, 200, "{page}");
        assert!(page.contains("Re-drove 1 dead event(s)"), "{page}");
        assert!(store.dead_events(10).await.unwrap().is_empty());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_behind_pgbouncer_in_transaction_mode() {
    with_test_db(async |db| {
        let bouncer = Pgbouncer::start(db);
        let pool = charges::connect_with(bouncer.options(), Pooler::Transaction, 10)
            .await
            .unwrap();
        charges::migrate(&pool).await.unwrap();
        let config = config(Pooler::Transaction, false);
        let store = charges::store(pool.clone(), &config);
        let app = TestApp::serve(pool.clone(), charges::app(pool, config)).await;
        every_page(&app, &store).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_on_citus() {
    let Some(cluster) = Citus::start("console::every_page_on_citus", 2).await else {
        return;
    };
    let pool: PgPool = charges::connect_with(cluster.options(), Pooler::Session, 10)
        .await
        .unwrap();
    charges::migrate(&pool).await.unwrap();
    let config = config(Pooler::Session, true);
    let store = charges::store(pool.clone(), &config);
    charges::distribute(&store).await.unwrap();
    let app = TestApp::serve(pool.clone(), charges::app(pool, config)).await;
    every_page(&app, &store).await;
}

/// A chromedriver of the test's own on a free port, killed on drop.
struct Chromedriver {
    port: u16,
    child: Child,
}

impl Chromedriver {
    fn start() -> Self {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "run chromedriver: install Debian's chromium and chromium-driver (.ci/run does)",
            );
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { port, child }
    }
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// A Chrome DevTools command through chromedriver (`goog/cdp/execute`): how the browser
/// is told to send the bearer token, as a browser behind an SSO proxy would.
#[derive(Debug)]
struct DevTools(&'static str, Value);

impl WebDriverCompatibleCommand for DevTools {
    fn endpoint(
        &self,
        base: &url::Url,
        session: Option<&str>,
    ) -> Result<url::Url, url::ParseError> {
        base.join(&format!(
            "session/{}/goog/cdp/execute",
            session.unwrap_or_default()
        ))
    }

    fn method_and_body(&self, _: &url::Url) -> (http::Method, Option<String>) {
        let body = json!({ "cmd": self.0, "params": self.1 });
        (http::Method::POST, Some(body.to_string()))
    }
}

/// Where the browser test's screenshots go: `target/console/`.
fn screenshots() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("../console");
    std::fs::create_dir_all(&dir).expect("create target/console");
    dir
}

async fn screenshot(browser: &Client, name: &str) {
    let png = browser.screenshot().await.expect("screenshot");
    std::fs::write(screenshots().join(format!("{name}.png")), png).expect("save the screenshot");
}

async fn until<T, F: AsyncFnMut() -> Option<T>>(what: &str, mut probe: F) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(found) = probe().await {
            return found;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The notice of the page an action's form led to. Polled: the click returns before the
/// browser has always loaded the answer to its POST (seen once in CI, on a loaded machine).
async fn notice(browser: &Client) -> String {
    until("the action's notice", async || {
        let notice = browser.find(Locator::Css("section.notice")).await.ok()?;
        notice.text().await.ok()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_redrives_a_dead_event_in_chromium() {
    with_test_db(async |db| {
        let prefix = unique("console");
        let pool = db.pool(10).await;
        charges::migrate(&pool).await.unwrap();
        let config = Config {
            events: Some(prefix.clone()),
            admin_token: Some(TOKEN.into()),
            ..Config::default()
        };
        let store = charges::store(pool.clone(), &config);
        // Three attempts, 2 s then 4 s apart: long enough to see an event held.
        let delivery = Delivery {
            max_attempts: 3,
            first_backoff: Duration::from_secs(2),
        };
        let (relay, ledger) = charges::events::start_with(&store, &nats_url(), &prefix, delivery)
            .await
            .expect("start the events");
        let app = TestApp::serve(pool.clone(), charges::app(pool.clone(), config)).await;
        let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());

        let driver = Chromedriver::start();
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({ "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                             "--disable-dev-shm-usage", "--window-size=1000,1000"] }),
        );
        let browser = ClientBuilder::new(hyper_connector())
            .capabilities(capabilities)
            .connect(&format!("http://127.0.0.1:{}", driver.port))
            .await
            .expect("start headless Chromium");
        browser
            .issue_cmd(DevTools("Network.enable", json!({})))
            .await
            .unwrap();
        browser
            .issue_cmd(DevTools(
                "Network.setExtraHTTPHeaders",
                json!({ "headers": { "Authorization": format!("Bearer {TOKEN}") } }),
            ))
            .await
            .unwrap();
        // The events' stream goes away: a charge's event and its refund's, ordered by
        // the charge, are captured by no stream; the first fails three times and is
        // parked, the second waits behind it meanwhile, then fails and is parked too.
        js.delete_stream(&prefix).await.expect("delete the stream");
        let bearer = [("authorization", "Bearer acct_1")];
        let charge = app
            .post_with(
                "/charges",
                Some("order-1"),
                &json!({ "amount": 4200, "currency": "eur", "customer": "cus_7" }),
                &bearer,
            )
            .await;
        assert_eq!(charge.status, 201);
        let charge_id = charge.json()["id"].as_str().unwrap().to_owned();
        let refund = app
            .post_with(
                &format!("/charges/{charge_id}/refunds"),
                Some("refund-1"),
                &json!({ "amount": 1000 }),
                &bearer,
            )
            .await;
        assert_eq!(refund.status, 201);

        // The page's text; empty while the browser is between two pages.
        let text = async || match browser.find(Locator::Css("main")).await {
            Ok(main) => main.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };

        // The outbox page: the charge's event backing off, its refund's blocked behind it.
        browser.goto(&app.url("/admin/idem/outbox")).await.unwrap();
        until(
            "the refund's event blocked behind the charge's",
            async || {
                browser.refresh().await.unwrap();
                let page = text().await;
                let blocked = !page.contains("No ordering key waits") && page.contains(&charge_id);
                blocked.then_some(())
            },
        )
        .await;
        screenshot(&browser, "outbox").await;

        // The overview, watched until both are parked: their reason, two events.
        browser.goto(&app.url("/admin/idem")).await.unwrap();
        let dead = until("both events to be parked", async || {
            browser.refresh().await.unwrap();
            let dead = store.dead_events(10).await.unwrap();
            (dead.len() == 2).then_some(dead)
        })
        .await;
        browser.refresh().await.unwrap();
        let reasons = browser
            .find(Locator::Css("table.reasons"))
            .await
            .expect("dead events by reason");
        let text_of_reasons = reasons.text().await.unwrap();
        assert!(
            text_of_reasons.contains(&dead[0].last_error),
            "{text_of_reasons}"
        );
        assert!(
            text_of_reasons.contains("charge.created")
                && text_of_reasons.contains("charge.refunded"),
            "{text_of_reasons}"
        );
        screenshot(&browser, "overview").await;

        // The dead list has both; the stream is back; the operator re-drives the charge's
        // event, then the rest of its reason's group.
        browser
            .find(Locator::LinkText("Dead events"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let checkbox = format!("input[name=id][value='{}']", dead[0].id);
        until("the dead event listed", async || {
            browser.find(Locator::Css(&checkbox)).await.ok()
        })
        .await;
        screenshot(&browser, "dead").await;
        js.create_stream(stream::Config {
            name: prefix.clone(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .expect("create the stream again");
        browser
            .find(Locator::Css(&checkbox))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        browser
            .find(Locator::XPath("//button[text()='Re-drive selected']"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        assert_eq!(
            notice(&browser).await,
            "Re-drove 1 dead event(s): they are pending again."
        );
        browser
            .find(Locator::XPath("//button[text()='Re-drive these']"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        assert_eq!(
            notice(&browser).await,
            "Re-drove 1 dead event(s): they are pending again."
        );

        // The audit trail has both re-drives, the operator's name and the count, newest
        // first: the reason's group, then the event picked by its id.
        browser
            .find(Locator::LinkText("Audit"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let trail = until("the audit trail", async || {
            let table = browser.find(Locator::Css("table.audit")).await.ok()?;
            table.text().await.ok()
        })
        .await;
        let rows: Vec<&str> = trail.lines().skip(1).collect();
        assert_eq!(rows.len(), 2, "{trail}");
        let reason = &dead[1].last_error;
        for (row, selected) in rows
            .iter()
            .zip([format!("reason {reason:?}"), format!("ids {}", dead[0].id)])
        {
            let found = ["admin", "console", "redrive", &selected]
                .iter()
                .all(|cell| row.contains(cell));
            assert!(found && row.trim_end().ends_with('1'), "{row} in {trail}");
        }
        screenshot(&browser, "audit").await;
        browser
            .find(Locator::LinkText("Dead events"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();

        // Delivered, in order, each under its event's id; gone from the dead list.
        let delivered = until("both events in the stream", async || {
            let mut stream = js.get_stream(&prefix).await.ok()?;
            let state = stream.info().await.ok()?.state.clone();
            if state.messages < 2 {
                return None;
            }
            let mut ids = Vec::new();
            for seq in state.first_sequence..=state.last_sequence {
                let message = stream.get_raw_message(seq).await.ok()?;
                ids.push(message.headers.get(MSG_ID)?.as_str().to_owned());
            }
            Some(ids)
        })
        .await;
        assert_eq!(delivered, [dead[0].id.clone(), dead[1].id.clone()]);
        browser.refresh().await.unwrap();
        let empty = text().await;
        assert!(
            empty.contains("No dead events.") && !empty.contains(&dead[0].id),
            "{empty}"
        );

        // The other pages: the keys (and the charge's key looked up), the outbox.
        browser
            .find(Locator::LinkText("Keys"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        screenshot(&browser, "keys").await;
        let lookup = browser
            .form(Locator::Css("form[action$='/key']"))
            .await
            .unwrap();
        lookup.set_by_name("scope", "charges").await.unwrap();
        lookup.set_by_name("principal", "acct_1").await.unwrap();
        lookup.set_by_name("key", "order-1").await.unwrap();
        lookup.submit().await.unwrap();
        until("the key's record", async || {
            let record = text().await;
            (record.contains("201") && record.contains("fingerprint")).then_some(())
        })
        .await;
        screenshot(&browser, "key").await;
        browser.close().await.ok();

        relay.stop();
        ledger.abort();
        js.delete_stream(&prefix).await.ok();
        js.delete_stream(charges::events::dead_letters(&prefix).0)
            .await
            .ok();
    })
    .await;
}

/// A plain HTTP connector: chromedriver listens on loopback, without TLS.
fn hyper_connector() -> hyper_util::client::legacy::connect::HttpConnector {
    hyper_util::client::legacy::connect::HttpConnector::new()
}

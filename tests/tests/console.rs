//! idem's console as the charges example mounts it (`ADMIN_TOKEN`, `/admin/idem`, behind
//! its bearer-token layer, actions on): every page renders and every action acts on the
//! three topologies (PostgreSQL directly, behind PgBouncer in transaction mode, on
//! Citus); and an operator, in headless Chromium, finds a dead event the example's relay
//! parked for real (its subject captured by no JetStream stream), re-drives it once the
//! stream exists, and sees it delivered and gone from the dead list; watches the overview
//! refresh itself as events are parked, reads an event's attempt history, the relays by
//! host and process, and the ledger's dead letters. The browser test saves a screenshot of
//! each page under `target/console/`: the guide's and the README's are those, copied to
//! `docs/book/src/console/` after a run of the browser test alone (`cargo test -p
//! idem-tests --test console chromium`: run with the others, this process's request counts
//! on the overview include theirs).

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use charges::events::Delivery;
use charges::Config;
use fantoccini::wd::WebDriverCompatibleCommand;
use fantoccini::{Client, ClientBuilder, Locator};
use idem::console::Role;
use idem::operate::{DeadSelection, EventFilter, FailedPublish};
use idem::outbox::nats::MSG_ID;
use idem::outbox::{Event, OutboxEvent, PublishError, Publisher};
use idem::{Pooler, Store};
use idem_tests::{nats_url, unique, with_test_db, Citus, Pgbouncer, TestApp, TestDb};
use serde_json::{json, Value};
use sqlx::PgPool;

const TOKEN: &str = "console-test-token-0123456789";
/// The example's read-only token (`ADMIN_READONLY_TOKEN`).
const READONLY: &str = "console-test-readonly-0123456789";

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

/// A pool of `connections` on a fresh database, and a store whose tables hold [`seed`]'s
/// rows.
async fn seeded(db: &TestDb, connections: u32) -> (PgPool, Store) {
    let pool = db.pool(connections).await;
    let store = Store::new(pool.clone());
    store.migrate().await.unwrap();
    seed(&store).await;
    (pool, store)
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
    post_as(app, path, TOKEN, form).await
}

/// POST a form to `path` with `token` as the bearer; follows the redirect to the page.
async fn post_as(app: &TestApp, path: &str, token: &str, form: &[(&str, &str)]) -> (u16, String) {
    let response = app
        .client
        .post(app.url(path))
        .bearer_auth(token)
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

/// The fields of the POST form of `page` that acts at `action`, as its button sends them.
fn form_of(page: &str, action: &str) -> Vec<(String, String)> {
    let start = format!("method=\"post\" action=\"{action}\"");
    let at = page
        .find(&start)
        .unwrap_or_else(|| panic!("a form to {action} in {page}"));
    let form = &page[at..at + page[at..].find("</form>").expect("the form's end")];
    let unescape = |v: &str| {
        v.replace("&quot;", "\"")
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&#39;", "'")
            .replace("&amp;", "&")
    };
    form.split("<input type=\"hidden\" name=\"")
        .skip(1)
        .map(|input| {
            let (name, rest) = input.split_once("\" value=\"").expect("a hidden field");
            let value = &rest[..rest.find('"').expect("the value's end")];
            (name.to_owned(), unescape(value))
        })
        .collect()
}

/// `fields` as a form's pairs.
fn pairs(fields: &[(String, String)]) -> Vec<(&str, &str)> {
    fields
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect()
}

/// The target of a page's "Next page" link, unescaped.
fn next_page(page: &str) -> Option<String> {
    let at = page.find("rel=\"next\" href=\"")? + 17;
    let href = &page[at..at + page[at..].find('"')?];
    Some(href.replace("&amp;", "&"))
}

/// `page` lists `errors`, the event's failed publishes, in its attempt history, oldest
/// first, each with its time.
fn assert_attempts(page: &str, errors: &[FailedPublish]) {
    let at = page
        .find("<table class=\"attempts\">")
        .unwrap_or_else(|| panic!("an attempt history in {page}"));
    let table = &page[at..at + page[at..].find("</table>").expect("its end")];
    assert_eq!(table.matches("<tr>").count(), errors.len() + 1, "{table}");
    let mut from = 0;
    for error in errors {
        let row = format!("<td class=\"at\">{} ", idem::operate::format_time(error.at));
        let found = table[from..]
            .find(&row)
            .unwrap_or_else(|| panic!("{row} after {from} in {table}"));
        from += found + row.len();
        let rest = &table[from..];
        let cell = format!("<td><code>{}</code></td>", error.error);
        let next = rest.find("<td>").expect("the error's cell");
        assert!(rest[next..].starts_with(&cell), "{cell} in {table}");
    }
}

/// Issue 39: the page at `path` is sent with a policy that allows the console's own
/// stylesheet and script and no inline code; both are served from the links the page
/// has, with their types, and a name the console did not give is 404.
async fn assert_assets(app: &TestApp, path: &str, token: Option<&str>) {
    let mut request = app.client.get(app.url(path));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("GET");
    let policy = response
        .headers()
        .get("content-security-policy")
        .expect("a Content-Security-Policy")
        .to_str()
        .unwrap()
        .to_owned();
    for directive in [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(policy.contains(directive), "{directive} in {policy}");
    }
    assert!(!policy.contains("unsafe-inline"), "{policy}");
    let page = response.text().await.unwrap();
    assert!(
        !page.contains("<style") && !page.contains("<script>"),
        "{page}"
    );
    for (attribute, kind) in [
        ("<link rel=\"stylesheet\" href=\"", "text/css"),
        ("<script src=\"", "text/javascript"),
    ] {
        let at = page.find(attribute).expect("the asset's link") + attribute.len();
        let href = &page[at..at + page[at..].find('"').unwrap()];
        let mut request = app.client.get(app.url(href));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let asset = request.send().await.unwrap();
        assert_eq!(asset.status().as_u16(), 200, "{href}");
        let served = asset.headers()["content-type"].to_str().unwrap().to_owned();
        assert!(served.starts_with(kind), "{href}: {served}");
        let wrong = href.replace("console.", "console.0");
        let mut request = app.client.get(app.url(&wrong));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        assert_eq!(request.send().await.unwrap().status().as_u16(), 404);
    }
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
        "2 dead",
    ] {
        assert!(overview.contains(expected), "{expected:?} in {overview}");
    }
    // Issue 39: the database's figures and this process's apart, each block saying so;
    // the page refreshes itself (`data-live`) with the console's own script, which its
    // policy allows, and no other.
    let database = overview
        .find("From the database")
        .expect("the database's block");
    let process = overview
        .find("From this process")
        .expect("this process's block");
    let (live, requests) = (
        overview.find("expiring within the hour").unwrap(),
        overview.find("422 mismatch").unwrap(),
    );
    assert!(
        database < live && live < process && process < requests,
        "records in the database's block, requests in this process's: {overview}"
    );
    assert!(overview.contains("<main data-live=\"5\">"), "{overview}");
    assert_assets(app, "/admin/idem", Some(TOKEN)).await;
    let (status, keys) = get(app, "/admin/idem/keys?scope=jobs", Some(TOKEN)).await;
    assert_eq!(status, 200, "{keys}");
    assert!(keys.contains("job-1") && keys.contains("job-2"), "{keys}");
    // Issue 39: by key prefix, and a page at a time by keyset.
    let (_, one) = get(app, "/admin/idem/keys?scope=jobs&prefix=job-2", Some(TOKEN)).await;
    assert!(one.contains(">job-2<") && !one.contains(">job-1<"), "{one}");
    let (_, first) = get(app, "/admin/idem/keys?scope=jobs&limit=1", Some(TOKEN)).await;
    let next = next_page(&first).unwrap_or_else(|| panic!("a next page in {first}"));
    assert!(
        next.contains("scope=jobs") && next.contains("limit=1"),
        "{next}"
    );
    let (status, second) = get(app, &next, Some(TOKEN)).await;
    assert_eq!(status, 200, "{second}");
    let newest_first = [">job-2<", ">job-1<"];
    assert!(first.contains(newest_first[0]) && !first.contains(newest_first[1]));
    assert!(second.contains(newest_first[1]) && !second.contains(newest_first[0]));
    assert_eq!(next_page(&second), None, "the last page: {second}");

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
    // The events job-1 wrote, found by the ids its key derives: two dead, two pending.
    let dead_events = store
        .operate()
        .dead_events_in(&idem::operate::DeadSelection::All, 10)
        .await
        .unwrap();
    assert_eq!(dead_events.len(), 2);
    let pending = store
        .operate()
        .pending_events(&EventFilter::default(), None, 10)
        .await
        .unwrap();
    assert_eq!(pending.rows.len(), 2);
    let written = &key[key.find("Events it wrote").expect("its events")..];
    for id in dead_events
        .iter()
        .map(|e| &e.id)
        .chain(pending.rows.iter().map(|e| &e.id))
    {
        assert!(written.contains(id.as_str()), "{id} in {written}");
    }
    let (_, other) = get(app, "/admin/idem/key?scope=jobs&key=job-2", Some(TOKEN)).await;
    assert!(other.contains("None: it wrote none"), "{other}");
    // And back: the request that wrote an event.
    let (status, writer) = get(
        app,
        &format!("/admin/idem/event/request?id={}", dead_events[1].id),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{writer}");
    assert!(writer.contains("&amp;key=job-1\""), "{writer}");
    let (status, _) = get(app, "/admin/idem/event/request?id=nothing", Some(TOKEN)).await;
    assert_eq!(status, 404);
    let (status, _) = get(app, "/admin/idem/key?scope=jobs&key=job-9", Some(TOKEN)).await;
    assert_eq!(status, 404);
    let (status, outbox) = get(app, "/admin/idem/outbox", Some(TOKEN)).await;
    assert_eq!(status, 200, "{outbox}");
    assert!(
        outbox.contains("slow.x") && outbox.contains(">acct-1</code>"),
        "{outbox}"
    );
    assert!(outbox.contains("broker unavailable"), "{outbox}");
    // Issue 39: live too, with its relays (none holds a session here: the seed's relay
    // ran until idle and closed its own) and the example's relay figures, which it has
    // not (no NATS).
    assert!(outbox.contains("<main data-live=\"5\">"), "{outbox}");
    assert!(store.operate().outbox_relays().await.unwrap().is_empty());
    assert!(
        outbox.contains("No relay holds a session now")
            && outbox.contains("No relay of this process was given to the console"),
        "{outbox}"
    );
    // A pending event's own page: who holds it, its failed publishes with their times.
    let (status, held) = get(
        app,
        &format!("/admin/idem/pending/event?id={}", pending.rows[0].id),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{held}");
    let errors = store
        .operate()
        .event_errors(&pending.rows[0].id)
        .await
        .unwrap();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_attempts(&held, &errors);
    assert!(held.contains("backoff, or a lease by time"), "{held}");
    // The pending events by topic and by ordering key prefix, a page at a time.
    let (status, listed) = get(app, "/admin/idem/pending?topic=slow.x", Some(TOKEN)).await;
    assert_eq!(status, 200, "{listed}");
    assert!(
        pending.rows.iter().all(|e| listed.contains(&e.id)),
        "{listed}"
    );
    let (_, first) = get(
        app,
        "/admin/idem/pending?ordering_key=acct&limit=1",
        Some(TOKEN),
    )
    .await;
    assert!(first.contains(&pending.rows[0].id) && !first.contains(&pending.rows[1].id));
    let next = next_page(&first).unwrap_or_else(|| panic!("a next page in {first}"));
    let (_, second) = get(app, &next, Some(TOKEN)).await;
    assert!(second.contains(&pending.rows[1].id) && !second.contains(&pending.rows[0].id));
    assert_eq!(next_page(&second), None);
    let (_, none) = get(app, "/admin/idem/pending?topic=nowhere.a", Some(TOKEN)).await;
    assert!(none.contains("No pending event matches."), "{none}");

    let (status, dead) = get(app, "/admin/idem/dead", Some(TOKEN)).await;
    assert_eq!(status, 200, "{dead}");
    for event in &dead_events {
        assert!(dead.contains(&event.id), "{dead}");
    }
    let (status, by_topic) = get(
        app,
        &format!("/admin/idem/dead?topic={}", dead_events[0].topic),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{by_topic}");
    assert!(
        by_topic.contains(&dead_events[0].id) && !by_topic.contains(&dead_events[1].id),
        "{by_topic}"
    );
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
    // Issue 39: a dead event's page has its attempt history; a dead event's id on the
    // pending events' page leads there, an unknown one is 404.
    let errors = store
        .operate()
        .event_errors(&dead_events[0].id)
        .await
        .unwrap();
    assert!(!errors.is_empty());
    assert_attempts(&one, &errors);
    let (status, moved) = get(
        app,
        &format!("/admin/idem/pending/event?id={}", dead_events[0].id),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{moved}");
    assert!(moved.contains("<h1>Dead event</h1>"), "{moved}");
    let (status, _) = get(app, "/admin/idem/pending/event?id=nothing", Some(TOKEN)).await;
    assert_eq!(status, 404);

    // Issue 39: the read-only operator (ADMIN_READONLY_TOKEN) sees every page and no
    // action, and is refused each action, even with a form an admin's page made.
    let (status, seen) = get(app, "/admin/idem/dead", Some(READONLY)).await;
    assert_eq!(status, 200, "{seen}");
    assert!(seen.contains(&dead_events[0].id), "{seen}");
    for action in [
        "method=\"post\"",
        "Re-drive these",
        "Re-drive all",
        "Discard",
        "type=\"checkbox\"",
        "csrf",
    ] {
        assert!(!seen.contains(action), "{action} in {seen}");
    }
    let (status, _) = get(app, "/admin/idem/dead/redrive?all=1", Some(READONLY)).await;
    assert_eq!(status, 403);

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
        store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap()
            .len(),
        2,
        "nothing moved"
    );
    // A bulk action shows what it will touch first; a form without the preview's bound
    // is answered the preview.
    let token = csrf(&key);
    let (status, preview) = get(
        app,
        &format!(
            "/admin/idem/dead/redrive?reason={}",
            reason.replace(' ', "+")
        ),
        Some(TOKEN),
    )
    .await;
    assert_eq!(status, 200, "{preview}");
    assert!(preview.contains(">Re-drive 2 events</button>"), "{preview}");
    let (status, page) = post(
        app,
        "/admin/idem/dead/redrive",
        &[("reason", reason), ("csrf", &token)],
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains(">Re-drive 2 events</button>"), "{page}");
    assert_eq!(
        store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap()
            .len(),
        2,
        "a preview"
    );
    let confirmation = form_of(&preview, "/admin/idem/dead/redrive");
    let (status, refused) = post_as(
        app,
        "/admin/idem/dead/redrive",
        READONLY,
        &pairs(&confirmation),
    )
    .await;
    assert_eq!(status, 403, "{refused}");
    assert!(refused.contains("role is read-only"), "{refused}");
    assert_eq!(
        store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap()
            .len(),
        2,
        "refused"
    );
    let (status, page) = post(app, "/admin/idem/dead/redrive", &pairs(&confirmation)).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("Re-drove 2 dead event(s)"), "{page}");
    assert!(store
        .operate()
        .dead_events_in(&idem::operate::DeadSelection::All, 10)
        .await
        .unwrap()
        .is_empty());
    let (status, page) = post(
        app,
        "/admin/idem/key/purge",
        &[("scope", "jobs"), ("key", "job-2"), ("csrf", &token)],
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("Purged 1 record(s)"), "{page}");
    assert!(store.inspect("jobs", "", "job-2").await.unwrap().is_none());
    let (status, preview) = get(app, "/admin/idem/sweep", Some(TOKEN)).await;
    assert_eq!(status, 200, "{preview}");
    assert!(preview.contains("No expired record"), "{preview}");
    let (status, page) = post(app, "/admin/idem/sweep", &[("csrf", &token)]).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("Sweep expired records?"), "a preview: {page}");
    let (status, page) = post(
        app,
        "/admin/idem/sweep",
        &[("expected", "0"), ("csrf", &token)],
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("Swept 0 expired record(s)"), "{page}");

    // Issue 39: each action is in the audit trail, newest first, as the operator the
    // admin layer named took it, with what it selected (a confirmed action with its
    // preview's bound) and how many rows it moved; the refused posts are not.
    let (status, audit) = get(app, "/admin/idem/audit", Some(TOKEN)).await;
    assert_eq!(status, 200, "{audit}");
    assert!(audit.contains("href=\"/admin/idem/audit\""), "{audit}");
    let rows: Vec<usize> = [
        "<td>sweep</td><td><code>expired, batch 1000</code></td><td class=\"n\">0</td>",
        "<td>purge</td><td><code>scope &quot;jobs&quot;, key &quot;job-2&quot;</code></td><td class=\"n\">1</td>",
        "<td>redrive</td><td><code>reason &quot;no stream captures the subject&quot;; as previewed: seq &lt;= ",
    ]
    .iter()
    .map(|row| {
        let cells = format!("<td><code>admin</code></td><td>console</td>{row}");
        audit.find(&cells).unwrap_or_else(|| panic!("{cells} in {audit}"))
    })
    .collect();
    assert!(rows.is_sorted(), "newest first: {audit}");
    assert!(
        audit.contains(", 2 previewed</code></td><td class=\"n\">2</td>"),
        "{audit}"
    );
    assert_eq!(audit.matches("<td>console</td>").count(), 3, "{audit}");
    let entries = store.operate().audit_log(10, None).await.unwrap();
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

    abandoned_pages(app, store.pool()).await;
    error_pages(app).await;
}

/// Five abandoned requests for the list's filters and pages, oldest first step first:
/// `p-1` (scope `charges`, principal `acct_1`, its first step an hour ago and its second
/// 50 minutes ago; failed), `p-2` (`charges`, `acct_2`, its first step at the same instant
/// as `p-1`'s, so after it by principal; pending), `p-3` (`charges`, `acct_1`, 40 minutes
/// ago; its endpoint stored nothing), `q-4` (`mail`, no principal, 30 minutes ago;
/// stored nothing), `p-5` (`charges`, `acct_2`, 20 minutes ago; abandoned by an operator,
/// stored nothing).
async fn seed_abandoned_pages(pool: &PgPool) {
    sqlx::query(
        "INSERT INTO idempotency_steps
             (scope, principal, key, step, fingerprint, result, created_at, expires_at)
         SELECT scope, principal, key, step, decode('00', 'hex'), '7',
                now() - make_interval(mins => ago), now() + interval '1 day'
           FROM (VALUES ('charges', 'acct_1', 'p-1', 'processor', 60),
                        ('charges', 'acct_1', 'p-1', 'ledger', 50),
                        ('charges', 'acct_2', 'p-2', 'processor', 60),
                        ('charges', 'acct_1', 'p-3', 'processor', 40),
                        ('mail', '', 'q-4', 'processor', 30),
                        ('charges', 'acct_2', 'p-5', 'processor', 20))
                AS s (scope, principal, key, step, ago)",
    )
    .persistent(false)
    .execute(pool)
    .await
    .expect("the steps");
    sqlx::query(
        "INSERT INTO idempotency_requests
             (scope, principal, key, fingerprint, method, target, headers, body, state,
              expires_at)
         SELECT 'charges', principal, key, decode('00', 'hex'), method, '/charges', '[]',
                convert_to('{}', 'UTF8'), state, now() + interval '1 day'
           FROM (VALUES ('acct_1', 'p-1', 'POST', 'failed'),
                        ('acct_2', 'p-2', 'POST', 'pending'),
                        ('acct_2', 'p-5', NULL, 'abandoning'))
                AS r (principal, key, method, state)",
    )
    .persistent(false)
    .execute(pool)
    .await
    .expect("the requests");
}

/// The keys of [`seed_abandoned_pages`]'s requests that `page` lists.
fn abandoned_keys(page: &str) -> Vec<&'static str> {
    ["p-1", "p-2", "p-3", "q-4", "p-5"]
        .into_iter()
        .filter(|key| page.contains(&format!(">{key}</code>")))
        .collect()
}

/// Issue 39: the abandoned requests are found by scope, principal, key prefix, completion
/// stage and idle time, and read a page at a time by keyset, oldest first step first
/// (ties by scope, principal and key), each page's "Next page" keeping the filter.
async fn abandoned_pages(app: &TestApp, pool: &PgPool) {
    seed_abandoned_pages(pool).await;
    let mut seen = Vec::new();
    let mut path = "/admin/idem/abandoned?idle=10m&limit=1".to_owned();
    // Bounded: a cursor that does not move on repeats a page.
    for _ in 0..10 {
        let (status, page) = get(app, &path, Some(TOKEN)).await;
        assert_eq!(status, 200, "{path}: {page}");
        let keys = abandoned_keys(&page);
        assert_eq!(keys.len(), 1, "{path}: {page}");
        seen.extend(keys);
        let Some(next) = next_page(&page) else { break };
        assert!(
            next.starts_with("/admin/idem/abandoned?idle=10m&limit=1&after="),
            "{next}"
        );
        path = next;
    }
    assert_eq!(seen, ["p-1", "p-2", "p-3", "q-4", "p-5"]);
    for (query, expected) in [
        ("scope=charges", &["p-1", "p-2", "p-3", "p-5"][..]),
        ("principal=acct_2", &["p-2", "p-5"]),
        ("prefix=q-", &["q-4"]),
        ("completion=failed", &["p-1"]),
        ("completion=pending", &["p-2"]),
        ("completion=abandoning", &["p-5"]),
        ("completion=not-completable", &["p-3", "q-4", "p-5"]),
        // p-5, idle for 20 minutes, is being abandoned: listed whatever its idle time.
        ("idle=45m", &["p-1", "p-2", "p-5"]),
        (
            "scope=charges&principal=acct_1&prefix=p-&completion=not-completable",
            &["p-3"],
        ),
        ("scope=mail&completion=failed", &[]),
    ] {
        let path = format!("/admin/idem/abandoned?{query}");
        let path = if query.contains("idle=") {
            path
        } else {
            format!("{path}&idle=10m")
        };
        let (status, page) = get(app, &path, Some(TOKEN)).await;
        assert_eq!(status, 200, "{path}: {page}");
        assert_eq!(abandoned_keys(&page), expected, "{path}: {page}");
        if expected.is_empty() {
            // Issue 48: an empty list names the idle time it was filtered by.
            assert!(
                page.contains("None with no step for 10m or more")
                    && page.contains("abandoned?idle=0s"),
                "{path}: {page}"
            );
        }
    }
    // Issue 48: the console's address with a slash after it was 404.
    let direct = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let slashed = direct
        .get(app.url("/admin/idem/"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .expect("GET");
    assert_eq!(slashed.status().as_u16(), 308);
    assert_eq!(
        slashed
            .headers()
            .get("location")
            .and_then(|l| l.to_str().ok()),
        Some("/admin/idem")
    );
    // The form shows the filter it listed with.
    let (_, page) = get(
        app,
        "/admin/idem/abandoned?scope=charges&completion=failed&idle=10m",
        Some(TOKEN),
    )
    .await;
    for expected in [
        "<form class=\"filter\" method=\"get\" action=\"/admin/idem/abandoned\">",
        "name=\"scope\" value=\"charges\"",
        "<option value=\"failed\" selected>failed (parked)</option>",
        "name=\"idle\" placeholder=\"5m\" value=\"10m\"",
    ] {
        assert!(page.contains(expected), "{expected:?} in {page}");
    }
    for wrong in ["completion=done", "idle=soon", "after=nothing"] {
        let (status, page) = get(app, &format!("/admin/idem/abandoned?{wrong}"), Some(TOKEN)).await;
        assert_eq!(status, 400, "{wrong}: {page}");
    }
}

/// Issue 39: the console's error pages are its pages too: under its policy, with its
/// stylesheet and script linked under the mount point (and served there), and its header.
async fn error_pages(app: &TestApp) {
    let stylesheet = "<link rel=\"stylesheet\" href=\"/admin/idem/assets/console.";
    for (path, token, status) in [
        ("/admin/idem/abandoned?completion=done", TOKEN, 400),
        // Each page's fields are read by one typed reader: what does not parse, or is
        // missing, is a page of the console too, never a plain-text rejection.
        ("/admin/idem/keys?older_than=soon", TOKEN, 400),
        ("/admin/idem/dead?after=x", TOKEN, 400),
        ("/admin/idem/dead/event", TOKEN, 400),
        ("/admin/idem/dead/redrive?all=1", READONLY, 403),
        (
            "/admin/idem/abandoned/abandon?scope=charges&principal=acct_1&key=nothing",
            TOKEN,
            404,
        ),
    ] {
        let (seen, page) = get(app, path, Some(token)).await;
        assert_eq!(seen, status, "{path}: {page}");
        for expected in [
            stylesheet,
            "<a href=\"/admin/idem/keys\">Keys</a>",
            &format!("<h1>{status} "),
        ] {
            assert!(page.contains(expected), "{expected:?} in {path}: {page}");
        }
        assert_assets(app, path, Some(token)).await;
    }
    // An action's form is a form: a JSON body is refused with a page, before anything.
    let response = app
        .client
        .post(app.url("/admin/idem/sweep"))
        .bearer_auth(TOKEN)
        .json(&json!({ "expected": 1 }))
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status().as_u16(), 415);
    let page = response.text().await.unwrap_or_default();
    assert!(page.contains("<h1>415 "), "{page}");
    assert!(page.contains("application/x-www-form-urlencoded"), "{page}");
}

fn config(pooler: Pooler, portable: bool) -> Config {
    Config {
        pooler,
        portable,
        admin_token: Some(TOKEN.into()),
        admin_readonly_token: Some(READONLY.into()),
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
        let parked = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap();
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
        assert_eq!(
            store
                .operate()
                .dead_events_in(&idem::operate::DeadSelection::All, 10)
                .await
                .unwrap()
                .len(),
            parked.len()
        );
    })
    .await;
}

/// The console with its actions on, at `/ops`, behind a layer that names every operator
/// `ana` and gives the role `x-role` asks for (`admin`; anything else read-only): one
/// operator, two roles, so that a form an admin's page made carries a token valid for
/// the read-only request too.
async fn console_with_roles(pool: PgPool, store: &Store) -> TestApp {
    async fn roles(
        mut request: axum::extract::Request,
        next: axum::middleware::Next,
    ) -> axum::response::Response {
        let role = match request.headers().get("x-role").map(|v| v.as_bytes()) {
            Some(b"admin") => Role::Admin,
            _ => Role::ReadOnly,
        };
        request.extensions_mut().insert(role);
        request
            .headers_mut()
            .insert("x-operator", http::HeaderValue::from_static("ana"));
        next.run(request).await
    }
    let console = idem::console::Console::new(store.clone())
        .actions(true)
        .operator_header(http::HeaderName::from_static("x-operator"))
        .router()
        .layer(axum::middleware::from_fn(roles));
    TestApp::serve(pool, axum::Router::new().nest("/ops", console)).await
}

/// A request to the console of [`console_with_roles`] as `role`: status and body, the
/// redirect after an action followed.
async fn as_role(
    app: &TestApp,
    role: &str,
    path: &str,
    form: Option<&[(&str, &str)]>,
) -> (u16, String) {
    let request = match form {
        Some(form) => app.client.post(app.url(path)).form(form),
        None => app.client.get(app.url(path)),
    };
    let response = request
        .header("x-role", role)
        .send()
        .await
        .expect("a request");
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

/// Issue 39: a bulk action's confirmation acts on the events its preview counted (the
/// filter within the bound the preview took), not on whatever the filter matches by
/// then: an event parked after the preview, whether written before the events it counted
/// or after them, is left dead, and the page says so; the audit row has the bound. A
/// confirmation whose bound holds more than its count does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmation_acts_on_what_its_preview_counted() {
    with_test_db(async |db| {
        let pool = db.pool(10).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        let emit = async |key: &str, topics: &[&str]| {
            store
                .run_once("jobs", key)
                .run(async |mut tx| {
                    for topic in topics {
                        tx.emit(Event::new(*topic, &json!({}))).await?;
                    }
                    Ok::<_, sqlx::Error>(())
                })
                .await
                .expect("run the job");
            store
                .relay(Refusing)
                .max_attempts(2)
                .backoff(Duration::from_secs(3_600), Duration::from_secs(3_600))
                .run_until_idle()
                .await
                .expect("run the relay");
        };
        // `slow.x` is written first and backs off; the two `nowhere` events are parked.
        emit("job-1", &["slow.x", "nowhere.a", "nowhere.b"]).await;
        let app = console_with_roles(pool.clone(), &store).await;
        let reason = "no stream captures the subject";
        let (status, preview) = as_role(
            &app,
            "admin",
            &format!("/ops/dead/redrive?reason={}", reason.replace(' ', "+")),
            None,
        )
        .await;
        assert_eq!(status, 200, "{preview}");
        assert!(preview.contains(">Re-drive 2 events</button>"), "{preview}");
        let confirmation = form_of(&preview, "/ops/dead/redrive");

        // After the preview: the event written before the two is parked for the same
        // reason, and a new one is written and parked.
        sqlx::query(
            "UPDATE idem_outbox SET dead_at = now(), last_error = $1 WHERE topic = 'slow.x'",
        )
        .bind(reason)
        .execute(&pool)
        .await
        .unwrap();
        emit("job-2", &["nowhere.c"]).await;
        let selection = DeadSelection::Reason(reason.into());
        assert_eq!(store.operate().dead_count(&selection).await.unwrap(), 4);

        let (status, page) = as_role(
            &app,
            "admin",
            "/ops/dead/redrive",
            Some(&pairs(&confirmation)),
        )
        .await;
        assert_eq!(status, 200, "{page}");
        assert!(
            page.contains(
                "Re-drove 2 dead event(s): they are pending again. 2 dead event(s) \
                           parked after your preview match the filter too; they were left as \
                           they are."
            ),
            "{page}"
        );
        let mut left: Vec<String> = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.topic)
            .collect();
        left.sort();
        assert_eq!(left, ["nowhere.c", "slow.x"]);
        let entry = &store.operate().audit_log(1, None).await.unwrap()[0];
        let through = &confirmation
            .iter()
            .find(|(n, _)| n == "through")
            .expect("the bound's seq")
            .1;
        assert!(
            entry.filter.starts_with(&format!(
                "reason {reason:?}; as previewed: seq <= {through}, parked by "
            )) && entry.filter.ends_with(", 2 previewed"),
            "{entry:?}"
        );
        assert_eq!((entry.action.as_str(), entry.rows), ("redrive", 2));

        // A confirmation whose bound holds more than it counted does nothing.
        let (_, preview) = as_role(
            &app,
            "admin",
            &format!("/ops/dead/discard?reason={}", reason.replace(' ', "+")),
            None,
        )
        .await;
        assert!(preview.contains(">Discard 2 events</button>"), "{preview}");
        let confirmation = form_of(&preview, "/ops/dead/discard");
        let understated: Vec<(&str, &str)> = pairs(&confirmation)
            .into_iter()
            .map(|(n, v)| if n == "expected" { (n, "1") } else { (n, v) })
            .collect();
        let (status, page) = as_role(&app, "admin", "/ops/dead/discard", Some(&understated)).await;
        assert_eq!(status, 409, "{page}");
        assert!(
            page.contains(
                "Nothing was done: 2 dead event(s) are within what you confirmed now, not the 1"
            ),
            "{page}"
        );
        assert_eq!(store.operate().dead_count(&selection).await.unwrap(), 2);
        let (status, page) = as_role(
            &app,
            "admin",
            "/ops/dead/discard",
            Some(&pairs(&confirmation)),
        )
        .await;
        assert_eq!(status, 200, "{page}");
        assert!(page.contains("Discarded 2 dead event(s)."), "{page}");
        assert_eq!(store.operate().dead_count(&selection).await.unwrap(), 0);
    })
    .await;
}

/// Issue 39: the role is the application's: a read-only request sees no action and is
/// refused (403) every action, even with a CSRF token valid for its operator; the same
/// form acts for an admin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_operator_is_refused_with_a_valid_token() {
    with_test_db(async |db| {
        let (pool, store) = seeded(db, 10).await;
        let app = console_with_roles(pool, &store).await;
        let (status, admin) = as_role(&app, "admin", "/ops/dead", None).await;
        assert_eq!(status, 200, "{admin}");
        assert!(admin.contains("Re-drive all"), "{admin}");
        let (_, key) = as_role(&app, "admin", "/ops/key?scope=jobs&key=job-1", None).await;
        let token = csrf(&key);
        let (status, seen) = as_role(&app, "viewer", "/ops/dead", None).await;
        assert_eq!(status, 200, "{seen}");
        assert!(seen.contains("read-only"), "{seen}");
        for action in [
            "method=\"post\"",
            "Re-drive these",
            "Re-drive all",
            "type=\"checkbox\"",
            "csrf",
        ] {
            assert!(!seen.contains(action), "{action} in {seen}");
        }
        let (_, key) = as_role(&app, "viewer", "/ops/key?scope=jobs&key=job-1", None).await;
        assert!(!key.contains("Purge"), "{key}");
        let (_, keys) = as_role(&app, "viewer", "/ops/keys", None).await;
        assert!(!keys.contains("Sweep"), "{keys}");
        for preview in [
            "/ops/dead/redrive?all=1",
            "/ops/dead/discard?all=1",
            "/ops/sweep",
        ] {
            let (status, page) = as_role(&app, "viewer", preview, None).await;
            assert_eq!(status, 403, "{preview}: {page}");
        }

        let (_, preview) = as_role(&app, "admin", "/ops/dead/redrive?all=1", None).await;
        let confirmation = form_of(&preview, "/ops/dead/redrive");
        assert!(confirmation.contains(&("csrf".to_owned(), token.clone())));
        let purge = [
            ("scope", "jobs"),
            ("key", "job-2"),
            ("csrf", token.as_str()),
        ];
        let sweep = [("expected", "0"), ("csrf", token.as_str())];
        for (path, form) in [
            ("/ops/dead/redrive", pairs(&confirmation)),
            ("/ops/key/purge", purge.to_vec()),
            ("/ops/sweep", sweep.to_vec()),
        ] {
            let (status, page) = as_role(&app, "viewer", path, Some(&form)).await;
            assert_eq!(status, 403, "{path}: {page}");
            assert!(page.contains("role is read-only"), "{path}: {page}");
        }
        assert_eq!(
            store
                .operate()
                .dead_events_in(&idem::operate::DeadSelection::All, 10)
                .await
                .unwrap()
                .len(),
            2,
            "nothing moved"
        );
        assert!(store.inspect("jobs", "", "job-2").await.unwrap().is_some());
        assert!(store
            .operate()
            .audit_log(10, None)
            .await
            .unwrap()
            .is_empty());

        let (status, page) = as_role(
            &app,
            "admin",
            "/ops/dead/redrive",
            Some(&pairs(&confirmation)),
        )
        .await;
        assert_eq!(status, 200, "{page}");
        assert!(page.contains("Re-drove 2 dead event(s)"), "{page}");
    })
    .await;
}

/// Issue 37: the dead events' pages show each event's age beside the re-drive window and
/// mark those outside it; a re-drive's confirmation page says how many are outside it,
/// and its button (`force=1`) names them. A confirmation without `force` that finds one
/// outside the window by then moves nothing and answers a page that says why, whose form
/// re-drives the same events with `force=1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_past_the_window_asks_first() {
    with_test_db(async |db| {
        let (pool, store) = seeded(db, 10).await;
        let parked = store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap();
        let (old, young) = (&parked[0].id, &parked[1].id);
        sqlx::query("UPDATE idem_outbox SET created_at = now() - interval '3 days' WHERE id = $1")
            .bind(old)
            .execute(&pool)
            .await
            .unwrap();
        let app = console_with_roles(pool.clone(), &store).await;
        let marker = "outside the re-drive window</span>";
        let (status, dead) = as_role(&app, "admin", "/ops/dead", None).await;
        assert_eq!(status, 200, "{dead}");
        assert!(dead.contains("Re-drive window: 24 h"), "{dead}");
        assert_eq!(dead.matches(marker).count(), 1, "{dead}");
        let (_, page) = as_role(&app, "admin", &format!("/ops/dead/event?id={old}"), None).await;
        assert!(page.contains("3 d ago") && page.contains(marker), "{page}");
        let (_, page) = as_role(&app, "admin", &format!("/ops/dead/event?id={young}"), None).await;
        assert!(!page.contains(marker), "{page}");

        // The preview of both names the one outside the window on its button.
        let (status, preview) = as_role(
            &app,
            "admin",
            &format!("/ops/dead/redrive?id={old}&id={young}"),
            None,
        )
        .await;
        assert_eq!(status, 200, "{preview}");
        assert!(
            preview.contains("1 of them were written more than 24 h ago")
                && preview.contains(">Re-drive 2 events, 1 past the window</button>"),
            "{preview}"
        );
        let forced = form_of(&preview, "/ops/dead/redrive");
        for field in [
            ("id", old.as_str()),
            ("id", young),
            ("force", "1"),
            ("expected", "2"),
        ] {
            assert!(
                forced.contains(&(field.0.to_owned(), field.1.to_owned())),
                "{field:?} in {forced:?}"
            );
        }
        // Without `force`, the confirmation moves nothing and asks again.
        let unforced: Vec<(&str, &str)> = pairs(&forced)
            .into_iter()
            .filter(|(n, _)| *n != "force")
            .collect();
        let (status, page) = as_role(&app, "admin", "/ops/dead/redrive", Some(&unforced)).await;
        assert_eq!(status, 409, "{page}");
        assert!(
            page.contains("Nothing was re-driven.")
                && page.contains("1 of the 2 selected dead event(s)")
                && page.contains(">Re-drive 2 events anyway</button>"),
            "{page}"
        );
        assert_eq!(form_of(&page, "/ops/dead/redrive"), forced);
        assert_eq!(
            store
                .operate()
                .dead_events_in(&idem::operate::DeadSelection::All, 10)
                .await
                .unwrap()
                .len(),
            2,
            "nothing moved"
        );
        let (status, page) =
            as_role(&app, "admin", "/ops/dead/redrive", Some(&pairs(&forced))).await;
        assert_eq!(status, 200, "{page}");
        assert!(page.contains("Re-drove 2 dead event(s)"), "{page}");
        assert!(store
            .operate()
            .dead_events_in(&idem::operate::DeadSelection::All, 10)
            .await
            .unwrap()
            .is_empty());
        let entry = &store.operate().audit_log(1, None).await.unwrap()[0];
        assert_eq!((entry.action.as_str(), entry.rows), ("redrive_forced", 2));
    })
    .await;
}

/// Abandoned requests as idem leaves them, each with a step recorded an hour ago: of
/// principal `acct_1` in scope `charges`, `k-failed` and `k-parked` stored and parked as
/// failed after five runs, `k-pending` stored and pending; `k-plain` in scope `jobs`, of an
/// endpoint that stores no request.
async fn seed_abandoned(pool: &PgPool) {
    for (scope, principal, key) in [
        ("charges", "acct_1", "k-failed"),
        ("charges", "acct_1", "k-parked"),
        ("charges", "acct_1", "k-pending"),
        ("jobs", "", "k-plain"),
    ] {
        sqlx::query(
            "INSERT INTO idempotency_steps
                 (scope, principal, key, step, fingerprint, result, created_at, expires_at)
             VALUES ($1, $2, $3, 'processor', decode('00', 'hex'), '7',
                     now() - interval '1 hour', now() + interval '1 day')",
        )
        .bind(scope)
        .bind(principal)
        .bind(key)
        .execute(pool)
        .await
        .expect("a step");
    }
    sqlx::query(
        "INSERT INTO idempotency_requests
             (scope, principal, key, fingerprint, method, target, headers, body, state, tries,
              failures, last_error, error_at, expires_at)
         SELECT 'charges', 'acct_1', key, decode('00', 'hex'), 'POST', '/charges', '[]',
                convert_to('{}', 'UTF8'), state, tries, tries, last_error,
                CASE WHEN last_error IS NOT NULL THEN now() - interval '1 minute' END,
                now() + interval '1 day'
           FROM (VALUES ('k-failed', 'failed', 5, 'the processor declined: card expired'),
                        ('k-parked', 'failed', 5, 'the processor declined: card expired'),
                        ('k-pending', 'pending', 0, NULL))
                AS r (key, state, tries, last_error)",
    )
    .execute(pool)
    .await
    .expect("the stored requests");
}

/// The form of an action on the abandoned request `(scope, principal, key)`, as the list
/// at `idle=0s` sends it (the list's query to come back to): with `csrf`, and `confirmed`
/// as the abandon's confirmation page sends it.
fn acting_on<'a>(
    (scope, principal, key): (&'a str, &'a str, &'a str),
    csrf: Option<&'a str>,
    confirmed: bool,
) -> Vec<(&'static str, &'a str)> {
    let mut form = vec![
        ("scope", scope),
        ("principal", principal),
        ("key", key),
        ("list", "idle=0s"),
    ];
    if let Some(csrf) = csrf {
        form.push(("csrf", csrf));
    }
    if confirmed {
        form.push(("confirmed", "1"));
    }
    form
}

/// The state and failures of `key`'s row in the requests table, if it has one.
async fn request_state(pool: &PgPool, key: &str) -> Option<(String, i32)> {
    sqlx::query_as("SELECT state, failures FROM idempotency_requests WHERE key = $1")
        .bind(key)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// Issue 38 and 39: the abandoned requests' page shows where each one's completion stands
/// (state, tries, failures, the last error and when; "not completable" for a request its
/// endpoint did not store). An admin sends a stored one to be completed (a parked one is
/// pending again, its failures forgotten), and abandons one for good from a page that
/// names it and says what follows, only with that page's button; each is audited. A
/// read-only operator sees no action and is refused both, with a valid token; an action
/// that finds nothing to act on does nothing and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_request_is_completed_or_abandoned_by_an_admin() {
    with_test_db(async |db| {
        let pool = db.pool(10).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        seed_abandoned(&pool).await;
        let app = console_with_roles(pool.clone(), &store).await;

        let (status, seen) = as_role(&app, "viewer", "/ops/abandoned?idle=0s", None).await;
        assert_eq!(status, 200, "{seen}");
        for expected in [
            "failed <span class=\"muted\">(parked: too many runs failed)</span>",
            "pending <span class=\"muted\">(the completer runs it)</span>",
            "<td class=\"n\">5</td><td class=\"n\">5</td>",
            "<code>the processor declined: card expired</code>",
            "<span class=\"muted\">not completable</span>",
        ] {
            assert!(seen.contains(expected), "{expected:?} in {seen}");
        }
        for action in [
            "Complete now",
            "Abandon for good",
            "method=\"post\"",
            "csrf",
        ] {
            assert!(!seen.contains(action), "{action} in {seen}");
        }
        let (status, list) = as_role(&app, "admin", "/ops/abandoned?idle=0s", None).await;
        assert_eq!(status, 200, "{list}");
        assert_eq!(
            list.matches(">Complete now</button>").count(),
            3,
            "the stored ones: {list}"
        );
        assert_eq!(list.matches(">Abandon for good…</a>").count(), 4, "{list}");
        assert!(
            list.contains(
                "href=\"/ops/abandoned/abandon?scope=charges&amp;principal=acct_1&amp;\
                 key=k-failed&amp;list=idle%3D0s\""
            ),
            "{list}"
        );
        let token = csrf(&list);
        let failed = ("charges", "acct_1", "k-failed");

        // Read-only: the confirmation page and both actions refused, a valid token or not.
        let (status, _) = as_role(
            &app,
            "viewer",
            "/ops/abandoned/abandon?scope=charges&principal=acct_1&key=k-failed",
            None,
        )
        .await;
        assert_eq!(status, 403);
        for (path, form) in [
            (
                "/ops/abandoned/abandon",
                acting_on(failed, Some(&token), true),
            ),
            (
                "/ops/abandoned/complete",
                acting_on(failed, Some(&token), false),
            ),
        ] {
            let (status, page) = as_role(&app, "viewer", path, Some(&form)).await;
            assert_eq!(status, 403, "{path}: {page}");
            assert!(page.contains("role is read-only"), "{path}: {page}");
        }
        // An admin's form without its token is refused too.
        let (status, _) = as_role(
            &app,
            "admin",
            "/ops/abandoned/complete",
            Some(&acting_on(failed, None, false)),
        )
        .await;
        assert_eq!(status, 403);
        assert_eq!(
            request_state(&pool, "k-failed").await,
            Some(("failed".to_owned(), 5))
        );
        assert!(store.operate().audit_log(10, None).await.unwrap().is_empty());

        // Abandon: the confirmation page names the request and says what follows; a form
        // without `confirmed` is answered that page; its button abandons.
        let (status, page) = as_role(
            &app,
            "admin",
            "/ops/abandoned/abandon?scope=charges&principal=acct_1&key=k-failed&list=idle%3D0s",
            None,
        )
        .await;
        assert_eq!(status, 200, "{page}");
        for expected in [
            "<h1>Abandon this request for good?</h1>",
            "<code>charges</code>",
            "<code>acct_1</code>",
            "<code>k-failed</code>",
            "<code>processor</code>",
            "Each of its 1 step that has an undo registered will be undone; a step without one is NOT undone. The key will answer 409 meanwhile, then 410.",
            ">Abandon for good</button>",
            "href=\"/ops/abandoned?idle=0s\">Cancel</a>",
        ] {
            assert!(page.contains(expected), "{expected:?} in {page}");
        }
        let confirmation = form_of(&page, "/ops/abandoned/abandon");
        assert!(
            confirmation.contains(&("confirmed".to_owned(), "1".to_owned())),
            "{confirmation:?}"
        );
        let (status, again) = as_role(
            &app,
            "admin",
            "/ops/abandoned/abandon",
            Some(&acting_on(failed, Some(&token), false)),
        )
        .await;
        assert_eq!(status, 200, "{again}");
        assert!(again.contains(">Abandon for good</button>"), "{again}");
        assert_eq!(
            request_state(&pool, "k-failed").await,
            Some(("failed".to_owned(), 5))
        );
        let (status, page) = as_role(
            &app,
            "admin",
            "/ops/abandoned/abandon",
            Some(&pairs(&confirmation)),
        )
        .await;
        assert_eq!(status, 200, "{page}");
        assert!(
            page.contains(
                "Abandoned key &quot;k-failed&quot; in scope &quot;charges&quot; of principal \
                 &quot;acct_1&quot;: the service's completer undoes its steps that have an undo \
                 registered, then answers 410 to its key from then on, naming any step it did \
                 not undo."
            ),
            "{page}"
        );
        assert!(
            page.contains("abandoning <span class=\"muted\">(its registered undos run, then 410)"),
            "back on the list, as it was (no step for 0s): {page}"
        );
        assert_eq!(
            request_state(&pool, "k-failed").await,
            Some(("abandoning".to_owned(), 5))
        );
        let entry = &store.operate().audit_log(1, None).await.unwrap()[0];
        assert_eq!(
            (
                entry.operator.as_str(),
                entry.via.as_str(),
                entry.action.as_str(),
                entry.filter.as_str(),
                entry.rows
            ),
            (
                "ana",
                "console",
                "abandon",
                "scope \"charges\", principal \"acct_1\", key \"k-failed\"",
                1
            )
        );

        // Complete now, from the second page of a filtered list (a page at a time): the
        // parked request is pending again, its failures forgotten, and the operator is
        // back on that page, its filter kept.
        let (_, first) = as_role(
            &app,
            "admin",
            "/ops/abandoned?scope=charges&idle=0s&limit=1",
            None,
        )
        .await;
        assert!(first.contains(">k-failed</code>"), "{first}");
        let second = next_page(&first).unwrap_or_else(|| panic!("a next page in {first}"));
        let (status, second) = as_role(&app, "admin", &second, None).await;
        assert_eq!(status, 200, "{second}");
        assert!(second.contains(">k-parked</code>"), "{second}");
        let complete = form_of(&second, "/ops/abandoned/complete");
        let list = &complete
            .iter()
            .find(|(n, _)| n == "list")
            .expect("the list")
            .1;
        assert!(
            list.starts_with("scope=charges&idle=0s&limit=1&after="),
            "{list}"
        );
        let (status, page) = as_role(
            &app,
            "admin",
            "/ops/abandoned/complete",
            Some(&pairs(&complete)),
        )
        .await;
        assert_eq!(status, 200, "{page}");
        assert!(
            page.contains("to be completed: the completer runs it at its next look"),
            "{page}"
        );
        assert!(
            page.contains(">k-parked</code>")
                && !page.contains(">k-failed</code>")
                && page.contains("pending <span class=\"muted\">(the completer runs it)")
                && page.contains("name=\"scope\" value=\"charges\""),
            "back on the second page: {page}"
        );
        assert!(
            next_page(&page).is_some_and(|next| next.contains("scope=charges")),
            "{page}"
        );
        assert_eq!(
            request_state(&pool, "k-parked").await,
            Some(("pending".to_owned(), 0))
        );
        let entry = &store.operate().audit_log(1, None).await.unwrap()[0];
        assert_eq!(
            (entry.action.as_str(), entry.filter.as_str(), entry.rows),
            (
                "complete",
                "scope \"charges\", principal \"acct_1\", key \"k-parked\"",
                1
            )
        );

        // Nothing to act on: a request its endpoint did not store cannot be completed
        // (409); a key without live steps can be neither (404). Nothing is audited.
        let plain = ("jobs", "", "k-plain");
        let (status, page) = as_role(
            &app,
            "admin",
            "/ops/abandoned/complete",
            Some(&acting_on(plain, Some(&token), false)),
        )
        .await;
        assert_eq!(status, 409, "{page}");
        assert!(
            page.contains("not completable), or is being abandoned"),
            "{page}"
        );
        let nothing = ("charges", "acct_1", "k-nothing");
        for (path, form) in [
            (
                "/ops/abandoned/complete",
                acting_on(nothing, Some(&token), false),
            ),
            (
                "/ops/abandoned/abandon",
                acting_on(nothing, Some(&token), true),
            ),
        ] {
            let (status, page) = as_role(&app, "admin", path, Some(&form)).await;
            assert_eq!(status, 404, "{path}: {page}");
            assert!(page.contains("has no live steps"), "{path}: {page}");
        }
        let (status, _) = as_role(
            &app,
            "admin",
            "/ops/abandoned/abandon?scope=charges&principal=acct_1&key=k-nothing",
            None,
        )
        .await;
        assert_eq!(status, 404);
        assert_eq!(store.operate().audit_log(10, None).await.unwrap().len(), 2);

        // A request its endpoint did not store is abandoned all the same: listed as not
        // completable and abandoning, without actions.
        let (status, page) = as_role(
            &app,
            "admin",
            "/ops/abandoned/abandon",
            Some(&acting_on(plain, Some(&token), true)),
        )
        .await;
        assert_eq!(status, 200, "{page}");
        assert_eq!(
            request_state(&pool, "k-plain").await.unwrap().0,
            "abandoning"
        );
        assert!(
            page.contains("<span class=\"muted\">not completable</span>, abandoning"),
            "{page}"
        );
        assert_eq!(
            page.matches(">Abandon for good…</a>").count(),
            2,
            "none for the two being abandoned: {page}"
        );
    })
    .await;
}

/// A publisher that parks `nowhere.*` at once and holds `hold.*` until its publish times
/// out: an event under a relay's lease for as long as a test looks.
struct Holding;

impl Publisher for Holding {
    async fn publish(&self, event: &OutboxEvent) -> Result<(), PublishError> {
        if event.topic.starts_with("hold.") {
            tokio::time::sleep(Duration::from_secs(3_600)).await;
        }
        Err(PublishError::permanent("no stream captures the subject"))
    }
}

/// Issue 39: the relay shows as its host and process wherever its owner number appears
/// (a lease, a pending event, the relays' block of the overview and the outbox), and the
/// overview shows what this process's relay published, retried and parked, labelled as
/// this process's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_shows_as_its_host_and_process_with_its_figures() {
    with_test_db(async |db| {
        let pool = db.pool(10).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        let relay = Arc::new(
            store
                .relay(Holding)
                .max_attempts(1)
                .lease(Duration::from_secs(120))
                .publish_timeout(Duration::from_secs(60))
                .spawn()
                .expect("start the relay"),
        );
        let console = idem::console::Console::new(store.clone())
            .relay_stats({
                let relay = Arc::clone(&relay);
                move || relay.stats()
            })
            .router();
        let app = TestApp::serve(pool.clone(), axum::Router::new().nest("/ops", console)).await;
        // Seen before anything was parked: the figures start from here.
        let (status, before) = get(&app, "/ops", None).await;
        assert_eq!(status, 200, "{before}");
        assert!(before.contains("id=\"parked-rate\">0<"), "{before}");
        let emit = async |key: &str, topics: &[&str]| {
            store
                .run_once("jobs", key)
                .run(async |mut tx| {
                    for topic in topics {
                        tx.emit(Event::new(*topic, &json!({}))).await?;
                    }
                    Ok::<_, sqlx::Error>(())
                })
                .await
                .expect("run the job");
        };
        emit("job-1", &["nowhere.a", "nowhere.b"]).await;
        until("both events parked", async || {
            (relay.stats().dead == 2).then_some(())
        })
        .await;

        let sessions = store.operate().outbox_relays().await.unwrap();
        assert_eq!(sessions.len(), 1, "{sessions:?}");
        let pid = format!(" pid <code>{}</code>", std::process::id());
        let (_, overview) = get(&app, "/ops", None).await;
        let process = overview.find("From this process").expect("its block");
        let figures = &overview[process..];
        assert!(
            figures.contains("The relays of this process")
                && figures.contains("id=\"parked-rate\">2<")
                && figures.contains("id=\"published-rate\">0<"),
            "{figures}"
        );
        let relays = &overview[overview
            .find("<table class=\"relays\">")
            .expect("the relays")..];
        assert!(
            relays.contains(&format!("<code>{}</code>", sessions[0].name))
                && sessions[0].name.starts_with("idem relay "),
            "{relays}"
        );

        // An event the relay holds: its lease names the relay's host and process.
        emit("job-2", &["hold.x"]).await;
        let lease = until("the event leased by the relay", async || {
            let leases = store.operate().outbox_leases(10).await.ok()?;
            leases.into_iter().find(|l| l.owner.is_some())
        })
        .await;
        assert_eq!(lease.owner.map(i64::from), Some(sessions[0].owner));
        for path in [
            "/ops/outbox".to_owned(),
            "/ops/pending".to_owned(),
            format!("/ops/pending/event?id={}", lease.id),
        ] {
            let (status, page) = get(&app, &path, None).await;
            assert_eq!(status, 200, "{path}: {page}");
            let title = format!("title=\"relay {}: session &quot;", sessions[0].owner);
            assert!(
                page.contains(&pid) && page.contains(&title),
                "{path}: {pid} and {title} in {page}"
            );
        }
        relay.abort();
    })
    .await;
}

/// Issue 39: the consumers' dead letters, read back from a JetStream stream of the
/// test's own: listed newest first with the event's id, subject, reason and time, the
/// payload hidden unless the service shows bodies; linked from the header only where
/// configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letters_page_lists_a_streams_dead_letters() {
    let stream = unique("console_dead");
    let js = jetstream::new(async_nats::connect(nats_url()).await.expect("NATS"));
    // Gone on its own within ten minutes, should the test stop before it deletes it.
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec![format!("{stream}.>")],
        max_age: Duration::from_secs(600),
        ..Default::default()
    })
    .await
    .expect("create the dead letters' stream");
    for (id, reason) in [
        ("evt-older", "payload is not JSON"),
        ("evt-newer", "no Nats-Msg-Id header"),
    ] {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Idem-Event-Id", id);
        headers.insert("Idem-Dead-Subject", "charges.charge.created");
        headers.insert("Idem-Dead-Reason", reason);
        js.publish_with_headers(
            format!("{stream}.ledger"),
            headers,
            "{\"card\":\"4111 1111 1111 1111\"}".into(),
        )
        .await
        .unwrap()
        .await
        .expect("the dead letter stored");
    }
    with_test_db(async |db| {
        let pool = db.pool(5).await;
        let store = Store::new(pool.clone());
        store.migrate().await.unwrap();
        let serve = async |show: bool, letters: bool| {
            let mut console = idem::console::Console::new(store.clone()).show_bodies(show);
            if letters {
                console = console.jetstream_dead_letters(js.clone(), stream.clone());
            }
            TestApp::serve(
                pool.clone(),
                axum::Router::new().nest("/ops", console.router()),
            )
            .await
        };
        let hidden = serve(false, true).await;
        let (status, overview) = get(&hidden, "/ops", None).await;
        assert_eq!(status, 200);
        assert!(
            overview.contains("<a href=\"/ops/dead-letters\">Dead letters</a>"),
            "{overview}"
        );
        let (status, page) = get(&hidden, "/ops/dead-letters", None).await;
        assert_eq!(status, 200, "{page}");
        let newer = page.find("evt-newer").expect("the newer letter");
        let older = page.find("evt-older").expect("the older letter");
        assert!(newer < older, "newest first: {page}");
        for expected in [
            "<code>charges.charge.created</code>",
            "<code>payload is not JSON</code>",
            "<code>no Nats-Msg-Id header</code>",
            &format!("<code>{stream}</code>"),
            "bytes, hidden",
        ] {
            assert!(page.contains(expected), "{expected} in {page}");
        }
        assert!(!page.contains("4111"), "the payload stays hidden: {page}");
        let (_, one) = get(&hidden, "/ops/dead-letters?limit=1", None).await;
        assert!(
            one.contains("evt-newer") && !one.contains("evt-older"),
            "{one}"
        );

        let shown = serve(true, true).await;
        let (_, page) = get(&shown, "/ops/dead-letters", None).await;
        assert!(page.contains("4111 1111 1111 1111"), "{page}");

        let without = serve(false, false).await;
        let (_, overview) = get(&without, "/ops", None).await;
        assert!(!overview.contains("Dead letters"), "{overview}");
        assert_eq!(get(&without, "/ops/dead-letters", None).await.0, 404);
    })
    .await;
    js.delete_stream(&stream)
        .await
        .expect("delete the test's stream");
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
        let js = jetstream::new(async_nats::connect(nats_url()).await.unwrap());
        let mut config = Config {
            events: Some(prefix.clone()),
            admin_token: Some(TOKEN.into()),
            admin_readonly_token: Some(READONLY.into()),
            jetstream: Some(js.clone()),
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
        let relay = Arc::new(relay);
        config.relay = Some(Arc::clone(&relay));
        let app = TestApp::serve(pool.clone(), charges::app(pool.clone(), config)).await;

        // Issue 39: a message the ledger can never book (not a charge event) is a dead
        // letter of the ledger, in `<prefix>_dead`, which the console lists.
        let (dead_stream, _) = charges::events::dead_letters(&prefix);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(MSG_ID, "not-a-charge-1");
        js.publish_with_headers(
            format!("{prefix}.charge.created"),
            headers,
            "not a charge".into(),
        )
        .await
        .unwrap()
        .await
        .expect("the message stored");
        let letter = until("the ledger's dead letter", async || {
            let letters = idem::outbox::nats::dead_letters(&js, &dead_stream, 10)
                .await
                .ok()?;
            letters.into_iter().next()
        })
        .await;
        assert_eq!(letter.event_id, "not-a-charge-1");

        let driver = Chromedriver::start();
        let mut capabilities = serde_json::Map::new();
        capabilities.insert(
            "goog:chromeOptions".into(),
            json!({ "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                             "--disable-dev-shm-usage", "--window-size=1400,1000"] }),
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
        // Issue 39: the relays, by the names their sessions carry: this process's.
        let relays = browser
            .find(Locator::Css("table.relays"))
            .await
            .expect("the relays")
            .text()
            .await
            .unwrap();
        assert!(
            relays.contains("idem relay")
                && relays.contains(&format!(" pid {}", std::process::id())),
            "{relays}"
        );
        screenshot(&browser, "outbox").await;

        // Issue 39: the overview refreshes itself. Loaded before both events are parked
        // (the refund's is tried only once the charge's is), it shows both parked without
        // a reload: a marker set on the page after it loaded is still there.
        browser.goto(&app.url("/admin/idem")).await.unwrap();
        let figure = async || match browser.find(Locator::Css("#dead-total")).await {
            Ok(figure) => figure.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        let first = until("the overview", async || {
            let shown = figure().await;
            (!shown.is_empty()).then_some(shown)
        })
        .await;
        assert_ne!(first, "2 dead", "the refund's event cannot be parked yet");
        browser
            .execute("window.idemMarker = 'loaded once'; return null;", vec![])
            .await
            .unwrap();
        until("the overview to show both events parked", async || {
            (figure().await == "2 dead").then_some(())
        })
        .await;
        let marker = browser
            .execute("return window.idemMarker || null;", vec![])
            .await
            .unwrap();
        assert_eq!(marker, json!("loaded once"), "refreshed without a reload");
        let dead = store.operate().dead_events_in(&idem::operate::DeadSelection::All, 10).await.unwrap();
        assert_eq!(dead.len(), 2, "{dead:?}");
        screenshot(&browser, "overview").await;
        // Paused, it holds still while the test reads it.
        let live = browser.find(Locator::Css("#live")).await.unwrap();
        assert!(
            live.text().await.unwrap().starts_with("live, every 5 s"),
            "{:?}",
            live.text().await
        );
        browser
            .find(Locator::Css("#live button"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
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

        // The dead list has both; the stream is back; the operator re-drives the charge's
        // event, picked in the list, through its confirmation page.
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

        // Issue 39: the charge's event's page has its attempt history: its three failed
        // publishes with their times, oldest first.
        browser
            .find(Locator::Css(&format!(
                "table.events a code[title='{}']",
                dead[0].id
            )))
            .await
            .expect("the event's link")
            .click()
            .await
            .unwrap();
        let history = until("the event's attempt history", async || {
            let table = browser.find(Locator::Css("table.attempts")).await.ok()?;
            table.text().await.ok()
        })
        .await;
        let errors = store.operate().event_errors(&dead[0].id).await.unwrap();
        assert_eq!(errors.len(), 3, "{errors:?}");
        let rows: Vec<&str> = history.lines().skip(1).collect();
        assert_eq!(rows.len(), 3, "{history}");
        for (row, error) in rows.iter().zip(&errors) {
            assert!(
                row.contains(&idem::operate::format_time(error.at)) && row.contains(&error.error),
                "{error:?} in {row}"
            );
        }
        // With the script, the whole id has its copy button.
        let copy = browser
            .find(Locator::Css("span.id.whole button.copy"))
            .await
            .unwrap();
        assert!(copy.is_displayed().await.unwrap());
        assert_eq!(
            copy.attr("data-copy").await.unwrap().as_deref(),
            Some(dead[0].id.as_str())
        );
        screenshot(&browser, "event").await;
        browser.back().await.unwrap();
        until("the dead list again", async || {
            browser.find(Locator::Css(&checkbox)).await.ok()
        })
        .await;
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
            .find(Locator::XPath("//button[text()='Re-drive selected…']"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let confirm = until("the re-drive's confirmation", async || {
            browser
                .find(Locator::XPath("//button[text()='Re-drive 1 event']"))
                .await
                .ok()
        })
        .await;
        let preview = text().await;
        assert!(
            preview.contains(&dead[0].id) && !preview.contains(&dead[1].id),
            "{preview}"
        );
        screenshot(&browser, "preview").await;
        confirm.click().await.unwrap();
        assert_eq!(
            notice(&browser).await,
            "Re-drove 1 dead event(s): they are pending again."
        );

        // Issue 39: the operator filters the dead list by reason, and re-drives what the
        // filter finds through its confirmation page, which names the count.
        let reason = &dead[1].last_error;
        let filter = browser
            .form(Locator::Css("form.filter"))
            .await
            .expect("the dead list's filter");
        filter.set_by_name("reason", reason).await.unwrap();
        filter.submit().await.unwrap();
        let filtered = until("the dead list filtered by reason", async || {
            let page = text().await;
            page.contains("1 dead event matches the filter.")
                .then_some(page)
        })
        .await;
        assert!(filtered.contains(&dead[1].id), "{filtered}");
        browser
            .find(Locator::LinkText("Re-drive these…"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let confirm = until("the reason's confirmation", async || {
            browser
                .find(Locator::XPath("//button[text()='Re-drive 1 event']"))
                .await
                .ok()
        })
        .await;
        let preview = text().await;
        assert!(
            preview.contains(&dead[1].id) && preview.contains(&format!("reason {reason:?}")),
            "{preview}"
        );
        confirm.click().await.unwrap();
        assert_eq!(
            notice(&browser).await,
            "Re-drove 1 dead event(s): they are pending again."
        );

        // The audit trail has both re-drives, the operator's name, what was selected with
        // the bound of its preview, and the count, newest first: the reason's, then the
        // event picked by its id.
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
        for (row, selected) in rows
            .iter()
            .zip([format!("reason {reason:?}"), format!("ids {}", dead[0].id)])
        {
            let found = [
                "admin",
                "console",
                "redrive",
                &selected,
                "as previewed: seq <=",
            ]
            .iter()
            .all(|cell| row.contains(cell));
            assert!(found && row.trim_end().ends_with('1'), "{row} in {trail}");
        }
        screenshot(&browser, "audit").await;

        // Issue 39: the ledger's dead letter, from the header's link.
        browser
            .find(Locator::LinkText("Dead letters"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let letters = until("the dead letters", async || {
            let table = browser.find(Locator::Css("table.letters")).await.ok()?;
            table.text().await.ok()
        })
        .await;
        assert!(
            letters.contains("not-a-charge-1")
                && letters.contains(&letter.reason)
                && letters.contains(&format!("{prefix}.charge.created"))
                && letters.contains("bytes, hidden")
                && !letters.contains("not a charge"),
            "{letters}"
        );
        screenshot(&browser, "dead-letters").await;
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

        // The account's keys, a page at a time by keyset: the refund's, then the charge's.
        browser
            .goto(&app.url("/admin/idem/keys?principal=acct_1&limit=1"))
            .await
            .unwrap();
        let listed = async || -> Vec<String> {
            let Ok(table) = browser.find(Locator::Css("table.keys")).await else {
                return Vec::new();
            };
            let text = table.text().await.unwrap_or_default();
            text.lines().skip(1).map(str::to_owned).collect()
        };
        let first = until("the first page of keys", async || {
            let rows = listed().await;
            (!rows.is_empty()).then_some(rows)
        })
        .await;
        assert!(
            first.len() == 1 && first[0].contains("refund-1"),
            "{first:?}"
        );
        screenshot(&browser, "keys").await;
        browser
            .find(Locator::LinkText("Next page"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let second = until("the next page of keys", async || {
            let rows = listed().await;
            rows.iter().any(|r| r.contains("order-1")).then_some(rows)
        })
        .await;
        assert_eq!(second.len(), 1, "{second:?}");
        assert!(
            browser.find(Locator::LinkText("Next page")).await.is_err(),
            "the last page"
        );

        // The charge's key looked up: its record.
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

        // Issue 38: a charge whose completion failed for good, parked, on the
        // "Abandoned" page with its actions.
        let record_page = browser.current_url().await.unwrap();
        sqlx::raw_sql(
            "INSERT INTO idempotency_steps (scope, principal, key, step, fingerprint, result, \
                 created_at, expires_at) \
             VALUES ('charges', 'acct_1', 'order-9', 'processor', sha256('order-9'::bytea), \
                 '{\"outcome\":\"charged\",\"id\":\"ch_9\"}', now() - interval '10 minutes', \
                 now() + interval '1 day'); \
             INSERT INTO idempotency_requests (scope, principal, key, fingerprint, method, target, \
                 headers, body, state, tries, failures, last_error, error_at, created_at, expires_at) \
             VALUES ('charges', 'acct_1', 'order-9', sha256('order-9'::bytea), 'POST', '/charges', \
                 '[]', '{}', 'failed', 5, 5, \
                 'answered 500 Internal Server Error: the charges table refused the row', now(), \
                 now() - interval '10 minutes', now() + interval '1 day')",
        )
        .execute(&app.pool)
        .await
        .expect("a parked completion");
        browser.goto(&app.url("/admin/idem/abandoned")).await.unwrap();
        until("the parked completion", async || {
            let page = text().await;
            (page.contains("order-9") && page.contains("failed")).then_some(())
        })
        .await;
        screenshot(&browser, "abandoned").await;
        browser.goto(record_page.as_str()).await.unwrap();
        let token = csrf(&browser.source().await.unwrap());
        let key_page = browser.current_url().await.unwrap();

        // Issue 39: the read-only operator (ADMIN_READONLY_TOKEN) sees the same page without
        // its button, and a purge posted by hand, with the form's CSRF token, is refused.
        browser
            .issue_cmd(DevTools(
                "Network.setExtraHTTPHeaders",
                json!({ "headers": { "Authorization": format!("Bearer {READONLY}") } }),
            ))
            .await
            .unwrap();
        browser.goto(key_page.as_str()).await.unwrap();
        let seen = until("the key's record, read-only", async || {
            let record = text().await;
            record.contains("fingerprint").then_some(record)
        })
        .await;
        assert!(!seen.contains("Purge"), "{seen}");
        assert!(
            browser
                .find(Locator::Css("form[method=post]"))
                .await
                .is_err(),
            "no action's form"
        );
        let level = browser.find(Locator::Css("header .muted")).await.unwrap();
        assert_eq!(level.text().await.unwrap(), "read-only");
        browser
            .execute(
                "const form = document.createElement('form');
                 form.method = 'post';
                 form.action = arguments[0];
                 for (const [name, value] of arguments[1]) {
                     const input = document.createElement('input');
                     input.type = 'hidden';
                     input.name = name;
                     input.value = value;
                     form.appendChild(input);
                 }
                 document.body.appendChild(form);
                 form.submit();",
                vec![
                    json!(app.url("/admin/idem/key/purge")),
                    json!([
                        ["scope", "charges"],
                        ["principal", "acct_1"],
                        ["key", "order-1"],
                        ["csrf", token]
                    ]),
                ],
            )
            .await
            .unwrap();
        let refused = until("the refusal", async || {
            let page = text().await;
            page.contains("403").then_some(page)
        })
        .await;
        assert!(refused.contains("role is read-only"), "{refused}");
        assert!(store
            .operate().key("charges", "acct_1", "order-1", false)
            .await
            .unwrap()
            .is_some());
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

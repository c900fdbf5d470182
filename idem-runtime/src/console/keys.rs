//! The keys' pages (the overview, the list, one key) and their actions (purge, sweep),
//! and the audit trail.

use super::form::{filled, lenient, page_size, parsed, present, Age, Fields};
use super::*;

pub(super) async fn overview(
    State(console): Console_,
    viewer: Viewer,
    Fields(notice): Fields<Notice>,
) -> Response {
    let store = &console.store;
    let within = Duration::from_secs(3_600);
    let (counts, reasons, pending, lag, relays) = match tokio::try_join!(
        store.operate().key_counts(within),
        store.operate().dead_reasons(),
        store.operate().outbox_pending(),
        store.operate().outbox_lag(),
        store.operate().outbox_relays(),
    ) {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    lag::record(&console, lag);
    let samples: Vec<(SystemTime, f64)> = console
        .lag
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .copied()
        .collect();
    let frame = console.live_frame(&viewer, notice.done);
    let chart = lag::chart(&samples, SystemTime::now(), console.lag_every);
    let database = pages::Database {
        counts: &counts,
        reasons: &reasons,
        pending: &pending,
        lag,
        relays: &relays,
    };
    let (outcomes, rates) = (outcomes(), console.relay_rates());
    let process = pages::Process {
        outcomes: &outcomes,
        relays: rates.as_ref(),
        chart,
    };
    html(StatusCode::OK, pages::overview(&frame, &database, &process))
}

/// What this process counted of its requests (feature `metrics`), else nothing.
pub(super) fn outcomes() -> Option<Vec<(String, crate::Outcome, u64)>> {
    #[cfg(feature = "metrics")]
    {
        Some(crate::operate::request_counts())
    }
    #[cfg(not(feature = "metrics"))]
    {
        None
    }
}

/// What the key list reads: `scope`, `principal`, `prefix` (of the key), `older_than`,
/// `expired`, `limit`, and `after` (the cursor of the page it continues).
#[derive(Deserialize)]
pub(super) struct KeyList {
    #[serde(default, deserialize_with = "filled")]
    scope: Option<String>,
    #[serde(default, deserialize_with = "filled")]
    principal: Option<String>,
    #[serde(default, deserialize_with = "filled")]
    prefix: Option<String>,
    #[serde(default)]
    older_than: Age,
    #[serde(default, deserialize_with = "present")]
    expired: bool,
    #[serde(default, deserialize_with = "lenient")]
    limit: Option<u32>,
    #[serde(default, deserialize_with = "parsed")]
    after: Option<KeyCursor>,
    done: Option<String>,
}

/// The key list, filtered, a page at a time.
pub(super) async fn keys(
    State(console): Console_,
    viewer: Viewer,
    Fields(fields): Fields<KeyList>,
) -> Response {
    let after = fields.after;
    let filter = KeyFilter {
        scope: fields.scope,
        principal: fields.principal,
        key_prefix: fields.prefix,
        older_than: fields.older_than.age,
        include_expired: fields.expired,
        limit: page_size(fields.limit, 100),
    };
    let page = match console
        .store
        .operate()
        .keys_page(&filter, after.as_ref())
        .await
    {
        Ok(page) => page,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&viewer, fields.done);
    html(
        StatusCode::OK,
        pages::keys(
            &frame,
            &filter,
            &fields.older_than.written,
            after.is_some(),
            &page,
        ),
    )
}

#[derive(Deserialize)]
pub(super) struct KeyQuery {
    scope: String,
    #[serde(default)]
    principal: String,
    key: String,
    done: Option<String>,
}

pub(super) async fn key(
    State(console): Console_,
    viewer: Viewer,
    Fields(q): Fields<KeyQuery>,
) -> Response {
    let store = &console.store;
    let (found, steps, events) = match tokio::try_join!(
        store
            .operate()
            .key(&q.scope, &q.principal, &q.key, console.show_bodies),
        store
            .operate()
            .key_steps(&q.scope, &q.principal, &q.key, console.show_bodies),
        store.operate().key_events(&q.scope, &q.principal, &q.key),
    ) {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&viewer, q.done);
    let status = if found.is_some() || !steps.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    };
    html(
        status,
        pages::key(
            &frame,
            &pages::KeyShown {
                scope: &q.scope,
                principal: &q.principal,
                key: &q.key,
            },
            found.as_ref(),
            &steps,
            &events,
        ),
    )
}

pub(super) async fn outbox(State(console): Console_, viewer: Viewer) -> Response {
    let store = &console.store;
    let (pending, relays, leases, blocked) = match tokio::try_join!(
        store.operate().outbox_pending(),
        store.operate().outbox_relays(),
        store.operate().outbox_leases(100),
        store.operate().outbox_blocked(100),
    ) {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let frame = console.live_frame(&viewer, None);
    let rates = console.relay_rates();
    let shown = pages::OutboxShown {
        pending: &pending,
        relays: &relays,
        rates: rates.as_ref(),
        leases: &leases,
        blocked: &blocked,
    };
    html(StatusCode::OK, pages::outbox(&frame, &shown))
}

/// What a key's purge carries: the key (`scope`, `principal`, none when empty, and
/// `key`), and the operator's token.
#[derive(Deserialize)]
pub(super) struct Purge {
    scope: Option<String>,
    #[serde(default)]
    principal: String,
    key: Option<String>,
    #[serde(default)]
    csrf: String,
}

/// One key's record purged: a single-item action, whose confirmation is the key's page
/// (it shows the record the button names).
pub(super) async fn purge_key(
    State(console): Console_,
    viewer: Viewer,
    Fields(fields): Fields<Purge>,
) -> Response {
    let operator = match console.acting(&viewer, &fields.csrf) {
        Ok(operator) => operator,
        Err(refused) => return refused.page(),
    };
    let (Some(scope), Some(key)) = (fields.scope.as_deref(), fields.key.as_deref()) else {
        return page_error(StatusCode::BAD_REQUEST, "A purge names a scope and a key.");
    };
    let n = match console
        .audited(&operator)
        .purge_key(scope, &fields.principal, key)
        .await
    {
        Ok(n) => n,
        Err(e) => return failed(e),
    };
    tracing::info!(
        target: "idem::console",
        operator = %operator,
        action = "purge",
        scope,
        records = n,
        "idem console: key purged"
    );
    back(
        &viewer.base,
        "/keys",
        &format!("Purged {n} record(s) of that key in scope {scope}."),
    )
}

/// The sweep's confirmation page: the expired records per scope.
pub(super) async fn sweep_preview(State(console): Console_, viewer: Viewer) -> Response {
    if let Some(refused) = console.read_only(&viewer) {
        return refused;
    }
    let counts = match console.store.operate().key_counts(Duration::ZERO).await {
        Ok(counts) => counts,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&viewer, None);
    html(StatusCode::OK, pages::sweep_preview(&frame, &counts))
}

/// What a sweep's confirmation carries: the count its page showed, and the operator's
/// token.
#[derive(Deserialize)]
pub(super) struct Sweep {
    #[serde(default, deserialize_with = "lenient")]
    expected: Option<u64>,
    #[serde(default)]
    csrf: String,
}

/// A sweep, confirmed on its page (a form without `expected` is answered that page).
pub(super) async fn sweep(
    State(console): Console_,
    viewer: Viewer,
    Fields(fields): Fields<Sweep>,
) -> Response {
    let operator = match console.acting(&viewer, &fields.csrf) {
        Ok(operator) => operator,
        Err(refused) => return refused.page(),
    };
    let Some(expected) = fields.expected else {
        return sweep_preview(State(Arc::clone(&console)), viewer).await;
    };
    let n = match console.audited(&operator).purge_expired(1_000).await {
        Ok(n) => n,
        Err(e) => return failed(e),
    };
    tracing::info!(
        target: "idem::console",
        operator = %operator,
        action = "sweep",
        records = n,
        previewed = expected,
        "idem console: expired records swept"
    );
    let mut notice = format!("Swept {n} expired record(s).");
    if n > expected {
        notice.push_str(&format!(
            " {} of them expired after your preview, which counted {expected}.",
            n - expected
        ));
    }
    back(&viewer.base, "/keys", &notice)
}

#[derive(Deserialize, Default)]
pub(super) struct AuditQuery {
    before: Option<i64>,
}

/// The audit trail, newest first, a page at a time: `before` pages by id.
pub(super) async fn audit(
    State(console): Console_,
    viewer: Viewer,
    Fields(q): Fields<AuditQuery>,
) -> Response {
    let limit = 100;
    let entries = match console.store.operate().audit_log(limit, q.before).await {
        Ok(entries) => entries,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&viewer, None);
    html(
        StatusCode::OK,
        pages::audit(&frame, &entries, limit, q.before.is_some()),
    )
}

//! The abandoned requests' page ([`Store::abandoned`]), with where each one's completion
//! stands ([`crate::complete`]), and its two actions for an admin: "Complete now" sends a
//! stored request to the completer's next look, its failures forgotten (a single-item
//! action: the list shows the row its button names); "Abandon for good" opens a page of
//! its own that names the key and its steps and says what follows (their compensations
//! run, the key answers 410), and only that page's button abandons. Both run through
//! [`Store::audited`], as the console's other actions do.
//!
//! [`Store::abandoned`]: crate::Store::abandoned
//! [`Store::audited`]: crate::Store::audited

use axum::extract::{Form, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;

use super::{
    age_field, back, failed, field, html, page_error, pages, Console_, Fields, Shared, Viewer,
};
use crate::operate::StepRecord;

#[derive(Deserialize, Default)]
pub(super) struct AbandonedQuery {
    idle: Option<String>,
    done: Option<String>,
}

/// The list: requests whose newest step is at least `idle` old (the store's
/// `abandoned_after` by default), oldest first.
pub(super) async fn list(
    State(console): Console_,
    viewer: Viewer,
    Query(q): Query<AbandonedQuery>,
) -> Response {
    let typed = q.idle.as_deref().map(str::trim).filter(|v| !v.is_empty());
    let idle_for = match age_field(typed, "no step for") {
        Ok(age) => age.unwrap_or_else(|| console.store.abandoned_after()),
        Err(how) => return page_error(StatusCode::BAD_REQUEST, &how),
    };
    let limit = 100;
    let listed = match console.store.abandoned(idle_for, limit).await {
        Ok(listed) => listed,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&viewer, q.done);
    html(
        StatusCode::OK,
        pages::abandoned(
            &frame,
            &typed.map_or_else(|| crate::operate::format_age(idle_for), str::to_owned),
            limit,
            &listed,
        ),
    )
}

/// The request an action names, as its form carries it: `scope`, `principal` (none when
/// empty) and `key`, and the list's `idle` to go back to.
struct Named<'a> {
    scope: &'a str,
    principal: &'a str,
    key: &'a str,
    idle: Option<&'a str>,
}

impl<'a> Named<'a> {
    /// The request `fields` name; `None` when they name no scope or no key
    /// ([`unnamed`]).
    fn from_fields(fields: &'a [(String, String)]) -> Option<Self> {
        let given = |name| field(fields, name).filter(|v| !v.is_empty());
        Some(Self {
            scope: given("scope")?,
            principal: field(fields, "principal").unwrap_or(""),
            key: given("key")?,
            idle: given("idle"),
        })
    }

    /// `key "k" in scope "s"`, and `of principal "p"` when it has one.
    fn described(&self) -> String {
        let mut what = format!("key {:?} in scope {:?}", self.key, self.scope);
        if !self.principal.is_empty() {
            what.push_str(&format!(" of principal {:?}", self.principal));
        }
        what
    }

    /// The list this request was acted on from, under the console's base.
    fn list(&self) -> String {
        match self.idle {
            Some(idle) => format!("/abandoned?idle={}", pages::encode(idle)),
            None => "/abandoned".to_owned(),
        }
    }

    fn shown(&self) -> pages::KeyShown<'a> {
        pages::KeyShown {
            scope: self.scope,
            principal: self.principal,
            key: self.key,
        }
    }
}

/// The answer to an action whose form names no request: 400.
fn unnamed() -> Response {
    page_error(
        StatusCode::BAD_REQUEST,
        "An action on an abandoned request names its scope and its key.",
    )
}

/// The live steps of the request `named`: what an abandon compensates. Empty when it has
/// none (it committed, its steps expired, or it never made one).
async fn live_steps(console: &Shared, named: &Named<'_>) -> Result<Vec<StepRecord>, sqlx::Error> {
    let steps = console
        .store
        .key_steps(named.scope, named.principal, named.key, false)
        .await?;
    Ok(steps.into_iter().filter(|s| !s.expired).collect())
}

/// The answer to an action on a request that has no live steps: nothing done, 404.
fn no_steps(named: &Named<'_>, verb: &str) -> Response {
    page_error(
        StatusCode::NOT_FOUND,
        &format!(
            "Nothing was done: {} has no live steps (its request committed, its steps \
             expired, or it never made one), so there is nothing to {verb}.",
            named.described()
        ),
    )
}

/// The confirmation page of an abandon: the request, its live steps, what follows.
pub(super) async fn abandon_preview(
    State(console): Console_,
    viewer: Viewer,
    Query(fields): Query<Fields>,
) -> Response {
    if let Some(refused) = console.read_only(&viewer) {
        return refused;
    }
    match Named::from_fields(&fields) {
        Some(named) => confirmation(&console, &viewer, &named).await,
        None => unnamed(),
    }
}

async fn confirmation(console: &Shared, viewer: &Viewer, named: &Named<'_>) -> Response {
    let steps = match live_steps(console, named).await {
        Ok(steps) => steps,
        Err(e) => return failed(e),
    };
    if steps.is_empty() {
        return no_steps(named, "abandon");
    }
    let frame = console.frame(viewer, None);
    html(
        StatusCode::OK,
        pages::abandon(&frame, &named.shown(), &steps, named.idle),
    )
}

/// An abandon, confirmed on its page (a form without `confirmed` is answered that page):
/// the request is marked for the service's completer, which runs the compensations of its
/// steps and commits a 410 for its key.
pub(super) async fn abandon(
    State(console): Console_,
    viewer: Viewer,
    Form(fields): Form<Fields>,
) -> Response {
    let operator = match console.acting(&viewer, &fields) {
        Ok(operator) => operator,
        Err(refused) => return refused.page(),
    };
    let Some(named) = Named::from_fields(&fields) else {
        return unnamed();
    };
    if field(&fields, "confirmed").is_none() {
        return confirmation(&console, &viewer, &named).await;
    }
    let marked = console
        .audited(&operator)
        .abandon_request(named.scope, named.principal, named.key)
        .await;
    match marked {
        Ok(true) => {}
        Ok(false) => return no_steps(&named, "abandon"),
        Err(e) => return failed(e),
    }
    tracing::info!(
        target: "idem::console",
        operator = %operator,
        action = "abandon",
        scope = named.scope,
        "idem console: request abandoned"
    );
    back(
        &viewer.base,
        &named.list(),
        &format!(
            "Abandoned {}: the service's completer runs the compensations of its steps, then \
             answers 410 to its key from then on.",
            named.described()
        ),
    )
}

/// "Complete now": a stored request (pending, or parked as failed) is sent to the
/// completer's next look, its failures forgotten. A request whose endpoint stored
/// nothing is answered 409 (it can only be abandoned); one without live steps 404.
pub(super) async fn complete(
    State(console): Console_,
    viewer: Viewer,
    Form(fields): Form<Fields>,
) -> Response {
    let operator = match console.acting(&viewer, &fields) {
        Ok(operator) => operator,
        Err(refused) => return refused.page(),
    };
    let Some(named) = Named::from_fields(&fields) else {
        return unnamed();
    };
    let sent = console
        .audited(&operator)
        .complete_request(named.scope, named.principal, named.key)
        .await;
    match sent {
        Ok(true) => {}
        Ok(false) => {
            return match live_steps(&console, &named).await {
                Ok(steps) if steps.is_empty() => no_steps(&named, "complete"),
                Ok(_) => page_error(
                    StatusCode::CONFLICT,
                    &format!(
                        "Nothing was done: {} stored no request to run again (its endpoint is \
                         not completable), so it cannot be completed; it can only be abandoned.",
                        named.described()
                    ),
                ),
                Err(e) => failed(e),
            }
        }
        Err(e) => return failed(e),
    }
    tracing::info!(
        target: "idem::console",
        operator = %operator,
        action = "complete",
        scope = named.scope,
        "idem console: request sent to be completed"
    );
    back(
        &viewer.base,
        &named.list(),
        &format!(
            "Sent {} to be completed: the completer runs it at its next look, its failures \
             forgotten.",
            named.described()
        ),
    )
}

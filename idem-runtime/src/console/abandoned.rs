//! The abandoned requests' page ([`Operate::abandoned_page`](crate::operate::Operate::abandoned_page)), filtered by scope,
//! principal, key prefix, completion stage and idle time and read a page at a time by
//! keyset, with where each one's completion stands ([`crate::complete`]), and its two
//! actions for an admin, each of which comes back to the page it was taken from:
//! "Complete now" sends a stored request to the completer's next look, its failures
//! forgotten (a single-item action: the list shows the row its button names); "Abandon
//! for good" opens a page of its own that names the key and its steps and says what
//! follows (their compensations run, the key answers 410), and only that page's button
//! abandons. Both run through [`Operate::audited`](crate::operate::Operate::audited), as the console's other actions do.
//!
//! [`Operate::abandoned_page`](crate::operate::Operate::abandoned_page): crate::operate::Operate::abandoned_page
//! [`Operate::audited`](crate::operate::Operate::audited): crate::operate::Operate::audited

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::Deserialize;

use super::form::{filled, lenient, page_size, parsed, present, Age, Fields};
use super::{back, failed, html, page_error, pages, Console_, Shared, Viewer};
use crate::operate::{format_age, AbandonedCursor, AbandonedFilter, CompletionStage, StepRecord};

/// What the list reads: `scope`, `principal`, `prefix` (of the key), `completion` (a
/// [`CompletionStage`]), `idle` (the least time since the newest step; empty, the
/// store's `abandoned_after`), `limit`, and `after` (the cursor of the page it
/// continues).
#[derive(Deserialize)]
pub(super) struct Listed {
    #[serde(default, deserialize_with = "filled")]
    scope: Option<String>,
    #[serde(default, deserialize_with = "filled")]
    principal: Option<String>,
    #[serde(default, deserialize_with = "filled")]
    prefix: Option<String>,
    #[serde(default, deserialize_with = "parsed")]
    completion: Option<CompletionStage>,
    #[serde(default)]
    idle: Age,
    #[serde(default, deserialize_with = "lenient")]
    limit: Option<u32>,
    #[serde(default, deserialize_with = "parsed")]
    after: Option<AbandonedCursor>,
    done: Option<String>,
}

/// The list, filtered, a page at a time, oldest first step first.
pub(super) async fn list(
    State(console): Console_,
    viewer: Viewer,
    Fields(fields): Fields<Listed>,
) -> Response {
    let after = fields.after;
    let filter = AbandonedFilter {
        scope: fields.scope,
        principal: fields.principal,
        key_prefix: fields.prefix,
        completion: fields.completion,
        idle_for: fields.idle.age,
    };
    let limit = page_size(fields.limit, 100);
    let page = match console
        .store
        .operate()
        .abandoned_page(&filter, after.as_ref(), limit)
        .await
    {
        Ok(page) => page,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&viewer, fields.done);
    let listed = pages::AbandonedListed {
        filter: &filter,
        idle: fields.idle.written.trim(),
        default_idle: format_age(console.store.operate().abandoned_after()),
        limit,
        after: after.as_ref(),
    };
    html(StatusCode::OK, pages::abandoned(&frame, &listed, &page))
}

/// Whether `query` is one the list made for an action's form to come back to (`list`):
/// its names and values percent-encoded, nothing that leads anywhere but the list.
fn list_query(query: &str) -> bool {
    query
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.~=&%".contains(&b))
}

/// What an action on one request carries: the request (`scope`, `principal`, none when
/// empty, and `key`), the query of the list's page to go back to (`list`), the operator's
/// token, and, for an abandon, whether its page was seen (`confirmed`).
#[derive(Deserialize)]
pub(super) struct Action {
    scope: Option<String>,
    #[serde(default)]
    principal: String,
    key: Option<String>,
    list: Option<String>,
    #[serde(default)]
    csrf: String,
    #[serde(default, deserialize_with = "present")]
    confirmed: bool,
}

/// The request an action names.
struct Named<'a> {
    scope: &'a str,
    principal: &'a str,
    key: &'a str,
    list: Option<&'a str>,
}

impl<'a> Named<'a> {
    /// The request `action` names; `None` when it names no scope or no key
    /// ([`unnamed`]).
    fn from_action(action: &'a Action) -> Option<Self> {
        Some(Self {
            scope: action.scope.as_deref()?,
            principal: &action.principal,
            key: action.key.as_deref()?,
            list: action.list.as_deref().filter(|q| list_query(q)),
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

    /// The list's page this request was acted on from, under the console's base.
    fn list(&self) -> String {
        match self.list {
            Some(query) => format!("/abandoned?{query}"),
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
        .operate()
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
    Fields(action): Fields<Action>,
) -> Response {
    if let Some(refused) = console.read_only(&viewer) {
        return refused;
    }
    match Named::from_action(&action) {
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
        pages::abandon(&frame, &named.shown(), &steps, named.list),
    )
}

/// An abandon, confirmed on its page (a form without `confirmed` is answered that page):
/// the request is marked for the service's completer, which runs the compensations of its
/// steps and commits a 410 for its key.
pub(super) async fn abandon(
    State(console): Console_,
    viewer: Viewer,
    Fields(action): Fields<Action>,
) -> Response {
    let operator = match console.acting(&viewer, &action.csrf) {
        Ok(operator) => operator,
        Err(refused) => return refused.page(),
    };
    let Some(named) = Named::from_action(&action) else {
        return unnamed();
    };
    if !action.confirmed {
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
            "Abandoned {}: the service's completer undoes its steps that have an undo \
             registered, then answers 410 to its key from then on, naming any step it did not \
             undo.",
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
    Fields(action): Fields<Action>,
) -> Response {
    let operator = match console.acting(&viewer, &action.csrf) {
        Ok(operator) => operator,
        Err(refused) => return refused.page(),
    };
    let Some(named) = Named::from_action(&action) else {
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
                         not completable), or is being abandoned, which is for good: it cannot \
                         be completed.",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_action_comes_back_only_to_a_query_the_list_made() {
        let cursor = "1795860530123456.63686172676573.616363745f31.6b2d31";
        let made = format!(
            "scope=charges&completion=not-completable&idle=10m&limit=1&after={}",
            pages::encode(cursor)
        );
        assert!(list_query(&made), "{made}");
        for wrong in [
            "/evil.example",
            "idle=0s#top",
            "a=b?c",
            "a b",
            "a=\r\nLocation: x",
        ] {
            assert!(!list_query(wrong), "{wrong:?}");
        }
    }
}

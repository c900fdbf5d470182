//! The console's mount: idem's console behind the example's two admin tokens.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use idem::console::{Console, Role};
use idem::Store;

use crate::{events, Config};

/// The header the admin layer names the operator in, for idem's console's action log.
pub const OPERATOR_HEADER: &str = "x-operator";

/// The console's two tokens: `ADMIN_TOKEN` acts, `ADMIN_READONLY_TOKEN` only looks.
pub(crate) struct Operators {
    pub(crate) admin: Option<String>,
    pub(crate) readonly: Option<String>,
}

/// idem's console, actions on (for the admin), behind [`admin_auth`] with `operators`:
/// with the relay's figures and the ledger's dead letters when `config` has them.
pub(crate) fn admin(store: Store, operators: Operators, config: &Config) -> Router {
    let mut console = Console::new(store)
        .actions(true)
        .operator_header(HeaderName::from_static(OPERATOR_HEADER));
    if let Some(relay) = &config.relay {
        let relay = Arc::clone(relay);
        console = console.relay_stats(move || relay.stats());
    }
    if let (Some(jetstream), Some(prefix)) = (&config.jetstream, &config.events) {
        let (stream, _) = events::dead_letters(prefix);
        console = console.jetstream_dead_letters(jetstream.clone(), stream);
    }
    console.router().layer(middleware::from_fn_with_state(
        Arc::new(operators),
        admin_auth,
    ))
}

/// `Authorization: Bearer <ADMIN_TOKEN>` (the operator `admin`, [`Role::Admin`]) or
/// `Bearer <ADMIN_READONLY_TOKEN>` (the operator `readonly`, [`Role::ReadOnly`]), or 401:
/// the console has no authentication of its own. A service with several operators names
/// each from its own identity provider here, and decides their role; whatever a client
/// sent as the operator header is replaced, and the role is an extension, which no client
/// can send.
///
/// [`Role::Admin`]: idem::console::Role::Admin
/// [`Role::ReadOnly`]: idem::console::Role::ReadOnly
async fn admin_auth(
    State(operators): State<Arc<Operators>>,
    mut request: Request,
    next: Next,
) -> Response {
    let sent = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    let holds = |token: &Option<String>| {
        token
            .as_deref()
            .is_some_and(|token| same(sent.as_bytes(), token.as_bytes()))
    };
    // Both compared, in constant time each: how long a refusal takes tells nothing.
    let (admin, readonly) = (holds(&operators.admin), holds(&operators.readonly));
    let (operator, role) = match (admin, readonly) {
        (true, _) => ("admin", Role::Admin),
        (false, true) => ("readonly", Role::ReadOnly),
        (false, false) => {
            let mut response = (
                StatusCode::UNAUTHORIZED,
                "send `Authorization: Bearer <ADMIN_TOKEN>` (or `<ADMIN_READONLY_TOKEN>`)\n",
            )
                .into_response();
            response.headers_mut().insert(
                WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"idem console\""),
            );
            return response;
        }
    };
    request
        .headers_mut()
        .insert(OPERATOR_HEADER, HeaderValue::from_static(operator));
    request.extensions_mut().insert(role);
    next.run(request).await
}

/// Whether `a` and `b` are equal, in a time that does not depend on where they differ.
pub(crate) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

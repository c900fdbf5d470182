//! Completion: requests whose clients went away after a step, finished by the service.
//!
//! A step ([`Tx::step`](crate::Tx::step)) makes an outside call once per request, as long
//! as the client retries. A client that never retries (it crashed too, it gave up) leaves
//! the call made (the processor took the money) and the service with no record of it.
//! An endpoint marked `completable` keeps what it takes to run such a request again:
//!
//! ```ignore
//! #[idempotent(scope = "charges", ttl = "24h", fields = [amount, currency, customer], completable = true)]
//! async fn create_charge(/* .. */) -> Result<Response, ApiError> { /* .. */ }
//! ```
//!
//! - **What is stored.** With the request's first step record, in the same message (so
//!   a request whose transaction was lost stores nothing): its method, path and query,
//!   the headers of [`StoreBuilder::stored_headers`](crate::StoreBuilder::stored_headers)
//!   (`Content-Type` by default) and the one its key came from, its body (up to
//!   [`StoreBuilder::max_response_bytes`](crate::StoreBuilder::max_response_bytes): a
//!   larger one is answered 413 before anything runs), and its principal as it was
//!   resolved. Never `Authorization`, `Proxy-Authorization` or `Cookie`. The row goes with
//!   the request's COMMIT, as its steps do, or expires with its key.
//! - **Who completes it.** A [`Completer`], spawned by the service beside its server with
//!   the application's own router. A request whose first step is older than its window
//!   ([`Completer::after`]) and that has not committed runs again, in process, through
//!   that router: the request as stored, with a [`Completion`] in its extensions, which
//!   no client can send. The service's authentication layer lets it through under
//!   [`Completion::principal`] (it carries no credential), and idem claims its key under
//!   that principal alone. Its steps replay (the processor is not called again); its
//!   answer is stored as if the client had sent it, and the client's late retry replays
//!   it.
//! - **One run at a time.** Each request is leased to one completer (a row lock of one
//!   statement, in every mode: on a distributed engine, on its own shard), and its run
//!   claims its key as any request does: a client retrying meanwhile gets 409, or the
//!   replay once it has committed, and two completers never both run it.
//! - **Failures.** A run answered 409, 429, 502, 503 or 504 is transient: tried again
//!   after a backoff doubling up to [`Completer::backoff`]'s cap, never counted. Any other
//!   answer that did not commit (the handler's `Err`, a panic, a 422) counts; at
//!   [`Completer::max_attempts`] the request is parked as `failed`, with its last error, for an
//!   operator ([`Operate::abandoned`](crate::operate::Operate::abandoned) lists it), or abandoned at
//!   once where the completer is told to ([`Completer::abandon_parked`]).
//! - **Compensation.** [`Completer::compensate`] names a step's undo (a refund for a
//!   charge). When an operator abandons a request for good
//!   ([`Audited::abandon_request`](crate::operate::Audited::abandon_request), `idem key
//!   abandon`, the console), or its completer abandons what it parks, the completer
//!   claims its key, runs the undo of each of its
//!   recorded steps as a step of its own (`compensate:<step>`: once, however often it is
//!   retried), and commits a 410 for the key
//!   ([`problem_type::REQUEST_ABANDONED`](crate::problem::problem_type::REQUEST_ABANDONED)), which
//!   every later retry replays. An undo that fails is retried with the backoff.
//!
//! Each run is a span (`idem.complete`, with the scope, the key and what was done) and a
//! log line naming the key.

mod capture;
mod completer;

use http::header;
use http::HeaderName;

pub(crate) use capture::CaptureBody;
#[doc(hidden)]
pub use capture::Completable;
pub use completer::{Completed, Completer, CompleterTask, Undo};

/// A completion's mark on the request it runs again: in the request's extensions, put
/// there by a [`Completer`], so that the service's authentication layer lets it through
/// under the principal its client had. It has no public constructor: no client (and no
/// other code) can make one, unlike a header.
///
/// ```
/// use axum::extract::Request;
/// use axum::middleware::Next;
/// use axum::response::Response;
///
/// #[derive(Clone)]
/// struct Account(String);
///
/// async fn authenticate(mut req: Request, next: Next) -> Response {
///     if let Some(completion) = req.extensions().get::<idem::complete::Completion>() {
///         // The service completing a request its client abandoned: under the
///         // principal the client had, without a credential.
///         let account = completion.principal().unwrap_or_default().to_owned();
///         req.extensions_mut().insert(Account(account));
///         return next.run(req).await;
///     }
///     // .. the bearer token, as for any request
///     # next.run(req).await
/// }
/// ```
#[derive(Debug, Clone)]
pub struct Completion {
    /// The scope as stored (with a spread key's mark).
    stored_scope: String,
    /// The scope as the endpoint names it.
    scope: String,
    /// The principal column's value.
    stored_principal: String,
    /// The principal as it was resolved; `None` for a key without one.
    principal: Option<String>,
    key: String,
}

impl Completion {
    /// The principal the request's client had, as idem resolved it then; `None` for a
    /// key kept without a principal.
    pub fn principal(&self) -> Option<&str> {
        self.principal.as_deref()
    }

    /// The request's idempotency key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The endpoint's scope.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// Whether `key` (claimed by the request this completion runs) is the stored one: a
    /// router that sent the request elsewhere is refused.
    pub(crate) fn is_for(&self, key: &crate::identity::KeyInScope) -> bool {
        key.stored_scope() == self.stored_scope
            && key.principal == self.stored_principal
            && key.key.as_str() == self.key
    }
}

/// Headers that carry a credential: never stored with a request.
pub(crate) fn is_credential(name: &HeaderName) -> bool {
    name == header::AUTHORIZATION || name == header::PROXY_AUTHORIZATION || name == header::COOKIE
}

/// Query parameters that carry a credential, by name (ASCII case aside): left out of a
/// stored request's target, as the credential headers are ([`is_credential`]). OAuth's
/// bearer in a query (RFC 6750 §2.3), API keys, passwords, and the signatures of
/// pre-signed URLs.
const CREDENTIAL_PARAMETERS: &[&str] = &[
    "access_token",
    "refresh_token",
    "id_token",
    "token",
    "api_key",
    "apikey",
    "password",
    "passwd",
    "secret",
    "client_secret",
    "auth",
    "authorization",
    "signature",
    "sig",
    "x-amz-signature",
    "x-amz-credential",
    "x-amz-security-token",
];

/// `target` (a path and its query) without the query parameters that carry a credential
/// ([`CREDENTIAL_PARAMETERS`]), the others kept as sent, in their order.
pub(crate) fn without_credentials(target: &str) -> String {
    let Some((path, query)) = target.split_once('?') else {
        return target.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let name = pair.split_once('=').map_or(*pair, |(name, _)| name);
            !CREDENTIAL_PARAMETERS
                .iter()
                .any(|credential| name.eq_ignore_ascii_case(credential))
        })
        .collect();
    if kept.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", kept.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::without_credentials;

    /// Issue 48: the stored target kept its whole query string, `?access_token=…`
    /// included, though `Authorization` was never stored.
    #[test]
    fn a_stored_target_keeps_no_credential_of_its_query() {
        for (sent, stored) in [
            ("/charges", "/charges"),
            ("/charges?currency=eur", "/charges?currency=eur"),
            ("/charges?access_token=s3cr3t", "/charges"),
            (
                "/charges?currency=eur&Access_Token=s3cr3t&x=1&api_key=k&sig=z",
                "/charges?currency=eur&x=1",
            ),
            ("/charges?token", "/charges"),
            ("/charges?tokens=2&page=1", "/charges?tokens=2&page=1"),
        ] {
            assert_eq!(without_credentials(sent), stored, "{sent}");
        }
    }
}

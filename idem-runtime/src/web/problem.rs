//! RFC 9457 problem details: every error idem answers is `application/problem+json`.

use std::borrow::Cow;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, StatusCode};
use serde::Serialize;

use crate::engine::{CommitError, Refusal};
use crate::key::{KeyError, KeyOrigin};
use crate::store::Store;
use crate::web::response::CaptureError;

/// The media type of problem bodies.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The base of the `type` URIs of idem's own problems, unless the store sets another
/// ([`StoreBuilder::problem_base`](crate::StoreBuilder::problem_base)): a problem's
/// `type` is the base followed by one of the [`problem_type`]s.
pub const DEFAULT_PROBLEM_BASE: &str = "urn:idem:problem:";

/// The stable last parts of the `type` URIs of the problems idem itself answers.
///
/// Clients should branch on `type`, not on `title` or `detail`, which are prose.
pub mod problem_type {
    /// 400: the endpoint requires a key (the `Idempotency-Key` header, or its own
    /// source: another header, a body field) and none was sent; the detail names it.
    pub const MISSING_KEY: &str = "missing-key";
    /// 400: the key (the `Idempotency-Key` header, or the endpoint's own source) is
    /// malformed or repeated; the detail names the source.
    pub const MALFORMED_KEY: &str = "malformed-key";
    /// 401: the store requires a principal (`StoreBuilder::require_principal`) and the
    /// request has none: authentication did not run, or found nobody.
    pub const MISSING_PRINCIPAL: &str = "missing-principal";
    /// 400: the request's principal is not a value of the store's principal column type
    /// (`StoreBuilder::principal_type`: a UUID, or a decimal integer).
    pub const INVALID_PRINCIPAL: &str = "invalid-principal";
    /// 409: a request with this key is still running; retry after `Retry-After`.
    pub const KEY_IN_USE: &str = "key-in-use";
    /// 422: this key was used for a request with a different payload or target.
    pub const KEY_REUSED: &str = "key-reused";
    /// 503: the database cannot be reached; nothing ran; retry after `Retry-After`.
    pub const UNAVAILABLE: &str = "unavailable";
    /// 503: the transaction could not be serialized with a concurrent one (SQLSTATE
    /// 40001 or 40P01 at commit); nothing was committed; retry after `Retry-After`.
    pub const SERIALIZATION_FAILURE: &str = "serialization-failure";
    /// 500: the handler's transaction was ended by the handler itself; nothing stored.
    pub const TRANSACTION_ESCAPED: &str = "transaction-escaped";
    /// 500: a statement of the handler failed and the handler answered a success all the
    /// same; PostgreSQL rolled its transaction back, so nothing was stored.
    pub const TRANSACTION_ABORTED: &str = "transaction-aborted";
    /// 500: the response exceeds the stored-response size cap; nothing committed.
    pub const RESPONSE_TOO_LARGE: &str = "response-too-large";
    /// 500: an unexpected failure inside idem; nothing committed.
    pub const INTERNAL: &str = "internal";
    /// 4xx: a request extractor (JSON body, path, query ...) refused the request.
    pub const INVALID_REQUEST: &str = "invalid-request";
    /// 504: a step's call (`Tx::step`) took longer than the store's step timeout; nothing
    /// was committed; a retry calls again with the same key.
    pub const STEP_TIMEOUT: &str = "step-timeout";
    /// 503: a step's call ran but its result could not be recorded (the request lost its
    /// transaction while the call ran); nothing was committed; retry after `Retry-After`.
    pub const STEP_UNRECORDED: &str = "step-unrecorded";
    /// 413: a completable endpoint's request body is larger than the store's cap on
    /// stored bodies (`StoreBuilder::max_response_bytes`): it could not be stored to be
    /// completed; nothing ran.
    pub const REQUEST_TOO_LARGE: &str = "request-too-large";
    /// 410: the request with this key was abandoned for good after its steps ran (by an
    /// operator, or by a completer that abandons what it parks); the undo registered for
    /// each step (a refund) ran, and the detail names any step that had none, whose work
    /// elsewhere stands. Nothing was committed, and the key answers this for as long as
    /// it is kept. Do not retry it; send a new request with a new key.
    pub const REQUEST_ABANDONED: &str = "request-abandoned";
    /// 409: the request with this key is being abandoned: the service is undoing what it
    /// did elsewhere, and then answers `request-abandoned` (410). Retry after
    /// `Retry-After` to read that answer; nothing will run.
    pub const REQUEST_ABANDONING: &str = "request-abandoning";
}

/// An RFC 9457 problem: a status, a stable `type`, a `title` and a `detail`.
///
/// ```
/// use idem::Problem;
/// use http::StatusCode;
///
/// let problem = Problem::new(StatusCode::BAD_REQUEST, "https://example.com/problems/bad-amount", "Invalid amount")
///     .with_detail("amount must be a positive integer");
/// assert_eq!(problem.status(), StatusCode::BAD_REQUEST);
/// ```
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    kind: Cow<'static, str>,
    title: Cow<'static, str>,
    #[serde(serialize_with = "serialize_status")]
    status: StatusCode,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    /// An extractor's own JSON rejection, kept as JSON (an RFC 9457 extension member).
    #[serde(skip_serializing_if = "Option::is_none")]
    errors: Option<serde_json::Value>,
    #[serde(skip)]
    retry_after: Option<Duration>,
}

fn serialize_status<S: serde::Serializer>(status: &StatusCode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u16(status.as_u16())
}

impl Problem {
    /// A problem with its status, `type` URI and short, stable `title`.
    pub fn new(
        status: StatusCode,
        kind: impl Into<Cow<'static, str>>,
        title: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            kind: kind.into(),
            title: title.into(),
            status,
            detail: None,
            errors: None,
            retry_after: None,
        }
    }

    /// Adds the human-readable explanation of this occurrence.
    #[must_use]
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds a `Retry-After` header: `after` in whole seconds, rounded up.
    #[must_use]
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The `type` URI.
    pub fn kind(&self) -> &str {
        &self.kind
    }

    /// The detail, when one was given.
    pub fn detail(&self) -> Option<&str> {
        self.detail.as_deref()
    }
}

/// Builds idem's own problems with the store's `type` base and `Retry-After`: how every
/// refusal of an idempotent endpoint looks to its client is decided here.
#[derive(Clone, Copy)]
pub(crate) struct Problems<'a> {
    pub(crate) base: &'a str,
    pub(crate) retry_after: Duration,
}

impl<'a> Problems<'a> {
    /// The problems of a store's endpoints.
    pub(crate) fn of(store: &'a Store) -> Self {
        Self {
            base: store
                .inner
                .problem_base
                .as_deref()
                .unwrap_or(DEFAULT_PROBLEM_BASE),
            retry_after: store.inner.retry_after,
        }
    }

    /// An engine's refusal, as its client sees it.
    pub(crate) fn refusal(self, refusal: &Refusal) -> Problem {
        match refusal {
            Refusal::InUse => self.key_in_use(),
            Refusal::Mismatch => self.key_reused(),
            Refusal::Abandoning => self.request_abandoning(),
            Refusal::Unavailable(_) => self.unavailable(),
            Refusal::Database(_) => {
                self.internal("a database error occurred; nothing was committed")
            }
            Refusal::Unreadable => self.internal("the stored response is unreadable"),
        }
    }

    /// A commit that failed, as the client sees it.
    pub(crate) fn commit_error(self, error: &CommitError) -> Problem {
        match error {
            CommitError::Escaped => self
                .problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    problem_type::TRANSACTION_ESCAPED,
                    "Transaction ended by the handler",
                )
                .with_detail(
                    "the handler committed or rolled back idem's transaction itself; nothing was stored",
                ),
            CommitError::Aborted(_) => self
                .problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    problem_type::TRANSACTION_ABORTED,
                    "Success answered after a failed statement",
                )
                .with_detail(
                    "one of the handler's statements failed, so PostgreSQL rolled back everything it wrote, yet it answered a success; nothing was stored; answer the failure as `Err`, or as a final 4xx",
                ),
            CommitError::Unavailable(_) => self.unavailable(),
            CommitError::Serialization(_) => self
                .problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    problem_type::SERIALIZATION_FAILURE,
                    "Concurrent update",
                )
                .with_detail(
                    "the transaction conflicted with a concurrent one and was rolled back; nothing was done; retry",
                )
                .with_retry_after(self.retry_after),
            CommitError::Database(_) => {
                self.internal("a database error occurred; nothing was committed")
            }
            CommitError::Refused(refusal) => self.refusal(refusal),
        }
    }

    /// A response that cannot be stored for replay.
    pub(crate) fn capture_error(self, error: &CaptureError) -> Problem {
        match error {
            CaptureError::TooLarge { limit } => self
                .problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    problem_type::RESPONSE_TOO_LARGE,
                    "Response too large to store",
                )
                .with_detail(format!(
                    "the response body exceeds the {limit}-byte cap for stored responses; nothing was committed"
                )),
            CaptureError::Body(_) => {
                self.internal("the response body could not be read; nothing was committed")
            }
        }
    }

    /// A keyed request for which neither the handler nor the store's resolver named a
    /// principal, on a store that requires one.
    pub(crate) fn missing_principal(self) -> Problem {
        self.problem(
            StatusCode::UNAUTHORIZED,
            problem_type::MISSING_PRINCIPAL,
            "Principal required",
        )
        .with_detail(
            "this service keys idempotent requests per principal, and none was found for this request: authenticate first",
        )
    }

    /// A principal the store's principal column cannot hold.
    pub(crate) fn invalid_principal(self, expected: &str) -> Problem {
        self.problem(
            StatusCode::BAD_REQUEST,
            problem_type::INVALID_PRINCIPAL,
            "Invalid principal",
        )
        .with_detail(format!(
            "this service keys idempotent requests per principal, a {expected} other than its zero value (which keeps keys without a principal), and this request's principal is not one"
        ))
    }

    /// A key that is missing where required, or malformed; the detail names where it
    /// was read from.
    pub(crate) fn key_error(self, error: &KeyError, origin: &KeyOrigin) -> Problem {
        let detail = error.describe(origin);
        match error {
            KeyError::Missing => self.missing_key(detail),
            _ => self.malformed_key(detail),
        }
    }

    pub(crate) fn problem(
        self,
        status: StatusCode,
        slug: &str,
        title: impl Into<Cow<'static, str>>,
    ) -> Problem {
        Problem::new(status, format!("{}{slug}", self.base), title)
    }

    pub(crate) fn missing_key(self, detail: String) -> Problem {
        self.problem(
            StatusCode::BAD_REQUEST,
            problem_type::MISSING_KEY,
            "Idempotency-Key required",
        )
        .with_detail(detail)
    }

    pub(crate) fn malformed_key(self, detail: String) -> Problem {
        self.problem(
            StatusCode::BAD_REQUEST,
            problem_type::MALFORMED_KEY,
            "Malformed Idempotency-Key",
        )
        .with_detail(detail)
    }

    pub(crate) fn key_in_use(self) -> Problem {
        self.problem(
            StatusCode::CONFLICT,
            problem_type::KEY_IN_USE,
            "Request in progress",
        )
        .with_detail("a request with this Idempotency-Key is still being processed; retry later")
        .with_retry_after(self.retry_after)
    }

    pub(crate) fn key_reused(self) -> Problem {
        self.problem(StatusCode::UNPROCESSABLE_ENTITY, problem_type::KEY_REUSED, "Idempotency-Key reused")
            .with_detail("this Idempotency-Key was already used for a request with a different payload or target")
    }

    pub(crate) fn unavailable(self) -> Problem {
        self.problem(
            StatusCode::SERVICE_UNAVAILABLE,
            problem_type::UNAVAILABLE,
            "Service unavailable",
        )
        .with_detail("the database could not be reached; nothing was done; retry later")
        .with_retry_after(self.retry_after)
    }

    pub(crate) fn request_too_large(self, limit: usize) -> Problem {
        self.problem(
            StatusCode::PAYLOAD_TOO_LARGE,
            problem_type::REQUEST_TOO_LARGE,
            "Request too large",
        )
        .with_detail(format!(
            "this endpoint stores its requests to complete them, up to {limit} bytes of body; nothing was done"
        ))
    }

    /// The 410 of an abandoned request, naming the steps whose work elsewhere was undone
    /// and those it was not (no undo was registered for them): the answer never claims
    /// an undo that did not run.
    pub(crate) fn request_abandoned(self, undone: &[String], not_undone: &[String]) -> Problem {
        let list = |steps: &[String]| {
            steps
                .iter()
                .map(|s| format!("{s:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut detail = String::from(
            "the request with this Idempotency-Key was abandoned for good and will not complete",
        );
        if !undone.is_empty() {
            detail.push_str(&format!("; undone elsewhere: {}", list(undone)));
        }
        if !not_undone.is_empty() {
            detail.push_str(&format!(
                "; NOT undone (no undo registered): {}",
                list(not_undone)
            ));
        }
        detail.push_str("; send a new request with a new key");
        self.problem(
            StatusCode::GONE,
            problem_type::REQUEST_ABANDONED,
            "Request abandoned",
        )
        .with_detail(detail)
    }

    pub(crate) fn request_abandoning(self) -> Problem {
        self.problem(
            StatusCode::CONFLICT,
            problem_type::REQUEST_ABANDONING,
            "Request being abandoned",
        )
        .with_detail(
            "the request with this Idempotency-Key is being abandoned: what it did elsewhere is being undone, and it will not run; retry later to read the final answer",
        )
        .with_retry_after(self.retry_after)
    }

    pub(crate) fn internal(self, detail: impl Into<String>) -> Problem {
        self.problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            problem_type::INTERNAL,
            "Internal error",
        )
        .with_detail(detail)
    }

    /// A request refused before anything ran (`invalid-request`), titled by `status`.
    pub(crate) fn invalid_request(self, status: StatusCode) -> Problem {
        let title = status.canonical_reason().unwrap_or("Invalid request");
        self.problem(status, problem_type::INVALID_REQUEST, title)
    }

    /// Rewrites an extractor's rejection (axum answers those in plain text) as a
    /// problem, keeping its status and its text as the detail. Rejections that already
    /// are problems pass through untouched.
    ///
    /// One status changes: on an idempotent endpoint 422 means "this key was used for
    /// another payload" (the IETF draft), so an extractor's 422 (axum's `Json` answers a
    /// body of the wrong shape so) becomes 400. Clients still tell idem's problems from
    /// a handler's own by `type`, which starts with the store's problem base.
    pub(crate) async fn rejection(self, rejection: Response) -> Response {
        let is_problem = rejection
            .headers()
            .get(CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(PROBLEM_JSON.as_bytes()));
        if is_problem {
            return rejection;
        }
        let (parts, body) = rejection.into_parts();
        let text = axum::body::to_bytes(body, 64 * 1024)
            .await
            .unwrap_or_default();
        let status = match parts.status {
            StatusCode::UNPROCESSABLE_ENTITY => StatusCode::BAD_REQUEST,
            other => other,
        };
        let mut problem = self.invalid_request(status);
        let is_json = parts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json") || v.contains("+json"));
        match serde_json::from_slice::<serde_json::Value>(&text) {
            // A JSON rejection stays JSON, under `errors`, instead of a string of JSON in
            // `detail`.
            Ok(errors) if is_json => {
                problem = problem.with_detail("the request was rejected; see `errors`");
                problem.errors = Some(errors);
            }
            _ if !text.is_empty() => {
                problem = problem.with_detail(String::from_utf8_lossy(&text).into_owned());
            }
            _ => {}
        }
        let mut response = problem.into_response();
        // Keep what the extractor said beyond its body (`Allow`, `WWW-Authenticate` ...).
        for (name, value) in &parts.headers {
            if name != CONTENT_TYPE && name != http::header::CONTENT_LENGTH {
                response.headers_mut().append(name, value.clone());
            }
        }
        response
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        // Serializing a struct of strings and an integer cannot fail; the fallback keeps
        // this path free of panics all the same.
        let body = serde_json::to_vec(&self).unwrap_or_else(|_| b"{}".to_vec());
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = self.retry_after {
            let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROBLEMS: Problems<'static> = Problems {
        base: DEFAULT_PROBLEM_BASE,
        retry_after: Duration::from_secs(1),
    };

    #[tokio::test]
    async fn problem_body_and_headers() {
        let response = PROBLEMS.key_in_use().into_response();
        assert_eq!(response.status(), StatusCode::CONFLICT);
        assert_eq!(response.headers()[CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(response.headers()[RETRY_AFTER], "1");
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["type"], "urn:idem:problem:key-in-use");
        assert_eq!(json["status"], 409);
        assert_eq!(json["title"], "Request in progress");
        assert!(json["detail"]
            .as_str()
            .unwrap()
            .contains("still being processed"));
    }

    #[tokio::test]
    async fn rejections_become_problems() {
        let rejection = (
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Expected request with `Content-Type: application/json`",
        )
            .into_response();
        let response = PROBLEMS.rejection(rejection).await;
        assert_eq!(response.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(response.headers()[CONTENT_TYPE], PROBLEM_JSON);
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["type"], "urn:idem:problem:invalid-request");
        assert_eq!(json["status"], 415);
        assert!(json["detail"].as_str().unwrap().contains("Content-Type"));

        let wrong_shape = (StatusCode::UNPROCESSABLE_ENTITY, "invalid type").into_response();
        assert_eq!(
            PROBLEMS.rejection(wrong_shape).await.status(),
            StatusCode::BAD_REQUEST
        );

        // Regression: a custom extractor's JSON rejection was double-encoded into
        // `detail`.
        let json_rejection = (
            StatusCode::BAD_REQUEST,
            axum::Json(serde_json::json!({ "field": "amount", "error": "negative" })),
        )
            .into_response();
        let response = PROBLEMS.rejection(json_rejection).await;
        assert_eq!(response.headers()[CONTENT_TYPE], PROBLEM_JSON);
        let body = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["errors"]["field"], "amount");
        assert!(!json["detail"].as_str().unwrap().contains('{'));

        let already = PROBLEMS.key_reused().into_response();
        let passed = PROBLEMS.rejection(already).await;
        assert_eq!(passed.status(), StatusCode::UNPROCESSABLE_ENTITY);
    }
}

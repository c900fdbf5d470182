//! A response as the engine stores it ([`Record`]): captured from the handler's answer,
//! and replayed on retries.

use axum::body::Body;
use axum::response::Response;
use http::header::HeaderName;
use http::response::Parts;
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::table::Record;

/// The header that marks a replayed response: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The header that marks a response of an endpoint with `required = false` that came
/// without a key: `Idempotent-Recorded: false`, nothing was stored for replay.
pub const IDEMPOTENT_RECORDED: HeaderName = HeaderName::from_static("idempotent-recorded");

/// Why a response could not be stored.
#[derive(Debug)]
pub(crate) enum CaptureError {
    TooLarge { limit: usize },
    Body(axum::BoxError),
}

impl std::fmt::Display for CaptureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TooLarge { limit } => {
                write!(
                    f,
                    "the response body is over the {limit}-byte stored-response cap"
                )
            }
            Self::Body(e) => write!(f, "the response body failed: {e}"),
        }
    }
}

/// Reads the whole body (up to `limit` bytes) and keeps the allow-listed headers.
/// Returns the stored form and the parts of the original response, which the first
/// caller receives in full.
pub(crate) async fn capture(
    response: Response,
    allow: &[HeaderName],
    limit: usize,
) -> Result<(Record, Parts), CaptureError> {
    let (parts, body) = response.into_parts();
    let body = Limited::new(body, limit)
        .collect()
        .await
        .map_err(|e| {
            if e.downcast_ref::<LengthLimitError>().is_some() {
                CaptureError::TooLarge { limit }
            } else {
                CaptureError::Body(e)
            }
        })?
        .to_bytes();
    let headers = encode_headers(&parts.headers, allow);
    Ok((
        Record {
            status: parts.status.as_u16(),
            headers,
            body,
        },
        parts,
    ))
}

/// The replay: stored status, headers and body, plus `Idempotent-Replayed: true`.
pub(crate) fn replay(record: Record) -> Response {
    let mut response = Response::new(Body::from(record.body));
    // The engine hands over only statuses in 100..=999, which `from_u16` accepts.
    *response.status_mut() =
        StatusCode::from_u16(record.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    *response.headers_mut() = decode_headers(&record.headers);
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// Headers as `name: value` lines. Header values cannot hold CR or LF and names cannot
/// hold ':', so the form is unambiguous, and readable with `convert_from(headers, 'UTF8')`.
fn encode_headers(headers: &HeaderMap, allow: &[HeaderName]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        if allow.contains(name) {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.push(b'\n');
        }
    }
    out
}

fn decode_headers(encoded: &[u8]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for line in encoded.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let name = HeaderName::from_bytes(&line[..colon]);
        let value = HeaderValue::from_bytes(line[colon + 1..].trim_ascii_start());
        if let (Ok(name), Ok(value)) = (name, value) {
            headers.append(name, value);
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse;
    use http::header::{CONTENT_TYPE, LOCATION, SET_COOKIE};

    #[tokio::test]
    async fn capture_keeps_allowed_headers_and_exact_body() {
        let response = (
            StatusCode::CREATED,
            [
                (LOCATION, "/charges/ch_1"),
                (SET_COOKIE, "s=1"),
                (CONTENT_TYPE, "application/json"),
            ],
            "{\"id\": \"ch_1\"}",
        )
            .into_response();
        let allow = [CONTENT_TYPE, LOCATION];
        let (stored, parts) = capture(response, &allow, 1024).await.unwrap();
        assert_eq!(
            parts.headers[SET_COOKIE], "s=1",
            "the first caller gets every header"
        );
        assert_eq!(stored.status, 201);
        let replay = replay(stored.clone());
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()[LOCATION], "/charges/ch_1");
        assert_eq!(replay.headers()[CONTENT_TYPE], "application/json");
        assert_eq!(replay.headers()[IDEMPOTENT_REPLAYED], "true");
        assert!(replay.headers().get(SET_COOKIE).is_none());
        let body = axum::body::to_bytes(replay.into_body(), 1024)
            .await
            .unwrap();
        assert_eq!(body, stored.body);
    }

    #[tokio::test]
    async fn over_the_cap_is_refused() {
        let response = "x".repeat(2000).into_response();
        let err = capture(response, &[], 1000).await.unwrap_err();
        assert!(matches!(err, CaptureError::TooLarge { limit: 1000 }));
    }

    #[test]
    fn repeated_headers_survive() {
        let mut headers = HeaderMap::new();
        headers.append("link", "<a>; rel=a".parse().unwrap());
        headers.append("link", "<b>; rel=b".parse().unwrap());
        let decoded = decode_headers(&encode_headers(&headers, &[http::header::LINK]));
        assert_eq!(decoded.get_all("link").iter().count(), 2);
    }
}

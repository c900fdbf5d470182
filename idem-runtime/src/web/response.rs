//! A response as the engine stores it ([`Record`]): captured from the handler's answer,
//! and replayed on retries.

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::header::{HeaderName, CONTENT_TYPE};
use http::response::Parts;
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};

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

/// Reads the whole body (up to `limit` bytes) and keeps the allow-listed headers (every
/// header: `None`). Returns the stored form, the parts of the original response, which
/// the first caller receives in full, and its trailers, which gRPC's status is sent in.
pub(crate) async fn capture(
    response: Response,
    allow: Option<&[HeaderName]>,
    limit: usize,
) -> Result<(Record, Parts, Option<HeaderMap>), CaptureError> {
    let (parts, body) = response.into_parts();
    let collected = Limited::new(body, limit).collect().await.map_err(|e| {
        if e.downcast_ref::<LengthLimitError>().is_some() {
            CaptureError::TooLarge { limit }
        } else {
            CaptureError::Body(e)
        }
    })?;
    let trailers = collected.trailers().cloned();
    let body = collected.to_bytes();
    let headers = encode_headers(&parts.headers, allow);
    Ok((
        Record {
            status: parts.status.as_u16(),
            headers,
            body,
        },
        parts,
        trailers,
    ))
}

/// A body of `bytes`, then `trailers` if there are any.
pub(crate) fn body(bytes: Bytes, trailers: Option<HeaderMap>) -> Body {
    match trailers {
        None => Body::from(bytes),
        Some(trailers) => {
            Body::new(Full::new(bytes).with_trailers(std::future::ready(Some(Ok(trailers)))))
        }
    }
}

/// The replay: stored status, headers and body, plus `Idempotent-Replayed: true`. A
/// stored gRPC reply ends with its status, OK (only those are stored), in its trailers.
pub(crate) fn replay(record: Record) -> Response {
    let headers = decode_headers(&record.headers);
    let trailers = is_grpc(&headers).then(|| {
        let mut trailers = HeaderMap::new();
        trailers.insert(GRPC_STATUS, HeaderValue::from_static("0"));
        trailers
    });
    let mut response = Response::new(body(record.body, trailers));
    // The engine hands over only statuses in 100..=999, which `from_u16` accepts.
    *response.status_mut() =
        StatusCode::from_u16(record.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    *response.headers_mut() = headers;
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// The header, or trailer, a gRPC reply's status is in.
pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// Whether `headers` are a gRPC request's or reply's: `application/grpc`, with or without
/// a subtype (`+proto`).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            value == "application/grpc"
                || value.starts_with("application/grpc+")
                || value.starts_with("application/grpc;")
        })
}

/// Headers as `name: value` lines. Header values cannot hold CR or LF and names cannot
/// hold ':', so the form is unambiguous, and readable with `convert_from(headers, 'UTF8')`.
fn encode_headers(headers: &HeaderMap, allow: Option<&[HeaderName]>) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        if allow.is_none_or(|allow| allow.contains(name)) {
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
        let (stored, parts, _) = capture(response, Some(&allow), 1024).await.unwrap();
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
        let err = capture(response, Some(&[]), 1000).await.unwrap_err();
        assert!(matches!(err, CaptureError::TooLarge { limit: 1000 }));
    }

    #[test]
    fn repeated_headers_survive() {
        let mut headers = HeaderMap::new();
        headers.append("link", "<a>; rel=a".parse().unwrap());
        headers.append("link", "<b>; rel=b".parse().unwrap());
        let decoded = decode_headers(&encode_headers(&headers, Some(&[http::header::LINK])));
        assert_eq!(decoded.get_all("link").iter().count(), 2);
    }
}

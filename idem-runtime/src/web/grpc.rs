//! The gRPC adapter: a tonic method's request on the web adapter's [`Guard`] and
//! [`Claimed`], and gRPC's answers in place of problems.
//!
//! `#[idem::grpc]` rewrites each `#[idempotent]` method of a tonic service to [`read`] the
//! request's metadata (its key, its principal), add the message's named fields, [`claim`]
//! and [`finish`], as the axum expansion does with the same `Guard` and `Claimed`. What
//! differs is what the client sees: a reply is stored as gRPC sends it (the metadata, and
//! the message in its length-prefixed frame), and idem's refusals, problems to an HTTP
//! client, are statuses with the details gRPC clients read ([`status_of`]). The same
//! frames and statuses are what `IdempotencyLayer` answers a gRPC request with.
//!
//! | idem's answer | HTTP | gRPC |
//! |---|---|---|
//! | a replay | the stored response, `Idempotent-Replayed: true` | the stored message and metadata, `idempotent-replayed: true` |
//! | a duplicate in flight | 409 `key-in-use` | `ABORTED`, `RetryInfo` |
//! | another payload under the key | 422 `key-reused` | `FAILED_PRECONDITION`, `ErrorInfo` `KEY_REUSED` |
//! | no key, or a malformed one | 400 | `INVALID_ARGUMENT` |
//! | the database away | 503 `unavailable` | `UNAVAILABLE`, `RetryInfo` |

use std::collections::HashMap;
use std::time::Duration;

use axum::body::Body;
use axum::extract::FromRef as _;
use axum::response::Response;
use bytes::{BufMut, Bytes, BytesMut};
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, StatusCode};
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use super::extract::KeySource;
use super::policy::KeyRead;
use super::problem::PROBLEM_JSON;
use super::response::{is_grpc, IDEMPOTENT_REPLAYED};
use super::{Answer, Claimed, Fields, Guard, Spec};
use crate::store::Store;

/// The `ErrorInfo` domain of idem's statuses.
const DOMAIN: &str = "idem";

/// The metadata gRPC's retry policy reads a server's pushback from (gRFC A6).
const PUSHBACK: &str = "grpc-retry-pushback-ms";

/// A service an `#[idempotent]` method takes idem's [`Store`] from: any service `S` with
/// `Store: FromRef<S>`, such as a `#[derive(Clone, FromRef)]` struct with a `Store` field.
#[diagnostic::on_unimplemented(
    message = "the service `{Self}` holds no `idem::Store`",
    label = "an `#[idempotent]` method takes idem's store from its service",
    note = "add a `store: idem::Store` field to `{Self}` and `#[derive(Clone, FromRef)]` on it, or implement `FromRef<{Self}>` for `idem::Store`"
)]
pub trait ServiceStore {
    /// The store, from the service.
    fn store(&self) -> Store;
}

#[diagnostic::do_not_recommend]
impl<S> ServiceStore for S
where
    Store: axum::extract::FromRef<S>,
{
    fn store(&self) -> Store {
        Store::from_ref(self)
    }
}

/// Reads `request`'s key and principal from its metadata for `service`'s store, and
/// begins its fingerprint: the scope and `procedure` (`Service/method`), which tell one
/// method's keys from another's. Its metadata and extensions are put back as they were.
pub async fn read<S: ServiceStore + ?Sized, T>(
    service: &S,
    spec: &Spec,
    procedure: &'static str,
    request: &mut tonic::Request<T>,
) -> Result<(Guard<()>, Fields), Status> {
    let (mut parts, ()) = http::Request::new(()).into_parts();
    parts.method = http::Method::POST;
    parts.headers = std::mem::take(request.metadata_mut()).into_headers();
    parts.extensions = std::mem::take(request.extensions_mut());
    let read = Guard::<()>::read(service.store(), &mut parts).await;
    *request.metadata_mut() = MetadataMap::from_headers(parts.headers);
    *request.extensions_mut() = parts.extensions;
    match read {
        Ok(guard) => {
            let guard = guard.procedure(procedure);
            let fields = guard.fingerprint(spec);
            Ok((guard, fields))
        }
        Err(refused) => Err(status_of(refused).await),
    }
}

/// Claims the key: `Ok` when the method is to run, `Err` with its answer when not (a
/// replay, or a status).
pub async fn claim<R: prost::Message + Default>(
    guard: Guard<()>,
    spec: &Spec,
    key: Option<KeyRead>,
    fields: Fields,
) -> Result<Claimed, Result<tonic::Response<R>, Status>> {
    match guard.claim(spec, None, key, fields).await {
        Ok(claimed) => Ok(claimed),
        Err(answer) => Err(reply_of(answer).await),
    }
}

/// Commits the method's `Ok` reply with its stored form, or rolls its `Err` back, and
/// answers.
pub async fn finish<R: prost::Message + Default>(
    claimed: Claimed,
    out: Result<tonic::Response<R>, Status>,
) -> Result<tonic::Response<R>, Status> {
    match out {
        Ok(reply) => {
            let (metadata, message, extensions) = reply.into_parts();
            let mut response = Response::new(Body::from(frame(&message)));
            *response.headers_mut() = metadata.into_headers();
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
            let answered = claimed.finish(Answer::rpc(response, true)).await;
            let fresh = answered.status() == StatusCode::OK
                && !answered.headers().contains_key(IDEMPOTENT_REPLAYED)
                && is_grpc(answered.headers());
            if fresh {
                let metadata = metadata_of(answered.into_parts().0.headers);
                Ok(tonic::Response::from_parts(metadata, message, extensions))
            } else {
                reply_of(answered).await
            }
        }
        Err(status) => {
            let answered = claimed
                .finish(Answer::rpc(status.into_http::<Body>(), false))
                .await;
            reply_of(answered).await
        }
    }
}

/// Without `fields = [..]`, the whole message: its bytes as prost encodes them, fields
/// in their numbers' order. A map's entries are encoded in the map's own order, which
/// prost's `HashMap` does not keep from one decoding to the next: name the fields of a
/// message with a map.
pub fn whole<M: prost::Message>(fields: &mut Fields, message: &M) {
    fields.bytes(&message.encode_to_vec());
}

/// The key of `key = field`: the field's text, where an empty one is no key, as proto3
/// sends a string field that was never set.
pub fn key_of<K: KeySource + ?Sized>(value: &K) -> KeyRead {
    let text = value.key_text();
    KeyRead::field(text.as_deref().filter(|text| !text.is_empty()))
}

/// Gives an async block its output type, so that `?` and `return` in a method's body
/// mean what they mean in the method.
pub fn typed<O, F: std::future::Future<Output = O>>(future: F) -> F {
    future
}

/// `message` as gRPC sends it: a frame of one uncompressed message, its length before it.
fn frame<M: prost::Message>(message: &M) -> Bytes {
    let len = message.encoded_len();
    let mut buf = BytesMut::with_capacity(5 + len);
    buf.put_u8(0);
    // A message over 4 GiB cannot be sent; tonic refuses far smaller ones.
    buf.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
    message.encode(&mut buf).ok();
    buf.freeze()
}

/// The one uncompressed message in `body`'s frame.
fn unframe(body: &[u8]) -> Option<&[u8]> {
    let (&[0, a, b, c, d], message) = body.split_first_chunk::<5>()? else {
        return None;
    };
    let len = usize::try_from(u32::from_be_bytes([a, b, c, d])).ok()?;
    (message.len() == len).then_some(message)
}

/// The metadata of a reply's headers, without those gRPC's transport sets itself.
fn metadata_of(mut headers: HeaderMap) -> MetadataMap {
    headers.remove(CONTENT_TYPE);
    headers.remove(http::header::CONTENT_LENGTH);
    MetadataMap::from_headers(headers)
}

/// A method's answer from the web adapter's: its own status back (rolled back), a
/// problem as a status, or a stored reply (a replay).
async fn reply_of<R: prost::Message + Default>(
    mut answer: Response,
) -> Result<tonic::Response<R>, Status> {
    if let Some(status) = answer.extensions_mut().remove::<Status>() {
        return Err(status);
    }
    if !is_grpc(answer.headers()) {
        return Err(status_of(answer).await);
    }
    let (parts, body) = answer.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .map_err(|e| Status::internal(format!("idem: the stored reply cannot be read: {e}")))?;
    let message = unframe(&bytes)
        .and_then(|message| R::decode(message).ok())
        .ok_or_else(|| {
            Status::internal(
                "idem: the key's stored reply is not one message of this method's reply type",
            )
        })?;
    Ok(tonic::Response::from_parts(
        metadata_of(parts.headers),
        message,
        http::Extensions::new(),
    ))
}

/// The web adapter's answer to a gRPC request: its problems as statuses in gRPC's own
/// response, anything else as it is (`IdempotencyLayer`).
pub(crate) async fn in_grpc(mut answer: Response) -> Response {
    let is_problem = answer
        .headers()
        .get(CONTENT_TYPE)
        .is_some_and(|value| value == PROBLEM_JSON);
    if is_problem {
        status_of(answer).await.into_http()
    } else {
        answer.extensions_mut().remove::<Status>();
        answer
    }
}

/// idem's refusal, a problem, as the status a gRPC client reads: the code its HTTP
/// status maps to, the detail as the message, an `ErrorInfo` with the problem's type,
/// and, where it says when to retry, a `RetryInfo` and gRPC's pushback.
pub(crate) async fn status_of(mut problem: Response) -> Status {
    if let Some(status) = problem.extensions_mut().remove::<Status>() {
        return status;
    }
    let (parts, body) = problem.into_parts();
    let body = axum::body::to_bytes(body, 64 * 1024)
        .await
        .unwrap_or_default();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let kind = json["type"].as_str().unwrap_or_default();
    let slug = kind.rsplit([':', '/']).next().unwrap_or_default();
    let message = json["detail"]
        .as_str()
        .or(json["title"].as_str())
        .unwrap_or("refused by idem");
    let retry = parts
        .headers
        .get(RETRY_AFTER)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok())
        .map(Duration::from_secs);
    let mut details = ErrorDetails::new();
    details.set_error_info(
        slug.to_ascii_uppercase().replace('-', "_"),
        DOMAIN,
        HashMap::from([("type".to_owned(), kind.to_owned())]),
    );
    if let Some(after) = retry {
        details.set_retry_info(Some(after));
    }
    let mut status = Status::with_error_details(code_of(parts.status), message, details);
    if let Some(after) = retry {
        let millis = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        status.metadata_mut().insert(PUSHBACK, millis.into());
    }
    status
}

/// The code of an HTTP status, as idem answers them (the adapter's table, in the book).
fn code_of(status: StatusCode) -> Code {
    match status.as_u16() {
        400 => Code::InvalidArgument,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        // A concurrency conflict (google/rpc/code.proto maps ABORTED to 409).
        409 => Code::Aborted,
        // The answer depends on what the key holds, not on the request alone: another
        // payload, an abandoned request.
        410 | 422 => Code::FailedPrecondition,
        413 | 429 => Code::ResourceExhausted,
        503 => Code::Unavailable,
        504 => Code::DeadlineExceeded,
        500..=599 => Code::Internal,
        _ => Code::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::response::IntoResponse;
    use prost::Message as _;

    #[test]
    fn a_frame_holds_one_message() {
        let message = "hello".to_owned();
        let framed = frame(&message);
        assert_eq!(&framed[..5], &[0, 0, 0, 0, 7]);
        assert_eq!(String::decode(unframe(&framed).unwrap()).unwrap(), "hello");
        assert!(unframe(&framed[..6]).is_none(), "a cut frame");
        let mut compressed = framed.to_vec();
        compressed[0] = 1;
        assert!(unframe(&compressed).is_none(), "a compressed frame");
    }

    #[tokio::test]
    async fn problems_become_statuses_with_their_details() {
        let problems = super::super::problem::Problems {
            base: super::super::problem::DEFAULT_PROBLEM_BASE,
            retry_after: Duration::from_secs(2),
        };
        let status = status_of(problems.key_in_use().into_response()).await;
        assert_eq!(status.code(), Code::Aborted);
        let details = status.get_error_details();
        assert_eq!(
            details.retry_info().unwrap().retry_delay,
            Some(Duration::from_secs(2))
        );
        let info = details.error_info().unwrap();
        assert_eq!(info.reason, "KEY_IN_USE");
        assert_eq!(info.domain, "idem");
        assert_eq!(info.metadata["type"], "urn:idem:problem:key-in-use");
        assert_eq!(status.metadata().get(PUSHBACK).unwrap(), "2000");

        let status = status_of(problems.key_reused().into_response()).await;
        assert_eq!(status.code(), Code::FailedPrecondition);
        assert!(status.get_error_details().retry_info().is_none());
        assert_eq!(
            status_of(problems.unavailable().into_response())
                .await
                .code(),
            Code::Unavailable
        );
        assert_eq!(
            status_of(problems.missing_key("no key".into()).into_response())
                .await
                .code(),
            Code::InvalidArgument
        );
    }
}

//! The request as it arrived, kept for a completable endpoint: the head by an extractor
//! the macro adds ([`Completable`]), the body by the body's own extractor, which reads
//! it once into a slot ([`CaptureBody`]) and hands the same bytes on.

use std::sync::{Arc, OnceLock};

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, OriginalUri, Request};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::{HeaderMap, HeaderName, Method};

use super::{is_credential, without_credentials, Completion};
use crate::table::requests::StoredRequest;
use crate::web::extract::HoldsStore;

/// Where the body's extractor leaves the bytes it read: put in the request's extensions
/// by [`Completable`], read by [`crate::web::extract::Extract`].
#[derive(Clone, Default)]
pub(crate) struct CaptureBody(Arc<OnceLock<Bytes>>);

impl CaptureBody {
    /// Reads `req`'s body whole (within the router's body limit, as `Bytes` would),
    /// keeps it, and gives back the request with the same bytes as its body.
    pub(crate) async fn read<S: Send + Sync>(
        &self,
        req: Request,
        state: &S,
    ) -> Result<Request, Response> {
        let (parts, body) = req.into_parts();
        let bytes = Bytes::from_request(Request::from_parts(parts.clone(), body), state)
            .await
            .map_err(IntoResponse::into_response)?;
        let _ = self.0.set(bytes.clone());
        Ok(Request::from_parts(parts, Body::from(bytes)))
    }
}

/// The head of a completable endpoint's request, and the slot its body is read into:
/// the extractor `#[idempotent(.., completable = true)]` adds. Nothing is kept for a
/// request that is itself a completion (it is stored already).
pub struct Completable {
    head: Option<Head>,
    body: CaptureBody,
    completion: Option<Completion>,
}

impl std::fmt::Debug for Completable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completable").finish_non_exhaustive()
    }
}

struct Head {
    method: Method,
    target: String,
    headers: HeaderMap,
}

impl<S: HoldsStore> FromRequestParts<S> for Completable {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Response> {
        if let Some(completion) = parts.extensions.get::<Completion>() {
            return Ok(Self {
                head: None,
                body: CaptureBody::default(),
                completion: Some(completion.clone()),
            });
        }
        // The router's own target: a nested router sees its path without its prefix,
        // and the completion runs through the outermost one.
        let uri = parts
            .extensions
            .get::<OriginalUri>()
            .map_or(&parts.uri, |original| &original.0);
        let target = uri
            .path_and_query()
            .map_or_else(|| uri.path().to_owned(), |pq| pq.as_str().to_owned());
        // Credentials are left out when the request is stored ([`Completable::stored`]).
        let headers = parts.headers.clone();
        let body = CaptureBody::default();
        parts.extensions.insert(body.clone());
        Ok(Self {
            head: Some(Head {
                method: parts.method.clone(),
                target,
                headers,
            }),
            body,
            completion: None,
        })
    }
}

impl Completable {
    /// The completion this request is, if it is one.
    pub(crate) fn completion(&self) -> Option<&Completion> {
        self.completion.as_ref()
    }

    /// The request to store: the allowed headers (`allowed`, and `key_header`, the one
    /// its key came from), never a credential, in a header or in the target's query
    /// ([`without_credentials`]); `None` for a completion.
    pub(crate) fn stored(
        self,
        allowed: &[HeaderName],
        key_header: &HeaderName,
    ) -> Option<StoredRequest> {
        let head = self.head?;
        let headers = head
            .headers
            .iter()
            .filter(|(name, _)| {
                !is_credential(name) && (*name == key_header || allowed.contains(name))
            })
            .filter_map(|(name, value)| {
                Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
            })
            .collect();
        Some(StoredRequest {
            method: head.method.as_str().to_owned(),
            target: without_credentials(&head.target),
            headers,
            body: self.body.0.get().cloned().unwrap_or_default(),
        })
    }
}

//! The service's OpenAPI document, served at `GET /openapi.json`.
//!
//! Each handler carries its `#[utoipa::path]`; on the idempotent ones `#[idempotent]`
//! sits above it and adds the `Idempotency-Key` header and idem's problem responses
//! (400, 409, 413, 415, 422, 503), so the handlers list only their own answers.

use std::collections::BTreeMap;

use axum::Json;
use utoipa::openapi::header::Header;
use utoipa::openapi::schema::Type;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, RefOr, Response, ResponseBuilder};
use utoipa::{IntoResponses, Modify, OpenApi};

/// The document.
#[derive(OpenApi)]
#[openapi(
    info(title = "charges", description = "The idem reference service: idempotent charges and refunds."),
    paths(
        crate::charge::create_charge,
        crate::charge::get_charge,
        crate::charge::create_refund,
        crate::webhook::payment_event,
        crate::webhook::stripe_event,
        crate::webhook::github_event,
    ),
    components(schemas(idem::Problem)),
    modifiers(&Bearer),
)]
#[derive(Debug)]
pub struct ApiDoc;

/// `GET /openapi.json`.
pub async fn document() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

/// The `bearer` scheme: `Authorization: Bearer <account>`.
struct Bearer;

impl Modify for Bearer {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// A problem+json response with `status` and `description`.
fn problem(description: &str) -> ResponseBuilder {
    ResponseBuilder::new().description(description).content(
        idem::problem::PROBLEM_JSON,
        ContentBuilder::new()
            .schema(Some(Ref::from_schema_name("Problem")))
            .build(),
    )
}

/// 401: no bearer account, or no valid webhook signature.
#[derive(Debug)]
pub struct Unauthenticated;

impl IntoResponses for Unauthenticated {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        let response = problem("No `Authorization: Bearer <account>`, or no valid signature")
            .header(
                "WWW-Authenticate",
                Header::new(utoipa::openapi::ObjectBuilder::new().schema_type(Type::String)),
            )
            .build();
        BTreeMap::from([("401".to_owned(), response.into())])
    }
}

/// 404: no such charge in the caller's account.
#[derive(Debug)]
pub struct NotFound;

impl IntoResponses for NotFound {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        let response = problem("No such charge in the caller's account").build();
        BTreeMap::from([("404".to_owned(), response.into())])
    }
}

/// The payment processor's answers to `POST /charges` (`PROCESSOR_URL`): 402, its refusal
/// of the charge (committed, replayed to retries); 502 and 504, no answer from it
/// (rolled back, retryable with the same key).
#[derive(Debug)]
pub struct ProcessorProblems;

impl IntoResponses for ProcessorProblems {
    fn responses() -> BTreeMap<String, RefOr<Response>> {
        [
            ("402", "The payment processor refused the charge"),
            (
                "502",
                "The payment processor failed or could not be reached; retry",
            ),
            ("504", "The payment processor did not answer in time; retry"),
        ]
        .into_iter()
        .map(|(status, description)| (status.to_owned(), problem(description).build().into()))
        .collect()
    }
}

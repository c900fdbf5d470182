//! OpenAPI documents through [utoipa](https://docs.rs/utoipa), with the `utoipa` feature.
//!
//! Put `#[idempotent]` **above** `#[utoipa::path]`: the attribute then adds to the
//! operation what idem itself answers, so no handler lists it by hand:
//!
//! - the key's parameter: the `Idempotency-Key` header, or the endpoint's own header
//!   (`key = header("Webhook-Id")`); none for `key = field`, whose key is in the body.
//!   It is required unless the endpoint says `required = false`;
//! - the problem responses, `application/problem+json` with the [`Problem`] schema:
//!   400 (key missing or malformed, request refused), 409 (a request with this key is
//!   still running, with `Retry-After`), 413 (body too large), 415 (body of another
//!   media type), 422 (key reused with another payload, or a body that does not
//!   deserialize) and 503 (database unavailable or serialization failure, with
//!   `Retry-After`); a status the path already lists is left as written;
//! - the `Idempotent-Replayed` header on each success response the path lists: a replay
//!   answers the stored status, headers and body, plus that header.
//!
//! The operation keeps its `operation_id` (the handler's name), its docs and everything
//! else the path says. Schemas are collected as usual: [`Problem`] lands in the
//! document's components because the responses name it.
//!
//! ```
//! use axum::http::StatusCode;
//! use axum::Json;
//! use idem::{idempotent, Problem, Tx};
//! use serde::{Deserialize, Serialize};
//! use utoipa::OpenApi;
//!
//! #[derive(Deserialize, Serialize, utoipa::ToSchema)]
//! struct NewCharge {
//!     amount: i64,
//! }
//!
//! /// Creates a charge.
//! #[idempotent(scope = "charges")]
//! #[utoipa::path(post, path = "/charges", request_body = NewCharge, responses((status = 201, description = "Created")))]
//! async fn create_charge(_tx: Tx, Json(req): Json<NewCharge>) -> Result<StatusCode, Problem> {
//!     let _ = req.amount;
//!     Ok(StatusCode::CREATED)
//! }
//!
//! #[derive(OpenApi)]
//! #[openapi(paths(create_charge))]
//! struct ApiDoc;
//!
//! let doc = serde_json::to_value(ApiDoc::openapi()).unwrap();
//! let op = &doc["paths"]["/charges"]["post"];
//! assert_eq!(op["parameters"][0]["name"], "Idempotency-Key");
//! assert_eq!(op["parameters"][0]["required"], true);
//! assert!(op["responses"]["201"]["headers"]["Idempotent-Replayed"].is_object());
//! assert!(op["responses"]["409"]["headers"]["Retry-After"].is_object());
//! assert!(op["responses"]["422"]["content"]["application/problem+json"].is_object());
//! assert!(doc["components"]["schemas"]["Problem"].is_object());
//! ```
//!
//! The other order, `#[utoipa::path]` above `#[idempotent]`, is a compile error on
//! `#[idempotent]`: utoipa would expand first, never seen by idem, and document the
//! function without any of the above.
//! Put `#[axum::debug_handler]` below `#[idempotent]` too (see the attribute's docs).

use std::borrow::Cow;

use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, Schema, SchemaFormat, SchemaType, Type};
use utoipa::openapi::RefOr;
use utoipa::{PartialSchema, ToSchema};

use crate::Problem;

fn text(description: &str) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some(description))
}

impl PartialSchema for Problem {
    /// An RFC 9457 problem details object, as [`Problem`] serializes it.
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .description(Some(
                "RFC 9457 problem details. Branch on `type`: idem's own problems end in one of \
                 `idem::problem::problem_type` (missing-key, malformed-key, key-in-use, key-reused, \
                 unavailable, serialization-failure, invalid-request, ...).",
            ))
            .property(
                "type",
                text("A URI that identifies the problem's kind; stable."),
            )
            .required("type")
            .property("title", text("A short, stable summary of the kind."))
            .required("title")
            .property(
                "status",
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int32)))
                    .minimum(Some(100))
                    .maximum(Some(599))
                    .description(Some("The HTTP status of the response.")),
            )
            .required("status")
            .property("detail", text("What went wrong with this request."))
            .property(
                "errors",
                ObjectBuilder::new()
                    .schema_type(SchemaType::AnyValue)
                    .description(Some(
                        "An extractor's own rejection, as JSON, when it has one.",
                    )),
            )
            .into()
    }
}

impl ToSchema for Problem {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("Problem")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_conforms_to_its_schema() {
        let schema = serde_json::to_value(Problem::schema()).expect("a schema");
        let problem = Problem::new(
            http::StatusCode::CONFLICT,
            "urn:idem:problem:key-in-use",
            "Key in use",
        )
        .with_detail("retry later");
        let value = serde_json::to_value(&problem).expect("a problem");
        let properties = schema["properties"].as_object().expect("properties");
        for (name, _) in value.as_object().expect("an object") {
            assert!(properties.contains_key(name), "`{name}` is in the schema");
        }
        for required in schema["required"].as_array().expect("required") {
            let name = required.as_str().expect("a name");
            assert!(value.get(name).is_some(), "`{name}` is always serialized");
        }
        assert_eq!(value["status"], 409);
        assert_eq!(Problem::name(), "Problem");
    }
}

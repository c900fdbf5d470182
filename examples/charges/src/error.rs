//! The service's errors, as problem+json responses.

use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idem::{Problem, StepError};

use crate::{ProcessorError, PROBLEM_BASE};

pub(crate) fn problem_type(slug: &str) -> String {
    format!("{PROBLEM_BASE}{slug}")
}

/// The service's error: a problem+json response. Database failures that mean "the
/// database is unreachable" answer 503, anything else 500.
#[derive(Debug)]
pub struct ApiError(pub Problem);

impl ApiError {
    pub(crate) fn invalid(detail: impl Into<String>) -> Self {
        Self(
            Problem::new(
                StatusCode::BAD_REQUEST,
                problem_type("invalid-request"),
                "Invalid request",
            )
            .with_detail(detail),
        )
    }

    pub(crate) fn not_found(what: &str) -> Self {
        Self(
            Problem::new(
                StatusCode::NOT_FOUND,
                problem_type("not-found"),
                "Not found",
            )
            .with_detail(format!("no such {what}")),
        )
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        // Text PostgreSQL cannot hold: a NUL character in a text value (22021) or a
        // `\u0000` in jsonb (22P05). The request's content, not the service, is at fault.
        let code = error.as_database_error().and_then(|e| e.code());
        if matches!(code.as_deref(), Some("22021" | "22P05")) {
            tracing::info!(%error, "request text refused by the database");
            return Self::invalid("text must not contain NUL characters (U+0000)");
        }
        if idem::sqlstate::is_unavailable(&error) {
            tracing::warn!(%error, "database unavailable");
            Self(
                Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    problem_type("unavailable"),
                    "Service unavailable",
                )
                .with_retry_after(Duration::from_secs(1)),
            )
        } else {
            tracing::error!(%error, "database error");
            Self(Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                problem_type("internal"),
                "Internal error",
            ))
        }
    }
}

impl From<idem::outbox::EmitError> for ApiError {
    fn from(error: idem::outbox::EmitError) -> Self {
        // The events are the service's own: a bad topic is a bug, answered 500.
        sqlx::Error::from(error).into()
    }
}

/// A step's failure: the processor's as the service's own 502 and 504, idem's as idem
/// answers them (422 `key-reused`, 503 `step-unrecorded`), the database's as the
/// service's other database errors. Each rolls the request back; a retry calls the
/// processor again with the same key, or resumes after its recorded answer.
impl From<StepError<ProcessorError>> for ApiError {
    fn from(error: StepError<ProcessorError>) -> Self {
        let timed_out = |after: Duration| {
            Self(
                Problem::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    problem_type("processor-timeout"),
                    "Payment processor timed out",
                )
                .with_detail(format!(
                    "the payment processor did not answer within {} ms; nothing was \
                     committed; a retry calls it again under the same key",
                    after.as_millis()
                )),
            )
        };
        match error {
            StepError::Call(ProcessorError::Timeout(after)) => {
                tracing::warn!(?after, "the payment processor did not answer in time");
                timed_out(after)
            }
            StepError::Timeout(after) => {
                tracing::warn!(?after, "the payment processor's step timed out");
                timed_out(after)
            }
            StepError::Call(error) => {
                tracing::warn!(%error, "payment processor call failed");
                Self(
                    Problem::new(
                        StatusCode::BAD_GATEWAY,
                        problem_type("processor-failed"),
                        "Payment processor failed",
                    )
                    .with_detail(
                        "the payment processor gave no answer to the charge; nothing was \
                         committed; a retry calls it again under the same key",
                    ),
                )
            }
            StepError::Database(error) => error.into(),
            other => match other.into_problem() {
                Ok(problem) => Self(problem),
                Err(error) => Self::from(StepError::Call(error)),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.0.into_response()
    }
}

//! A step's failure ([`StepError`]) as an HTTP answer: the call's own error answers as
//! itself, idem's as problems.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::StatusCode;

use crate::sqlstate::is_unavailable;
use crate::steps::StepError;
use crate::web::problem::{problem_type, Problem, DEFAULT_PROBLEM_BASE};

/// The `Retry-After` of a step's 503: the same second the store's answers default to.
const RETRY_AFTER: Duration = Duration::from_secs(1);

impl<E> StepError<E> {
    /// idem's answer to this failure, as a problem with the default problem base
    /// (`urn:idem:problem:`): 504 `step-timeout`, 422 `key-reused`, 503 `step-unrecorded`
    /// or `unavailable` (with `Retry-After`), 500 `internal`. `Err` gives the call's own
    /// error back ([`StepError::Call`]), for the handler to answer.
    pub fn into_problem(self) -> Result<Problem, E> {
        let problem = |status, kind: &str, title: &'static str| {
            Problem::new(status, format!("{DEFAULT_PROBLEM_BASE}{kind}"), title)
        };
        Ok(match self {
            Self::Call(error) => return Err(error),
            Self::Timeout(after) => problem(
                StatusCode::GATEWAY_TIMEOUT,
                problem_type::STEP_TIMEOUT,
                "Outside call timed out",
            )
            .with_detail(format!(
                "a call to another service took longer than {after:?}; nothing was \
                 committed; a retry calls again"
            )),
            Self::Mismatch => problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                problem_type::KEY_REUSED,
                "Idempotency-Key reused",
            )
            .with_detail(
                "this Idempotency-Key was already used for a request with a different payload",
            ),
            Self::Lost => problem(
                StatusCode::SERVICE_UNAVAILABLE,
                problem_type::STEP_UNRECORDED,
                "Outside call not recorded",
            )
            .with_detail(
                "the request lost its transaction during a call to another service; retry later",
            )
            .with_retry_after(RETRY_AFTER),
            Self::Database(error) if is_unavailable(&error) => problem(
                StatusCode::SERVICE_UNAVAILABLE,
                problem_type::UNAVAILABLE,
                "Service unavailable",
            )
            .with_detail("the database could not be reached; nothing was committed; retry later")
            .with_retry_after(RETRY_AFTER),
            Self::Database(error) => {
                tracing::error!(%error, "idem: a step could not be read or recorded");
                problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    problem_type::INTERNAL,
                    "Internal error",
                )
                .with_detail("a step could not be recorded; nothing was committed")
            }
            Self::Json(error) => {
                tracing::error!(%error, "idem: a step's result is not JSON of its type");
                problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    problem_type::INTERNAL,
                    "Internal error",
                )
                .with_detail("a step's result could not be recorded or read back")
            }
        })
    }
}

impl<E: IntoResponse> IntoResponse for StepError<E> {
    fn into_response(self) -> Response {
        match self.into_problem() {
            Ok(problem) => problem.into_response(),
            Err(error) => error.into_response(),
        }
    }
}

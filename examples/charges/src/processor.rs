//! The payment processor `POST /charges` calls (`PROCESSOR_URL`), as a step
//! (`tx.step("processor", ..)`): the call runs once per request, across failures, crashes
//! and retries, and its result is recorded before the charge is written.
//!
//! `POST {PROCESSOR_URL}/v1/charges` with `{"amount", "currency", "customer"}` and
//! `Idempotency-Key: <the step's derived key>`, the same key for every retry of one
//! request. What its answers become:
//!
//! | the processor answers | recorded | `POST /charges` answers |
//! |---|---|---|
//! | 2xx with `{"id": ".."}` | yes | 201, the id as `processor_id` |
//! | 400, 402 or 422 (a declined card, a charge it refuses) | yes | 402 `payment-declined`, committed: retries replay it |
//! | another 4xx (401, 403, 404: the service's own settings; 408, 409, 429: try later), a 5xx, an answer without an id, nothing (unreachable) | no | 502 `processor-failed`, rolled back: a retry calls again, with the same key |
//! | nothing within `PROCESSOR_TIMEOUT_MS` | no | 504 `processor-timeout`, rolled back: as above |
//!
//! Only the processor's verdict on the charge itself is final: a 4xx that says something
//! about this service's credentials or URL, or asks to come back later, would otherwise
//! refuse the key's request for good once the cause is fixed.
//!
//! The step's undo, when an operator abandons a charge whose client went away
//! (`idem::complete`): `POST {PROCESSOR_URL}/v1/refunds` with `{"charge": "<processor
//! id>"}` and `Idempotency-Key: <the compensation's derived key>`; a 2xx is done,
//! anything else is tried again.

use std::time::Duration;

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

/// The processor's statuses that refuse a charge for good ([module docs](self)).
const DECLINING: [u16; 3] = [400, 402, 422];

/// The most of a declining answer's message kept in the 402's detail.
const MESSAGE_CHARS: usize = 200;

/// A payment processor's endpoint and the HTTP client that calls it, with its timeout.
#[derive(Debug, Clone)]
pub struct Processor {
    charges_url: reqwest::Url,
    refunds_url: reqwest::Url,
    client: reqwest::Client,
    timeout: Duration,
}

impl Processor {
    /// Calls `{base_url}/v1/charges`, each call bounded by `timeout` (connecting,
    /// sending and reading the answer). `base_url` is an `http://` URL: the example's
    /// client has no TLS (put a TLS-terminating proxy in front of a real processor).
    pub fn new(base_url: &str, timeout: Duration) -> Result<Self, String> {
        let base = reqwest::Url::parse(base_url)
            .map_err(|e| format!("PROCESSOR_URL must be an http:// URL, not {base_url:?}: {e}"))?;
        if base.scheme() != "http" || base.cannot_be_a_base() || base.host().is_none() {
            return Err(format!(
                "PROCESSOR_URL must be an http:// URL (the example's client has no TLS), \
                 not {base_url:?}"
            ));
        }
        if timeout.is_zero() {
            return Err("PROCESSOR_TIMEOUT_MS must be at least 1".into());
        }
        let at = |path: &str| {
            let mut url = base.clone();
            url.set_path(&format!("{}{path}", base.path().trim_end_matches('/')));
            url
        };
        let (charges_url, refunds_url) = (at("/v1/charges"), at("/v1/refunds"));
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| format!("cannot make the processor's HTTP client: {e}"))?;
        Ok(Self {
            charges_url,
            refunds_url,
            client,
            timeout,
        })
    }

    /// How long one call may take.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// What the client's `error` means.
    fn failed(&self, error: reqwest::Error) -> ProcessorError {
        if error.is_timeout() {
            ProcessorError::Timeout(self.timeout)
        } else if error.is_decode() {
            ProcessorError::Malformed(error)
        } else {
            ProcessorError::Unreachable(error)
        }
    }

    /// Charges at the processor under `key`: its id, or its refusal of the charge; `Err`
    /// for anything a retry may change.
    pub(crate) async fn charge(
        &self,
        key: &str,
        charge: &ProcessorCharge<'_>,
    ) -> Result<Outcome, ProcessorError> {
        let answer = self
            .client
            .post(self.charges_url.clone())
            .header("Idempotency-Key", key)
            .json(charge)
            .send()
            .await
            .map_err(|e| self.failed(e))?;
        let status = answer.status();
        if status.is_success() {
            let charged: Charged = answer.json().await.map_err(|e| self.failed(e))?;
            return Ok(Outcome::Charged { id: charged.id });
        }
        if !DECLINING.contains(&status.as_u16()) {
            return Err(ProcessorError::Failed(status));
        }
        let body = answer.bytes().await.map_err(|e| self.failed(e))?;
        Ok(Outcome::Declined {
            status: status.as_u16(),
            message: message(&body),
        })
    }
}

impl Processor {
    /// Refunds the processor's charge `charge` under `key`: the undo of the charge's
    /// step. `Err` for anything but a 2xx (tried again with the same key).
    pub async fn refund(&self, key: &str, charge: &str) -> Result<(), ProcessorError> {
        let answer = self
            .client
            .post(self.refunds_url.clone())
            .header("Idempotency-Key", key)
            .json(&serde_json::json!({ "charge": charge }))
            .send()
            .await
            .map_err(|e| self.failed(e))?;
        match answer.status() {
            status if status.is_success() => Ok(()),
            status => Err(ProcessorError::Failed(status)),
        }
    }

    /// The undo of the `processor` step whose recorded result is `outcome`: a refund of
    /// a charge; nothing for a declined one.
    pub async fn undo(&self, key: &str, outcome: Outcome) -> Result<(), ProcessorError> {
        match outcome {
            Outcome::Charged { id } => self.refund(key, &id).await,
            Outcome::Declined { .. } => Ok(()),
        }
    }
}

/// The body of `POST /v1/charges`.
#[derive(Serialize)]
pub(crate) struct ProcessorCharge<'a> {
    pub(crate) amount: i64,
    pub(crate) currency: &'a str,
    pub(crate) customer: &'a str,
}

/// A 2xx answer's body.
#[derive(Deserialize)]
struct Charged {
    id: String,
}

/// The processor's final word on a charge: the step's recorded result.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// Charged, under the processor's id.
    Charged { id: String },
    /// Refused with `status` (one of [`DECLINING`]), and its message if it gave one.
    Declined {
        status: u16,
        message: Option<String>,
    },
}

/// A call that gave no final word: nothing is recorded, and the retry calls again.
#[derive(Debug)]
pub enum ProcessorError {
    /// No answer within the timeout, which it names.
    Timeout(Duration),
    /// No answer: the processor could not be reached, or its connection broke.
    Unreachable(reqwest::Error),
    /// An answer that is neither a charge nor a refusal (a 5xx, a 4xx such as 401 or
    /// 429).
    Failed(StatusCode),
    /// A 2xx whose body is not `{"id": ".."}`.
    Malformed(reqwest::Error),
}

impl std::fmt::Display for ProcessorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Timeout(after) => {
                write!(f, "the payment processor did not answer within {after:?}")
            }
            Self::Unreachable(e) => write!(f, "the payment processor could not be reached: {e}"),
            Self::Failed(status) => write!(f, "the payment processor answered {status}"),
            Self::Malformed(e) => write!(f, "the payment processor's answer has no charge id: {e}"),
        }
    }
}

impl std::error::Error for ProcessorError {}

/// The message of a refusal: `error.message`, `message` or `error` of a JSON body, else
/// the body as text, cut to [`MESSAGE_CHARS`]; `None` when empty.
fn message(body: &[u8]) -> Option<String> {
    let json: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let text = match &json {
        Some(json) => [&json["error"]["message"], &json["message"], &json["error"]]
            .into_iter()
            .find_map(|v| v.as_str())
            .map(str::to_owned),
        None => Some(String::from_utf8_lossy(body).into_owned()),
    }?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.chars().take(MESSAGE_CHARS).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_charges_url_keeps_the_base_s_path() {
        let url = |base| Processor::new(base, Duration::from_secs(1)).map(|p| p.charges_url);
        assert_eq!(
            Processor::new("http://pay.internal/proxy/", Duration::from_secs(1))
                .unwrap()
                .refunds_url
                .as_str(),
            "http://pay.internal/proxy/v1/refunds"
        );
        assert_eq!(
            url("http://127.0.0.1:9000").unwrap().as_str(),
            "http://127.0.0.1:9000/v1/charges"
        );
        assert_eq!(
            url("http://pay.internal/proxy/").unwrap().as_str(),
            "http://pay.internal/proxy/v1/charges"
        );
        for wrong in ["", "127.0.0.1:9000", "https://api.stripe.com", "mailto:a@b"] {
            let error = url(wrong).unwrap_err();
            assert!(
                error.starts_with("PROCESSOR_URL must be an http:// URL"),
                "{error}"
            );
        }
        let error = Processor::new("http://127.0.0.1:9000", Duration::ZERO).unwrap_err();
        assert!(error.contains("PROCESSOR_TIMEOUT_MS"), "{error}");
    }

    #[test]
    fn a_refusal_s_message_is_read_from_its_body() {
        let read = |body: &str| message(body.as_bytes());
        assert_eq!(
            read(r#"{"error": {"message": "card declined", "code": "x"}}"#).as_deref(),
            Some("card declined")
        );
        assert_eq!(read(r#"{"message": "no"}"#).as_deref(), Some("no"));
        assert_eq!(
            read(r#"{"error": "insufficient funds"}"#).as_deref(),
            Some("insufficient funds")
        );
        assert_eq!(read(r#"{"code": 7}"#), None);
        assert_eq!(read("  "), None);
        assert_eq!(read("declined").as_deref(), Some("declined"));
        assert_eq!(read(&"x".repeat(500)).map(|m| m.len()), Some(MESSAGE_CHARS));
    }

    #[test]
    fn the_recorded_outcome_is_tagged_json() {
        let declined = Outcome::Declined {
            status: 402,
            message: Some("card declined".into()),
        };
        assert_eq!(
            serde_json::to_value(&declined).unwrap(),
            serde_json::json!({"outcome": "declined", "status": 402, "message": "card declined"})
        );
        let charged: Outcome =
            serde_json::from_str(r#"{"outcome": "charged", "id": "ch_1"}"#).unwrap();
        assert!(matches!(charged, Outcome::Charged { id } if id == "ch_1"));
    }
}

//! The console's queries and forms, typed. Each page and each action reads a struct of
//! its own through [`Fields`], with serde_html_form: a field repeated for a list (the
//! events a form checks), an empty one absent. A field that does not parse is answered a
//! 400 page saying how to write it; a filter's text is trimmed, and blank is no filter;
//! a page size or a bound that does not parse is left to its default.

use std::fmt::Display;
use std::str::FromStr;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::header::CONTENT_TYPE;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::{DeserializeOwned, Deserializer, Error as _, IgnoredAny};
use serde::Deserialize;

use super::page_error;

/// A page's query (`GET`) or an action's form (`POST`, its body), read as `T`.
pub(super) struct Fields<T>(pub(super) T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Fields<T> {
    type Rejection = Response;

    async fn from_request(req: Request, state: &S) -> Result<Self, Response> {
        let read = if req.method() == Method::GET || req.method() == Method::HEAD {
            serde_html_form::from_str(req.uri().query().unwrap_or(""))
        } else {
            let form = req
                .headers()
                .get(CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split(';').next())
                .is_some_and(|m| {
                    m.trim()
                        .eq_ignore_ascii_case("application/x-www-form-urlencoded")
                });
            if !form {
                return Err(page_error(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "An action's form is sent as application/x-www-form-urlencoded, as the \
                     console's pages send it.",
                ));
            }
            let body = Bytes::from_request(req, state)
                .await
                .map_err(IntoResponse::into_response)?;
            serde_html_form::from_bytes(&body)
        };
        read.map(Self)
            .map_err(|error| page_error(StatusCode::BAD_REQUEST, &error.to_string()))
    }
}

/// A filter's text, trimmed; blank is no filter.
pub(super) fn filled<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let text: Option<String> = Option::deserialize(d)?;
    Ok(text.map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()))
}

/// A value with a parser of its own, whose error says how to write one; blank is none.
pub(super) fn parsed<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
    T::Err: Display,
{
    filled(d)?
        .map(|text| text.parse().map_err(D::Error::custom))
        .transpose()
}

/// A number that does not parse is none, and its page's default applies: a list's
/// `limit`, the bound a confirmation carries.
pub(super) fn lenient<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr,
{
    Ok(filled(d)?.and_then(|text| text.parse().ok()))
}

/// A checkbox, or a button's flag: there, whatever its value, or not.
pub(super) fn present<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    IgnoredAny::deserialize(d).map(|_| true)
}

/// How many rows a list shows: its `limit`, 1 to 500, else `default`.
pub(super) fn page_size(limit: Option<u32>, default: u32) -> u32 {
    limit.map_or(default, |n| n.clamp(1, 500))
}

/// An age as operators write it (`90s`, `30m`, `24h`, `7d`), kept as written too, for
/// the form that shows it again; empty is none.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Age {
    pub(super) written: String,
    pub(super) age: Option<Duration>,
}

impl<'de> Deserialize<'de> for Age {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let written = String::deserialize(d)?;
        let text = written.trim();
        let age = if text.is_empty() {
            None
        } else {
            Some(crate::operate::parse_age(text).ok_or_else(|| {
                D::Error::custom(format!(
                    "An age is a whole number and a unit: 90s, 30m, 24h or 7d, not {text:?}."
                ))
            })?)
        };
        Ok(Self { written, age })
    }
}

/// A list's `after` for the lists paged by `seq` (the outbox's): the `seq` its page
/// continues after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct After(pub(super) i64);

impl FromStr for After {
    type Err = &'static str;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        text.parse().map(Self).map_err(|_| {
            "\"after\" is the position of a list's last row shown: follow the page's links."
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize, Debug, PartialEq)]
    struct Probe {
        #[serde(default, deserialize_with = "filled")]
        text: Option<String>,
        #[serde(default, deserialize_with = "parsed")]
        after: Option<After>,
        #[serde(default, deserialize_with = "lenient")]
        limit: Option<u32>,
        #[serde(default, deserialize_with = "present")]
        checked: bool,
        #[serde(default)]
        older_than: Age,
        #[serde(default)]
        id: Vec<String>,
    }

    fn probe(query: &str) -> Result<Probe, String> {
        serde_html_form::from_str(query).map_err(|e| e.to_string())
    }

    #[test]
    fn a_form_reads_lists_blanks_and_checkboxes() {
        let read = probe("text=+a+&after=41&limit=x&checked=&older_than=2h&id=a&id=b").unwrap();
        assert_eq!(read.text.as_deref(), Some("a"));
        assert_eq!(read.after, Some(After(41)));
        assert_eq!(read.limit, None);
        assert!(read.checked);
        assert_eq!(read.older_than.age, Some(Duration::from_secs(7_200)));
        assert_eq!(read.older_than.written, "2h");
        assert_eq!(read.id, ["a", "b"]);
        let empty = probe("text=+&after=&older_than=").unwrap();
        assert_eq!(
            (empty.text, empty.after, empty.checked),
            (None, None, false)
        );
        assert_eq!(empty.older_than, Age::default());
    }

    #[test]
    fn a_field_that_does_not_parse_says_how_to_write_it() {
        let wrong = probe("older_than=2+hours").unwrap_err();
        assert!(
            wrong.contains("90s, 30m, 24h or 7d, not \"2 hours\""),
            "{wrong}"
        );
        let wrong = probe("after=nothing").unwrap_err();
        assert!(wrong.contains("follow the page's links"), "{wrong}");
        assert_eq!(page_size(Some(0), 100), 1);
        assert_eq!(page_size(Some(9_999), 100), 500);
        assert_eq!(page_size(None, 50), 50);
    }
}

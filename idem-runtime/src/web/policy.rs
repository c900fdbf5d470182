//! Request policy of an idempotent endpoint: which key a request is claimed under, and
//! for which principal.

use http::HeaderMap;

use crate::key::{IdempotencyKey, KeyError, KeyOrigin};

/// A key as read from one source (absent, present, or malformed), and the source, which
/// a refusal names.
#[derive(Debug)]
pub struct KeyRead {
    origin: KeyOrigin,
    read: Result<Option<IdempotencyKey>, KeyError>,
}

impl KeyRead {
    /// The key of the `Idempotency-Key` header.
    pub(crate) fn idempotency_key(headers: &HeaderMap) -> Self {
        Self {
            origin: KeyOrigin::IDEMPOTENCY_KEY,
            read: IdempotencyKey::from_headers(headers),
        }
    }

    /// The key of another header (`key = header("..")`), by the same rules; of a header
    /// a signature covers (`signed`), as plain text
    /// ([`IdempotencyKey::from_signed_header`]).
    pub(crate) fn header(headers: &HeaderMap, name: &'static str, signed: bool) -> Self {
        Self {
            origin: KeyOrigin::Header(name.into()),
            read: if signed {
                IdempotencyKey::from_signed_header(headers, name)
            } else {
                IdempotencyKey::from_header(headers, name)
            },
        }
    }

    /// The key of a body field (`key = field`): plain text, see
    /// [`IdempotencyKey::from_text`]; `None` when the field is absent.
    pub(crate) fn field(text: Option<&str>) -> Self {
        Self {
            origin: KeyOrigin::Field,
            read: text.map(IdempotencyKey::from_text).transpose(),
        }
    }
}

impl KeyRead {
    /// The key of `key = digest(body)`; a body whose encoding failed has none (the
    /// same failure refuses its fingerprint).
    pub(crate) fn digest(digest: Option<&[u8; 32]>) -> Self {
        Self {
            origin: KeyOrigin::Digest,
            read: Ok(digest.map(IdempotencyKey::from_digest)),
        }
    }
}

/// A key refused with 400, and where it was read from.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct KeyRefused {
    pub(crate) origin: KeyOrigin,
    pub(crate) error: KeyError,
}

/// The key a request is claimed under.
///
/// The endpoint's own source (`key = field` or `key = header("..")`), when it has one,
/// decides alone: the `Idempotency-Key` header is then not consulted, so a client cannot
/// override a webhook's event id. Without a key, an endpoint that requires one refuses
/// the request ([`KeyError::Missing`], naming the source it expected); one with
/// `required = false` runs it unrecorded (`Ok(None)`).
pub(crate) fn key(
    own: Option<KeyRead>,
    header: KeyRead,
    required: bool,
) -> Result<Option<IdempotencyKey>, KeyRefused> {
    let KeyRead { origin, read } = own.unwrap_or(header);
    match read {
        Ok(None) if required => Err(KeyRefused {
            origin,
            error: KeyError::Missing,
        }),
        Ok(key) => Ok(key),
        Err(error) => Err(KeyRefused { origin, error }),
    }
}

/// The principal a key is claimed for: the handler's own `principal = Type` wins over
/// the store's resolver; with neither, the empty principal, which makes keys global to
/// their scope, unless the store requires a principal (`None`: refuse the request). An
/// empty principal is no principal: two tenants resolved to `""` would share keys.
///
/// A `signed` request (a webhook delivery) is named by what its signature covers and by
/// the endpoint's own code alone (ARCHITECTURE.md, invariant 8): the store's resolver reads
/// request data that nothing vouches for (a tenant header, an optional auth layer), and
/// a captured delivery sent again under another value of it would be another request
/// and act again. So the resolver is not asked, and a store that requires a principal
/// still serves it: its sender is the provider, which has no account with the service.
pub(crate) fn principal(
    own: Option<String>,
    resolved: Option<String>,
    required: bool,
    signed: bool,
) -> Option<String> {
    let non_empty = |p: Option<String>| p.filter(|p| !p.is_empty());
    let resolved = if signed { None } else { non_empty(resolved) };
    match non_empty(own).or(resolved) {
        None if required && !signed => None,
        principal => Some(principal.unwrap_or_default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(text: &str) -> KeyRead {
        read(IdempotencyKey::parse(text.as_bytes()).map(Some))
    }

    fn read(read: Result<Option<IdempotencyKey>, KeyError>) -> KeyRead {
        KeyRead {
            origin: KeyOrigin::IDEMPOTENCY_KEY,
            read,
        }
    }

    fn text(read: Result<Option<IdempotencyKey>, KeyRefused>) -> Result<Option<String>, KeyError> {
        read.map(|k| k.map(|k| k.as_str().to_owned()))
            .map_err(|refused| refused.error)
    }

    #[test]
    fn a_refusal_names_the_source_that_decided() {
        let event_id = KeyRead {
            origin: KeyOrigin::Header("X-Event-Id".into()),
            read: Ok(None),
        };
        assert_eq!(
            key(Some(event_id), k("hdr"), true),
            Err(KeyRefused {
                origin: KeyOrigin::Header("X-Event-Id".into()),
                error: KeyError::Missing
            })
        );
        assert_eq!(
            key(Some(KeyRead::field(Some(""))), k("hdr"), true),
            Err(KeyRefused {
                origin: KeyOrigin::Field,
                error: KeyError::Empty
            })
        );
    }

    #[test]
    fn the_endpoints_own_source_decides_alone() {
        assert_eq!(
            text(key(Some(k("evt_1")), k("hdr"), true)),
            Ok(Some("evt_1".into()))
        );
        // A malformed header does not matter when the key comes from elsewhere ...
        assert_eq!(
            text(key(Some(k("evt_1")), read(Err(KeyError::Repeated)), true)),
            Ok(Some("evt_1".into()))
        );
        // ... and an absent own key is not replaced by the header's.
        assert_eq!(
            text(key(Some(read(Ok(None))), k("hdr"), true)),
            Err(KeyError::Missing)
        );
        assert_eq!(text(key(Some(read(Ok(None))), k("hdr"), false)), Ok(None));
        assert_eq!(
            text(key(Some(read(Err(KeyError::Empty))), k("hdr"), true)),
            Err(KeyError::Empty)
        );
    }

    #[test]
    fn the_header_otherwise() {
        assert_eq!(text(key(None, k("hdr"), true)), Ok(Some("hdr".into())));
        assert_eq!(
            text(key(None, read(Ok(None)), true)),
            Err(KeyError::Missing)
        );
        assert_eq!(text(key(None, read(Ok(None)), false)), Ok(None));
        assert_eq!(
            text(key(None, read(Err(KeyError::Repeated)), false)),
            Err(KeyError::Repeated),
            "a malformed key is refused even where keys are optional"
        );
    }

    #[test]
    fn the_handlers_principal_wins() {
        assert_eq!(
            principal(Some("t1".into()), Some("acct".into()), false, false).as_deref(),
            Some("t1")
        );
        assert_eq!(
            principal(None, Some("acct".into()), true, false).as_deref(),
            Some("acct")
        );
        assert_eq!(principal(None, None, false, false).as_deref(), Some(""));
        assert_eq!(
            principal(None, None, true, false),
            None,
            "strict: no global keys"
        );
        // Regression (issue 19, 7): an empty principal passed strict mode and landed
        // among the global keys.
        let empty = || Some(String::new());
        assert_eq!(principal(empty(), None, true, false), None);
        assert_eq!(principal(None, empty(), true, false), None);
        assert_eq!(
            principal(empty(), empty(), false, false).as_deref(),
            Some("")
        );
        let acct = || Some("acct_1".to_owned());
        assert_eq!(
            principal(empty(), acct(), true, false),
            acct(),
            "an empty override defers"
        );
    }

    /// Regression (issue 27, 1): a captured signed delivery sent again with another
    /// tenant header took the resolver's principal and ran again under each value.
    #[test]
    fn a_signed_request_takes_no_principal_from_the_resolver() {
        let acct = || Some("acct_1".to_owned());
        assert_eq!(principal(None, acct(), false, true).as_deref(), Some(""));
        assert_eq!(
            principal(None, acct(), true, true).as_deref(),
            Some(""),
            "a store that requires principals still serves signed deliveries"
        );
        assert_eq!(principal(None, None, true, true).as_deref(), Some(""));
        assert_eq!(
            principal(Some("t1".into()), acct(), true, true).as_deref(),
            Some("t1"),
            "the endpoint's own principal is its code's"
        );
    }
}

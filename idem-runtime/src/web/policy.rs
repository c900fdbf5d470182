//! Request policy of an idempotent endpoint: which key a request is claimed under, and
//! for which principal.

use crate::key::{IdempotencyKey, KeyError};

/// A key as read from one source: absent, present, or malformed.
pub(crate) type KeyRead = Result<Option<IdempotencyKey>, KeyError>;

/// The key a request is claimed under.
///
/// The endpoint's own source (`key = field` or `key = header("..")`), when it has one,
/// decides alone: the `Idempotency-Key` header is then not consulted, so a client cannot
/// override a webhook's event id. Without a key, an endpoint that requires one refuses
/// the request ([`KeyError::Missing`]); one with `required = false` runs it unrecorded
/// (`Ok(None)`).
pub(crate) fn key(own: Option<KeyRead>, header: KeyRead, required: bool) -> KeyRead {
    match own.unwrap_or(header)? {
        None if required => Err(KeyError::Missing),
        key => Ok(key),
    }
}

/// The principal a key is claimed for: the handler's own `principal = Type` wins over
/// the store's resolver; with neither, the empty principal, which makes keys global to
/// their scope.
pub(crate) fn principal(own: Option<String>, resolved: Option<String>) -> String {
    own.or(resolved).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(text: &str) -> KeyRead {
        IdempotencyKey::parse(text.as_bytes()).map(Some)
    }

    fn text(read: KeyRead) -> Result<Option<String>, KeyError> {
        read.map(|k| k.map(|k| k.as_str().to_owned()))
    }

    #[test]
    fn the_endpoints_own_source_decides_alone() {
        assert_eq!(
            text(key(Some(k("evt_1")), k("hdr"), true)),
            Ok(Some("evt_1".into()))
        );
        // A malformed header does not matter when the key comes from elsewhere ...
        assert_eq!(
            text(key(Some(k("evt_1")), Err(KeyError::Repeated), true)),
            Ok(Some("evt_1".into()))
        );
        // ... and an absent own key is not replaced by the header's.
        assert_eq!(
            text(key(Some(Ok(None)), k("hdr"), true)),
            Err(KeyError::Missing)
        );
        assert_eq!(text(key(Some(Ok(None)), k("hdr"), false)), Ok(None));
        assert_eq!(
            text(key(Some(Err(KeyError::Empty)), k("hdr"), true)),
            Err(KeyError::Empty)
        );
    }

    #[test]
    fn the_header_otherwise() {
        assert_eq!(text(key(None, k("hdr"), true)), Ok(Some("hdr".into())));
        assert_eq!(text(key(None, Ok(None), true)), Err(KeyError::Missing));
        assert_eq!(text(key(None, Ok(None), false)), Ok(None));
        assert_eq!(
            text(key(None, Err(KeyError::Repeated), false)),
            Err(KeyError::Repeated),
            "a malformed key is refused even where keys are optional"
        );
    }

    #[test]
    fn the_handlers_principal_wins() {
        assert_eq!(principal(Some("t1".into()), Some("acct".into())), "t1");
        assert_eq!(principal(None, Some("acct".into())), "acct");
        assert_eq!(principal(None, None), "");
    }
}

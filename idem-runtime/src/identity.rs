//! A request's identity, and where its record is kept.
//!
//! A request is named by (scope, owner, key): its owner is a principal the service
//! authenticated, or nobody (a webhook delivery, a queue message). Each part comes from
//! the endpoint's code, from what the service authenticated, or from what a signature
//! covers (ARCHITECTURE.md, invariant 8).
//!
//! Where the record is kept is another matter: its *place*, (scope as stored,
//! principal column, key). A key with an owner is kept under its owner. A key without
//! one is kept under the nobody value, or under a value that spreads it over a
//! distributed engine's shards ([`crate::spread`]): a hash of the key, or the tenant the
//! event concerns. A spread value is derived from request data, and the principal column
//! is also where authenticated principals live: so a spread key is kept under a scope of
//! its own, `scope` and a mark no scope has ([`valid_scope`]), and no value derived from
//! request data can ever name the record of an authenticated principal, whatever it
//! spells.

use std::borrow::Cow;

use crate::key::IdempotencyKey;

/// Whether `scope` can name keys: it has no control character. The stored scope of a
/// spread key ends in one (U+001F and its kind, [`Place::mark`]), which no endpoint's
/// scope has (the attribute allows letters, digits and `_-.:/`) and which
/// [`Store::run_once`](crate::Store::run_once) refuses: no scope stored plainly equals a
/// spread one.
pub(crate) fn valid_scope(scope: &str) -> bool {
    !scope.chars().any(char::is_control)
}

/// Where a key's record is kept, by who owns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Place {
    /// Under its owner, a principal the service authenticated.
    Principal,
    /// A key without an owner, under the principal column's nobody value (`''`, the nil
    /// UUID, 0).
    Nobody,
    /// A key without an owner, under a hash of itself (`spread = key`, the portable
    /// mode's default).
    Hashed,
    /// A key without an owner, under the tenant its event concerns (`spread = tenant_fn`,
    /// `RunOnce::spread_by`).
    Tenant,
}

impl Place {
    /// The stored scope's suffix: none for the places that cannot be confused with an
    /// authenticated principal's (the nobody value is never one).
    fn mark(self) -> Option<&'static str> {
        match self {
            Self::Principal | Self::Nobody => None,
            Self::Hashed => Some(concat!('\u{1f}', "key")),
            Self::Tenant => Some(concat!('\u{1f}', "tenant")),
        }
    }
}

/// The scope `scope` is stored under in `place`.
pub(crate) fn stored_scope(scope: &str, place: Place) -> Cow<'_, str> {
    match place.mark() {
        None => Cow::Borrowed(scope),
        Some(mark) => Cow::Owned(format!("{scope}{mark}")),
    }
}

/// A key with who owns it and where it is kept.
#[derive(Debug, Clone)]
pub(crate) struct KeyInScope {
    /// The scope, as the endpoint names it.
    pub(crate) scope: Cow<'static, str>,
    /// The value the key is kept under in the principal column, in its canonical
    /// spelling (`PrincipalType::canonical`):
    /// its owner, or its spread.
    pub(crate) principal: String,
    pub(crate) key: IdempotencyKey,
    pub(crate) place: Place,
}

impl KeyInScope {
    /// The principal the key belongs to: `""` for a key without one, whatever value it
    /// is kept under. What identifies the request beyond idem's table
    /// ([`Tx::derived_key`](crate::Tx::derived_key)), so that moving a key (to a spread,
    /// across an upgrade) changes nothing a downstream service sees.
    pub(crate) fn owner(&self) -> &str {
        match self.place {
            Place::Principal => &self.principal,
            Place::Nobody | Place::Hashed | Place::Tenant => "",
        }
    }

    /// The scope as stored in this key's place.
    pub(crate) fn stored_scope(&self) -> Cow<'_, str> {
        stored_scope(&self.scope, self.place)
    }

    /// A key as a table stores it, read back: `stored_scope` with its place's mark,
    /// `principal` as the principal column's text, where `nobody` is that column's value
    /// for no principal (its type's).
    pub(crate) fn from_stored(
        stored_scope: &str,
        principal: &str,
        key: &str,
        nobody: &str,
    ) -> Self {
        let marked = [Place::Hashed, Place::Tenant]
            .into_iter()
            .find_map(|place| {
                let mark = place.mark()?;
                stored_scope.strip_suffix(mark).map(|scope| (scope, place))
            });
        let (scope, place, principal) = match marked {
            Some((scope, place)) => (scope, place, principal.to_owned()),
            None if principal == nobody => (stored_scope, Place::Nobody, String::new()),
            None => (stored_scope, Place::Principal, principal.to_owned()),
        };
        Self {
            scope: Cow::Owned(scope.to_owned()),
            principal,
            key: crate::key::IdempotencyKey::stored(key),
            place,
        }
    }

    /// The same key kept in another place.
    pub(crate) fn moved(&self, place: Place, principal: String) -> Self {
        Self {
            scope: self.scope.clone(),
            principal,
            key: self.key.clone(),
            place,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_key_is_stored_apart_from_every_principal() {
        assert_eq!(stored_scope("charges", Place::Principal), "charges");
        assert_eq!(stored_scope("charges", Place::Nobody), "charges");
        let hashed = stored_scope("charges", Place::Hashed);
        let tenant = stored_scope("charges", Place::Tenant);
        assert_ne!(hashed, tenant);
        for spread in [hashed, tenant] {
            assert!(spread.starts_with("charges"));
            assert!(!valid_scope(&spread));
        }
    }
}

//! Where a key without a principal is kept: its *spread*.
//!
//! idem's table is keyed, and on a distributed engine distributed, by `principal`. A key
//! without one (a webhook delivery, a queue message) is kept under the column's "nobody"
//! value (`''`, the nil UUID, 0): one value, so on Citus one shard on one worker for every
//! such key of a service, however many workers there are. An endpoint that opts in
//! (`#[idempotent(spread = ..)]`, [`RunOnce::spread_by`](crate::RunOnce::spread_by),
//! [`RunOnce::spread_by_key`](crate::RunOnce::spread_by_key)) keeps such keys under a
//! value that spreads instead:
//!
//! - the tenant the event concerns, when the handler can name it (the `account` of a
//!   payment event): the key then lives on that tenant's shard, beside the rows the
//!   handler writes for that tenant, so the request commits on one worker;
//! - else a hash of the key: keys spread evenly over the shards, and business rows
//!   written under [`Tx::principal`](crate::Tx::principal) land beside them.
//!
//! The spread value takes the principal's place in the lookup, (scope, spread, key). A
//! hash of the key is a function of the key, so keys stay global to their scope, as
//! without a spread. A tenant is part of the event: the same key under another tenant is
//! another record (so a redelivery whose payload names another tenant runs, where it
//! would otherwise be a 422); name the tenant only from what the sender signs. A request
//! that has a principal (the store's resolver, `principal = ..`) keeps it: it spreads
//! already. Without the option nothing changes: keys without a principal stay under the
//! "nobody" value, as they are stored by earlier versions.

use sha2::{Digest, Sha256};

use crate::table::PrincipalType;

/// How an endpoint spreads its keys without a principal.
#[doc(hidden)]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Spread {
    /// Not at all: the column's "nobody" value (the default, and the only behaviour
    /// before spreads existed).
    #[default]
    None,
    /// A hash of the key.
    Key,
    /// The tenant the event concerns; a hash of the key when it names none (`None`, or
    /// a value that is not of the principal column's type).
    Tenant(Option<String>),
}

impl Spread {
    /// The value a key without a principal is kept under: `""` (the "nobody" value) for
    /// [`Spread::None`].
    pub(crate) fn value(&self, principal_type: PrincipalType, key: &str) -> String {
        match self {
            Self::None => String::new(),
            Self::Tenant(Some(tenant)) if !tenant.is_empty() && principal_type.accepts(tenant) => {
                tenant.clone()
            }
            Self::Key | Self::Tenant(_) => hashed(principal_type, key),
        }
    }
}

/// A value of the principal column's type from a hash of `key`: 16 hex digits after `~`
/// for `text`, a UUID made of the hash's first 16 bytes, or a non-zero `bigint`.
fn hashed(principal_type: PrincipalType, key: &str) -> String {
    let digest = Sha256::new()
        .chain_update("idem.spread.v1")
        .chain_update((key.len() as u64).to_be_bytes())
        .chain_update(key.as_bytes())
        .finalize();
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    match principal_type {
        PrincipalType::Uuid => format!(
            "{}-{}-{}-{}-{}",
            &hex[..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..32]
        ),
        PrincipalType::Bigint => {
            let mut bytes = [0; 8];
            bytes.copy_from_slice(&digest[..8]);
            // Never 0, the "nobody" value; keeps the sign bit out for readability.
            ((u64::from_be_bytes(bytes) >> 1) | 1).to_string()
        }
        PrincipalType::Text => format!("~{}", &hex[..16]),
    }
}

/// What `spread = path` answers: the tenant a request's body concerns, if it names one.
/// Implemented for the return types a tenant function may have.
#[doc(hidden)]
pub trait IntoTenant {
    fn into_tenant(self) -> Option<String>;
}

impl IntoTenant for Option<String> {
    fn into_tenant(self) -> Option<String> {
        self
    }
}

impl IntoTenant for Option<&str> {
    fn into_tenant(self) -> Option<String> {
        self.map(str::to_owned)
    }
}

impl IntoTenant for String {
    fn into_tenant(self) -> Option<String> {
        Some(self)
    }
}

impl IntoTenant for &str {
    fn into_tenant(self) -> Option<String> {
        Some(self.to_owned())
    }
}

/// `spread = path` in generated code: the tenant `path` finds in the body.
#[doc(hidden)]
pub fn tenant_of(tenant: impl IntoTenant) -> Spread {
    Spread::Tenant(tenant.into_tenant())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_spread_keeps_the_nobody_value() {
        for t in [
            PrincipalType::Text,
            PrincipalType::Uuid,
            PrincipalType::Bigint,
        ] {
            assert_eq!(Spread::None.value(t, "evt_1"), "");
        }
    }

    #[test]
    fn a_hashed_spread_is_stable_of_the_column_type_and_spreads() {
        for t in [
            PrincipalType::Text,
            PrincipalType::Uuid,
            PrincipalType::Bigint,
        ] {
            let a = Spread::Key.value(t, "evt_1");
            assert_eq!(a, Spread::Key.value(t, "evt_1"), "a function of the key");
            assert_ne!(a, Spread::Key.value(t, "evt_2"));
            assert!(t.accepts(&a), "{a} is a {t:?}");
        }
        assert_eq!(Spread::Key.value(PrincipalType::Text, "k").len(), 17);
        // 1 000 keys take 1 000 values: nothing shares one value by construction.
        let values: std::collections::HashSet<String> = (0..1000)
            .map(|i| Spread::Key.value(PrincipalType::Text, &format!("evt_{i}")))
            .collect();
        assert_eq!(values.len(), 1000);
    }

    #[test]
    fn a_tenant_is_used_when_it_fits_the_column_else_the_key_hash() {
        let t = PrincipalType::Text;
        assert_eq!(
            Spread::Tenant(Some("acct_1".into())).value(t, "evt_1"),
            "acct_1"
        );
        let hashed = Spread::Key.value(t, "evt_1");
        assert_eq!(Spread::Tenant(None).value(t, "evt_1"), hashed);
        assert_eq!(
            Spread::Tenant(Some(String::new())).value(t, "evt_1"),
            hashed
        );
        let u = PrincipalType::Uuid;
        assert_eq!(
            Spread::Tenant(Some("not a uuid".into())).value(u, "evt_1"),
            Spread::Key.value(u, "evt_1")
        );
        assert_eq!(tenant_of(Some("a")), Spread::Tenant(Some("a".into())));
        assert_eq!(tenant_of(None::<String>), Spread::Tenant(None));
    }
}

//! Where a key without a principal is kept: its *spread*.
//!
//! idem's table is keyed, and on a distributed engine distributed, by `principal`. A key
//! without one (a webhook delivery, a queue message) needs a value in that column. Kept
//! under one value for all of them, the column's "nobody" value (`''`, the nil UUID, 0),
//! such keys would all live in one shard on one worker of a distributed engine, however
//! many workers there are. So:
//!
//! - an endpoint may name the tenant the event concerns (`#[idempotent(spread =
//!   account_of)]`, [`RunOnce::spread_by`](crate::jobs::RunOnce::spread_by)): the key then
//!   lives on that tenant's shard, beside the rows the handler writes for that tenant,
//!   and the request commits on one worker;
//! - otherwise, in the [portable mode](crate::StoreBuilder::portable) (the mode that
//!   runs on a distributed engine), the key is kept under a hash of itself: keys spread
//!   evenly over the shards, and business rows written under
//!   [`Tx::principal`](crate::Tx::principal) land beside them. No key shares one shard
//!   with every other by construction;
//! - outside the portable mode (one PostgreSQL node, where there are no shards), such
//!   keys keep the nobody value unless the endpoint asks for the hash
//!   (`spread = key`, [`RunOnce::spread_by_key`](crate::jobs::RunOnce::spread_by_key)).
//!
//! The spread value takes the principal's place in the lookup, (scope, spread, key). A
//! hash of the key is a function of the key, so keys stay global to their scope, as
//! without a spread. A tenant is part of the event: the same key under another tenant is
//! another record (so a redelivery whose payload names another tenant runs, where it
//! would otherwise be a 422); name the tenant only from what the sender signs. A request
//! that has a principal (the store's resolver, `principal = ..`) keeps it: it spreads
//! already.
//!
//! A spread value is request data, never an authenticated principal: a spread key is
//! stored under a scope of its own ([`crate::identity`]), so it never names a
//! principal's record.
//!
//! **Records kept elsewhere before.** A change of configuration (a spread added or
//! changed, the mode changed) moves where a key is kept. A claim first looks for the
//! key's live record in the places other configurations keep it ([`earlier_places`]),
//! for as long as its scope has live records there ([`Earlier`]): a retry after the
//! change replays the answer stored before it (or is a 422), never runs again. Once
//! those records have expired, the look-up stops, and a key costs what any key costs
//! (one indexed statement per scope and place a minute). What the look-up cannot see is
//! an instance of the earlier configuration at work during a rolling change: its attempt
//! in flight holds the key in the old place, so the primary key no longer arbitrates
//! between the two; and what it commits is unseen for up to a minute when the scope had
//! no live records there. Roll such changes out with no instance of the earlier
//! configuration still taking their requests.
//! [`Tx::derived_key`](crate::Tx::derived_key) derives from `""` for such keys wherever
//! they are kept, so a downstream call keeps its key across the move.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use sha2::{Digest, Sha256};

use crate::identity::{KeyInScope, Place};
use crate::table::{Dialect, PrincipalType, Table};

/// How an endpoint spreads its keys without a principal.
#[doc(hidden)]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Spread {
    /// The endpoint says nothing: a hash of the key in the portable mode, else the
    /// column's "nobody" value (the only behaviour before spreads existed).
    #[default]
    None,
    /// A hash of the key.
    Key,
    /// The tenant the event concerns; a hash of the key when it names none (`None`, or
    /// a value that is not of the principal column's type).
    Tenant(Option<String>),
}

impl Spread {
    /// Where a key without a principal is kept in `dialect`, and the value it is kept
    /// under: the nobody value (`""`) for [`Spread::None`] outside the portable mode; a
    /// tenant in its canonical spelling.
    pub(crate) fn place(&self, dialect: Dialect, key: &str) -> (Place, String) {
        let principal_type = dialect.principal_type;
        let tenant = match self {
            Self::None if !dialect.portable => return (Place::Nobody, String::new()),
            Self::Tenant(Some(tenant)) if !tenant.is_empty() => principal_type.canonical(tenant),
            Self::None | Self::Key | Self::Tenant(_) => None,
        };
        match tenant {
            Some(tenant) => (Place::Tenant, tenant),
            None => (Place::Hashed, hashed(principal_type, key)),
        }
    }
}

/// Where earlier configurations may have kept `key`'s record: every place it can be
/// found from the key alone, other than its own (ARCHITECTURE.md, invariant 9). A spread
/// added or changed (to a hash, to a tenant), or a mode changed (the portable mode
/// hashes where the others keep the nobody value), moves a key between these; a retry
/// of a request answered before the change finds its record there. A tenant cannot be
/// found from the key: a key that was kept under its tenant is not found once the
/// endpoint no longer names one (the guide's "Topologies", "Changing where keys are kept").
///
/// A key with an owner looks where keys without one are kept only when the store
/// requires a principal (`require_principal`): then a record there was written before
/// the resolver was added (or by a signed delivery, which no client can forge), and a
/// retry of it, authenticated now, is the same request. Without that, anonymous requests
/// still write there, and one could plant a record under a key a principal will use.
pub(crate) fn earlier_places(
    key: &KeyInScope,
    dialect: Dialect,
    require_principal: bool,
) -> Vec<KeyInScope> {
    let places: &[Place] = match key.place {
        Place::Principal if require_principal => &[Place::Nobody, Place::Hashed],
        Place::Principal => &[],
        Place::Nobody => &[Place::Hashed],
        Place::Hashed => &[Place::Nobody],
        Place::Tenant => &[Place::Nobody, Place::Hashed],
    };
    places
        .iter()
        .map(|&place| {
            let principal = match place {
                Place::Hashed => hashed(dialect.principal_type, key.key.as_str()),
                _ => String::new(),
            };
            key.moved(place, principal)
        })
        .collect()
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

/// How long a scope's answer to "are records kept under the nobody value still live?"
/// is trusted: what an instance of an earlier version commits there goes unseen for up
/// to this long (the module's "Records kept before the spread").
const EARLIER_RECHECK: Duration = Duration::from_secs(60);

/// How many scopes' answers are kept; past it they are all asked again (scopes named at
/// run time, such as `run_once` scopes built from data, must not grow the map forever).
const EARLIER_SCOPES: usize = 1024;

/// Whether keys kept under a spread value must also be looked up under the nobody value,
/// where earlier versions kept them (the module's "Records kept before the spread"), per
/// scope. Asked once a minute per scope ([`Table::earlier_live`]: one indexed statement);
/// between two asks the answer is kept.
#[derive(Default)]
pub(crate) struct Earlier {
    scopes: Mutex<HashMap<(String, Place), (Instant, bool)>>,
}

impl Earlier {
    /// Whether `place` of `scope` may still have a live record.
    ///
    /// A failed ask keeps a known "no" for another period: once a scope's records there
    /// are gone, that shard is no longer needed for its requests. A failed first ask
    /// answers `true` and is asked again next time: looking costs a statement, not
    /// looking could run a request twice.
    pub(crate) async fn live(
        &self,
        table: &Table,
        pool: &PgPool,
        scope: &str,
        place: Place,
    ) -> bool {
        let id = (scope.to_owned(), place);
        // A stale answer is marked asked at once and kept meanwhile, so that one request
        // asks again, not every request that arrives while it does.
        let known = match self.lock().get_mut(&id) {
            Some((asked, live)) if asked.elapsed() < EARLIER_RECHECK => return *live,
            Some((asked, live)) => {
                *asked = Instant::now();
                Some(*live)
            }
            None => None,
        };
        let live = match table.earlier_live(pool, scope, place).await {
            Ok(live) => live,
            Err(error) if known == Some(false) => {
                tracing::warn!(%error, scope, ?place, "idem: could not ask for records kept elsewhere before; there were none");
                false
            }
            Err(error) => {
                tracing::warn!(%error, scope, ?place, "idem: could not ask for records kept elsewhere before; looking");
                return true;
            }
        };
        let mut scopes = self.lock();
        if scopes.len() >= EARLIER_SCOPES && !scopes.contains_key(&id) {
            scopes.clear();
        }
        scopes.insert(id, (Instant::now(), live));
        live
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, Place), (Instant, bool)>> {
        self.scopes.lock().unwrap_or_else(PoisonError::into_inner)
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

    fn one_node(principal_type: PrincipalType) -> Dialect {
        Dialect {
            principal_type,
            ..Dialect::default()
        }
    }

    fn portable(principal_type: PrincipalType) -> Dialect {
        Dialect {
            portable: true,
            ..one_node(principal_type)
        }
    }

    #[test]
    fn no_spread_keeps_the_nobody_value_on_one_node_and_the_hash_when_portable() {
        for t in [
            PrincipalType::Text,
            PrincipalType::Uuid,
            PrincipalType::Bigint,
        ] {
            assert_eq!(Spread::None.place(one_node(t), "evt_1").1, "");
            assert_eq!(
                Spread::None.place(portable(t), "evt_1").1,
                Spread::Key.place(one_node(t), "evt_1").1
            );
        }
    }

    #[test]
    fn a_hashed_spread_is_stable_of_the_column_type_and_spreads() {
        for t in [
            PrincipalType::Text,
            PrincipalType::Uuid,
            PrincipalType::Bigint,
        ] {
            let a = Spread::Key.place(one_node(t), "evt_1").1;
            assert_eq!(
                a,
                Spread::Key.place(one_node(t), "evt_1").1,
                "a function of the key"
            );
            assert_ne!(a, Spread::Key.place(one_node(t), "evt_2").1);
            assert_eq!(t.canonical(&a).as_ref(), Some(&a), "{a} is a {t:?}");
        }
        assert_eq!(
            Spread::Key
                .place(one_node(PrincipalType::Text), "k")
                .1
                .len(),
            17
        );
        // 1 000 keys take 1 000 values: nothing shares one value by construction.
        let values: std::collections::HashSet<String> = (0..1000)
            .map(|i| {
                Spread::Key
                    .place(one_node(PrincipalType::Text), &format!("evt_{i}"))
                    .1
            })
            .collect();
        assert_eq!(values.len(), 1000);
    }

    /// A failed ask keeps a known "no" (the shard of the nobody value is not needed once
    /// its records are gone), and answers "look" when nothing is known.
    #[tokio::test]
    async fn a_failed_ask_keeps_a_known_no_and_otherwise_looks() {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .connect_lazy("postgres://127.0.0.1:1/none")
            .unwrap();
        let table = Table::new(
            &crate::table::TableName::default(),
            Dialect::default(),
            Duration::from_millis(200),
        );
        let earlier = Earlier::default();
        let long_ago = Instant::now() - EARLIER_RECHECK - Duration::from_secs(1);
        earlier
            .lock()
            .insert(("gone".into(), Place::Nobody), (long_ago, false));
        earlier
            .lock()
            .insert(("kept".into(), Place::Nobody), (long_ago, true));
        assert!(!earlier.live(&table, &pool, "gone", Place::Nobody).await);
        assert!(earlier.live(&table, &pool, "kept", Place::Nobody).await);
        assert!(earlier.live(&table, &pool, "unknown", Place::Nobody).await);
        // A stale answer counts as asked once asked: the next request does not ask again.
        assert!(earlier.lock()[&("gone".to_owned(), Place::Nobody)].0 > long_ago);
        assert!(earlier.lock()[&("kept".to_owned(), Place::Nobody)].0 > long_ago);
        assert!(!earlier
            .lock()
            .contains_key(&("unknown".to_owned(), Place::Nobody)));
    }

    #[test]
    fn a_tenant_is_used_when_it_fits_the_column_else_the_key_hash() {
        let t = PrincipalType::Text;
        assert_eq!(
            Spread::Tenant(Some("acct_1".into()))
                .place(one_node(t), "evt_1")
                .1,
            "acct_1"
        );
        let hashed = Spread::Key.place(one_node(t), "evt_1").1;
        assert_eq!(Spread::Tenant(None).place(one_node(t), "evt_1").1, hashed);
        assert_eq!(
            Spread::Tenant(Some(String::new()))
                .place(one_node(t), "evt_1")
                .1,
            hashed
        );
        let u = PrincipalType::Uuid;
        assert_eq!(
            Spread::Tenant(Some("not a uuid".into()))
                .place(one_node(u), "evt_1")
                .1,
            Spread::Key.place(one_node(u), "evt_1").1
        );
        assert_eq!(tenant_of(Some("a")), Spread::Tenant(Some("a".into())));
        assert_eq!(tenant_of(None::<String>), Spread::Tenant(None));
    }

    /// Regression (issue 27, 4): a tenant spelled two ways was kept, locked and hashed as
    /// two tenants.
    #[test]
    fn a_tenant_is_kept_in_its_canonical_spelling() {
        let u = PrincipalType::Uuid;
        let lower = "3f2504e0-4f89-41d3-9a0c-0305e82c3301";
        for spelling in [
            lower,
            "3F2504E0-4F89-41D3-9A0C-0305E82C3301",
            "{3f2504e0-4f89-41d3-9a0c-0305e82c3301}",
            "3f2504e04f8941d39a0c0305e82c3301",
        ] {
            assert_eq!(
                Spread::Tenant(Some(spelling.into())).place(one_node(u), "evt_1"),
                (Place::Tenant, lower.to_owned()),
                "{spelling}"
            );
        }
        assert_eq!(
            Spread::Tenant(Some("+007".into())).place(one_node(PrincipalType::Bigint), "k"),
            (Place::Tenant, "7".to_owned())
        );
    }

    /// Regression (issue 27, 2): a key moved by a change of spread or mode was looked
    /// for only under the nobody value.
    #[test]
    fn a_key_is_looked_for_wherever_another_configuration_kept_it() {
        let d = one_node(PrincipalType::Text);
        let key = |spread: Spread| {
            let (place, principal) = spread.place(d, "evt_1");
            KeyInScope {
                scope: "s".into(),
                principal,
                key: crate::key::IdempotencyKey::from_text("evt_1").unwrap(),
                place,
            }
        };
        let places = |k: &KeyInScope, strict| {
            earlier_places(k, d, strict)
                .into_iter()
                .map(|k| (k.place, k.principal))
                .collect::<Vec<_>>()
        };
        let hashed = (Place::Hashed, Spread::Key.place(d, "evt_1").1);
        let nobody = (Place::Nobody, String::new());
        let tenant = key(Spread::Tenant(Some("acct_1".into())));
        assert_eq!(places(&tenant, false), [nobody.clone(), hashed.clone()]);
        assert_eq!(
            places(&key(Spread::Key), false),
            std::slice::from_ref(&nobody)
        );
        assert_eq!(
            places(&key(Spread::None), false),
            std::slice::from_ref(&hashed)
        );
        let owned = tenant.moved(Place::Principal, "acct_1".into());
        assert!(
            places(&owned, false).is_empty(),
            "anonymous records could be planted"
        );
        assert_eq!(places(&owned, true), [nobody, hashed]);
    }
}

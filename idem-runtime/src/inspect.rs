//! Answering an operator's "did key K of principal P in scope S run, when, and with what
//! status?".

use std::borrow::Cow;
use std::time::SystemTime;

use http::StatusCode;

use crate::identity::{stored_scope, Place};
use crate::spread::Spread;
use crate::Store;

/// A committed idempotency record, as [`Store::inspect`](crate::Store::inspect) finds it. Requests still
/// in flight are invisible: their record commits with them, or never exists.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyRecord {
    /// When the request that ran committed its transaction's start time.
    pub created_at: SystemTime,
    /// When the record stops being replayed.
    pub expires_at: SystemTime,
    /// Whether `expires_at` has passed (a new request with this key runs afresh).
    pub expired: bool,
    /// The status of the stored response.
    pub status: StatusCode,
    /// The size of the stored response body.
    pub body_bytes: usize,
}

impl Store {
    /// The committed record of `key` (as the client meant it, without sf-string quotes)
    /// for `principal` in `scope`, if any.
    ///
    /// For a key without a principal pass `""`: the record is found where it is kept,
    /// under a hash of the key (a [portable](crate::StoreBuilder::portable) store's
    /// default, or `spread = key`) or under the nobody value (the other modes' default,
    /// and earlier versions'); a live record before an expired one. A key spread by a
    /// tenant (`spread = tenant_fn`, [`RunOnce::spread_by`](crate::jobs::RunOnce::spread_by))
    /// is kept under that tenant, apart from the tenant's own keys: pass the tenant as
    /// `principal`, and the principal's own record is found first, else the spread
    /// one's. A principal is found in any spelling the principal column's type takes
    /// (an upper-case UUID, say).
    pub async fn inspect(
        &self,
        scope: &str,
        principal: &str,
        key: &str,
    ) -> Result<Option<KeyRecord>, sqlx::Error> {
        let Some(places) = self.places(scope, principal, key) else {
            return Ok(None);
        };
        // The first live record, else the first expired one.
        let mut found = None;
        for (stored, place) in &places {
            let row = self
                .inner
                .table
                .inspect(&self.inner.pool, [stored, place, key])
                .await?;
            match row {
                Some(row) if !row.expired => {
                    found = Some(row);
                    break;
                }
                Some(row) if found.is_none() => found = Some(row),
                _ => {}
            }
        }
        let Some(row) = found else {
            return Ok(None);
        };
        let status = u16::try_from(row.status)
            .ok()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .ok_or_else(|| {
                sqlx::Error::Decode(
                    format!("stored status {} is not an HTTP status", row.status).into(),
                )
            })?;
        Ok(Some(KeyRecord {
            created_at: row.created_at,
            expires_at: row.expires_at,
            expired: row.expired,
            status,
            body_bytes: row.body_bytes,
        }))
    }

    /// Where the record of `key` for `principal` in `scope` may be kept, as (stored
    /// scope, principal column value), in the order [`Store::inspect`](crate::Store::inspect) looks (see its
    /// docs); `None` when `principal` is not of the principal column's type.
    pub(crate) fn places<'a>(
        &self,
        scope: &'a str,
        principal: &str,
        key: &str,
    ) -> Option<Vec<(Cow<'a, str>, String)>> {
        let dialect = self.inner.dialect;
        Some(if principal.is_empty() {
            let (_, hashed) = Spread::Key.place(dialect, key);
            let hashed = (stored_scope(scope, Place::Hashed), hashed);
            let nobody = (Cow::Borrowed(scope), String::new());
            if dialect.portable {
                vec![hashed, nobody]
            } else {
                vec![nobody, hashed]
            }
        } else {
            let principal = dialect.principal_type.canonical(principal)?;
            vec![
                (Cow::Borrowed(scope), principal.clone()),
                (stored_scope(scope, Place::Tenant), principal),
            ]
        })
    }
}

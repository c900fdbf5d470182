//! What an operator asks of idem's tables, answered without HTTP: one module of queries
//! that the command-line tool (`idem-cli`) and the console (`idem::console`, feature
//! `console`) both stand on.
//!
//! - keys: one key's record ([`Operate::key`]), a list by scope, principal or age
//!   ([`Operate::keys`]), counts per scope ([`Operate::key_counts`]), purging one key
//!   ([`Audited::purge_key`]); sweeping is [`Audited::purge_expired`]; the requests that
//!   recorded steps and have not committed ([`Operate::abandoned`]);
//! - the outbox: pending events per topic ([`Operate::outbox_pending`]), the events that
//!   are leased or backing off ([`Operate::outbox_leases`]), ordering keys held up behind
//!   an event ([`Operate::outbox_blocked`]), dead events grouped by reason
//!   ([`Operate::dead_reasons`]), listed ([`Operate::dead_events_in`]), re-driven
//!   ([`Audited::redrive_dead`], within the re-drive window;
//!   [`Audited::redrive_dead_forced`] past it) or discarded ([`Audited::discard_dead`]), by
//!   id, by reason or all ([`DeadSelection`]);
//! - the outbox's events found: pending ([`Operate::pending_events`]) and dead
//!   ([`Operate::dead_page`]) events by id, reason, topic, ordering key prefix or age
//!   ([`EventFilter`]), a [`Page`] at a time by keyset; a bulk action's dry run
//!   ([`Operate::dead_preview`]), whose [`DeadBound`] its confirmation acts within
//!   ([`Audited::redrive_confirmed`], [`Audited::discard_confirmed`]);
//! - what links a key to the events its request wrote ([`Operate::key_events`]) and an
//!   event to the request that wrote it ([`Operate::event_request`]);
//! - an event's last ten failed publishes ([`Operate::event_errors`]), and the relays
//!   holding their sessions, by host and process ([`Operate::outbox_relays`]);
//! - the audit trail: the same actions taken by an [`Operator`] ([`Operate::audited`]),
//!   each recorded in the audit table in its own transaction, and the trail read back,
//!   newest first ([`Operate::audit_log`]);
//! - with the `metrics` feature, what this process counted of its requests
//!   (`request_counts`).
//!
//! Every statement runs as the store's others do outside a request: on a connection of
//! its own (in a transaction of its own behind a transaction pooler, unnamed there), and
//! within what a distributed engine runs (no row locks, no session state). Response
//! bodies and event payloads are read only when asked for: they carry personal data.
//!

mod abandoned;
mod audit;
mod errors;
mod events;
mod keys;
mod links;
mod outbox;
mod relays;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::store::Store;

/// The operators' side of a store ([`Store::operate`](crate::Store::operate)): what the console and the
/// command-line tool read, and, as an [`Operator`] ([`Operate::audited`]), what they do.
/// Every action goes through [`Audited`], recorded in the audit table.
#[derive(Debug, Clone, Copy)]
pub struct Operate<'a> {
    store: &'a Store,
}

impl Store {
    /// The operators' queries of this store's tables, and their audited actions.
    pub fn operate(&self) -> Operate<'_> {
        Operate { store: self }
    }
}

impl<'a> Operate<'a> {
    /// The store it reads.
    pub fn store(&self) -> &'a Store {
        self.store
    }

    /// How long a request that recorded a step may go without committing before it
    /// counts as abandoned ([`StoreBuilder::abandoned_after`](crate::StoreBuilder::abandoned_after)).
    pub fn abandoned_after(self) -> Duration {
        self.store.inner.abandoned_after
    }

    /// The re-drive window ([`StoreBuilder::redrive_max_age`](crate::StoreBuilder::redrive_max_age)): a dead event written
    /// at least this long ago is re-driven only when forced.
    pub fn redrive_max_age(self) -> Duration {
        self.store.inner.redrive_max_age
    }
}

pub use crate::inspect::KeyRecord;
pub use abandoned::{
    Abandoned, AbandonedCursor, AbandonedFilter, AbandonedStep, CompletionStage, CompletionState,
};
pub use audit::{AuditEntry, Audited, Operator};
pub use errors::FailedPublish;
pub use events::{
    ConfirmError, Confirmed, DeadBound, DeadPreview, EventFilter, Page, PendingEvent,
};
pub use keys::{KeyCounts, KeyCursor, KeyDetail, KeyFilter, KeySummary, StepRecord};
pub use links::{KeyEvent, RequestKey};
pub use outbox::{
    BlockedKey, DeadDetail, DeadJson, DeadReason, DeadSelection, Lease, RedriveError, TopicPending,
};
pub use relays::RelaySession;

/// An instant PostgreSQL gave as seconds since the Unix epoch.
fn instant(epoch: f64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs_f64(epoch.max(0.0))
}

/// A duration PostgreSQL gave as seconds, negative ones as zero.
fn seconds(value: f64) -> Duration {
    Duration::from_secs_f64(value.max(0.0))
}

/// An age as operators write it: a whole number and a unit, `90s`, `30m`, `24h` or
/// `7d` (the units of `#[idempotent(ttl = ..)]`), up to a century; `None` for anything
/// else.
pub fn parse_age(text: &str) -> Option<Duration> {
    let text = text.trim();
    let unit = text.chars().last()?;
    let secs = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3_600,
        'd' => 86_400,
        _ => return None,
    };
    let number: u64 = text[..text.len() - 1].parse().ok()?;
    // PostgreSQL's intervals hold about 178 million years; a century is age enough.
    number
        .checked_mul(secs)
        .filter(|secs| *secs <= 100 * 366 * 86_400)
        .map(Duration::from_secs)
}

/// An age as [`parse_age`] reads it, to the second, its units from days down, the
/// empty ones left out: `1d`, `26h` as `1d 2h`, `90s` as `1m 30s`, zero as `0s`.
pub fn format_age(age: Duration) -> String {
    let mut left = age.as_secs();
    let mut parts = Vec::new();
    for (unit, secs) in [('d', 86_400), ('h', 3_600), ('m', 60), ('s', 1)] {
        if left >= secs {
            parts.push(format!("{}{unit}", left / secs));
            left %= secs;
        }
    }
    if parts.is_empty() {
        return "0s".to_owned();
    }
    parts.join(" ")
}

/// `time` in RFC 3339, UTC, to the second (`2026-11-25T10:08:50Z`), as the operators'
/// tools write instants.
pub fn format_time(time: SystemTime) -> String {
    let secs = time
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's `civil_from_days`.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60
    )
}

/// Serializes an instant as [`format_time`] writes it.
pub(crate) fn rfc3339<S: serde::Serializer>(time: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_time(*time))
}

/// Serializes bytes as text, invalid UTF-8 replaced.
pub(crate) fn lossy<S: serde::Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&String::from_utf8_lossy(bytes))
}

/// [`lossy`] of bytes that may be absent.
fn lossy_text<S: serde::Serializer>(bytes: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
    match bytes {
        Some(bytes) => lossy(bytes, s),
        None => s.serialize_none(),
    }
}

/// Serializes a duration as seconds.
fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1000.0).round() / 1000.0)
}

/// How many requests this process answered, per scope and [`Outcome`](crate::Outcome),
/// since it started: the figures behind `idem_requests_total` (feature `metrics`), kept
/// in the process as well, for the console's overview. Scopes are labelled as in the
/// metrics (the 65th and later scopes made at run time count as `other`). Sorted by
/// scope, then outcome.
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub fn request_counts() -> Vec<(String, crate::Outcome, u64)> {
    crate::observe::metrics::counted()
}

/// A list's cursor as text: a row's time in microseconds, then its stored scope,
/// principal and key in hex, dot-separated ([`KeyCursor`], [`AbandonedCursor`]).
fn write_cursor(
    f: &mut std::fmt::Formatter<'_>,
    at_us: i64,
    scope: &str,
    principal: &str,
    key: &str,
) -> std::fmt::Result {
    let hex = |text: &str| crate::fingerprint::hex(text.as_bytes());
    write!(f, "{at_us}.{}.{}.{}", hex(scope), hex(principal), hex(key))
}

/// [`write_cursor`]'s text read back; `Err` names `what` list it is not a cursor of.
fn read_cursor(text: &str, what: &str) -> Result<(i64, String, String, String), String> {
    let wrong = || format!("not a cursor of {what}: {text:?}");
    let unhex = |part: &str| -> Option<String> {
        if !part.len().is_multiple_of(2) {
            return None;
        }
        let bytes = (0..part.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(part.get(i..i + 2)?, 16).ok())
            .collect::<Option<Vec<u8>>>()?;
        String::from_utf8(bytes).ok()
    };
    let parts: Vec<&str> = text.split('.').collect();
    let [at, scope, principal, key] = parts[..] else {
        return Err(wrong());
    };
    Ok((
        at.parse().map_err(|_| wrong())?,
        unhex(scope).ok_or_else(wrong)?,
        unhex(principal).ok_or_else(wrong)?,
        unhex(key).ok_or_else(wrong)?,
    ))
}

/// The selected dead events, oldest first, after the `seq` $8 (NULL: from the first). $9
/// how many. `seq` pages them ([`Page::next`]).
pub(super) const DEAD_LIST: &str = "\
SELECT seq, id, topic, ordering_key, attempts, coalesce(last_error, '') AS last_error,
       extract(epoch FROM now() - dead_at)::float8 AS dead_for,
       extract(epoch FROM now() - created_at)::float8 AS age
  FROM {table}
 WHERE {selected} AND ($8::bigint IS NULL OR seq > $8)
 ORDER BY seq
 LIMIT $9";

/// A `bigint` count column as a `u64`.
pub(super) fn count(row: &PgRow, column: &str) -> Result<u64, sqlx::Error> {
    Ok(u64::try_from(row.try_get::<i64, _>(column)?).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_as_ttls_do() {
        assert_eq!(parse_age("90s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_age(" 30m"), Some(Duration::from_secs(1_800)));
        assert_eq!(parse_age("24h"), Some(Duration::from_secs(86_400)));
        assert_eq!(parse_age("7d"), Some(Duration::from_secs(604_800)));
        for wrong in [
            "",
            "h",
            "1.5h",
            "-1h",
            "10",
            "1w",
            "99999999999999999999d",
            "1000000000000d",
        ] {
            assert_eq!(parse_age(wrong), None, "{wrong}");
        }
    }

    #[test]
    fn ages_are_written_as_they_are_read() {
        assert_eq!(format_age(Duration::ZERO), "0s");
        assert_eq!(format_age(Duration::from_millis(999)), "0s");
        assert_eq!(format_age(Duration::from_secs(90)), "1m 30s");
        assert_eq!(format_age(Duration::from_secs(86_400)), "1d");
        assert_eq!(format_age(Duration::from_secs(93_784)), "1d 2h 3m 4s");
        assert_eq!(format_age(Duration::from_secs(7_200)), "2h");
        for text in ["90s", "30m", "24h", "7d"] {
            let age = parse_age(text).unwrap();
            let written = format_age(age);
            let read: u64 = written
                .split(' ')
                .map(|part| parse_age(part).unwrap().as_secs())
                .sum();
            assert_eq!(read, age.as_secs(), "{text} written as {written}");
        }
    }

    #[test]
    fn times_are_written_in_rfc_3339() {
        assert_eq!(format_time(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_795_860_530);
        assert_eq!(format_time(t), "2026-11-28T10:08:50Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(format_time(leap), "2000-02-29T00:00:00Z");
    }
}

//! The opt-in cache of committed answers ([`StoreBuilder::replay_cache`](crate::StoreBuilder::replay_cache)): a replay that
//! finds its key's answer here asks PostgreSQL nothing.
//!
//! A committed answer does not change: the key's row is written once, with its response,
//! in the transaction that commits the work. Only three things end it: its expiry, an
//! operator's purge, and a sweep of expired rows. So an answer may be replayed from memory
//! for a while, provided each entry is dropped
//!
//! - at its key's expiry, by this process's clock, counted from before the transaction
//!   that stored it began (the database counts from that transaction's start, later), for
//!   an answer this process committed;
//! - and in any case `max_stale` after it was kept: a purge on another instance, or the
//!   expiry of an answer this process only read, is honoured here within that bound. A
//!   purge through this store empties the cache at once.
//!
//! Only a matching fingerprint is answered from memory; another payload goes to the
//! database, which decides (422, or a fresh run after a purge). The cache holds at most
//! `max_bytes` of keys and answers, and drops the oldest entries first.
//!
//! [`StoreBuilder::replay_cache`](crate::StoreBuilder::replay_cache): crate::StoreBuilder::replay_cache

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::fingerprint::Fingerprint;
use crate::identity::{KeyInScope, Place};
use crate::table::Record;

/// What an entry costs beyond its bytes: the map's slot, the order's, the allocations.
const OVERHEAD: usize = 160;

/// A key's row, as the table tells it from others.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Slot {
    scope: Box<str>,
    principal: Box<str>,
    key: Box<str>,
    place: Place,
}

impl Slot {
    fn of(key: &KeyInScope) -> Self {
        Self {
            scope: key.scope.as_ref().into(),
            principal: key.principal.as_str().into(),
            key: key.key.as_str().into(),
            place: key.place,
        }
    }

    fn bytes(&self) -> usize {
        self.scope.len() + self.principal.len() + self.key.len()
    }
}

/// One committed answer, with what a retry's fingerprint must match.
struct Entry {
    record: Record,
    combined: Vec<u8>,
    parts: Vec<u8>,
    until: Instant,
    bytes: usize,
    /// Which insertion this is, so that the order's older mentions of its slot are
    /// skipped.
    serial: u64,
}

#[derive(Default)]
struct Entries {
    by_slot: HashMap<Slot, Entry>,
    /// Slots oldest first, each with the serial it was kept under.
    order: VecDeque<(Slot, u64)>,
    bytes: usize,
    serial: u64,
    /// How many times the entries were cleared ([`Answers::clear`]).
    cleared: u64,
}

/// Committed answers kept in memory (see the module's docs).
pub(crate) struct Answers {
    max_bytes: usize,
    max_stale: Duration,
    entries: Mutex<Entries>,
}

impl Answers {
    /// At most `max_bytes` of entries, each kept at most `max_stale`.
    pub(crate) fn new(max_bytes: usize, max_stale: Duration) -> Self {
        Self {
            max_bytes,
            max_stale,
            entries: Mutex::new(Entries::default()),
        }
    }

    /// The answer kept for `key`, if it is still fresh and `fingerprint` is a retry of the
    /// request that stored it.
    pub(crate) fn get(&self, key: &KeyInScope, fingerprint: &Fingerprint) -> Option<Record> {
        let slot = Slot::of(key);
        let mut entries = self.lock();
        let entry = entries.by_slot.get(&slot)?;
        if entry.until <= Instant::now() {
            let bytes = entry.bytes;
            entries.by_slot.remove(&slot);
            entries.bytes -= bytes;
            return None;
        }
        fingerprint
            .matches(&entry.combined, &entry.parts)
            .then(|| entry.record.clone())
    }

    /// Where the entries stand, for a later [`Answers::keep`]: read before the database
    /// is asked for what will be kept.
    pub(crate) fn generation(&self) -> u64 {
        self.lock().cleared
    }

    /// Keeps `record`, committed for `key` with `fingerprint`, until `until` (its key's
    /// expiry, when known) or `max_stale` from now, whichever comes first; unless the
    /// entries were cleared since `since` ([`Answers::generation`]): the record was read
    /// (or committed) before a purge, which may have deleted it since, and a replay from
    /// memory must not bring it back.
    pub(crate) fn keep(
        &self,
        key: &KeyInScope,
        combined: &[u8],
        parts: Vec<u8>,
        record: &Record,
        until: Option<Instant>,
        since: u64,
    ) {
        let stale = Instant::now() + self.max_stale;
        let until = until.map_or(stale, |until| until.min(stale));
        let slot = Slot::of(key);
        let bytes = OVERHEAD
            + 2 * slot.bytes()
            + record.body.len()
            + record.headers.len()
            + combined.len()
            + parts.len();
        let mut entries = self.lock();
        if entries.cleared != since {
            return;
        }
        if bytes > self.max_bytes {
            // Not kept; nor is what was kept for the key before (a purge elsewhere and a
            // new answer since): it must not be replayed in its place.
            if let Some(before) = entries.by_slot.remove(&slot) {
                entries.bytes -= before.bytes;
            }
            return;
        }
        entries.serial += 1;
        let serial = entries.serial;
        let entry = Entry {
            record: record.clone(),
            combined: combined.to_vec(),
            parts,
            until,
            bytes,
            serial,
        };
        if let Some(before) = entries.by_slot.insert(slot.clone(), entry) {
            entries.bytes -= before.bytes;
        }
        entries.bytes += bytes;
        entries.order.push_back((slot, serial));
        while entries.bytes > self.max_bytes {
            let Some((oldest, serial)) = entries.order.pop_front() else {
                break;
            };
            if entries
                .by_slot
                .get(&oldest)
                .is_some_and(|e| e.serial == serial)
            {
                let gone = entries.by_slot.remove(&oldest).map_or(0, |e| e.bytes);
                entries.bytes -= gone;
            }
        }
        // Mentions of slots kept again, or dropped when they went stale, stay in the order
        // until it is trimmed here: it never holds more than twice the entries.
        if entries.order.len() > 2 * entries.by_slot.len() + 64 {
            let Entries { by_slot, order, .. } = &mut *entries;
            order.retain(|(slot, serial)| by_slot.get(slot).is_some_and(|e| e.serial == *serial));
        }
    }

    /// Drops every entry: a purge through this store.
    pub(crate) fn clear(&self) {
        let mut entries = self.lock();
        *entries = Entries {
            cleared: entries.cleared + 1,
            ..Entries::default()
        };
    }

    /// The bytes held, as counted against `max_bytes`.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        // A panic while the lock was held left the entries consistent or half-updated;
        // either way they are only a cache: start afresh.
        match self.entries.lock() {
            Ok(entries) => entries,
            Err(poisoned) => {
                let mut entries = poisoned.into_inner();
                *entries = Entries::default();
                entries
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::IdempotencyKey;

    fn key(n: usize) -> KeyInScope {
        KeyInScope {
            scope: "charges".into(),
            principal: "acct_1".into(),
            key: IdempotencyKey::parse(format!("key-{n}").as_bytes()).unwrap(),
            place: Place::Principal,
        }
    }

    fn record(body: &str) -> Record {
        Record {
            status: 201,
            headers: b"content-type: application/json".to_vec(),
            body: body.as_bytes().to_vec().into(),
        }
    }

    fn fingerprint(amount: &str) -> Fingerprint {
        let mut builder = Fingerprint::builder("charges", "POST", "/charges", []);
        builder.field("amount", amount).unwrap();
        builder.finish()
    }

    #[test]
    fn an_answer_is_replayed_for_its_fingerprint_only() {
        let answers = Answers::new(1 << 20, Duration::from_secs(60));
        let mine = fingerprint("a");
        answers.keep(
            &key(1),
            mine.combined(),
            mine.parts(),
            &record("{}"),
            None,
            0,
        );
        assert_eq!(answers.get(&key(1), &mine), Some(record("{}")));
        assert_eq!(
            answers.get(&key(1), &fingerprint("b")),
            None,
            "another payload"
        );
        assert_eq!(answers.get(&key(2), &mine), None, "another key");
    }

    #[test]
    fn an_entry_ends_at_its_expiry_or_max_stale() {
        let answers = Answers::new(1 << 20, Duration::from_millis(50));
        let f = fingerprint("a");
        answers.keep(&key(1), f.combined(), f.parts(), &record("{}"), None, 0);
        let soon = Instant::now() + Duration::from_millis(10);
        answers.keep(
            &key(2),
            f.combined(),
            f.parts(),
            &record("{}"),
            Some(soon),
            0,
        );
        std::thread::sleep(Duration::from_millis(20));
        assert!(answers.get(&key(1), &f).is_some());
        assert_eq!(answers.get(&key(2), &f), None, "past its expiry");
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(answers.get(&key(1), &f), None, "past max_stale");
    }

    #[test]
    fn the_cache_holds_no_more_than_its_bytes() {
        let max = 64 * 1024;
        let answers = Answers::new(max, Duration::from_secs(60));
        let f = fingerprint("a");
        let body = "x".repeat(1000);
        for n in 0..10_000 {
            // Some keys kept again and again, most once.
            answers.keep(
                &key(n % 3_000),
                f.combined(),
                f.parts(),
                &record(&body),
                None,
                0,
            );
            assert!(
                answers.bytes() <= max,
                "{} bytes after {n}",
                answers.bytes()
            );
        }
        assert!(
            answers.get(&key(9_999 % 3_000), &f).is_some(),
            "the newest is kept"
        );
        assert_eq!(answers.get(&key(0), &f), None, "the oldest went first");
        let entries = answers.lock();
        assert!(entries.order.len() <= 2 * entries.by_slot.len() + 64);
        drop(entries);
        // An answer larger than the whole cache is not kept, and what was kept for its
        // key before goes with it.
        assert!(answers.get(&key(9_999 % 3_000), &f).is_some());
        answers.keep(
            &key(9_999 % 3_000),
            f.combined(),
            f.parts(),
            &record(&"y".repeat(max)),
            None,
            0,
        );
        assert_eq!(answers.get(&key(9_999 % 3_000), &f), None);
        answers.clear();
        assert_eq!(answers.bytes(), 0);
    }

    /// Issue 48: a replay that read a record just before a purge through the same store
    /// put the purged answer back into memory, for `max_stale`.
    #[test]
    fn a_record_read_before_a_purge_is_not_kept_after_it() {
        let answers = Answers::new(1 << 20, Duration::from_secs(60));
        let f = fingerprint("a");
        let since = answers.generation();
        // The replay reads the row; the purge deletes it and clears; the replay keeps.
        answers.clear();
        answers.keep(&key(1), f.combined(), f.parts(), &record("{}"), None, since);
        assert_eq!(
            answers.get(&key(1), &f),
            None,
            "the purged answer stays gone"
        );
        answers.keep(
            &key(1),
            f.combined(),
            f.parts(),
            &record("{}"),
            None,
            answers.generation(),
        );
        assert!(
            answers.get(&key(1), &f).is_some(),
            "read after the purge: kept"
        );
    }
}

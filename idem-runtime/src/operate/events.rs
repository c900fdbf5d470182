//! The outbox's events found and acted on safely: a filter (ids, reason, topic, ordering
//! key prefix, age), lists of the pending and the dead events a page at a time by keyset
//! (`seq`, never an offset), and the dry run of a bulk action on dead events
//! ([`Operate::dead_preview`](crate::operate::Operate::dead_preview)) whose [`DeadBound`] the confirmation acts within
//! ([`Audited::redrive_confirmed`], [`Audited::discard_confirmed`]): the events the
//! preview counted, not whatever matches the filter by then.
//!
//! [`Audited::redrive_confirmed`]: super::Audited::redrive_confirmed
//! [`Audited::discard_confirmed`]: super::Audited::discard_confirmed

use super::Operate;
use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{Postgres, Row};

use super::{count, format_age, format_time, seconds, secs, DeadSelection, DEAD_LIST};
use crate::outbox::DeadEvent;

/// The pending events, oldest first, after the `seq` $8 (NULL: from the first), $9 how
/// many; filtered as [`super::outbox::MATCHES`] says, its bound NULL. Through the pending
/// rows' index on `seq`: a page reads its rows, not the ones before it.
const PENDING_LIST: &str = "\
SELECT seq, id, topic, ordering_key, attempts, last_error, lease_owner,
       extract(epoch FROM now() - created_at)::float8 AS age,
       extract(epoch FROM available_at - now())::float8 AS held_for
  FROM {table}
 WHERE {pending} AND ($8::bigint IS NULL OR seq > $8)
 ORDER BY seq
 LIMIT $9";

/// What a bulk action on the filtered dead events would touch, in one snapshot: how many,
/// the highest `seq`, the instant (microseconds since the epoch, exact), and how many
/// were written before the re-drive window ($8, seconds).
const PREVIEW: &str = "\
SELECT count(*)::bigint AS events, max(seq) AS through,
       (extract(epoch FROM now()) * 1000000)::bigint AS as_of,
       coalesce(sum(CASE WHEN created_at <= now() - $8::float8 * interval '1 second'
                         THEN 1 ELSE 0 END), 0)::bigint AS outside
  FROM {table}
 WHERE {selected}";

/// Which outbox events an operator looks at or acts on: every field narrows, the default
/// names them all. The console's dead and pending lists filter with it, and a bulk
/// action on dead events acts on what it names within a [`DeadBound`].
///
/// ```
/// use std::time::Duration;
/// use idem::operate::EventFilter;
///
/// let mut filter = EventFilter::default();
/// filter.topic = Some("charge.created".into());
/// filter.ordering_key = Some("acct_1".into());
/// filter.older_than = Some(Duration::from_secs(3_600));
/// assert_eq!(
///     filter.to_string(),
///     r#"topic "charge.created", ordering key "acct_1"*, older than 1h"#
/// );
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EventFilter {
    /// Only the events with these ids.
    pub ids: Option<Vec<String>>,
    /// Only those whose last error is exactly this: a dead event's reason
    /// ([`DeadReason::reason`](super::DeadReason::reason)).
    pub reason: Option<String>,
    /// Only those of this topic.
    pub topic: Option<String>,
    /// Only those whose ordering key starts with this (a whole key is its own prefix:
    /// `acct_1` also names `acct_10`'s events).
    pub ordering_key: Option<String>,
    /// Only those written at least this long ago.
    pub older_than: Option<Duration>,
}

impl EventFilter {
    /// Binds $1 to $7 of [`super::outbox::MATCHES`]: this filter, within `bound` if any.
    pub(super) fn bind(
        &self,
        query: Query<'static, Postgres, PgArguments>,
        bound: Option<&DeadBound>,
    ) -> Query<'static, Postgres, PgArguments> {
        query
            .bind(self.ids.clone())
            .bind(self.reason.clone())
            .bind(self.topic.clone())
            .bind(self.ordering_key.clone())
            .bind(self.older_than.map(|d| d.as_secs_f64()))
            .bind(bound.map(|b| b.through))
            .bind(bound.map(|b| b.as_of))
    }

    /// Whether it names every event.
    pub fn is_all(&self) -> bool {
        *self == Self::default()
    }
}

impl From<&DeadSelection> for EventFilter {
    fn from(selection: &DeadSelection) -> Self {
        let mut filter = Self::default();
        match selection {
            DeadSelection::Ids(ids) => filter.ids = Some(ids.clone()),
            DeadSelection::Reason(reason) => filter.reason = Some(reason.clone()),
            DeadSelection::All => {}
        }
        filter
    }
}

impl fmt::Display for EventFilter {
    /// As the audit trail and the logs write it: `all`, or its criteria, comma-separated:
    /// `ids a,b`, `reason "..."`, `topic "..."`, `ordering key "..."*` (a prefix),
    /// `older than 1h`. A selection by ids or by reason alone reads as
    /// [`DeadSelection`]'s.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(ids) = &self.ids {
            parts.push(format!("ids {}", ids.join(",")));
        }
        if let Some(reason) = &self.reason {
            parts.push(format!("reason {reason:?}"));
        }
        if let Some(topic) = &self.topic {
            parts.push(format!("topic {topic:?}"));
        }
        if let Some(prefix) = &self.ordering_key {
            parts.push(format!("ordering key {prefix:?}*"));
        }
        if let Some(age) = self.older_than {
            parts.push(format!("older than {}", format_age(age)));
        }
        if parts.is_empty() {
            return f.write_str("all");
        }
        f.write_str(&parts.join(", "))
    }
}

/// The dead events a preview counted ([`Operate::dead_preview`](crate::operate::Operate::dead_preview)): those of its filter no
/// later in the outbox than the highest `seq` it saw and parked no later than the instant
/// it was taken (by the database's clock), with how many they were. Ages in the filter
/// count from that instant too, so that no event comes of age between the preview and
/// the confirmation. A confirmation acts within it: an event parked after the preview
/// matches the filter but not the bound, and is left as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadBound {
    /// The highest `seq` among them.
    through: i64,
    /// When the preview was taken, in microseconds since the epoch, exactly.
    as_of: i64,
    /// How many they were.
    events: u64,
}

impl DeadBound {
    /// The bound of `events` dead events, the highest `seq` among them `through`, counted
    /// at `as_of` (microseconds since the epoch, as the database gave it): for a bound
    /// that travelled through a form or a file. A bound made up matches what it says, no
    /// more: it never widens the filter.
    pub fn new(through: i64, as_of: i64, events: u64) -> Self {
        Self {
            through,
            as_of,
            events,
        }
    }

    /// The highest `seq` the preview saw.
    pub fn through(&self) -> i64 {
        self.through
    }

    /// When the preview was taken, in microseconds since the epoch.
    pub fn as_of(&self) -> i64 {
        self.as_of
    }

    /// When the preview was taken.
    pub fn taken_at(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_micros(u64::try_from(self.as_of).unwrap_or(0))
    }

    /// How many events the preview counted.
    pub fn events(&self) -> u64 {
        self.events
    }
}

impl fmt::Display for DeadBound {
    /// As the audit trail writes it: `seq <= 41, parked by 2026-11-28T10:08:50Z, 12
    /// previewed`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "seq <= {}, parked by {}, {} previewed",
            self.through,
            format_time(self.taken_at()),
            self.events
        )
    }
}

/// The dry run of a bulk action on dead events ([`Operate::dead_preview`](crate::operate::Operate::dead_preview)).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DeadPreview {
    /// How many dead events the filter names.
    pub events: u64,
    /// How many of them were written before the re-drive window
    /// ([`Operate::redrive_max_age`](crate::operate::Operate::redrive_max_age)): a re-drive of them is forced or refused.
    pub outside_window: u64,
    /// The first of them, oldest first.
    pub first: Vec<DeadEvent>,
    /// What a confirmation acts within; `None` when nothing matched.
    pub bound: Option<DeadBound>,
}

/// What a confirmed bulk action on dead events did ([`Audited::redrive_confirmed`],
/// [`Audited::discard_confirmed`]).
///
/// [`Audited::redrive_confirmed`]: super::Audited::redrive_confirmed
/// [`Audited::discard_confirmed`]: super::Audited::discard_confirmed
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Confirmed {
    /// How many events it re-drove or discarded.
    pub moved: u64,
    /// How many the preview counted ([`DeadBound::events`]): more than `moved` when some
    /// were re-driven, discarded or published in between.
    pub previewed: u64,
    /// How many dead events the filter names after the action: those parked after the
    /// preview, which the bound left as they are.
    pub left: u64,
}

/// Why a confirmed bulk action on dead events did nothing.
#[derive(Debug)]
#[non_exhaustive]
pub enum ConfirmError {
    /// The bound holds more dead events than the preview counted: one was parked by a
    /// transaction that began before the preview and committed after it. Nothing was
    /// done; preview again.
    Changed {
        /// How many the bound holds now.
        bounded: u64,
        /// How many the preview counted.
        previewed: u64,
    },
    /// A re-drive that was not forced: some of the events are outside the re-drive
    /// window by now ([`RedriveError::OutsideWindow`](super::RedriveError::OutsideWindow)
    /// says what that means). Nothing was re-driven.
    OutsideWindow {
        /// How many events the bound holds.
        selected: u64,
        /// How many of them are outside the window.
        outside: u64,
        /// The age of the oldest of them, since it was written.
        oldest: Duration,
        /// The window: [`Operate::redrive_max_age`](crate::operate::Operate::redrive_max_age).
        max_age: Duration,
    },
    /// The database failed; nothing was done.
    Database(sqlx::Error),
}

impl fmt::Display for ConfirmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Changed { bounded, previewed } => write!(
                f,
                "{bounded} dead event(s) are within the preview's bound now, not the \
                 {previewed} it counted; nothing was done: preview again"
            ),
            Self::OutsideWindow {
                selected,
                outside,
                oldest,
                max_age,
            } => write!(
                f,
                "{outside} of the {selected} confirmed dead event(s) were written more than \
                 the re-drive window ({}) ago, the oldest {} ago; nothing was re-driven",
                format_age(*max_age),
                format_age(*oldest),
            ),
            Self::Database(e) => write!(f, "the dead events could not be changed: {e}"),
        }
    }
}

impl std::error::Error for ConfirmError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Database(e) => Some(e),
            Self::Changed { .. } | Self::OutsideWindow { .. } => None,
        }
    }
}

impl From<sqlx::Error> for ConfirmError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}

/// A pending event ([`Operate::pending_events`](crate::operate::Operate::pending_events)).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PendingEvent {
    /// The event's id.
    pub id: String,
    /// Its topic.
    pub topic: String,
    /// Its ordering key.
    pub ordering_key: Option<String>,
    /// How many times a relay took it.
    pub attempts: i32,
    /// Its last failure, while it backs off or is tried again.
    pub last_error: Option<String>,
    /// The owner number of the relay whose lease holds it ([`Lease::owner`]).
    ///
    /// [`Lease::owner`]: super::Lease::owner
    pub owner: Option<i32>,
    /// How long ago it was written.
    #[serde(rename = "age_secs", serialize_with = "secs")]
    pub age: Duration,
    /// How long until a relay may take it (a lease, or a backoff after a failure); `None`
    /// when it may be taken now.
    #[serde(rename = "held_for_secs", serialize_with = "held")]
    pub held_for: Option<Duration>,
}

fn held<S: serde::Serializer>(held: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match held {
        Some(d) => secs(d, s),
        None => s.serialize_none(),
    }
}

/// One page of a list read by keyset: its rows, and the cursor the next page starts
/// after (`None`: this is the last page). The cursor is a position in the list's order,
/// not a count, so a row written or deleted meanwhile neither repeats nor skips a row.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Page<T, C> {
    /// The rows of this page.
    pub rows: Vec<T>,
    /// Where the next page starts, if there is one.
    pub next: Option<C>,
}

impl<T, C> Page<T, C> {
    /// `rows` read with one more than `limit` asked for: the page of the first `limit`,
    /// with the cursor of its last row when the extra row was there.
    pub(super) fn of(mut rows: Vec<(T, C)>, limit: u32) -> Self {
        let more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        let mut next = None;
        let rows = rows
            .into_iter()
            .map(|(row, cursor)| {
                next = Some(cursor);
                row
            })
            .collect();
        Self {
            rows,
            next: if more { next } else { None },
        }
    }
}

impl Operate<'_> {
    /// The dead events `filter` names, oldest first, `limit` of them after the event
    /// whose `seq` is `after` (`None`: from the first). The page's [`Page::next`] is the
    /// next page's `after`.
    pub async fn dead_page(
        self,
        filter: &EventFilter,
        after: Option<i64>,
        limit: u32,
    ) -> Result<Page<DeadEvent, i64>, sqlx::Error> {
        let limit = limit.max(1);
        let rows = self
            .outbox_rows(DEAD_LIST, |q| {
                filter.bind(q, None).bind(after).bind(i64::from(limit) + 1)
            })
            .await?;
        let rows = rows
            .iter()
            .map(|row| Ok((DeadEvent::from_row(row)?, row.try_get::<i64, _>("seq")?)))
            .collect::<Result<_, sqlx::Error>>()?;
        Ok(Page::of(rows, limit))
    }

    /// The pending events `filter` names (its `ids` and `reason` too: a pending event's
    /// last error is that of its last failed attempt), oldest first, `limit` of them
    /// after the event whose `seq` is `after` (`None`: from the first).
    pub async fn pending_events(
        self,
        filter: &EventFilter,
        after: Option<i64>,
        limit: u32,
    ) -> Result<Page<PendingEvent, i64>, sqlx::Error> {
        let limit = limit.max(1);
        let rows = self
            .outbox_rows(PENDING_LIST, |q| {
                filter.bind(q, None).bind(after).bind(i64::from(limit) + 1)
            })
            .await?;
        let rows = rows
            .iter()
            .map(|row| Ok((pending(row)?, row.try_get::<i64, _>("seq")?)))
            .collect::<Result<_, sqlx::Error>>()?;
        Ok(Page::of(rows, limit))
    }

    /// The dry run of a bulk action on the dead events `filter` names: how many, how many
    /// are outside the re-drive window, the first `rows` of them, and the bound a
    /// confirmation acts within, so that it acts on these and not on events parked
    /// after ([`Audited::redrive_confirmed`], [`Audited::discard_confirmed`]).
    ///
    /// ```no_run
    /// # async fn f(store: idem::Store) -> Result<(), Box<dyn std::error::Error>> {
    /// use idem::operate::{EventFilter, Operator};
    ///
    /// let mut filter = EventFilter::default();
    /// filter.reason = Some("no stream captures the subject".into());
    /// let preview = store.operate().dead_preview(&filter, 20).await?;
    /// println!("{} events, the first: {:?}", preview.events, preview.first);
    /// if let Some(bound) = preview.bound {
    ///     // ... once the operator said yes:
    ///     let ops = store.operate().audited(Operator::new("ana@example.com", "support-tool"));
    ///     let done = ops.redrive_confirmed(&filter, &bound, false).await?;
    ///     println!("re-drove {}, {} parked since", done.moved, done.left);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// [`Audited::redrive_confirmed`]: super::Audited::redrive_confirmed
    /// [`Audited::discard_confirmed`]: super::Audited::discard_confirmed
    pub async fn dead_preview(
        self,
        filter: &EventFilter,
        rows: u32,
    ) -> Result<DeadPreview, sqlx::Error> {
        let max_age = self.store.inner.redrive_max_age.as_secs_f64();
        let found = self
            .outbox_rows(PREVIEW, |q| filter.bind(q, None).bind(max_age))
            .await?;
        // An aggregate without GROUP BY: one row.
        let Some(row) = found.first() else {
            return Ok(DeadPreview {
                events: 0,
                outside_window: 0,
                first: Vec::new(),
                bound: None,
            });
        };
        let events = count(row, "events")?;
        let through: Option<i64> = row.try_get("through")?;
        let as_of: i64 = row.try_get("as_of")?;
        let outside_window = count(row, "outside")?;
        let Some(through) = through else {
            return Ok(DeadPreview {
                events,
                outside_window,
                first: Vec::new(),
                bound: None,
            });
        };
        let bound = DeadBound::new(through, as_of, events);
        let listed = self
            .outbox_rows(DEAD_LIST, |q| {
                filter
                    .bind(q, Some(&bound))
                    .bind(None::<i64>)
                    .bind(i64::from(rows))
            })
            .await?;
        Ok(DeadPreview {
            events,
            outside_window,
            first: listed
                .iter()
                .map(DeadEvent::from_row)
                .collect::<Result<_, _>>()?,
            bound: Some(bound),
        })
    }
}

fn pending(row: &PgRow) -> Result<PendingEvent, sqlx::Error> {
    let held_for: f64 = row.try_get("held_for")?;
    Ok(PendingEvent {
        id: row.try_get("id")?,
        topic: row.try_get("topic")?,
        ordering_key: row.try_get("ordering_key")?,
        attempts: row.try_get("attempts")?,
        last_error: row.try_get("last_error")?,
        owner: row.try_get("lease_owner")?,
        age: seconds(row.try_get("age")?),
        held_for: (held_for > 0.0).then(|| seconds(held_for)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_reads_as_the_selection_it_extends() {
        for selection in [
            DeadSelection::All,
            DeadSelection::Reason("broker said \"no\"".into()),
            DeadSelection::Ids(vec!["a".into(), "b".into()]),
        ] {
            assert_eq!(
                EventFilter::from(&selection).to_string(),
                selection.to_string()
            );
        }
        assert!(EventFilter::from(&DeadSelection::All).is_all());
    }

    #[test]
    fn a_bound_names_its_seq_instant_and_count() {
        let bound = DeadBound::new(41, 1_795_860_530_123_456, 12);
        assert_eq!(
            bound.to_string(),
            "seq <= 41, parked by 2026-11-28T10:08:50Z, 12 previewed"
        );
    }

    #[test]
    fn a_page_keeps_the_cursor_only_when_more_rows_follow() {
        let full = Page::of(vec![("a", 1), ("b", 2), ("c", 3)], 2);
        assert_eq!((full.rows, full.next), (vec!["a", "b"], Some(2)));
        let last = Page::of(vec![("a", 1), ("b", 2)], 2);
        assert_eq!((last.rows, last.next), (vec!["a", "b"], None));
    }
}

//! The outbox's relays as the console shows them: the host and process behind each lease
//! owner's number, read from the relays' session names ([`Operate::outbox_relays`](crate::operate::Operate::outbox_relays)), and
//! the per-minute figures of the relays in this process ([`Console::relay_stats`]), from
//! samples of their counters that the console takes.
//!
//! [`Operate::outbox_relays`](crate::operate::Operate::outbox_relays): crate::operate::Operate::outbox_relays
//! [`Console::relay_stats`]: super::Console::relay_stats

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use maud::{html, Markup};

use crate::operate::{format_time, RelaySession};
use crate::outbox::RelayStats;

/// How far back a per-minute figure looks.
const MINUTE: Duration = Duration::from_secs(60);

/// At most this many samples are kept, however often the pages are viewed.
const MOST: usize = 1_000;

/// A relay session's host and process id, from its name `idem relay <host> pid <pid>`;
/// `None` for a name the relay's options replaced (or that PostgreSQL cut at 63 bytes
/// before the pid).
pub(crate) fn host_and_pid(name: &str) -> Option<(&str, &str)> {
    let (host, pid) = name.strip_prefix("idem relay ")?.rsplit_once(" pid ")?;
    let pid_ok = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
    (!host.is_empty() && pid_ok).then_some((host, pid))
}

/// The relay whose owner number is `owner`, as a reader tells it apart: its host and
/// process (the number, session name, address and start in the `title`), else its
/// session's name, else the bare number with why no more is known.
pub(crate) fn owner(owner: i64, relays: &[RelaySession]) -> Markup {
    let Some(relay) = relays.iter().find(|r| r.owner == owner) else {
        return html! {
            "relay " (owner) " "
            span.muted title="No session holds this relay's lock now: it ended (its leases are over), or this database role cannot see it." {
                "(session not found)"
            }
        };
    };
    let title = format!(
        "relay {owner}: session \"{}\"{}, connected {}",
        relay.name,
        relay
            .client_addr
            .as_deref()
            .map(|a| format!(" from {a}"))
            .unwrap_or_default(),
        relay
            .since
            .map_or_else(|| "at a time this role may not see".to_owned(), format_time)
    );
    html! {
        span.relay title=(title) {
            @if let Some((host, pid)) = host_and_pid(&relay.name) {
                code { (host) } " pid " code { (pid) }
            } @else {
                code { (relay.name) }
            }
        }
    }
}

/// The relays of this process, as the service handed them to the console: a function
/// that reads their counters, and the samples taken of it.
pub(crate) struct Counters {
    read: Box<dyn Fn() -> RelayStats + Send + Sync>,
    samples: Mutex<VecDeque<(SystemTime, RelayStats)>>,
}

impl Counters {
    pub(crate) fn new(read: Box<dyn Fn() -> RelayStats + Send + Sync>) -> Self {
        Self {
            read,
            samples: Mutex::new(VecDeque::new()),
        }
    }

    /// Reads the counters now and keeps them as a sample.
    pub(crate) fn sample(&self) {
        let stats = (self.read)();
        let mut samples = self
            .samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        keep(&mut samples, SystemTime::now(), stats);
    }

    /// What the relays did lately, from the samples (after taking one now).
    pub(crate) fn rates(&self) -> Option<Rates> {
        self.sample();
        let samples = self
            .samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        rates(&samples)
    }
}

/// Keeps `stats` as the sample of `at`, and drops the samples a per-minute figure no
/// longer needs: all but the newest that is a minute old or more.
fn keep(samples: &mut VecDeque<(SystemTime, RelayStats)>, at: SystemTime, stats: RelayStats) {
    samples.push_back((at, stats));
    let old = |s: &(SystemTime, RelayStats)| at.duration_since(s.0).unwrap_or_default() >= MINUTE;
    while samples.len() > MOST || (samples.len() > 2 && samples.get(1).is_some_and(old)) {
        samples.pop_front();
    }
}

/// What this process's relays did: over `over` (a minute, a little more, or less when the
/// console is younger than a minute), and in all since they started.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rates {
    pub(crate) over: Duration,
    pub(crate) published: u64,
    pub(crate) retried: u64,
    pub(crate) parked: u64,
    pub(crate) total: RelayStats,
}

impl Rates {
    /// `n` over this window as a reader compares it: per minute when the window is a
    /// minute or more (one decimal), else the count itself.
    fn figure(&self, n: u64) -> String {
        if self.over < MINUTE {
            return n.to_string();
        }
        let per_minute = n as f64 * 60.0 / self.over.as_secs_f64();
        let rounded = (per_minute * 10.0).round() / 10.0;
        rounded.to_string()
    }
}

/// The counts between the newest sample and the newest one at least a minute older (else
/// the oldest); `None` without samples.
fn rates(samples: &VecDeque<(SystemTime, RelayStats)>) -> Option<Rates> {
    let &(now, last) = samples.back()?;
    let base = samples
        .iter()
        .rev()
        .find(|(at, _)| now.duration_since(*at).unwrap_or_default() >= MINUTE)
        .or(samples.front())?;
    let (since, first) = *base;
    Some(Rates {
        over: now.duration_since(since).unwrap_or_default(),
        published: last.published.saturating_sub(first.published),
        retried: last.retried.saturating_sub(first.retried),
        parked: last.dead.saturating_sub(first.dead),
        total: last,
    })
}

/// The block of this process's relays: per minute (or so far) and since they started.
pub(crate) fn block(rates: Option<&Rates>) -> Markup {
    html! {
        h3 { "The relays of this process" }
        @if let Some(r) = rates {
            @let window = if r.over < MINUTE {
                format!("the last {} (the console's first minute)", super::pages::seconds(r.over.as_secs_f64()))
            } else {
                format!("per minute, over the last {}", super::pages::seconds(r.over.as_secs_f64()))
            };
            table.rates {
                tr { th {} th { (window) } th { "since they started" } }
                tr { td { "published" } td.n #published-rate { (r.figure(r.published)) } td.n { (r.total.published) } }
                tr { td { "retried" } td.n { (r.figure(r.retried)) } td.n { (r.total.retried) } }
                tr { td { "parked" } td.n #parked-rate { (r.figure(r.parked)) } td.n { (r.total.dead) } }
            }
            p.muted {
                "Counted by the relays this process runs (their own counters), not by the relays "
                "of other processes: a fleet's figures are in the relays' metrics ("
                code { "idem_outbox_published_total" } ", " code { "_retried_total" } ", "
                code { "_dead_total" } ", feature " code { "metrics" } ")."
            }
        } @else {
            p.muted {
                "No relay of this process was given to the console ("
                code { "Console::relay_stats" } "): the relays' figures are in their metrics ("
                code { "idem_outbox_published_total" } " and the others, feature " code { "metrics" } ")."
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(published: u64, retried: u64, dead: u64) -> RelayStats {
        RelayStats {
            published,
            retried,
            dead,
            ..RelayStats::default()
        }
    }

    #[test]
    fn a_session_name_gives_its_host_and_pid() {
        assert_eq!(
            host_and_pid("idem relay web-7.example.com pid 4242"),
            Some(("web-7.example.com", "4242"))
        );
        assert_eq!(
            host_and_pid("idem relay a pid b pid 12"),
            Some(("a pid b", "12"))
        );
        for other in [
            "psql",
            "idem relay  pid 1",
            "idem relay h pid ",
            "idem relay h pid 1x",
        ] {
            assert_eq!(host_and_pid(other), None, "{other}");
        }
    }

    #[test]
    fn an_owner_shows_its_host_and_process_or_says_why_not() {
        let relay = RelaySession {
            owner: 1_873_542_264,
            name: "idem relay web-7 pid 4242".into(),
            client_addr: Some("10.0.0.7".into()),
            since: Some(SystemTime::UNIX_EPOCH),
        };
        let known = owner(1_873_542_264, std::slice::from_ref(&relay)).into_string();
        assert!(
            known.contains("<code>web-7</code> pid <code>4242</code>")
                && known.contains("title=\"relay 1873542264: session &quot;idem relay web-7 pid 4242&quot; from 10.0.0.7"),
            "{known}"
        );
        let unknown = owner(5, &[relay]).into_string();
        assert!(unknown.starts_with("relay 5 ") && unknown.contains("session not found"));
    }

    #[test]
    fn a_per_minute_figure_is_taken_over_the_last_minute() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let mut samples = VecDeque::new();
        keep(&mut samples, t0, stats(0, 0, 0));
        keep(&mut samples, t0 + Duration::from_secs(20), stats(10, 1, 0));
        // Younger than a minute: the counts since the first sample.
        let young = rates(&samples).unwrap();
        assert_eq!(
            (young.over, young.published, young.retried),
            (Duration::from_secs(20), 10, 1)
        );
        assert_eq!(young.figure(young.published), "10");
        keep(&mut samples, t0 + Duration::from_secs(60), stats(30, 2, 1));
        keep(&mut samples, t0 + Duration::from_secs(90), stats(60, 2, 3));
        // The newest sample at least a minute old is t0+20s, 70 s back; older ones go.
        assert_eq!(samples.front().unwrap().0, t0 + Duration::from_secs(20));
        let r = rates(&samples).unwrap();
        assert_eq!(r.over, Duration::from_secs(70));
        assert_eq!((r.published, r.retried, r.parked), (50, 1, 3));
        assert_eq!(r.figure(r.published), "42.9");
        assert_eq!(r.total, stats(60, 2, 3));
        let html = block(Some(&r)).into_string();
        assert!(html.contains("per minute, over the last 70 s"), "{html}");
        assert!(block(None).into_string().contains("Console::relay_stats"));
    }

    #[test]
    fn samples_stay_few_however_often_they_are_taken() {
        let t0 = SystemTime::UNIX_EPOCH;
        let mut samples = VecDeque::new();
        for i in 0..5_000 {
            keep(
                &mut samples,
                t0 + Duration::from_millis(i * 10),
                stats(i, 0, 0),
            );
        }
        assert!(samples.len() <= MOST, "{}", samples.len());
    }
}

//! What the command prints: aligned tables for a terminal, JSON (`--json`) for scripts.

use std::time::Duration;

use idem::operate::{
    format_age, format_time, Abandoned, AbandonedCursor, AuditEntry, BlockedKey, CompletionState,
    Confirmed, DeadJson, DeadPreview, DeadReason, FailedPublish, KeyCounts, KeyDetail, KeySummary,
    Lease, Page, RelaySession, StepRecord, TopicPending,
};
use idem::outbox::DeadEvent;
use serde::Serialize;
use serde_json::json;

/// Stdout could not be written: a reader that went away (a closed pipe) ends the command
/// with success, as `head` expects; anything else says why and fails.
pub(crate) fn unwritable(error: &std::io::Error) -> ! {
    if error.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("idem: cannot write to standard output: {error}");
    std::process::exit(1)
}

/// How to print.
pub(crate) struct Out {
    pub(crate) json: bool,
}

/// A dead event as listed in JSON: its fields, and whether it is outside the re-drive
/// window, when there is one.
#[derive(Serialize)]
pub(crate) struct Listed<'a> {
    #[serde(flatten)]
    event: DeadJson<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    outside_window: Option<bool>,
}

/// `events` as JSON lists them, each beside the re-drive window `max_age`, if any.
pub(crate) fn listed(events: &[DeadEvent], max_age: Option<Duration>) -> Vec<Listed<'_>> {
    events
        .iter()
        .map(|e| Listed {
            event: DeadJson(e),
            outside_window: max_age.map(|max_age| e.outside_window(max_age)),
        })
        .collect()
}

/// Seconds to the millisecond.
fn secs(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64())
}

/// `rows` under `header`, each column as wide as its widest cell: the lines.
fn aligned(header: &[&str], rows: &[Vec<String>]) -> Vec<String> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        padded.join("  ").trim_end().to_owned()
    };
    let mut lines = vec![line(header.to_vec())];
    lines.extend(
        rows.iter()
            .map(|row| line(row.iter().map(String::as_str).collect())),
    );
    lines
}

/// `rows` under `header`, printed.
fn table(header: &[&str], rows: &[Vec<String>]) {
    for line in aligned(header, rows) {
        say!("{line}");
    }
}

/// Dead events as a table's lines, each with its age and, given the re-drive window
/// `max_age`, whether it is outside it.
fn dead_table(events: &[DeadEvent], max_age: Option<Duration>) -> Vec<String> {
    let rows: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            let mut row = vec![
                e.id.clone(),
                e.topic.clone(),
                e.ordering_key.clone().unwrap_or_default(),
                e.attempts.to_string(),
                secs(e.dead_for),
                secs(e.age),
            ];
            if let Some(max_age) = max_age {
                let window = if e.outside_window(max_age) {
                    "OUTSIDE"
                } else {
                    "within"
                };
                row.push(window.into());
            }
            row.push(e.last_error.clone());
            row
        })
        .collect();
    let mut header = vec![
        "EVENT",
        "TOPIC",
        "ORDERING_KEY",
        "ATTEMPTS",
        "DEAD_SECS",
        "AGE_SECS",
    ];
    if max_age.is_some() {
        header.push("WINDOW");
    }
    header.push("REASON");
    aligned(&header, &rows)
}

/// A bulk action's preview as lines: its first events, each beside the re-drive window
/// `max_age` for a re-drive, and how many more it counted.
pub(crate) fn preview_lines(preview: &DeadPreview, max_age: Option<Duration>) -> Vec<String> {
    let mut lines = dead_table(&preview.first, max_age);
    let listed = preview.first.len() as u64;
    let more = preview.events.saturating_sub(listed);
    if more > 0 {
        lines.push(format!(
            "and {more} more (the first {listed} are listed; `idem outbox dead --list` lists more)"
        ));
    }
    lines
}

/// The state, tries, failures and last error of an abandoned request's completion; `not
/// completable` for a request its endpoint did not store.
fn completion(completion: Option<&CompletionState>) -> [String; 4] {
    let Some(c) = completion else {
        return ["not completable".into(), "-".into(), "-".into(), "-".into()];
    };
    let state = if c.stored {
        c.state.clone()
    } else {
        format!("not completable, {}", c.state)
    };
    // One line per row: an error's own line breaks would break the table.
    let error = match (&c.last_error, c.error_at) {
        (Some(error), Some(at)) => format!("at {}: {}", format_time(at), error.replace('\n', " ")),
        (Some(error), None) => error.replace('\n', " "),
        (None, _) => "-".into(),
    };
    [state, c.tries.to_string(), c.failures.to_string(), error]
}

impl Out {
    pub(crate) fn print_json<T: Serialize + ?Sized>(&self, value: &T) {
        match serde_json::to_string_pretty(value) {
            Ok(text) => say!("{text}"),
            Err(e) => eprintln!("idem: cannot write JSON: {e}"),
        }
    }

    /// A command that changed nothing but says it is done.
    pub(crate) fn done(&self, message: &str) {
        if self.json {
            self.print_json(&json!({ "ok": true, "message": message }));
        } else {
            say!("{message}");
        }
    }

    /// A command that moved `n` things.
    pub(crate) fn moved(&self, what: &str, n: u64, message: &str) {
        if self.json {
            self.print_json(&json!({ what: n }));
        } else {
            say!("{message}");
        }
    }

    pub(crate) fn key(&self, k: Option<&KeyDetail>, steps: &[StepRecord]) {
        if self.json {
            /// A key's record (its fields, when it has one) and its recorded steps.
            #[derive(serde::Serialize)]
            struct Key<'a> {
                #[serde(flatten)]
                record: Option<&'a KeyDetail>,
                steps: &'a [StepRecord],
            }
            return self.print_json(&Key { record: k, steps });
        }
        if let Some(k) = k {
            let expires = if k.expired {
                format!("{} (expired)", format_time(k.expires_at))
            } else {
                format_time(k.expires_at)
            };
            let rows = vec![
                vec!["status".into(), k.status.as_u16().to_string()],
                vec!["created".into(), format_time(k.created_at)],
                vec!["expires".into(), expires],
                vec!["fingerprint".into(), k.fingerprint.clone()],
                vec!["response bytes".into(), k.body_bytes.to_string()],
                vec!["headers".into(), k.headers.trim_end().replace('\n', "; ")],
            ];
            table(&["", ""], &rows);
            if let Some(body) = &k.body {
                say!("body:\n{}", String::from_utf8_lossy(body));
            }
        } else {
            say!("no committed record (a request that has not committed recorded these steps)");
        }
        if !steps.is_empty() {
            say!("steps (a retry resumes after them):");
            let rows: Vec<Vec<String>> = steps
                .iter()
                .map(|s| {
                    let expires = format_time(s.expires_at);
                    vec![
                        s.step.clone(),
                        format_time(s.created_at),
                        if s.expired {
                            format!("{expires} (expired)")
                        } else {
                            expires
                        },
                        s.result_bytes.to_string(),
                        s.result.clone().unwrap_or_default(),
                    ]
                })
                .collect();
            table(
                &["step", "recorded", "expires", "result bytes", "result"],
                &rows,
            );
        }
    }

    pub(crate) fn keys(&self, keys: &[KeySummary]) {
        if self.json {
            return self.print_json(keys);
        }
        let rows: Vec<Vec<String>> = keys
            .iter()
            .map(|k| {
                vec![
                    match &k.spread {
                        Some(spread) => format!("{} (spread by {spread})", k.scope),
                        None => k.scope.clone(),
                    },
                    k.principal.clone(),
                    k.key.clone(),
                    k.status.to_string(),
                    k.body_bytes.to_string(),
                    format_time(k.created_at),
                    format!(
                        "{}{}",
                        format_time(k.expires_at),
                        if k.expired { " (expired)" } else { "" }
                    ),
                ]
            })
            .collect();
        table(
            &[
                "SCOPE",
                "PRINCIPAL",
                "KEY",
                "STATUS",
                "BYTES",
                "CREATED",
                "EXPIRES",
            ],
            &rows,
        );
    }

    /// A page of abandoned requests: in JSON, each with its `cursor`; in a table, the
    /// next page's `--after` under it, when there is one. An empty first page names the
    /// idle time it was filtered by (`idle_for`), which hides requests still making steps.
    pub(crate) fn abandoned(
        &self,
        page: &Page<Abandoned, AbandonedCursor>,
        idle_for: Duration,
        first: bool,
    ) {
        if self.json {
            return self.print_json(&page.rows);
        }
        if page.rows.is_empty() && first && !idle_for.is_zero() {
            say!(
                "None with no step for {} or more (parked and abandoning ones are listed \
                 whatever their idle time); --idle-for 0s lists every request with a step.",
                idem::operate::format_age(idle_for)
            );
            return;
        }
        let rows: Vec<Vec<String>> = page
            .rows
            .iter()
            .map(|r| {
                let steps: Vec<String> = r
                    .steps
                    .iter()
                    .map(|s| format!("{} at {}", s.step, format_time(s.recorded_at)))
                    .collect();
                let mut row = vec![
                    r.scope.clone(),
                    r.principal.clone(),
                    r.key.clone(),
                    steps.join(", "),
                    format_age(r.idle),
                ];
                row.extend(completion(r.completion.as_ref()));
                row
            })
            .collect();
        table(
            &[
                "SCOPE",
                "PRINCIPAL",
                "KEY",
                "STEPS",
                "IDLE FOR",
                "STATE",
                "TRIES",
                "FAILURES",
                "LAST ERROR",
            ],
            &rows,
        );
        if let Some(next) = &page.next {
            say!("next page: --after {next}");
        }
    }

    /// The audit trail, newest first; the last id is where the next page starts
    /// (`--before`).
    pub(crate) fn audit(&self, entries: &[AuditEntry]) {
        if self.json {
            return self.print_json(entries);
        }
        let rows: Vec<Vec<String>> = entries
            .iter()
            .map(|e| {
                vec![
                    e.id.to_string(),
                    format_time(e.at),
                    e.operator.clone(),
                    e.via.clone(),
                    e.action.clone(),
                    e.rows.to_string(),
                    e.filter.clone(),
                ]
            })
            .collect();
        table(
            &["ID", "AT", "OPERATOR", "VIA", "ACTION", "ROWS", "SELECTED"],
            &rows,
        );
    }

    pub(crate) fn counts(&self, counts: &[KeyCounts]) {
        if self.json {
            return self.print_json(counts);
        }
        let rows: Vec<Vec<String>> = counts
            .iter()
            .map(|c| {
                vec![
                    c.scope.clone(),
                    c.live.to_string(),
                    c.expiring.to_string(),
                    c.expired.to_string(),
                ]
            })
            .collect();
        table(&["SCOPE", "LIVE", "EXPIRING", "EXPIRED"], &rows);
    }

    pub(crate) fn pending(&self, pending: &[TopicPending]) {
        if self.json {
            return self.print_json(pending);
        }
        let rows: Vec<Vec<String>> = pending
            .iter()
            .map(|p| {
                vec![
                    p.topic.clone(),
                    p.events.to_string(),
                    p.held.to_string(),
                    secs(p.oldest),
                ]
            })
            .collect();
        table(&["TOPIC", "PENDING", "HELD", "LAG_SECS"], &rows);
    }

    pub(crate) fn lag(&self, lag: Option<Duration>) {
        if self.json {
            return self.print_json(&json!({ "lag_secs": lag.map(|l| l.as_secs_f64()) }));
        }
        match lag {
            Some(lag) => say!("{} s: the age of the oldest pending event", secs(lag)),
            None => say!("nothing pending"),
        }
    }

    fn lease_row(l: &Lease) -> Vec<String> {
        vec![
            l.id.clone(),
            l.topic.clone(),
            l.attempts.to_string(),
            l.owner.map_or("-".into(), |o| format!("relay {o}")),
            format_time(l.until),
            l.last_error.clone().unwrap_or_default(),
        ]
    }

    pub(crate) fn leases(&self, leases: &[Lease]) {
        if self.json {
            return self.print_json(leases);
        }
        let rows: Vec<Vec<String>> = leases.iter().map(Self::lease_row).collect();
        table(
            &[
                "EVENT",
                "TOPIC",
                "ATTEMPTS",
                "HELD_BY",
                "UNTIL",
                "LAST_ERROR",
            ],
            &rows,
        );
    }

    pub(crate) fn relays(&self, relays: &[RelaySession]) {
        if self.json {
            return self.print_json(relays);
        }
        let rows: Vec<Vec<String>> = relays
            .iter()
            .map(|r| {
                vec![
                    r.owner.to_string(),
                    r.name.clone(),
                    r.client_addr.clone().unwrap_or_else(|| "-".to_owned()),
                    r.since.map_or_else(|| "-".to_owned(), format_time),
                ]
            })
            .collect();
        table(&["OWNER", "SESSION", "CLIENT", "SINCE"], &rows);
    }

    pub(crate) fn errors(&self, errors: &[FailedPublish]) {
        if self.json {
            return self.print_json(errors);
        }
        let rows: Vec<Vec<String>> = errors
            .iter()
            .map(|e| vec![format_time(e.at), e.error.clone()])
            .collect();
        table(&["AT", "ERROR"], &rows);
    }

    pub(crate) fn blocked(&self, blocked: &[BlockedKey]) {
        if self.json {
            return self.print_json(blocked);
        }
        let rows: Vec<Vec<String>> = blocked
            .iter()
            .map(|b| {
                let mut row = vec![b.ordering_key.clone(), b.waiting.to_string()];
                row.extend(Self::lease_row(&b.blocking));
                row
            })
            .collect();
        table(
            &[
                "ORDERING_KEY",
                "WAITING",
                "BLOCKED_BY",
                "TOPIC",
                "ATTEMPTS",
                "HELD_BY",
                "UNTIL",
                "LAST_ERROR",
            ],
            &rows,
        );
    }

    pub(crate) fn reasons(&self, reasons: &[DeadReason]) {
        if self.json {
            return self.print_json(reasons);
        }
        let rows: Vec<Vec<String>> = reasons
            .iter()
            .map(|r| {
                vec![
                    r.events.to_string(),
                    r.topics.join(","),
                    secs(r.oldest),
                    r.reason.clone(),
                ]
            })
            .collect();
        table(&["EVENTS", "TOPICS", "OLDEST_SECS", "REASON"], &rows);
    }

    /// Dead events, each with its age and, given the re-drive window `max_age`, whether
    /// it is outside it.
    pub(crate) fn dead(&self, events: &[DeadEvent], max_age: Option<Duration>) {
        if self.json {
            return self.print_json(&listed(events, max_age));
        }
        for line in dead_table(events, max_age) {
            say!("{line}");
        }
        if let Some(max_age) = max_age {
            let outside = events.iter().filter(|e| e.outside_window(max_age)).count();
            say!(
                "re-drive window {} (--redrive-max-age): {outside} of these were written longer \
                 ago, and are re-driven only with --force",
                format_age(max_age)
            );
        }
    }

    /// A confirmed bulk action on dead events that moved `done.moved` of them (`what`:
    /// `redriven`, `discarded`); in JSON with how many its preview counted, and how many
    /// parked since match its filter and were left.
    pub(crate) fn confirmed(&self, what: &str, done: &Confirmed, message: &str) {
        if self.json {
            self.print_json(&json!({
                what: done.moved,
                "previewed": done.previewed,
                "left": done.left,
            }));
        } else {
            say!("{message}");
        }
    }
}

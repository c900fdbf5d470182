//! The report's words: answers, passes, and what to change for each broken property.

use std::collections::HashSet;

use super::report::Broke;
use super::runner::Move;
use super::Kit;
use crate::failpoint::Point;

/// What to change, for `broke` in the history `moves`, whose calls to each stand-in were
/// `calls`.
pub(super) fn advise(
    kit: &Kit,
    broke: &Broke,
    moves: &[Move],
    calls: &[Vec<Option<String>>],
) -> String {
    let deaths: Vec<Point> = moves
        .iter()
        .filter_map(|m| match m {
            Move::Send { dies: Some((p, _)) } | Move::Complete { dies: Some((p, _)) } => Some(*p),
            _ => None,
        })
        .collect();
    let concurrent = moves.iter().any(|m| matches!(m, Move::AtOnce(_)));
    match broke {
        Broke::Setup { .. } => "make the request succeed when sent once".into(),
        Broke::EffectTwice { effect, .. } if concurrent && deaths.is_empty() => format!(
            "`{effect}` was written by more than one of the copies sent at once: write it through `tx` (`&mut *tx`), where idem's claim lets one copy run"
        ),
        Broke::EffectTwice { effect, .. } => format!(
            "`{effect}` was written again when the request ran again: its first write was not rolled back with the request. Write it through `tx` (`&mut *tx`), not through a pool, a connection of its own or a spawned task"
        ),
        Broke::EffectLost { effect, .. } => format!(
            "`{effect}` is missing though the request answered: a write left to a spawned task (or made after the answer) dies with its process. Make it in the handler, through `tx`"
        ),
        Broke::OutsideCalledAgain { service, .. } => format!(
            "the call to `{service}` happened again after a crash after it: make it a `tx.step`, whose recorded result a retry replays"
        ),
        Broke::OutsideEffectTwice { service, .. } => {
            let stand_in = kit.outside.iter().position(|s| s.name() == service);
            let keys: Vec<&Option<String>> = stand_in
                .map(|n| calls[n].iter().collect())
                .unwrap_or_default();
            let honours = stand_in.is_some_and(|n| kit.outside[n].honours_keys());
            if !honours && deaths.contains(&Point::StepCalled) {
                format!(
                    "`{service}` ignores Idempotency-Key, so a death between its call and the step's record makes it act twice, and nothing in the handler can prevent it: use the service's own key, or reconcile with it"
                )
            } else if keys.iter().any(|k| k.is_none()) {
                format!(
                    "`{service}` was called without an Idempotency-Key: send the step's key (the argument `tx.step` gives its closure)"
                )
            } else if keys.iter().collect::<HashSet<_>>().len() > 1 {
                format!(
                    "`{service}` was sent another Idempotency-Key when the call was made again: send the step's key (the argument `tx.step` gives its closure), not one of the handler's making"
                )
            } else {
                format!(
                    "`{service}` acted more than once: make the call a `tx.step` and send it the step's key"
                )
            }
        }
        Broke::OutsideEffectLost { service, .. } => format!(
            "`{service}` was not called though the request answered: a call left to a spawned task dies with its process. Make it in the handler, as a `tx.step`"
        ),
        Broke::AnswerChanged { .. } => "a key's answer changed: is the handler `#[idempotent]`, and does the request reach it?".into(),
        Broke::NotCompleted { .. } => "a request the faults interrupted did not come back to its answer: see the history's last moves".into(),
        Broke::Invisible { service } => format!(
            "the call to `{service}` was made and nothing records it: no answer committed, no step for an operator to see. Make it a `tx.step`"
        ),
        Broke::RanWithoutDatabase { .. } => "with the database unreachable the request must not run: is the handler `#[idempotent]`, and does it take `Tx`?".into(),
    }
}

pub(super) fn answer_words(status: u16, body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text: String = text.chars().take(200).collect();
    if text.is_empty() {
        status.to_string()
    } else {
        format!("{status} {text}")
    }
}

pub(super) fn replayed_words(replayed: bool) -> &'static str {
    if replayed {
        " (replayed)"
    } else {
        ""
    }
}

/// " (at its 2nd pass)" past the first.
pub(super) fn ordinal(pass: u32) -> String {
    match pass {
        1 => String::new(),
        2 => " (at its 2nd pass)".into(),
        3 => " (at its 3rd pass)".into(),
        n => format!(" (at its {n}th pass)"),
    }
}

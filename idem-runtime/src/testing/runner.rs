//! The histories: the matrix of single faults, the seeded ones, their shrinking, and the
//! properties each is checked against.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::attempt::{Answer, Attempts};
use super::report::{Broke, Finding};
use super::stand_in::Books;
use super::words::{answer_words, ordinal, replayed_words};
use super::{Kit, MakeRequest};
use crate::failpoint::{Failpoints, Point};
use crate::operate::AbandonedFilter;
use crate::store::Store;

use super::process::Died;

/// What the kit counts, at one moment.
pub(super) struct Counts {
    pub(super) effects: Vec<i64>,
    pub(super) outside: Vec<Books>,
}

/// One move of a history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Move {
    /// The client sends the request; the process dies at the point's pass, if armed.
    Send { dies: Option<(Point, u32)> },
    /// A restarted instance's completer looks once; its process dies where armed.
    Complete { dies: Option<(Point, u32)> },
    /// Copies of the request at once, in one process.
    AtOnce(usize),
    /// The next version is deployed.
    Deploy,
    /// The database is unreachable while the client sends.
    Outage,
}

impl Move {
    fn dies(self) -> Option<(Point, u32)> {
        match self {
            Move::Send { dies } | Move::Complete { dies } => dies,
            _ => None,
        }
    }
}

/// What one request does when nothing goes wrong.
pub(super) struct Once {
    status: u16,
    effects: Vec<i64>,
    calls: Vec<usize>,
    outside_effects: Vec<u64>,
    /// The passes through each point ([`Point::ALL`]'s order).
    passes: Vec<u32>,
    /// The same, by the next version, where [`Kit::deploy`] gave one.
    next: Option<Box<Once>>,
}

impl Once {
    /// The least and the most one run changes a count by: this version's, or, in a
    /// history with a deploy, either version's (the next one may add a step).
    fn bounds<T: Ord + Copy>(&self, deploys: bool, of: impl Fn(&Once) -> T) -> (T, T) {
        let this = of(self);
        match (&self.next, deploys) {
            (Some(next), true) => {
                let next = of(next);
                (this.min(next), this.max(next))
            }
            _ => (this, this),
        }
    }

    /// The points a request passes (not an abandon's), with how often it passed each.
    fn points(&self) -> impl Iterator<Item = (Point, u32)> + '_ {
        Point::ALL
            .iter()
            .zip(&self.passes)
            .filter(|(point, passes)| **point != Point::BeforeUndo && **passes > 0)
            .map(|(point, passes)| (*point, *passes))
    }
}

/// What a history did.
pub(super) struct Outcome {
    pub(super) words: Vec<String>,
    pub(super) broke: Vec<Broke>,
    /// Calls of each stand-in in the history, with their keys.
    pub(super) calls: Vec<Vec<Option<String>>>,
}

impl Outcome {
    fn setup(what: String) -> Self {
        Outcome {
            words: Vec::new(),
            broke: vec![Broke::Setup { what }],
            calls: Vec::new(),
        }
    }
}

/// What a history has done so far.
#[derive(Default)]
struct Trace {
    words: Vec<String>,
    broke: Vec<Broke>,
    /// Every answer, in order: the final ones are held to the first.
    finals: Vec<(u16, Bytes)>,
    deployed: bool,
    /// Deaths between a step's call and its record: each lets the call be made again.
    lost_calls: usize,
}

/// The counts around a history: before it, before its last retry, after it.
struct Seen {
    before: Counts,
    middle: Counts,
    after: Counts,
    /// Whether the request was listed for an operator before the last retry.
    listed: bool,
}

pub(super) struct Runner<'k> {
    pub(super) kit: &'k Kit,
    pub(super) attempts: Attempts<'k>,
    pub(super) rng: Rng,
    pub(super) nonce: u64,
    pub(super) keys: u64,
    pub(super) histories: usize,
    /// A store on the test's own pool ([`Kit::migrated`]).
    pub(super) home: Store,
}

impl Runner<'_> {
    /// Runs the matrix and the seeded histories against `request`.
    pub(super) async fn prove(&mut self, request: &MakeRequest, findings: &mut Vec<Finding>) {
        let name = {
            let r = request();
            format!("{} {}", r.method(), r.uri())
        };
        let once = match self.baseline(request).await {
            Ok(once) => once,
            Err(what) => {
                findings.push(Finding {
                    request: name,
                    broke: Broke::Setup { what },
                    history: Vec::new(),
                    advice: "make the request succeed when sent once, with nothing going wrong"
                        .into(),
                });
                return;
            }
        };
        let mut found: Vec<(Vec<Move>, Outcome)> = Vec::new();
        for moves in self.matrix(&once) {
            let outcome = self.history(request, &once, &moves).await;
            if !outcome.broke.is_empty() {
                found.push((moves, outcome));
            }
        }
        for _ in 0..self.kit.histories {
            let moves = self.draw(&once);
            let outcome = self.history(request, &once, &moves).await;
            if !outcome.broke.is_empty() {
                found.push(self.shrink(request, &once, moves, outcome).await);
            }
        }
        let mut kept: Vec<Finding> = Vec::new();
        for (moves, outcome) in found {
            for broke in &outcome.broke {
                let finding = Finding {
                    request: name.clone(),
                    broke: broke.clone(),
                    history: outcome.words.clone(),
                    advice: advise(self.kit, &once, broke, &moves, &outcome.calls),
                };
                match kept.iter_mut().find(|k| k.broke.same_as(broke)) {
                    Some(k) if k.history.len() > finding.history.len() => *k = finding,
                    Some(_) => {}
                    None => kept.push(finding),
                }
            }
        }
        findings.extend(kept);
    }

    /// [`Runner::once`], and the next version's too where there is one.
    async fn baseline(&mut self, request: &MakeRequest) -> Result<Once, String> {
        let mut once = self.once(request, false).await?;
        if self.kit.deployed.is_some() {
            let next = self
                .once(request, true)
                .await
                .map_err(|what| format!("by the next version: {what}"))?;
            once.next = Some(Box::new(next));
        }
        Ok(once)
    }

    /// The request sent once, nothing going wrong: what every history is held to.
    async fn once(&mut self, request: &MakeRequest, deployed: bool) -> Result<Once, String> {
        self.histories += 1;
        let key = self.key();
        let before = self.kit.counts().await?;
        let failpoints = Arc::new(Failpoints::new());
        let (status, body, _) = self
            .attempts
            .send(request, &key, Arc::clone(&failpoints), deployed)
            .await
            .map_err(|died| match died {
                Died::At(point) => format!("it died {point} with nothing armed"),
                Died::NotStarted(what) => what,
            })?;
        let after = self.kit.counts().await?;
        if !(200..300).contains(&status) {
            return Err(format!(
                "sent once, it answered {}",
                answer_words(status, &body)
            ));
        }
        let pairs = || before.outside.iter().zip(&after.outside);
        Ok(Once {
            status,
            effects: before
                .effects
                .iter()
                .zip(&after.effects)
                .map(|(b, a)| a - b)
                .collect(),
            calls: pairs()
                .map(|(b, a)| a.calls.len() - b.calls.len())
                .collect(),
            outside_effects: pairs().map(|(b, a)| a.effects - b.effects).collect(),
            passes: Point::ALL.iter().map(|p| failpoints.passes(*p)).collect(),
            next: None,
        })
    }

    /// Every single fault: each send's copies, a death at each pass of each point the
    /// request passed with each way back, the deploy, the outage.
    fn matrix(&self, once: &Once) -> Vec<Vec<Move>> {
        let mut matrix = vec![
            vec![Move::Send { dies: None }],
            vec![Move::AtOnce(self.kit.at_once)],
        ];
        for (point, passes) in once.points() {
            for pass in 1..=passes {
                let dies = Some((point, pass));
                matrix.push(vec![Move::Send { dies }]);
                matrix.push(vec![Move::Send { dies }, Move::Complete { dies: None }]);
                if self.kit.deployed.is_some() && point != Point::AfterCommit {
                    matrix.push(vec![
                        Move::Send { dies },
                        Move::Deploy,
                        Move::Complete { dies: None },
                    ]);
                    matrix.push(vec![Move::Send { dies }, Move::Deploy]);
                }
            }
        }
        matrix.push(vec![Move::Outage]);
        matrix
    }

    /// A seeded history of up to three moves.
    fn draw(&mut self, once: &Once) -> Vec<Move> {
        let points: Vec<(Point, u32)> = once
            .points()
            .flat_map(|(point, passes)| (1..=passes).map(move |pass| (point, pass)))
            .collect();
        let len = 1 + self.rng.below(3) as usize;
        let mut moves = Vec::with_capacity(len);
        for _ in 0..len {
            let dies = if points.is_empty() || self.rng.below(3) == 0 {
                None
            } else {
                Some(points[self.rng.below(points.len() as u64) as usize])
            };
            let kinds = if self.kit.deployed.is_some() { 6 } else { 5 };
            moves.push(match self.rng.below(kinds) {
                0 | 1 => Move::Send { dies },
                2 => Move::Complete { dies },
                3 => Move::AtOnce(2),
                4 => Move::Outage,
                _ => Move::Deploy,
            });
        }
        moves
    }

    /// The shortest history found by leaving moves out of `moves` that still breaks the
    /// first property `outcome` broke.
    async fn shrink(
        &mut self,
        request: &MakeRequest,
        once: &Once,
        mut moves: Vec<Move>,
        mut outcome: Outcome,
    ) -> (Vec<Move>, Outcome) {
        let target = outcome.broke[0].clone();
        let mut at = 0;
        while at < moves.len() && moves.len() > 1 {
            let mut shorter = moves.clone();
            shorter.remove(at);
            let tried = self.history(request, once, &shorter).await;
            if tried.broke.iter().any(|b| b.same_as(&target)) {
                moves = shorter;
                outcome = tried;
            } else {
                at += 1;
            }
        }
        (moves, outcome)
    }

    fn key(&mut self) -> String {
        self.keys += 1;
        format!("idem-kit-{:x}-{}", self.nonce, self.keys)
    }

    /// Runs `moves`, then the client's last retry, and checks what they did against
    /// `once`.
    async fn history(&mut self, request: &MakeRequest, once: &Once, moves: &[Move]) -> Outcome {
        self.histories += 1;
        let key = self.key();
        let mut trace = Trace::default();
        let before = match self.kit.counts().await {
            Ok(counts) => counts,
            Err(what) => return Outcome::setup(what),
        };
        for m in moves {
            if let Err(what) = self.act(request, &key, *m, &mut trace).await {
                return Outcome::setup(what);
            }
        }
        // Before the last retry: is what happened visible?
        let middle = match self.kit.counts().await {
            Ok(counts) => counts,
            Err(what) => return Outcome::setup(what),
        };
        let listed = self.listed(&key).await;
        let last = match self
            .attempts
            .send(request, &key, Arc::new(Failpoints::new()), trace.deployed)
            .await
        {
            Ok(answer) => answer,
            Err(Died::At(point)) => {
                return Outcome::setup(format!("the last retry died {point} unarmed"))
            }
            Err(Died::NotStarted(what)) => return Outcome::setup(what),
        };
        let (status, body, replayed) = &last;
        trace.words.push(format!(
            "the client retries: {}{}",
            answer_words(*status, body),
            replayed_words(*replayed)
        ));
        let after = match self.kit.counts().await {
            Ok(counts) => counts,
            Err(what) => return Outcome::setup(what),
        };
        let seen = Seen {
            before,
            middle,
            after,
            listed,
        };
        self.check(once, moves, trace, &seen, last)
    }

    /// One move of a history; `Err` where the kit could not make it.
    async fn act(
        &mut self,
        request: &MakeRequest,
        key: &str,
        m: Move,
        trace: &mut Trace,
    ) -> Result<(), String> {
        let failpoints = Arc::new(Failpoints::new());
        let armed = m.dies();
        if let Some((point, pass)) = armed {
            failpoints.arm_at(point, pass);
        }
        let died = |point: Point| {
            let pass = armed.map_or(String::new(), |(_, pass)| ordinal(pass));
            format!("its process dies {point}{pass}")
        };
        let deployed = trace.deployed;
        match m {
            Move::Send { .. } => match self.attempts.send(request, key, failpoints, deployed).await
            {
                Ok((status, body, replayed)) => {
                    trace.words.push(format!(
                        "the client sends the request: {}{}",
                        answer_words(status, &body),
                        replayed_words(replayed)
                    ));
                    trace.finals.push((status, body));
                }
                Err(Died::At(point)) => {
                    trace
                        .words
                        .push(format!("the client sends the request; {}", died(point)));
                    trace.lost_calls += usize::from(point == Point::StepCalled);
                }
                Err(Died::NotStarted(what)) => return Err(what),
            },
            Move::Complete { .. } => match self.attempts.complete(failpoints, deployed).await {
                Ok(Ok(n)) => trace.words.push(format!(
                    "a restarted instance's completer looks, and completes {n} request{}",
                    if n == 1 { "" } else { "s" }
                )),
                Ok(Err(error)) => trace
                    .words
                    .push(format!("a restarted instance's completer fails: {error}")),
                Err(Died::At(point)) => {
                    trace.words.push(format!(
                        "a restarted instance's completer looks; {}",
                        died(point)
                    ));
                    trace.lost_calls += usize::from(point == Point::StepCalled);
                }
                Err(Died::NotStarted(what)) => return Err(what),
            },
            Move::AtOnce(copies) => {
                let delays: Vec<u64> = (0..copies).map(|_| self.rng.below(3)).collect();
                let answers = match self.attempts.at_once(request, key, &delays, deployed).await {
                    Ok(answers) => answers,
                    Err(Died::At(point)) => {
                        return Err(format!("copies at once died {point} with nothing armed"))
                    }
                    Err(Died::NotStarted(what)) => return Err(what),
                };
                let statuses: Vec<String> = answers
                    .iter()
                    .map(|(s, _, r)| format!("{s}{}", replayed_words(*r)))
                    .collect();
                trace.words.push(format!(
                    "the client sends {copies} copies at once: {}",
                    statuses.join(", ")
                ));
                trace
                    .finals
                    .extend(answers.into_iter().map(|(s, b, _)| (s, b)));
            }
            Move::Deploy => {
                trace.deployed = true;
                trace.words.push("the next version is deployed".into());
            }
            Move::Outage => self.outage(request, key, trace).await?,
        }
        Ok(())
    }

    /// The database cut away while the client sends: the request must be answered 503
    /// and change nothing.
    async fn outage(
        &mut self,
        request: &MakeRequest,
        key: &str,
        trace: &mut Trace,
    ) -> Result<(), String> {
        let counted = self.kit.counts().await?;
        self.attempts.gate.shut().await;
        let sent = self
            .attempts
            .send(request, key, Arc::new(Failpoints::new()), trace.deployed)
            .await;
        self.attempts.gate.open().await;
        let after = self.kit.counts().await?;
        let (status, body, _) = match sent {
            Ok(answer) => answer,
            Err(Died::At(point)) => {
                return Err(format!("the outage's send died {point} with nothing armed"))
            }
            Err(Died::NotStarted(what)) => return Err(what),
        };
        trace.words.push(format!(
            "the database is unreachable while the client sends: {}",
            answer_words(status, &body)
        ));
        if status != 503 {
            trace.broke.push(Broke::RanWithoutDatabase {
                what: format!("it answered {}", answer_words(status, &body)),
            });
        }
        if let Some(changed) = changes(&counted, &after) {
            trace.broke.push(Broke::RanWithoutDatabase {
                what: format!("{changed} changed"),
            });
        }
        Ok(())
    }

    /// Holds what the history did to what `once` does.
    fn check(
        &self,
        once: &Once,
        moves: &[Move],
        trace: Trace,
        seen: &Seen,
        last: Answer,
    ) -> Outcome {
        let Trace {
            words,
            mut broke,
            mut finals,
            lost_calls,
            ..
        } = trace;
        let deploys = moves.contains(&Move::Deploy);
        let (status, body, replayed) = last;
        let next_status = once.next.as_ref().map(|next| next.status);
        if status != once.status && !(deploys && next_status == Some(status)) {
            broke.push(Broke::NotCompleted {
                answer: answer_words(status, &body),
            });
        }
        finals.push((status, body));
        let settled: Vec<&(u16, Bytes)> = finals
            .iter()
            .filter(|(s, _)| *s != 409 && *s < 500)
            .collect();
        if let Some(first) = settled.first() {
            if let Some(then) = settled.iter().find(|a| **a != *first) {
                broke.push(Broke::AnswerChanged {
                    first: answer_words(first.0, &first.1),
                    then: answer_words(then.0, &then.1),
                });
            }
        }
        let (before, after) = (&seen.before, &seen.after);
        for (n, effect) in self.kit.effects.iter().enumerate() {
            let found = after.effects[n] - before.effects[n];
            let (least, most) = once.bounds(deploys, |o| o.effects[n]);
            let effect = effect.name.clone();
            if found > most {
                broke.push(Broke::EffectTwice {
                    effect,
                    once: most,
                    found,
                });
            } else if found < least {
                broke.push(Broke::EffectLost {
                    effect,
                    once: least,
                    found,
                });
            }
        }
        let mut calls = Vec::new();
        for (n, service) in self.kit.outside.iter().enumerate() {
            let (b, m, a) = (
                &before.outside[n],
                &seen.middle.outside[n],
                &after.outside[n],
            );
            let service = service.name().to_owned();
            // A death between a step's call and its record is the one window where the
            // call is made again (with the same key): each allows one more.
            let called = a.calls.len() - b.calls.len();
            let (_, most) = once.bounds(deploys, |o| o.calls[n]);
            if called > most + lost_calls * most.max(1) {
                broke.push(Broke::OutsideCalledAgain {
                    service: service.clone(),
                    once: most,
                    found: called,
                });
            }
            let made = a.effects - b.effects;
            let (least, most) = once.bounds(deploys, |o| o.outside_effects[n]);
            if made > most {
                broke.push(Broke::OutsideEffectTwice {
                    service: service.clone(),
                    once: most,
                    found: made,
                });
            } else if made < least {
                broke.push(Broke::OutsideEffectLost {
                    service: service.clone(),
                    once: least,
                    found: made,
                });
            }
            let unrecorded = (m.calls.len() - b.calls.len()).saturating_sub(lost_calls);
            if unrecorded > 0 && !seen.listed && !replayed {
                broke.push(Broke::Invisible { service });
            }
            calls.push(a.calls[b.calls.len()..].to_vec());
        }
        Outcome {
            words,
            broke,
            calls,
        }
    }

    /// Whether an operator sees `key` among the requests with a recorded step.
    async fn listed(&self, key: &str) -> bool {
        let filter = AbandonedFilter {
            key_prefix: Some(key.to_owned()),
            idle_for: Some(Duration::ZERO),
            ..AbandonedFilter::default()
        };
        self.home
            .operate()
            .abandoned_page(&filter, None, 10)
            .await
            .is_ok_and(|page| page.rows.iter().any(|r| r.key == key))
    }
}

/// What to change, for `broke` in the history `moves`, whose calls to each stand-in were
/// `calls`; `once` is what the request does when nothing goes wrong.
fn advise(
    kit: &Kit,
    once: &Once,
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
            let stepped = once.points().any(|(point, _)| point == Point::StepCalled);
            if !stepped {
                format!(
                    "`{service}` acted more than once, and the request makes no step: make the call a `tx.step`, and send the service the key the step gives its closure"
                )
            } else if !honours && deaths.contains(&Point::StepCalled) {
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

/// What changed between two counts, in words, if anything.
fn changes(before: &Counts, after: &Counts) -> Option<String> {
    let effects = before.effects != after.effects;
    let calls = before
        .outside
        .iter()
        .zip(&after.outside)
        .any(|(b, a)| b.calls.len() != a.calls.len());
    match (effects, calls) {
        (false, false) => None,
        (true, false) => Some("a counted effect".into()),
        (false, true) => Some("an outside service's calls".into()),
        (true, true) => Some("a counted effect and an outside service's calls".into()),
    }
}

/// splitmix64: the run's draws, repeatable from its seed.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

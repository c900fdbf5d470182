//! Failpoints: the durable boundaries a request crosses, named in one place, where a test
//! makes the process die (feature `failpoints`, off by default; without it every
//! boundary is a no-op the compiler removes).
//!
//! A process that dies mid-request leaves in PostgreSQL exactly what it had committed:
//! its open transaction rolls back when its connection goes. A test gets the same by
//! dropping the request's future at the boundary (the future's transaction rolls back,
//! as idem guarantees for any drop of a request), and by stopping the instance's
//! completer. [`Failpoints::arm`] makes the next pass through a [`Point`] of the store's
//! requests stop there for good and say so ([`Failpoints::died`]); the test then drops
//! what was running, as the process's death would, and starts it again.
//!
//! The points are kept on the store ([`crate::StoreBuilder::failpoints`]), not in the
//! process: two tests with two stores run in parallel. `tests/tests/lifecycle.rs` (the
//! model of every actor on a key) and the test kit for users' own handlers
//! ([`crate::testing`], feature `testing`) are their users.

// Without the feature only `Point` and the no-op pass are used.
#![cfg_attr(not(feature = "failpoints"), allow(dead_code, unreachable_pub))]

use std::fmt;
use std::sync::Mutex;

use tokio::sync::Notify;

/// A durable boundary of a request, in the order a request with a step crosses them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Point {
    /// A step's call has answered, and its result is not recorded yet: a death here
    /// leaves the outside effect without its record (a retry calls again, with the same
    /// key).
    StepCalled,
    /// A step's result is recorded, and the handler has not gone on yet: a death here
    /// leaves the record, and the request, for a retry or the completer to resume.
    StepRecorded,
    /// The handler has answered, and the message that commits its writes with the key's
    /// record is not sent yet: a death here commits nothing.
    BeforeCommit,
    /// The request has committed, and its answer is not sent yet: a death here leaves
    /// the answer stored, for the retry to replay.
    AfterCommit,
    /// An abandon's decision has committed and an undo is about to run: a death here
    /// leaves the key answering 409 `request-abandoning`, for the next run to finish.
    BeforeUndo,
}

impl Point {
    /// Every point, in the order a request crosses them.
    pub const ALL: [Point; 5] = [
        Point::StepCalled,
        Point::StepRecorded,
        Point::BeforeCommit,
        Point::AfterCommit,
        Point::BeforeUndo,
    ];
}

impl fmt::Display for Point {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Point::StepCalled => "after a step's call, before its record",
            Point::StepRecorded => "after a step's record",
            Point::BeforeCommit => "before COMMIT",
            Point::AfterCommit => "after COMMIT, before the answer",
            Point::BeforeUndo => "after an abandon's decision, before an undo",
        })
    }
}

/// The failpoints of one store: which are armed, and which was hit.
#[derive(Default)]
pub struct Failpoints {
    /// Each armed point, with how many passes through it go on before the one that dies.
    armed: Mutex<Vec<(Point, u32)>>,
    died: Mutex<Vec<Point>>,
    /// The passes through each point, in [`Point::ALL`]'s order.
    passes: Mutex<[u32; Point::ALL.len()]>,
    hit: Notify,
}

impl fmt::Debug for Failpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Failpoints")
            .field("armed", &*lock(&self.armed))
            .field("died", &*lock(&self.died))
            .finish()
    }
}

fn index(point: Point) -> usize {
    Point::ALL
        .iter()
        .position(|p| *p == point)
        .unwrap_or_default()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Failpoints {
    /// No point armed.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next pass of one of the store's requests (or its completer) through `point`
    /// stops there for good, as if its process had died: it never returns, and
    /// [`Failpoints::died`] says so. Arming a point twice stops two passes.
    pub fn arm(&self, point: Point) {
        self.arm_at(point, 1);
    }

    /// Arms `point` at its `pass`th pass from now (1: the next one).
    pub(crate) fn arm_at(&self, point: Point, pass: u32) {
        lock(&self.armed).push((point, pass.saturating_sub(1)));
    }

    /// The passes through `point` so far, the one that died included (the test kit's
    /// count of where a request goes).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(crate) fn passes(&self, point: Point) -> u32 {
        lock(&self.passes)[index(point)]
    }

    /// Disarms every point that has not been hit.
    pub fn disarm(&self) {
        lock(&self.armed).clear();
    }

    /// The points hit since the last call, oldest first, without waiting.
    pub fn take_died(&self) -> Vec<Point> {
        std::mem::take(&mut *lock(&self.died))
    }

    /// Waits until an armed point is hit, and returns it.
    pub async fn died(&self) -> Point {
        loop {
            let notified = self.hit.notified();
            if let Some(point) = {
                let mut died = lock(&self.died);
                (!died.is_empty()).then(|| died.remove(0))
            } {
                return point;
            }
            notified.await;
        }
    }

    /// Whether a pass through `point` dies, disarming it if so.
    pub(crate) fn take(&self, point: Point) -> bool {
        lock(&self.passes)[index(point)] += 1;
        let mut armed = lock(&self.armed);
        let Some(at) = armed.iter().position(|(p, _)| *p == point) else {
            return false;
        };
        if armed[at].1 > 0 {
            armed[at].1 -= 1;
            return false;
        }
        armed.remove(at);
        drop(armed);
        lock(&self.died).push(point);
        self.hit.notify_waiters();
        true
    }
}

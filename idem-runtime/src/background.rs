//! What a background task's handle asks of it: to stop after the unit of work it is in
//! (a round, a look, a sweep), which its loop waits for beside its timer. The relay, the
//! completer and the sweeper share the one shape: `stop`, `stopped` (stop and wait),
//! `abort` (at once, as a crash would).

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

/// A request to stop, shared by a task and its handle.
#[derive(Debug, Default)]
pub(crate) struct Stop {
    asked: AtomicBool,
    wake: Notify,
}

impl Stop {
    /// Asks the task to stop after its current unit of work.
    pub(crate) fn ask(&self) {
        self.asked.store(true, Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// Whether the task was asked to stop.
    pub(crate) fn asked(&self) -> bool {
        self.asked.load(Ordering::SeqCst)
    }

    /// A wake-up for when the task is asked to stop, for a loop that waits on more than
    /// a timer.
    pub(crate) fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.wake.notified()
    }

    /// Waits for `tick` (the task's timer), or until the task is asked to stop: whether
    /// it was.
    pub(crate) async fn tick_or_stop(&self, tick: impl std::future::Future<Output = ()>) -> bool {
        if self.asked() {
            return true;
        }
        tokio::select! {
            () = tick => self.asked(),
            () = self.wake.notified() => true,
        }
    }
}

//! A process of the user's service, as the kit runs it: a thread with a runtime of its
//! own, which dies where a failpoint stops it.
//!
//! A real process that dies takes with it everything it was doing: its open transactions
//! roll back when their connections go, and its spawned tasks never run again. Dropping
//! a request's future does the first but not the second, so each process here is a
//! thread with a current-thread runtime of its own, dropped where the process dies: every
//! task it holds goes with it, and every connection of its pool is closed.
//!
//! Where a failpoint stops the job, the job stays stopped there while the process's other
//! tasks run on for the settling time; then the process dies. Whether a task the handler
//! spawned got its work done before a death is a race in a real process; here it always
//! has (with the settling time's margin), so that a history's outcome does not depend on
//! timing: a write left to a spawned task is then made twice when the request runs again.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::failpoint::{Failpoints, Point};

/// Runs `job` in a new process until it ends, or until an armed failpoint stops it; then
/// lets the process's other tasks run `settle` longer (the tasks it spawned finish their
/// work) before it stops. `Err` names the point it died at.
pub(super) async fn run<T, F, Fut>(
    failpoints: Arc<Failpoints>,
    settle: Duration,
    job: F,
) -> Result<T, Died>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T> + 'static,
{
    let (sender, receiver) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("idem-testing-process".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(error) => {
                    sender.send(Err(Died::NotStarted(error.to_string()))).ok();
                    return;
                }
            };
            let outcome = runtime.block_on(async move {
                let job = job();
                tokio::pin!(job);
                tokio::select! {
                    biased;
                    done = &mut job => {
                        tokio::time::sleep(settle).await;
                        Ok(done)
                    }
                    point = failpoints.died() => {
                        tokio::time::sleep(settle).await;
                        Err(Died::At(point))
                    }
                }
            });
            // The process's death, or its end: its tasks and connections go, as they are.
            drop(runtime);
            sender.send(outcome).ok();
        });
    if let Err(error) = spawned {
        return Err(Died::NotStarted(error.to_string()));
    }
    receiver
        .await
        .unwrap_or_else(|_| Err(Died::NotStarted("the process panicked".into())))
}

/// How a process ended before its job did.
#[derive(Debug)]
pub(super) enum Died {
    /// A failpoint stopped it.
    At(Point),
    /// It could not run (no thread or runtime), or its job panicked.
    NotStarted(String),
}

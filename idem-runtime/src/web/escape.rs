//! Finding writes that escape the request's transaction: a handler that writes through
//! its own pool connection (`State<PgPool>`) instead of [`Tx`](crate::Tx) commits those
//! writes even when idem rolls the request back, and runs them again on every retry.
//!
//! In debug builds, each idempotent handler runs with its name in a task-local; a pool
//! configured with [`warn_on_escaping_writes`] logs a warning, naming the handler, when
//! a connection is acquired while one runs. Release builds do neither.

use std::future::Future;

use sqlx::postgres::PgPoolOptions;

tokio::task_local! {
    /// The idempotent handler running in this task.
    static HANDLER: &'static str;
}

/// Runs an idempotent handler's future with its name in the task-local (debug builds).
pub(crate) async fn running<F: Future>(handler: &'static str, future: F) -> F::Output {
    if cfg!(debug_assertions) {
        HANDLER.scope(handler, future).await
    } else {
        future.await
    }
}

/// The idempotent handler running in this task, if any.
fn running_handler() -> Option<&'static str> {
    HANDLER.try_with(|handler| *handler).ok()
}

fn warn(handler: &'static str) {
    tracing::warn!(
        handler,
        "idem: a pool connection was acquired inside the idempotent handler `{handler}`: \
         its writes escape the request's transaction (they commit even when the request \
         rolls back, and run again on retry); write through `Tx` instead"
    );
}

/// Adds a check to a pool's options: in debug builds, acquiring a connection from this
/// pool while an `#[idempotent]` handler runs in the same task logs a warning naming
/// the handler. Release builds add nothing.
///
/// ```no_run
/// # async fn f() -> Result<(), sqlx::Error> {
/// let pool = idem::extract::warn_on_escaping_writes(sqlx::postgres::PgPoolOptions::new())
///     .connect("postgres://postgres@127.0.0.1/postgres")
///     .await?;
/// # Ok(()) }
/// ```
pub fn warn_on_escaping_writes(options: PgPoolOptions) -> PgPoolOptions {
    if !cfg!(debug_assertions) {
        return options;
    }
    options
        .after_connect(|_, _| {
            Box::pin(async {
                if let Some(handler) = running_handler() {
                    warn(handler);
                }
                Ok(())
            })
        })
        .before_acquire(|_, _| {
            Box::pin(async {
                if let Some(handler) = running_handler() {
                    warn(handler);
                }
                Ok(true)
            })
        })
}

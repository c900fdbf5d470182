//! Runs the charges service: `cargo run -p charges`.
//!
//! Environment: `BIND_ADDR` (default `127.0.0.1:3000`), `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`, a local trust-auth PostgreSQL),
//! `PROCESSOR_DELAY_MS` (default 0: the pause inside a charge's transaction, after the
//! processor's call), `PROCESSOR_URL` (unset by default: no processor; set, an
//! `http://` base URL: each charge is made at `{PROCESSOR_URL}/v1/charges` first, once
//! per request, as a step), `PROCESSOR_TIMEOUT_MS` (default 10000: longer, a 504),
//! `WEBHOOK_SECRET` (the HMAC key of webhook
//! signatures, at least 16 bytes: empty or shorter, the service refuses to start;
//! `WEBHOOK_SECRET_PREVIOUS` is also accepted while rotating),
//! `DB_POOL_SIZE` (default 20), `DB_POOLER` (`session`, the default: PostgreSQL itself or
//! a pooler in session mode; `transaction`: a pooler in transaction mode, such as
//! PgBouncer's `pool_mode = transaction`; anything else stops the service at start),
//! `DB_PORTABLE` (`true` on Citus: the service distributes its tables itself),
//! `SWEEP_PERIOD_SECS` (default 60: how often expired idempotency records are swept)
//! `SWEEP_BATCH` (default 1000: rows per delete batch, 1 to 100 000),
//! `NATS_URL` (unset by default: no events; set, `charge.created` and `charge.refunded`
//! go through idem's outbox to NATS JetStream, and the ledger consumer books them),
//! `NATS_SUBJECT_PREFIX` (default `charges`: the stream and its subjects; the ledger's
//! dead letters go to the stream `<prefix>_dead`, listed by the console's "Dead letters"
//! page),
//! `ADMIN_TOKEN` (unset by default: nothing at `/admin/idem`; set, at least 16 characters,
//! idem's console is mounted there behind `Authorization: Bearer <ADMIN_TOKEN>`, actions
//! on), `ADMIN_READONLY_TOKEN` (unset by default; set, at least 16 characters and not
//! `ADMIN_TOKEN`, its bearer sees the console read-only: no action, 403 on any),
//! `OUTBOX_MAX_ATTEMPTS` (default 10: failed publishes before an event is parked as dead),
//! `OUTBOX_BACKOFF_MS` (default 500: the first wait after a failed publish, doubling),
//! `RUST_LOG` (default `info`, with PostgreSQL's notices such as "relation already exists,
//! skipping" from `warn` only).

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    charges::init_logging("info,sqlx::postgres::notice=warn");
    match charges::main_from_env().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // One line with its causes, not the `Debug` dump of `fn main() -> Result`.
            eprintln!("charges: {}", charges::one_line(&error));
            ExitCode::FAILURE
        }
    }
}

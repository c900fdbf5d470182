//! The command line, as clap reads it.

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use idem::operate::{AbandonedCursor, CompletionStage};

/// Operate idem's tables: migrate and verify them, look at idempotency keys, watch the
/// outbox, re-drive or discard dead events, complete or abandon abandoned requests. Each
/// action (purge, sweep, abandon, complete, redrive, discard) is recorded in the audit
/// trail with its --operator, and `idem audit` lists it.
///
/// Exit codes: 0 done; 1 the database failed otherwise; 2 wrong usage (or an action
/// refused without --yes, or a re-drive past the window without --force); 3 not found
/// (a key, or nothing an action's filter matches: nothing done); 4 the tables are missing
/// or wrong; 5 the database cannot be reached (nothing listens, or not PostgreSQL); 6
/// permission denied; 7 more dead events were within a re-drive's or a discard's preview
/// when it acted than the preview counted (one parked meanwhile): nothing done, run it
/// again.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, long_about)]
pub(crate) struct Cli {
    /// The PostgreSQL to work on.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub(crate) database_url: Option<String>,
    /// The idempotency table, `name` or `schema.name`.
    #[arg(long, default_value = idem::schema::DEFAULT.keys_table, global = true)]
    pub(crate) table: String,
    /// The outbox table (default: `idem_outbox` in the idempotency table's schema).
    #[arg(long, global = true)]
    pub(crate) outbox_table: Option<String>,
    /// The steps table (default: `idempotency_steps` in the idempotency table's schema).
    #[arg(long, global = true)]
    pub(crate) steps_table: Option<String>,
    /// The requests table (default: `idempotency_requests` in the idempotency table's
    /// schema).
    #[arg(long, global = true)]
    pub(crate) requests_table: Option<String>,
    /// The audit table (default: `idem_audit` in the idempotency table's schema).
    #[arg(long, global = true)]
    pub(crate) audit_table: Option<String>,
    /// Who runs the command, as the audit trail records its actions (default: the OS
    /// user, from $USER or $LOGNAME, else "unknown").
    #[arg(long, global = true)]
    pub(crate) operator: Option<String>,
    /// What sits in front of PostgreSQL: nothing or a pooler in session mode, or a
    /// pooler in transaction mode (PgBouncer `pool_mode = transaction`).
    #[arg(long, value_enum, default_value_t = PoolerArg::Session, global = true)]
    pub(crate) pooler: PoolerArg,
    /// The store's portable mode (distributed PostgreSQL, such as Citus).
    #[arg(long, global = true)]
    pub(crate) portable: bool,
    /// The re-drive window: dead events written at least this long ago are re-driven
    /// only with --force, since consumers that deduplicate with run_once may have
    /// forgotten them. Set it to the services' `redrive_max_age`, their consumers' ttl
    /// (default 1d, run_once's default ttl): 90s, 30m, 24h, 7d.
    #[arg(long, value_parser = age, global = true)]
    pub(crate) redrive_max_age: Option<Duration>,
    /// The type of the principal column, for `migrate`.
    #[arg(long, value_enum, default_value_t = PrincipalArg::Text, global = true)]
    pub(crate) principal_type: PrincipalArg,
    /// Print JSON, for scripts, instead of tables.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PoolerArg {
    Session,
    Transaction,
}

/// Where an abandoned request's completion stands (`idem::operate::CompletionStage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum CompletionArg {
    /// The service's completer runs it.
    Pending,
    /// Parked after too many failed runs.
    Failed,
    /// Given up: the undos registered for its steps run, then 410.
    Abandoning,
    /// Its endpoint stored no request: it can only be abandoned.
    NotCompletable,
}

impl From<CompletionArg> for CompletionStage {
    fn from(arg: CompletionArg) -> Self {
        match arg {
            CompletionArg::Pending => Self::Pending,
            CompletionArg::Failed => Self::Failed,
            CompletionArg::Abandoning => Self::Abandoning,
            CompletionArg::NotCompletable => Self::NotCompletable,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PrincipalArg {
    Text,
    Uuid,
    Bigint,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Create idem's tables if they are missing (in portable mode on Citus, distribute
    /// the idempotency table by principal too).
    Migrate {
        /// Print the DDL instead of running it.
        #[arg(long)]
        print: bool,
        /// Portable mode on Citus: the tenant table to colocate the idempotency table
        /// with.
        #[arg(long)]
        colocate_with: Option<String>,
    },
    /// Check that the tables suit the store as configured (`Store::verify`).
    Verify,
    /// Idempotency keys.
    #[command(subcommand)]
    Key(KeyCommand),
    /// The outbox.
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// The audit trail: who purged, swept, re-drove or discarded what, when, and how many
    /// rows it moved, from the console or from here. Newest first.
    Audit {
        /// How many actions, newest first.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Only actions older than this one: the last id of the page before.
        #[arg(long)]
        before: Option<i64>,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum KeyCommand {
    /// One key's record: status, created, expires, fingerprint, response size.
    Status {
        scope: String,
        key: String,
        /// Its principal (none by default).
        #[arg(long, default_value = "")]
        principal: String,
        /// Show the stored response body too (it may carry personal data).
        #[arg(long)]
        body: bool,
    },
    /// Records, newest first.
    List {
        #[arg(long)]
        scope: Option<String>,
        #[arg(long)]
        principal: Option<String>,
        /// Only records at least this old: 90s, 30m, 24h, 7d.
        #[arg(long, value_parser = age)]
        older_than: Option<Duration>,
        /// Expired records too.
        #[arg(long)]
        expired: bool,
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Requests that made an outside call (recorded a step) and never committed: their
    /// clients went away. Oldest first step first, a page at a time (--after), each with
    /// where its completion stands: pending (the service's completer runs it), failed
    /// (parked after too many failed runs), abandoning (given up: its registered undos run),
    /// or not completable (its endpoint stores no request).
    Abandoned {
        /// Only requests whose newest step is at least this old: 90s, 30m, 24h, 7d.
        #[arg(long, value_parser = age, default_value = "5m")]
        idle_for: Duration,
        /// Only this scope's requests.
        #[arg(long)]
        scope: Option<String>,
        /// Only this principal's requests.
        #[arg(long)]
        principal: Option<String>,
        /// Only keys that start with this.
        #[arg(long)]
        prefix: Option<String>,
        /// Only requests whose completion stands here.
        #[arg(long, value_enum)]
        completion: Option<CompletionArg>,
        /// How many, oldest first step first.
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// The page after this request: the cursor the page before printed last (`next
        /// page: --after ...`), or its last row's `cursor` in JSON.
        #[arg(long)]
        after: Option<AbandonedCursor>,
    },
    /// Records per scope: live, expiring soon, expired.
    Counts {
        /// What "expiring soon" means.
        #[arg(long, value_parser = age, default_value = "1h")]
        expiring_within: Duration,
    },
    /// Delete one key's record, so that its next request runs afresh.
    Purge {
        scope: String,
        key: String,
        #[arg(long, default_value = "")]
        principal: String,
        /// Do not ask first.
        #[arg(long)]
        yes: bool,
    },
    /// Give up an abandoned request for good: the service's completer undoes each of its
    /// steps that has an undo registered (a refund for a charge), the last first, then
    /// answers 410 to its key from then on, naming any step it did not undo.
    Abandon {
        /// The endpoint's scope, as `#[idempotent(scope = ..)]` names it.
        scope: String,
        /// The request's idempotency key.
        key: String,
        /// The principal the key is kept under (the account of a service that keys
        /// requests per account); empty for a key without one.
        #[arg(long, default_value = "")]
        principal: String,
        /// Say which steps would be compensated, and abandon nothing.
        #[arg(long)]
        dry_run: bool,
        /// Do not ask first.
        #[arg(long)]
        yes: bool,
    },
    /// Send a stored abandoned request (pending, or parked as failed) to be completed at
    /// the completer's next look, its failures forgotten.
    Complete {
        /// The endpoint's scope, as `#[idempotent(scope = ..)]` names it.
        scope: String,
        /// The request's idempotency key.
        key: String,
        /// The principal the key is kept under; empty for a key without one.
        #[arg(long, default_value = "")]
        principal: String,
    },
    /// Delete expired records now.
    Sweep {
        #[arg(long, default_value_t = 1_000)]
        batch: u32,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum OutboxCommand {
    /// Pending events per topic, with their lag.
    Pending,
    /// The age of the oldest pending event.
    Lag,
    /// Events a relay leases, or that back off after a failure, and until when.
    Leases {
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// The relays whose sessions hold their locks now: owner number, host and process.
    Relays,
    /// One event's last ten failed publishes, oldest first, each with its time.
    Errors {
        /// The event's id (as `idem outbox dead --list` or `leases` print it).
        id: String,
    },
    /// Ordering keys whose events wait behind another, and the event that blocks each.
    Blocked {
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Dead events grouped by reason, with counts; `--list` lists them.
    Dead {
        #[arg(long)]
        list: bool,
        /// Only this reason's (with --list).
        #[arg(long)]
        reason: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Make dead events pending again, their attempts reset; refused (nothing moved) if
    /// one of them was written longer ago than --redrive-max-age, unless --force. It
    /// counts and lists them first, asks (naming the count) unless --yes, and moves only
    /// the events it counted: one parked since is left as it is.
    Redrive {
        #[command(flatten)]
        which: Which,
        /// Say what would move (how many, and the first of them), and move nothing.
        #[arg(long)]
        dry_run: bool,
        /// Re-drive events outside the re-drive window too: their consumers may apply
        /// them a second time.
        #[arg(long)]
        force: bool,
        /// Do not ask first (they are still counted first, and only those are moved).
        #[arg(long)]
        yes: bool,
    },
    /// Delete dead events: they are never published. It counts and lists them first,
    /// asks (naming the count) unless --yes, and deletes only the events it counted: one
    /// parked since is left as it is.
    Discard {
        #[command(flatten)]
        which: Which,
        /// Say what would be deleted (how many, and the first of them), and delete
        /// nothing.
        #[arg(long)]
        dry_run: bool,
        /// Do not ask first (they are still counted first, and only those are deleted).
        #[arg(long)]
        yes: bool,
    },
}

/// Which dead events: by id, by reason, or all.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub(crate) struct Which {
    /// These events (repeat, or separate with commas).
    #[arg(long, value_delimiter = ',')]
    pub(crate) id: Vec<String>,
    /// Those whose last error is exactly this (as `idem outbox dead` prints it).
    #[arg(long)]
    pub(crate) reason: Option<String>,
    /// All of them.
    #[arg(long)]
    pub(crate) all: bool,
}

fn age(text: &str) -> Result<Duration, String> {
    idem::operate::parse_age(text).ok_or_else(|| {
        format!("{text:?} is not an age: use a whole number and s, m, h or d (90s, 30m, 24h, 7d)")
    })
}

//! `idem`: idem's tables from a terminal or a script, over the same queries as the
//! console (`idem::operate`). `idem --help` lists the commands; the README's "The
//! command line" shows them at work.

/// `println!`, except that a reader that went away (`idem outbox dead --list | head`)
/// ends the command quietly, as it ends other Unix tools, not with a panic.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(error) = writeln!(std::io::stdout().lock(), $($arg)*) {
            $crate::output::unwritable(&error)
        }
    }};
}

mod args;
mod keys;
mod output;

use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use idem::operate::{
    format_age, format_time, AbandonedFilter, Audited, ConfirmError, Confirmed, DeadPreview,
    DeadSelection, EventFilter, KeyFilter, Operator,
};
use idem::schema::PrincipalType;
use idem::{Store, VerifyError};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use args::{Cli, Command, KeyCommand, OutboxCommand, PoolerArg, PrincipalArg, Which};
use output::Out;

/// The exit codes scripts can rely on (also in `idem --help`).
mod exit {
    /// The database failed in another way.
    pub(crate) const FAILED: u8 = 1;
    /// Wrong usage, or an action refused without `--yes` (or a re-drive past the
    /// window without `--force`).
    pub(crate) const USAGE: u8 = 2;
    /// What was asked for is not there: a key, or anything an action's filter matches
    /// (nothing done).
    pub(crate) const NOT_FOUND: u8 = 3;
    /// idem's tables are missing or not as the store is configured.
    pub(crate) const TABLES: u8 = 4;
    /// The database cannot be reached: nothing listens, or what answers is not
    /// PostgreSQL.
    pub(crate) const UNREACHABLE: u8 = 5;
    /// The database refused: permission denied, or authentication failed.
    pub(crate) const PERMISSION: u8 = 6;
    /// A re-drive's or a discard's preview counted fewer dead events than its bound held
    /// when it acted (one was parked by a transaction running during the preview):
    /// nothing done; running it again previews them anew.
    pub(crate) const CHANGED: u8 = 7;
}

/// Why the command stopped: an exit code and one line.
struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

/// Where the command connects, without the password, and what it needs there, for
/// messages.
struct Target {
    server: String,
    user: String,
    /// The privileges the command needs on idem's tables.
    privileges: &'static str,
    /// The audit table's name as PostgreSQL names it in a message (without its schema),
    /// and the privileges the command needs on it.
    audit: (String, &'static str),
}

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("idem: {}", failure.message.replace('\n', " "));
            ExitCode::from(failure.code)
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let out = Out { json: cli.json };
    let options = connect_options(cli.database_url.as_deref())?;
    let target = Target {
        server: format!(
            "{}:{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or_default()
        ),
        user: options.get_username().to_owned(),
        privileges: privileges(&cli.command),
        audit: (
            cli.audit_table
                .as_deref()
                .and_then(|name| name.rsplit('.').next())
                .unwrap_or(idem::schema::DEFAULT.audit_table)
                .to_owned(),
            audit_privileges(&cli.command),
        ),
    };
    let options = match cli.pooler {
        PoolerArg::Transaction => options.statement_cache_capacity(0),
        PoolerArg::Session => options,
    };
    let store = |pool| store_of(&cli, pool);
    if let Command::Migrate { print: true, .. } = cli.command {
        // Printing the DDL needs no database.
        let lazy = PgPoolOptions::new().connect_lazy_with(options);
        let store = store(lazy)?;
        say!(
            "{}\n{}\n{}\n{}\n{}",
            store.schema().keys_sql,
            store.schema().outbox_sql,
            store.schema().steps_sql,
            store.schema().requests_sql,
            store.schema().audit_sql
        );
        return Ok(());
    }
    connect(&options, &target).await?;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_with(options)
        .await
        .map_err(|e| database(&e, &target))?;
    let store = store(pool)?;
    let failed = |e: sqlx::Error| database(&e, &target);
    // A blank name names nobody: the OS user's stands in.
    let named = cli.operator.clone().filter(|name| !name.trim().is_empty());
    let operator = Operator::new(named.unwrap_or_else(os_user), "cli");
    let audited = store.operate().audited(operator);
    match cli.command {
        Command::Migrate { colocate_with, .. } => {
            store.migrate().await.map_err(failed)?;
            if cli.portable {
                store
                    .distribute(colocate_with.as_deref())
                    .await
                    .map_err(|e| verify(e, &target))?;
            }
            out.done(&format!("idem's tables are in {}", target.server));
        }
        Command::Verify => {
            store.verify().await.map_err(|e| verify(e, &target))?;
            out.done(&format!(
                "idem's tables in {} suit the store as configured",
                target.server
            ));
        }
        Command::Key(command) => keys::key(&audited, &out, command)
            .await
            .map_err(|f| f.or(&target))?,
        Command::Outbox(command) => outbox(&audited, &out, command)
            .await
            .map_err(|f| f.or(&target))?,
        Command::Audit { limit, before } => {
            out.audit(
                &store
                    .operate()
                    .audit_log(limit, before)
                    .await
                    .map_err(failed)?,
            );
        }
    }
    Ok(())
}

/// The connection options `DATABASE_URL` names: a PostgreSQL URL, or a usage failure that
/// says what is wrong with it.
fn connect_options(url: Option<&str>) -> Result<PgConnectOptions, Failure> {
    let url = url.ok_or_else(|| {
        Failure::new(
            exit::USAGE,
            "no database: set DATABASE_URL or pass --database-url",
        )
    })?;
    // sqlx parses any scheme as PostgreSQL's: `mysql://` would be tried as one.
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    if !scheme.eq_ignore_ascii_case("postgres") && !scheme.eq_ignore_ascii_case("postgresql") {
        return Err(Failure::new(
            exit::USAGE,
            format!(
                "DATABASE_URL is not a PostgreSQL URL: its scheme is {scheme:?}, where idem \
                 works on PostgreSQL only (postgres:// or postgresql://)"
            ),
        ));
    }
    let options: PgConnectOptions = url.parse().map_err(|e| {
        Failure::new(
            exit::USAGE,
            format!("DATABASE_URL is not a PostgreSQL URL: {e}"),
        )
    })?;
    Ok(options)
}

/// The store the command's flags describe, on `pool`.
fn store_of(cli: &Cli, pool: sqlx::PgPool) -> Result<Store, Failure> {
    let mut builder = Store::builder(pool)
        .table(&cli.table)
        .pooler(match cli.pooler {
            PoolerArg::Session => idem::Pooler::Session,
            PoolerArg::Transaction => idem::Pooler::Transaction,
        })
        .principal_type(match cli.principal_type {
            PrincipalArg::Text => PrincipalType::Text,
            PrincipalArg::Uuid => PrincipalType::Uuid,
            PrincipalArg::Bigint => PrincipalType::Bigint,
        });
    if let Some(outbox) = &cli.outbox_table {
        builder = builder.outbox_table(outbox);
    }
    if let Some(steps) = &cli.steps_table {
        builder = builder.steps_table(steps);
    }
    if let Some(requests) = &cli.requests_table {
        builder = builder.requests_table(requests);
    }
    if let Some(audit) = &cli.audit_table {
        builder = builder.audit_table(audit);
    }
    if cli.portable {
        builder = builder.portable(true);
    }
    if let Some(max_age) = cli.redrive_max_age {
        builder = builder.redrive_max_age(max_age);
    }
    builder
        .build()
        .map_err(|e| Failure::new(exit::USAGE, e.to_string()))
}

/// Whether the outbox holds the event `id`, pending or dead.
async fn in_outbox(store: &Store, id: &str) -> Result<bool, sqlx::Error> {
    if store.operate().dead_event(id, false).await?.is_some() {
        return Ok(true);
    }
    let mut filter = EventFilter::default();
    filter.ids = Some(vec![id.to_owned()]);
    Ok(!store
        .operate()
        .pending_events(&filter, None, 1)
        .await?
        .rows
        .is_empty())
}

/// Who runs the command when `--operator` does not say: the OS user, else `unknown`.
fn os_user() -> String {
    ["USER", "LOGNAME"]
        .into_iter()
        .filter_map(|name| std::env::var(name).ok())
        .find(|user| !user.trim().is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// A failure of a subcommand: a database error, classified once the target is known,
/// or a failure of its own.
enum Fault {
    Database(sqlx::Error),
    Own(Failure),
}

impl From<sqlx::Error> for Fault {
    fn from(e: sqlx::Error) -> Self {
        Self::Database(e)
    }
}

impl Fault {
    fn or(self, target: &Target) -> Failure {
        match self {
            Self::Database(e) => database(&e, target),
            Self::Own(failure) => failure,
        }
    }
}

/// The names of the steps of a request that has not committed, oldest first, those that
/// have not expired: what an abandon compensates.
async fn live_steps(
    store: &Store,
    scope: &str,
    principal: &str,
    key: &str,
) -> Result<Vec<String>, Fault> {
    let steps = store
        .operate()
        .key_steps(scope, principal, key, false)
        .await?;
    Ok(steps
        .into_iter()
        .filter(|s| !s.expired)
        .map(|s| s.step)
        .collect())
}

/// An action on `what`, a request without live steps: exit 3, nothing `done`; `hint`
/// ends the line ([`holders`]: the principals that hold the key, when none was given).
fn no_live_steps(what: &str, done: &str, hint: &str) -> Fault {
    Fault::Own(Failure::new(
        exit::NOT_FOUND,
        format!(
            "{what} has no live steps: its request committed, its steps expired, or it never \
             made one (`idem key abandoned --idle-for 0s` lists them): nothing {done}{hint}"
        ),
    ))
}

/// An outbox command; its actions are recorded in the audit trail as `audited`'s
/// operator's (a dry run is no action: it records nothing).
async fn outbox(audited: &Audited<'_>, out: &Out, command: OutboxCommand) -> Result<(), Fault> {
    let store = audited.store();
    match command {
        OutboxCommand::Pending => out.pending(&store.operate().outbox_pending().await?),
        OutboxCommand::Lag => out.lag(store.operate().outbox_lag().await?),
        OutboxCommand::Leases { limit } => out.leases(&store.operate().outbox_leases(limit).await?),
        OutboxCommand::Blocked { limit } => {
            out.blocked(&store.operate().outbox_blocked(limit).await?)
        }
        OutboxCommand::Errors { id } => {
            let errors = store.operate().event_errors(&id).await?;
            if errors.is_empty() && !in_outbox(store, &id).await? {
                return Err(Fault::Own(Failure::new(
                    exit::NOT_FOUND,
                    format!(
                        "no event {id:?} in the outbox (published, discarded, or mistyped): \
                         `idem outbox dead --list` and `idem outbox leases` list ids"
                    ),
                )));
            }
            out.errors(&errors);
        }
        OutboxCommand::Relays => out.relays(&store.operate().outbox_relays().await?),
        OutboxCommand::Dead {
            list,
            reason,
            limit,
        } => {
            if list || reason.is_some() {
                let selection = reason.map_or(DeadSelection::All, DeadSelection::Reason);
                let events = store.operate().dead_events_in(&selection, limit).await?;
                out.dead(&events, Some(store.operate().redrive_max_age()));
            } else {
                out.reasons(&store.operate().dead_reasons().await?);
            }
        }
        OutboxCommand::Redrive {
            which,
            dry_run,
            force,
            yes,
        } => {
            let action = Bulk::Redrive { force };
            bulk(audited, out, &selection(which), action, dry_run, yes).await?;
        }
        OutboxCommand::Discard {
            which,
            dry_run,
            yes,
        } => bulk(audited, out, &selection(which), Bulk::Discard, dry_run, yes).await?,
    }
    Ok(())
}

/// A bulk action on dead events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bulk {
    /// Make them pending again; `force`: those outside the re-drive window too.
    Redrive { force: bool },
    /// Delete them.
    Discard,
}

impl Bulk {
    /// As "would re-drive" says it.
    fn verb(self) -> &'static str {
        match self {
            Self::Redrive { .. } => "re-drive",
            Self::Discard => "discard",
        }
    }

    /// As "nothing re-driven" says it.
    fn done(self) -> &'static str {
        match self {
            Self::Redrive { .. } => "re-driven",
            Self::Discard => "discarded",
        }
    }

    /// The re-drive window `max_age`, for a re-drive: what its events are listed beside.
    fn window(self, max_age: Duration) -> Option<Duration> {
        matches!(self, Self::Redrive { .. }).then_some(max_age)
    }
}

/// How many of the events a bulk action counted its preview lists, as the console's does.
const PREVIEW_ROWS: u32 = 20;

/// `action` on the dead events `selection` names, as the console takes it: first a
/// preview (how many, the first of them, and their bound: the highest `seq` and the
/// instant it saw), which is all a dry run prints; then, once confirmed (asked on the
/// terminal, naming the count, or `--yes`), the action within that bound. So it touches
/// at most the events counted and shown: one parked since is left as it is, and when the
/// bound holds more than were counted (one parked by a transaction that was running
/// during the preview), nothing is done and the command exits 7.
async fn bulk(
    audited: &Audited<'_>,
    out: &Out,
    selection: &DeadSelection,
    action: Bulk,
    dry_run: bool,
    yes: bool,
) -> Result<(), Fault> {
    let store = audited.store();
    let filter = EventFilter::from(selection);
    let preview = store.operate().dead_preview(&filter, PREVIEW_ROWS).await?;
    let max_age = store.operate().redrive_max_age();
    if dry_run {
        dry(out, action, &preview, max_age);
        return Ok(());
    }
    let Some(bound) = preview.bound else {
        return Err(matched_nothing(selection, action.done()));
    };
    let (n, outside) = (preview.events, preview.outside_window);
    let question = match action {
        // Refused before asking: a yes would be refused all the same.
        Bulk::Redrive { force: false } if outside > 0 => {
            return Err(outside_window(outside, n, max_age, None));
        }
        Bulk::Redrive { force: true } if outside > 0 => format!(
            "Re-drive {n} dead event(s), {outside} of them written more than the re-drive \
             window ({}) ago? Their consumers may apply those a second time.",
            format_age(max_age)
        ),
        Bulk::Redrive { .. } => {
            format!("Re-drive {n} dead event(s)? They will be published again.")
        }
        Bulk::Discard => {
            format!("Discard {n} dead event(s)? They will never be published.")
        }
    };
    let mut shown = vec![format!(
        "{n} dead event(s) selected ({filter}) as of {}:",
        format_time(bound.taken_at())
    )];
    shown.extend(output::preview_lines(&preview, action.window(max_age)));
    confirm(yes, &shown, &question)?;
    let done = match action {
        Bulk::Redrive { force } => audited.redrive_confirmed(&filter, &bound, force).await,
        Bulk::Discard => audited.discard_confirmed(&filter, &bound).await,
    };
    let done = done.map_err(|e| match e {
        ConfirmError::Changed { bounded, previewed } => Fault::Own(Failure::new(
            exit::CHANGED,
            format!(
                "{bounded} dead event(s) were within the preview's bound when it acted, not \
                 the {previewed} it counted (one was parked by a transaction that was running \
                 during the preview): nothing {}; run the command again to count them anew",
                action.done()
            ),
        )),
        // An event came of age between the preview and the act.
        ConfirmError::OutsideWindow {
            selected,
            outside,
            oldest,
            max_age,
        } => outside_window(outside, selected, max_age, Some(oldest)),
        ConfirmError::Database(e) => Fault::Database(e),
        other => Fault::Own(Failure::new(exit::FAILED, other.to_string())),
    })?;
    if done.moved == 0 {
        return Err(Fault::Own(Failure::new(
            exit::NOT_FOUND,
            format!(
                "the {} dead event(s) the preview counted left the dead list before the {} \
                 (another operator re-drove or discarded them): nothing {}{}",
                done.previewed,
                action.verb(),
                action.done(),
                parked_since(&done, &filter)
            ),
        )));
    }
    let moved = done.moved;
    let (what, mut message) = match action {
        Bulk::Redrive { .. } => (
            "redriven",
            format!("re-drove {moved} dead event(s): they are pending again"),
        ),
        Bulk::Discard => ("discarded", format!("discarded {moved} dead event(s)")),
    };
    if moved < done.previewed {
        message.push_str(&format!(
            "; {} of the {} counted had left the dead list meanwhile",
            done.previewed - moved,
            done.previewed
        ));
    }
    message.push_str(&parked_since(&done, &filter));
    out.confirmed(what, &done, &message);
    Ok(())
}

/// The end of a confirmed action's line when events matching `filter` were parked after
/// its preview: it left them as they are.
fn parked_since(done: &Confirmed, filter: &EventFilter) -> String {
    if done.left == 0 {
        return String::new();
    }
    format!(
        "; {} dead event(s) parked since the preview match ({filter}) too: left as they \
         are, run the command again for them",
        done.left
    )
}

/// A re-drive refused because `outside` of the `selected` dead events are outside the
/// re-drive window `max_age` (the oldest written `oldest` ago, when known): exit 2, as an
/// action refused without `--yes`, for the operator decides.
fn outside_window(
    outside: u64,
    selected: u64,
    max_age: Duration,
    oldest: Option<Duration>,
) -> Fault {
    let oldest = oldest.map_or(String::new(), |age| {
        format!(", the oldest {} ago", format_age(age))
    });
    Fault::Own(Failure::new(
        exit::USAGE,
        format!(
            "{outside} of the {selected} selected dead event(s) were written more than the \
             re-drive window ({}) ago{oldest}: their consumers may have forgotten a first \
             delivery and would apply them again; nothing was re-driven; `idem outbox dead \
             --list` shows their ages: pass --force to re-drive them anyway",
            format_age(max_age)
        ),
    ))
}

/// What `action` would do, from its `preview`: how many events, how many of them are
/// outside the re-drive window `max_age` (for a re-drive), and the first of them.
fn dry(out: &Out, action: Bulk, preview: &DeadPreview, max_age: Duration) {
    let n = preview.events;
    let verb = action.verb();
    let window = action.window(max_age);
    let outside = window.map_or(0, |_| preview.outside_window);
    // Without --force, one event outside the window stops the whole re-drive.
    let needs_force = outside > 0 && action == Bulk::Redrive { force: false };
    if out.json {
        let mut answer = json!({
            "dry_run": true,
            "would": verb,
            "events": n,
            "list": output::listed(&preview.first, window),
        });
        if window.is_some() {
            answer["redrive_max_age_secs"] = json!(max_age.as_secs_f64());
            answer["outside_window"] = json!(outside);
            answer["needs_force"] = json!(needs_force);
        }
        out.print_json(&answer);
        return;
    }
    let max_age = format_age(max_age);
    if needs_force {
        say!(
            "would re-drive nothing: {outside} of {n} dead event(s) were written more than the \
             re-drive window ({max_age}) ago, and need --force; nothing moved (--dry-run)"
        );
    } else if outside > 0 {
        say!(
            "would {verb} {n} dead event(s), {outside} of them written more than the re-drive \
             window ({max_age}) ago (--force); nothing moved (--dry-run)"
        );
    } else {
        say!("would {verb} {n} dead event(s); nothing moved (--dry-run)");
    }
    if n > 0 {
        for line in output::preview_lines(preview, window) {
            say!("{line}");
        }
    }
}

fn selection(which: Which) -> DeadSelection {
    if which.all {
        DeadSelection::All
    } else if let Some(reason) = which.reason {
        DeadSelection::Reason(reason)
    } else {
        DeadSelection::Ids(which.id)
    }
}

/// How many principals a "not found" names, before "and N more".
const HOLDERS_NAMED: u32 = 5;

/// For a key looked up without a principal: the principals that hold it in `scope`, as
/// the end of a "not found" line (empty when a principal was given, or none holds it).
async fn holders(store: &Store, scope: &str, principal: &str, key: &str) -> Result<String, Fault> {
    if !principal.is_empty() {
        return Ok(String::new());
    }
    let (named, holders) = store
        .operate()
        .key_principals(scope, key, HOLDERS_NAMED)
        .await?;
    if named.is_empty() {
        return Ok(String::new());
    }
    let mut names = named
        .iter()
        .map(|p| format!("{p:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    let more = holders.saturating_sub(named.len() as u64);
    if more > 0 {
        names.push_str(&format!(" and {more} more"));
    }
    Ok(format!(
        "; the key is held under a principal: pass --principal ({names})"
    ))
}

/// An action whose `selection` matched no dead event: exit 3, nothing `done`.
fn matched_nothing(selection: &DeadSelection, done: &str) -> Fault {
    let asked = match selection {
        DeadSelection::All => "there are no dead events".to_owned(),
        DeadSelection::Reason(reason) => format!("no dead event has the reason {reason:?}"),
        DeadSelection::Ids(ids) => format!("no dead event has the id {}", ids.join(" or ")),
    };
    Fault::Own(Failure::new(
        exit::NOT_FOUND,
        format!("{asked} (`idem outbox dead` lists them): nothing {done}"),
    ))
}

fn of(principal: &str) -> String {
    if principal.is_empty() {
        String::new()
    } else {
        format!(" of principal {principal:?}")
    }
}

/// Asks `question` on the terminal unless `yes`, after the lines `shown` (what the action
/// would touch); refuses (exit 2) when stdin is no terminal to ask on.
fn confirm(yes: bool, shown: &[String], question: &str) -> Result<(), Fault> {
    if yes {
        return Ok(());
    }
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Fault::Own(Failure::new(
            exit::USAGE,
            "refusing without --yes: standard input is not a terminal to ask on",
        )));
    }
    for line in shown {
        eprintln!("{line}");
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush().ok();
    let mut answer = String::new();
    stdin.lock().read_line(&mut answer).ok();
    if matches!(answer.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(Fault::Own(Failure::new(
            exit::USAGE,
            "not confirmed: nothing done",
        )))
    }
}

/// Connects once, alone, so that a failure to connect says why: the pool would only
/// say that it timed out, after retrying.
async fn connect(options: &PgConnectOptions, target: &Target) -> Result<(), Failure> {
    use sqlx::{ConnectOptions, Connection};
    let server = &target.server;
    let error = match tokio::time::timeout(CONNECT_TIMEOUT, options.connect()).await {
        Ok(Ok(connection)) => {
            connection.close().await.ok();
            return Ok(());
        }
        Ok(Err(error)) => error,
        Err(_) => {
            return Err(Failure::new(
                exit::UNREACHABLE,
                format!(
                    "cannot reach PostgreSQL at {server}: no answer within {} s",
                    CONNECT_TIMEOUT.as_secs()
                ),
            ))
        }
    };
    let unreachable = |why: String| Err(Failure::new(exit::UNREACHABLE, why));
    match &error {
        sqlx::Error::Io(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => unreachable(
            format!("cannot reach PostgreSQL at {server}: connection refused (nothing listens on that port)"),
        ),
        // It answered in another protocol, or hung up mid-handshake (PostgreSQL answers a
        // startup it refuses with an error message): the wrong port, another server on it.
        sqlx::Error::Protocol(_) | sqlx::Error::Decode(_) => unreachable(format!(
            "what answers at {server} is not PostgreSQL (check the port): {error}"
        )),
        sqlx::Error::Io(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::InvalidData
                    | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            unreachable(format!(
                "what answers at {server} is not PostgreSQL (check the port): {error}"
            ))
        }
        _ => Err(database(&error, target)),
    }
}

/// The privileges `command` needs on idem's tables, for a "permission denied".
fn privileges(command: &Command) -> &'static str {
    match command {
        Command::Migrate { .. } => "CREATE on the schema",
        Command::Verify
        | Command::Key(
            KeyCommand::Status { .. }
            | KeyCommand::List { .. }
            | KeyCommand::Abandoned { .. }
            | KeyCommand::Counts { .. },
        )
        | Command::Outbox(
            OutboxCommand::Pending
            | OutboxCommand::Lag
            | OutboxCommand::Leases { .. }
            | OutboxCommand::Blocked { .. }
            | OutboxCommand::Errors { .. }
            | OutboxCommand::Relays
            | OutboxCommand::Dead { .. },
        ) => "SELECT",
        Command::Outbox(
            OutboxCommand::Redrive { dry_run: true, .. }
            | OutboxCommand::Discard { dry_run: true, .. },
        )
        | Command::Key(KeyCommand::Abandon { dry_run: true, .. }) => "SELECT",
        Command::Key(KeyCommand::Abandon { .. }) => "SELECT, INSERT and UPDATE",
        Command::Key(KeyCommand::Complete { .. }) => "SELECT and UPDATE",
        Command::Key(KeyCommand::Purge { .. } | KeyCommand::Sweep { .. })
        | Command::Outbox(OutboxCommand::Discard { .. }) => "SELECT and DELETE",
        Command::Outbox(OutboxCommand::Redrive { .. }) => "SELECT and UPDATE",
        Command::Audit { .. } => "SELECT",
    }
}

/// The privileges `command` needs on the audit table: its actions insert their row, `idem
/// audit` reads them; a dry run and the other commands do not touch it.
fn audit_privileges(command: &Command) -> &'static str {
    match command {
        Command::Key(
            KeyCommand::Purge { .. }
            | KeyCommand::Sweep { .. }
            | KeyCommand::Abandon { dry_run: false, .. }
            | KeyCommand::Complete { .. },
        )
        | Command::Outbox(
            OutboxCommand::Redrive { dry_run: false, .. }
            | OutboxCommand::Discard { dry_run: false, .. },
        ) => "INSERT",
        Command::Audit { .. } => "SELECT",
        _ => "nothing",
    }
}

/// A database error as one line and an exit code.
fn database(error: &sqlx::Error, target: &Target) -> Failure {
    let Target {
        server,
        user,
        privileges,
        audit,
    } = target;
    if idem::sqlstate::is_unavailable(error) {
        return Failure::new(
            exit::UNREACHABLE,
            format!("cannot reach PostgreSQL at {server}: {error}"),
        );
    }
    let (code, message) = match error {
        sqlx::Error::Database(e) => (e.code().map(|c| c.into_owned()), e.message().to_owned()),
        other => (None, other.to_string()),
    };
    match code.as_deref() {
        Some("42P01" | "3F000") => Failure::new(
            exit::TABLES,
            format!("{message} in {server}: check --table and --outbox-table, or create the tables with `idem migrate`"),
        ),
        Some("42703") => Failure::new(
            exit::TABLES,
            format!("{message} in {server}: the table is older than this idem; run `idem migrate`"),
        ),
        // PostgreSQL names the object ("permission denied for table idem_outbox"), not
        // the privilege: the command knows which it needs.
        Some("42501") => {
            let on = message
                .strip_prefix("permission denied for ")
                .unwrap_or("idem's tables");
            // An action's audit row: an insert into the audit table, which takes the next
            // value of its `id` sequence.
            let needs = if on.strip_prefix("table ") == Some(audit.0.as_str()) {
                audit.1
            } else if on.starts_with("sequence ") {
                "USAGE"
            } else {
                privileges
            };
            Failure::new(
                exit::PERMISSION,
                format!("{message} (as user {user:?} on {server}): this command needs {needs} on {on}"),
            )
        }
        Some("28P01" | "28000") => Failure::new(exit::PERMISSION, format!("{message} (on {server})")),
        Some("3D000") => Failure::new(exit::UNREACHABLE, format!("{message} (on {server})")),
        _ => Failure::new(exit::FAILED, format!("{server}: {message}")),
    }
}

/// A [`VerifyError`] as one line and an exit code.
fn verify(error: VerifyError, target: &Target) -> Failure {
    match error {
        VerifyError::Database(e) => database(&e, target),
        // The CLI's own command first: the runtime's message suggests the library's.
        VerifyError::MissingTable { table } => Failure::new(
            exit::TABLES,
            format!(
                "{}: the idempotency table `{table}` does not exist: create idem's tables with \
                 `idem migrate` (the same flags), or `Store::migrate()` at the service's start",
                target.server
            ),
        ),
        // The role may not use idem's tables: as PostgreSQL's own 42501.
        e @ VerifyError::Privileges { .. } => {
            Failure::new(exit::PERMISSION, format!("{}: {e}", target.server))
        }
        other => Failure::new(exit::TABLES, format!("{}: {other}", target.server)),
    }
}

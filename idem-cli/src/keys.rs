//! `idem key ..`: one key's record and steps, lists and counts, and the actions on a
//! key (purge, sweep, abandon, complete), each recorded in the audit trail.

use super::*;

/// A key command; its actions are recorded in the audit trail as `audited`'s operator's.
pub(crate) async fn key(
    audited: &Audited<'_>,
    out: &Out,
    command: KeyCommand,
) -> Result<(), Fault> {
    let store = audited.store();
    match command {
        KeyCommand::Status {
            scope,
            key,
            principal,
            body,
        } => {
            let found = store.operate().key(&scope, &principal, &key, body).await?;
            let steps = store
                .operate()
                .key_steps(&scope, &principal, &key, body)
                .await?;
            if found.is_none() && steps.is_empty() {
                return Err(Fault::Own(Failure::new(
                    exit::NOT_FOUND,
                    format!(
                        "no committed record of key {key:?} in scope {scope:?}{}, and no recorded step{}",
                        of(&principal),
                        holders(store, &scope, &principal, &key).await?
                    ),
                )));
            }
            out.key(found.as_ref(), &steps);
        }
        KeyCommand::List {
            scope,
            principal,
            older_than,
            expired,
            limit,
        } => {
            let mut filter = KeyFilter::default();
            filter.scope = scope;
            filter.principal = principal;
            filter.older_than = older_than;
            filter.include_expired = expired;
            filter.limit = limit;
            out.keys(&store.operate().keys(&filter).await?);
        }
        KeyCommand::Abandoned {
            idle_for,
            scope,
            principal,
            prefix,
            completion,
            limit,
            after,
        } => {
            let mut filter = AbandonedFilter::default();
            filter.idle_for = Some(idle_for);
            filter.scope = scope;
            filter.principal = principal;
            filter.key_prefix = prefix;
            filter.completion = completion.map(Into::into);
            let page = store
                .operate()
                .abandoned_page(&filter, after.as_ref(), limit)
                .await?;
            out.abandoned(&page, idle_for, after.is_none());
        }
        KeyCommand::Counts { expiring_within } => {
            out.counts(&store.operate().key_counts(expiring_within).await?);
        }
        KeyCommand::Purge {
            scope,
            key,
            principal,
            yes,
        } => {
            let what = format!("key {key:?} in scope {scope:?}{}", of(&principal));
            confirm(yes, &[], &format!("Purge the record of {what}?"))?;
            let n = audited.purge_key(&scope, &principal, &key).await?;
            if n == 0 {
                return Err(Fault::Own(Failure::new(
                    exit::NOT_FOUND,
                    format!(
                        "no committed record of {what}{}",
                        holders(store, &scope, &principal, &key).await?
                    ),
                )));
            }
            out.moved("purged", n, &format!("purged {n} record(s) of {what}"));
        }
        KeyCommand::Sweep { batch } => {
            let n = audited.purge_expired(batch).await?;
            out.moved("swept", n, &format!("swept {n} expired record(s)"));
        }
        KeyCommand::Abandon {
            scope,
            key,
            principal,
            dry_run,
            yes,
        } => abandon(audited, out, &scope, &principal, &key, dry_run, yes).await?,
        KeyCommand::Complete {
            scope,
            key,
            principal,
        } => complete(audited, out, &scope, &principal, &key).await?,
    }
    Ok(())
}

/// `idem key abandon`: gives a request with live steps up for good, after a dry run or a
/// confirmation.
async fn abandon(
    audited: &Audited<'_>,
    out: &Out,
    scope: &str,
    principal: &str,
    key: &str,
    dry_run: bool,
    yes: bool,
) -> Result<(), Fault> {
    let store = audited.store();
    let what = format!("key {key:?} in scope {scope:?}{}", of(principal));
    let steps = live_steps(store, scope, principal, key).await?;
    if steps.is_empty() {
        let hint = holders(store, scope, principal, key).await?;
        return Err(no_live_steps(&what, "abandoned", &hint));
    }
    let named = steps.join(", ");
    if dry_run {
        if out.json {
            out.print_json(&json!({ "dry_run": true, "would": "abandon", "steps": steps }));
        } else {
            say!(
                "would abandon {what}: the service's completer would undo each of its \
                 steps ({named}) that has an undo registered, the last first (a step \
                 without one is NOT undone, and the 410 and the completer's audit row \
                 name it), answering 409 meanwhile and 410 after; nothing done \
                 (--dry-run)"
            );
        }
        return Ok(());
    }
    confirm(
        yes,
        &[],
        &format!(
            "Abandon {what} for good? The service's completer will undo each of its \
             steps ({named}) that has an undo registered, the last first; a step \
             without one is NOT undone (the 410 and the completer's audit row name \
             it). Its key will answer 409 meanwhile, then 410."
        ),
    )?;
    if !audited.abandon_request(scope, principal, key).await? {
        return Err(no_live_steps(&what, "abandoned", ""));
    }
    out.moved(
        "abandoned",
        1,
        &format!(
            "abandoned {what}: the service's completer will undo its steps that have \
             an undo registered and answer 410 to its key from then on, naming any \
             step it did not undo"
        ),
    );
    Ok(())
}

/// `idem key complete`: sends a request with live steps to be completed now.
async fn complete(
    audited: &Audited<'_>,
    out: &Out,
    scope: &str,
    principal: &str,
    key: &str,
) -> Result<(), Fault> {
    let store = audited.store();
    let what = format!("key {key:?} in scope {scope:?}{}", of(principal));
    if !audited.complete_request(scope, principal, key).await? {
        if live_steps(store, scope, principal, key).await?.is_empty() {
            let hint = holders(store, scope, principal, key).await?;
            return Err(no_live_steps(&what, "completed", &hint));
        }
        return Err(Fault::Own(Failure::new(
            exit::NOT_FOUND,
            format!(
                "{what} stored no request to run again (its endpoint is not \
                 completable): nothing completed; `idem key abandon` gives it up"
            ),
        )));
    }
    out.moved(
        "completing",
        1,
        &format!(
            "sent {what} to be completed: the completer will run it at its next look, \
             its failures forgotten"
        ),
    );
    Ok(())
}

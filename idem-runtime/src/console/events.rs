//! The outbox's pages (pending and dead events, one event, the consumers' dead letters,
//! an event's request) and the dead events' actions (re-drive, discard), each previewed
//! before it is confirmed.

use super::form::{filled, lenient, page_size, parsed, present, After, Age, Fields};
use super::*;

/// What the outbox's lists, and the dead events' previews and confirmations, read: the
/// events named (`id`, repeated; `reason`; `topic`; `ordering_key`, a prefix;
/// `older_than`, an age; none of them, or `all`: every event), the list's page (`after`,
/// `limit`, `done`), and an action's token, bound (`through`, `as_of`, `expected`) and
/// `force`.
#[derive(Deserialize, Default)]
pub(super) struct EventFields {
    #[serde(default)]
    id: Vec<String>,
    reason: Option<String>,
    #[serde(default, deserialize_with = "filled")]
    topic: Option<String>,
    #[serde(default, deserialize_with = "filled")]
    ordering_key: Option<String>,
    #[serde(default)]
    older_than: Age,
    #[serde(default, deserialize_with = "parsed")]
    after: Option<After>,
    #[serde(default, deserialize_with = "lenient")]
    limit: Option<u32>,
    done: Option<String>,
    #[serde(default)]
    csrf: String,
    #[serde(default, deserialize_with = "lenient")]
    through: Option<i64>,
    #[serde(default, deserialize_with = "lenient")]
    as_of: Option<i64>,
    #[serde(default, deserialize_with = "lenient")]
    expected: Option<u64>,
    #[serde(default, deserialize_with = "present")]
    force: bool,
}

impl EventFields {
    /// The events the fields name.
    fn filter(&self) -> EventFilter {
        let ids: Vec<String> = self
            .id
            .iter()
            .filter(|id| !id.is_empty())
            .cloned()
            .collect();
        EventFilter {
            ids: (!ids.is_empty()).then_some(ids),
            reason: self.reason.clone(),
            topic: self.topic.clone(),
            ordering_key: self.ordering_key.clone(),
            older_than: self.older_than.age,
        }
    }

    /// The bound a confirmation carries, if it carries all of it.
    fn bound(&self) -> Option<DeadBound> {
        Some(DeadBound::new(self.through?, self.as_of?, self.expected?))
    }

    /// Where a list's page starts.
    fn after(&self) -> Option<i64> {
        self.after.map(|After(seq)| seq)
    }
}

/// The pending events, filtered, a page at a time after `after`.
pub(super) async fn pending(
    State(console): Console_,
    viewer: Viewer,
    Fields(fields): Fields<EventFields>,
) -> Response {
    let (filter, after) = (fields.filter(), fields.after());
    let limit = page_size(fields.limit, 100);
    let store = &console.store;
    let (page, relays) = match tokio::try_join!(
        store.operate().pending_events(&filter, after, limit),
        store.operate().outbox_relays(),
    ) {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&viewer, None);
    let shown = pages::Listed {
        filter: &filter,
        older_than: &fields.older_than.written,
        limit,
        paged: after.is_some(),
    };
    html(
        StatusCode::OK,
        pages::pending(&frame, &shown, &page, &relays),
    )
}

/// One pending event: its row, the relay that holds it, its failed publishes. A dead
/// event's id is sent to its own page.
pub(super) async fn pending_event(
    State(console): Console_,
    viewer: Viewer,
    Fields(q): Fields<EventQuery>,
) -> Response {
    let store = &console.store;
    let one = EventFilter {
        ids: Some(vec![q.id.clone()]),
        ..EventFilter::default()
    };
    let (page, errors, relays) = match tokio::try_join!(
        store.operate().pending_events(&one, None, 1),
        store.operate().event_errors(&q.id),
        store.operate().outbox_relays(),
    ) {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let found = page.rows.first();
    if found.is_none() {
        match store.operate().dead_event(&q.id, false).await {
            Ok(Some(_)) => {
                return see_other(&format!(
                    "{}/dead/event?id={}",
                    viewer.base,
                    pages::encode(&q.id)
                ))
            }
            Ok(None) => {}
            Err(e) => return failed(e),
        }
    }
    let frame = console.frame(&viewer, None);
    let status = if found.is_some() {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    };
    html(
        status,
        pages::pending_event(&frame, &q.id, found, &errors, &relays),
    )
}

/// The dead events: grouped by reason, and listed, filtered, a page at a time.
pub(super) async fn dead(
    State(console): Console_,
    viewer: Viewer,
    Fields(fields): Fields<EventFields>,
) -> Response {
    let (filter, after) = (fields.filter(), fields.after());
    let limit = page_size(fields.limit, 100);
    let store = &console.store;
    let (reasons, page, matching) = match tokio::try_join!(
        store.operate().dead_reasons(),
        store.operate().dead_page(&filter, after, limit),
        store.operate().dead_matching(&filter),
    ) {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&viewer, fields.done.clone());
    let shown = pages::Listed {
        filter: &filter,
        older_than: &fields.older_than.written,
        limit,
        paged: after.is_some(),
    };
    let max_age = store.operate().redrive_max_age();
    html(
        StatusCode::OK,
        pages::dead(&frame, &shown, &reasons, &page, matching, max_age),
    )
}

#[derive(Deserialize)]
pub(super) struct EventQuery {
    id: String,
}

pub(super) async fn dead_event(
    State(console): Console_,
    viewer: Viewer,
    Fields(q): Fields<EventQuery>,
) -> Response {
    let store = &console.store;
    let (found, errors) = match tokio::try_join!(
        store.operate().dead_event(&q.id, console.show_bodies),
        store.operate().event_errors(&q.id),
    ) {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&viewer, None);
    let status = if found.is_some() {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    };
    let max_age = console.store.operate().redrive_max_age();
    html(
        status,
        pages::dead_event(&frame, &q.id, found.as_ref(), &errors, max_age),
    )
}

/// What the dead letters' page reads: how many to show.
#[cfg(any(feature = "nats", feature = "amqp"))]
#[derive(Deserialize)]
pub(super) struct LetterFields {
    #[serde(default, deserialize_with = "lenient")]
    limit: Option<u32>,
}

/// The consumers' dead letters, from their JetStream stream (the newest) or their
/// RabbitMQ queue (the oldest): `limit` of them (50 by default, at most 500).
#[cfg(any(feature = "nats", feature = "amqp"))]
pub(super) async fn dead_letters(
    State(console): Console_,
    viewer: Viewer,
    Fields(fields): Fields<LetterFields>,
) -> Response {
    let Some(source) = &console.dead_letters else {
        return page_error(
            StatusCode::NOT_FOUND,
            "No dead letters' source is configured.",
        );
    };
    let limit = page_size(fields.limit, 50);
    let (read, from) = read_dead_letters(source, limit as usize).await;
    let letters = match read {
        Ok(letters) => letters,
        Err(Unread::Failed(error)) => {
            tracing::warn!(target: "idem::console", %error, "idem console: reading the dead letters failed");
            return page_error(StatusCode::SERVICE_UNAVAILABLE, &error);
        }
        Err(Unread::TimedOut) => {
            return page_error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!(
                    "The broker did not answer within {} s: the dead letters of {} {:?} \
                     cannot be read now.",
                    LETTERS_WITHIN.as_secs(),
                    from.kind,
                    from.name
                ),
            )
        }
    };
    let frame = console.frame(&viewer, None);
    html(
        StatusCode::OK,
        pages::dead_letters(&frame, &from, limit, &letters),
    )
}

/// How long the dead letters' page waits for the broker.
#[cfg(any(feature = "nats", feature = "amqp"))]
const LETTERS_WITHIN: Duration = Duration::from_secs(10);

/// Why the dead letters could not be read.
#[cfg(any(feature = "nats", feature = "amqp"))]
pub(super) enum Unread {
    /// The broker answered with an error, said here.
    Failed(String),
    /// The broker did not answer within [`LETTERS_WITHIN`].
    TimedOut,
}

/// Reads `limit` dead letters from `source`, within [`LETTERS_WITHIN`] (a broker that does
/// not answer is said so, not waited for), as the page shows them; and where they were
/// read.
#[cfg(any(feature = "nats", feature = "amqp"))]
pub(super) async fn read_dead_letters(
    source: &DeadLetters,
    limit: usize,
) -> (Result<Vec<pages::Letter>, Unread>, pages::LettersFrom) {
    match source {
        #[cfg(feature = "nats")]
        DeadLetters::JetStream { jetstream, stream } => {
            let read = crate::outbox::nats::dead_letters(jetstream, stream, limit);
            let from = pages::LettersFrom {
                kind: "the JetStream stream",
                name: stream.clone(),
                order: "newest first",
            };
            (within(read).await, from)
        }
        #[cfg(feature = "amqp")]
        DeadLetters::Amqp { connection, queue } => {
            let read = crate::outbox::amqp::dead_letters(connection, queue, limit);
            let from = pages::LettersFrom {
                kind: "the RabbitMQ queue",
                name: queue.clone(),
                order: "oldest first",
            };
            (within(read).await, from)
        }
    }
}

/// One broker's dead letters, read within [`LETTERS_WITHIN`], as the page shows them.
#[cfg(any(feature = "nats", feature = "amqp"))]
async fn within<L, E>(
    read: impl std::future::Future<Output = Result<Vec<L>, E>>,
) -> Result<Vec<pages::Letter>, Unread>
where
    pages::Letter: From<L>,
    E: std::fmt::Display,
{
    match tokio::time::timeout(LETTERS_WITHIN, read).await {
        Ok(Ok(letters)) => Ok(letters.into_iter().map(pages::Letter::from).collect()),
        Ok(Err(error)) => Err(Unread::Failed(error.to_string())),
        Err(_) => Err(Unread::TimedOut),
    }
}

/// The request that wrote an outbox event, pending or dead.
pub(super) async fn event_request(
    State(console): Console_,
    viewer: Viewer,
    Fields(q): Fields<EventQuery>,
) -> Response {
    let found = match console.store.operate().event_request(&q.id).await {
        Ok(found) => found,
        Err(e) => return failed(e),
    };
    let frame = console.frame(&viewer, None);
    let status = if found.is_some() {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    };
    html(status, pages::event_request(&frame, &q.id, found.as_ref()))
}

/// Which of the two bulk actions on dead events.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum DeadAction {
    Redrive,
    Discard,
}

impl DeadAction {
    /// Its path under the console's base.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Self::Redrive => "/dead/redrive",
            Self::Discard => "/dead/discard",
        }
    }

    /// Its verb, capitalised, for a button.
    pub(crate) fn verb(self) -> &'static str {
        match self {
            Self::Redrive => "Re-drive",
            Self::Discard => "Discard",
        }
    }
}

pub(super) async fn redrive_preview(
    State(console): Console_,
    viewer: Viewer,
    Fields(fields): Fields<EventFields>,
) -> Response {
    if let Some(refused) = console.read_only(&viewer) {
        return refused;
    }
    preview(&console, &viewer, &fields, DeadAction::Redrive, None).await
}

pub(super) async fn discard_preview(
    State(console): Console_,
    viewer: Viewer,
    Fields(fields): Fields<EventFields>,
) -> Response {
    if let Some(refused) = console.read_only(&viewer) {
        return refused;
    }
    preview(&console, &viewer, &fields, DeadAction::Discard, None).await
}

/// The confirmation page of `action` on the dead events `fields` name: the dry run, and
/// the form that acts on what it counted. `warning` (after a confirmation that found the
/// set changed) is shown above it, with 409.
pub(super) async fn preview(
    console: &Shared,
    viewer: &Viewer,
    fields: &EventFields,
    action: DeadAction,
    warning: Option<String>,
) -> Response {
    let filter = fields.filter();
    let preview = match console.store.operate().dead_preview(&filter, 20).await {
        Ok(preview) => preview,
        Err(e) => return failed(e),
    };
    let frame = console.frame(viewer, None);
    let status = if warning.is_some() {
        StatusCode::CONFLICT
    } else {
        StatusCode::OK
    };
    let max_age = console.store.operate().redrive_max_age();
    html(
        status,
        pages::preview(
            &frame,
            action,
            &filter,
            &preview,
            max_age,
            warning.as_deref(),
        ),
    )
}

pub(super) async fn redrive(
    State(console): Console_,
    viewer: Viewer,
    Fields(fields): Fields<EventFields>,
) -> Response {
    confirm(&console, &viewer, &fields, DeadAction::Redrive).await
}

pub(super) async fn discard(
    State(console): Console_,
    viewer: Viewer,
    Fields(fields): Fields<EventFields>,
) -> Response {
    confirm(&console, &viewer, &fields, DeadAction::Discard).await
}

/// A confirmation of `action`: it acts on the events its preview counted (the filter
/// within the bound the form carries), and only then. A form without a bound (a form
/// made by hand, or one of an earlier version) acts on nothing: it is answered the
/// preview.
pub(super) async fn confirm(
    console: &Shared,
    viewer: &Viewer,
    fields: &EventFields,
    action: DeadAction,
) -> Response {
    let operator = match console.acting(viewer, &fields.csrf) {
        Ok(operator) => operator,
        Err(refused) => return refused.page(),
    };
    let filter = fields.filter();
    let Some(bound) = fields.bound() else {
        return preview(console, viewer, fields, action, None).await;
    };
    let force = action == DeadAction::Redrive && fields.force;
    let audited = console.audited(&operator);
    let done = match action {
        DeadAction::Redrive => audited.redrive_confirmed(&filter, &bound, force).await,
        DeadAction::Discard => audited.discard_confirmed(&filter, &bound).await,
    };
    let verb = match action {
        DeadAction::Redrive => "redrive",
        DeadAction::Discard => "discard",
    };
    let done = match done {
        Ok(done) => done,
        Err(ConfirmError::Changed { bounded, previewed }) => {
            let warning = format!(
                "Nothing was done: {bounded} dead event(s) are within what you confirmed now, \
                 not the {previewed} it counted (one was parked by a transaction that was \
                 running during your preview). Review them again."
            );
            return preview(console, viewer, fields, action, Some(warning)).await;
        }
        Err(ConfirmError::OutsideWindow {
            selected,
            outside,
            oldest,
            max_age,
        }) => {
            tracing::info!(
                target: "idem::console",
                operator = %operator,
                action = verb,
                selection = %filter,
                outside,
                "idem console: re-drive refused, events outside the re-drive window"
            );
            let frame = console.frame(viewer, None);
            let page = pages::redrive_past_window(
                &frame,
                &filter,
                &bound,
                &pages::Window {
                    selected,
                    outside,
                    oldest,
                    max_age,
                },
            );
            return html(StatusCode::CONFLICT, page);
        }
        Err(ConfirmError::Database(e)) => return failed(e),
    };
    tracing::info!(
        target: "idem::console",
        operator = %operator,
        action = verb,
        selection = %filter,
        bound = %bound,
        forced = force,
        events = done.moved,
        left = done.left,
        "idem console: dead events {}",
        if action == DeadAction::Redrive { "re-driven" } else { "discarded" }
    );
    let mut notice = match action {
        DeadAction::Redrive => format!(
            "Re-drove {} dead event(s): they are pending again.",
            done.moved
        ),
        DeadAction::Discard => format!("Discarded {} dead event(s).", done.moved),
    };
    if done.moved < done.previewed {
        notice.push_str(&format!(
            " {} of the {} you confirmed had left the dead list meanwhile.",
            done.previewed - done.moved,
            done.previewed
        ));
    }
    if done.left > 0 {
        notice.push_str(&format!(
            " {} dead event(s) parked after your preview match the filter too; they were left \
             as they are.",
            done.left
        ));
    }
    let mut listed = filter.clone();
    listed.ids = None;
    back(
        &viewer.base,
        &format!("/dead{}", pages::filter_query(&listed)),
        &notice,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(query: &str) -> EventFields {
        serde_html_form::from_str(query).expect("the fields")
    }

    #[test]
    fn a_pages_fields_name_the_events_they_filter() {
        let filter = fields(
            "id=a&id=&id=b&reason=no+stream&topic=+charge.created+&ordering_key=&older_than=2h",
        )
        .filter();
        assert_eq!(filter.ids, Some(vec!["a".to_owned(), "b".to_owned()]));
        assert_eq!(filter.reason.as_deref(), Some("no stream"));
        assert_eq!(filter.topic.as_deref(), Some("charge.created"));
        assert_eq!(filter.ordering_key, None);
        assert_eq!(filter.older_than, Some(Duration::from_secs(7_200)));
        assert!(fields("all=1").filter().is_all());
    }

    #[test]
    fn a_confirmation_carries_its_whole_bound_or_none() {
        let whole = "through=41&as_of=1795860530123456&expected=12";
        assert_eq!(
            fields(whole).bound(),
            Some(DeadBound::new(41, 1_795_860_530_123_456, 12))
        );
        for missing in ["through", "as_of", "expected"] {
            let part: Vec<&str> = whole
                .split('&')
                .filter(|pair| !pair.starts_with(missing))
                .collect();
            assert_eq!(fields(&part.join("&")).bound(), None, "without {missing}");
        }
        assert_eq!(fields("through=x&as_of=1&expected=1").bound(), None);
    }
}

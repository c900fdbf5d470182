//! What idem reports through `tracing`: the fields of its spans and ERROR events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

/// The fields of a span or an event, as text: strings as they are, anything else as its
/// `Debug` form.
#[derive(Default, Clone, Debug)]
pub struct SpanFields(pub HashMap<String, String>);

impl Visit for SpanFields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl SpanFields {
    /// A field as text, if recorded.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    /// A numeric field (the timings), if recorded.
    pub fn number(&self, name: &str) -> Option<f64> {
        self.get(name)?.parse().ok()
    }
}

/// A layer that collects the fields of every span of one name when it closes
/// (`idem.request` by default, `idem.relay` ...), and of every ERROR event.
#[derive(Debug, Clone)]
pub struct ClosedSpans {
    name: &'static str,
    closed: Arc<Mutex<Vec<SpanFields>>>,
    errors: Arc<Mutex<Vec<SpanFields>>>,
}

impl Default for ClosedSpans {
    fn default() -> Self {
        Self::named("idem.request")
    }
}

impl ClosedSpans {
    /// Collects the spans named `name`.
    pub fn named(name: &'static str) -> Self {
        Self {
            name,
            closed: Arc::default(),
            errors: Arc::default(),
        }
    }

    /// The spans closed so far, taken: the next call starts afresh.
    pub fn take(&self) -> Vec<SpanFields> {
        std::mem::take(&mut *self.closed.lock().unwrap())
    }

    /// The ERROR events so far.
    pub fn errors(&self) -> Vec<SpanFields> {
        self.errors.lock().unwrap().clone()
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for ClosedSpans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() == self.name {
            let mut fields = SpanFields::default();
            attrs.record(&mut fields);
            if let Some(span) = ctx.span(id) {
                span.extensions_mut().insert(fields);
            }
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(fields) = span.extensions_mut().get_mut::<SpanFields>() {
                values.record(fields);
            }
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::ERROR {
            let mut fields = SpanFields::default();
            event.record(&mut fields);
            self.errors.lock().unwrap().push(fields);
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            if let Some(fields) = span.extensions_mut().remove::<SpanFields>() {
                self.closed.lock().unwrap().push(fields);
            }
        }
    }
}

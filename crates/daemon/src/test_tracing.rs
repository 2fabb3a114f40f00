//! Tests' tracing subscribers: a test states what it does with each event ([`OnEvent`]) and
//! [`EventSubscriber`] is the rest of a `tracing::Subscriber` (every callsite enabled, spans
//! ignored), written once.

use std::sync::Arc;

/// What a test's subscriber does with one event.
pub(crate) trait OnEvent: Send + Sync + 'static {
    fn on_event(&self, event: &tracing::Event<'_>);
}

impl<T: OnEvent> OnEvent for Arc<T> {
    fn on_event(&self, event: &tracing::Event<'_>) {
        (**self).on_event(event)
    }
}

/// A subscriber that hands every event to `T` and ignores spans.
pub(crate) struct EventSubscriber<T>(pub T);

impl<T: OnEvent> tracing::Subscriber for EventSubscriber<T> {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        self.0.on_event(event)
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

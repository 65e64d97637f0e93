//! OpenTelemetry spans along a message's path (feature `opentelemetry`),
//! named and attributed as the OpenTelemetry messaging conventions say:
//! a `process <topic>` span (kind consumer) per message, continuing the
//! trace of its `traceparent`; a batch's span links to each message's
//! instead (one transaction, many traces); the relay's `send <topic>` span
//! (kind producer) continues the trace its outbox event was made in. Spans
//! go to the global tracer provider the application installs (none: no
//! cost beyond a no-op span).

use opentelemetry::trace::{Link, SpanKind, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue, global};
use rdkafka::message::{Headers as _, Message as _, OwnedHeaders, OwnedMessage};

use crate::pipeline::KafkaHeaders;

use dedup_core::trace::{TRACEPARENT, TRACESTATE};

/// The instrumentation scope of dedup's spans.
const SCOPE: &str = "dedup";

/// An outbox event's stored headers, read as dedup-core reads headers.
struct Stored<'a>(&'a [(String, Vec<u8>)]);

impl dedup_core::Headers for Stored<'_> {
    fn get(&self, name: &str) -> Option<&[u8]> {
        dedup_core::Headers::get(self.0, name)
    }
}

/// What every span of a message says of it.
fn attributes(operation: &'static str, topic: &str) -> Vec<KeyValue> {
    vec![
        KeyValue::new("messaging.system", "kafka"),
        KeyValue::new("messaging.operation.type", operation),
        KeyValue::new("messaging.operation.name", operation),
        KeyValue::new("messaging.destination.name", topic.to_owned()),
    ]
}

/// The context a message is processed in: a new `process <topic>` span,
/// child of the record's trace context if it carries one.
pub(crate) fn process(msg: &OwnedMessage, group: &str) -> Context {
    let parent = dedup_core::trace::parent(&KafkaHeaders(msg.headers()));
    let mut attributes = attributes("process", msg.topic());
    attributes.extend([
        KeyValue::new("messaging.consumer.group.name", group.to_owned()),
        KeyValue::new(
            "messaging.destination.partition.id",
            msg.partition().to_string(),
        ),
        KeyValue::new("messaging.kafka.offset", msg.offset()),
    ]);
    let tracer = global::tracer(SCOPE);
    let span = tracer
        .span_builder(format!("process {}", msg.topic()))
        .with_kind(SpanKind::Consumer)
        .with_attributes(attributes)
        .start_with_context(&tracer, &parent);
    parent.with_span(span)
}

/// The context a batch of messages is processed in, in one transaction: a
/// new trace whose `process <topic>` span links to each message's own
/// span (`each`: their contexts, from [`process`]).
pub(crate) fn batch(messages: &[OwnedMessage], each: &[Context], group: &str) -> Context {
    let Some(first) = messages.first() else {
        return Context::new();
    };
    let links: Vec<Link> = each
        .iter()
        .map(|cx| cx.span().span_context().clone())
        .filter(|sc| sc.is_valid())
        .map(Link::with_context)
        .collect();
    let mut attributes = attributes("process", first.topic());
    attributes.extend([
        KeyValue::new("messaging.consumer.group.name", group.to_owned()),
        KeyValue::new(
            "messaging.destination.partition.id",
            first.partition().to_string(),
        ),
        KeyValue::new("messaging.batch.message_count", messages.len() as i64),
    ]);
    let tracer = global::tracer(SCOPE);
    let span = tracer
        .span_builder(format!("process {}", first.topic()))
        .with_kind(SpanKind::Consumer)
        .with_attributes(attributes)
        .with_links(links)
        .start_with_context(&tracer, &Context::new());
    Context::new().with_span(span)
}

/// The context the relay sends an outbox event in: a `send <topic>` span,
/// child of the context the event was made in (its stored headers).
pub(crate) fn send(topic: &str, headers: &[(String, Vec<u8>)]) -> Context {
    let parent = dedup_core::trace::parent(&Stored(headers));
    let tracer = global::tracer(SCOPE);
    let span = tracer
        .span_builder(format!("send {topic}"))
        .with_kind(SpanKind::Producer)
        .with_attributes(attributes("send", topic))
        .start_with_context(&tracer, &parent);
    parent.with_span(span)
}

/// `work`, run with `cx` as the current context.
pub(crate) fn within<F: std::future::Future>(
    work: F,
    cx: &Context,
) -> opentelemetry::context::WithContext<F> {
    opentelemetry::context::FutureExt::with_context(work, cx.clone())
}

/// `headers` with the trace context of `cx` in place of any they carried:
/// what a record sent on `cx`'s behalf says of its cause. Unchanged when
/// `cx` has no span.
pub(crate) fn with_trace(headers: OwnedHeaders, cx: &Context) -> OwnedHeaders {
    let Some(trace) = dedup_core::trace::headers_of(cx) else {
        return headers;
    };
    let mut out = OwnedHeaders::new_with_capacity(headers.count() + trace.len());
    for h in headers.iter() {
        if h.key != TRACEPARENT && h.key != TRACESTATE {
            out = out.insert(rdkafka::message::Header {
                key: h.key,
                value: h.value,
            });
        }
    }
    for (key, value) in &trace {
        out = out.insert(rdkafka::message::Header {
            key,
            value: Some(value.as_bytes()),
        });
    }
    out
}

//! W3C trace context in Kafka headers (feature `opentelemetry`): how an
//! event's trace is read from its record and written onto the records it
//! causes, as OpenTelemetry's messaging conventions carry it (`traceparent`
//! and `tracestate` headers; Spring Kafka, Karafka and Debezium do the same).
//!
//! The runtime (dedup-kafka's `opentelemetry` feature) continues each
//! record's trace in its processing span and makes that span current while
//! the handler runs, so what the handler writes carries it on: an
//! [`OutboxMessage`](crate::OutboxMessage) takes the current context when it
//! is made.

use std::str::FromStr;

use opentelemetry::Context;
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};

use crate::Headers;

/// The header of the W3C trace context: `00-<trace id>-<span id>-<flags>`.
pub const TRACEPARENT: &str = "traceparent";

/// The header of vendor trace state that goes with it.
pub const TRACESTATE: &str = "tracestate";

/// The remote span context a record's headers carry, if they carry a valid
/// one (version `00`, non-zero ids).
pub fn extract(headers: &dyn Headers) -> Option<SpanContext> {
    let parent = std::str::from_utf8(headers.get(TRACEPARENT)?).ok()?.trim();
    let mut parts = parent.split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    // Version 00 has exactly four fields; a later version may add more.
    if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    if trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
        return None;
    }
    let lower_hex = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if ![version, trace, span, flags].iter().all(|s| lower_hex(s)) {
        return None;
    }
    let trace = TraceId::from_hex(trace).ok()?;
    let span = SpanId::from_hex(span).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    if trace == TraceId::INVALID || span == SpanId::INVALID {
        return None;
    }
    let state = headers
        .get(TRACESTATE)
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| TraceState::from_str(v).ok())
        .unwrap_or_default();
    Some(SpanContext::new(
        trace,
        span,
        TraceFlags::new(flags & 0x01),
        true,
        state,
    ))
}

/// The context a record's processing continues: its remote span, or none.
pub fn parent(headers: &dyn Headers) -> Context {
    match extract(headers) {
        Some(remote) => Context::new().with_remote_span_context(remote),
        None => Context::new(),
    }
}

/// The `traceparent` and `tracestate` headers of `cx`'s span, if it has a
/// valid one (`tracestate` only when it holds something).
pub fn headers_of(cx: &Context) -> Option<Vec<(&'static str, String)>> {
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    let mut out = vec![(
        TRACEPARENT,
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8() & 0x01
        ),
    )];
    let state = sc.trace_state().header();
    if !state.is_empty() {
        out.push((TRACESTATE, state));
    }
    Some(out)
}

/// [`headers_of`] the current context.
pub fn current_headers() -> Option<Vec<(&'static str, String)>> {
    headers_of(&Context::current())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn reads_a_traceparent_and_writes_it_back_the_same() {
        let headers = vec![(TRACEPARENT, PARENT), (TRACESTATE, "congo=t61rcWkgMzE")];
        let remote = extract(&headers).expect("valid");
        assert!(remote.is_remote() && remote.is_sampled());
        assert_eq!(
            format!("{}", remote.trace_id()),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        let cx = Context::new().with_remote_span_context(remote);
        let written = headers_of(&cx).expect("a valid span");
        assert_eq!(
            written,
            vec![
                (TRACEPARENT, PARENT.to_owned()),
                (TRACESTATE, "congo=t61rcWkgMzE".to_owned())
            ]
        );
    }

    #[test]
    fn an_outbox_event_takes_the_current_context_unless_given_its_own() {
        let remote = extract(&vec![(TRACEPARENT, PARENT)]).expect("valid");
        let _current = Context::new().with_remote_span_context(remote).attach();
        let made = crate::OutboxMessage::bytes("t", b"x".to_vec()).with_header("a", "1");
        let header = |(k, v): (&str, &str)| (k.to_owned(), v.as_bytes().to_vec());
        assert_eq!(
            made.headers,
            vec![header((TRACEPARENT, PARENT)), header(("a", "1"))]
        );
        let own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let given = made.with_header(TRACEPARENT, own);
        assert_eq!(
            given.headers,
            vec![header(("a", "1")), header((TRACEPARENT, own))],
            "the caller's replaces the current context's, not beside it"
        );
    }

    #[test]
    fn refuses_what_is_not_a_trace_context() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert!(extract(&vec![(TRACEPARENT, bad)]).is_none(), "{bad:?}");
        }
        assert!(extract(&()).is_none());
        assert!(headers_of(&Context::new()).is_none());
        // A later version keeps the first four fields' meaning.
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what";
        assert!(extract(&vec![(TRACEPARENT, later)]).is_some());
    }
}

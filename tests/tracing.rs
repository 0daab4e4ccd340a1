//! The `tracing` feature: a debug event per removed frame and a summary when the body ends, and
//! an event for each other decision (the guard's strips, grants and refusals, a frame too large,
//! an encoded stream refused), inside the request's span.
#![cfg(feature = "tracing")]

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use http::Request;
use http_body::Body;
use test_support::body::{data, response, Gated};
use test_support::logs::Captured;
use tower::{service_fn, Layer, Service};
use tower_bypass_marker::BypassMarkerLayer;

fn ready<F: Future>(f: F) -> F::Output {
    match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("not ready"),
    }
}

#[test]
fn removed_frames_and_the_summary_are_logged_at_debug() {
    let log = logged(|| {
        poll_then_drop(
            BypassMarkerLayer::new().never_forward("llm_metrics"),
            &[
                "event: x-bypass-remote-prefill\n: true\n\n",
                "data: 1\n\nevent: llm_metrics\ndata: {}\n\n",
            ],
            true,
        );
    });
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 3, "{log}");
    assert!(
        lines[0].contains("removed annotation frame")
            && lines[0].contains("event=\"x-bypass-remote-prefill\"")
            && lines[0].contains("bytes=39"),
        "{log}"
    );
    assert!(
        lines[1].contains("event=\"llm_metrics\"") && lines[1].contains("bytes=29"),
        "{log}"
    );
    assert!(
        lines[2].contains("event stream ended")
            && lines[2].contains("removed_frames=2")
            && lines[2].contains("removed_bytes=68"),
        "{log}"
    );
}

/// Runs `f` with a debug-level subscriber and returns what it logged.
fn logged(f: impl FnOnce()) -> String {
    let captured = Captured::default();
    tracing::subscriber::with_default(captured.subscriber(tracing::Level::DEBUG), f);
    captured.text()
}

/// A filtered body over `chunks`, polled until it waits for more (`close`: until its end), then
/// dropped.
fn poll_then_drop(layer: BypassMarkerLayer, chunks: &[&'static str], close: bool) {
    let gated = Gated::default();
    for &chunk in chunks {
        gated.push(data(chunk));
    }
    if close {
        gated.close();
    }
    let upstream = gated.clone();
    let mut svc = layer.layer(service_fn(move |_req: Request<()>| {
        let body = upstream.clone();
        async { Ok::<_, std::convert::Infallible>(response("text/event-stream", body)) }
    }));
    let res = ready(svc.call(Request::new(()))).unwrap();
    let mut body = pin!(res.into_body());
    let mut cx = Context::from_waker(Waker::noop());
    while let Poll::Ready(Some(Ok(_))) = body.as_mut().poll_frame(&mut cx) {}
}

#[test]
fn a_body_dropped_before_its_end_still_logs_its_summary() {
    let log = logged(|| {
        poll_then_drop(
            BypassMarkerLayer::new(),
            &[
                "event: x-bypass-remote-prefill\n: true\n\ndata: 1\n\n",
                "data: 2",
            ],
            false,
        );
    });
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains("event stream dropped before its end")
            && last.contains("removed_frames=1")
            && last.contains("removed_bytes=39")
            && last.contains("held_bytes=7"),
        "{log}"
    );
    assert_eq!(
        log.matches("removed_frames").count(),
        1,
        "one summary: {log}"
    );
}

#[test]
fn a_body_read_to_its_end_logs_one_summary_only() {
    let log = logged(|| {
        poll_then_drop(BypassMarkerLayer::new(), &["data: 1\n\n"], true);
    });
    assert!(log.contains("event stream ended"), "{log}");
    assert!(!log.contains("dropped before its end"), "{log}");
}

#[test]
fn a_frame_too_large_error_logs_the_summary_with_the_limit() {
    let log = logged(|| {
        let layer = BypassMarkerLayer::new()
            .max_frame_bytes(8)
            .on_overflow(tower_bypass_marker::Overflow::Error);
        poll_then_drop(layer, &["data: 12", "345678901"], false);
    });
    assert!(
        log.contains("event stream failed: a frame outgrew max_frame_bytes")
            && log.contains("limit=8"),
        "{log}"
    );
    assert_eq!(
        log.matches("removed_frames").count(),
        1,
        "one summary: {log}"
    );
}

/// The LF of a CRLF that closes a removed frame, arriving in the next chunk, is the end of that
/// frame: one frame removed, its bytes counted in full, not a second frame.
#[test]
fn a_split_crlf_after_a_removed_frame_counts_as_one_frame() {
    let log = logged(|| {
        poll_then_drop(
            BypassMarkerLayer::new(),
            &[
                "event: x-bypass-remote-prefill\r\n: true\r\n\r",
                "\ndata: 1\r\n\r\n",
            ],
            true,
        );
    });
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 2, "{log}");
    assert!(lines[0].contains("removed annotation frame"), "{log}");
    assert!(
        lines[1].contains("event stream ended")
            && lines[1].contains("removed_frames=1")
            && lines[1].contains("removed_bytes=42"),
        "{log}"
    );
}

/// hyper stops polling a body once `is_end_stream` says it has ended after a data frame, and drops
/// it without polling it to `None`. A body that ended that way ended: its summary says so.
#[test]
fn a_body_that_ends_by_is_end_stream_logs_that_it_ended() {
    let log = logged(|| {
        let gated = Gated::default();
        gated.push(data(
            "event: x-bypass-remote-prefill\n: true\n\ndata: 1\n\n",
        ));
        gated.close();
        let upstream = gated.clone();
        let mut svc = BypassMarkerLayer::new().layer(service_fn(move |_req: Request<()>| {
            let body = upstream.clone();
            async { Ok::<_, std::convert::Infallible>(response("text/event-stream", body)) }
        }));
        let res = ready(svc.call(Request::new(()))).unwrap();
        let mut body = Box::pin(res.into_body());
        let mut cx = Context::from_waker(Waker::noop());
        // As hyper's HTTP/1 and HTTP/2 writers do: after each data frame, stop at the end.
        loop {
            match body.as_mut().poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(_))) if body.is_end_stream() => break,
                Poll::Ready(Some(Ok(_))) => {}
                other => panic!("the body should have ended on its data frame: {other:?}"),
            }
        }
        drop(body);
    });
    assert!(
        log.contains("event stream ended") && log.contains("removed_frames=1"),
        "{log}"
    );
    assert!(!log.contains("dropped before its end"), "{log}");
}

#[test]
fn every_event_fires_inside_the_span_the_request_was_called_in() {
    let log = logged(|| {
        let gated = Gated::default();
        gated.push(data(
            "event: x-bypass-remote-prefill\n: true\n\ndata: 1\n\n",
        ));
        gated.push(data("data: 2"));
        let upstream = gated.clone();
        let mut svc = BypassMarkerLayer::new().layer(service_fn(move |_req: Request<()>| {
            let body = upstream.clone();
            async { Ok::<_, std::convert::Infallible>(response("text/event-stream", body)) }
        }));
        // The call and its future in the request's span (as tower-http's TraceLayer runs them),
        let span = tracing::debug_span!("request", id = 7);
        let res = span.in_scope(|| {
            let req = Request::builder()
                .header(http::header::ACCEPT_ENCODING, "gzip, deflate, br, zstd")
                .body(())
                .unwrap();
            ready(svc.call(req)).unwrap()
        });
        // the body polled and dropped outside it, as hyper does.
        let mut body = Box::pin(res.into_body());
        let mut cx = Context::from_waker(Waker::noop());
        while let Poll::Ready(Some(Ok(_))) = body.as_mut().poll_frame(&mut cx) {}
        drop(body);
    });
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 3, "{log}");
    assert!(lines[0].contains("accept-encoding identity"), "{log}");
    assert!(lines[1].contains("removed annotation frame"), "{log}");
    assert!(
        lines[2].contains("event stream dropped before its end"),
        "{log}"
    );
    for line in lines {
        assert!(
            line.contains("request{id=7}"),
            "outside the request's span: {line}"
        );
    }
}

/// Each decision of the guard and the response side is an event with the fields the crate's docs
/// list, inside the request's span.
#[cfg(feature = "json")]
#[tokio::test]
async fn each_decision_is_a_tracing_event_with_its_fields() {
    use test_support::serve::guarded::{ok, post, send, sse};
    use tracing::Instrument;

    let captured = Captured::default();
    let subscriber = captured.subscriber(tracing::Level::DEBUG);
    let _default = tracing::subscriber::set_default(subscriber);
    let span = tracing::info_span!("request", id = 7);
    let layer = BypassMarkerLayer::dynamo();
    async {
        let body = r#"{"nvext":{"annotations":["x-bypass-remote-prefill:1","request_id"]}}"#;
        send(
            layer.json_guard(),
            &layer,
            post("application/json", body),
            ok(),
        )
        .await;
        send(
            layer.json_guard(),
            &layer,
            post("application/json", "{"),
            ok(),
        )
        .await;
        send(
            layer.json_guard(),
            &layer,
            post("application/json", "{}"),
            sse(&[("content-encoding", "gzip")], "x"),
        )
        .await;
    }
    .instrument(span)
    .await;
    let log = captured.text();
    let line = |needle: &str| {
        log.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} in {log}"))
            .to_owned()
    };
    let stripped = line("router-owned annotation stripped");
    assert!(
        stripped.contains("INFO") && stripped.contains("request{id=7}"),
        "{stripped}"
    );
    assert!(
        stripped.contains("annotation=\"x-bypass-remote-prefill\""),
        "{stripped}"
    );
    let granted = line("annotation granted to the client");
    assert!(
        granted.contains("DEBUG") && granted.contains("annotation=\"request_id\""),
        "{granted}"
    );
    let refused = line("request refused by the guard");
    assert!(
        refused.contains("status=400") && refused.contains("code=\"invalid_json\""),
        "{refused}"
    );
    assert!(
        refused.contains("reason=the request body is not valid JSON"),
        "{refused}"
    );
    let encoded = line("encoded event stream refused");
    assert!(
        encoded.contains("WARN") && encoded.contains("coding=gzip"),
        "{encoded}"
    );
}

#[test]
fn a_frame_forwarded_unfiltered_is_a_warning_with_the_limit() {
    let captured = Captured::default();
    tracing::subscriber::with_default(captured.subscriber(tracing::Level::DEBUG), || {
        let layer = BypassMarkerLayer::new().max_frame_bytes(8);
        let filter = layer
            .event_stream_filter(&tower_bypass_marker::RequestedAnnotations::new())
            .unwrap();
        let out = filter
            .filter_all([&b"data: 0123"[..], b"456789\n\n"])
            .unwrap();
        assert_eq!(out, &b"data: 0123456789\n\n"[..]);
    });
    let log = captured.text();
    assert!(
        log.contains("WARN") && log.contains("forwarded unfiltered") && log.contains("limit=8"),
        "{log}"
    );
}

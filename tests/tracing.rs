//! The `tracing` feature: a debug event per removed frame and a summary when the body ends.
#![cfg(feature = "tracing")]

mod bodies;

use std::future::Future;
use std::io::Write;
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bodies::{data, response, Items};
use http::Request;
use http_body::Body;
use tower::{service_fn, Layer, Service};
use tower_bypass_marker::BypassMarkerLayer;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn ready<F: Future>(f: F) -> F::Output {
    match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("not ready"),
    }
}

#[test]
fn removed_frames_and_the_summary_are_logged_at_debug() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let layer = BypassMarkerLayer::new().never_forward("llm_metrics");
        let mut svc = layer.layer(service_fn(|_req: Request<()>| async {
            let body = Items::new([
                data("event: x-bypass-remote-prefill\n: true\n\n"),
                data("data: 1\n\nevent: llm_metrics\ndata: {}\n\n"),
            ]);
            Ok::<_, std::convert::Infallible>(response("text/event-stream", body))
        }));
        let res = ready(svc.call(Request::new(()))).unwrap();
        let mut body = pin!(res.into_body());
        let mut cx = Context::from_waker(Waker::noop());
        while let Poll::Ready(Some(frame)) = body.as_mut().poll_frame(&mut cx) {
            frame.unwrap();
        }
    });
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
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

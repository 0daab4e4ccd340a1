//! The layer's and the guard's decisions as Prometheus counters: a `FrameObserver` over
//! `prometheus-client`, and `/metrics` beside the API.
//!
//! ```sh
//! cargo run --example prometheus --features json -- --addr 127.0.0.1:3000
//! curl -N localhost:3000/v1/chat/completions -H 'content-type: application/json' \
//!   -d '{"nvext":{"annotations":["x-bypass-remote-prefill:true"]}}'
//! curl localhost:3000/metrics
//! ```
//!
//! The counters, each with the label that tells its series apart:
//!
//! | counter | labels | from |
//! | --- | --- | --- |
//! | `bypass_marker_frames_removed_total` | `annotation` (`""` for SDK-safe mode) | `frame_removed` |
//! | `bypass_marker_frames_forwarded_total` | `annotation` | `frame_forwarded` |
//! | `bypass_marker_annotations_stripped_total` | `annotation` | `annotation_stripped` |
//! | `bypass_marker_annotations_granted_total` | `annotation` | `annotation_granted` |
//! | `bypass_marker_requests_refused_total` | `reason` (the error's code), `status` | `request_refused` |
//! | `bypass_marker_frames_too_large_total` | `reason` (`forwarded` or `failed`) | `frame_too_large` |
//! | `bypass_marker_encoded_streams_refused_total` | `reason` (the coding) | `encoded_stream_refused` |
//!
//! The upstream here is a stand-in that starts every stream with Dynamo's marker; in a gateway it
//! is the proxy to Dynamo (examples/gateway.rs).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use http::{header, StatusCode};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tower_bypass_marker::{BypassMarkerLayer, FrameObserver};

/// The `annotation` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Annotation {
    annotation: String,
}

/// The `reason` label, and a status where there is one.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: String,
    status: Option<u16>,
}

/// The observer the layer calls: one counter family per kind of decision.
#[derive(Default)]
struct Counters {
    removed: Family<Annotation, Counter>,
    forwarded: Family<Annotation, Counter>,
    stripped: Family<Annotation, Counter>,
    granted: Family<Annotation, Counter>,
    refused: Family<Reason, Counter>,
    too_large: Family<Reason, Counter>,
    encoded: Family<Reason, Counter>,
}

fn annotation(name: &str) -> Annotation {
    Annotation {
        annotation: name.to_owned(),
    }
}

fn reason(reason: &str, status: Option<u16>) -> Reason {
    Reason {
        reason: reason.to_owned(),
        status,
    }
}

impl FrameObserver for Counters {
    fn frame_removed(&self, name: Option<&str>, _bytes: usize) {
        self.removed
            .get_or_create(&annotation(name.unwrap_or("")))
            .inc();
    }
    fn frame_forwarded(&self, name: &str) {
        self.forwarded.get_or_create(&annotation(name)).inc();
    }
    fn annotation_stripped(&self, name: &str) {
        self.stripped.get_or_create(&annotation(name)).inc();
    }
    fn annotation_granted(&self, name: &str) {
        self.granted.get_or_create(&annotation(name)).inc();
    }
    fn request_refused(&self, status: StatusCode, code: &str) {
        let labels = reason(code, Some(status.as_u16()));
        self.refused.get_or_create(&labels).inc();
    }
    fn frame_too_large(&self, _limit: usize, forwarded: bool) {
        let outcome = if forwarded { "forwarded" } else { "failed" };
        self.too_large.get_or_create(&reason(outcome, None)).inc();
    }
    fn encoded_stream_refused(&self, coding: &str) {
        self.encoded.get_or_create(&reason(coding, None)).inc();
    }
}

/// The registry holding `counters`' families under their names.
fn registry(counters: &Counters) -> Registry {
    let mut registry = Registry::with_prefix("bypass_marker");
    let families: [(&str, &str, &Family<Annotation, Counter>); 4] = [
        (
            "frames_removed",
            "Annotation frames removed",
            &counters.removed,
        ),
        (
            "frames_forwarded",
            "Annotation frames forwarded to a client that asked",
            &counters.forwarded,
        ),
        (
            "annotations_stripped",
            "Router-owned names stripped from requests",
            &counters.stripped,
        ),
        (
            "annotations_granted",
            "Annotations granted to clients",
            &counters.granted,
        ),
    ];
    for (name, help, family) in families {
        registry.register(name, help, family.clone());
    }
    let families: [(&str, &str, &Family<Reason, Counter>); 3] = [
        (
            "requests_refused",
            "Requests the guard refused",
            &counters.refused,
        ),
        (
            "frames_too_large",
            "Frames over max_frame_bytes",
            &counters.too_large,
        ),
        (
            "encoded_streams_refused",
            "Encoded event streams refused with a 502",
            &counters.encoded,
        ),
    ];
    for (name, help, family) in families {
        registry.register(name, help, family.clone());
    }
    registry
}

/// The app: the API behind the layer and the guard, and `/metrics`.
fn app() -> Router {
    let counters = Arc::new(Counters::default());
    let registry = Arc::new(registry(&counters));
    let bypass = BypassMarkerLayer::dynamo().observe(counters);
    let api = Router::new()
        .route("/v1/chat/completions", post(stream))
        .layer(bypass.clone())
        .layer(bypass.json_guard());
    api.route(
        "/metrics",
        get(move || async move {
            let mut text = String::new();
            encode(&mut text, &registry).expect("writing to a String");
            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
        }),
    )
}

/// A stand-in for the upstream: an event stream that starts with Dynamo's marker.
async fn stream() -> impl IntoResponse {
    let body =
        "event: x-bypass-remote-prefill\n: true\n\ndata: {\"choices\":[]}\n\ndata: [DONE]\n\n";
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from(body),
    )
}

#[tokio::main]
async fn main() -> Result<(), Infallible> {
    let addr = std::env::args()
        .skip_while(|arg| arg != "--addr")
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await.expect("bind");
    println!(
        "listening on http://{}",
        listener.local_addr().expect("addr")
    );
    axum::serve(listener, app()).await.expect("serve");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn post_json(base: &str, body: &str) -> (u16, String) {
        let client = test_support::serve::h1_client();
        let req = http::Request::post(format!("{base}/v1/chat/completions"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.to_owned(),
            )))
            .unwrap();
        let res = client.request(req).await.unwrap();
        let status = res.status().as_u16();
        let (body, _) = test_support::serve::read_all(res.into_body()).await;
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    /// Real requests on loopback, then a scrape: each decision is a series with its label.
    #[tokio::test]
    async fn each_decision_is_a_counter_with_its_label() {
        let addr = test_support::serve::spawn_axum(app()).await;
        let base = format!("http://{addr}");
        let forged = r#"{"nvext":{"annotations":["X-Bypass-Remote-Prefill:true"]}}"#;
        let (status, body) = post_json(&base, forged).await;
        assert_eq!(status, 200);
        assert!(!body.contains("x-bypass-remote-prefill"), "{body}");
        let (status, _) = post_json(&base, "{").await;
        assert_eq!(status, 400);
        let (status, body) = post_json(
            &base,
            r#"{"nvext":{"annotations":["x-bypass-remote-prefill"]}}"#,
        )
        .await;
        assert_eq!(status, 200);
        assert!(body.starts_with("event: x-bypass-remote-prefill"), "{body}");

        let client = test_support::serve::h1_client();
        let res = client
            .get(format!("{base}/metrics").parse().unwrap())
            .await
            .unwrap();
        let (metrics, _) = test_support::serve::read_all(res.into_body()).await;
        let metrics = String::from_utf8(metrics.to_vec()).unwrap();
        for line in [
            // Both requests named it; the bare name in the second is also its opt-in.
            r#"bypass_marker_annotations_stripped_total{annotation="x-bypass-remote-prefill"} 2"#,
            r#"bypass_marker_annotations_granted_total{annotation="x-bypass-remote-prefill"} 1"#,
            r#"bypass_marker_requests_refused_total{reason="invalid_json",status="400"} 1"#,
            r#"bypass_marker_frames_removed_total{annotation="x-bypass-remote-prefill"} 1"#,
            r#"bypass_marker_frames_forwarded_total{annotation="x-bypass-remote-prefill"} 1"#,
        ] {
            assert!(
                metrics.lines().any(|l| l == line),
                "no {line} in\n{metrics}"
            );
        }
    }
}

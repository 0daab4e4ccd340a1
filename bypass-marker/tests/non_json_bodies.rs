//! `--non-json-bodies` (and `BYPASS_MARKER_NON_JSON_BODIES`): what the sidecar's guard does with a
//! request body whose content type is not JSON, run as the binary in front of an upstream that
//! echoes what it received.
#![cfg(unix)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::routing::post;
use bytes::Bytes;
use http::{header, StatusCode};
use http_body_util::Full;

mod support;
use support::{send, serve_upstream, start_proxy};

const FORGED: &str =
    r#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill","request_id"]}}"#;
const JUDGED: &str = r#"{"model":"m","nvext":{"annotations":["request_id"]}}"#;

/// An upstream that answers with the body it received, and the count of requests that reached it.
async fn echo() -> (String, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move |body: Bytes| {
            counted.fetch_add(1, Ordering::SeqCst);
            async move { body }
        }),
    );
    (format!("http://{}", serve_upstream(app).await), calls)
}

async fn post_text(proxy: &str, body: &str) -> (StatusCode, Bytes) {
    let req = http::Request::post(format!("http://{proxy}/v1/chat/completions"))
        .header(header::CONTENT_TYPE, "text/plain")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let reply = send(req).await.unwrap();
    (reply.status, reply.body)
}

async fn proxy(
    upstream: &str,
    args: &[&str],
    env: &[(&str, &str)],
) -> (tokio::process::Child, String) {
    start_proxy(
        support::command()
            .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream])
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "warn"),
    )
    .await
}

#[tokio::test]
async fn non_json_bodies_are_forwarded_by_default_judged_or_refused_on_request() {
    let (upstream, calls) = echo().await;

    let (_default, addr) = proxy(&upstream, &[], &[]).await;
    assert_eq!(
        post_text(&addr, FORGED).await,
        (StatusCode::OK, Bytes::from(FORGED))
    );

    let (_judge, addr) = proxy(&upstream, &["--non-json-bodies", "judge"], &[]).await;
    assert_eq!(
        post_text(&addr, FORGED).await,
        (StatusCode::OK, Bytes::from(JUDGED))
    );
    assert_eq!(post_text(&addr, "plain text").await.1, "plain text");

    let before = calls.load(Ordering::SeqCst);
    let env = [("BYPASS_MARKER_NON_JSON_BODIES", "refuse")];
    let (_refuse, addr) = proxy(&upstream, &[], &env).await;
    let (status, body) = post_text(&addr, FORGED).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert!(String::from_utf8_lossy(&body).contains(r#""code":"unsupported_media_type""#));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        before,
        "a refused request reached the upstream"
    );
    assert_eq!(post_text(&addr, "plain text").await.1, "plain text");
}

#[test]
fn an_unknown_value_is_a_usage_error_naming_the_flag() {
    let out = support::std_command()
        .args([
            "proxy",
            "--upstream",
            "http://127.0.0.1:9",
            "--non-json-bodies",
            "deny",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--non-json-bodies"), "{stderr}");
}

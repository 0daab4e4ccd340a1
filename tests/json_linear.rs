//! Hang detector for the JSON request guard (`json` feature): adversarial 4 MiB bodies, each built
//! to make some part of the guard's one pass work hard (many entries to strip, escapes everywhere,
//! keys to unescape, nesting just under the limit, dense non-ASCII text, long whitespace), go
//! through `JsonGuardLayer` and must be decided in well under the bound. A linear pass takes well
//! under a second even in a debug build. This is not a performance claim (see BENCHMARKS.md for
//! those): the bound is generous so that a slow or busy machine never fails it, only an algorithm
//! that is not linear in the body.
#![cfg(feature = "json")]

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, ServiceExt};
use tower_bypass_marker::json::JsonGuardBody;
use tower_bypass_marker::BypassMarkerLayer;

const MIB: usize = 1024 * 1024;
/// The bound for one body. A linear pass over 4 MiB takes well under a second in a debug build.
const BOUND: Duration = Duration::from_secs(20);

/// `unit` repeated until the result is at least `len` bytes long.
fn repeat(unit: &str, len: usize) -> String {
    unit.repeat(len.div_ceil(unit.len()))
}

/// `items` repeated to about 4 MiB, each followed by a comma, then `last`.
fn list(items: &str, last: &str) -> String {
    format!("{}{last}", repeat(&format!("{items},"), 4 * MIB))
}

/// Every adversarial body: (name, body, what the upstream must get; `None`: the body unchanged).
fn bodies() -> Vec<(&'static str, String, Option<String>)> {
    let marker = "\"x-bypass-remote-prefill\"";
    let escaped = r#""x\u002dbypass-remote-prefill""#;
    vec![
        (
            "4 MiB of router-owned entries, all stripped",
            format!(
                r#"{{"nvext":{{"annotations":[{}"request_id"]}}}}"#,
                list(marker, "")
            ),
            Some(r#"{"nvext":{"annotations":["request_id"]}}"#.to_owned()),
        ),
        (
            "4 MiB of escaped router-owned entries, all stripped",
            format!(r#"{{"nvext":{{"annotations":[{}1]}}}}"#, list(escaped, "")),
            Some(r#"{"nvext":{"annotations":[1]}}"#.to_owned()),
        ),
        (
            "4 MiB of kept entries",
            format!(
                r#"{{"nvext":{{"annotations":[{}"request_id"]}}}}"#,
                list(r#""r\u0065quest_id""#, "")
            ),
            None,
        ),
        (
            "4 MiB of top-level keys with escapes",
            format!("{{{}\"nvext\":null}}", list(r#""\u006e\u0076ext_":1"#, "")),
            None,
        ),
        (
            "4 MiB of nesting just under the limit",
            format!(
                r#"{{"m":[{}0]}}"#,
                list(&format!("{}{}", "[".repeat(125), "]".repeat(125)), "")
            ),
            None,
        ),
        (
            "a 4 MiB string of escapes",
            format!(r#"{{"m":"{}"}}"#, repeat(r#"\"\\\u00e9\n"#, 4 * MIB)),
            None,
        ),
        (
            "a 4 MiB string of non-ASCII text",
            format!(r#"{{"m":"{}"}}"#, repeat("東京 naïve 🙂", 4 * MIB)),
            None,
        ),
        (
            "4 MiB of whitespace",
            format!("{{\"m\":{}1}}", repeat(" \t\r\n", 4 * MIB)),
            None,
        ),
        (
            "4 MiB of numbers",
            format!(r#"{{"m":[{}]}}"#, list("-1.5e400", "0")),
            None,
        ),
    ]
}

/// Guards `body` in one chunk; returns the status and what the upstream got.
async fn guard(body: String) -> (StatusCode, Option<Bytes>) {
    let upstream = service_fn(|req: Request<JsonGuardBody<Full<Bytes>>>| async move {
        let body = req.into_body().collect().await.unwrap().to_bytes();
        Ok::<_, Infallible>(Response::new(Full::new(body)))
    });
    let svc = BypassMarkerLayer::new()
        .opt_in("request_id")
        .json_guard()
        .layer(upstream);
    let req = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, (status == StatusCode::OK).then_some(body))
}

#[tokio::test]
async fn adversarial_json_bodies_are_guarded_in_linear_time() {
    for (name, body, expected) in bodies() {
        assert!(body.len() >= 4 * MIB, "{name}: {} bytes", body.len());
        let start = Instant::now();
        let (status, got) = guard(body.clone()).await;
        let took = start.elapsed();
        assert_eq!(status, StatusCode::OK, "{name}");
        assert_eq!(
            got.as_deref(),
            Some(expected.as_deref().unwrap_or(&body).as_bytes()),
            "{name}"
        );
        assert!(took < BOUND, "{name}: {took:?}, bound {BOUND:?}");
    }
}

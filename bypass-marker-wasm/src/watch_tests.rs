//! The held-head watch ([`crate::watch`]) on the fake host: which heads it watches, when it
//! answers, what it logs, and when it stops watching.

use bypass_marker_envoy_adapter::config::FilterConfig;
use bypass_marker_envoy_adapter::stream::RequestHead;
use proxy_wasm::types::{Action, LogLevel};

use crate::fake::{FakeProxy, SimulatedPlugin};
use crate::watch::{HeldHeads, HELD_HEAD_BOUND_SECS, TIMED_OUT_BODY};

fn dynamo() -> FilterConfig {
    FilterConfig::parse(b"").unwrap()
}

fn json_post(d: &mut SimulatedPlugin) -> Action {
    d.request(
        "POST",
        &[
            ("content-type", "application/json"),
            ("content-length", "13"),
        ],
        false,
    )
}

/// Ticks `watch` at `now` on a fresh fake; the ids answered, and the fake.
fn tick(watch: &mut HeldHeads, now: u64) -> (Vec<u32>, FakeProxy) {
    let mut fake = FakeProxy::default();
    let mut entered = Vec::new();
    watch.tick(now, &mut fake, |id| entered.push(id));
    (entered, fake)
}

fn errors(fake: &FakeProxy) -> Vec<&str> {
    fake.logs
        .iter()
        .filter(|(level, _)| *level == LogLevel::Error)
        .map(|(_, line)| line.as_str())
        .collect()
}

#[test]
fn a_json_body_held_for_the_guard_is_a_held_head() {
    let mut d = SimulatedPlugin::new(&dynamo());
    assert_eq!(json_post(&mut d), Action::Pause);
    assert!(d.stream.holds_request_head());
    // Its body comes: judged, the head goes on.
    d.request_chunk(br#"{"model":"m"}"#, true);
    assert!(!d.stream.holds_request_head());
}

#[test]
fn heads_that_are_not_held_for_a_body_are_not_watched() {
    // Forwarded at once (the gateways' setting).
    let mut d = SimulatedPlugin::with_head(&dynamo(), RequestHead::Forwarded);
    assert_eq!(json_post(&mut d), Action::Continue);
    assert!(!d.stream.holds_request_head());
    // A GET: nothing to judge.
    let mut d = SimulatedPlugin::new(&dynamo());
    assert_eq!(d.request("GET", &[], true), Action::Continue);
    assert!(!d.stream.holds_request_head());
    // Refused at the head (an encoded JSON body): answered, not held.
    let mut d = SimulatedPlugin::new(&dynamo());
    d.request(
        "POST",
        &[
            ("content-type", "application/json"),
            ("content-encoding", "br"),
        ],
        false,
    );
    assert!(d.fake().sent.is_some());
    assert!(!d.stream.holds_request_head());
}

#[test]
fn a_head_without_a_body_hook_is_answered_after_the_bound_with_the_setting_named() {
    let mut watch = HeldHeads::default();
    watch.held(7, 1_000);
    assert!(watch.watching());
    let (entered, fake) = tick(&mut watch, 1_000 + HELD_HEAD_BOUND_SECS - 1);
    assert!(entered.is_empty() && fake.sent.is_none() && fake.logs.is_empty());
    let (entered, fake) = tick(&mut watch, 1_000 + HELD_HEAD_BOUND_SECS);
    assert_eq!(entered, [7]);
    let (status, body) = fake.sent.clone().unwrap();
    assert_eq!(status, 500);
    assert_eq!(body, TIMED_OUT_BODY.as_bytes());
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["error"]["type"], "server_error");
    assert_eq!(json["error"]["code"], "allow_on_headers_stop_iteration");
    let message = json["error"]["message"].as_str().unwrap();
    assert!(message.contains("allow_on_headers_stop_iteration: true"));
    assert!(message.contains(r#""request-head": "forwarded""#));
    let lines = errors(&fake);
    assert_eq!(lines.len(), 1);
    assert!(lines[0].contains("allow_on_headers_stop_iteration: true"));
    assert!(lines[0].contains(r#""request-head": "forwarded""#));
    // Answered once: its hooks pass the reply, and the next tick leaves it alone.
    assert!(watch.answered(7));
    assert!(!watch.watching());
    let (entered, _) = tick(&mut watch, 1_000 + 3 * HELD_HEAD_BOUND_SECS);
    assert!(entered.is_empty());
    watch.done(7);
    assert!(!watch.answered(7));
}

#[test]
fn the_error_line_goes_once_then_at_most_once_a_minute() {
    let mut watch = HeldHeads::default();
    let mut lines = Vec::new();
    for (i, now) in [(1, 0), (2, 5), (3, 30), (4, 75)] {
        watch.held(i, now);
        let (entered, fake) = tick(&mut watch, now + HELD_HEAD_BOUND_SECS);
        assert_eq!(entered, [i], "every such head is answered");
        assert_eq!(fake.sent.as_ref().map(|s| s.0), Some(500));
        lines.extend(errors(&fake).into_iter().map(str::to_owned));
    }
    // At 10 s (the first), then not at 15 s or 40 s, then at 85 s with the two held back.
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(!lines[0].contains("more since the last"));
    assert!(lines[1].contains("(2 more since the last such line, not logged)"));
}

#[test]
fn a_body_hook_proves_the_setting_and_ends_the_watch() {
    let mut watch = HeldHeads::default();
    watch.held(1, 100);
    watch.held(2, 100);
    // A body hook of a stream not held proves nothing.
    watch.body(9);
    assert!(!watch.proven() && watch.watching());
    watch.body(1);
    assert!(watch.proven());
    // Every head is let be, stream 2's too: Envoy has the setting for the whole plugin.
    assert!(!watch.watching());
    let (entered, fake) = tick(&mut watch, 100 + 10 * HELD_HEAD_BOUND_SECS);
    assert!(entered.is_empty() && fake.sent.is_none());
    // A slow client later: never watched.
    watch.held(3, 1_000);
    assert!(!watch.watching());
    let (entered, _) = tick(&mut watch, 1_000 + 10 * HELD_HEAD_BOUND_SECS);
    assert!(entered.is_empty());
}

#[test]
fn a_stream_that_ends_is_not_answered() {
    let mut watch = HeldHeads::default();
    watch.held(4, 0);
    watch.done(4);
    assert!(!watch.watching());
    let (entered, fake) = tick(&mut watch, HELD_HEAD_BOUND_SECS);
    assert!(entered.is_empty() && fake.sent.is_none());
    // Nor does it prove the setting.
    assert!(!watch.proven());
}

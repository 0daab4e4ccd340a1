//! The plugin without Envoy: [`Stream`](crate::stream::Stream) on a fake of proxy-wasm's host
//! that keeps Envoy's buffer semantics (`fake`, with the feature of that name), through every hook order Envoy makes.

use bypass_marker::config::Config;
use bypass_marker::metrics::Counter;
use proxy_wasm::types::{Action, LogLevel};
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};

use crate::fake::{FakeProxy, Simulated};
use crate::metrics::metric_name;

const MARKER: &[u8] = b"event: x-bypass-remote-prefill\n: true\n\n";
const DATA: &[u8] = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
const REQUEST_ID: &[u8] = b"event: request_id\ndata: \"r-1\"\n\n";

fn stream_body() -> Vec<u8> {
    [MARKER, REQUEST_ID, DATA, MARKER, b"data: [DONE]\n\n"].concat()
}

/// What the tower body gives a client that asked for `requested`, from the same bytes.
fn tower(requested: &[&str], body: &[u8]) -> Vec<u8> {
    let mut asked = RequestedAnnotations::new();
    for name in requested {
        asked.insert(name);
    }
    match BypassMarkerLayer::dynamo().event_stream_filter(&asked) {
        Some(filter) => filter.filter_all([body]).unwrap(),
        None => body.to_vec(),
    }
}

fn dynamo() -> Config {
    Config::parse(b"").unwrap()
}

#[test]
fn a_stream_split_at_every_position_gives_the_tower_bodys_bytes_and_counts() {
    let config = dynamo();
    let body = stream_body();
    let want = tower(&[], &body);
    for cut in 0..=body.len() {
        let mut d = Simulated::new(&config);
        assert_eq!(d.request("GET", &[], true), Action::Continue);
        assert_eq!(d.sse(), Action::Continue);
        let (a, b) = body.split_at(cut);
        assert_eq!(d.response_chunk(a, false), Action::Continue);
        assert_eq!(d.response_chunk(b, true), Action::Continue);
        d.done();
        let fake = d.fake();
        assert_eq!(fake.client, want, "cut at {cut}");
        assert!(!fake.reset);
        assert_eq!(
            fake.count(Counter::FramesRemoved, "x-bypass-remote-prefill"),
            2
        );
        assert_eq!(fake.count(Counter::FramesRemoved, "request_id"), 1);
    }
}

#[test]
fn one_byte_chunks_and_an_opted_in_client() {
    let config = dynamo();
    let body = stream_body();
    let json = br#"{"model":"m","stream":true,"nvext":{"annotations":["x-bypass-remote-prefill","request_id"]}}"#;
    let mut d = Simulated::new(&config);
    let len = json.len().to_string();
    assert_eq!(
        d.request(
            "POST",
            &[
                ("content-type", "application/json"),
                ("content-length", &len)
            ],
            false
        ),
        Action::Continue,
        "the request head goes on before the body"
    );
    assert_eq!(d.request_chunk(json, true), Action::Continue);
    // The router-owned name goes from the request; the client's opt-in to it stands.
    let spliced = br#"{"model":"m","stream":true,"nvext":{"annotations":["request_id"]}}"#;
    let padded = [&spliced[..], &vec![b' '; json.len() - spliced.len()]].concat();
    assert_eq!(d.fake().upstream, padded);
    d.sse();
    for byte in &body {
        assert_eq!(d.response_chunk(&[*byte], false), Action::Continue);
    }
    d.response_chunk(&[], true);
    assert_eq!(
        d.fake().client,
        tower(&["x-bypass-remote-prefill", "request_id"], &body)
    );
}

#[test]
fn a_chunk_with_nothing_to_remove_is_not_written_back() {
    let mut d = Simulated::new(&dynamo());
    d.request("GET", &[], true);
    d.sse();
    for _ in 0..10 {
        assert_eq!(d.response_chunk(DATA, false), Action::Continue);
    }
    assert_eq!(d.fake().response_writes, 0);
    // A marker at the front is drained: one call.
    d.response_chunk(&[MARKER, DATA].concat(), false);
    assert_eq!(d.fake().response_writes, 1);
    assert_eq!(d.fake().client, DATA.repeat(11));
}

#[test]
fn json_responses_pass_untouched() {
    let mut d = Simulated::new(&dynamo());
    d.request("GET", &[], true);
    let body = br#"{"text":"event: x-bypass-remote-prefill\n: true\n\n"}"#;
    assert_eq!(
        d.response(
            &[
                (":status", "200"),
                ("content-type", "application/json"),
                ("content-length", "49")
            ],
            false
        ),
        Action::Continue
    );
    assert_eq!(d.response_chunk(body, true), Action::Continue);
    assert_eq!(d.fake().client, body.as_slice());
    assert_eq!(d.fake().response_writes, 0);
}

#[test]
fn router_owned_names_are_spliced_and_padded_to_the_content_length_sent() {
    let json = br#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill","request_id"]}}"#;
    for pieces in [1, 2, 7, json.len()] {
        let mut d = Simulated::new(&dynamo());
        let len = json.len().to_string();
        d.request(
            "POST",
            &[
                ("content-type", "application/json"),
                ("content-length", &len),
            ],
            false,
        );
        let chunks: Vec<&[u8]> = json.chunks(json.len().div_ceil(pieces)).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let action = d.request_chunk(chunk, last);
            assert_eq!(
                action,
                if last {
                    Action::Continue
                } else {
                    Action::Pause
                }
            );
        }
        let upstream = d.fake().upstream.clone();
        assert_eq!(
            upstream.len(),
            json.len(),
            "{pieces} pieces: the content-length sent holds"
        );
        let value: serde_json::Value = serde_json::from_slice(&upstream).unwrap();
        assert_eq!(
            value["nvext"]["annotations"],
            serde_json::json!(["request_id"])
        );
        assert!(
            upstream.ends_with(b"}                          "),
            "{}",
            String::from_utf8_lossy(&upstream)
        );
        assert_eq!(
            d.fake().header_value("content-length"),
            Some(len.into_bytes())
        );
    }
}

#[test]
fn a_chunked_request_is_spliced_without_padding_and_trailers_end_it() {
    let json = br#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill"]}}"#;
    let mut d = Simulated::new(&dynamo());
    d.request("POST", &[("content-type", "application/json")], false);
    assert_eq!(d.request_chunk(&json[..10], false), Action::Pause);
    assert_eq!(d.request_chunk(&json[10..], false), Action::Pause);
    assert_eq!(d.request_trailers(), Action::Continue);
    assert_eq!(
        d.fake().upstream,
        br#"{"model":"m","nvext":{"annotations":[]}}"#
    );
}

#[test]
fn refusals_are_local_replies_counted_and_logged() {
    let config = Config::parse(br#"{"max-body": 16}"#).unwrap();
    // 413 from the content-length, at the head.
    let mut d = Simulated::new(&config);
    assert_eq!(
        d.request(
            "POST",
            &[
                ("content-type", "application/json"),
                ("content-length", "17")
            ],
            false
        ),
        Action::Pause
    );
    assert_eq!(d.fake().sent.as_ref().map(|s| s.0), Some(413));
    // 413 once a chunked body passes max-body, nothing of it upstream.
    let mut d = Simulated::new(&config);
    d.request("POST", &[("content-type", "application/json")], false);
    assert_eq!(d.request_chunk(b"{\"model\":", false), Action::Pause);
    assert_eq!(d.request_chunk(b"\"0123456789\"}", true), Action::Pause);
    assert_eq!(d.fake().sent.as_ref().map(|s| s.0), Some(413));
    assert!(d.fake().upstream.is_empty());
    // 400 for a body that is not JSON; 415 for a JSON-looking body of another type.
    let mut d = Simulated::new(&config);
    d.request("POST", &[("content-type", "application/json")], false);
    d.request_chunk(b"{\"a\":", true);
    let (status, body) = d.fake().sent.clone().unwrap();
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("invalid_json"));
    assert!(d.fake().upstream.is_empty());
    assert_eq!(d.fake().count(Counter::RequestsRefused, "400"), 1);
    assert!(d
        .fake()
        .logs
        .iter()
        .any(|(level, line)| *level == LogLevel::Info
            && line.starts_with("bypass_marker: refused a request with 400")));
}

#[test]
fn an_encoded_event_stream_fails_closed() {
    let mut d = Simulated::new(&dynamo());
    d.request("GET", &[], true);
    assert_eq!(
        d.response(
            &[
                (":status", "200"),
                ("content-type", "text/event-stream"),
                ("content-encoding", "gzip")
            ],
            false
        ),
        Action::Pause
    );
    assert_eq!(d.fake().sent.as_ref().map(|s| s.0), Some(502));
    assert_eq!(d.response_chunk(MARKER, true), Action::Pause);
    assert!(d.fake().client.is_empty());
    assert_eq!(d.fake().count(Counter::EncodedStreamsRefused, "gzip"), 1);
}

#[test]
fn trailers_after_complete_frames_pass_and_after_an_open_frame_reset() {
    let mut d = Simulated::new(&dynamo());
    d.request("GET", &[], true);
    d.sse();
    d.response_chunk(&stream_body(), false);
    assert_eq!(d.response_trailers(), Action::Continue);
    assert!(!d.fake().reset);
    assert_eq!(d.fake().client, tower(&[], &stream_body()));

    // Bytes held for a frame still open cannot go out in a trailers hook: the stream is reset.
    let mut d = Simulated::new(&dynamo());
    d.request("GET", &[], true);
    d.sse();
    d.response_chunk(b"data: {\"open\":", false);
    assert_eq!(d.response_trailers(), Action::Pause);
    assert!(d.fake().reset);
    assert!(d.fake().client.is_empty());
}

#[test]
fn a_frame_over_the_limit_resets_the_stream() {
    let mut d = Simulated::new(&dynamo());
    d.request("GET", &[], true);
    d.sse();
    let big = vec![b'x'; 1 << 20];
    d.response_chunk(b"data: ", false);
    d.response_chunk(&big, false);
    assert!(d.fake().reset);
    assert!(d
        .fake()
        .logs
        .iter()
        .any(|(level, line)| *level == LogLevel::Warn && line.contains("stream reset")));
}

#[test]
fn a_bad_configuration_is_refused_with_a_line_naming_the_key() {
    for (text, key) in [
        (&br#"{"opt-in": "request_id"}"#[..], "opt-in"),
        (br#"{"preset": "vllm"}"#, "preset"),
        (br#"{"sdk_safe": true}"#, "sdk_safe"),
    ] {
        let mut fake = FakeProxy::default();
        assert!(crate::plugin::configure(&mut fake, text).is_none());
        let (level, line) = &fake.logs[0];
        assert_eq!(*level, LogLevel::Error);
        assert!(line.contains(&format!("field \"{key}\"")), "{line}");
    }
    assert!(crate::plugin::configure(&mut FakeProxy::default(), b"").is_some());
}

#[test]
fn metric_names_carry_the_label_as_istio_does() {
    assert_eq!(
        metric_name(Counter::FramesRemoved, "x-bypass-remote-prefill"),
        "annotation=.=x-bypass-remote-prefill;.;bypass_marker_frames_removed"
    );
    assert_eq!(
        metric_name(Counter::RequestsRefused, "413"),
        "status=.=413;.;bypass_marker_requests_refused"
    );
}

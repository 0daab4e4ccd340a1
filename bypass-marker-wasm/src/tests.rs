//! The plugin without Envoy: [`Stream`](crate::stream::Stream) on a fake of proxy-wasm's host
//! that keeps Envoy's buffer semantics (`fake`, with the feature of that name), through every hook order Envoy makes.

use bypass_marker_envoy_adapter::config::FilterConfig;
use bypass_marker_envoy_adapter::log_limit::LogLimit;
use bypass_marker_envoy_adapter::metrics::Counter;
use bypass_marker_envoy_adapter::stream::memory::fixtures::{
    stream_body, DATA, GZIPPED_JSON, MARKER,
};
use bypass_marker_envoy_adapter::stream::RequestHead;
use proxy_wasm::types::{Action, LogLevel};
use tower_bypass_marker::{BypassMarkerLayer, RequestedAnnotations};

use crate::fake::{FakeProxy, SimulatedPlugin};
use crate::metrics::metric_name;

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

fn dynamo() -> FilterConfig {
    FilterConfig::parse(b"").unwrap()
}

/// A plugin configuration as this build must be given it: a test build (`--all-features` makes
/// one) starts only where the configuration names it.
fn plugin_config(json: &str) -> Vec<u8> {
    let mut value: serde_json::Value = serde_json::from_str(json).unwrap();
    if let Some(build) = crate::plugin::BUILD {
        value["build"] = serde_json::json!(build);
    }
    serde_json::to_vec(&value).unwrap()
}

/// Sends a `POST` head for a JSON body of `body_len` bytes, with its `content-length`.
fn json_post_head(d: &mut SimulatedPlugin, body_len: usize) -> Action {
    let len = body_len.to_string();
    d.request(
        "POST",
        &[
            ("content-type", "application/json"),
            ("content-length", &len),
        ],
        false,
    )
}

/// The request head as the upstream got it: its content-length.
fn upstream_length(d: &mut SimulatedPlugin) -> Option<Vec<u8>> {
    let head = d.fake().upstream_head.clone()?;
    head.into_iter()
        .find(|(k, _)| k == "content-length")
        .map(|(_, v)| v)
}

#[test]
fn a_stream_split_at_every_position_gives_the_tower_bodys_bytes_and_counts() {
    let config = dynamo();
    let body = stream_body();
    let want = tower(&[], &body);
    for cut in 0..=body.len() {
        let mut d = SimulatedPlugin::new(&config);
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
    let mut d = SimulatedPlugin::new(&config);
    assert_eq!(
        json_post_head(&mut d, json.len()),
        Action::Pause,
        "the request head waits for the guard"
    );
    assert!(d.fake().upstream_head.is_none());
    assert_eq!(d.request_chunk(json, true), Action::Continue);
    // The router-owned name goes from the request; the client's opt-in to it stands. The head
    // goes on with the new body's length: no padding.
    let spliced = br#"{"model":"m","stream":true,"nvext":{"annotations":["request_id"]}}"#;
    assert_eq!(d.fake().upstream, spliced);
    assert_eq!(
        upstream_length(&mut d),
        Some(spliced.len().to_string().into_bytes())
    );
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
    let mut d = SimulatedPlugin::new(&dynamo());
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
    let mut d = SimulatedPlugin::new(&dynamo());
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
fn a_held_head_goes_on_with_the_spliced_bodys_content_length_and_no_padding() {
    let json = br#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill","request_id"]}}"#;
    let spliced = br#"{"model":"m","nvext":{"annotations":["request_id"]}}"#;
    for pieces in [1, 2, 7, json.len()] {
        let mut d = SimulatedPlugin::new(&dynamo());
        let head = json_post_head(&mut d, json.len());
        assert_eq!(head, Action::Pause, "the head waits for the guard");
        let chunks: Vec<&[u8]> = json.chunks(json.len().div_ceil(pieces)).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let action = d.request_chunk(chunk, last);
            assert_eq!(
                d.fake().upstream_head.is_some(),
                last,
                "{pieces} pieces, chunk {i}"
            );
            assert_eq!(
                action,
                if last {
                    Action::Continue
                } else {
                    Action::Pause
                }
            );
        }
        assert_eq!(d.fake().upstream, spliced, "{pieces} pieces");
        assert_eq!(
            upstream_length(&mut d),
            Some(spliced.len().to_string().into_bytes()),
            "{pieces} pieces: the content-length is the spliced body's"
        );
    }
}

#[test]
fn a_forwarded_head_keeps_its_content_length_and_the_body_is_padded_to_it() {
    let json = br#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill","request_id"]}}"#;
    for pieces in [1, 2, 7, json.len()] {
        let mut d = SimulatedPlugin::with_head(&dynamo(), RequestHead::Forwarded);
        let head = json_post_head(&mut d, json.len());
        assert_eq!(head, Action::Continue, "the head goes on at once");
        let chunks: Vec<&[u8]> = json.chunks(json.len().div_ceil(pieces)).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            d.request_chunk(chunk, i + 1 == chunks.len());
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
            upstream_length(&mut d),
            Some(json.len().to_string().into_bytes())
        );
    }
}

#[test]
fn a_spliced_body_replaces_the_old_in_the_same_set_buffer_call() {
    // The drain of the old body and the first piece of the new one are one `set_buffer` call
    // (from 0: drain, then put in front); each further piece of the spliced body is appended.
    let json = br#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill"]}}"#;
    let mut d = SimulatedPlugin::new(&dynamo());
    d.request("POST", &[("content-type", "application/json")], false);
    d.request_chunk(json, true);
    assert_eq!(d.fake().bare_drains, 0, "a drain of its own");
    assert!(d.fake().request_writes >= 1);
    assert_eq!(
        d.fake().upstream,
        br#"{"model":"m","nvext":{"annotations":[]}}"#
    );
    // A response chunk rebuilt around a marker in its middle: one call.
    let mut d = SimulatedPlugin::new(&dynamo());
    d.request("GET", &[], true);
    d.sse();
    d.response_chunk(&[DATA, MARKER, DATA].concat(), false);
    assert_eq!(d.fake().response_writes, 1);
    assert_eq!(d.fake().bare_drains, 0);
    assert_eq!(d.fake().client, DATA.repeat(2));
}

#[test]
fn a_chunked_request_is_spliced_without_padding_and_trailers_end_it() {
    let json = br#"{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill"]}}"#;
    let mut d = SimulatedPlugin::new(&dynamo());
    d.request("POST", &[("content-type", "application/json")], false);
    assert_eq!(d.request_chunk(&json[..10], false), Action::Pause);
    assert_eq!(d.request_chunk(&json[10..], false), Action::Pause);
    let reads = d.fake().request_reads.get();
    assert_eq!(d.request_trailers(), Action::Continue);
    assert_eq!(
        d.fake().request_reads.get(),
        reads + 1,
        "the trailers hook reads the body once, to judge it, not to learn its length"
    );
    assert_eq!(
        d.fake().upstream,
        br#"{"model":"m","nvext":{"annotations":[]}}"#
    );
}

#[test]
fn refusals_are_local_replies_counted_and_logged() {
    let config = FilterConfig::parse(br#"{"max-body": 16}"#).unwrap();
    // 413 from the content-length, at the head.
    let mut d = SimulatedPlugin::new(&config);
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
    let mut d = SimulatedPlugin::new(&config);
    d.request("POST", &[("content-type", "application/json")], false);
    assert_eq!(d.request_chunk(b"{\"model\":", false), Action::Pause);
    assert_eq!(d.request_chunk(b"\"0123456789\"}", true), Action::Pause);
    assert_eq!(d.fake().sent.as_ref().map(|s| s.0), Some(413));
    assert!(d.fake().upstream.is_empty());
    assert!(d.fake().upstream_head.is_none());
    // 400 for a body that is not JSON.
    let mut d = SimulatedPlugin::new(&config);
    d.request("POST", &[("content-type", "application/json")], false);
    d.request_chunk(b"{\"a\":", true);
    let (status, body) = d.fake().sent.clone().unwrap();
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("invalid_json"));
    assert!(d.fake().upstream.is_empty());
    assert!(d.fake().upstream_head.is_none(), "not even the head");
    assert_eq!(d.fake().count(Counter::RequestsRefused, "400"), 1);
    // 415 for a JSON body the guard cannot read (encoded), at the head.
    let mut d = SimulatedPlugin::new(&config);
    let head = d.request("POST", GZIPPED_JSON, false);
    assert_eq!(head, Action::Pause);
    let (status, body) = d.fake().sent.clone().unwrap();
    assert_eq!(status, 415);
    assert!(String::from_utf8_lossy(&body).contains("unsupported_content_encoding"));
    assert!(d.fake().upstream_head.is_none());
    // The refusals' log lines: the first of this configuration at info; the later ones within
    // the minute are counted, not logged.
    let mut d = SimulatedPlugin::new(&config);
    d.request("POST", &[("content-type", "application/json")], false);
    d.request_chunk(b"{\"a\":", true);
    assert!(d.fake().logs.is_empty(), "{:?}", d.fake().logs);
    let config = FilterConfig::parse(br#"{"max-body": 16}"#).unwrap();
    let mut d = SimulatedPlugin::new(&config);
    d.request("POST", &[("content-type", "application/json")], false);
    d.request_chunk(b"{\"a\":", true);
    assert!(d
        .fake()
        .logs
        .iter()
        .any(|(level, line)| *level == LogLevel::Info
            && line.starts_with("bypass_marker: refused a request with 400")));
}

#[test]
fn refusal_lines_go_at_most_once_a_minute_with_the_count_held_back() {
    let limit = LogLimit::new(60);
    assert_eq!(limit.admit(1000), Some(0));
    assert_eq!(limit.admit(1000), None);
    assert_eq!(limit.admit(1059), None);
    assert_eq!(limit.admit(1060), Some(2));
    assert_eq!(limit.admit(1061), None);
}

#[test]
fn a_refused_request_never_reaches_the_upstream_not_even_its_head() {
    let config = FilterConfig::parse(br#"{"max-body": 64}"#).unwrap();
    let cases: [(&str, &[&[u8]]); 4] = [
        ("invalid JSON", &[b"{\"model\":"]),
        (
            "a duplicate nvext",
            &[br#"{"nvext":{},"nvext":{"annotations":["x-bypass-remote-prefill"]}}"#],
        ),
        ("over max-body in one chunk", &[&[b' '; 65]]),
        ("over max-body in pieces", &[&[b' '; 40], &[b' '; 40]]),
    ];
    for (what, chunks) in cases {
        let mut d = SimulatedPlugin::new(&config);
        d.request("POST", &[("content-type", "application/json")], false);
        for (i, chunk) in chunks.iter().enumerate() {
            d.request_chunk(chunk, i + 1 == chunks.len());
        }
        let status = d.fake().sent.as_ref().map(|s| s.0);
        assert!(matches!(status, Some(400 | 413)), "{what}: {status:?}");
        assert!(
            d.fake().upstream_head.is_none(),
            "{what}: the head went upstream"
        );
        assert!(d.fake().upstream.is_empty(), "{what}");
    }
}

#[test]
fn an_encoded_event_stream_fails_closed() {
    let mut d = SimulatedPlugin::new(&dynamo());
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
    let mut d = SimulatedPlugin::new(&dynamo());
    d.request("GET", &[], true);
    d.sse();
    d.response_chunk(&stream_body(), false);
    assert_eq!(d.response_trailers(), Action::Continue);
    assert!(!d.fake().reset);
    assert_eq!(d.fake().client, tower(&[], &stream_body()));

    // Bytes held for a frame still open cannot go out in a trailers hook: the stream is reset.
    let mut d = SimulatedPlugin::new(&dynamo());
    d.request("GET", &[], true);
    d.sse();
    d.response_chunk(b"data: {\"open\":", false);
    assert_eq!(d.response_trailers(), Action::Pause);
    assert!(d.fake().reset);
    assert!(d.fake().client.is_empty());
}

#[test]
fn a_frame_over_the_limit_resets_the_stream() {
    let mut d = SimulatedPlugin::new(&dynamo());
    d.request("GET", &[], true);
    d.sse();
    let big = vec![b'x'; 1 << 20];
    d.response_chunk(b"data: ", false);
    d.response_chunk(&big, false);
    assert!(d.fake().reset);
    assert!(
        d.fake().client.is_empty(),
        "the client received nothing of the open frame: {} bytes",
        d.fake().client.len()
    );
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
        let text = plugin_config(std::str::from_utf8(text).unwrap());
        assert!(crate::plugin::configure(&mut fake, &text).is_none());
        let (level, line) = &fake.logs[0];
        assert_eq!(*level, LogLevel::Error);
        // Named as the user wrote it: in Envoy's `configuration`, not the module's filter_config.
        assert!(
            line.contains(&format!("configuration field \"{key}\""))
                && !line.contains("filter_config"),
            "{line}"
        );
    }
    let config = crate::plugin::parse(&plugin_config("{}")).unwrap();
    assert_eq!(
        config.head,
        RequestHead::Held,
        "the head is held by default"
    );
    let config = crate::plugin::parse(&plugin_config(r#"{"request-head": "forwarded"}"#)).unwrap();
    assert_eq!(config.head, RequestHead::Forwarded);
    let err = crate::plugin::parse(&plugin_config(r#"{"request-head": "late"}"#)).unwrap_err();
    assert!(
        err.starts_with("configuration field \"request-head\""),
        "{err}"
    );
}

#[test]
fn max_body_is_capped_at_what_one_vm_can_hold() {
    let limit = crate::plugin::MAX_BODY_LIMIT;
    let ok = crate::plugin::parse(&plugin_config(&format!(r#"{{"max-body": {limit}}}"#))).unwrap();
    assert_eq!(ok.config.guard().max_body() as u64, limit);
    for n in [limit + 1, 1 << 30, 4 << 30, 1 << 40] {
        let err =
            crate::plugin::parse(&plugin_config(&format!(r#"{{"max-body": {n}}}"#))).unwrap_err();
        assert!(
            err.starts_with("configuration field \"max-body\"")
                && err.contains("more than one plugin VM can hold"),
            "{n}: {err}"
        );
    }
}

#[test]
fn a_build_starts_only_where_the_configuration_names_it() {
    match crate::plugin::BUILD {
        None => {
            assert!(crate::plugin::parse(b"{}").is_ok());
            let err = crate::plugin::parse(br#"{"build": "test-panic"}"#).unwrap_err();
            assert!(err.contains("release build"), "{err}");
        }
        Some(build) => {
            let err = crate::plugin::parse(b"{}").unwrap_err();
            assert!(err.contains(&format!("the {build} build")), "{err}");
            let other = crate::plugin::parse(br#"{"build": "other"}"#).unwrap_err();
            assert!(other.contains(&format!("the {build} build")), "{other}");
            assert!(crate::plugin::parse(&plugin_config("{}")).is_ok());
        }
    }
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

#[test]
fn the_vm_memory_gauge_is_reported_when_it_grows_and_only_then() {
    let mut fake = FakeProxy::default();
    crate::metrics::report_memory(&mut fake, 1 << 20);
    crate::metrics::report_memory(&mut fake, 1 << 20);
    crate::metrics::report_memory(&mut fake, 1 << 19);
    assert_eq!(fake.counts.get(crate::metrics::VM_MEMORY), Some(&(1 << 20)));
    let mut fake = FakeProxy::default();
    crate::metrics::report_memory(&mut fake, 1 << 20);
    assert!(fake.counts.is_empty(), "no growth, no host call");
    crate::metrics::report_memory(&mut fake, 2 << 20);
    assert_eq!(fake.counts.get(crate::metrics::VM_MEMORY), Some(&(2 << 20)));
}

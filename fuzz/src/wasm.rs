//! The proxy-wasm plugin's body path (`bypass-marker-wasm`'s `Stream`), driven through its fake of
//! Envoy's proxy-wasm host in the hook orders Envoy produces, and compared with the tower body for
//! the same layer, opt-in and chunks, as the `module` target compares the dynamic module.
//!
//! Where the plugin differs from the module: Envoy hands a proxy-wasm hook one contiguous buffer
//! (no slices); and bytes held for a frame still open when trailers arrive cannot go out in the
//! trailers hook, so the stream is reset instead (its output then a strict prefix of the body's).
//! The request head waits for the guard, as the module's does (an Envoy with
//! `allow_on_headers_stop_iteration`).

use bypass_marker_envoy_adapter::config::FilterConfig;
use bypass_marker_wasm::fake::SimulatedPlugin;
use proxy_wasm::types::Action;
use tower_bypass_marker::json::DEFAULT_MAX_BODY_BYTES;

use test_support::fuzz::case::Case;
use test_support::fuzz::filter::{body_seen, response_head};
use test_support::fuzz::oracle::esc;

use crate::host::{assert_as_body, request_body, response_headers, Given};

/// Runs one case through the plugin's stream and holds it to the tower body.
pub fn check_wasm(case: &Case) {
    // A `200` to the request with no transfer coding: this host sends `:status` 200 to a POST
    // (the head byte's statuses and codings are the `body` and `filter` targets').
    let case = &case.status_200();
    let config = FilterConfig::new(case.layer(), DEFAULT_MAX_BODY_BYTES);
    let want = body_seen(case, config.layer());
    let mut stream = SimulatedPlugin::new(&config);

    // The request: the client's opt-in in `nvext.annotations`, its body in two pieces; the head
    // and the body are held until the body's end.
    let body = request_body(case);
    assert_eq!(
        stream.request("POST", &[("content-type", "application/json")], false),
        Action::Pause
    );
    let (a, b) = body.split_at(body.len() / 2);
    assert_eq!(stream.request_chunk(a, false), Action::Pause);
    let forwarded = if case.body.trailers {
        stream.request_chunk(b, false) == Action::Pause
            && stream.request_trailers() == Action::Continue
    } else {
        stream.request_chunk(b, true) == Action::Continue
    };
    assert!(
        forwarded && stream.fake().upstream_head.is_some(),
        "the request was not forwarded: {:?}",
        stream.fake().sent
    );

    // The response.
    let head = response_head(case);
    let headers = response_headers(&head);
    if stream.response(&headers, false) == Action::Pause {
        // An encoded event stream with something to remove: the 502, never a byte of it.
        assert_eq!(stream.fake().sent.as_ref().map(|s| s.0), Some(502));
        for chunk in case.chunks() {
            assert_eq!(stream.response_chunk(chunk, false), Action::Pause);
        }
        assert!(stream.fake().client.is_empty());
        return;
    }
    let trailers = case.body.trailers;
    let empty_last = !trailers && case.input.len() % 2 == 1;
    let chunks = case.chunks();
    let mut after = Vec::new();
    let mut reset = false;
    for (i, chunk) in chunks.iter().enumerate() {
        if case.body.empty_chunks {
            assert_eq!(stream.response_chunk(&[], false), Action::Continue);
        }
        let last = i + 1 == chunks.len() && !trailers && !empty_last;
        if stream.response_chunk(chunk, last) == Action::Pause {
            reset = true;
            break;
        }
        after.push(stream.fake().client.len());
    }
    let mut reset_at_trailers = false;
    if !reset {
        if trailers {
            reset_at_trailers = stream.response_trailers() != Action::Continue;
            reset = reset_at_trailers;
        } else if empty_last {
            reset = stream.response_chunk(&[], true) != Action::Continue;
        }
    }
    stream.done();

    let got = esc(&stream.fake().client);
    assert_eq!(reset, stream.fake().reset);
    if reset_at_trailers {
        // Held bytes at trailers: the plugin resets where the module would append them.
        assert!(want.too_large.is_none());
        assert!(
            want.out.starts_with(&got) && got != want.out,
            "reset at trailers with nothing held: {got:?} against {:?}",
            want.out
        );
        return;
    }
    let n = match after.len() {
        _ if reset => 0,
        n if !trailers && !empty_last && n > 0 => n - 1,
        n => n,
    };
    let want_after = &want.after[..n];
    let fake = stream.fake();
    let given = Given {
        host: "plugin",
        client: &fake.client,
        reset,
        after: &after[..n],
    };
    assert_as_body(&given, &want, want_after, || {
        format!(
            "{:?}; requested {:?}, {:?}",
            fake.logs, case.requested, case.body
        )
    });
}

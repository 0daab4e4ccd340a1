//! What the `module` and `wasm` targets share: the request both send, the response head both
//! get, and the oracle that holds what a host's stream gave the client to the tower body's output
//! for the same layer, opt-in and chunks.

use http::HeaderMap;
use test_support::fuzz::case::Case;
use test_support::fuzz::filter::Seen;
use test_support::fuzz::oracle::esc;

/// The request body: the client's opt-in in `nvext.annotations`.
pub fn request_body(case: &Case) -> Vec<u8> {
    serde_json::json!({"stream": true, "nvext": {"annotations": case.requested}})
        .to_string()
        .into_bytes()
}

/// The response head as a host's header list: `:status` 200, then `head`'s fields.
pub fn response_headers(head: &HeaderMap) -> Vec<(&str, &str)> {
    let mut headers = vec![(":status", "200")];
    for (name, value) in head {
        headers.push((name.as_str(), value.to_str().unwrap()));
    }
    headers
}

/// What a host's stream gave the client.
#[derive(Debug)]
pub struct Given<'a> {
    /// The host's name in the messages (`module`, `plugin`).
    pub host: &'static str,
    /// The bytes that reached the client.
    pub client: &'a [u8],
    /// Whether the host reset the stream.
    pub reset: bool,
    /// The output's length after each chunk whose count the body's can be held to.
    pub after: &'a [usize],
}

/// Holds `given` to the tower body's output `want`: a reset exactly where the body fails with
/// `FrameTooLarge`, and then a prefix of what the body gave before it failed (a reset stream loses
/// the chunk it failed in); else the same bytes, each chunk's output as soon as the body's
/// (`want_after`, the body's counts for the chunks of `given.after`). `context` says more when an
/// assertion fails.
pub fn assert_as_body(given: &Given<'_>, want: &Seen, want_after: &[usize], context: impl Fn() -> String) {
    let host = given.host;
    let reset = given.reset;
    assert_eq!(
        want.too_large.is_some(),
        reset,
        "body failed: {:?}, {host} reset: {reset} ({})",
        want.too_large,
        context()
    );
    let got = esc(given.client);
    if reset {
        assert!(
            want.out.starts_with(&got),
            "reset: {got:?} is no prefix of {:?}",
            want.out
        );
        return;
    }
    assert_eq!(
        got,
        want.out,
        "the {host} and the tower body differ; {}",
        context()
    );
    assert_eq!(
        given.after,
        want_after,
        "output after each chunk: {}",
        context()
    );
}

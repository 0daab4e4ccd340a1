//! What a client receives from a Dynamo-like router on a prefix-cache hit, without and with
//! `BypassMarkerLayer`.
//!
//! ```text
//! cargo run --example demo
//! ```
//!
//! Starts the simulated router of `examples/support` twice on 127.0.0.1 (without and with the
//! layer), sends the same streamed chat request until it is a prefix-cache hit, prints the exact
//! bytes each client receives and checks what it says about them: it exits non-zero if the layer
//! did not do what the output claims. Like Dynamo, the router prepends a `request_id` frame to
//! every stream, and the marker before it on a cache hit; the layer forwards each only to the
//! clients that listed it in `nvext.annotations`.

mod support;

use std::process::ExitCode;

use support::router::{Endpoint, Running, BYPASS_FRAME};

type BoxError = support::client::BoxError;

const PROMPT: &str = "Why is the sky blue?";
const MAX_TOKENS: u64 = 3;
const MARKER_OPT_IN: &str = "x-bypass-remote-prefill";
const REQUEST_ID_OPT_IN: &str = "request_id";

/// Sends the demo's streamed chat request, with `annotations` if any, and returns the body.
async fn stream(server: &Running, annotations: &[&str]) -> Result<Vec<u8>, BoxError> {
    let mut request = support::client::request(Endpoint::Chat, PROMPT, true, MAX_TOKENS);
    if !annotations.is_empty() {
        request = support::client::with_annotations(request, annotations);
    }
    let reply = server
        .post_json(support::client::path(Endpoint::Chat), &request)
        .await?;
    if !reply.status.is_success() || reply.content_type() != "text/event-stream" {
        return Err(format!(
            "expected a 200 text/event-stream, got {} {:?}",
            reply.status,
            reply.content_type()
        )
        .into());
    }
    Ok(reply.body.to_vec())
}

fn heading(title: &str) {
    println!("\n== {title} ==");
}

/// Prints a body one frame per line, every byte visible.
fn show(body: &[u8]) {
    for frame in support::client::frames(body) {
        println!("  {}", support::client::escape(frame));
    }
}

/// The claims the demo prints, checked.
struct Claims {
    failed: usize,
}

impl Claims {
    fn check(&mut self, holds: bool, claim: &str) {
        if holds {
            println!("  [ok] {claim}");
        } else {
            println!("  [FAILED] {claim}");
            self.failed += 1;
        }
    }
}

/// Whether `body` has a `request_id` frame.
fn has_request_id(body: &[u8]) -> bool {
    support::client::frames(body)
        .iter()
        .any(|frame| frame.starts_with(b"event: request_id\n"))
}

/// The `request_id` frame of the stream `body`, as the router writes it: the completion's id.
fn request_id_frame(body: &[u8]) -> Result<String, BoxError> {
    Ok(format!(
        "event: request_id\n: \"{}\"\n\n",
        support::client::stream_id(body)?
    ))
}

/// Frames with an `event` field but no `data` line: the ones the OpenAI SDKs cannot parse.
fn frames_without_data(body: &[u8]) -> usize {
    support::client::frames(body)
        .iter()
        .filter(|frame| {
            let lines = frame.split(|&b| b == b'\n');
            let mut has_data = false;
            let mut has_event = false;
            for line in lines {
                has_data |= line.starts_with(b"data:");
                has_event |= line.starts_with(b"event:");
            }
            has_event && !has_data
        })
        .count()
}

async fn run() -> Result<usize, BoxError> {
    let without = support::router::spawn(false).await?;
    let with = support::router::spawn(true).await?;
    println!(
        "Simulated Dynamo router without the layer: http://{}",
        without.addr
    );
    println!(
        "Simulated Dynamo router with the layer:    http://{}",
        with.addr
    );
    println!(
        "\nEach router is first sent the streamed chat request {PROMPT:?} once (a cold request).\n\
         Sent again, the prompt is a prefix-cache hit: the router bypasses remote prefill and\n\
         prepends {:?} to the stream. Like Dynamo, it also\n\
         prepends \"event: request_id\\n: \\\"<id>\\\"\\n\\n\" to every stream, cold or not, after the\n\
         marker. Below is the cache-hit stream exactly as each client receives it, one frame per\n\
         line, `\\n` shown as is.",
        BYPASS_FRAME
    );
    let bare_cold = stream(&without, &[]).await?;
    let filtered_cold = stream(&with, &[]).await?;

    let mut claims = Claims { failed: 0 };

    heading("1. Without the layer (Dynamo today): every client");
    let bare = stream(&without, &[]).await?;
    show(&bare);
    let bare_request_id = request_id_frame(&bare)?;
    claims.check(
        bare.starts_with(BYPASS_FRAME.as_bytes()),
        "the stream starts with the x-bypass-remote-prefill frame",
    );
    claims.check(
        support::client::frames(&bare).get(1) == Some(&bare_request_id.as_bytes()),
        "the request_id frame follows it, though this client did not ask for it",
    );
    claims.check(
        frames_without_data(&bare) == 2,
        "those are the stream's two frames without a `data` line",
    );
    claims.check(
        support::client::frames(&bare_cold).first()
            == Some(&request_id_frame(&bare_cold)?.as_bytes())
            && frames_without_data(&bare_cold) == 1,
        "the cold stream before it (not shown) started with its request_id frame, no marker",
    );
    println!(
        "  Both frames have an `event` field and a comment but no `data` line. The OpenAI SDKs\n  \
         parse every frame's data as JSON: openai-python raises JSONDecodeError and openai-node\n  \
         SyntaxError, so every streamed request fails before its first token (a cold one on\n  \
         request_id alone, a cache hit on the marker too)."
    );

    heading("2. With the layer: a default client (no nvext.annotations)");
    let filtered = stream(&with, &[]).await?;
    show(&filtered);
    let log = with.router.worker_log();
    claims.check(
        log.last().is_some_and(|w| w.bypass_remote_prefill),
        "the router did bypass remote prefill for this request (and emitted the marker)",
    );
    claims.check(
        frames_without_data(&filtered) == 0,
        "no frame without a `data` line reaches the client: the marker was removed",
    );
    claims.check(
        !has_request_id(&filtered) && frames_without_data(&filtered_cold) == 0,
        "request_id was removed too, here and from the cold stream: this client did not ask for it",
    );
    let both = format!("{BYPASS_FRAME}{bare_request_id}");
    claims.check(
        bare.strip_prefix(both.as_bytes()) == Some(&filtered[..]),
        "every other byte is identical to the stream without the layer",
    );

    heading(
        "3. With the layer: a client that sent nvext.annotations: [\"x-bypass-remote-prefill\"]",
    );
    let opted_in = stream(&with, &[MARKER_OPT_IN]).await?;
    show(&opted_in);
    claims.check(
        opted_in.starts_with(BYPASS_FRAME.as_bytes()),
        "the marker is forwarded, byte for byte, as the first frame",
    );
    claims.check(
        frames_without_data(&opted_in) == 1,
        "it is the only frame without a `data` line",
    );
    claims.check(
        !has_request_id(&opted_in),
        "request_id was removed: this client asked for the marker only",
    );
    claims.check(
        support::client::streamed_text(&opted_in)? == support::client::streamed_text(&filtered)?,
        "the completion text is the same as the default client's",
    );
    let log = with.router.worker_log();
    claims.check(
        log.last().is_some_and(|w| w.annotations.is_empty()),
        "the worker never saw the client's x-bypass-remote-prefill annotation (the guard removed it)",
    );

    heading(
        "4. With the layer: a client that sent nvext.annotations: [\"x-bypass-remote-prefill\", \"request_id\"]",
    );
    let both = stream(&with, &[MARKER_OPT_IN, REQUEST_ID_OPT_IN]).await?;
    show(&both);
    let frames = support::client::frames(&both);
    claims.check(
        frames.first() == Some(&BYPASS_FRAME.as_bytes())
            && frames.get(1) == Some(&request_id_frame(&both)?.as_bytes()),
        "the marker comes first, then this stream's request_id frame, both byte for byte",
    );
    claims.check(
        frames_without_data(&both) == 2,
        "they are the only frames without a `data` line",
    );
    let log = with.router.worker_log();
    claims.check(
        log.last()
            .is_some_and(|w| w.bypass_remote_prefill && w.annotations == [REQUEST_ID_OPT_IN]),
        "the worker was handed request_id but not the marker annotation",
    );

    without.stop().await?;
    with.stop().await?;
    Ok(claims.failed)
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(0) => {
            println!("\nAll claims hold.");
            ExitCode::SUCCESS
        }
        Ok(failed) => {
            eprintln!("\ndemo: {failed} claim(s) did not hold");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("demo: {err}");
            ExitCode::FAILURE
        }
    }
}

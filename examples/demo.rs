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
//! did not do what the output claims.

mod support;

use std::process::ExitCode;

use support::{Endpoint, Running, BYPASS_FRAME};

type BoxError = support::BoxError;

const PROMPT: &str = "Why is the sky blue?";
const MAX_TOKENS: u64 = 3;
const MARKER_OPT_IN: &str = "x-bypass-remote-prefill";

/// Sends the demo's streamed chat request, with `annotations` if any, and returns the body.
async fn stream(server: &Running, annotations: &[&str]) -> Result<Vec<u8>, BoxError> {
    let mut request = support::request(Endpoint::Chat, PROMPT, true, MAX_TOKENS);
    if !annotations.is_empty() {
        request = support::with_annotations(request, annotations);
    }
    let reply = server
        .post_json(support::path(Endpoint::Chat), &request)
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
    for frame in support::frames(body) {
        println!("  {}", support::escape(frame));
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

/// Frames with an `event` field but no `data` line: the ones the OpenAI SDKs cannot parse.
fn frames_without_data(body: &[u8]) -> usize {
    support::frames(body)
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
    let without = support::spawn(false).await?;
    let with = support::spawn(true).await?;
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
         prepends {:?} to the stream. Below is that cache-hit\n\
         stream exactly as each client receives it, one frame per line, `\\n` shown as is.",
        BYPASS_FRAME
    );
    stream(&without, &[]).await?;
    stream(&with, &[]).await?;

    let mut claims = Claims { failed: 0 };

    heading("1. Without the layer (Dynamo today): every client");
    let bare = stream(&without, &[]).await?;
    show(&bare);
    claims.check(
        bare.starts_with(BYPASS_FRAME.as_bytes()),
        "the stream starts with the x-bypass-remote-prefill frame",
    );
    println!(
        "  That frame has an `event` field and a comment but no `data` line. The OpenAI SDKs\n  \
         parse every frame's data as JSON: openai-python raises JSONDecodeError and openai-node\n  \
         SyntaxError, so every cache-hit request fails before its first token."
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
        bare.strip_prefix(BYPASS_FRAME.as_bytes()) == Some(&filtered[..]),
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
        support::streamed_text(&opted_in)? == support::streamed_text(&filtered)?,
        "the completion text is the same as the default client's",
    );
    let log = with.router.worker_log();
    claims.check(
        log.last().is_some_and(|w| w.annotations.is_empty()),
        "the worker never saw the client's x-bypass-remote-prefill annotation (the guard removed it)",
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

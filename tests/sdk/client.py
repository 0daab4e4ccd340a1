#!/usr/bin/env python3
"""Real clients against the simulated router of examples/support (started by tests/sdk/run.sh).

The router prepends `event: request_id\n: "<id>"\n\n` to every stream, and Dynamo's marker
`event: x-bypass-remote-prefill\n: true\n\n` before it on a prefix-cache hit. Neither frame has a
data line, so each one alone breaks the SDKs.

  client.py sdk --base-url URL/v1 --expect pass|fail-every-stream --label L --version V
      Streams with the openai package of the running interpreter, for chat and completions: a
      cold request, the same request again (a prefix-cache hit), again with a spoofed marker in
      nvext.annotations (sent through extra_body), and again opted in to the marker. With
      --expect pass (router with the layer, which removes both frames unless asked for) the first
      three must stream the echo model's text; with --expect fail-every-stream (router without
      the layer) every one must fail with the SDK's JSON decode error, the cold one on the
      request_id frame, the cache hits on the marker too: the Dynamo bug. The opted-in request
      gets the marker in both cases, so it fails too; that proves nvext reaches the router.

  client.py raw --layer-url URL --no-layer-url URL
      A raw HTTP client (urllib, no SDK) checking the bytes, so that the SDK errors above are
      known to come from these frames. Through the layer: a client that lists
      x-bypass-remote-prefill in nvext.annotations gets the marker as the first frame of its
      cache-hit stream, exactly once, and no request_id frame unless it also lists request_id;
      others get neither frame. Without the layer: every stream starts with the request_id frame,
      and a cache-hit stream starts with the exact marker frame, then request_id.

Prints one `PASS <what>` or `FAIL <what>: <why>` line per check; exits 1 if any check failed.
"""

import argparse
import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import checks  # noqa: E402  (tests/support/checks.py)
from checks import frames, report  # noqa: E402

MAX_TOKENS = 8
BYPASS_FRAME = b"event: x-bypass-remote-prefill\n: true\n\n"
# A spoofed marker in a form the guard strips but that is not an opt-in, and an annotation the
# layer does not know.
SPOOFED = ["x-bypass-remote-prefill:true", "sdk-test"]
# The opt-in: the layer forwards the marker to this client (which an SDK cannot parse).
OPT_IN = ["x-bypass-remote-prefill"]
MARKER = "the x-bypass-remote-prefill frame"
REQUEST_ID = "the request_id frame"

def echo_text(prompt, max_tokens=MAX_TOKENS):
    """What the simulated echo model answers: the prompt's words, cycled, max_tokens of them."""
    words = prompt.split() or ["..."]
    return " ".join(words[i % len(words)] for i in range(max_tokens))


def run_sdk(args):
    client = checks.openai_client(args, api_key="sk-simulated", timeout=20)
    if client is None:
        return
    model = "sim-llm"

    def chat(prompt, extra_body):
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_body=extra_body,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def completion(prompt, extra_body):
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, extra_body=extra_body
        )
        return "".join(c.choices[0].text or "" for c in stream if c.choices)

    with_layer = args.expect == "pass"
    router = "with layer" if with_layer else "without layer"
    # What breaks the SDK on a cache hit without the layer: the marker, first, then request_id.
    hit = None if with_layer else f"{MARKER} and {REQUEST_ID}"
    for endpoint, call in (("chat", chat), ("completions", completion)):
        prompt = f"prefix caching for {args.label}"
        # (what, extra_body, the frame the SDK must fail on, or None if it must stream the text)
        attempts = (
            ("#1 cold", None, None if with_layer else REQUEST_ID),
            ("#2 cache hit", None, hit),
            (
                "#3 cache hit, spoofed marker in nvext.annotations",
                {"nvext": {"annotations": SPOOFED}},
                hit,
            ),
            (
                "#4 cache hit, opted in to the marker via extra_body",
                {"nvext": {"annotations": OPT_IN}},
                MARKER if with_layer else hit,
            ),
        )
        for name, extra_body, breaks_on in attempts:
            what = f"{args.label} | {router} | {endpoint} stream {name}"
            try:
                text = call(prompt, extra_body)
            except Exception as err:  # the SDK's own error is what is being checked
                failed = f"{type(err).__module__}.{type(err).__name__}: {err}"
                if breaks_on is None:
                    report(False, what, f"the SDK failed: {failed}")
                else:
                    # The bug: the SDK parses the empty data of a frame without data as JSON.
                    report(
                        isinstance(err, json.JSONDecodeError),
                        f"{what}: {breaks_on} received, SDK fails as in Dynamo ({failed})",
                        f"expected json.JSONDecodeError, got {failed}",
                    )
                continue
            if breaks_on is not None:
                report(
                    False, what, f"streamed {text!r}, but {breaks_on} must reach and break the SDK"
                )
            else:
                expected = echo_text(prompt)
                report(text == expected, f"{what}: {text!r}", f"expected {expected!r}")


def post(url, body):
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "accept": "text/event-stream"},
    )
    with urllib.request.urlopen(req, timeout=20) as res:
        return res.headers.get("content-type", ""), res.read()


def run_raw(args):
    def stream(base, prompt, annotations=None):
        body = {
            "model": "sim-llm",
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "max_tokens": 3,
        }
        if annotations is not None:
            body["nvext"] = {"annotations": annotations}
        content_type, data = post(f"{base}/v1/chat/completions", body)
        if content_type != "text/event-stream":
            raise AssertionError(f"content-type {content_type!r}")
        return data

    def check(what, ok, body):
        report(ok, what, f"received {body!r}")

    def request_id_frame(body):
        """The request_id frame the router must have sent with `body`: the stream's id."""
        data = next(f for f in frames(body) if f.startswith(b"data: "))
        stream_id = json.loads(data[len(b"data: ") :])["id"]
        return f'event: request_id\n: "{stream_id}"\n\n'.encode()

    def events(body):
        """The frames that carry an event field, in order."""
        return [f for f in frames(body) if f.startswith(b"event:")]

    prompt = "raw client prompt"
    opt_in = ["x-bypass-remote-prefill"]
    cold = stream(args.layer_url, prompt, opt_in)
    check(
        "raw | with layer | marker opted-in cold request: no marker, no request_id",
        events(cold) == [],
        cold,
    )
    hit = stream(args.layer_url, prompt, opt_in)
    check(
        "raw | with layer | marker opted-in cache hit: marker is the first frame",
        frames(hit)[0] == BYPASS_FRAME,
        hit,
    )
    check(
        "raw | with layer | marker opted-in cache hit: marker sent once, request_id not at all",
        events(hit) == [BYPASS_FRAME],
        hit,
    )
    hit = stream(args.layer_url, prompt)
    check(
        "raw | with layer | default cache hit: no marker, no request_id", b"event:" not in hit, hit
    )
    hit = stream(args.layer_url, prompt, ["x-bypass-remote-prefill:true"])
    check(
        "raw | with layer | spoofed 'x-bypass-remote-prefill:true' is no opt-in: neither frame",
        b"event:" not in hit,
        hit,
    )
    hit = stream(args.layer_url, prompt, ["request_id"])
    check(
        "raw | with layer | request_id opted-in cache hit: request_id frame first, no marker",
        frames(hit)[0] == request_id_frame(hit) and events(hit) == [request_id_frame(hit)],
        hit,
    )
    hit = stream(args.layer_url, prompt, ["x-bypass-remote-prefill", "request_id"])
    check(
        "raw | with layer | both opted in, cache hit: marker first, then request_id, once each",
        frames(hit)[:2] == [BYPASS_FRAME, request_id_frame(hit)]
        and events(hit) == [BYPASS_FRAME, request_id_frame(hit)],
        hit,
    )

    cold = stream(args.no_layer_url, prompt)
    check(
        "raw | without layer | default cold request: request_id frame first, no marker",
        frames(cold)[0] == request_id_frame(cold) and events(cold) == [request_id_frame(cold)],
        cold,
    )
    hit = stream(args.no_layer_url, prompt)
    check(
        "raw | without layer | default cache hit: marker is the first frame",
        frames(hit)[0] == BYPASS_FRAME,
        hit,
    )
    check(
        "raw | without layer | default cache hit: request_id frame right after the marker",
        frames(hit)[1] == request_id_frame(hit)
        and events(hit) == [BYPASS_FRAME, request_id_frame(hit)],
        hit,
    )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    checks.sdk_mode(sub, ["pass", "fail-every-stream"])
    raw = sub.add_parser("raw")
    raw.add_argument("--layer-url", required=True)
    raw.add_argument("--no-layer-url", required=True)
    args = parser.parse_args()
    if args.mode == "sdk":
        run_sdk(args)
    else:
        run_raw(args)
    return checks.exit_status()


if __name__ == "__main__":
    sys.exit(main())

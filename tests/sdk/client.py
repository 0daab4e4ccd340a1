#!/usr/bin/env python3
"""Real clients against the simulated router of examples/support (started by tests/sdk/run.sh).

  client.py sdk --base-url URL/v1 --expect pass|fail-on-hit --label L --version V
      Streams with the openai package of the running interpreter, for chat and completions: a
      cold request, the same request again (a prefix-cache hit), again with a spoofed marker in
      nvext.annotations (sent through extra_body), and again opted in to the marker. With
      --expect pass (router with the layer) the first three must stream the echo model's text;
      with --expect fail-on-hit (router without the layer) only the cold one must, and the cache
      hits must fail with the SDK's JSON decode error: the Dynamo bug. The opted-in request gets
      the marker in both cases, so it fails too; that proves nvext reaches the router.

  client.py raw --layer-url URL --no-layer-url URL
      A raw HTTP client (urllib, no SDK) checking the bytes: a client that lists
      x-bypass-remote-prefill in nvext.annotations gets the marker as the first frame of its
      cache-hit stream through the layer, others do not; without the layer everyone gets it.

Prints one `PASS <what>` or `FAIL <what>: <why>` line per check; exits 1 if any check failed.
"""

import argparse
import json
import sys
import urllib.request

MAX_TOKENS = 8
BYPASS_FRAME = b"event: x-bypass-remote-prefill\n: true\n\n"
# A spoofed marker in a form the guard strips but that is not an opt-in, and an annotation the
# layer does not know.
SPOOFED = ["x-bypass-remote-prefill:true", "sdk-test"]
# The opt-in: the layer forwards the marker to this client (which an SDK cannot parse).
OPT_IN = ["x-bypass-remote-prefill"]

failures = 0


def report(ok, what, why=""):
    global failures
    if ok:
        print(f"PASS {what}", flush=True)
    else:
        failures += 1
        print(f"FAIL {what}: {why}", flush=True)


def echo_text(prompt, max_tokens=MAX_TOKENS):
    """What the simulated echo model answers: the prompt's words, cycled, max_tokens of them."""
    words = prompt.split() or ["..."]
    return " ".join(words[i % len(words)] for i in range(max_tokens))


def run_sdk(args):
    import openai

    if openai.__version__ != args.version:
        report(False, args.label, f"expected openai {args.version}, imported {openai.__version__}")
        return
    client = openai.OpenAI(
        base_url=args.base_url, api_key="sk-simulated", max_retries=0, timeout=20
    )
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
    for endpoint, call in (("chat", chat), ("completions", completion)):
        prompt = f"prefix caching for {args.label}"
        # (what, extra_body, whether the SDK must fail on it)
        attempts = (
            ("#1 cold", None, False),
            ("#2 cache hit", None, not with_layer),
            (
                "#3 cache hit, spoofed marker in nvext.annotations",
                {"nvext": {"annotations": SPOOFED}},
                not with_layer,
            ),
            (
                "#4 cache hit, opted in to the marker via extra_body",
                {"nvext": {"annotations": OPT_IN}},
                True,
            ),
        )
        for name, extra_body, must_fail in attempts:
            what = f"{args.label} | {router} | {endpoint} stream {name}"
            try:
                text = call(prompt, extra_body)
            except Exception as err:  # the SDK's own error is what is being checked
                failed = f"{type(err).__module__}.{type(err).__name__}: {err}"
                if not must_fail:
                    report(False, what, f"the SDK failed: {failed}")
                else:
                    # The bug: the SDK parses the marker frame's empty data as JSON.
                    report(
                        isinstance(err, json.JSONDecodeError),
                        f"{what}: marker received, SDK fails as in Dynamo ({failed})",
                        f"expected json.JSONDecodeError, got {failed}",
                    )
                continue
            if must_fail:
                report(
                    False,
                    what,
                    f"streamed {text!r}, but the marker frame must reach and break the SDK",
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


def frames(body):
    out, rest = [], body
    while rest:
        end = rest.find(b"\n\n")
        end = len(rest) if end < 0 else end + 2
        out.append(rest[:end])
        rest = rest[end:]
    return out


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

    prompt = "raw client prompt"
    opt_in = ["x-bypass-remote-prefill"]
    cold = stream(args.layer_url, prompt, opt_in)
    check("raw | with layer | opted-in cold request: no marker", BYPASS_FRAME not in cold, cold)
    hit = stream(args.layer_url, prompt, opt_in)
    check(
        "raw | with layer | opted-in cache hit: marker is the first frame",
        frames(hit)[0] == BYPASS_FRAME,
        hit,
    )
    check(
        "raw | with layer | opted-in cache hit: marker sent once", hit.count(BYPASS_FRAME) == 1, hit
    )
    hit = stream(args.layer_url, prompt)
    check("raw | with layer | default cache hit: no marker", b"event:" not in hit, hit)
    hit = stream(args.layer_url, prompt, ["x-bypass-remote-prefill:true"])
    check(
        "raw | with layer | spoofed 'x-bypass-remote-prefill:true' is no opt-in: no marker",
        b"event:" not in hit,
        hit,
    )
    hit = stream(args.layer_url, prompt, ["request_id"])
    first = frames(hit)[0]
    check(
        "raw | with layer | request_id opt-in: request_id frame first, no marker",
        first.startswith(b'event: request_id\n: "') and BYPASS_FRAME not in hit,
        hit,
    )

    stream(args.no_layer_url, prompt)
    hit = stream(args.no_layer_url, prompt)
    check(
        "raw | without layer | default cache hit: marker is the first frame",
        frames(hit)[0] == BYPASS_FRAME,
        hit,
    )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    sdk = sub.add_parser("sdk")
    sdk.add_argument("--base-url", required=True)
    sdk.add_argument("--expect", choices=["pass", "fail-on-hit"], required=True)
    sdk.add_argument("--label", required=True)
    sdk.add_argument("--version", required=True)
    raw = sub.add_parser("raw")
    raw.add_argument("--layer-url", required=True)
    raw.add_argument("--no-layer-url", required=True)
    args = parser.parse_args()
    if args.mode == "sdk":
        run_sdk(args)
    else:
        run_raw(args)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

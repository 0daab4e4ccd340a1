#!/usr/bin/env python3
"""Clients for tests/dynamo/run.sh, against the real Dynamo 1.6.1 frontend and the proxy.

Dynamo's mocker streams the replies of replies.json (built by model.py) to a request whose
nvext.annotations hold `output_replay_id:<key>`. While the slowed prefill worker is busy with the
holder's long request, Dynamo's KV router bypasses remote prefill for every other request and
its HTTP layer prepends `event: x-bypass-remote-prefill\n: true\n\n` to chat and completion
streams, asked for or not (1.6.1 never reads the opt-in). A client that lists `request_id` gets
`event: request_id\n: "<id>"\n\n` as well, before the marker. Its /v1/responses and /v1/messages
streams carry neither (MARKED).

  client.py hold --url URL --words N
      The holder: one chat stream with a prompt of N words and max_tokens 1, read to its end.
      Prints `holder: done in S s` when Dynamo answered it.
  client.py probe --url URL
      Exits 0 if a plain chat stream starts with the marker frame (the bypass is on), else 1.
  client.py direct --url URL --replies FILE
      The control, a raw HTTP client straight to Dynamo: chat and completion streams start with
      the marker, byte for byte, then stream the reply; with request_id asked for, both frames.
      Responses API and Messages API streams carry no annotation frame, asked for or not.
  client.py proxy --url PROXY --direct-url URL --replies FILE [--via NAME]
      A raw HTTP client through the proxy (or another front door, --via names it): plain chat and
      completion streams carry no annotation frame and the same reply; opted in to the marker, it
      is the first frame, byte for byte, once; request_id asked for gives that frame and not the
      marker; both asked for give both, as Dynamo sends them. On all four streaming endpoints, the
      same request straight to Dynamo and through the front door: the same bytes (but ids and
      clocks), less the marker frames unless opted in to them. Non-streaming chat and
      completions, and GET /v1/models, are the same as straight to Dynamo.
  client.py sdk --base-url URL/v1 --expect pass|fail --label L --version V --replies FILE
                [--via NAME]
      Streams chat, completions and responses with the openai package of the running
      interpreter. pass (a front door): each streams its reply. fail (Dynamo itself): chat and
      completions fail with json.JSONDecodeError on the marker; responses streams its reply.
  client.py anthropic --base-url URL --label L --version V --replies FILE [--via NAME]
      messages.stream with the anthropic package of the running interpreter, through a front door
      (--via) or straight to Dynamo: its text_stream and final message are the reply.

Prints one `PASS <what>` or `FAIL <what>: <why>` line per check; exits 1 if any check failed.
"""

import argparse
import json
import os
import re
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import checks  # noqa: E402  (tests/support/checks.py)
from checks import frames, report  # noqa: E402

MODEL = "tiny"
# More than any reply in replies.json, so the mocker's replay decides where the text ends.
MAX_TOKENS = 64
MARKER = b"event: x-bypass-remote-prefill\n: true\n\n"
TIMEOUT = 30
# The streaming endpoints Dynamo 1.6.1 serves (/v1/messages with --enable-anthropic-api), and
# whether it prepends the marker to their streams when it bypasses remote prefill, as measured
# against the real frontend: on chat and completions, not on the Responses API (whose frames are
# all named: `event: response.created`, ...) nor on Anthropic's Messages API. `direct` pins this;
# the day Dynamo changes it, that check fails, and the front doors' checks (which compare with
# what Dynamo sent for the same request) show the marker removed there as on chat.
MARKED = {"chat": True, "completion": True, "responses": False, "messages": False}
PATHS = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
# The event names of BypassMarkerLayer::dynamo(), the front doors' preset: frames a client gets
# only if it opted in, or never.
ROUTER_NAMES = {
    b"x-bypass-remote-prefill",
    b"x-prefill-continue",
    b"request_id",
    b"formatted_prompt",
    b"token_ids",
    b"llm_metrics",
    b"payload_usage",
}

def replay(key):
    return f"output_replay_id:{key}"


def request(url, body=None, accept="text/event-stream", timeout=TIMEOUT):
    """Sends a request (POST with a JSON body, or GET); returns (status, content-type, bytes)."""
    headers = {"accept": accept}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["content-type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as res:
            return res.status, res.headers.get("content-type", ""), res.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("content-type", ""), err.read()


def events(body):
    """The frames that carry an event field (the annotations), in order."""
    return [f for f in frames(body) if f.startswith(b"event:")]


def annotation_frames(body):
    """The frames named by one of ROUTER_NAMES, in order (a Responses API stream names every
    frame; those are its own)."""
    named = ((f, f.split(b"\n", 1)[0][len(b"event:") :].strip()) for f in events(body))
    return [f for f, name in named if name in ROUTER_NAMES]


def without_marker(body):
    """The stream with every marker frame taken out, byte for byte otherwise."""
    return b"".join(f for f in frames(body) if f != MARKER)


# What differs between two requests for the same reply: the ids Dynamo mints per request (a
# chat's `chatcmpl-<uuid>`, a completion's `cmpl-<uuid>`, a response's `resp_<hex>` and its
# message's `msg_<hex>`, an Anthropic message's `msg_<hex>`) and the clock (`created`,
# `created_at`). `canonical` numbers each id by its first appearance, so which frames share an id
# still counts, and zeroes the clock; every other byte is compared as it is.
IDS = re.compile(rb"\b(?:chatcmpl-|cmpl-|resp_|msg_)[0-9a-f][0-9a-f-]*")
CLOCK = re.compile(rb'"(created|created_at)":\d+')


def canonical(body):
    seen = {}

    def number(match):
        return b"<id %d>" % seen.setdefault(match.group(0), len(seen) + 1)

    return CLOCK.sub(rb'"\1":0', IDS.sub(number, body))


def first_difference(a, b):
    """Where two byte strings part, with some context, for a failure message."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    around = slice(max(0, at - 80), at + 80)
    return f"at byte {at} of {len(a)}/{len(b)}: {a[around]!r} vs {b[around]!r}"


def is_request_id_frame(frame):
    """`event: request_id\n: "<id>"\n\n`, the id a JSON string."""
    head, sep = b'event: request_id\n: "', b'"\n\n'
    if not (frame.startswith(head) and frame.endswith(sep)):
        return False
    try:
        return isinstance(json.loads(frame[len(b"event: request_id\n: ") : -2]), str)
    except ValueError:
        return False


def streamed_text(body, endpoint):
    """The text a stream of `endpoint` carries in its data lines, up to [DONE]: a chat's deltas,
    a completion's texts, a response's `response.output_text.delta` and a message's
    `text_delta` events."""
    text = []
    for frame in frames(body):
        data = next((line for line in frame.split(b"\n") if line.startswith(b"data: ")), None)
        if data is None:
            continue
        data = data[len(b"data: ") :].strip()
        if data == b"[DONE]":
            break
        value = json.loads(data)
        if endpoint == "responses":
            if value.get("type") == "response.output_text.delta":
                text.append(value["delta"])
        elif endpoint == "messages":
            delta = value.get("delta") if value.get("type") == "content_block_delta" else None
            if delta and delta.get("type") == "text_delta":
                text.append(delta["text"])
        else:
            for choice in value.get("choices", []):
                if endpoint == "chat":
                    text.append(choice.get("delta", {}).get("content") or "")
                else:
                    text.append(choice.get("text") or "")
    return "".join(text)


def report_reply(text, reply, what):
    """The check that a client got the reply replies.json holds for its request: the text it
    streamed, after `what` in the line."""
    return report(text == reply, f"{what} {text!r}", f"expected {reply!r}")


def request_body(endpoint, annotations, prompt="Say hello."):
    """The streaming request to `endpoint` with `annotations` in nvext: what the raw client sends
    as JSON, and the openai SDK as its create() arguments (nvext through extra_body)."""
    body = {"model": MODEL, "stream": True}
    if endpoint == "chat":
        body.update(messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS)
    elif endpoint == "completion":
        body.update(prompt=prompt, max_tokens=MAX_TOKENS)
    elif endpoint == "responses":
        body.update(input=prompt, max_output_tokens=MAX_TOKENS)
    else:
        body.update(messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS)
    body["nvext"] = {"annotations": annotations}
    return body


def stream(base, endpoint, annotations, prompt="Say hello."):
    body = request_body(endpoint, annotations, prompt)
    status, content_type, data = request(base + PATHS[endpoint], body)
    if status != 200 or not content_type.startswith("text/event-stream"):
        raise AssertionError(f"status {status}, content-type {content_type!r}: {data[:500]!r}")
    return data


def run_hold(args):
    prompt = " ".join(f"w{i}" for i in range(args.words))
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": prompt}],
    }
    started = time.monotonic()
    status, _, data = request(args.url + "/v1/chat/completions", body, timeout=3600)
    print(
        f"holder: done in {time.monotonic() - started:.1f} s, status {status}, "
        f"{len(data)} bytes, starts {data[:60]!r}",
        flush=True,
    )


def run_probe(args):
    try:
        body = stream(args.url, "chat", [replay("chat")])
    except Exception as err:  # not up yet
        print(f"probe: {err}", file=sys.stderr)
        return 1
    return 0 if body.startswith(MARKER) else 1


def run_direct(args):
    replies = json.load(open(args.replies))
    # Where 1.6.1 sends no marker: none comes, asked for or not, and the stream is the
    # endpoint's own named events, which the front doors must pass byte for byte.
    for endpoint in (e for e, marked in MARKED.items() if not marked):
        what = f"direct to Dynamo | {PATHS[endpoint]} stream"
        for annotations in ([], ["request_id", "x-bypass-remote-prefill"]):
            body = stream(args.url, endpoint, [replay(endpoint)] + annotations)
            asked = f"asked for {' and '.join(annotations)}" if annotations else "not opted in"
            found = annotation_frames(body)
            report(
                found == [] and MARKER not in frames(body),
                f"{what}, {asked}: no marker and no other annotation frame, as Dynamo 1.6.1 "
                f"streams this endpoint ({len(events(body))} named frames of its own)",
                f"Dynamo now sends annotation frames here, {found!r}: if it is the marker, set "
                f"MARKED[{endpoint!r}] = True (the front doors' checks then show it removed) "
                f"and update the docs; received {body[:300]!r}",
            )
        report_reply(streamed_text(body, endpoint), replies[endpoint], f"{what}: streams the reply")
    for endpoint in (e for e, marked in MARKED.items() if marked):
        what = f"direct to Dynamo | {endpoint} stream"
        body = stream(args.url, endpoint, [replay(endpoint)])
        report(
            frames(body)[0] == MARKER,
            f"{what}, not opted in: the bypass marker is the first frame, byte for byte",
            f"received {body[:300]!r}",
        )
        report(
            events(body) == [MARKER],
            f"{what}, not opted in: the marker is its only annotation frame",
            f"annotation frames {events(body)!r}",
        )
        report_reply(
            streamed_text(body, endpoint), replies[endpoint], f"{what}: then streams the reply"
        )
        body = stream(args.url, endpoint, [replay(endpoint), "request_id"])
        found = events(body)
        report(
            len(found) == 2 and is_request_id_frame(found[0]) and found[1] == MARKER,
            f"{what}, request_id asked for: the request_id frame, then the marker",
            f"annotation frames {found!r}",
        )


def run_proxy(args):
    replies = json.load(open(args.replies))
    for endpoint in ("chat", "completion"):
        what = f"through {args.via} | {endpoint} stream"
        text_ok = lambda body: streamed_text(body, endpoint) == replies[endpoint]  # noqa: E731

        body = stream(args.url, endpoint, [replay(endpoint)])
        report(
            events(body) == [] and text_ok(body),
            f"{what}, not opted in: no annotation frame, the reply {replies[endpoint]!r}",
            f"received {body[:400]!r}",
        )
        body = stream(args.url, endpoint, [replay(endpoint), "x-bypass-remote-prefill"])
        report(
            frames(body)[0] == MARKER and events(body) == [MARKER] and text_ok(body),
            f"{what}, opted in to x-bypass-remote-prefill: the marker first, byte for byte, "
            "once, then the reply",
            f"received {body[:400]!r}",
        )
        body = stream(args.url, endpoint, [replay(endpoint), "request_id"])
        found = events(body)
        report(
            len(found) == 1 and is_request_id_frame(found[0]) and text_ok(body),
            f"{what}, request_id asked for: the request_id frame and not the marker",
            f"annotation frames {found!r}, received {body[:400]!r}",
        )
        body = stream(args.url, endpoint, [replay(endpoint), "request_id", "x-bypass-remote-prefill"])
        found = events(body)
        report(
            len(found) == 2 and is_request_id_frame(found[0]) and found[1] == MARKER,
            f"{what}, both asked for: request_id, then the marker, as Dynamo sends them",
            f"annotation frames {found!r}",
        )

    # Every streaming endpoint, byte for byte: the same request straight to Dynamo and through
    # the front door, the bodies compared but for the ids and clocks (`canonical`). Not opted in,
    # the front door's stream is Dynamo's without the marker frames it sent (on chat and
    # completions, one; on the Responses and Messages APIs, none with 1.6.1: there the whole
    # stream, every named frame, must come through as it is). Opted in to the marker, it is
    # Dynamo's stream as it is.
    for endpoint in PATHS:
        for annotations in ([], ["x-bypass-remote-prefill"]):
            asked = "opted in to x-bypass-remote-prefill" if annotations else "not opted in"
            what = f"through {args.via} | {PATHS[endpoint]} stream, {asked}"
            request_annotations = [replay(endpoint)] + annotations
            direct = stream(args.direct_url, endpoint, request_annotations)
            through = stream(args.url, endpoint, request_annotations)
            want = direct if annotations else without_marker(direct)
            removed = len(frames(direct)) - len(frames(want))
            same = canonical(through) == canonical(want)
            text = streamed_text(through, endpoint)
            marker_gone = bool(annotations) or MARKER not in frames(through)
            report(
                same and text == replies[endpoint] and marker_gone,
                f"{what}: byte for byte the stream Dynamo sent for the same request"
                f"{f' less its {removed} marker frame(s)' if removed else ''} "
                f"({len(through)} bytes, {len(frames(through))} frames, "
                f"{len(events(through))} named), the reply {text!r}",
                (
                    f"differs {first_difference(canonical(through), canonical(want))}"
                    if not same
                    else f"the reply {text!r}, expected {replies[endpoint]!r}; "
                    f"received {through[:300]!r}"
                ),
            )

    # Non-streaming requests and GET /v1/models: the same through the proxy as straight to
    # Dynamo, but for the fields that differ per request.
    def normal(data):
        value = json.loads(data)
        value.pop("id", None)
        value.pop("created", None)
        return value

    for endpoint, path, body in (
        (
            "chat",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Say hello."}]},
        ),
        ("completion", "/v1/completions", {"prompt": "Say hello."}),
    ):
        body.update(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            nvext={"annotations": [replay(endpoint)]},
        )
        direct = request(args.direct_url + path, body, accept="application/json")
        proxied = request(args.url + path, body, accept="application/json")
        same = direct[:2] == proxied[:2] and normal(direct[2]) == normal(proxied[2])
        report(
            same and direct[0] == 200,
            f"non-streaming {endpoint}: status, content-type and body (but id and created) "
            f"the same through {args.via} as direct ({proxied[0]}, {proxied[1]}, "
            f"{len(proxied[2])} bytes)",
            f"direct {direct!r}, through {args.via} {proxied!r}",
        )
    # Dynamo stamps each model's "created" with the time of the request, so two requests a
    # second apart differ there; every other byte must be the same.
    def unstamped(reply):
        status, kind, data = reply
        return status, kind, re.sub(rb'"created":\d+', b'"created":0', data)

    direct = request(args.direct_url + "/v1/models", accept="application/json")
    proxied = request(args.url + "/v1/models", accept="application/json")
    report(
        unstamped(direct) == unstamped(proxied)
        and direct[0] == 200
        and b'"tiny"' in direct[2],
        f"GET /v1/models: status, content-type and body (but created) the same through "
        f"{args.via} as direct ({proxied[2]!r})",
        f"direct {direct!r}, through {args.via} {proxied!r}",
    )


def run_sdk(args):
    client = checks.openai_client(args, api_key="unused", timeout=TIMEOUT)
    if client is None:
        return
    replies = json.load(open(args.replies))

    def create(api, endpoint):
        """`api.create` with the raw client's request to `endpoint` (request_body)."""
        body = request_body(endpoint, [replay(endpoint)])
        nvext = body.pop("nvext")
        return api.create(**body, extra_body={"nvext": nvext})

    def chat():
        stream = create(client.chat.completions, "chat")
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def completion():
        stream = create(client.completions, "completion")
        return "".join(c.choices[0].text or "" for c in stream if c.choices)

    def responses():
        stream = create(client.responses, "responses")
        return "".join(e.delta for e in stream if e.type == "response.output_text.delta")

    for endpoint, call in (("chat", chat), ("completion", completion), ("responses", responses)):
        what = f"{args.label} | {args.where} | {PATHS[endpoint]} stream"
        # Straight to Dynamo, the SDK breaks where Dynamo sends the marker, and only there.
        breaks = args.expect == "fail" and MARKED[endpoint]
        try:
            text = call()
        except Exception as err:  # the SDK's own error is what is being checked
            failed = f"{type(err).__module__}.{type(err).__name__}: {err}"
            if breaks:
                report(
                    isinstance(err, json.JSONDecodeError),
                    f"{what}: fails on the marker ({failed})",
                    f"expected json.JSONDecodeError, got {failed}",
                )
            else:
                report(False, what, f"the SDK failed: {failed}")
            continue
        if breaks:
            report(False, what, f"streamed {text!r}, but the marker must break the SDK")
        else:
            report_reply(text, replies[endpoint], f"{what}:")


def run_anthropic(args):
    """Anthropic's SDK on /v1/messages: `messages.stream`, its text and its final message."""
    import anthropic

    if anthropic.__version__ != args.version:
        imported = anthropic.__version__
        report(False, args.label, f"expected anthropic {args.version}, imported {imported}")
        return
    # Unlike openai-python, this SDK skips events whose name it does not know: measured with a
    # marker prepended to Dynamo's /v1/messages stream, messages.stream still reads its reply. So
    # it streams straight to Dynamo whatever MARKED says, and `direct` is the check that sees the
    # day Dynamo marks this endpoint.
    replies = json.load(open(args.replies))
    # The SDK appends /v1/messages to the base URL.
    client = anthropic.Anthropic(
        base_url=args.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT
    )
    what = f"{args.label} | {args.where} | /v1/messages stream"
    try:
        with client.messages.stream(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": "Say hello."}],
            extra_body={"nvext": {"annotations": [replay("messages")]}},
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    except Exception as err:  # the SDK's own error is what is being checked
        failed = f"{type(err).__module__}.{type(err).__name__}: {err}"
        report(False, what, f"the SDK failed: {failed}")
        return
    final_text = "".join(block.text for block in final.content if block.type == "text")
    report(
        text == final_text == replies["messages"],
        f"{what}: text_stream and the final message both {text!r}",
        f"text_stream {text!r}, final message {final_text!r}, expected {replies['messages']!r}",
    )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="mode", required=True)
    hold = sub.add_parser("hold")
    hold.add_argument("--url", required=True)
    hold.add_argument("--words", type=int, required=True)
    probe = sub.add_parser("probe")
    probe.add_argument("--url", required=True)
    direct = sub.add_parser("direct")
    direct.add_argument("--url", required=True)
    direct.add_argument("--replies", required=True)
    proxy = sub.add_parser("proxy")
    proxy.add_argument("--url", required=True)
    proxy.add_argument("--direct-url", required=True)
    proxy.add_argument("--replies", required=True)
    proxy.add_argument("--via", default="the proxy", help="what --url is, for the messages")
    sdk = checks.sdk_mode(sub, ["pass", "fail"])
    sdk.add_argument("--replies", required=True)
    sdk.add_argument("--via", default="the proxy", help="what --base-url is when --expect pass")
    claude = sub.add_parser("anthropic")
    claude.add_argument("--base-url", required=True, help="without /v1: the SDK adds it")
    claude.add_argument("--label", required=True)
    claude.add_argument("--version", required=True)
    claude.add_argument("--replies", required=True)
    claude.add_argument("--via", help="what --base-url is; without it, Dynamo itself")
    args = parser.parse_args()
    if args.mode == "sdk":
        args.where = f"through {args.via}" if args.expect == "pass" else "direct to Dynamo"
    if args.mode == "anthropic":
        args.where = f"through {args.via}" if args.via else "direct to Dynamo"
    run = {
        "hold": run_hold,
        "probe": run_probe,
        "direct": run_direct,
        "proxy": run_proxy,
        "sdk": run_sdk,
        "anthropic": run_anthropic,
    }[args.mode]
    status = run(args)
    return status if status is not None else checks.exit_status()


if __name__ == "__main__":
    sys.exit(main())

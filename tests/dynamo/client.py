#!/usr/bin/env python3
"""Clients for tests/dynamo/run.sh, against the real Dynamo 1.6.1 frontend and the proxy.

Dynamo's mocker streams the replies of replies.json (built by model.py) to a request whose
nvext.annotations hold `output_replay_id:<key>`. While the slowed prefill worker is busy with the
holder's long request, Dynamo's KV router bypasses remote prefill for every other request and
its HTTP layer prepends `event: x-bypass-remote-prefill\n: true\n\n` to the stream, asked for or
not (1.6.1 never reads the opt-in). A client that lists `request_id` gets
`event: request_id\n: "<id>"\n\n` as well, before the marker.

  client.py hold --url URL --words N
      The holder: one chat stream with a prompt of N words and max_tokens 1, read to its end.
      Prints `holder: done in S s` when Dynamo answered it.
  client.py probe --url URL
      Exits 0 if a plain chat stream starts with the marker frame (the bypass is on), else 1.
  client.py direct --url URL --replies FILE
      The control, a raw HTTP client straight to Dynamo: chat and completion streams start with
      the marker, byte for byte, then stream the reply; with request_id asked for, both frames.
  client.py proxy --url PROXY --direct-url URL --replies FILE [--via NAME]
      A raw HTTP client through the proxy (or Envoy with the processor, --via Envoy): plain streams carry no annotation frame and the same
      reply; opted in to the marker, it is the first frame, byte for byte, once; request_id asked
      for gives that frame and not the marker; both asked for give both, as Dynamo sends them.
      Non-streaming chat and completions, and GET /v1/models, are the same as straight to Dynamo.
  client.py sdk --base-url URL/v1 --expect pass|fail --label L --version V --replies FILE
      Streams chat and completions with the openai package of the running interpreter. pass (the
      proxy): each streams the reply. fail (Dynamo itself): each fails with json.JSONDecodeError.

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
    """The text of the data frames of a chat or completion stream, up to [DONE]."""
    text = []
    for frame in frames(body):
        if not frame.startswith(b"data: "):
            continue
        data = frame[len(b"data: ") :].strip()
        if data == b"[DONE]":
            break
        for choice in json.loads(data).get("choices", []):
            if endpoint == "chat":
                text.append(choice.get("delta", {}).get("content") or "")
            else:
                text.append(choice.get("text") or "")
    return "".join(text)


def stream(base, endpoint, annotations, prompt="Say hello."):
    body = {"model": MODEL, "stream": True, "max_tokens": MAX_TOKENS}
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    body["nvext"] = {"annotations": annotations}
    status, content_type, data = request(base + path, body)
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
    for endpoint in ("chat", "completion"):
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
        text = streamed_text(body, endpoint)
        report(
            text == replies[endpoint],
            f"{what}: then streams the reply {text!r}",
            f"expected {replies[endpoint]!r}",
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
    import openai

    if openai.__version__ != args.version:
        report(False, args.label, f"expected openai {args.version}, imported {openai.__version__}")
        return
    replies = json.load(open(args.replies))
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT)

    def chat():
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_body={"nvext": {"annotations": [replay("chat")]}},
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def completion():
        stream = client.completions.create(
            model=MODEL,
            prompt="Say hello.",
            max_tokens=MAX_TOKENS,
            stream=True,
            extra_body={"nvext": {"annotations": [replay("completion")]}},
        )
        return "".join(c.choices[0].text or "" for c in stream if c.choices)

    for endpoint, call in (("chat", chat), ("completion", completion)):
        what = f"{args.label} | {args.where} | {endpoint} stream"
        try:
            text = call()
        except Exception as err:  # the SDK's own error is what is being checked
            failed = f"{type(err).__module__}.{type(err).__name__}: {err}"
            if args.expect == "pass":
                report(False, what, f"the SDK failed: {failed}")
            else:
                report(
                    isinstance(err, json.JSONDecodeError),
                    f"{what}: fails on the marker ({failed})",
                    f"expected json.JSONDecodeError, got {failed}",
                )
            continue
        if args.expect == "pass":
            report(text == replies[endpoint], f"{what}: {text!r}", f"expected {replies[endpoint]!r}")
        else:
            report(False, what, f"streamed {text!r}, but the marker must break the SDK")


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
    sdk = sub.add_parser("sdk")
    sdk.add_argument("--base-url", required=True)
    sdk.add_argument("--expect", choices=["pass", "fail"], required=True)
    sdk.add_argument("--label", required=True)
    sdk.add_argument("--version", required=True)
    sdk.add_argument("--replies", required=True)
    sdk.add_argument("--via", default="the proxy", help="what --base-url is when --expect pass")
    args = parser.parse_args()
    if args.mode == "sdk":
        args.where = f"through {args.via}" if args.expect == "pass" else "direct to Dynamo"
    run = {
        "hold": run_hold,
        "probe": run_probe,
        "direct": run_direct,
        "proxy": run_proxy,
        "sdk": run_sdk,
    }[args.mode]
    status = run(args)
    return status if status is not None else checks.exit_status()


if __name__ == "__main__":
    sys.exit(main())

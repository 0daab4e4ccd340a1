#!/usr/bin/env python3
"""Checks through Envoy with the processor (started by tests/envoy/run.sh), the dynamic module
(tests/envoy/module.sh: `--front module`) or the proxy-wasm plugin (tests/envoy/wasm.sh:
`--front wasm`), with a small HTTP/1.1 client of its own that tells a
clean end of a response from a broken one.

  client.py checks --envoy URL --upstream URL
      the request side and the pass-through: router-owned names never reach the upstream (any
      form, streamed or not, a 5 MiB body too), a body the guard refuses gets its 400 and never
      reaches the upstream, JSON responses and GET /v1/models are the same status, content-type
      and bytes as straight from the upstream (content-length kept, or chunked: Envoy drops it
      when response_body_mode is STREAMED), opted-in clients get exactly what they asked for
      (the marker byte for byte)
  client.py concurrent --envoy URL --upstream URL --streams N
      N scripted streams at once (all in flight together), each byte for byte what its opt-in
      allows, and no router-owned name reached the upstream
  client.py down --envoy URL --upstream URL
      Envoy whose processor is not running: a 5xx, no upstream byte, the upstream saw nothing
  client.py kill --envoy URL --upstream URL --pid PID
      a paced stream; after its first events the processor (PID) is killed: the client sees a
      broken stream (no clean end, no [DONE]) and never the marker
  client.py stall --envoy URL --upstream URL --pid PID --timeout SECS
      the processor stopped (SIGSTOP) before a request: Envoy gives up after its message timeout
      (a 5xx, nothing reaches the upstream); in the middle of a stream: nothing more reaches the
      client, and the stream breaks a message timeout after the upstream's last chunk (Envoy
      re-arms the timeout with every chunk it sends); each time the processor then continues
      (SIGCONT) and serves the next request
  client.py disconnect --envoy URL --upstream URL
      a client that goes away in the middle of a stream: the upstream's stream is cancelled, and
      Envoy and the processor serve the next request
  client.py reset --envoy URL --upstream URL
      an upstream that resets its connection in the middle of a stream: the client sees a broken
      stream, never the marker; the next request is served
  client.py pieces --envoy URL --upstream URL --streams N
      N scripted streams, one after another, whose upstream writes 1 to 9 bytes at a time (1 ms
      apart, so that Envoy reads them apart): each byte for byte what its opt-in allows
  client.py panic --envoy URL --upstream URL --hook HOOK
      (a module built with feature test-panic) a request whose header makes HOOK panic: the
      client sees an error or a broken stream, never the marker nor a clean end of a stream; the
      next request is served
  client.py panic_inflight --envoy URL --upstream URL --hook HOOK
      (the proxy-wasm plugin's test-panic build) a stream in flight when another panics in HOOK:
      it breaks too (Envoy fails every stream of the trapped VM), never the marker; the next
      stream is served by a reloaded VM
  client.py chain --envoy URL --upstream URL --label NAME
      (an Envoy with a body-buffering filter before the module, max-body 100) {"model":"m"}, a
      56-byte body, the body `1` and a body naming a router-owned marker, with content-length and
      chunked: each reaches the upstream once, as sent (the marker stripped)
  client.py trailers --envoy URL --upstream URL --streams N
      (an Envoy with enable_trailers both ways) N scripted streams that end in a trailer section:
      each byte for byte what its opt-in allows, then its trailer; chunked requests that end in a
      trailer section: the body judged whole (a router-owned name stripped), then the trailer
  client.py unheld --envoy URL --upstream URL --kind forwarded|held
      (the plugin in an Envoy without allow_on_headers_stop_iteration, request_timeout 3 s)
      forwarded: a shortened body padded to the content-length sent, a refused request's head at
      the upstream, a stalled upload holding the upstream connection until the 408; held: the
      request answered by request_timeout (504), nothing at the upstream, not even the head
  client.py curl --envoy URL --upstream URL --streams N
      N scripted streams through curl, over HTTP/1.1 and HTTP/2 (prior knowledge): each byte for
      byte what its opt-in allows
  client.py encoded --envoy URL --upstream URL
      an upstream that gzips an event stream whatever the request asked for: a 502 before any
      byte (the stream has a marker to remove), and the next stream is served
  client.py h2 --envoy URL --upstream URL --h2-python PYTHON
      (an Envoy whose upstream cluster speaks HTTP/2 to tests/envoy/h2_upstream.py) a 204 and a
      304 HEADERS without END_STREAM, then DATA holding the marker frame: over HTTP/1.1 and over
      HTTP/2 (h2_upstream.py fetch, run with PYTHON, which has the h2 package) the client gets
      one of the two outcomes H2_RESET_BODY's comment gives, never a byte of the DATA
  client.py nocontent --envoy URL --upstream URL
      (issue 48) an event stream with `transfer-encoding: gzip, chunked`, a 204 and a 304 with
      `content-type: text/event-stream` and body bytes after the head, an event-stream answer to
      HEAD with body bytes after the head: the exact outcome Envoy's HTTP/1.1 codec gives each
      (see NO_CONTENT_CASES), never a byte of the marker anywhere in what the client reads until
      Envoy closes the connection, and the next stream is served

Prints `PASS <what>` or `FAIL <what>: <why>` per check; exits 1 if any failed.
"""

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from urllib.parse import urlsplit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import checks  # noqa: E402  (tests/support/checks.py)
from checks import report  # noqa: E402
import script  # noqa: E402  (tests/envoy/script.py)


class Response:
    def __init__(self):
        self.status = None
        self.headers = {}
        self.body = b""
        self.clean_end = False  # the whole body arrived as framed (last chunk, or content-length)
        self.trailers = {}
        self.error = None  # why it did not: the connection closed or reset early, a timeout
        self.elapsed = None


async def request(url, path, body=None, headers=None, method=None, on_data=None, timeout=30,
                  chunked=False, trailers=None):
    """One request on a new connection. `on_data(response)` is called after each read of the
    body; returning True stops reading (the connection is closed, as a client going away).
    `chunked`: send the body in chunked encoding (no content-length), with the trailer section
    `trailers` (a dict) if given."""
    parts = urlsplit(url)
    res = Response()
    started = time.monotonic()
    method = method or ("POST" if body is not None else "GET")
    data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [f"{method} {path} HTTP/1.1", f"host: {parts.netloc}", "connection: close"]
    extra = dict(headers or {})
    content_type = extra.pop("content-type", "application/json")
    if body is not None and chunked:
        head += [f"content-type: {content_type}", "transfer-encoding: chunked"]
        end = b"0\r\n" + b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in (trailers or {}).items())
        data = (b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + end + b"\r\n"
    elif body is not None:
        head += [f"content-type: {content_type}", f"content-length: {len(data)}"]
    head += [f"{k}: {v}" for k, v in extra.items()]
    state = {"writer": None, "sending": None, "in_chunk": False}

    async def exchange():
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port, limit=1 << 24)
        state["writer"] = writer
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        # The answer may come before the whole body is sent (a 413): read while writing.
        state["sending"] = asyncio.ensure_future(writer.drain())
        res.status, res.headers = script.response_head(await reader.readuntil(b"\r\n\r\n"))
        if method == "HEAD" or res.status in (204, 304):
            res.clean_end = True
        elif res.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                        k, _, v = line.decode("latin-1").partition(":")
                        res.trailers[k.strip().lower()] = v.strip()
                    res.clean_end = True
                    break
                state["in_chunk"] = True
                res.body += await reader.readexactly(size)
                state["in_chunk"] = False
                await reader.readexactly(2)
                if on_data and on_data(res):
                    break
        elif "content-length" in res.headers:
            res.body = await reader.readexactly(int(res.headers["content-length"]))
            res.clean_end = True
        else:
            res.body = await reader.read()
            res.error = "no framing: read to the end of the connection"

    try:
        await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout} s"
    except asyncio.IncompleteReadError as err:
        if state["in_chunk"]:
            res.body += err.partial
        res.error = "the connection closed before the end of the response"
    except (ConnectionError, ValueError) as err:
        res.error = f"{type(err).__name__}: {err}"
    finally:
        if state["sending"] is not None:
            state["sending"].cancel()
            try:
                await state["sending"]
            except (asyncio.CancelledError, ConnectionError):
                pass
        if state["writer"] is not None:
            state["writer"].close()
    res.elapsed = time.monotonic() - started
    return res


def chat(stream, annotations=None, test=None, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if annotations is not None:
        body["nvext"] = {"annotations": annotations}
    if test is not None:
        body["test"] = test
    body.update(extra)
    return body


def sized_body(size, annotations):
    """A non-streamed chat request of exactly `size` bytes, naming `annotations`."""
    body = chat(False, annotations, padding="")
    base = len(json.dumps(body).encode())
    body["padding"] = "p" * (size - base)
    data = json.dumps(body).encode()
    assert len(data) == size
    return data


class Ids:
    """Test ids unique to this run, for the upstream's /seen."""

    def __init__(self, mode):
        self.prefix = f"{mode}-{os.getpid()}-{time.time_ns()}"
        self.n = 0

    def __call__(self):
        self.n += 1
        return f"{self.prefix}-{self.n}"


async def seen(upstream, test_id):
    res = await request(upstream, f"/seen?test_id={test_id}")
    return json.loads(res.body) if res.status == 200 else None


async def head_seen(upstream, test_id):
    """Whether the upstream got the request's head at all (even one whose body never came)."""
    return (await request(upstream, f"/head?test_id={test_id}")).status == 200


async def counts(upstream):
    return json.loads((await request(upstream, "/counts")).body)


async def wait_outcome(upstream, test_id, want, within=10):
    """The upstream's outcome for test_id once it is `want` (or the last one after `within`)."""
    deadline = time.monotonic() + within
    while True:
        entry = await seen(upstream, test_id)
        outcome = entry and entry["outcome"]
        if outcome == want or time.monotonic() > deadline:
            return outcome
        await asyncio.sleep(0.05)


def show(body, limit=300):
    return repr(body[:limit]) + ("..." if len(body) > limit else "")


async def served_after(args, what, within=0.0):
    """A scripted stream through Envoy right after a failure: served, byte for byte. With
    `within` (seconds), Envoy may first answer with its 5xx while it recovers (the proxy-wasm
    plugin's VM reloading after a trap): the stream is asked for again until it is served or
    `within` has passed, and none of the answers before may carry a byte of the stream."""
    full, expected = script.stream(1)
    started = time.monotonic()
    refused = 0
    while True:
        res = await request(
            args.envoy, "/v1/chat/completions",
            chat(True, script.annotations_of(1), {"kind": "script", "id": 1}),
        )
        recovering = (res.status or 0) >= 500 and b"data:" not in res.body
        if not recovering or time.monotonic() - started >= within:
            break
        refused += 1
        await asyncio.sleep(0.1)
    waited = time.monotonic() - started
    report(
        res.status == 200 and res.clean_end and res.body == expected,
        f"{what}: the next stream through Envoy is served byte for byte"
        + (f" ({refused} answered 5xx first, served {waited:.1f} s after, bound {within:.0f} s)" if within else ""),
        f"status {res.status}, error {res.error}, body {show(res.body)}, after {waited:.1f} s",
    )


# ---------------------------------------------------------------------------------------------


async def run_checks(args):
    ids = Ids("checks")
    before = await counts(args.upstream)
    # Router-owned names in every form a client could try: none may reach the upstream.
    forms = [
        ["x-bypass-remote-prefill"],
        ["X-Bypass-Remote-Prefill"],
        ["x-bypass-remote-prefill:true"],
        [" x-bypass-remote-prefill "],
        ["x-prefill-continue", "request_id"],
        ["X-PREFILL-CONTINUE:1"],
    ]
    for stream in (False, True):
        for names in forms:
            test_id = ids()
            res = await request(
                args.envoy, "/v1/chat/completions", chat(stream, names),
                headers={"x-test-id": test_id},
            )
            entry = await seen(args.upstream, test_id)
            got = entry and entry["body"].get("nvext", {}).get("annotations")
            # The body as rewritten goes on with its own content-length, never padded to the
            # length the client sent (the plugin holds the head, as the module does).
            raw = entry and entry.get("raw", "")
            framed = args.front not in ("wasm", "module") or (
                entry is not None and raw == raw.rstrip()
                and entry.get("content_length") == str(len(raw.encode("latin-1"))))
            report(
                res.status == 200 and entry is not None and not script.forces(entry["body"]) and framed,
                f"{'streamed' if stream else 'non-streamed'} request naming {names!r}: "
                f"the upstream got annotations {got!r}, {len(raw or '')} bytes with a content-length "
                "of as many, no padding",
                f"status {res.status}, upstream saw {entry and entry['body']}, raw {raw!r}, "
                f"content-length {entry and entry.get('content_length')}",
            )
    # A client that accepts gzip (the OpenAI SDKs do): the upstream, which compresses for such
    # clients, is asked for identity by the processor, so the stream is filtered, not passed
    # through encoded with the marker in it.
    test_id = ids()
    res = await request(
        args.envoy, "/v1/chat/completions", chat(True),
        headers={"x-test-id": test_id, "accept-encoding": "gzip, deflate, br"},
    )
    entry = await seen(args.upstream, test_id)
    report(
        res.status == 200 and res.clean_end and "content-encoding" not in res.headers
        and script.MARKER not in res.body and b"data:" in res.body
        and entry is not None and entry.get("accept_encoding") == "identity",
        "a client that accepts gzip gets the stream filtered (the upstream was asked for identity)",
        f"status {res.status}, headers {res.headers}, body {show(res.body)}, "
        f"upstream saw accept-encoding {entry and entry.get('accept_encoding')!r}",
    )
    # The JSON escape of a name is the name.
    test_id = ids()
    raw = b'{"model":"tiny","stream":false,"messages":[],"nvext":{"annotations":["x-bypass-remote-prefil\\u006c"]}}'
    res = await request(args.envoy, "/v1/chat/completions", raw, headers={"x-test-id": test_id})
    entry = await seen(args.upstream, test_id)
    report(
        res.status == 200 and entry is not None and not script.forces(entry["body"]),
        "a router-owned name written with a JSON escape does not reach the upstream",
        f"status {res.status}, upstream saw {entry and entry['body']}",
    )
    # A 5 MiB body: more than Envoy's default buffer (1 MiB) and gRPC's default message (4 MiB).
    test_id = ids()
    big = chat(False, ["x-bypass-remote-prefill"], padding="p" * (5 << 20))
    res = await request(args.envoy, "/v1/chat/completions", big, headers={"x-test-id": test_id})
    entry = await seen(args.upstream, test_id)
    report(
        res.status == 200 and entry is not None and not script.forces(entry["body"])
        and len(entry["body"].get("padding", "")) == 5 << 20,
        "a 5 MiB JSON body goes through Envoy and the guard, the marker stripped from it",
        f"status {res.status} {show(res.body)}, upstream saw {entry is not None}",
    )
    # The limits of the shipped bootstrap and the processor's default --max-body (32 MiB): a body
    # just under it goes through, chunked or not; one over it gets the processor's 413
    # (OpenAI-shaped: from content-length at the head, or from the buffered body when chunked) as
    # long as Envoy's buffer limit (32 MiB + 64 KiB) holds it; a chunked one over Envoy's buffer
    # limit gets Envoy's own 413. None of the refused ones reaches the upstream.
    # The proxy-wasm plugin races Envoy over the last case: Envoy adds each chunk to its buffer
    # before calling the plugin, so whichever sees the body over its limit first answers, and that
    # depends on how the chunks arrive. Both answers are right; either is accepted ("any 413"), and
    # the upstream must not see the body either way.
    max_body = 32 << 20
    for what, size, chunked, want in (
        ("a body of 32 MiB - 1 KiB", max_body - 1024, False, 200),
        ("a chunked body of 32 MiB - 1 KiB", max_body - 1024, True, 200),
        ("a body of 32 MiB + 1 KiB (over --max-body)", max_body + 1024, False, "processor 413"),
        ("a chunked body of 32 MiB + 1 KiB (over --max-body)", max_body + 1024, True, "processor 413"),
        ("a body of 32 MiB + 128 KiB", max_body + (128 << 10), False, "processor 413"),
        # The processor sees a buffered body only once Envoy has all of it; the module sees every
        # chunk and refuses as soon as the body is over --max-body, before Envoy's limit.
        # So does the processor in FULL_DUPLEX_STREAMED, where Envoy buffers nothing. The
        # proxy-wasm plugin sees every chunk too, but Envoy adds it to its buffer first.
        ("a chunked body of 32 MiB + 128 KiB (over Envoy's buffer limit)", max_body + (128 << 10), True,
         {"module": "processor 413", "duplex": "processor 413", "wasm": "any 413"}.get(args.front, "envoy 413")),
    ):
        test_id = ids()
        raw = sized_body(size, ["x-bypass-remote-prefill"])
        res = await request(args.envoy, "/v1/chat/completions", raw, headers={"x-test-id": test_id},
                            timeout=60, chunked=chunked)
        entry = await seen(args.upstream, test_id)
        if want == 200:
            ok = res.status == 200 and entry is not None and not script.forces(entry["body"])
        else:
            try:
                shaped = json.loads(res.body)["error"]["type"] == "invalid_request_error"
            except (ValueError, KeyError, TypeError):
                shaped = False
            # The processor's refusal is OpenAI-shaped; Envoy's own is its plain text. The plugin
            # holds the head as the module does: not even it reaches the upstream.
            head = args.front == "wasm" and await head_seen(args.upstream, test_id)
            ok = (res.status == 413 and entry is None and not head
                  and (want == "any 413" or shaped == (want == "processor 413")))
        report(
            ok,
            f"{what}: {res.status} ({show(res.body, 100)})"
            + (", the upstream got it without the marker" if want == 200 else ", the upstream never saw it"),
            f"status {res.status}, body {show(res.body)}, upstream saw it: {entry is not None}"
            + ("" if want == 200 else f", its head: {head}"),
        )
        entry = None

    # A body the guard refuses: its status and OpenAI-shaped error, nothing reaches the upstream.
    for what, raw in (
        ("invalid JSON", b'{"model":"tiny","nvext":{"annotations":["x-bypass-remote-prefill"]'),
        ("a duplicate nvext key", b'{"nvext":{"annotations":[]},"nvext":{"annotations":["x-bypass-remote-prefill"]}}'),
    ):
        test_id = ids()
        res = await request(args.envoy, "/v1/chat/completions", raw, headers={"x-test-id": test_id})
        try:
            error = json.loads(res.body)["error"]
            shaped = error["type"] == "invalid_request_error" and "message" in error and "code" in error
        except (ValueError, KeyError, TypeError):
            shaped = False
        entry = await seen(args.upstream, test_id)
        head = args.front == "wasm" and await head_seen(args.upstream, test_id)
        report(
            res.status == 400 and shaped and entry is None and not head,
            f"{what}: refused by the processor with 400 and an OpenAI-shaped error ({show(res.body, 160)}), "
            "the upstream never saw it" + (", not even its head" if args.front == "wasm" else ""),
            f"status {res.status}, body {show(res.body)}, upstream saw it: {entry is not None}, its head: {head}",
        )
    # JSON responses and the model list: the same bytes as straight from the upstream.
    for what, path, body in (
        ("GET /v1/models", "/v1/models", None),
        ("a non-streamed chat completion", "/v1/chat/completions", chat(False)),
        ("a non-streamed chat completion with an opt-in", "/v1/chat/completions", chat(False, ["request_id"])),
    ):
        direct = await request(args.upstream, path, body)
        through = await request(args.envoy, path, body)
        # Envoy drops content-length from every response when response_body_mode is STREAMED,
        # before the processor sees it (checked: it keeps it with NONE); unless the processor puts
        # it back, the same bytes come chunked.
        length = through.headers.get("content-length")
        framing = (
            "and content-length" if length == str(len(direct.body))
            else "(chunked: Envoy's STREAMED mode drops content-length)"
            if length is None and through.headers.get("transfer-encoding") == "chunked"
            else None
        )
        report(
            through.status == direct.status == 200
            and through.body == direct.body and through.clean_end
            and through.headers.get("content-type") == direct.headers.get("content-type")
            and framing is not None,
            f"{what}: through Envoy the same status, content-type and {len(direct.body)} bytes "
            f"{framing} as straight from the upstream",
            f"direct {direct.status} {show(direct.body)}, through Envoy {through.status} "
            f"{through.headers} {show(through.body)}",
        )
    # Scripted streams: straight from the upstream every annotation arrives (the control);
    # through Envoy exactly what each client's opt-in allows, the marker byte for byte.
    for stream_id in range(8):
        full, expected = script.stream(stream_id)
        names = script.annotations_of(stream_id)
        body = chat(True, names, {"kind": "script", "id": stream_id})
        direct = await request(args.upstream, "/v1/chat/completions", body)
        through = await request(args.envoy, "/v1/chat/completions", body)
        report(
            direct.body == full and through.status == 200 and through.clean_end
            and through.body == expected
            and through.headers.get("content-type") == "text/event-stream",
            f"scripted stream {stream_id} asking for {names}: direct {len(full)} bytes with every "
            f"annotation, through Envoy the {len(expected)} bytes its opt-in allows"
            + (" (the marker first, byte for byte)" if expected.startswith(script.MARKER) else ""),
            f"direct == full: {direct.body == full}; through Envoy status {through.status}, "
            f"clean end {through.clean_end}, {len(through.body)} bytes, error {through.error}, "
            f"first difference at {next((i for i, (a, b) in enumerate(zip(through.body, expected)) if a != b), min(len(through.body), len(expected)))}",
        )
    # The upstream's own count agrees: the only requests that named a router-owned marker are the
    # scripted ones sent straight to it (the control), none of those through Envoy.
    after = await counts(args.upstream)
    direct_forcing = sum(script.forces(chat(True, script.annotations_of(i))) for i in range(8))
    report(
        after["forced"] - before["forced"] == direct_forcing,
        f"the upstream counted {after['forced'] - before['forced']} requests naming a router-owned "
        f"marker, the {direct_forcing} sent straight to it, none of the "
        f"{after['requests'] - before['requests'] - 8} through Envoy",
        f"{after['forced'] - before['forced']} forcing requests, expected {direct_forcing}",
    )


async def run_concurrent(args):
    before = await counts(args.upstream)
    n = args.streams
    started = time.monotonic()

    async def one(stream_id):
        body = chat(True, script.annotations_of(stream_id), {"kind": "script", "id": stream_id, "barrier": n})
        return stream_id, await request(args.envoy, "/v1/chat/completions", body, timeout=120)

    results = await asyncio.gather(*(one(i) for i in range(n)))
    elapsed = time.monotonic() - started
    bad = []
    for stream_id, res in results:
        _, expected = script.stream(stream_id)
        if not (res.status == 200 and res.clean_end and res.body == expected):
            bad.append(f"stream {stream_id}: status {res.status}, error {res.error}, {len(res.body)} of {len(expected)} bytes")
    after = await counts(args.upstream)
    total = sum(len(script.stream(i)[1]) for i in range(n))
    report(
        not bad,
        f"{n} concurrent streams through Envoy and the {args.front}, all in flight at once, each byte "
        f"for byte what its opt-in allows ({total} bytes in {elapsed:.1f} s)",
        f"{len(bad)} wrong: " + "; ".join(bad[:5]),
    )
    report(
        after["requests"] - before["requests"] == n and after["forced"] == before["forced"],
        f"the upstream got all {n} requests, and none of the {n // 4} that tried to force the marker named it",
        f"requests {after['requests'] - before['requests']}, forced {after['forced'] - before['forced']}",
    )


async def run_down(args):
    ids = Ids("down")
    for what, body in (
        ("a streamed request", chat(True, test={"kind": "paced", "events": 3, "interval_ms": 1})),
        ("a non-streamed request", chat(False)),
    ):
        test_id = ids()
        res = await request(args.envoy, "/v1/chat/completions", body, headers={"x-test-id": test_id})
        entry = await seen(args.upstream, test_id)
        report(
            res.status is not None and 500 <= res.status < 600 and b"data:" not in res.body
            and b"x-bypass" not in res.body and entry is None,
            f"processor down, {what}: Envoy answers {res.status} ({show(res.body, 80)}), the "
            "upstream never saw the request",
            f"status {res.status}, body {show(res.body)}, upstream saw it: {entry is not None}",
        )
    res = await request(args.envoy, "/v1/models")
    report(
        res.status is not None and 500 <= res.status < 600 and b"tiny" not in res.body,
        f"processor down, GET /v1/models: Envoy answers {res.status}, not the upstream's list",
        f"status {res.status}, body {show(res.body)}",
    )


async def broken_stream(args, what, act, events=40, interval_ms=100, timeout=30):
    """A paced stream through Envoy (every data frame preceded by the marker); `act(res)` runs
    once the first events have arrived. The client must see a broken stream and never the
    marker. Returns the response."""
    test_id = Ids(what.split()[0])()
    acted = asyncio.Event()

    def on_data(res):
        if not acted.is_set() and res.body.count(b"data:") >= 3:
            acted.set()
            act(res)
        return False

    body = chat(True, test={"kind": "paced", "events": events, "interval_ms": interval_ms})
    res = await request(args.envoy, "/v1/chat/completions", body, headers={"x-test-id": test_id},
                        on_data=on_data, timeout=timeout)
    expected_prefix = script.paced_expected(events)
    report(
        res.status == 200 and acted.is_set() and not res.clean_end and res.error is not None
        and b"[DONE]" not in res.body and script.MARKER not in res.body
        and b"x-bypass" not in res.body and expected_prefix.startswith(res.body),
        f"{what}: the client got {res.body.count(b'data:')} of {events} events, unfiltered none, "
        f"then a broken stream ({res.error}) after {res.elapsed:.1f} s, never the marker nor a clean end",
        f"status {res.status}, acted {acted.is_set()}, clean end {res.clean_end}, error {res.error}, body {show(res.body)}",
    )
    return res, test_id


async def run_kill(args):
    res, _ = await broken_stream(args, "processor killed mid-stream", lambda res: os.kill(args.pid, signal.SIGKILL))
    report(res.elapsed < 10, f"processor killed mid-stream: the stream ended {res.elapsed:.1f} s after it began (40 events of 100 ms would take 4 s)", "too slow")


def stopped(pid):
    """Whether every thread of process pid has stopped (state T in /proc)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = []
        for tid in tasks:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
            states.append(stat[stat.rindex(")") + 2])
    except (FileNotFoundError, ProcessLookupError):
        return False
    return bool(states) and all(state in "tT" for state in states)


async def stop_process(pid):
    """SIGSTOP, then wait until every thread has stopped: on a busy machine a thread may still
    run for a while after kill() returns, and could answer Envoy meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    for _ in range(200):
        if stopped(pid):
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"process {pid} did not stop within 2 s of SIGSTOP")


@contextlib.asynccontextmanager
async def stalled(args, what):
    """The processor (`args.pid`), stopped with SIGSTOP before the body or in it, is continued
    (SIGCONT) on the way out whatever happened there, so that no check leaves it stopped; then,
    unless the body raised, the next stream through Envoy must be served (`served_after`, its line
    starting with `what`)."""
    try:
        yield
    finally:
        os.kill(args.pid, signal.SIGCONT)
    await served_after(args, what)


async def run_stall(args):
    ids = Ids("stall")
    await stop_process(args.pid)
    async with stalled(args, "processor continued"):
        test_id = ids()
        res = await request(args.envoy, "/v1/chat/completions", chat(True, test={"kind": "paced", "events": 3, "interval_ms": 1}),
                            headers={"x-test-id": test_id}, timeout=args.timeout + 20)
        entry = await seen(args.upstream, test_id)
        report(
            res.status is not None and 500 <= res.status < 600 and b"data:" not in res.body
            and entry is None and res.elapsed < args.timeout + 5,
            f"processor stopped before a request: Envoy answers {res.status} after {res.elapsed:.1f} s "
            f"(message timeout {args.timeout} s), the upstream never saw it",
            f"status {res.status}, after {res.elapsed:.1f} s, body {show(res.body)}, upstream saw it: {entry is not None}",
        )

    # In the middle of a stream. Envoy forwards nothing more, but it re-arms the message timeout
    # with every chunk it sends the processor (Envoy 1.40.0), so the stream breaks a message
    # timeout after the upstream's last chunk (or once the chunks held for the processor reach the
    # buffer limit), not a message timeout after the stall.
    # The events that may still arrive after the stall are those the processor answered before
    # it: at most the ones the upstream had written by then (one at once, then one per interval),
    # less those the client had read. How many that is depends on how far the client lags behind
    # on a busy machine, so the bound is reckoned from the clock, not fixed.
    events, interval_ms = 100, 20
    stalled_at = []
    began = time.monotonic()

    def stop(res):
        os.kill(args.pid, signal.SIGSTOP)
        written = 1 + int((time.monotonic() - began) * 1000 / interval_ms)
        stalled_at.append(res.body.count(b"data:"))
        stalled_at.append(max(1, written - stalled_at[0]))

    async with stalled(args, "processor continued after a mid-stream stall"):
        res, _ = await broken_stream(args, "processor stopped mid-stream", stop, events=events,
                                     interval_ms=interval_ms, timeout=args.timeout + 20)
        upstream_time = events * interval_ms / 1000
        after = res.body.count(b"data:") - stalled_at[0] if stalled_at else None
        in_transit = stalled_at[1] if stalled_at else 0
        report(
            bool(stalled_at) and after <= in_transit and res.elapsed < upstream_time + args.timeout + 3,
            f"processor stopped mid-stream: {after} events reached the client after the stall (at "
            f"most {in_transit}: those the upstream had written by then); the "
            f"stream broke {res.elapsed:.1f} s after it began (the upstream streams for "
            f"{upstream_time:.0f} s, then Envoy's message timeout of {args.timeout} s)",
            f"stopped after {stalled_at} events, {after} more arrived, broken after {res.elapsed:.1f} s",
        )


async def run_disconnect(args):
    test_id = Ids("disconnect")()
    body = chat(True, test={"kind": "paced", "events": 200, "interval_ms": 20})
    res = await request(args.envoy, "/v1/chat/completions", body, headers={"x-test-id": test_id},
                        on_data=lambda res: res.body.count(b"data:") >= 3)
    outcome = await wait_outcome(args.upstream, test_id, "cancelled")
    report(
        res.status == 200 and script.MARKER not in res.body and outcome == "cancelled",
        "client went away after 3 events: the upstream's stream was cancelled (it stops generating)",
        f"status {res.status}, upstream outcome {outcome!r}, body {show(res.body)}",
    )
    await served_after(args, "after a client disconnect")


async def run_reset(args):
    test_id = Ids("reset")()
    body = chat(True, test={"kind": "reset", "events": 5})
    res = await request(args.envoy, "/v1/chat/completions", body, headers={"x-test-id": test_id})
    entry = await seen(args.upstream, test_id)
    report(
        entry is not None and entry["outcome"] == "reset" and not res.clean_end
        and script.MARKER not in res.body and b"[DONE]" not in res.body
        and script.paced_expected(5).startswith(res.body),
        f"upstream reset after 5 events: the client got {res.body.count(b'data:')} events, never the "
        f"marker, then a broken stream ({res.error}), no clean end (status {res.status})",
        f"status {res.status}, clean end {res.clean_end}, error {res.error}, upstream {entry and entry['outcome']}, body {show(res.body)}",
    )
    await served_after(args, "after an upstream reset")


async def run_encoded(args):
    """An upstream that gzips its event stream although it was asked for identity: the stream
    cannot be filtered, so the client gets a 502 (OpenAI-shaped, code encoded_event_stream) before
    any byte of it, never the stream."""
    for what, names in (("a client that asked for nothing", []),
                        ("a client that opted in to the marker", ["x-bypass-remote-prefill"])):
        test_id = Ids("encoded")()
        res = await request(args.envoy, "/v1/chat/completions", chat(True, names, {"kind": "gzip"}),
                            headers={"x-test-id": test_id, "accept-encoding": "gzip"})
        try:
            error = json.loads(res.body)["error"]
            shaped = (error["code"] == "encoded_event_stream" and error["type"] == "server_error"
                      and "gzip" in error["message"])
        except (ValueError, KeyError, TypeError):
            shaped = False
        entry = await seen(args.upstream, test_id)
        report(
            res.status == 502 and shaped and res.clean_end
            and res.headers.get("content-type") == "application/json"
            and "content-encoding" not in res.headers and entry is not None,
            f"an event stream the upstream gzipped anyway, to {what} (the Dynamo preset always "
            f"removes llm_metrics): 502 encoded_event_stream, no byte of the stream ({show(res.body, 120)})",
            f"status {res.status}, headers {res.headers}, body {show(res.body)}, upstream saw it: "
            f"{entry is not None}",
        )
    await served_after(args, "after an encoded stream")


async def raw_exchange(url, method, path, body=None, headers=None, timeout=15):
    """One request with `connection: close`, and every byte that comes back until Envoy closes
    the connection (or `timeout`): what a client reads, whatever framing it believes in."""
    parts = urlsplit(url)
    data = b"" if body is None else json.dumps(body).encode()
    head = [f"{method} {path} HTTP/1.1", f"host: {parts.netloc}", "connection: close"]
    if body is not None:
        head += ["content-type: application/json", f"content-length: {len(data)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    got = b""
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await writer.drain()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                more = await asyncio.wait_for(reader.read(1 << 16), deadline - time.monotonic())
            except asyncio.TimeoutError:
                break
            if not more:
                break
            got += more
    except ConnectionError:
        pass
    finally:
        writer.close()
    return got


# Issue 48: what Envoy 1.40.0's HTTP/1.1 codec makes of each upstream response, observed, and the
# exact outcome each front door's client gets (the filter never sees a byte of these bodies):
#   - `transfer-encoding: gzip, chunked`: the codec refuses any transfer coding other than
#     chunked (source/common/http/http1/codec_impl.cc, ConnectionImpl::onHeadersCompleteBase:
#     "Envoy should reject transfer-codings it does not understand", a CodecProtocolException
#     "http/1.1 protocol error: unsupported transfer encoding"; with the balsa parser,
#     BalsaFrameEnums::UNKNOWN_TRANSFER_ENCODING), so the router resets the upstream request
#     before headers and answers with its own local reply, `TE_STATUS`, body "upstream connect
#     error or disconnect/reset before headers. reset reason: protocol error"; the filter's 502
#     encoded_event_stream (bypass-marker-envoy-adapter's and the processor's unit tests) is for
#     a host that would pass such a head on;
#   - a 204 or 304, or the answer to HEAD: the codec takes the response as ended at its head
#     (ClientConnectionImpl::cannotHaveBody: a HEAD request, 204, 304), so the filter sees a head
#     that ends the stream (passed, headers kept) and the bytes after it are never a body: the
#     client gets the status, the head's headers and nothing after the blank line. The 304's and
#     HEAD's content-length is kept through the module and the plugin (and through Envoy with no
#     filter); through ext_proc Envoy drops it, as from every response when response_body_mode is
#     STREAMED or FULL_DUPLEX_STREAMED (the processor answers these heads unchanged), and its
#     HTTP/1.1 encoder then marks the answer to HEAD `transfer-encoding: chunked`, still with no
#     body.
TE_STATUS = 502
# An HTTP/2 upstream's 204 or 304 whose HEADERS do not end the stream, then DATA (run_h2): Envoy's
# HTTP/2 codec (oghttp2, quiche's http2/adapter/oghttp2_session.cc, OgHttp2Session::
# OnDataFrameHeader: `if (!iter->second.can_receive_body && length > 0)` it sends RST_STREAM
# PROTOCOL_ERROR) resets the upstream stream at the DATA frame's header, so no filter is ever
# called with its bytes. What the client gets depends on whether the head had gone downstream by
# then, a race observed both ways in Envoy 1.40.0 (the processor's ext_proc, which holds the head
# until the processor answers, loses it most often):
#   - the head first: the status and the head's headers, then the stream reset (an HTTP/2 client:
#     RST_STREAM, never a clean end, with INTERNAL_ERROR, 2, in Envoy 1.39.3 and 1.40.0 and
#     NO_ERROR, 0, in 1.36.4, `H2_RESET_CODES`; an HTTP/1.1 client: the head alone, a 204 and 304
#     having no body);
#   - the reset first: Envoy's own 502, `H2_RESET_BODY`, a clean end.
H2_RESET_BODY = b"upstream connect error or disconnect/reset before headers. reset reason: protocol error"
H2_RESET_CODES = (2, 0)
NO_CONTENT_CASES = [
    # (what, method, test, status)
    ("a 204 event-stream head followed by body bytes", "POST", {"kind": "nocontent", "status": 204}, 204),
    ("a 304 event-stream head (content-length) followed by body bytes", "POST",
     {"kind": "nocontent", "status": 304}, 304),
    ("an event-stream answer to HEAD (content-length) followed by body bytes", "HEAD", None, 200),
]


def leaks(raw):
    """What of the marker a client's bytes hold: the frame, or its name anywhere."""
    found = []
    if script.MARKER in raw:
        found.append("the marker frame")
    if b"x-bypass-remote-prefill" in raw.lower():
        found.append("x-bypass-remote-prefill")
    return found


async def run_nocontent(args):
    """Issue 48 through Envoy: a transfer coding other than chunked, and body bytes after the
    head of a response that has none. See NO_CONTENT_CASES for what Envoy does with each."""
    ids = Ids("nocontent")
    # `transfer-encoding: gzip, chunked`: Envoy's own 502 for the upstream's protocol error.
    for what, names in (("a client that asked for nothing", []),
                        ("a client that opted in to the marker", ["x-bypass-remote-prefill"])):
        test_id = ids()
        raw = await raw_exchange(args.envoy, "POST", "/v1/chat/completions",
                                 chat(True, names, {"kind": "te-gzip"}), {"x-test-id": test_id})
        head, _, body = raw.partition(b"\r\n\r\n")
        status, headers = script.response_head(head + b"\r\n\r\n") if head.startswith(b"HTTP/1.1 ") else (None, {})
        entry = await seen(args.upstream, test_id)
        report(
            status == TE_STATUS and b"protocol error" in body and not leaks(raw) and b"data:" not in body
            and entry is not None,
            f"an event stream with transfer-encoding gzip, chunked, to {what}: Envoy's codec refuses "
            f"it, the client gets Envoy's {status} ({body[:90]!r}), no byte of the stream",
            f"status {status}, headers {headers}, leaks {leaks(raw)}, raw {show(raw)}, upstream saw it: "
            f"{entry is not None}",
        )
    for what, method, test, want in NO_CONTENT_CASES:
        for names in ([], ["x-bypass-remote-prefill"]):
            test_id = ids()
            body = None if method == "HEAD" else chat(True, names, test)
            raw = await raw_exchange(args.envoy, method, "/v1/chat/completions", body, {"x-test-id": test_id})
            head, sep, rest = raw.partition(b"\r\n\r\n")
            status, headers = script.response_head(head + sep) if sep else (None, {})
            entry = await seen(args.upstream, test_id)
            length = str(len(b"".join(script.paced(3))))
            # The head's own headers kept: content-type, etag, and the content-length the 304 and
            # the answer to HEAD carry (a 204 carries none; ext_proc drops it, see above).
            ext_proc = args.front in ("processor", "duplex")
            kept = (headers.get("content-type") == "text/event-stream" and headers.get("etag") == '"sse"'
                    and headers.get("content-length") == (None if want == 204 or ext_proc else length))
            report(
                status == want and kept and rest == b"" and not leaks(raw) and entry is not None,
                f"{what}, to a client that {'opted in' if names else 'asked for nothing'}: the client gets "
                f"{status}, its headers kept (content-length {headers.get('content-length')}), and not a "
                "byte after the head",
                f"status {status}, headers {headers}, after the head {show(rest)}, leaks {leaks(raw)}, "
                f"upstream saw it: {entry is not None}",
            )
    await served_after(args, "after a transfer coding and bodies without content")


async def run_h2(args):
    """Issue 48 with an HTTP/2 upstream: a 204 or 304 whose HEADERS do not end the stream, then a
    DATA frame with the marker frame in it (h2_upstream.py serve). The filter is called with that
    DATA if Envoy passes it on (the head did not end the stream) and must forward none of it;
    Envoy 1.40.0 never passes it on (H2_RESET_BODY says what happens instead)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for status in ("204", "304"):
        for names in ([], ["x-bypass-remote-prefill"]):
            who = "a client that opted in" if names else "a client that asked for nothing"
            body = chat(True, names)
            raw = await raw_exchange(args.envoy, "POST", "/v1/chat/completions", body, {"x-status": status})
            head, sep, rest = raw.partition(b"\r\n\r\n")
            got, _ = script.response_head(head + sep) if sep else (None, {})
            head_first = got == int(status) and rest == b""
            reset_first = got == 502 and rest == H2_RESET_BODY
            report(
                (head_first or reset_first) and not leaks(raw),
                f"HTTP/2 upstream, {status} HEADERS without END_STREAM then DATA with the marker, to {who}, "
                f"over HTTP/1.1: the client gets {got}, "
                + ("the head alone" if head_first else "Envoy's 502 for the upstream's protocol error"),
                f"status {got}, after the head {show(rest)}, leaks {leaks(raw)}, raw {show(raw)}",
            )
            proc = await asyncio.create_subprocess_exec(
                args.h2_python, os.path.join(here, "h2_upstream.py"), "fetch", args.envoy, status,
                json.dumps(body), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            try:
                res = json.loads(out)
            except ValueError:
                res = {"error": f"h2_upstream.py fetch: {proc.returncode} {err.decode(errors='replace')[-300:]}"}
            data = res.get("data", "").encode("latin-1")
            seen_bytes = data + json.dumps(res.get("headers", {})).encode()
            outcome = ("a clean end" if res.get("ended") else f"RST_STREAM {res.get('reset')}"
                       if res.get("reset") is not None else f"error {res.get('error')}")
            head_first = res.get("status") == int(status) and data == b"" and res.get("reset") in H2_RESET_CODES
            reset_first = res.get("status") == 502 and data == H2_RESET_BODY and res.get("ended")
            report(
                (head_first or reset_first) and not leaks(seen_bytes),
                f"HTTP/2 upstream, {status} HEADERS without END_STREAM then DATA with the marker, to {who}, "
                f"over HTTP/2: the client gets {res.get('status')}, "
                + ("no byte of the DATA" if head_first else "Envoy's body" if reset_first else "?")
                + f", then {outcome}",
                f"{res}",
            )


async def run_pieces(args):
    bad = []
    total = 0
    for stream_id in range(args.streams):
        body = chat(True, script.annotations_of(stream_id),
                    {"kind": "script", "id": stream_id, "largest": 9, "pace_ms": 1})
        res = await request(args.envoy, "/v1/chat/completions", body, timeout=120)
        _, expected = script.stream(stream_id)
        total += len(expected)
        if not (res.status == 200 and res.clean_end and res.body == expected):
            bad.append(f"stream {stream_id}: status {res.status}, error {res.error}, "
                       f"{len(res.body)} of {len(expected)} bytes: {show(res.body)}")
    report(
        not bad,
        f"{args.streams} streams written 1 to 9 bytes at a time: each byte for byte what its opt-in "
        f"allows ({total} bytes)",
        "; ".join(bad[:3]),
    )


async def run_panic(args):
    test_id = Ids(f"panic-{args.hook}")()
    body = chat(True, test={"kind": "paced", "events": 5, "interval_ms": 20})
    res = await request(args.envoy, "/v1/chat/completions", body,
                        headers={"x-test-id": test_id, "x-bypass-marker-test-panic": args.hook})
    # Before the response started Envoy answers with an error or closes the connection; after,
    # the stream breaks.
    failed = not res.clean_end or res.status >= 500
    report(
        failed and script.MARKER not in res.body and b"[DONE]" not in res.body,
        f"a panic in {args.hook}: the client gets status {res.status} and "
        f"{'a broken stream' if not res.clean_end else 'an error'} ({res.error}), never the marker "
        "nor a clean end of the stream",
        f"status {res.status}, clean end {res.clean_end}, body {show(res.body)}",
    )
    await served_after(args, f"after a panic in {args.hook}", recovery_bound(args))


async def run_trailers(args):
    """Scripted streams that end with a trailer section (an Envoy with enable_trailers both ways):
    each byte for byte what its opt-in allows, the trailer after it."""
    bad = []
    for stream_id in range(args.streams):
        largest = 9 if stream_id % 2 else 300
        body = chat(True, script.annotations_of(stream_id),
                    {"kind": "script", "id": stream_id, "largest": largest, "trailers": f"t{stream_id}"})
        res = await request(args.envoy, "/v1/chat/completions", body, timeout=60)
        _, expected = script.stream(stream_id)
        if not (res.status == 200 and res.clean_end and res.body == expected
                and res.trailers.get("x-stream-end") == f"t{stream_id}"):
            bad.append(f"stream {stream_id}: status {res.status}, error {res.error}, trailers "
                       f"{res.trailers}, {len(res.body)} of {len(expected)} bytes: {show(res.body)}")
    report(
        not bad,
        f"{args.streams} streams ending in trailers: each byte for byte what its opt-in allows, then "
        "its trailer",
        "; ".join(bad[:3]),
    )
    # Requests that end in trailers: the guard judges the body held until them, the upstream gets
    # it with the router-owned name stripped, then the trailer section as sent.
    ids = Ids("request-trailers")
    cases = [
        ("a body naming a router-owned marker: the marker stripped",
         chat(False, ["x-bypass-remote-prefill", "request_id"]),
         chat(False, ["request_id"])),
        ("a body naming nothing router-owned: as sent", chat(False, ["request_id"]), chat(False, ["request_id"])),
        ("a streamed request naming a router-owned marker: the marker stripped",
         chat(True, ["x-bypass-remote-prefill"], {"kind": "script", "id": 0, "largest": 300}),
         chat(True, [], {"kind": "script", "id": 0, "largest": 300})),
    ]
    for what, body, want in cases:
        test_id = ids()
        trailer = {"x-request-end": test_id}
        res = await request(args.envoy, "/v1/chat/completions", body, headers={"x-test-id": test_id},
                            chunked=True, trailers=trailer, timeout=60)
        entry = await seen(args.upstream, test_id)
        got = entry and entry["body"]
        got_trailers = entry and entry.get("trailers")
        report(
            res.status == 200 and res.clean_end and got == want and got_trailers == trailer,
            f"a chunked request ending in a trailer section: {what}, then its trailer (status {res.status})",
            f"status {res.status}, error {res.error}, body {show(res.body)}, upstream got {got!r} "
            f"and trailers {got_trailers!r}",
        )


async def run_curl(args):
    """Scripted streams through curl over HTTP/1.1 and HTTP/2 (prior knowledge): each byte for byte
    what its opt-in allows."""
    for proto in ("--http1.1", "--http2-prior-knowledge"):
        bad = []
        for stream_id in range(args.streams):
            body = chat(True, script.annotations_of(stream_id), {"kind": "script", "id": stream_id})
            proc = await asyncio.create_subprocess_exec(
                "curl", "-sS", "-N", "--fail", proto, "-H", "content-type: application/json",
                "--data-binary", "@-", f"{args.envoy}/v1/chat/completions",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(json.dumps(body).encode()), 60)
            _, expected = script.stream(stream_id)
            if proc.returncode != 0 or out != expected:
                bad.append(f"stream {stream_id}: curl {proc.returncode} {err.decode(errors='replace').strip()}, "
                           f"{len(out)} of {len(expected)} bytes: {show(out)}")
        report(not bad, f"{args.streams} streams with curl {proto[2:]}: each byte for byte what its opt-in "
               "allows", "; ".join(bad[:3]))


# After a panic traps the proxy-wasm plugin's VM, Envoy (failure_policy FAIL_RELOAD) answers new
# streams with its 503 until the reload backoff has passed (1 s by default), then loads a fresh VM
# for the next one. How soon the first stream after the panic comes depends on the machine, so the
# check asks until it is served, within this bound (seconds); the module and the processor serve
# the very next stream.
RELOAD_BOUND = 10.0


def recovery_bound(args):
    return RELOAD_BOUND if args.front == "wasm" else 0.0


async def run_panic_inflight(args):
    """(the proxy-wasm plugin, test-panic build) A panic traps the VM every stream of the worker
    shares: a stream in flight on it when another panics fails too (Envoy fails each stream of a
    failed VM), never going on unfiltered; the next stream gets a reloaded VM."""
    body = chat(True, test={"kind": "paced", "events": 60, "interval_ms": 50})
    started = asyncio.Event()

    def on_data(res):
        if res.body.count(b"data:") >= 3:
            started.set()
        return False

    inflight = asyncio.ensure_future(request(args.envoy, "/v1/chat/completions", body, on_data=on_data,
                                             timeout=30))
    await asyncio.wait_for(started.wait(), 20)
    panic = await request(args.envoy, "/v1/chat/completions",
                          chat(True, test={"kind": "paced", "events": 5, "interval_ms": 20}),
                          headers={"x-bypass-marker-test-panic": args.hook})
    res = await inflight
    report(
        not res.clean_end and script.MARKER not in res.body and b"[DONE]" not in res.body
        and (not panic.clean_end or (panic.status or 0) >= 500),
        f"a stream in flight when another panics in {args.hook}: it breaks after "
        f"{res.body.count(b'data:')} events ({res.error}), never the marker nor a clean end",
        f"status {res.status}, clean end {res.clean_end}, body {show(res.body)}; the panicking one: "
        f"status {panic.status}, clean end {panic.clean_end}",
    )
    await served_after(args, f"after a panic in {args.hook} with a stream in flight", recovery_bound(args))


async def run_chain(args):
    """A filter before the module buffered the request body (envoy.filters.http.buffer, a Lua
    body()): each body reaches the upstream once, as sent (issue 27, item 1). The Envoy under test
    runs the module with max-body 100."""
    ids = Ids("chain")
    pad = "x" * 20
    cases = [
        ("{\"model\":\"m\"} forwarded intact", b'{"model":"m"}', {"model": "m"}),
        ("a 56-byte body under max-body 100 accepted",
         ('{"model":"m","messages":[],"pad":"%s"}' % pad).encode(),
         {"model": "m", "messages": [], "pad": pad}),
        ("the body `1` reaches the upstream as `1`", b"1", 1),
        ("router-owned names stripped",
         b'{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill","request_id"]}}',
         {"model": "m", "nvext": {"annotations": ["request_id"]}}),
    ]
    assert len(cases[1][1]) == 56
    for chunked in (False, True):
        framing = "chunked" if chunked else "content-length"
        for what, body, want in cases:
            test_id = ids()
            res = await request(args.envoy, "/v1/chat/completions", body,
                                headers={"x-test-id": test_id}, chunked=chunked)
            entry = await seen(args.upstream, test_id)
            got = entry and entry["body"]
            report(
                res.status == 200 and got == want,
                f"{args.label}, {framing}: {what} (status {res.status})",
                f"status {res.status}, body {show(res.body)}, upstream got {got!r}",
            )


async def run_unheld(args):
    """(the proxy-wasm plugin in an Envoy without allow_on_headers_stop_iteration, as Envoy
    Gateway and Istio leave it; request_timeout 3 s) With `--kind forwarded` (the plugin's
    configuration says request-head: forwarded): a body is still judged whole before any byte of
    it goes on, but the head goes first, so a shortened body is padded to the content-length
    sent, a refused request's head reaches the upstream, and an upload in flight holds the
    upstream connection until request_timeout ends it. With `--kind held` (the default, the
    setting missing): the body hooks never come, so nothing reaches the upstream, not even the
    head, and Envoy's request_timeout answers."""
    ids = Ids(f"unheld-{args.kind}")
    raw = json.dumps(chat(False, ["x-bypass-remote-prefill", "request_id"])).encode()
    test_id = ids()
    res = await request(args.envoy, "/v1/chat/completions", raw, headers={"x-test-id": test_id}, timeout=20)
    entry = await seen(args.upstream, test_id)
    head = await request(args.upstream, f"/head?test_id={test_id}")
    if args.kind == "forwarded":
        got = entry and entry.get("raw", "")
        report(
            res.status == 200 and entry is not None and not script.forces(entry["body"])
            and entry.get("content_length") == str(len(raw)) and len(got) == len(raw)
            and got.endswith(" ") and got.rstrip() == got.rstrip(" "),
            f"request-head forwarded: a body naming a router-owned marker reaches the upstream stripped "
            f"and padded with {len(got or '') - len((got or '').rstrip())} spaces to the content-length "
            f"the client sent ({len(raw)})",
            f"status {res.status}, upstream raw {got!r}, content-length {entry and entry.get('content_length')}",
        )
        test_id = ids()
        res = await request(args.envoy, "/v1/chat/completions", b'{"model":', headers={"x-test-id": test_id})
        entry = await seen(args.upstream, test_id)
        head = await request(args.upstream, f"/head?test_id={test_id}")
        report(
            res.status == 400 and entry is None and head.status == 200,
            "request-head forwarded: a refused request gets its 400, and the upstream saw its head "
            "(then a reset), never its body: the cost of a gateway that cannot hold the head",
            f"status {res.status}, upstream body {entry}, head {head.status}",
        )
        # An upload in flight: the head and 10 of 100 bytes, then nothing.
        test_id = ids()
        parts = urlsplit(args.envoy)
        started = time.monotonic()
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
                      f"content-type: application/json\r\ncontent-length: 100\r\n"
                      f"x-test-id: {test_id}\r\n\r\n" + '{"model":"').encode())
        await writer.drain()
        try:
            answer = await asyncio.wait_for(reader.read(1 << 16), 20)
        except asyncio.TimeoutError:
            answer = b""
        waited = time.monotonic() - started
        writer.close()
        held = None
        for _ in range(50):
            head = await request(args.upstream, f"/head?test_id={test_id}")
            held = head.status == 200 and json.loads(head.body).get("held_for")
            if held:
                break
            await asyncio.sleep(0.1)
        report(
            answer.startswith(b"HTTP/1.1 408") and bool(held) and held <= 3 + 1.5 and waited <= 3 + 1.5,
            f"request-head forwarded: an upload that stalls holds the upstream connection {held} s, "
            f"until request_timeout (3 s) answers 408 after {waited:.1f} s",
            f"answer {answer[:60]!r} after {waited:.1f} s, upstream connection held {held}",
        )
    else:
        report(
            # Envoy answers 504 "request timeout" when the whole request had arrived, 408 when not.
            res.status in (408, 504) and entry is None and head.status == 404 and res.elapsed < 3 + 1.5,
            f"request-head held but allow_on_headers_stop_iteration missing: the body hooks never "
            f"come, so Envoy's request_timeout answers {res.status} after {res.elapsed:.1f} s and the "
            "upstream never sees the request, not even its head (fails closed)",
            f"status {res.status}, body {show(res.body)}, after {res.elapsed:.1f} s, upstream body "
            f"{entry is not None}, head {head.status}",
        )
        # A request with no body to judge is not held.
        res = await request(args.envoy, "/v1/models")
        report(res.status == 200, "request-head held, setting missing: GET /v1/models is served",
               f"status {res.status}")


async def head_only(url, length):
    """A connection that sends a request head declaring `length` bytes of JSON body, and no body.
    Returns the writer (close it to end the connection)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
                  f"content-type: application/json\r\ncontent-length: {length}\r\n\r\n").encode())
    await writer.drain()
    return reader, writer


def over_budget(res):
    """The processor's 503 past --max-buffered-bytes: Retry-After, OpenAI-shaped."""
    try:
        error = json.loads(res.body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (res.status == 503 and res.headers.get("retry-after") == "1"
            and error.get("code") == "request_bodies_over_budget"
            and error.get("type") == "server_error")


async def run_budget(args):
    """Issue 34, item 1, with the processor at --max-buffered-bytes 2000000 --max-body 1000000:
    two clients that send only a head declaring 950,000 bytes take nothing of the processor's
    budget, so a complete 950 kB JSON request is served (content-length and chunked, at 1 s and
    at 12 s); 20 such requests at once each get 200 or the processor's 503 with Retry-After,
    never a 500."""
    ids = Ids("budget")
    heads = [await head_only(args.envoy, 950_000) for _ in range(2)]
    try:
        for wait in (1, 11):
            await asyncio.sleep(wait)
            for chunked in (False, True):
                test_id = ids()
                res = await request(args.envoy, "/v1/chat/completions", sized_body(950_000, []),
                                    headers={"x-test-id": test_id}, chunked=chunked)
                entry = await seen(args.upstream, test_id)
                framing = "chunked" if chunked else "content-length"
                report(
                    res.status == 200 and entry is not None,
                    f"two head-only clients declaring 950,000 bytes, after {1 if wait == 1 else 12} s: a "
                    f"950 kB JSON request ({framing}) is served (status {res.status})",
                    f"status {res.status}, body {show(res.body)}, upstream saw it: {entry is not None}",
                )
    finally:
        for _, writer in heads:
            writer.close()
    results = await asyncio.gather(*[
        request(args.envoy, "/v1/chat/completions", sized_body(950_000, []), timeout=60)
        for _ in range(20)
    ])
    served = sum(r.status == 200 for r in results)
    refused = sum(over_budget(r) for r in results)
    statuses = sorted(str(r.status) for r in results)
    report(
        served + refused == 20 and served > 0,
        f"20 concurrent 950 kB requests: {served} served, {refused} got the 503 with Retry-After, "
        "none a 500",
        f"statuses {statuses}; a non-200: "
        f"{next((show(r.body) for r in results if r.status != 200 and not over_budget(r)), None)}",
    )
    await served_after(args, "after the budget's refusals")


async def run_unread(args):
    """Issue 34, item 2: without allow_mode_override Envoy sends the processor bodies the guard
    does not read; a 1.9 MB application/octet-stream upload passes uncharged, with the budget at
    2,000,000 bytes."""
    test_id = Ids("unread")()
    res = await request(args.envoy, "/v1/chat/completions", bytes(1_900_000),
                        headers={"x-test-id": test_id, "content-type": "application/octet-stream"})
    entry = await seen(args.upstream, test_id)
    got = entry and len(entry["body"].get("unparsed", ""))
    report(
        got == 1_900_000 and res.status == 400,
        f"a 1.9 MB application/octet-stream upload without allow_mode_override reaches the upstream "
        f"whole (its 400 for a body that is not JSON, status {res.status}), not a 500",
        f"status {res.status}, body {show(res.body)}, upstream got {got} bytes",
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["checks", "concurrent", "down", "kill", "stall", "disconnect", "reset",
                                         "pieces", "panic", "panic_inflight", "chain", "encoded", "nocontent", "h2", "trailers",
                                         "curl", "budget", "unread", "unheld"])
    # duplex: the processor with FULL_DUPLEX_STREAMED bodies.
    # wasm: the proxy-wasm plugin (tests/envoy/wasm.sh).
    parser.add_argument("--front", choices=["processor", "module", "duplex", "wasm"], default="processor")
    parser.add_argument("--hook", default="response_body")
    parser.add_argument("--kind", choices=["forwarded", "held"], default="forwarded",
                        help="unheld: the plugin's request-head")
    parser.add_argument("--label", default="", help="names the Envoy in chain's check lines")
    parser.add_argument("--envoy", required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--h2-python", help="h2: a python with the h2 package")
    parser.add_argument("--pid", type=int)
    parser.add_argument("--timeout", type=float, default=1.0)
    args = parser.parse_args()
    if args.mode in ("kill", "stall") and not args.pid:
        parser.error(f"{args.mode} needs --pid")
    asyncio.run(globals()[f"run_{args.mode}"](args))
    return checks.exit_status()


if __name__ == "__main__":
    sys.exit(main())

"""The event streams tests/envoy/upstream.py sends and what a client must receive of them through
the processor with the Dynamo preset (`bypass-marker ext-proc --preset dynamo`):

- router-owned x-bypass-remote-prefill and x-prefill-continue: removed unless the client opted
  in, and stripped from requests in every form (so an upstream never sees them);
- opt-in request_id, formatted_prompt, token_ids: removed unless the client opted in;
- never-forwarded llm_metrics, payload_usage: always removed.

And the HTTP/1.1 the suites' own clients and upstreams share: how the upstreams that send these
streams (upstream.py, concurrency.py's) listen, and how a client (client.py, tests/soak/driver.py)
reads a response's head.
"""

import asyncio
import random
import sys

MARKER = b"event: x-bypass-remote-prefill\n: true\n\n"
DONE = b"data: [DONE]\n\n"
NEVER = {"llm_metrics", "payload_usage"}
ROUTER_OWNED = ("x-bypass-remote-prefill", "x-prefill-continue")


def annotations_of(stream_id):
    """How the client of scripted stream `stream_id` asks for annotations."""
    return [
        [],
        ["x-bypass-remote-prefill", "request_id"],
        ["X-Bypass-Remote-Prefill:true", "token_ids"],  # forcing: stripped, no opt-in
        ["llm_metrics", "request_id"],  # never forwarded
    ][stream_id % 4]


def stream(stream_id):
    """(every byte the upstream sends, every byte the client must get) for scripted stream id."""
    asked = annotations_of(stream_id)
    rng = random.Random(stream_id)
    full, expected = [], []

    def frame(name, text):
        text = text.encode()
        full.append(text)
        if name is None or (name not in NEVER and name in asked):
            expected.append(text)

    if stream_id % 2 == 1:
        frame("x-bypass-remote-prefill", MARKER.decode())
    frame("request_id", f'event: request_id\n: "req-{stream_id}"\n\n')
    for i in range(rng.randrange(5, 40)):
        kind = rng.randrange(12)
        if kind == 0:
            frame("llm_metrics", f'event: llm_metrics\n: {{"i":{i}}}\n\n')
        elif kind == 1:
            frame(None, ": keep-alive\n\n")
        elif kind == 2:
            frame("token_ids", f'event: token_ids\n: "[{i}, {stream_id}]"\n\n')
        elif kind == 3:
            frame("x-prefill-continue", "event: x-prefill-continue\n: true\n\n")
        else:
            pad = "x" * rng.randrange(200)
            frame(
                None,
                f'data: {{"id":"chatcmpl-{stream_id}","choices":[{{"index":0,'
                f'"delta":{{"content":"t{i}{pad}"}}}}]}}\n\n',
            )
    frame(None, DONE.decode())
    return b"".join(full), b"".join(expected)


def chunks(stream_id, largest=300):
    """The upstream's chunks of scripted stream id: 1 to `largest` bytes, cutting frames anywhere."""
    full, _ = stream(stream_id)
    rng = random.Random(~stream_id)
    out, at = [], 0
    while at < len(full):
        n = rng.randrange(1, largest + 1)
        out.append(full[at : at + n])
        at += n
    return out


def data_frame(i):
    return (
        f'data: {{"id":"chatcmpl-paced","choices":[{{"index":0,"delta":{{"content":" t{i}"}}}}]}}\n\n'
    ).encode()


def paced(events):
    """The chunks of a paced stream: each a marker frame and a data frame, then [DONE]."""
    return [MARKER + data_frame(i) for i in range(events)] + [DONE]


def paced_expected(events):
    """What a client that did not opt in gets of paced(events): the data frames, then [DONE]."""
    return b"".join(data_frame(i) for i in range(events)) + DONE


def forces(body):
    """Whether a request body as the upstream received it names a router-owned marker in
    nvext.annotations, in any form (any case, with a value)."""
    nvext = body.get("nvext") if isinstance(body, dict) else None
    names = nvext.get("annotations") if isinstance(nvext, dict) else None
    if not isinstance(names, list):
        return False
    return any(
        isinstance(n, str) and n.strip().lower().startswith(ROUTER_OWNED) for n in names
    )


async def serve(handle, lifetime, **options):
    """Serves connections with `handle` (asyncio.start_server's callback; `options` go to
    start_server) on 127.0.0.1, at a port the system picks, until `lifetime` seconds have passed.
    Prints `listening on http://127.0.0.1:PORT` first: the line the suites wait for and take the
    URL from (tests/support/procs.sh's `listening`)."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0, **options)
    print(f"listening on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        try:
            await asyncio.wait_for(server.serve_forever(), lifetime)
        except asyncio.TimeoutError:
            print("--lifetime elapsed: stopping", file=sys.stderr)


def response_head(head):
    """(status, headers) of an HTTP/1.1 response head, its bytes up to and with the blank line:
    the headers' names lower-cased and their values stripped, the last of a repeated name kept."""
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return status, headers

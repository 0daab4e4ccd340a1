#!/usr/bin/env python3
"""A scriptable OpenAI-like upstream for tests/envoy/run.sh: asyncio, HTTP/1.1, 127.0.0.1 only.

  upstream.py [--lifetime SECS]      prints `listening on http://127.0.0.1:PORT`, then serves:

  GET  /v1/models               a fixed JSON model list (content-length)
  POST /v1/chat/completions     by the JSON body's "test" object (see script.py):
         absent or stream false    a fixed JSON completion (content-length)
         {"kind": "script", "id": N, "barrier": K, "largest": L, "pace_ms": MS, "trailers": T}
                                   the event stream script.stream(N) in the chunks
                                   script.chunks(N): every annotation Dynamo sends, markers
                                   included, frames cut anywhere; with "barrier", each stream waits
                                   halfway until K scripted streams have reached that point (at most
                                   60 s), so all K are in flight at once; with "largest", chunks
                                   of 1 to L bytes (default 300); with "pace_ms", MS between
                                   chunks (so that each arrives in a read of its own); with
                                   "trailers", the trailer section `x-stream-end: T` after the
                                   last chunk (an Envoy with enable_trailers passes it on)
         {"kind": "paced", "events": N, "interval_ms": MS}
                                   N data frames each preceded by the marker frame, one every MS,
                                   each its own chunk, then `data: [DONE]`
         {"kind": "gzip"}         the paced stream of 3, gzip-compressed whatever the request's
                                   accept-encoding says
         {"kind": "te-gzip"}      the paced stream of 3 with `transfer-encoding: gzip, chunked`
                                   (gzip-compressed, then chunked; no content-encoding): a
                                   transfer coding other than chunked (issue 48)
         {"kind": "nocontent", "status": 204 | 304}
                                   a 204 or 304 head with `content-type: text/event-stream`
                                   (the 304 with a content-length of the bytes that follow, the
                                   204 without one), then the paced stream of 3 (markers included)
                                   written right after it as if it were the body, then the
                                   connection closed (issue 48)
         {"kind": "reset", "events": N, "after_ms": MS}
                                   N data frames (with markers) 50 ms apart, then after MS
                                   (default 200) a TCP reset (no end chunk)
         {"kind": "hold", "events": N}
                                   N data frames (with markers) 50 ms apart, then nothing (no end
                                   chunk) until the client side closes the connection (at most
                                   120 s): a stream that a client leaves mid-stream
  HEAD (any path)               an event-stream head (`content-type: text/event-stream`, a
                                content-length of the bytes that follow), then the paced stream
                                of 3 (markers included) as if it were the body, then the
                                connection closed (issue 48); recorded under x-test-id
  GET  /counts                  {"requests": POSTs received, "forced": how many of them named a
                                router-owned marker in nvext.annotations, in any form}
  GET  /head?test_id=X          200 if a request head with header `x-test-id: X` arrived, whether
                                or not its body ever did (a head, then a reset), with
                                {"held_for": seconds from the head to the connection's end if the
                                body never came whole, else null}; 404 if none did
  GET  /seen?test_id=X          what the upstream received for the request whose header
                                `x-test-id` was X: {"body": <the JSON body as received>,
                                "outcome": "complete" | "cancelled" | "reset" | "open",
                                "accept_encoding", "content_type": those request headers,
                                "trailers": the request's trailer section, {} if none, "raw":
                                the body's bytes (latin-1), "content_length": the header as
                                received, or null}; 404 if
                                no such request arrived

Requests without `x-test-id` are served but not recorded. The server stops by itself after
--lifetime seconds (default 600).
"""

import argparse
import asyncio
import json
import socket
import struct
import zlib
from collections import OrderedDict
from urllib.parse import parse_qs, urlsplit

import script

MODELS = json.dumps(
    {
        "object": "list",
        "data": [{"id": "tiny", "object": "model", "created": 1764500000, "owned_by": "e2e"}],
    }
).encode()
COMPLETION = json.dumps(
    {
        "id": "chatcmpl-json",
        "object": "chat.completion",
        "created": 1764500000,
        "model": "tiny",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()

seen = OrderedDict()  # test id -> {"body": ..., "outcome": ...}, the newest 10,000
heads = OrderedDict()  # test id -> True for every request head that arrived, the newest 10,000
counts = {"requests": 0, "forced": 0}  # POSTs received; how many named a router-owned marker
barriers = {}  # K -> [count, asyncio.Event]


def record(test_id, body):
    counts["requests"] += 1
    counts["forced"] += script.forces(body)
    if test_id is None:
        return None
    entry = {"body": body, "outcome": "open"}
    seen[test_id] = entry
    while len(seen) > 10_000:
        seen.popitem(last=False)
    return entry


async def read_request(reader):
    """(method, target, headers, body, trailers) or None at the end of the connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    arrived = asyncio.get_running_loop().time()
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    head = None
    if "x-test-id" in headers:
        head = heads[headers["x-test-id"]] = {"held_for": None}
        while len(heads) > 10_000:
            heads.popitem(last=False)
    try:
        return await read_body(reader, method, target, headers)
    except (asyncio.IncompleteReadError, ConnectionError):
        if head is not None:  # the body never came whole: how long the connection was held
            head["held_for"] = round(asyncio.get_running_loop().time() - arrived, 3)
        raise


async def read_body(reader, method, target, headers):
    """The rest of read_request: the body and trailers of a request whose head is read."""
    body = b""
    trailers = {}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
                    name, _, value = line.decode("latin-1").partition(":")
                    trailers[name.strip().lower()] = value.strip()
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        body = b"".join(parts)
    elif "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    return method, target, headers, body, trailers


def simple(status, content_type, body):
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[status]
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def send_stream(
    writer,
    chunks,
    entry,
    pace=None,
    reset=False,
    gzip=False,
    reset_after=0.2,
    hold=None,
    reader=None,
    trailers=None,
):
    """Writes an event stream in chunked encoding, one HTTP chunk per element of `chunks`;
    `gzip`: compressed (`content-encoding: gzip`), as a server does for a client that accepts it;
    `reset`: a TCP reset `reset_after` seconds after the last chunk instead of the end; `hold`:
    an asyncio.Event in `chunks` stops the stream there, without an end, until `reader` reaches
    the end of the connection (at most `hold` seconds)."""
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        + (b"content-encoding: gzip\r\n" if gzip else b"")
        + b"transfer-encoding: chunked\r\n\r\n"
    )
    if gzip:
        packer = zlib.compressobj(wbits=31)
        chunks = [c if isinstance(c, asyncio.Event) else packer.compress(c) + packer.flush(zlib.Z_SYNC_FLUSH)
                  for c in chunks] + [packer.flush()]
    try:
        for i, chunk in enumerate(chunks):
            if isinstance(chunk, asyncio.Event) and hold:  # wait for the client to go away
                try:
                    await asyncio.wait_for(reader.read(), hold)
                except (asyncio.TimeoutError, ConnectionError):
                    pass
                if entry:
                    entry["outcome"] = "cancelled"
                return False
            if isinstance(chunk, asyncio.Event):  # a barrier
                await asyncio.wait_for(chunk.wait(), 60)
                continue
            if pace and i:
                await asyncio.sleep(pace)
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        if reset:
            await asyncio.sleep(reset_after)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            if entry:
                entry["outcome"] = "reset"
            return False
        end = b"" if trailers is None else b"x-stream-end: %s\r\n" % trailers.encode()
        writer.write(b"0\r\n" + end + b"\r\n")
        await writer.drain()
    except (ConnectionError, asyncio.TimeoutError):
        if entry:
            entry["outcome"] = "cancelled"
        return False
    if entry:
        entry["outcome"] = "complete"
    return True


async def send_te_gzip(writer, entry):
    """The paced stream of 3 with `transfer-encoding: gzip, chunked`: gzip-compressed as a
    transfer coding (no content-encoding), then chunked."""
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: gzip, chunked\r\n\r\n"
    )
    packer = zlib.compressobj(wbits=31)
    chunks = [packer.compress(c) + packer.flush(zlib.Z_SYNC_FLUSH) for c in script.paced(3)]
    chunks.append(packer.flush())
    try:
        for chunk in chunks:
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    except ConnectionError:
        if entry:
            entry["outcome"] = "cancelled"
        return
    if entry:
        entry["outcome"] = "complete"


async def send_without_content(writer, entry, status, length):
    """An event-stream head of a response that has no content (a 204, a 304, the answer to a
    HEAD), then the bytes of the paced stream of 3, markers included, as if they were its body;
    `length`: a content-length of as many bytes in the head. The connection is closed after."""
    body = b"".join(script.paced(3))
    reason = {200: "OK", 204: "No Content", 304: "Not Modified"}[status]
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/event-stream\r\n"
        f"cache-control: no-cache\r\netag: \"sse\"\r\n".encode()
        + (b"content-length: %d\r\n" % len(body) if length else b"")
        + b"\r\n" + body
    )
    try:
        await writer.drain()
    except ConnectionError:
        pass
    if entry:
        entry["outcome"] = "complete"


def barrier_for(k):
    """The barrier event of a group of k streams, counting this stream in."""
    state = barriers.setdefault(k, [0, asyncio.Event()])
    state[0] += 1
    if state[0] >= k:
        state[1].set()
        del barriers[k]
    return state[1]


async def handle(reader, writer):
    try:
        while True:
            try:
                request = await read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            method, target, headers, body, trailers = request
            url = urlsplit(target)
            test_id = headers.get("x-test-id")
            if method == "GET" and url.path == "/v1/models":
                writer.write(simple(200, "application/json", MODELS))
            elif method == "HEAD":
                # Recorded, not counted (`requests` counts POSTs).
                entry = None
                if test_id is not None:
                    entry = seen[test_id] = {"body": {"head": url.path}, "outcome": "open"}
                await send_without_content(writer, entry, 200, length=True)
                return
            elif method == "GET" and url.path == "/counts":
                writer.write(simple(200, "application/json", json.dumps(counts).encode()))
            elif method == "GET" and url.path == "/head":
                key = parse_qs(url.query).get("test_id", [""])[0]
                found = heads.get(key)
                writer.write(simple(200 if found else 404, "application/json", json.dumps(found or {}).encode()))
            elif method == "GET" and url.path == "/seen":
                key = parse_qs(url.query).get("test_id", [""])[0]
                if key in seen:
                    writer.write(simple(200, "application/json", json.dumps(seen[key]).encode()))
                else:
                    writer.write(simple(404, "application/json", b"{}"))
            elif method == "POST" and url.path == "/v1/chat/completions":
                try:
                    request_json = json.loads(body)
                except ValueError:
                    record(test_id, {"unparsed": body.decode("latin-1")})
                    writer.write(simple(400, "application/json", b'{"error":"not json"}'))
                    await writer.drain()
                    continue
                entry = record(test_id, request_json)
                if entry is not None:
                    entry["accept_encoding"] = headers.get("accept-encoding")
                    entry["content_type"] = headers.get("content-type")
                    entry["trailers"] = trailers
                    entry["raw"] = body.decode("latin-1")
                    entry["content_length"] = headers.get("content-length")
                if not isinstance(request_json, dict):  # JSON, not a chat request (`1`)
                    writer.write(simple(200, "application/json", COMPLETION))
                    if entry:
                        entry["outcome"] = "complete"
                    await writer.drain()
                    continue
                # Compresses for a client that accepts gzip, as web servers do; `gzip` compresses
                # whatever the client accepts (an upstream that ignores accept-encoding).
                test = request_json.get("test") or {}
                gzip = "gzip" in headers.get("accept-encoding", "") or test.get("kind") == "gzip"
                if not request_json.get("stream"):
                    writer.write(simple(200, "application/json", COMPLETION))
                    if entry:
                        entry["outcome"] = "complete"
                elif test.get("kind") == "script":
                    chunks = script.chunks(test["id"], test.get("largest", 300))
                    if test.get("barrier"):
                        chunks.insert(len(chunks) // 2, barrier_for(test["barrier"]))
                    pace = test.get("pace_ms", 0) / 1000
                    if not await send_stream(writer, chunks, entry, pace=pace, trailers=test.get("trailers")):
                        return
                elif test.get("kind") == "paced":
                    frames = script.paced(test["events"])
                    if not await send_stream(writer, frames, entry, pace=test["interval_ms"] / 1000):
                        return
                elif test.get("kind") == "gzip":
                    if not await send_stream(writer, script.paced(3), entry, gzip=True):
                        return
                elif test.get("kind") == "te-gzip":
                    await send_te_gzip(writer, entry)
                    return
                elif test.get("kind") == "nocontent":
                    status = test.get("status", 204)
                    await send_without_content(writer, entry, status, length=status == 304)
                    return
                elif test.get("kind") == "reset":
                    # Paced, and a pause before the reset, so that everything sent before it has
                    # been read (a reset discards what the peer has not read yet).
                    chunks = script.paced(test["events"])[:-1]
                    after = test.get("after_ms", 200) / 1000
                    await send_stream(writer, chunks, entry, pace=0.05, reset=True, reset_after=after)
                    return
                elif test.get("kind") == "hold":
                    # The frames, then no end: wait for the other side to go away.
                    hold = [*script.paced(test["events"])[:-1], asyncio.Event()]
                    if not await send_stream(writer, hold, entry, pace=0.05, hold=120, reader=reader):
                        return
                else:
                    if not await send_stream(writer, script.paced(3), entry, gzip=gzip):
                        return
            else:
                writer.write(simple(404, "application/json", b'{"error":"no such route"}'))
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lifetime", type=float, default=600)
    args = parser.parse_args()
    await script.serve(handle, args.lifetime, backlog=4096, limit=1 << 26)


if __name__ == "__main__":
    asyncio.run(main())

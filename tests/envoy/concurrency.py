#!/usr/bin/env python3
"""Many long-lived event streams at once through Envoy (tests/envoy/concurrency.sh): asyncio,
HTTP/1.1, 127.0.0.1 only.

  concurrency.py upstream --streams N --events E --interval-ms MS [--lifetime SECS]
      prints `listening on http://127.0.0.1:PORT`, then answers every POST with an event stream:
      Dynamo's marker frame (`event: x-bypass-remote-prefill`), then, once N requests have
      arrived (all streams in flight together; at most --barrier-timeout seconds), E data events
      MS apart, each its own chunk, then `data: [DONE]`. GET /count: how many requests arrived.
  concurrency.py client --envoy URL --streams N --events E
      N requests at once, each on its own connection: every stream must end cleanly with E data
      events and [DONE], byte for byte, and never the marker.

The client prints `PASS <what>` or `FAIL <what>: <why>` and exits 1 if anything failed.
"""

import argparse
import asyncio
import json
import sys
import time

import client as http

MARKER = b"event: x-bypass-remote-prefill\n: true\n\n"
DONE = b"data: [DONE]\n\n"


def event(i):
    return b'data: {"id":"chatcmpl-c","choices":[{"index":0,"delta":{"content":" t%d"}}]}\n\n' % i


def expected(events):
    return b"".join(event(i) for i in range(events)) + DONE


def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve(args):
    arrived = {"n": 0}
    all_in = asyncio.Event()
    chunks = [chunk(event(i)) for i in range(args.events)]

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                if length:
                    await reader.readexactly(length)
                if method == "GET" and path == "/count":
                    body = json.dumps({"requests": arrived["n"]}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
                    await writer.drain()
                    continue
                arrived["n"] += 1
                if arrived["n"] >= args.streams:
                    all_in.set()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n" + chunk(MARKER))
                await writer.drain()
                try:
                    await asyncio.wait_for(all_in.wait(), args.barrier_timeout)
                except asyncio.TimeoutError:
                    pass  # the client's checks say which streams did not arrive
                for i, data in enumerate(chunks):
                    if i:
                        await asyncio.sleep(args.interval_ms / 1000)
                    writer.write(data)
                    await writer.drain()
                writer.write(chunk(DONE) + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=args.streams + 128)
    print(f"listening on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        try:
            await asyncio.wait_for(server.serve_forever(), args.lifetime)
        except asyncio.TimeoutError:
            print("--lifetime elapsed: stopping", file=sys.stderr)


def report(ok, what, why=""):
    print(f"PASS {what}" if ok else f"FAIL {what}: {why}", flush=True)
    return ok


async def run_client(args):
    want = expected(args.events)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    started = time.monotonic()
    results = await asyncio.gather(*(
        http.request(args.envoy, "/v1/chat/completions", body, timeout=args.timeout)
        for _ in range(args.streams)))
    elapsed = time.monotonic() - started
    bad = {}
    for res in results:
        if res.status == 200 and res.clean_end and res.body == want:
            continue
        why = (f"status {res.status}" if res.status != 200 else
               f"error {res.error}" if not res.clean_end else
               "the marker" if MARKER in res.body else f"{len(res.body)} of {len(want)} bytes")
        bad[why] = bad.get(why, 0) + 1
    ok = report(
        not bad,
        f"{args.streams} concurrent streams of {args.events} events through Envoy, every one intact "
        f"and without the marker ({args.streams - sum(bad.values())} of {args.streams}, "
        f"{len(want) * args.streams} bytes in {elapsed:.1f} s)",
        f"{sum(bad.values())} of {args.streams} wrong: " + "; ".join(f"{n} with {why}" for why, n in bad.items()),
    )
    return 0 if ok else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["upstream", "client"])
    parser.add_argument("--streams", type=int, default=5000)
    parser.add_argument("--events", type=int, default=100)
    parser.add_argument("--interval-ms", type=float, default=20)
    parser.add_argument("--barrier-timeout", type=float, default=120)
    parser.add_argument("--lifetime", type=float, default=900)
    parser.add_argument("--envoy")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.mode == "upstream":
        asyncio.run(serve(args))
        return 0
    if not args.envoy:
        parser.error("client needs --envoy")
    return asyncio.run(run_client(args))


if __name__ == "__main__":
    sys.exit(main())

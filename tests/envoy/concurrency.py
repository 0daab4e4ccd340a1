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

  concurrency.py answer-times --access-log FILE --metrics URL
      with the external processor in front (CONCURRENCY_FRONT=ext-proc): prints the answer times
      Envoy saw (its access log's ext_proc filter-state fields: each stream's request and response
      headers messages, and the slowest of its response body messages) and the processor's own
      histogram (bypass_marker_ext_proc_answer_seconds, from its /metrics), as p50, p99, p99.9.

The client prints `PASS <what>` or `FAIL <what>: <why>` and exits 1 if anything failed.
"""

import argparse
import asyncio
import json
import sys
import time

import client as http
import script

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

    await script.serve(handle, args.lifetime, backlog=args.streams + 128)


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
    ok = http.report(
        not bad,
        f"{args.streams} concurrent streams of {args.events} events through Envoy, every one intact "
        f"and without the marker ({args.streams - sum(bad.values())} of {args.streams}, "
        f"{len(want) * args.streams} bytes in {elapsed:.1f} s)",
        f"{sum(bad.values())} of {args.streams} wrong: " + "; ".join(f"{n} with {why}" for why, n in bad.items()),
    )
    return 0 if ok else 1


def percentiles(values):
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]
    return pick(0.5), pick(0.99), pick(0.999), values[-1]


def bucket_percentiles(buckets):
    """p50, p99, p99.9 of a Prometheus histogram as the upper bound of the bucket each falls in."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    out = []
    for q in (0.5, 0.99, 0.999):
        out.append(next(le for le, n in buckets if n >= q * total))
    return out, total


def answer_times(args):
    import urllib.request

    fields = {"request_header_latency_us": "request headers",
              "response_header_latency_us": "response headers",
              "response_body_max_latency_us": "slowest response body message of a stream"}
    seen = {field: [] for field in fields}
    with open(args.access_log) as log:
        for line in log:
            entry = json.loads(line)
            for field in fields:
                value = entry.get(field)
                if value not in (None, "", "-"):
                    seen[field].append(int(value) / 1000)
    for field, what in fields.items():
        if seen[field]:
            p50, p99, p999, top = percentiles(seen[field])
            print(f"envoy saw, {what}: n={len(seen[field])} p50 {p50:.2f} ms, p99 {p99:.2f} ms, "
                  f"p99.9 {p999:.2f} ms, max {top:.2f} ms")
    text = urllib.request.urlopen(args.metrics, timeout=10).read().decode()
    series = {}
    for line in text.splitlines():
        if line.startswith("bypass_marker_ext_proc_answer_seconds_bucket{"):
            labels, value = line.split("{", 1)[1].rsplit("} ", 1)
            pairs = dict(p.split("=", 1) for p in labels.split(","))
            le = pairs["le"].strip('"')
            series.setdefault(pairs["message"].strip('"'), []).append(
                (float("inf") if le == "+Inf" else float(le), float(value)))
    for message, buckets in sorted(series.items()):
        (p50, p99, p999), total = bucket_percentiles(buckets)
        if total:
            ms = lambda s: "> 5 s" if s == float("inf") else f"<= {s * 1000:g} ms"
            print(f"processor's histogram, {message}: n={int(total)} p50 {ms(p50)}, p99 {ms(p99)}, "
                  f"p99.9 {ms(p999)}")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["upstream", "client", "answer-times"])
    parser.add_argument("--access-log")
    parser.add_argument("--metrics")
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
    if args.mode == "answer-times":
        return answer_times(args)
    if not args.envoy:
        parser.error("client needs --envoy")
    return asyncio.run(run_client(args))


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The soak's traffic and its checks (tests/soak/run.sh starts the servers and runs this).

Drives every front door at once with mixed traffic, for --secs seconds after a warm-up:

  script     a stream of every annotation Dynamo sends, frames cut anywhere, paced; the client
             asks for nothing, opts in, tries to force a router-owned marker, or asks for a
             never-forwarded name (tests/envoy/script.py, by the stream's id); one in ten with a
             60 KiB request body the guard reads whole
  paced      markers and data frames, one chunk each, 5 to 20 ms apart
  client-reset  the upstream sends N frames and then nothing; the client reads the N frames and
             resets the connection (RST)
  upstream-reset  the upstream sends N frames, then resets its connection
  slow-reader  2,000 marker and data frames back to back, one chunk each (170 kB once
             filtered), read by a client with a 4 KiB receive buffer, 8 KiB every 5 ms
  oversized  a JSON request body past max-body: 413
  malformed  a request body that is no JSON, cut short, or not UTF-8: 400
  gzip       an upstream that gzips its event stream whatever it was asked: 502

Every response is checked byte for byte: a complete stream against the filtered output it must
be; a cut stream (the upstream's reset) against the frames sent before the reset, and it must not
end cleanly; a refusal against the first refusal of the same kind through the same door (the
calibration), which itself must have the expected status and an OpenAI-shaped error.

Then, with the traffic stopped: every process's RSS and open file descriptors against the quiet
state after the warm-up, the streams-in-flight and held-bytes gauges at 0, and every counter's
increase equal to what the driver sent (see --help of run.sh and BENCHMARKS.md "The soak").

Prints PASS and FAIL lines (tests/support/checks.sh counts them), a table of RSS at start, peak
and end per process, and writes the figures as JSON to --summary.
"""

import argparse
import asyncio
import collections
import functools
import json
import os
import random
import re
import socket
import struct
import sys
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "envoy"))
import script  # noqa: E402  (tests/envoy/script.py: the streams and what a client must get)

# The Dynamo preset's names (what each front door counts frames under).
PRESET = (
    "x-bypass-remote-prefill",
    "x-prefill-continue",
    "request_id",
    "formatted_prompt",
    "token_ids",
    "llm_metrics",
    "payload_usage",
)
# The driver's max-body for every front door (run.sh passes the same): oversized bodies are
# past it, large accepted ones under it.
MAX_BODY = 65536
TIMEOUT = 60  # seconds any one exchange may take
SLOW_EVENTS = 2000  # the slow reader's stream: 2,000 marker and data frames, 250 kB sent
CASES = {
    "script": 40,
    "paced": 12,
    "client-reset": 10,
    "upstream-reset": 8,
    "slow-reader": 4,
    "oversized": 5,
    "malformed": 8,
    "gzip": 5,
}
MALFORMED = {
    "cut": b'{"model":"tiny","stream":true,"messages":[{"role":"user","content":"so',
    "not-utf8": b'{"model":"tiny","stream":true,"messages":[{"role":"user","content":"\xff\xfe"}]}',
    "trailing": b'{"model":"tiny","stream":true,"messages":[]} {"again":1}',
    "not-json": b"model=tiny&stream=true",
}


@functools.cache
def slow_expected():
    return script.paced_expected(SLOW_EVENTS)


class Failure(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# What a stream must give, and the counts it adds


def frames(data):
    """The frames of a scripted stream (each ends in a blank line; none holds one)."""
    out = []
    for part in data.split(b"\n\n")[:-1]:
        out.append(part + b"\n\n")
    return out


def event_name(frame):
    first = frame.split(b"\n", 1)[0]
    if first.startswith(b"event: "):
        return first[len(b"event: ") :].decode()
    return None


def tally_stream(tally, full, expected):
    """Adds the frames a front door removes and forwards from `full` to give `expected`."""
    kept = frames(expected)
    at = 0
    for frame in frames(full):
        name = event_name(frame)
        if at < len(kept) and kept[at] == frame:
            at += 1
            if name in PRESET:
                tally["forwarded", name] += 1
        elif name is not None:
            tally["removed", name] += 1
    if at != len(kept):
        raise AssertionError("the expected stream is not a subsequence of the stream sent")


def chat(annotations=None, test=None, pad=0):
    body = {
        "model": "tiny",
        "stream": True,
        "messages": [{"role": "user", "content": "soak " + "x" * pad}],
    }
    if annotations is not None:
        body["nvext"] = {"annotations": annotations}
    if test is not None:
        body["test"] = test
    return json.dumps(body).encode()


# ---------------------------------------------------------------------------------------------
# A raw HTTP/1.1 client


class Reply:
    def __init__(self):
        self.status = None
        self.head = b""
        self.headers = {}
        self.body = bytearray()
        self.complete = False  # the body ended as its framing says (last chunk, full length)
        self.error = None


async def connect(host, port, rcvbuf=None, limit=1 << 16):
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=limit)


def reset(writer):
    """Closes with an RST (SO_LINGER 0), as a client that goes away does."""
    sock = writer.get_extra_info("socket")
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


async def post(door, body, *, rcvbuf=None, pause=0.0, stop_at=None, content_type="application/json"):
    """POSTs `body` to the door's /v1/chat/completions; reads the reply (slowly with `pause` per
    4 KiB); with `stop_at`, resets the connection once that many body bytes are in."""
    reply = Reply()
    reader, writer = await connect(door.host, door.port, rcvbuf, limit=4096 if rcvbuf else 1 << 16)
    try:
        writer.write(
            (
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: {content_type}\r\n"
                f"content-length: {len(body)}\r\n\r\n"
            ).encode()
            + body
        )
        # Not drained: a refusal may come (and the door close) before the body is all written.
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as err:
            reply.error = f"no response head ({len(err.partial)} bytes)"
            return reply
        reply.head = head
        reply.status, reply.headers = script.response_head(head)
        read = 0

        async def take(n):
            nonlocal read
            if not pause:
                return await reader.readexactly(n)
            # A slow reader: a pause after every 8 KiB.
            parts = []
            while n:
                part = await reader.readexactly(min(n, 8192))
                parts.append(part)
                n -= len(part)
                before, read = read, read + len(part)
                if before // 8192 != read // 8192:
                    await asyncio.sleep(pause)
            return b"".join(parts)

        try:
            if reply.headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";")[0], 16)
                    if size == 0:
                        await reader.readuntil(b"\r\n")
                        reply.complete = True
                        break
                    reply.body += await take(size)
                    await reader.readexactly(2)
                    if stop_at is not None and len(reply.body) >= stop_at:
                        return reply
            elif "content-length" in reply.headers:
                reply.body += await take(int(reply.headers["content-length"]))
                reply.complete = True
            else:
                reply.body += await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError) as err:
            if isinstance(err, asyncio.IncompleteReadError):
                reply.body += err.partial
            reply.error = type(err).__name__
        return reply
    finally:
        if stop_at is not None:
            reset(writer)
        else:
            writer.close()


# ---------------------------------------------------------------------------------------------
# The cases


class Door:
    def __init__(self, name, url):
        self.name = name
        host, port = url.split("//", 1)[1].rstrip("/").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.tally = collections.Counter()
        self.references = {}  # refusal kind -> (status, body), from the calibration
        self.cases = collections.Counter()
        self.failures = collections.Counter()
        self.shown = 0


def mismatch(what, got, want):
    """A short description of where `got` departs from `want`."""
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (
        f"{what}: {len(got)} bytes, expected {len(want)}; first difference at {at}: "
        f"got {bytes(got[max(0, at - 40):at + 40])!r}, expected {bytes(want[max(0, at - 40):at + 40])!r}"
    )


def expect_stream(reply, want):
    if reply.status != 200:
        raise Failure(f"status {reply.status} ({reply.error}), expected 200: {bytes(reply.body[:300])!r}")
    if not reply.complete:
        raise Failure(f"cut after {len(reply.body)} bytes ({reply.error}): " + mismatch("body", reply.body, want))
    if reply.body != want:
        raise Failure(mismatch("body", reply.body, want))


async def refusal(door, kind, status, body, marker, content_type="application/json"):
    reply = await post(door, body, content_type=content_type)
    got = (reply.status, bytes(reply.body))
    if kind not in door.references:
        # The calibration: the first refusal of each kind must be this status, whole, an
        # OpenAI-shaped error naming `marker`; every later one the same bytes.
        if reply.status != status or not reply.complete:
            raise Failure(f"{kind}: status {reply.status} ({reply.error}), expected {status}: {got[1][:300]!r}")
        try:
            error = json.loads(got[1])["error"]
        except (ValueError, KeyError, TypeError):
            raise Failure(f"{kind}: not an OpenAI-shaped error: {got[1][:300]!r}") from None
        if marker not in json.dumps(error):
            raise Failure(f"{kind}: the error does not name {marker!r}: {got[1][:300]!r}")
        door.references[kind] = got
    want = door.references[kind]
    if got != want:
        if reply.status != want[0]:
            raise Failure(f"{kind}: status {reply.status} ({reply.error}), expected {want[0]}: {got[1][:300]!r}")
        raise Failure(f"{kind}: " + mismatch("refusal body", got[1], want[1]))
    door.tally["refused", str(status)] += 1


async def run_case(door, case, rng):
    tally = door.tally
    tally["requests"] += 1
    if case == "script":
        stream_id = rng.randrange(1_000_000)
        largest = rng.choice((9, 300, 300, 4096))
        full, want = script.stream(stream_id)
        pad = 60_000 if rng.random() < 0.1 else 0
        test = {"kind": "script", "id": stream_id, "largest": largest, "pace_ms": rng.choice((0, 1, 3))}
        reply = await post(door, chat(script.annotations_of(stream_id), test, pad))
        expect_stream(reply, want)
        tally_stream(tally, full, want)
    elif case == "paced":
        events = rng.randrange(1, 30)
        opted = rng.random() < 0.5
        test = {"kind": "paced", "events": events, "interval_ms": rng.choice((5, 10, 20))}
        reply = await post(door, chat(["x-bypass-remote-prefill"] if opted else [], test))
        chunks = script.paced(events)
        want = b"".join(chunks) if opted else script.paced_expected(events)
        expect_stream(reply, want)
        tally["forwarded" if opted else "removed", "x-bypass-remote-prefill"] += events
    elif case == "client-reset":
        events = rng.randrange(1, 12)
        want = script.paced_expected(events)[: -len(script.DONE)]
        test = {"kind": "hold", "events": events}
        reply = await post(door, chat([], test), stop_at=len(want))
        if reply.status != 200 or bytes(reply.body) != want:
            raise Failure(
                f"status {reply.status} ({reply.error}); " + mismatch("body before the reset", reply.body, want)
            )
        tally["removed", "x-bypass-remote-prefill"] += events
    elif case == "upstream-reset":
        events = rng.randrange(1, 12)
        want = script.paced_expected(events)[: -len(script.DONE)]
        # 2 s between the last frame and the reset: the frames are through the door before it.
        test = {"kind": "reset", "events": events, "after_ms": 2000}
        reply = await post(door, chat([], test))
        if reply.status != 200:
            raise Failure(f"status {reply.status} ({reply.error}), expected 200")
        if reply.complete:
            raise Failure("a stream the upstream reset ended cleanly")
        if bytes(reply.body) != want:
            raise Failure(mismatch("body before the reset", reply.body, want))
        tally["removed", "x-bypass-remote-prefill"] += events
        tally["upstream-reset"] += 1
    elif case == "slow-reader":
        events = SLOW_EVENTS
        test = {"kind": "paced", "events": events, "interval_ms": 0}
        reply = await post(door, chat([], test), rcvbuf=4096, pause=0.005)
        expect_stream(reply, slow_expected())
        tally["removed", "x-bypass-remote-prefill"] += events
    elif case == "oversized":
        await refusal(door, "oversized", 413, chat([], {"kind": "script", "id": 1}, MAX_BODY + 100), "")
    elif case == "malformed":
        kind = rng.choice(sorted(MALFORMED))
        await refusal(door, f"malformed-{kind}", 400, MALFORMED[kind], "")
    elif case == "gzip":
        await refusal(door, "gzip", 502, chat([], {"kind": "gzip"}), "encoded_event_stream")
        tally["encoded"] += 1
    else:
        raise AssertionError(case)


async def worker(door, rng, until, think):
    names = sorted(CASES)
    weights = [CASES[n] for n in names]
    while time.monotonic() < until:
        case = rng.choices(names, weights)[0]
        door.cases[case] += 1
        try:
            await asyncio.wait_for(run_case(door, case, rng), TIMEOUT)
        except (Failure, OSError, asyncio.TimeoutError, ValueError) as err:
            door.failures[case] += 1
            if door.shown < 10:
                door.shown += 1
                print(f"FAIL {door.name}: {case}: {type(err).__name__}: {err}", flush=True)
        await asyncio.sleep(rng.uniform(0, think))


async def traffic(doors, secs, concurrency, think, seed, label):
    until = time.monotonic() + secs
    tasks = []
    for d, door in enumerate(doors):
        for w in range(concurrency):
            rng = random.Random(f"{seed}/{label}/{d}/{w}")
            tasks.append(worker(door, rng, until, think))
    await asyncio.gather(*tasks)


# ---------------------------------------------------------------------------------------------
# What the processes say about themselves


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


SERIES = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text):
    """{(name, ((label, value), ...)): value} of a Prometheus or OpenMetrics text."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SERIES.match(line)
        if m:
            labels = tuple(sorted(LABEL.findall(m.group(2) or "")))
            out[m.group(1), labels] = float(m.group(3))
    return out


def value(series, name, **labels):
    want = set(labels.items())
    found = [v for (n, ls), v in series.items() if n == name and want <= set(ls)]
    return sum(found) if found else None


class Sources:
    """Where each door's counters and gauges are read."""

    def __init__(self, args):
        self.sidecar_metrics = args.sidecar_metrics
        self.processor_metrics = args.processor_metrics
        self.ext_proc_admin = args.ext_proc_admin
        self.module_admin = args.module_admin

    def counters(self, door):
        """The door's counters, in the keys of a Door's tally."""
        out = collections.Counter()
        if door == "sidecar":
            s = parse_prometheus(get(self.sidecar_metrics))
            prefix, total = "bypass_marker_", "_total"
        elif door == "ext-proc":
            s = parse_prometheus(get(self.processor_metrics))
            prefix, total = "bypass_marker_", "_total"
        else:
            s = parse_prometheus(get(self.module_admin + "/stats/prometheus"))
            prefix, total = "envoy_dynamicmodulescustom_bypass_marker_", ""
        for name in PRESET:
            out["removed", name] = value(s, f"{prefix}frames_removed{total}", annotation=name) or 0
            out["forwarded", name] = value(s, f"{prefix}frames_forwarded{total}", annotation=name) or 0
        out["encoded"] = value(s, f"{prefix}encoded_streams_refused{total}") or 0
        if door == "sidecar":
            for status in ("400", "413"):
                out["refused", status] = value(s, "bypass_marker_requests_refused_total", status=status) or 0
            out["upstream-reset"] = value(s, "bypass_marker_upstream_errors_total", kind="body") or 0
        if door == "module":
            for status in ("400", "413"):
                out["refused", status] = value(s, f"{prefix}requests_refused", status=status) or 0
        if door in ("ext-proc", "module"):
            admin = self.ext_proc_admin if door == "ext-proc" else self.module_admin
            e = parse_prometheus(get(admin + "/stats/prometheus"))
            http = {"envoy_http_conn_manager_prefix": "openai"}
            out["requests"] = value(e, "envoy_http_downstream_rq_total", **http) or 0
            out["envoy-4xx"] = value(e, "envoy_http_downstream_rq_xx", envoy_response_code_class="4", **http) or 0
            out["envoy-5xx"] = value(e, "envoy_http_downstream_rq_xx", envoy_response_code_class="5", **http) or 0
        return out

    def gauges(self, door):
        """The door's in-flight and held gauges: {name: value}."""
        out = {}
        if door == "sidecar":
            s = parse_prometheus(get(self.sidecar_metrics))
            out["sidecar streams_active"] = value(s, "bypass_marker_streams_active")
            out["sidecar request_bytes_held"] = value(s, "bypass_marker_request_bytes_held")
            return out
        admin = self.ext_proc_admin if door == "ext-proc" else self.module_admin
        e = parse_prometheus(get(admin + "/stats/prometheus"))
        http = {"envoy_http_conn_manager_prefix": "openai"}
        out[f"{door} Envoy downstream_rq_active"] = value(e, "envoy_http_downstream_rq_active", **http)
        out[f"{door} Envoy downstream_cx_active"] = value(e, "envoy_http_downstream_cx_active", **http)
        out[f"{door} Envoy upstream_rq_active (dynamo)"] = value(
            e, "envoy_cluster_upstream_rq_active", envoy_cluster_name="dynamo"
        )
        if door == "ext-proc":
            # The gRPC streams Envoy has open to the processor: the processor's streams in flight.
            out["processor streams in flight (Envoy's upstream_rq_active, bypass_marker)"] = value(
                e, "envoy_cluster_upstream_rq_active", envoy_cluster_name="bypass_marker"
            )
            s = parse_prometheus(get(self.processor_metrics))
            out["processor request_bytes_held"] = value(s, "bypass_marker_request_bytes_held")
        return out

    def envoy_heap(self, door):
        admin = self.ext_proc_admin if door == "ext-proc" else self.module_admin
        e = parse_prometheus(get(admin + "/stats/prometheus"))
        return value(e, "envoy_server_memory_allocated")


def proc_stats(pid):
    """(RSS in KiB, open file descriptors, CPU seconds) of a process."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return rss, len(os.listdir(f"/proc/{pid}/fd")), cpu


# ---------------------------------------------------------------------------------------------


def check(ok, label):
    print(f"{'PASS' if ok else 'FAIL'} {label}", flush=True)
    return ok


async def quiesce(sources, doors, patience):
    """Waits until every in-flight gauge reads 0 (at most `patience` seconds); returns the last
    readings."""
    deadline = time.monotonic() + patience
    while True:
        readings = {}
        for door in doors:
            readings.update(sources.gauges(door.name))
        if all(v == 0 for v in readings.values()) or time.monotonic() > deadline:
            return readings
        await asyncio.sleep(0.5)


async def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sidecar", required=True, help="the sidecar's URL")
    parser.add_argument("--ext-proc", required=True, help="the URL of Envoy with the processor")
    parser.add_argument("--module", required=True, help="the URL of Envoy with the module")
    parser.add_argument("--sidecar-metrics", required=True)
    parser.add_argument("--processor-metrics", required=True)
    parser.add_argument("--ext-proc-admin", required=True)
    parser.add_argument("--module-admin", required=True)
    parser.add_argument("--upstream", required=True, help="upstream.py's URL (GET /counts)")
    parser.add_argument("--pid", action="append", default=[], help="NAME=PID, a process to watch")
    parser.add_argument("--secs", type=float, default=300)
    parser.add_argument("--warmup", type=float, default=30)
    parser.add_argument("--concurrency", type=int, default=4, help="clients per front door")
    parser.add_argument("--think", type=float, default=0.1, help="most seconds between requests")
    parser.add_argument("--seed", default="soak")
    parser.add_argument("--summary", help="write the figures here as JSON")
    # The tolerances (BENCHMARKS.md, "The soak", says why these).
    parser.add_argument("--rss-slack-kib", type=int, default=4096, help="RSS growth allowed, at least")
    parser.add_argument("--rss-slack-ratio", type=float, default=0.10, help="RSS growth allowed, of the start")
    parser.add_argument("--heap-slack-kib", type=int, default=2048, help="Envoy heap growth allowed, at least")
    args = parser.parse_args()

    sources = Sources(args)
    doors = [Door("sidecar", args.sidecar), Door("ext-proc", args.ext_proc), Door("module", args.module)]
    pids = dict(p.split("=", 1) for p in args.pid)
    samples = {name: [] for name in pids}

    def sample(phase):
        for name, pid in pids.items():
            rss, fds, cpu = proc_stats(pid)
            samples[name].append(
                {"t": round(time.monotonic() - t0, 1), "phase": phase, "rss_kib": rss, "fds": fds, "cpu_s": cpu}
            )

    t0 = time.monotonic()
    sample("initial")
    driver_cpu = time.process_time()
    initial = {name: samples[name][-1] for name in pids}
    before = {door.name: sources.counters(door.name) for door in doors}

    # The calibration: one of each refusal through each door, before anything else.
    for door in doors:
        rng = random.Random(args.seed)
        try:
            for kind in sorted(MALFORMED):
                door.tally["requests"] += 1
                await refusal(door, f"malformed-{kind}", 400, MALFORMED[kind], "")
            for case in ("oversized", "gzip"):
                await run_case(door, case, rng)
        except (Failure, OSError, asyncio.TimeoutError, ValueError) as err:
            check(False, f"{door.name}: calibration: {type(err).__name__}: {err}")
            return 1
    for door in doors:
        check(len(door.references) == len(MALFORMED) + 2, f"{door.name}: calibration refusals ({', '.join(f'{k} {v[0]}' for k, v in sorted(door.references.items()))})")

    print(f"soak: warm-up, {args.warmup:.0f} s", file=sys.stderr, flush=True)
    await traffic(doors, args.warmup, args.concurrency, args.think, args.seed, "warmup")
    gauges = await quiesce(sources, doors, 30)
    sample("start")
    start = {name: samples[name][-1] for name in pids}
    heap_start = {d.name: sources.envoy_heap(d.name) for d in doors if d.name != "sidecar"}

    print(f"soak: {args.secs:.0f} s of traffic through {len(doors)} front doors", file=sys.stderr, flush=True)
    sampler_stop = asyncio.Event()

    async def sampler():
        while not sampler_stop.is_set():
            try:
                await asyncio.wait_for(sampler_stop.wait(), 5)
            except asyncio.TimeoutError:
                sample("traffic")
                t = samples[next(iter(pids))][-1]["t"] if pids else 0
                if int(t) % 60 < 5:
                    line = ", ".join(f"{n} {samples[n][-1]['rss_kib'] // 1024} MiB/{samples[n][-1]['fds']} fds" for n in pids)
                    print(f"soak: t={t:.0f}s {line}", file=sys.stderr, flush=True)

    sampling = asyncio.create_task(sampler())
    await traffic(doors, args.secs, args.concurrency, args.think, args.seed, "soak")
    sampler_stop.set()
    await sampling

    gauges = await quiesce(sources, doors, 30)
    # Connections the doors pool to the upstream close or idle; give the processes a moment.
    await asyncio.sleep(2)
    sample("end")
    end = {name: samples[name][-1] for name in pids}
    heap_end = {d.name: sources.envoy_heap(d.name) for d in doors if d.name != "sidecar"}

    # --- the checks
    ok = True
    for door in doors:
        n = sum(door.cases.values())
        f = sum(door.failures.values())
        mix = ", ".join(f"{c} {door.cases[c]}" for c in sorted(door.cases))
        ok &= check(f == 0, f"{door.name}: {n} exchanges, every one as expected ({mix}){'' if f == 0 else f'; {f} failed: {dict(door.failures)}'}")

    for name, v in gauges.items():
        ok &= check(v == 0, f"{name} back to 0 (reads {v})")

    for door in doors:
        after = sources.counters(door.name)
        wrong = []
        keys = set(after) | set(before[door.name])
        for key in sorted(keys, key=str):
            got = after[key] - before[door.name][key]
            if key in (("envoy-4xx"), ("envoy-5xx")):
                want = (
                    door.tally["refused", "400"] + door.tally["refused", "413"]
                    if key == "envoy-4xx"
                    else door.tally["encoded"]
                )
            else:
                want = door.tally[key]
            if got != want:
                wrong.append(f"{key}: counted {got:g}, sent {want}")
        shown = ", ".join(f"{'/'.join(k) if isinstance(k, tuple) else k} {door.tally[k]}" for k in sorted(door.tally, key=str) if door.tally[k])
        ok &= check(not wrong, f"{door.name}: the counters equal what the driver sent ({shown})" + (f": {'; '.join(wrong)}" if wrong else ""))

    counts = json.loads(get(args.upstream + "/counts"))
    ok &= check(counts["forced"] == 0, f"no router-owned marker reached the upstream ({counts['requests']} requests)")

    slack = args.rss_slack_kib
    for name in pids:
        s, e = start[name], end[name]
        limit = s["rss_kib"] + max(slack, int(s["rss_kib"] * args.rss_slack_ratio))
        ok &= check(
            e["rss_kib"] <= limit,
            f"{name}: RSS at the end {e['rss_kib']} KiB, at the start {s['rss_kib']} KiB (at most {limit} KiB)",
        )
        fd_limit = s["fds"] + 2 * args.concurrency + 4
        ok &= check(
            e["fds"] <= fd_limit,
            f"{name}: open files at the end {e['fds']}, at the start {s['fds']} (at most {fd_limit})",
        )
    for door, s in heap_start.items():
        e = heap_end[door]
        limit = s + max(args.heap_slack_kib * 1024, s * args.rss_slack_ratio)
        ok &= check(e <= limit, f"{door} Envoy: heap allocated at the end {e / 1048576:.1f} MiB, at the start {s / 1048576:.1f} MiB (at most {limit / 1048576:.1f} MiB)")

    print("\nprocess     RSS initial   start     peak      end   (MiB)   fds start  peak  end   CPU s", file=sys.stderr)
    figures = {}
    for name in pids:
        peak_rss = max(x["rss_kib"] for x in samples[name])
        peak_fds = max(x["fds"] for x in samples[name])
        figures[name] = {
            "rss_kib": {"initial": initial[name]["rss_kib"], "start": start[name]["rss_kib"], "peak": peak_rss, "end": end[name]["rss_kib"]},
            "fds": {"initial": initial[name]["fds"], "start": start[name]["fds"], "peak": peak_fds, "end": end[name]["fds"]},
            "cpu_s": end[name]["cpu_s"] - initial[name]["cpu_s"],
        }
        mib = lambda k: k / 1024  # noqa: E731
        print(
            f"{name:<14} {mib(initial[name]['rss_kib']):8.1f} {mib(start[name]['rss_kib']):8.1f} {mib(peak_rss):8.1f} {mib(end[name]['rss_kib']):8.1f}"
            f"          {start[name]['fds']:5} {peak_fds:5} {end[name]['fds']:5} {figures[name]['cpu_s']:7.1f}",
            file=sys.stderr,
        )
    total = sum(sum(d.cases.values()) for d in doors)
    print(
        f"{total} exchanges in {args.warmup + args.secs:.0f} s; the driver used {time.process_time() - driver_cpu:.1f} s of CPU",
        file=sys.stderr,
    )
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(
                {
                    "secs": args.secs,
                    "warmup": args.warmup,
                    "concurrency": args.concurrency,
                    "exchanges": {d.name: dict(d.cases) for d in doors},
                    "processes": figures,
                    "envoy_heap": {"start": heap_start, "end": heap_end},
                    "samples": samples,
                },
                f,
                indent=1,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

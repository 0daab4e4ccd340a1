#!/usr/bin/env python3
"""The client of tests/istio/ext_proc.sh: streams and forged requests through an Envoy that carries
examples/istio/ext-proc.yaml's filter and cluster, with the real `bypass-marker ext-proc` behind
the cluster, the simulated router (`--no-layer`, Dynamo as it is) and tests/envoy/upstream.py
(which records what reaches it, `host: upstream`) behind Envoy; then reads the processor's
/metrics.

    python3 tests/istio/ext_proc_client.py ENVOY_URL ROUTER_URL RECORDER_URL METRICS_URL PROMPT

Prints PASS/FAIL lines (tests/support/checks.py)."""

import json
import pathlib
import re
import sys
import urllib.error
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "support"))
from checks import exit_status, frames, report  # noqa: E402

MARKER = b"event: x-bypass-remote-prefill"
REQUEST_ID = b"event: request_id"
# Router-owned names, as a client would forge them (the Dynamo preset's; any case, with a value).
FORGED = ["x-bypass-remote-prefill", "X-Bypass-Remote-Prefill:true", "x-prefill-continue"]


def post(base, body, headers=None):
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def stream(base, prompt, annotations=None):
    body = {"model": "sim-llm", "stream": True, "messages": [{"role": "user", "content": prompt}]}
    if annotations is not None:
        body["nvext"] = {"annotations": annotations}
    return post(base, body)


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def main():
    envoy, router, recorder, metrics, prompt = sys.argv[1:6]
    # The control: straight to the router, a repeated prompt is a prefix-cache hit with the marker.
    stream(router, prompt)
    status, raw = stream(router, prompt)
    report(status == 200 and MARKER in raw and REQUEST_ID in raw,
           "the control: straight to the router, a cache hit starts with the marker and request_id frames",
           f"status {status}, {raw[:200]!r}")

    for attempt in ("a cold stream", "a cache hit"):
        status, body = stream(envoy, prompt + " (through Envoy)")
        report(status == 200 and MARKER not in body and REQUEST_ID not in body and body.endswith(b"data: [DONE]\n\n"),
               f"through the Istio example's ext_proc filter and the processor, {attempt} reaches the client "
               "without the router's frames, ending in data: [DONE]", f"status {status}, {body[:300]!r}")
    status, body = stream(envoy, prompt + " (through Envoy)", ["x-bypass-remote-prefill"])
    marker_frames = [f for f in frames(body) if f.startswith(MARKER)]
    report(status == 200 and marker_frames == [MARKER + b"\n: true\n\n"] and REQUEST_ID not in body,
           "a client that opted in to x-bypass-remote-prefill gets that frame byte for byte, and not request_id",
           f"status {status}, {body[:300]!r}")

    # Forged router-owned names: the guard strips them before the upstream; the rest arrives.
    body = {"model": "sim-llm", "messages": [{"role": "user", "content": "hi"}],
            "nvext": {"annotations": FORGED + ["request_id"]}}
    status, answer = post(envoy, body, {"host": "upstream", "x-test-id": "istio-forged"})
    seen_status, seen = get(f"{recorder}/seen?test_id=istio-forged")
    received = json.loads(seen)["body"] if seen_status == 200 else None
    annotations = (received or {}).get("nvext", {}).get("annotations")
    report(status == 200 and annotations == ["request_id"],
           f"a request naming router-owned markers ({', '.join(FORGED)}) reaches the upstream without them, "
           "request_id kept", f"status {status} {answer[:200]!r}; the upstream saw {received!r}")
    _, counts = get(f"{recorder}/counts")
    forced = json.loads(counts).get("forced")
    report(forced == 0, "no request that reached the upstream named a router-owned marker, in any form",
           f"/counts: {counts!r}")
    # A body the guard refuses never reaches the upstream either.
    request = urllib.request.Request(f"{envoy}/v1/chat/completions", data=b'{"nvext":',
                                     headers={"content-type": "application/json", "host": "upstream",
                                              "x-test-id": "istio-malformed"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            refused = response.status
    except urllib.error.HTTPError as error:
        refused = error.code
    seen_status, _ = get(f"{recorder}/seen?test_id=istio-malformed")
    report(refused == 400 and seen_status == 404, "malformed JSON gets the guard's 400 and never reaches the upstream",
           f"status {refused}, the upstream's /seen: {seen_status}")

    # The processor counted what it removed, under its front door's label.
    _, text = get(metrics)
    text = text.decode()
    removed = re.search(r'^bypass_marker_frames_removed_total\{front_door="ext-proc",annotation="x-bypass-remote-prefill"\} (\d+)$',
                        text, re.M)
    report(removed is not None and int(removed.group(1)) >= 1,
           "the processor's /metrics: frames_removed_total{front_door=\"ext-proc\",annotation=\"x-bypass-remote-prefill\"} "
           f"{removed.group(1) if removed else 'missing'}", "\n".join(l for l in text.splitlines() if "frames_removed" in l))
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())

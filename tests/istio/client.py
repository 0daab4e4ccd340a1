#!/usr/bin/env python3
"""The client of tests/istio/module.sh: streams through an Envoy that carries
examples/istio/dynamic-module.yaml's filter, with the simulated router (`--no-layer`, Dynamo as it
is) behind it and, for the control, straight to it; then reads Envoy's /stats/prometheus.

    python3 tests/istio/client.py ENVOY_URL ADMIN_URL ROUTER_URL PROMPT (kept|dropped)

`kept`: the module's labelled counter must be in /stats/prometheus (the Gateway's stats
annotation); `dropped`: no dynamicmodulescustom series may be (Istio's default stats matcher),
though the module still removes the marker. Prints PASS/FAIL lines (tests/support/checks.py)."""

import json
import pathlib
import re
import sys
import urllib.request

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "support"))
from checks import exit_status, frames, report  # noqa: E402

MARKER = b"event: x-bypass-remote-prefill"
REQUEST_ID = b"event: request_id"


def stream(base, prompt, annotations=None):
    body = {"model": "sim-llm", "stream": True, "messages": [{"role": "user", "content": prompt}]}
    if annotations is not None:
        body["nvext"] = {"annotations": annotations}
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, response.read()


def main():
    envoy, admin, router, prompt, stats = sys.argv[1:6]
    # The control: straight to the router, a repeated prompt is a prefix-cache hit with the marker.
    stream(router, prompt)
    status, raw = stream(router, prompt)
    report(status == 200 and MARKER in raw and REQUEST_ID in raw,
           "the control: straight to the router, a cache hit starts with the marker and request_id frames",
           f"status {status}, {raw[:200]!r}")

    for attempt in ("a cold stream", "a cache hit"):
        status, body = stream(envoy, prompt + " (through Envoy)")
        report(status == 200 and MARKER not in body and REQUEST_ID not in body and body.endswith(b"data: [DONE]\n\n"),
               f"through the Istio example's filter, {attempt} reaches the client without the router's frames, "
               "ending in data: [DONE]", f"status {status}, {body[:300]!r}")
    status, body = stream(envoy, prompt + " (through Envoy)", ["x-bypass-remote-prefill"])
    marker_frames = [f for f in frames(body) if f.startswith(MARKER)]
    report(status == 200 and marker_frames == [MARKER + b"\n: true\n\n"] and REQUEST_ID not in body,
           "a client that opted in to x-bypass-remote-prefill gets that frame byte for byte, and not request_id",
           f"status {status}, {body[:300]!r}")

    with urllib.request.urlopen(f"{admin}/stats/prometheus", timeout=10) as response:
        text = response.read().decode()
    series = [line for line in text.splitlines() if "dynamicmodulescustom" in line and not line.startswith("#")]
    if stats == "kept":
        removed = re.search(r'^envoy_dynamicmodulescustom_bypass_marker_frames_removed\{annotation="x-bypass-remote-prefill"\} (\d+)$',
                            text, re.M)
        forwarded = re.search(r'^envoy_dynamicmodulescustom_bypass_marker_frames_forwarded\{annotation="x-bypass-remote-prefill"\} (\d+)$',
                              text, re.M)
        report(removed is not None and int(removed.group(1)) == 1 and forwarded is not None and int(forwarded.group(1)) == 1,
               "with the Gateway's proxy.istio.io/config proxyStatsMatcher, /stats/prometheus has the module's counters "
               "with their labels: frames_removed{annotation=\"x-bypass-remote-prefill\"} 1, frames_forwarded 1",
               "\n".join(series) or "no dynamicmodulescustom series")
    else:
        report(not series and "envoy_server_live" in text,
               "with Istio's default stats matcher (no annotation), /stats/prometheus has no dynamicmodulescustom series "
               "although the module removed the marker", "\n".join(series) or "no envoy_server_live either")
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())

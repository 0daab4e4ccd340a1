#!/usr/bin/env python3
"""One streamed request through a front door built from the images (tests/images/run.sh).

  one_request.py --url URL --upstream URL --label L

Sends the same streamed chat request (upstream.py's "paced" kind: each data frame preceded by
Dynamo's marker frame) through URL and straight to the upstream, then once more opted in to the
marker (nvext.annotations). Not opted in, the bytes through URL must be the upstream's with every
marker frame removed; opted in, exactly the upstream's. Prints PASS/FAIL lines; exits 1 on a
failure.
"""

import argparse
import json
import sys
import urllib.request

sys.path.insert(0, __file__.rsplit("/", 3)[0] + "/tests/envoy")
sys.path.insert(0, __file__.rsplit("/", 3)[0] + "/tests/support")
import checks  # noqa: E402  (tests/support/checks.py)
from checks import report  # noqa: E402
import script  # noqa: E402  (tests/envoy/script.py: what upstream.py streams)

EVENTS = 3


def stream(base, opt_in):
    body = {
        "model": "tiny",
        "stream": True,
        "messages": [{"role": "user", "content": "hello"}],
        "test": {"kind": "paced", "events": EVENTS, "interval_ms": 5},
    }
    if opt_in:
        body["nvext"] = {"annotations": ["x-bypass-remote-prefill"]}
    request = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, response.read()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--label", required=True)
    args = parser.parse_args()

    status, direct = stream(args.upstream, opt_in=False)
    report(
        status == 200 and direct.count(script.MARKER) == EVENTS,
        f"{args.label}: straight to the upstream, the stream carries {EVENTS} marker frames",
        f"status {status}, {direct[:200]!r}",
    )
    status, through = stream(args.url, opt_in=False)
    expected = script.paced_expected(EVENTS)
    report(
        status == 200 and through == expected,
        f"{args.label}: the stream arrives without the marker, every other byte as sent",
        f"status {status}, got {through[:300]!r}, expected {expected[:300]!r}",
    )
    status, opted = stream(args.url, opt_in=True)
    report(
        status == 200 and opted == direct,
        f"{args.label}: a client opted in to the marker gets the upstream's bytes exactly",
        f"status {status}, got {opted[:300]!r}, expected {direct[:300]!r}",
    )
    sys.exit(checks.exit_status())


if __name__ == "__main__":
    main()

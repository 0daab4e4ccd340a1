#!/usr/bin/env python3
"""The checks of tests/envoy/wasm_hang.sh: the proxy-wasm plugin's held request head, in an Envoy
without `allow_on_headers_stop_iteration` (--unset) and with it (--set), tests/envoy/upstream.py
behind both.

  wasm_hang.py --unset URL --set URL --upstream URL --label TEXT

Without the setting: two requests with a body, sent at once, each get the plugin's 500 naming
the setting within 30 s (not before the plugin's 10 s bound), and the upstream sees neither head;
a GET without a body passes. With it: a first request proves the setting to the VM, then a client
that sends its head and waits 12 s (past the bound) before its body still gets its answer, and the
upstream gets the body. The two Envoys are checked at once (threads), so the run takes about 13 s.
Prints a PASS or FAIL line per check; exits non-zero if any failed.
"""

import argparse
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid

BOUND = 10  # bypass-marker-wasm/src/watch.rs, HELD_HEAD_BOUND_SECS
ANSWER_WITHIN = 30
SLOW = 12

lines = []
lock = threading.Lock()


def check(ok, name):
    with lock:
        lines.append(("PASS " if ok else "FAIL ") + name)


def post(base, body, test_id, timeout=60):
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"content-type": "application/json", "x-test-id": test_id})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, response.headers, data


def upstream_head(upstream, test_id):
    try:
        urllib.request.urlopen(f"{upstream}/head?test_id={test_id}", timeout=5)
        return True
    except urllib.error.HTTPError as err:
        return err.code != 404


def unset(args, index, results):
    test_id = f"hang-{index}-{uuid.uuid4().hex}"
    started = time.monotonic()
    try:
        status, headers, data = post(args.unset, {"model": "m", "stream": True, "messages": []}, test_id)
    except (OSError, http.client.HTTPException) as err:
        status, headers, data = None, {}, repr(err).encode()
    results[index] = (time.monotonic() - started, status, headers, data, test_id)


def unset_checks(args):
    label = args.label
    results = [None, None]
    threads = [threading.Thread(target=unset, args=(args, i, results)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for index, (elapsed, status, headers, data, test_id) in enumerate(results):
        try:
            error = json.loads(data)["error"]
        except (ValueError, KeyError, TypeError):
            error = {}
        message = error.get("message", "")
        ok = (status == 500 and headers.get("content-type") == "application/json"
              and error.get("code") == "allow_on_headers_stop_iteration"
              and error.get("type") == "server_error"
              and "allow_on_headers_stop_iteration: true" in message
              and '"request-head": "forwarded"' in message
              and BOUND - 1 <= elapsed <= ANSWER_WITHIN)
        check(ok, f"{label}: no allow_on_headers_stop_iteration, request {index + 1} of 2 with a body: the "
                  f"plugin's 500 naming the setting and request-head forwarded after {elapsed:.1f} s "
                  f"(bound {BOUND} s, at most {ANSWER_WITHIN} s; status {status}, code {error.get('code')})")
        check(not upstream_head(args.upstream, test_id),
              f"{label}: no allow_on_headers_stop_iteration, request {index + 1}: its head never reached the upstream")
    started = time.monotonic()
    with urllib.request.urlopen(f"{args.unset}/v1/models", timeout=ANSWER_WITHIN) as response:
        status = response.status
    elapsed = time.monotonic() - started
    check(status == 200 and elapsed < BOUND - 1,
          f"{label}: no allow_on_headers_stop_iteration, a GET without a body passes at once ({elapsed:.1f} s)")


def set_checks(args):
    label = args.label
    test_id = f"proof-{uuid.uuid4().hex}"
    status, _, _ = post(args.set, {"model": "m"}, test_id)
    check(status == 200, f"{label}: with allow_on_headers_stop_iteration, a request with a body: {status}")
    # A slow client: the head, then the body SLOW seconds later (past the bound).
    url = urllib.parse.urlsplit(args.set)
    body = json.dumps({"model": "m", "nvext": {"annotations": ["x-bypass-remote-prefill"]}}).encode()
    test_id = f"slow-{uuid.uuid4().hex}"
    sock = socket.create_connection((url.hostname, url.port), timeout=60)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {url.hostname}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-test-id: {test_id}\r\nconnection: close\r\n\r\n")
    started = time.monotonic()
    sock.sendall(head.encode())
    time.sleep(SLOW)
    sock.sendall(body)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    elapsed = time.monotonic() - started
    status_line = answer.split(b"\r\n", 1)[0].decode("latin-1")
    seen = json.load(urllib.request.urlopen(f"{args.upstream}/seen?test_id={test_id}", timeout=5))["body"]
    check(status_line.startswith("HTTP/1.1 200") and seen == {"model": "m", "nvext": {"annotations": []}},
          f"{label}: with allow_on_headers_stop_iteration (proven by a body hook), a client whose body "
          f"comes {SLOW} s after its head is answered ({status_line}, after {elapsed:.1f} s), the body "
          f"guarded: {json.dumps(seen)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--unset", required=True)
    parser.add_argument("--set", required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--label", required=True)
    args = parser.parse_args()
    threads = [threading.Thread(target=f, args=(args,)) for f in (unset_checks, set_checks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for line in lines:
        print(line, flush=True)
    expected = 7
    if len(lines) != expected:
        print(f"FAIL {args.label}: {len(lines)} checks ran, not {expected} (a thread failed)")
    raise SystemExit(0 if all(line.startswith("PASS") for line in lines) and len(lines) == expected else 1)


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The proxy-wasm plugin's memory, measured (docs/envoy.md, "The plugin's memory"): the real Envoy
# (one worker) with the shipped bootstrap (examples/envoy/wasm.yaml) and the plugin at max-body
# M, then N JSON request bodies of exactly M bytes through it, one after another, every other one
# naming a router-owned marker (so the guard rewrites it: the body and its rewrite in the VM at
# once). Prints the plugin VM's linear memory (the gauge bypass_marker_vm_memory_bytes, which the
# plugin reports when its memory grows; Wasm memory never shrinks, so this is the worker's
# high-water mark) after the first body and after the last, and Envoy's resident memory (VmRSS,
# VmHWM). A benchmark, not a CI check: it fails only if a body is not served.
#
#   bash tests/envoy/wasm_memory.sh                         # N=1000, M=33554432 (the default)
#   WASM_MEMORY_MAX_BODY=536870912 bash tests/envoy/wasm_memory.sh   # at the cap: 73 min here
#
# Environment: WASM_MEMORY_BODIES (N), WASM_MEMORY_MAX_BODY (M, at most 536870912: the plugin's
# cap), WASM_MEMORY_ENVOY (default ENVOY_LATEST in tests/versions.sh), ENVOY_CACHE, PYTHON,
# CARGO_TARGET_DIR.
set -euo pipefail

SUITE="wasm memory" LIFETIME=7200
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
# shellcheck source=tests/envoy/servers.sh
source "$here/servers.sh"
bodies="${WASM_MEMORY_BODIES:-1000}"
max_body="${WASM_MEMORY_MAX_BODY:-33554432}"
version="${WASM_MEMORY_ENVOY:-$ENVOY_LATEST}"

install_envoys "$version"
log "building the plugin (bash bypass-marker-wasm/build.sh)"
plugin="$(bash "$root/bypass-marker-wasm/build.sh")" || die "cannot build the plugin"

start upstream "$python" "$here/upstream.py" --lifetime "$LIFETIME"
wait_for "$last_group" 100 listening upstream || die "upstream.py did not start: $(cat "$work/upstream.log")"
upstream="$url"

listen="$(free_port)"
admin="$(free_port)"
"$python" "$here/variant.py" "$root/examples/envoy/wasm.yaml" "config={\"preset\": \"dynamo\", \"max-body\": $max_body}" \
  >"$work/memory.yaml" || die "cannot write the bootstrap"
render_bootstrap "$work/memory.yaml" LISTEN_PORT="$listen" ADMIN_PORT="$admin" UPSTREAM_PORT="${upstream##*:}" \
  WASM_FILE="$plugin" BUFFER_LIMIT="$((max_body + 65536))" >"$work/envoy.yaml" || die "cannot render the bootstrap"
start envoy "${envoys[$version]}" --disable-hot-restart --concurrency 1 --log-level warning -c "$work/envoy.yaml"
envoy_group="$last_group"
wait_for "$envoy_group" 300 envoy_ready "$admin" || die "Envoy did not get ready: $(tail -n 20 "$work/envoy.log")"
envoy_pid="$(pgrep -g "$envoy_group" -x envoy | head -1 || true)"
[[ -n "$envoy_pid" ]] || envoy_pid="$(pgrep -g "$envoy_group" | tail -1)"

log "Envoy $version (pid $envoy_pid, one worker), plugin max-body $max_body: $bodies bodies of $max_body bytes"
started=$SECONDS
"$python" - "http://127.0.0.1:$listen" "http://127.0.0.1:$admin" "$bodies" "$max_body" "$envoy_pid" <<'PY'
import http.client, json, re, sys, time
from urllib.parse import urlsplit
envoy, admin, n, size, pid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

def body(marker):
    names = ["x-bypass-remote-prefill", "request_id"] if marker else ["request_id"]
    head = json.dumps({"model": "tiny", "stream": False, "nvext": {"annotations": names}, "padding": ""}).encode()
    pad = size - len(head)
    return head[:-2] + b"p" * pad + head[-2:]

def gauge():
    text = http.client.HTTPConnection(urlsplit(admin).netloc, timeout=30)
    text.request("GET", "/stats/prometheus")
    stats = text.getresponse().read().decode()
    m = re.search(r"^bypass_marker_vm_memory_bytes(?:\{\})? (\d+)", stats, re.M)
    return int(m.group(1)) if m else None

def rss():
    status = open(f"/proc/{pid}/status").read()
    get = lambda key: int(re.search(rf"^{key}:\s+(\d+) kB", status, re.M).group(1)) // 1024
    return get("VmRSS"), get("VmHWM")

bodies = [body(False), body(True)]
assert all(len(b) == size for b in bodies)
first = None
t0 = time.monotonic()
for i in range(n):
    conn = http.client.HTTPConnection(urlsplit(envoy).netloc, timeout=600)
    conn.request("POST", "/v1/chat/completions", body=bodies[i % 2],
                 headers={"content-type": "application/json", "connection": "close"})
    res = conn.getresponse()
    res.read()
    if res.status != 200:
        sys.exit(f"body {i}: status {res.status}")
    if i == 0:
        time.sleep(0.2)
        first = gauge()
    if (i + 1) % max(1, n // 10) == 0:
        print(f"  {i + 1} bodies in {time.monotonic() - t0:.0f} s: VM memory {gauge()} bytes, Envoy RSS {rss()[0]} MiB", file=sys.stderr)
time.sleep(0.5)
last = gauge()
now, peak = rss()
mib = lambda b: f"{b / 2**20:.0f} MiB" if b is not None else "missing"
print(f"max-body {size} ({size / 2**20:.0f} MiB), {n} bodies (every other one rewritten):")
print(f"  plugin VM memory after the first body: {first} bytes ({mib(first)})")
print(f"  plugin VM memory after body {n}:       {last} bytes ({mib(last)}), {last / size if last else 0:.2f} x max-body")
print(f"  Envoy VmRSS {now} MiB, VmHWM {peak} MiB")
PY
log "done in $((SECONDS - started)) s"
nothing_left

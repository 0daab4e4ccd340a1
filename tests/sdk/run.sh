#!/usr/bin/env bash
# The real OpenAI SDKs against the simulated Dynamo-like router (examples/router.rs).
#
#   bash tests/sdk/run.sh
#
# Installs openai-python (pinned and newest, from PyPI) and openai-node (pinned and newest, from
# npm), each in its own directory under $SDK_CACHE (default ~/.cache/tower-bypass-marker-sdk),
# kept across runs. Builds the router and gateway examples, serves the router on free loopback
# ports (with BypassMarkerLayer and with --no-layer), then with each SDK streams chat and completions
# requests until they are prefix-cache hits. The router prepends a request_id frame to every
# stream and Dynamo's marker before it on a cache hit; neither frame has a data line.
#   - with the layer every plain request streams the right text;
#   - without it every streamed request fails with the SDK's JSON error (the router reproduces
#     the bug): the cold ones on the request_id frame, the cache hits on the marker too;
#   - a raw HTTP client checks the bytes behind those errors: without the layer a cache-hit
#     stream starts with the exact marker frame, then request_id; with it a client that opts in
#     through nvext.annotations gets the marker as its first frame, once, and request_id only if
#     it also asked for it;
#   - no ordering trap: two more routers with the layer add tower-http's CompressionLayer (event
#     streams included), one outside the layer and one inside it; every SDK, sending its own
#     Accept-Encoding, streams the right text through both, and a raw client asking for gzip gets
#     a gzipped, filtered stream from the first and an identity, filtered one from the second;
#   - the gateway users write (examples/gateway.rs: axum, hyper-util's client, the layer, the
#     guard, compression, timeouts, trace, request ids, a concurrency limit) in front of the
#     router without the layer: every SDK streams the right text through it, and the raw client's
#     checks pass through it as through the layer;
#   - every process listens on 127.0.0.1 only, and none is left after the run.
# Ends with `sdk: N passed, M failed`; exits non-zero if anything failed.
#
# Environment: SDK_CACHE, PYTHON (default python3), CARGO_TARGET_DIR,
# SDK_OFFLINE=1 (no registry look-ups: use the newest SDKs already in the cache).
set -euo pipefail

SUITE=sdk LIFETIME=600
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
cache="$sdk_cache"
mkdir -p "$cache"

# ---------------------------------------------------------------------------------------------
# Installs

# shellcheck source=tests/sdk/sdks.sh
source "$here/sdks.sh"

started=$SECONDS
install_sdks
# Older "newest" versions are not needed any more.
prune() {
  local kind="$1" dir keep
  shift
  for dir in "$cache/$kind"-*; do
    [[ -d "$dir" ]] || continue
    for keep in "$@"; do
      [[ "$dir" == "$cache/$kind-$keep" ]] && continue 2
    done
    log "removing $dir"
    rm -rf "$dir"
  done
}
prune py-openai "${py_versions[@]}"
prune node-openai "${node_versions[@]}"
log "SDKs ready in $((SECONDS - started)) s: python openai ${py_versions[*]}, node openai ${node_versions[*]}"

# ---------------------------------------------------------------------------------------------
# The router

log "building the router and gateway examples"
# --all-features: the gateway needs json; the build `cargo test --all-features` made is reused.
(cd "$root" && cargo build --quiet --all-features --example router --example gateway)
router="$target/debug/examples/router"
[[ -x "$router" ]] || die "no router binary at $router"
gateway_bin="$target/debug/examples/gateway"
[[ -x "$gateway_bin" ]] || die "no gateway binary at $gateway_bin"

# Starts the router with "$@" and sets `url` to its base URL once it accepts connections.
start_router() {
  local name="$1"
  shift
  start "$name" "$router" --addr 127.0.0.1:0 --shutdown-after "$LIFETIME" "$@"
  wait_for "$last_group" 100 listening "$name" || die "router ($name) did not start: $(cat "$work/$name.log")"
}

start_router layer
with_layer="$url"
start_router no-layer --no-layer
without_layer="$url"
start_router compress-outside --compress outside
compress_outside="$url"
start_router compress-inside --compress inside
compress_inside="$url"
log "router with the layer: $with_layer, without: $without_layer"
# The gateway users write (examples/gateway.rs), in front of a router without the layer; its
# control, a third such router (the raw client's cold requests must be cold on each).
start_router gateway-upstream --no-layer
gateway_upstream="$url"
start_router gateway-control --no-layer
gateway_control="$url"
start gateway "$gateway_bin" --upstream "$gateway_upstream" --listen 127.0.0.1:0
wait_for "$last_group" 100 listening gateway || die "the gateway did not start: $(cat "$work/gateway.log")"
gateway="$url"
log "the gateway example: $gateway, in front of $gateway_upstream"

# ---------------------------------------------------------------------------------------------
# The clients

# Clients get 120 s each.
CLIENT_TIMEOUT=120

run_sdk_clients "$with_layer" "$without_layer" "the layer"
run_sdk_clients "$gateway" "$gateway_control" "the gateway example"

# No ordering trap: compression outside the layer or inside it, each SDK with its own
# Accept-Encoding (which names gzip at least), the right text either way; inside, the layer asks
# the services below it for identity, so nothing is compressed.
for where in outside inside; do
  base="$compress_outside"
  [[ "$where" == inside ]] && base="$compress_inside"
  for v in "${py_versions[@]}"; do
    run_client "python openai $v, compression $where the layer" "${py_bin[$v]}" "$root/tests/sdk/client.py" sdk \
      --base-url "$base/v1" --expect pass --label "python openai $v, compression $where" --version "$v"
  done
  for v in "${node_versions[@]}"; do
    run_client "node openai $v, compression $where the layer" "${node_bin[$v]}" "$root/tests/sdk/client.mjs" \
      --sdk-dir "${node_dir[$v]}" --base-url "$base/v1" --expect pass --label "node openai $v, compression $where" \
      --version "$v"
  done
  want=gzip
  [[ "$where" == inside ]] && want=identity
  # A cache hit (the same prompt twice) asking for gzip: the coding the layer order gives, and a
  # stream with neither the marker nor the request_id frame.
  got="$("$python" - "$base" <<'PY'
import gzip, json, sys, urllib.request
body = json.dumps({"model": "sim-llm", "stream": True,
                   "messages": [{"role": "user", "content": "compression order"}]}).encode()
for _ in range(2):
    req = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", data=body, headers={
        "content-type": "application/json", "accept-encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=30) as res:
        coding = res.headers.get("content-encoding") or "identity"
        raw = res.read()
text = (gzip.decompress(raw) if coding == "gzip" else raw).decode()
clean = "data: [DONE]" in text and "event:" not in text
print(f"{coding} {'filtered' if clean else 'NOT-FILTERED'}")
PY
)" || got="error"
  count "$([[ "$got" == "$want filtered" ]] && echo 1 || echo 0)" \
    "compression $where the layer, a client asking for gzip: $want and filtered (got: $got)"
done

only_loopback
nothing_left
log "done in $((SECONDS - started)) s"
echo "sdk: $passed passed, $failed failed"
((failed == 0 && passed > 0))

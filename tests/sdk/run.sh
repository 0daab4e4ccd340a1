#!/usr/bin/env bash
# The real OpenAI SDKs against the simulated Dynamo-like router (examples/router.rs).
#
#   bash tests/sdk/run.sh
#
# Installs openai-python (pinned and newest, from PyPI) and openai-node (pinned and newest, from
# npm), each in its own directory under $SDK_CACHE (default ~/.cache/tower-bypass-marker-sdk),
# kept across runs. Builds the router example, serves it twice on free loopback ports (with
# BypassMarkerLayer and with --no-layer), then with each SDK streams chat and completions
# requests until they are prefix-cache hits. The router prepends a request_id frame to every
# stream and Dynamo's marker before it on a cache hit; neither frame has a data line.
#   - with the layer every plain request streams the right text;
#   - without it every streamed request fails with the SDK's JSON error (the router reproduces
#     the bug): the cold ones on the request_id frame, the cache hits on the marker too;
#   - a raw HTTP client checks the bytes behind those errors: without the layer a cache-hit
#     stream starts with the exact marker frame, then request_id; with it a client that opts in
#     through nvext.annotations gets the marker as its first frame, once, and request_id only if
#     it also asked for it.
# Ends with `sdk: N passed, M failed`; exits non-zero if anything failed.
#
# Environment: SDK_CACHE, PYTHON (default python3), CARGO_TARGET_DIR,
# SDK_OFFLINE=1 (no registry look-ups: use the newest SDKs already in the cache).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cache="${SDK_CACHE:-$HOME/.cache/tower-bypass-marker-sdk}"
sdk_cache="$cache"
python="${PYTHON:-python3}"


log() { printf 'sdk: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

mkdir -p "$cache"
work="$(mktemp -d)"
pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

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

log "building the router example"
(cd "$root" && cargo build --quiet --example router)
router="${CARGO_TARGET_DIR:-$root/target}/debug/examples/router"
[[ -x "$router" ]] || die "no router binary at $router"

# Starts the router with "$@" and sets router_url to its base URL once it accepts connections.
# (Not called in a command substitution: that subshell would keep the pid from the cleanup.)
start_router() {
  local name="$1" out="$work/$1.out" url="" i
  shift
  # Created here, not by the background job's redirection, which may not have run yet when sed
  # first reads it.
  : >"$out"
  # --shutdown-after: it stops by itself even if this script is killed without its trap.
  "$router" --addr 127.0.0.1:0 --shutdown-after 600 "$@" >"$out" 2>"$work/$name.err" &
  pids+=($!)
  for ((i = 0; i < 100; i++)); do
    url="$(sed -n 's#^listening on \(http://.*\)$#\1#p' "$out")"
    [[ -n "$url" ]] && break
    kill -0 "${pids[-1]}" 2>/dev/null || die "router ($name) exited: $(cat "$work/$name.err")"
    sleep 0.1
  done
  [[ -n "$url" ]] || die "router ($name) did not print 'listening on' within 10 s"
  router_url="$url"
}

start_router layer
with_layer="$router_url"
start_router no-layer --no-layer
without_layer="$router_url"
log "router with the layer: $with_layer, without: $without_layer"

# ---------------------------------------------------------------------------------------------
# The clients

passed=0
failed=0

# Runs a client ("$@") and counts its PASS and FAIL lines; a client that fails without saying
# which check failed counts as one failure.
run_client() {
  local name="$1" out="$work/client.out" err="$work/client.err" status=0 p f
  shift
  timeout 120 "$@" >"$out" 2>"$err" || status=$?
  cat "$out"
  p="$(grep -c '^PASS ' "$out" || true)"
  f="$(grep -c '^FAIL ' "$out" || true)"
  if ((status != 0 && f == 0)); then
    printf 'FAIL %s: exited with status %d\n' "$name" "$status"
    f=1
  fi
  if ((f > 0 || status != 0)); then
    log "$name: stderr follows"
    sed 's/^/    /' "$err" >&2
  fi
  passed=$((passed + p))
  failed=$((failed + f))
}

for v in "${py_versions[@]}"; do
  label="python openai $v"
  run_client "$label, with layer" "${py_bin[$v]}" "$here/client.py" sdk \
    --base-url "$with_layer/v1" --expect pass --label "$label" --version "$v"
  run_client "$label, without layer" "${py_bin[$v]}" "$here/client.py" sdk \
    --base-url "$without_layer/v1" --expect fail-every-stream --label "$label" --version "$v"
done
for v in "${node_versions[@]}"; do
  label="node openai $v"
  run_client "$label, with layer" "${node_bin[$v]}" "$here/client.mjs" --sdk-dir "${node_dir[$v]}" \
    --base-url "$with_layer/v1" --expect pass --label "$label" --version "$v"
  run_client "$label, without layer" "${node_bin[$v]}" "$here/client.mjs" --sdk-dir "${node_dir[$v]}" \
    --base-url "$without_layer/v1" --expect fail-every-stream --label "$label" --version "$v"
done
run_client "raw HTTP client" "$python" "$here/client.py" raw \
  --layer-url "$with_layer" --no-layer-url "$without_layer"

log "done in $((SECONDS - started)) s"
echo "sdk: $passed passed, $failed failed"
((failed == 0 && passed > 0))

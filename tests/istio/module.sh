#!/usr/bin/env bash
# examples/istio/dynamic-module.yaml in the real Envoy: its EnvoyFilter's HTTP filter, taken from
# the file as written, in a bootstrap with the Gateway's listener patch and istio-proxy's stats
# settings (tests/istio/bootstrap.py), and the module where the Gateway's Deployment patch puts it
# (the file name its init container copies, in the directory its ENVOY_DYNAMIC_MODULES_SEARCH_PATH
# names, here a scratch directory). No Istio runs here: this is the Envoy side of it.
#
#   bash tests/istio/module.sh
#
# Checks, in Envoy 1.40.0 (and `envoy --mode validate` in 1.38.3 and 1.39.3):
#   - Envoy loads the module from the search path alone, with the example's filter_config;
#   - the simulated router (`--no-layer`, as Dynamo is) streams through it: no request_id or
#     marker frame reaches a client that did not opt in, the opted-in frame arrives byte for byte
#     (the same router straight: the frames are there);
#   - with the Gateway's `proxy.istio.io/config` proxyStatsMatcher the module's counters are in
#     /stats/prometheus with their labels; with Istio's default stats matcher they are not;
#   - every process listens on 127.0.0.1 only, and none is left after the run.
# Ends with `istio module: N passed, M failed`; exits non-zero if anything failed.
#
# Environment: ENVOY_CACHE, PYTHON (default python3), CARGO_TARGET_DIR.
set -euo pipefail

SUITE="istio module" LIFETIME=300
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
# shellcheck source=tests/envoy/servers.sh
source "$root/tests/envoy/servers.sh"

# shellcheck disable=SC2086 # a list of versions
install_envoys "$ENVOY_LATEST" $ENVOY_MODULE_OLDER
build_module
build_router
# pyyaml for bootstrap.py: the validate suites' venv has it; else the interpreter's own.
yaml_python="$python"
for venv in "${EG_CACHE:-$HOME/.cache/tower-bypass-marker-envoy-gateway}"/venv-*/bin/python; do
  [[ -x "$venv" ]] && "$venv" -c 'import yaml' 2>/dev/null && yaml_python="$venv" && break
done
"$yaml_python" -c 'import yaml' 2>/dev/null || die "no python with PyYAML (run tests/istio/validate.sh first)"

# The module where the Gateway's pods have it: <the file the init container copies> in <a
# directory>, ENVOY_DYNAMIC_MODULES_SEARCH_PATH naming it (the example's own path is /etc/istio/...).
read -r copied search_path < <("$yaml_python" "$here/bootstrap.py" --print-copy)
count "$([[ "$copied" == libbypass_marker_envoy_module.so && "$search_path" == /* ]] && echo 1 || echo 0)" \
  "the Gateway's Deployment patch copies $copied and points ENVOY_DYNAMIC_MODULES_SEARCH_PATH at $search_path"
mkdir -p "$work/modules"
cp "$target/release/libbypass_marker_envoy_module.so" "$work/modules/$copied"
export ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$work/modules"

start router "$router" --addr 127.0.0.1:0 --no-layer --shutdown-after "$LIFETIME"
wait_for "$last_group" 100 listening router || die "the router did not start: $(cat "$work/router.log")"
router_url="$url"
router_port="${router_url##*:}"

run=0
# Runs Envoy $1 with the bootstrap for stats $2 (kept: the Gateway's annotation; dropped: Istio's
# defaults), and the client.
through_envoy() {
  local version="$1" stats="$2" listen admin option=()
  run=$((run + 1))
  [[ "$stats" == dropped ]] && option=(--istio-defaults)
  listen="$(free_port)"
  admin="$(free_port)"
  "$yaml_python" "$here/bootstrap.py" --listen "$listen" --admin "$admin" --upstream "$router_port" \
    "${option[@]}" >"$work/bootstrap-$run.json"
  start "envoy-$run" "${envoys[$version]}" --disable-hot-restart --base-id "$((RANDOM + 40000))" \
    -c "$work/bootstrap-$run.json" --log-level warn --component-log-level dynamic_modules:info
  if ! wait_for "$last_group" 300 envoy_ready "$admin"; then
    count 0 "Envoy $version starts with the Istio example's filter: $(tail -n 3 "$work/envoy-$run.log" | tr '\n' ' ')"
    return
  fi
  local loaded=0
  grep -q "Dynamic module ABI version" "$work/envoy-$run.log" && loaded=1
  count $loaded "Envoy $version loads $copied from ENVOY_DYNAMIC_MODULES_SEARCH_PATH with the Istio example's filter ($stats stats): $(grep -o 'Dynamic module ABI version.*' "$work/envoy-$run.log" | head -n 1)"
  run_client "client ($version, $stats)" "$python" "$here/client.py" "http://127.0.0.1:$listen" \
    "http://127.0.0.1:$admin" "$router_url" "Why is the sky blue? ($run)" "$stats"
  ((${#groups[@]})) && only_loopback
  kill -TERM -- "-$last_group" 2>/dev/null || true
}

through_envoy "$ENVOY_LATEST" kept
through_envoy "$ENVOY_LATEST" dropped

# The older Envoys Envoy Gateway ships: the same bootstrap passes `envoy --mode validate` (which
# loads the module).
# shellcheck disable=SC2086 # a list of versions
for version in $ENVOY_MODULE_OLDER; do
  "$yaml_python" "$here/bootstrap.py" --listen 10000 --admin 9901 --upstream 8000 >"$work/validate.json"
  status=0
  timeout 60 "${envoys[$version]}" --mode validate -c "$work/validate.json" >"$work/validate.log" 2>&1 || status=$?
  count "$((status == 0))" "envoy $version --mode validate loads the module with the Istio example's filter (status $status)$( ((status)) && printf ': %s' "$(tail -n 1 "$work/validate.log")")"
done

nothing_left
echo "istio module: $passed passed, $failed failed"
((failed == 0 && passed > 0))

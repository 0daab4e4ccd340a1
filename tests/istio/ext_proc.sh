#!/usr/bin/env bash
# examples/istio/ext-proc.yaml in the real Envoy with the real processor: its EnvoyFilter's ext_proc
# HTTP filter and the cluster it ADDs, taken from the file as written (the cluster's address aside:
# 127.0.0.1 and the processor's port for the Service's name), in a bootstrap with the Gateway's
# listener and connection manager patches (tests/istio/ext_proc_bootstrap.py), and
# `bypass-marker ext-proc --preset dynamo` behind that cluster. No Istio runs here: this is the
# Envoy side of it, as tests/istio/module.sh is for the module's EnvoyFilter.
#
#   bash tests/istio/ext_proc.sh
#
# Checks, in Envoy 1.40.0 (tests/versions.sh's ENVOY_LATEST):
#   - Envoy starts with the example's filter and cluster, and health-checks the processor healthy
#     through the cluster's gRPC health check;
#   - the simulated router (`--no-layer`, as Dynamo is) streams through it: no request_id or marker
#     frame reaches a client that did not opt in, the opted-in frame arrives byte for byte (the same
#     router straight: the frames are there);
#   - forged router-owned names (any case, with a value) never reach the upstream
#     (tests/envoy/upstream.py records what arrives), and malformed JSON gets the 400 and never
#     reaches it;
#   - the processor's /metrics counts the removals under front_door="ext-proc";
#   - every process listens on 127.0.0.1 only, and none is left after the run.
# Ends with `istio ext-proc: N passed, M failed`; exits non-zero if anything failed.
#
# Environment: ENVOY_CACHE, PYTHON (default python3), CARGO_TARGET_DIR, BYPASS_MARKER_BIN, EG_CACHE.
set -euo pipefail

SUITE="istio ext-proc" LIFETIME=300
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
# shellcheck source=tests/envoy/servers.sh
source "$root/tests/envoy/servers.sh"

install_envoys "$ENVOY_LATEST"
build_bypass_marker
build_router
# PyYAML for the bootstrap: the validate suites' venv has it; else the interpreter's own.
yaml_python="$python"
for venv in "${EG_CACHE:-$HOME/.cache/tower-bypass-marker-envoy-gateway}"/venv-*/bin/python; do
  [[ -x "$venv" ]] && "$venv" -c 'import yaml' 2>/dev/null && yaml_python="$venv" && break
done
"$yaml_python" -c 'import yaml' 2>/dev/null || die "no python with PyYAML (run tests/istio/validate.sh first)"

start router "$router" --addr 127.0.0.1:0 --no-layer --shutdown-after "$LIFETIME"
wait_for "$last_group" 100 listening router || die "the router did not start: $(cat "$work/router.log")"
router_url="$url"
start recorder "$python" "$root/tests/envoy/upstream.py" --lifetime "$LIFETIME"
wait_for "$last_group" 100 listening recorder || die "upstream.py did not start: $(cat "$work/recorder.log")"
recorder_url="$url"

ext_proc_port="$(free_port)"
metrics_port="$(free_port)"
start processor "$bin" ext-proc --listen "127.0.0.1:$ext_proc_port" --metrics-listen "127.0.0.1:$metrics_port" --preset dynamo
wait_for "$last_group" 100 accepts "$ext_proc_port" ||
  die "the processor does not accept connections on 127.0.0.1:$ext_proc_port: $(cat "$work/processor.log")"

listen="$(free_port)"
admin="$(free_port)"
"$yaml_python" "$here/ext_proc_bootstrap.py" --listen "$listen" --admin "$admin" --upstream "${router_url##*:}" \
  --recorder "${recorder_url##*:}" --ext-proc "$ext_proc_port" >"$work/bootstrap.json"
start envoy "${envoys[$ENVOY_LATEST]}" --disable-hot-restart --base-id "$((RANDOM + 40000))" \
  -c "$work/bootstrap.json" --log-level warn
if ! wait_for "$last_group" 300 envoy_ready "$admin"; then
  count 0 "Envoy $ENVOY_LATEST starts with the Istio example's ext_proc filter and cluster: $(tail -n 3 "$work/envoy.log" | tr '\n' ' ')"
else
  count 1 "Envoy $ENVOY_LATEST starts with the Istio example's ext_proc filter and cluster"
  # The cluster's gRPC health check (the processor's grpc.health.v1) marks the processor healthy.
  healthy() {
    "$python" -c "import urllib.request, sys; t = urllib.request.urlopen('http://127.0.0.1:$admin/clusters', timeout=2).read().decode(); sys.exit(0 if 'bypass_marker::127.0.0.1:$ext_proc_port::health_flags::healthy' in t else 1)" 2>/dev/null
  }
  ok=0
  wait_for "$last_group" 100 healthy && ok=1
  count $ok "Envoy's gRPC health check through the example's cluster finds the processor healthy (/clusters)"
  run_client "client" "$python" "$here/ext_proc_client.py" "http://127.0.0.1:$listen" "$router_url" "$recorder_url" \
    "http://127.0.0.1:$metrics_port/metrics" "Why is the sky blue? (istio ext-proc)"
  only_loopback
fi

nothing_left
echo "istio ext-proc: $passed passed, $failed failed"
((failed == 0 && passed > 0))

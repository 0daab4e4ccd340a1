#!/usr/bin/env bash
# Envoy Gateway's own xDS for the dynamic module, run (issue 49, item 3): the listener filter and
# the per-route enable that Envoy Gateway v1.8.3 and v1.9.0 generate for
# examples/envoy-gateway/dynamic-module.yaml (envoyproxy/gateway
# internal/xds/translator/dynamicmodule.go, the same file at both tags), written as a static
# bootstrap (tests/envoy-gateway/module-xds.yaml), in the real Envoy 1.40.0 and in Envoy 1.38.3
# and 1.39.3 (the Envoys Envoy Gateway 1.8 and 1.9 ship) with the real module
# (target/release/libbypass_marker_envoy_module.so, loaded by module.local.filename, with
# ENVOY_DYNAMIC_MODULES_SEARCH_PATH unset) and tests/envoy/upstream.py behind it:
#   - the bootstrap is what Envoy Gateway generates from the example's EnvoyProxy and
#     EnvoyExtensionPolicy: the filter's name, `disabled: true`, module.local.filename (the
#     EnvoyProxy's path), filter_name, filter_config (the policy's config), and the empty
#     envoy.config.route.v3.FilterConfig on one route only (module_xds.py bootstrap);
#   - Envoy loads the module from that file and passes `envoy --mode validate`;
#   - on the route with the per-route enable, a stream with the marker arrives without it, and a
#     request body naming router-owned markers reaches the upstream without them; the module
#     counts the removed frames;
#   - on the route without it, the stream passes byte for byte (the marker included), the forged
#     names reach the upstream as sent and the module counts nothing: the module does not run;
#   - a real per-route config for the module (a DynamicModuleFilterPerRoute in place of the empty
#     FilterConfig): Envoy 1.40.0 refuses it, "Failed to resolve symbol" (the module has no
#     per-route hooks; 1.38.3 cannot load a per-route module by file at all);
#   - every process listens on 127.0.0.1 only, and none is left after the run.
# Ends with `envoy-gateway module xds: N passed, M failed`; exits non-zero if anything failed.
#
#   bash tests/envoy-gateway/module_xds.sh
#
# Environment: ENVOY_CACHE, PYTHON (default python3), CARGO_TARGET_DIR,
#   XDS_ENVOYS   the Envoys (default ENVOY_LATEST, then ENVOY_MODULE_OLDER, from tests/versions.sh)
set -euo pipefail

SUITE="envoy-gateway module xds" LIFETIME=600
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
# shellcheck source=tests/envoy/servers.sh
source "$root/tests/envoy/servers.sh"
versions="${XDS_ENVOYS:-$ENVOY_LATEST $ENVOY_MODULE_OLDER}"
# The module by its file, as Envoy Gateway loads it: never from a search path.
unset ENVOY_DYNAMIC_MODULES_SEARCH_PATH

started=$SECONDS
# shellcheck disable=SC2086 # a list of versions
install_envoys $versions
build_module
module="$target/release/libbypass_marker_envoy_module.so"
log "installs and builds ready in $((SECONDS - started)) s"

suite=$SECONDS
bootstrap="$here/module-xds.yaml"
run_client "the bootstrap is Envoy Gateway's xDS for the example" "$python" "$here/module_xds.py" bootstrap \
  --bootstrap "$bootstrap" --example "$root/examples/envoy-gateway/dynamic-module.yaml"

start upstream "$python" "$root/tests/envoy/upstream.py" --lifetime "$LIFETIME"
wait_for "$last_group" 100 listening upstream || die "upstream.py did not start: $(cat "$work/upstream.log")"
upstream="$url"

for version in $versions; do
  v="Envoy $version"
  render_bootstrap "$bootstrap" MODULE_FILE="$module" >"$work/validate.yaml"
  status=0
  timeout 120 "${envoys[$version]}" --mode validate -c "$work/validate.yaml" >"$work/validate.log" 2>&1 ||
    status=$?
  ok=0
  ((status == 0)) && ok=1
  count $ok "$v: envoy --mode validate -c tests/envoy-gateway/module-xds.yaml: status $status$( ((status)) && printf ': %s' "$(tail -n 3 "$work/validate.log" | tr '\n' ' ')")"

  start_envoy_from "envoy-$version" "$version" info "$bootstrap" UPSTREAM_PORT="${upstream##*:}" \
    MODULE_FILE="$module"
  ok=0
  grep -Eq 'Dynamic module ABI version v0\.2\.0 (matched|is deprecated)' "$work/envoy-$version.log" && ok=1
  count $ok "$v: loads the module from module.local.filename $module (no search path)"
  [[ "$version" == "${versions%% *}" ]] && only_loopback
  run_client "$v: the routes" "$python" "$here/module_xds.py" routes --envoy "$url" --upstream "$upstream" \
    --admin "$admin_url"
done

# A real per-route config: the module exports no per-route hooks, so Envoy refuses it.
render_bootstrap "$bootstrap" MODULE_FILE="$module" >"$work/rendered.yaml"
"$python" "$here/module_xds.py" per-route --bootstrap "$work/rendered.yaml" >"$work/per-route.yaml" ||
  die "cannot write the per-route bootstrap"
status=0
timeout 120 "${envoys[$ENVOY_LATEST]}" --mode validate -c "$work/per-route.yaml" >"$work/per-route.log" 2>&1 ||
  status=$?
ok=0
((status != 0)) && grep -q 'Failed to resolve symbol envoy_dynamic_module_on_http_filter_per_route_config_new' \
  "$work/per-route.log" && ok=1
count $ok "Envoy $ENVOY_LATEST: a DynamicModuleFilterPerRoute for the module is refused (status $status): \"Failed to resolve symbol envoy_dynamic_module_on_http_filter_per_route_config_new\""

nothing_left

log "suite done in $((SECONDS - suite)) s ($((SECONDS - started)) s with the installs and the builds)"
echo "envoy-gateway module xds: $passed passed, $failed failed"
((failed == 0 && passed > 0))

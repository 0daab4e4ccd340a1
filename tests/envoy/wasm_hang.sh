#!/usr/bin/env bash
# No silent hang (issue 49, item 6): the proxy-wasm plugin holds a request's head for the guard
# (`request-head: held`, the default), which needs `allow_on_headers_stop_iteration: true` in its
# Envoy configuration; without it Envoy withholds the body hooks and, before, such a request waited
# in silence for stream_idle_timeout (600 s). In Envoy 1.40.0, 1.39.3 and 1.36.4 (the wasm suite's
# Envoys, tests/versions.sh), with bypass_marker.wasm in V8 and tests/envoy/upstream.py behind:
#   - tests/envoy/wasm-no-allow.yaml is examples/envoy/wasm.yaml less that one line, nothing else;
#   - without the setting: two requests with a body, sent at once, each get the plugin's 500
#     (OpenAI-shaped, code allow_on_headers_stop_iteration, the message naming the setting and
#     "request-head": "forwarded") after the plugin's 10 s bound and within 30 s; the upstream sees
#     neither head; a GET without a body passes at once; Envoy's log has one error line naming the
#     setting (the second request's held back: at most one a minute);
#   - with the setting (the shipped bootstrap): once a body hook has come, a client whose body
#     comes 12 s after its head (past the bound) is answered, its body guarded, and nothing is
#     logged about the setting;
#   - every process listens on 127.0.0.1 only, and none is left after the run.
# Ends with `envoy wasm hang: N passed, M failed`; exits non-zero if anything failed.
#
#   bash tests/envoy/wasm_hang.sh
#
# Environment: ENVOY_CACHE, PYTHON (default python3), CARGO_TARGET_DIR,
#   WASM_ENVOYS   the Envoys (default ENVOY_LATEST, then ENVOY_WASM_OLDER, from tests/versions.sh)
set -euo pipefail

SUITE="envoy wasm hang" LIFETIME=600
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
# shellcheck source=tests/envoy/servers.sh
source "$here/servers.sh"
versions="${WASM_ENVOYS:-$ENVOY_LATEST $ENVOY_WASM_OLDER}"

started=$SECONDS
# shellcheck disable=SC2086 # a list of versions
install_envoys $versions
log "building the plugin (bash bypass-marker-wasm/build.sh)"
plugin="$(bash "$root/bypass-marker-wasm/build.sh")" || die "cannot build the plugin"
log "installs and builds ready in $((SECONDS - started)) s"

suite=$SECONDS
unset_bootstrap="$here/wasm-no-allow.yaml"
# The file's own comment is its first 6 lines.
ok=0
[[ "$(grep -c 'allow_on_headers_stop_iteration: true' "$root/examples/envoy/wasm.yaml")" == 1 ]] &&
  diff <(grep -v 'allow_on_headers_stop_iteration: true' "$root/examples/envoy/wasm.yaml") \
    <(tail -n +7 "$unset_bootstrap") >/dev/null && ok=1
count $ok "tests/envoy/wasm-no-allow.yaml is examples/envoy/wasm.yaml less allow_on_headers_stop_iteration: true"

start upstream "$python" "$here/upstream.py" --lifetime "$LIFETIME"
wait_for "$last_group" 100 listening upstream || die "upstream.py did not start: $(cat "$work/upstream.log")"
upstream="$url"

setting='allow_on_headers_stop_iteration: true \(Envoy 1\.35 and later\)\. Set it, or set "request-head": "forwarded"'
for version in $versions; do
  v="Envoy $version"
  start_envoy_from "unset-$version" "$version" info "$unset_bootstrap" UPSTREAM_PORT="${upstream##*:}" \
    WASM_FILE="$plugin"
  unset_url="$url"
  start_envoy_from "set-$version" "$version" info "$root/examples/envoy/wasm.yaml" \
    UPSTREAM_PORT="${upstream##*:}" WASM_FILE="$plugin"
  set_url="$url"
  [[ "$version" == "${versions%% *}" ]] && only_loopback
  run_client "$v: held heads" "$python" "$here/wasm_hang.py" --unset "$unset_url" --set "$set_url" \
    --upstream "$upstream" --label "$v"
  n="$(grep -Ec "\[error\]\[wasm\].*bypass_marker: a request head held for the guard got no body within 10 s.*$setting" \
    "$work/unset-$version.log" || true)"
  ok=0
  ((n == 1)) && ok=1
  count $ok "$v: without the setting, Envoy's log has one error line naming it for two such requests (found $n)"
  n="$(grep -c 'allow_on_headers_stop_iteration' "$work/set-$version.log" || true)"
  ok=0
  ((n == 0)) && ok=1
  count $ok "$v: with the setting, nothing about it is logged (found $n lines)"
done

nothing_left

log "suite done in $((SECONDS - suite)) s ($((SECONDS - started)) s with the installs and the builds)"
echo "envoy wasm hang: $passed passed, $failed failed"
((failed == 0 && passed > 0))

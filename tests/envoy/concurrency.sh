#!/usr/bin/env bash
# Thousands of long-lived event streams at once through the real Envoy 1.40.0 with the shipped
# bootstrap (examples/envoy/dynamic-module.yaml: its circuit breakers as shipped, its addresses
# set by examples/envoy/render.sh) and the dynamic module, all on 127.0.0.1: N streams (default
# 5,000) of E events (default 100) MS apart (default 20 ms), every one in flight at once. Checks
# that every stream arrives intact and without Dynamo's marker, that the upstream got exactly N
# requests, that Envoy's circuit breakers overflowed nowhere, and that the module's counter says
# exactly N markers removed. Prints Envoy's peak RSS.
#
#   bash tests/envoy/concurrency.sh
#
# Envoy's default circuit breakers (1,024 connections, pending and active requests per cluster)
# fail this with 5,000 streams: try `CONCURRENCY_MAX_STREAMS=1024 bash tests/envoy/concurrency.sh`.
#
# Environment:
#   CONCURRENCY_STREAMS (default 5000), CONCURRENCY_EVENTS (100), CONCURRENCY_INTERVAL_MS (20)
#   CONCURRENCY_MAX_STREAMS   render.sh --max-streams (default: as shipped)
#   ENVOY_CACHE, PYTHON (default python3), CARGO_TARGET_DIR
# Needs 2 x N + 200 open files per process (ulimit -n; raised to the hard limit here).
# Ends with `envoy concurrency: N passed, M failed`; exits non-zero if anything failed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3}"
target="${CARGO_TARGET_DIR:-$root/target}"
streams="${CONCURRENCY_STREAMS:-5000}"
events="${CONCURRENCY_EVENTS:-100}"
interval="${CONCURRENCY_INTERVAL_MS:-20}"
LIFETIME=900

log() { printf 'envoy concurrency: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

hard_limit="$(ulimit -Hn)"
[[ "$hard_limit" == unlimited ]] && hard_limit=1048576
ulimit -n "$hard_limit" 2>/dev/null || true
if [[ "$(ulimit -n)" != unlimited ]] && (($(ulimit -n) < 2 * streams + 200)); then
  die "$streams concurrent streams need $((2 * streams + 200)) open files, the limit is $(ulimit -n)"
fi

# shellcheck source=tests/envoy/install.sh
source "$here/install.sh"
work="$(mktemp -d "${TMPDIR:-/tmp}/tower-bypass-marker-concurrency.XXXXXX")"
# shellcheck source=tests/support/procs.sh
source "$here/../support/procs.sh"
# shellcheck source=tests/support/checks.sh
source "$here/../support/checks.sh"
# shellcheck source=tests/envoy/servers.sh
source "$here/servers.sh"

started=$SECONDS
install_envoy || die "cannot install Envoy $ENVOY_VERSION"
log "building the module (cargo build --release -p bypass-marker-envoy-module)"
(cd "$root" && cargo build --quiet --release -p bypass-marker-envoy-module) || die "cannot build the module"
[[ -f "$target/release/libbypass_marker.so" ]] || die "no $target/release/libbypass_marker.so"

start upstream "$python" "$here/concurrency.py" upstream --streams "$streams" --events "$events" \
  --interval-ms "$interval" --lifetime "$LIFETIME"
wait_for "$last_group" 100 listening upstream || die "concurrency.py did not start: $(cat "$work/upstream.log")"
upstream="$url"

listen="$(free_port)"
admin="$(free_port)"
# The operator's render script (examples/envoy/render.sh) sets the addresses.
options=(--listen "127.0.0.1:$listen" --admin "127.0.0.1:$admin" --upstream "${upstream#http://}")
[[ -n "${CONCURRENCY_MAX_STREAMS:-}" ]] && options+=(--max-streams "$CONCURRENCY_MAX_STREAMS")
bash "$root/examples/envoy/render.sh" "$root/examples/envoy/dynamic-module.yaml" "${options[@]}" \
  >"$work/envoy.yaml" || die "cannot render the bootstrap"
ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$target/release" start envoy "$envoy_bin" --disable-hot-restart \
  --concurrency 2 --log-level warn -c "$work/envoy.yaml"
envoy_group="$last_group"
wait_for "$envoy_group" 300 envoy_ready "$admin" || die "Envoy did not get ready: $(tail -n 20 "$work/envoy.log")"
envoy_pid="$(ps -o pid= --ppid "$envoy_group" | tr -d ' ')"
log "ready in $((SECONDS - started)) s: upstream $upstream, Envoy $envoy_bin on 127.0.0.1:$listen (pid $envoy_pid), $(grep -c '# template: MAX_STREAMS' "$work/envoy.yaml") circuit-breaker thresholds at $(sed -n 's/.*max_connections: \([0-9]*\).*/\1/p' "$work/envoy.yaml")"

suite=$SECONDS
CLIENT_TIMEOUT=800 run_client "$streams concurrent streams" "$python" "$here/concurrency.py" client \
  --envoy "http://127.0.0.1:$listen" --streams "$streams" --events "$events"
log "the streams took $((SECONDS - suite)) s"

get() { "$python" -c "import urllib.request, sys; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())" "$1"; }
requests="$(get "$upstream/count" | "$python" -c 'import json, sys; print(json.load(sys.stdin)["requests"])')"
ok=0
((requests == streams)) && ok=1
count $ok "the upstream got exactly $requests requests of $streams"

stats="$(get "http://127.0.0.1:$admin/stats/prometheus")"
removed="$(grep -F 'envoy_dynamicmodulescustom_bypass_marker_frames_removed{annotation="x-bypass-remote-prefill"} ' <<<"$stats" | awk '{print $2}')"
ok=0
[[ "$removed" == "$streams" ]] && ok=1
count $ok "the module's counter: frames_removed{annotation=\"x-bypass-remote-prefill\"} is ${removed:-missing}, exactly $streams"

overflows="$(grep -E '^envoy_cluster_(upstream_rq_pending_overflow|upstream_cx_overflow)\{envoy_cluster_name="dynamo"\} ' <<<"$stats" || true)"
ok=0
[[ "$(wc -l <<<"$overflows")" == 2 ]] && ! awk '{print $2}' <<<"$overflows" | grep -qv '^0$' && ok=1
count $ok "no circuit breaker of the cluster overflowed: $(awk '{sub(/\{.*\}/, "", $1); printf "%s %s; ", $1, $2}' <<<"$overflows")"

rss="$(awk '/^VmHWM/ {print int($2 / 1024)}' "/proc/$envoy_pid/status" 2>/dev/null || echo '?')"
log "Envoy's peak RSS: $rss MB for $streams streams"

nothing_left
log "done in $((SECONDS - started)) s (the streams: $((SECONDS - suite)) s)"
echo "envoy concurrency: $passed passed, $failed failed"
((failed == 0 && passed > 0))

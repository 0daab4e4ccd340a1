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
# CONCURRENCY_FRONT=ext-proc puts `bypass-marker ext-proc` (release build, one thread) behind
# Envoy instead, with the shipped examples/envoy/ext-proc.yaml and an access log of ext_proc's
# per-message latencies: then it checks the processor's own frames_removed counter, prints Envoy's
# ext_proc message timeouts, and the answer times as p50, p99, p99.9, both as Envoy saw them and
# in the processor's bypass_marker_ext_proc_answer_seconds histogram (BENCHMARKS.md, "Answer
# times under a burst"):
#
#   CONCURRENCY_FRONT=ext-proc CONCURRENCY_STREAMS=1000 bash tests/envoy/concurrency.sh
#
# Envoy's default circuit breakers (1,024 connections, pending and active requests per cluster)
# fail this with 5,000 streams: try `CONCURRENCY_MAX_STREAMS=1024 bash tests/envoy/concurrency.sh`.
#
# Environment:
#   CONCURRENCY_STREAMS (default 5000), CONCURRENCY_EVENTS (100), CONCURRENCY_INTERVAL_MS (20)
#   CONCURRENCY_MAX_STREAMS   render.sh --max-streams (default: as shipped)
#   CONCURRENCY_FRONT   module (default) or ext-proc
#   CONCURRENCY_MESSAGE_TIMEOUT   ext-proc: Envoy's message_timeout (default: as shipped, 2s)
#   BYPASS_MARKER_BIN   ext-proc: the binary (default: built with `cargo build --release -p bypass-marker`)
#   ENVOY_CACHE, PYTHON (default python3), CARGO_TARGET_DIR
# Needs 2 x N + 200 open files per process (ulimit -n; raised to the hard limit here).
# Ends with `envoy concurrency: N passed, M failed`; exits non-zero if anything failed.
set -euo pipefail

SUITE="envoy concurrency" LIFETIME=900
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
events="${CONCURRENCY_EVENTS:-100}"
interval="${CONCURRENCY_INTERVAL_MS:-20}"
front="${CONCURRENCY_FRONT:-module}"
[[ "$front" == module || "$front" == ext-proc ]] || die "CONCURRENCY_FRONT: module or ext-proc, not $front"

# shellcheck source=tests/envoy/servers.sh
source "$here/servers.sh"
concurrent_streams "${CONCURRENCY_STREAMS:-5000}"

started=$SECONDS
install_envoy || die "cannot install Envoy $ENVOY_VERSION"
if [[ "$front" == module ]]; then
  build_module
else
  build_bypass_marker
fi

start upstream "$python" "$here/concurrency.py" upstream --streams "$streams" --events "$events" \
  --interval-ms "$interval" --lifetime "$LIFETIME"
wait_for "$last_group" 100 listening upstream || die "concurrency.py did not start: $(cat "$work/upstream.log")"
upstream="$url"

listen="$(free_port)"
admin="$(free_port)"
# The operator's render script (examples/envoy/render.sh) sets the addresses.
options=(--listen "127.0.0.1:$listen" --admin "127.0.0.1:$admin" --upstream "${upstream#http://}")
[[ -n "${CONCURRENCY_MAX_STREAMS:-}" ]] && options+=(--max-streams "$CONCURRENCY_MAX_STREAMS")
if [[ "$front" == module ]]; then
  bash "$root/examples/envoy/render.sh" "$root/examples/envoy/dynamic-module.yaml" "${options[@]}" \
    >"$work/envoy.yaml" || die "cannot render the bootstrap"
else
  processor_port="$(free_port)"
  metrics_port="$(free_port)"
  start processor "$bin" ext-proc --listen "127.0.0.1:$processor_port" \
    --metrics-listen "127.0.0.1:$metrics_port" --preset dynamo
  wait_for "$last_group" 100 accepts "$processor_port" || die "the processor did not start: $(cat "$work/processor.log")"
  bash "$root/examples/envoy/render.sh" "$root/examples/envoy/ext-proc.yaml" "${options[@]}" \
    --ext-proc "127.0.0.1:$processor_port" >"$work/envoy.yaml" || die "cannot render the bootstrap"
  # Envoy's own view of each answer: ext_proc's filter-state fields in a JSON access log.
  "$python" - "$work/envoy.yaml" "$work/access.log" "${CONCURRENCY_MESSAGE_TIMEOUT:-}" <<'PY' || die "cannot add the access log"
import sys, yaml
path, log, timeout = sys.argv[1:]
doc = yaml.safe_load(open(path))
hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
state = "%FILTER_STATE(envoy.filters.http.ext_proc:FIELD:{})%"
fields = ["request_header_latency_us", "response_header_latency_us", "response_body_max_latency_us",
          "response_body_call_count"]
hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
    "path": log,
    "log_format": {"json_format": dict({f: state.format(f) for f in fields}, status="%RESPONSE_CODE%")}}}]
if timeout:
    hcm["http_filters"][0]["typed_config"]["message_timeout"] = timeout
yaml.safe_dump(doc, open(path, "w"))
PY
fi
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
if [[ "$front" == module ]]; then
  removed="$(grep -F 'envoy_dynamicmodulescustom_bypass_marker_frames_removed{annotation="x-bypass-remote-prefill"} ' <<<"$stats" | awk '{print $2}')"
else
  removed="$(get "http://127.0.0.1:$metrics_port/metrics" | grep -F 'bypass_marker_frames_removed_total{front_door="ext-proc",annotation="x-bypass-remote-prefill"} ' | awk '{print $2}')"
fi
ok=0
[[ "$removed" == "$streams" ]] && ok=1
count $ok "the $front's counter: frames_removed{annotation=\"x-bypass-remote-prefill\"} is ${removed:-missing}, exactly $streams"
if [[ "$front" == ext-proc ]]; then
  log "Envoy's ext_proc stats: $(grep -E '^envoy_http_ext_proc_(message_timeouts|streams_failed|streams_started)\{' <<<"$stats" | sed 's/{[^}]*}//' | tr '\n' ' ')"
  "$python" "$here/concurrency.py" answer-times --access-log "$work/access.log" \
    --metrics "http://127.0.0.1:$metrics_port/metrics" >&2 || log "cannot read the answer times"
fi

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

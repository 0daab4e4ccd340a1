#!/usr/bin/env bash
# The soak: every front door at once, for minutes, with mixed traffic, on 127.0.0.1.
#
#   bash tests/soak/run.sh                                 # 5 minutes after a 30 s warm-up
#   BYPASS_MARKER_SOAK_SECS=1800 bash tests/soak/run.sh    # 30 minutes
#
# Starts one upstream (tests/envoy/upstream.py) and, in front of it at the same time:
#   - the sidecar, `bypass-marker proxy`;
#   - Envoy 1.40.0 (tests/envoy/install.sh) with `bypass-marker ext-proc` as its external processor,
#     from the shipped bootstrap examples/envoy/ext-proc.yaml;
#   - Envoy 1.40.0 with the dynamic module (libbypass_marker_envoy_module.so), from examples/envoy/dynamic-module.yaml;
# each with the Dynamo preset and a max-body of 64 KiB. Then tests/soak/driver.py sends each of
# them the same mix: streams of every annotation (clients that ask for nothing, opt in, try to
# force a router-owned marker), paced streams, clients that reset mid-stream, upstreams that reset
# mid-stream, slow readers, oversized and malformed request bodies, gzipped event streams. Every
# response is checked byte for byte. At the end, with the traffic stopped:
#   - every process's RSS is within max(4 MiB, 10 %) of its quiet state after the warm-up, each
#     Envoy's heap within max(2 MiB, 10 %), its open files within 2 per client + 4
#     (BENCHMARKS.md, "The soak", says why);
#   - the streams-in-flight and held-bytes gauges read 0: the sidecar's streams_active and
#     request_bytes_held, the processor's request_bytes_held and the gRPC streams Envoy has open
#     to it, each Envoy's active downstream requests, connections and upstream requests;
#   - every counter rose by what the driver sent: frames removed and forwarded per name, refusals
#     by status, encoded streams refused, the sidecar's upstream body errors, Envoy's requests and
#     4xx and 5xx answers; and no router-owned marker reached the upstream;
#   - no process is left behind.
# Ends with `soak: N passed, M failed` and the RSS at start, peak and end per process; exits
# non-zero if anything failed.
#
# Environment:
#   BYPASS_MARKER_SOAK_SECS         seconds of traffic after the warm-up (default 300)
#   BYPASS_MARKER_SOAK_WARMUP       seconds of warm-up (default 30)
#   BYPASS_MARKER_SOAK_CONCURRENCY  clients per front door (default 4)
#   BYPASS_MARKER_SOAK_SEED         the traffic's seed (default soak)
#   BYPASS_MARKER_SOAK_SUMMARY      write the figures here as JSON
#   BYPASS_MARKER_BIN               the bypass-marker binary (default: built by build_bypass_marker)
#   ENVOY_CACHE, PYTHON (default python3), CARGO_TARGET_DIR
set -euo pipefail

SUITE=soak
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
secs="${BYPASS_MARKER_SOAK_SECS:-300}"
warmup="${BYPASS_MARKER_SOAK_WARMUP:-30}"
concurrency="${BYPASS_MARKER_SOAK_CONCURRENCY:-4}"
seed="${BYPASS_MARKER_SOAK_SEED:-soak}"
MAX_BODY=65536 # as driver.py's MAX_BODY
# Every process started here stops by itself after this long, even if this script is killed
# without its trap.
LIFETIME=$((${secs%.*} + ${warmup%.*} + 600))
# shellcheck source=tests/support/preamble.sh
source "$here/../support/preamble.sh"

# shellcheck source=tests/envoy/servers.sh
source "$root/tests/envoy/servers.sh"
# The pid of the process a group leader (`timeout`, see start) runs.
child_of() { awk '{print $1}' "/proc/$1/task/$1/children" 2>/dev/null; }

# ---------------------------------------------------------------------------------------------
# Installs and builds

started=$SECONDS
install_envoy || die "cannot install Envoy $ENVOY_VERSION"
build_bypass_marker
build_module
module_dir="$target/release"
log "installs and builds ready in $((SECONDS - started)) s"

# ---------------------------------------------------------------------------------------------
# Servers

start upstream "$python" "$root/tests/envoy/upstream.py" --lifetime "$LIFETIME"
wait_for "$last_group" 100 listening upstream || die "upstream.py did not start: $(cat "$work/upstream.log")"
upstream="$url"
upstream_port="${upstream##*:}"

sidecar_metrics="$(free_port)"
start sidecar "$bin" proxy --upstream "$upstream" --listen 127.0.0.1:0 \
  --metrics-listen "127.0.0.1:$sidecar_metrics" --max-body "$MAX_BODY"
sidecar_group=$last_group
wait_for "$sidecar_group" 100 listening sidecar || die "the sidecar did not start: $(cat "$work/sidecar.log")"
sidecar="$url"

ext_proc_port="$(free_port)"
processor_metrics="$(free_port)"
start processor "$bin" ext-proc --listen "127.0.0.1:$ext_proc_port" --preset dynamo \
  --metrics-listen "127.0.0.1:$processor_metrics" --max-body "$MAX_BODY"
processor_group=$last_group
wait_for "$processor_group" 100 accepts "$ext_proc_port" ||
  die "the processor does not accept connections: $(cat "$work/processor.log")"

ext_proc_listen="$(free_port)"
ext_proc_admin="$(free_port)"
render_bootstrap "$root/examples/envoy/ext-proc.yaml" LISTEN_PORT="$ext_proc_listen" \
  ADMIN_PORT="$ext_proc_admin" UPSTREAM_PORT="$upstream_port" EXT_PROC_PORT="$ext_proc_port" \
  >"$work/envoy-ext-proc.yaml" || die "cannot render the processor's bootstrap"
start envoy-ext-proc "$envoy_bin" --disable-hot-restart --concurrency 1 --log-level warning \
  -c "$work/envoy-ext-proc.yaml"
envoy_ext_proc_group=$last_group
wait_for "$envoy_ext_proc_group" 300 envoy_ready "$ext_proc_admin" ||
  die "Envoy with the processor did not get ready: $(tail -n 20 "$work/envoy-ext-proc.log")"

module_listen="$(free_port)"
module_admin="$(free_port)"
render_bootstrap "$root/examples/envoy/dynamic-module.yaml" LISTEN_PORT="$module_listen" \
  ADMIN_PORT="$module_admin" UPSTREAM_PORT="$upstream_port" >"$work/envoy-module.yaml.in" ||
  die "cannot render the module's bootstrap"
# The module's max-body, as the other two doors'.
sed "s#value: '{\"preset\": \"dynamo\"}'#value: '{\"preset\": \"dynamo\", \"max-body\": $MAX_BODY}'#" \
  "$work/envoy-module.yaml.in" >"$work/envoy-module.yaml"
grep -q "\"max-body\": $MAX_BODY" "$work/envoy-module.yaml" ||
  die "the module's bootstrap has no filter_config to set max-body in"
ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$module_dir" start envoy-module "$envoy_bin" --disable-hot-restart \
  --concurrency 1 --log-level warning -c "$work/envoy-module.yaml"
envoy_module_group=$last_group
wait_for "$envoy_module_group" 300 envoy_ready "$module_admin" ||
  die "Envoy with the module did not get ready: $(tail -n 20 "$work/envoy-module.log")"

pids=()
for pair in "sidecar=$sidecar_group" "processor=$processor_group" \
  "envoy-ext-proc=$envoy_ext_proc_group" "envoy-module=$envoy_module_group"; do
  pid="$(child_of "${pair#*=}")"
  [[ -n "$pid" ]] || die "cannot find the pid of ${pair%%=*}"
  pids+=(--pid "${pair%%=*}=$pid")
done
log "the sidecar on $sidecar, Envoy with the processor on 127.0.0.1:$ext_proc_listen, Envoy with the module on 127.0.0.1:$module_listen, the upstream on $upstream"

# ---------------------------------------------------------------------------------------------
# The soak

CLIENT_TIMEOUT=$((${secs%.*} + ${warmup%.*} + 300))
summary="${BYPASS_MARKER_SOAK_SUMMARY:-$work/summary.json}"
soaked=$SECONDS
failed_before=$failed
run_client "the soak" "$python" -u "$here/driver.py" \
  --sidecar "$sidecar" --ext-proc "http://127.0.0.1:$ext_proc_listen" \
  --module "http://127.0.0.1:$module_listen" \
  --sidecar-metrics "http://127.0.0.1:$sidecar_metrics/metrics" \
  --processor-metrics "http://127.0.0.1:$processor_metrics/metrics" \
  --ext-proc-admin "http://127.0.0.1:$ext_proc_admin" --module-admin "http://127.0.0.1:$module_admin" \
  --upstream "$upstream" "${pids[@]}" --secs "$secs" --warmup "$warmup" \
  --concurrency "$concurrency" --seed "$seed" --summary "$summary"
# The figures (the driver's stderr, which run_client shows whole when it failed).
((failed == failed_before)) && sed -n '/^process /,$p' "$work/client.err" >&2
log "traffic and checks took $((SECONDS - soaked)) s"

# Every server still up after the soak (a crash between the driver's last check and here).
for group in "$sidecar_group" "$processor_group" "$envoy_ext_proc_group" "$envoy_module_group"; do
  kill -0 "$group" 2>/dev/null || count 0 "a server ended during the soak (group $group)"
done
if grep -Eh '\[critical\]|panicked' "$work"/envoy-*.log "$work/sidecar.log" "$work/processor.log"; then
  count 0 "no panic or critical line in the servers' logs"
else
  count 1 "no panic or critical line in the servers' logs"
fi
nothing_left

echo "soak: $passed passed, $failed failed"
((failed == 0 && passed > 0))

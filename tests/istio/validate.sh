#!/usr/bin/env bash
# Checks examples/istio/ offline against the CRDs of Istio 1.30.3 (WasmPlugin, TrafficExtension,
# EnvoyFilter), kept in tests/istio/schemas/ (structure only, extracted by
# tests/envoy-gateway/extract.py from the release's customresourcedefinitions.gen.yaml, istio/api
# v1.30.3): unknown fields refused, the CEL rules evaluated (the url rule through a port of Go's
# url.ParseRequestURI, as Kubernetes' isURL and url do), broken copies refused, the two examples
# and the dynamic module's config held to one another. tests/envoy-gateway/validate.py --suite
# istio, in the venv that tests/envoy-gateway/validate.sh keeps (jsonschema, cel-python from PyPI).
#
#   bash tests/istio/validate.sh
#
# Environment: EG_CACHE, PYTHON (as tests/envoy-gateway/validate.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."

bash tests/envoy-gateway/validate.sh istio

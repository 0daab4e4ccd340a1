#!/usr/bin/env bash
# Checks examples/istio/ offline against the CRDs of Istio 1.30.3 (WasmPlugin, TrafficExtension,
# EnvoyFilter), kept in tests/istio/schemas/ (structure only, extracted by
# tests/envoy-gateway/extract.py from the release's customresourcedefinitions.gen.yaml, istio/api
# v1.30.3), and the Gateway and HTTPRoute against Gateway API v1.5.1 and v1.6.1 (Istio 1.30's and,
# near enough, 1.31's v1.6.0; kept in tests/envoy-gateway/schemas/): unknown fields refused, the
# CEL rules evaluated (the url rule through a port of Go's url.ParseRequestURI, as Kubernetes'
# isURL and url do), broken copies refused, the three examples held to one another (Gateway,
# HTTPRoute, buffer limit, the plugin's extraStatTags) and to the module's config, image and copy
# of examples/envoy-gateway/dynamic-module.yaml. The ConfigMap (a core kind) is
# tests/k8s/validate.sh's; the module's filter in Envoy is tests/istio/module.sh's. tests/envoy-gateway/validate.py --suite
# istio, in the venv that tests/envoy-gateway/validate.sh keeps (jsonschema, cel-python from PyPI).
#
#   bash tests/istio/validate.sh
#
# Environment: EG_CACHE, PYTHON (as tests/envoy-gateway/validate.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."

bash tests/envoy-gateway/validate.sh istio

#!/usr/bin/env bash
# Checks examples/agentgateway/ offline against agentgateway v1.4.1's AgentgatewayPolicy CRD (kept
# in tests/agentgateway/schemas/, structure only, extracted by tests/envoy-gateway/extract.py) and
# Gateway API v1.6.1's Gateway and HTTPRoute (the release agentgateway v1.4.1 builds against,
# kept by tests/envoy-gateway/): unknown fields refused, the CEL rules evaluated, broken copies
# refused, the policy's processor held to examples/k8s/ext-proc.yaml's Service and to the
# FULL_DUPLEX_STREAMED settings the processor serves. tests/envoy-gateway/validate.py --suite
# agentgateway, in the venv that tests/envoy-gateway/validate.sh keeps. agentgateway itself is not
# run: no binary or image of it is reachable here.
#
#   bash tests/agentgateway/validate.sh
#
# Environment: EG_CACHE, PYTHON (as tests/envoy-gateway/validate.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."

bash tests/envoy-gateway/validate.sh agentgateway

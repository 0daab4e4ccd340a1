#!/usr/bin/env python3
"""Writes an Envoy bootstrap that carries what examples/istio/dynamic-module.yaml gives a Gateway's
istio-proxy, for tests/istio/module.sh to run in the real Envoy:

- the HTTP filter of the EnvoyFilter `bypass-marker-module`, inserted before the router as its
  patch says, taken from the file as written (its typed_config untouched);
- the listener fields of the EnvoyFilter `bypass-marker-buffer-limit` (a MERGE into the listener),
  and the connection manager's fields it merges (`stream_idle_timeout`, `request_timeout`);
- the stats settings Istio 1.30 writes into istio-proxy's bootstrap (istio/istio release-1.30,
  tools/packaging/common/envoy_bootstrap.json and pkg/bootstrap/config.go): Envoy's default tags
  off, and a stats matcher that keeps only the prefixes `reporter=`, `component`, `istio`, the
  required `cluster_manager`, `listener_manager`, `server`, `cluster.xds-grpc`, `wasm`, and those
  of the pod's proxy configuration (`proxy.istio.io/config`'s `proxyStatsMatcher.inclusionPrefixes`,
  or the deprecated `sidecar.istio.io/statsInclusionPrefixes` annotation, which wins when set; the
  Gateway's `infrastructure.annotations`), plus Istio's fixed suffixes and regex. With
  `--istio-defaults` they are left out, as for a Gateway without them.

The module's search path is the caller's (ENVOY_DYNAMIC_MODULES_SEARCH_PATH, as the Gateway's
Deployment patch sets it); `--print-copy` prints what the patch's init container copies (the file
name Envoy must find there) and the search path it names, and writes nothing else.

    python3 tests/istio/bootstrap.py --listen PORT --admin PORT --upstream PORT [--istio-defaults]
    python3 tests/istio/bootstrap.py --print-copy
"""

import argparse
import json
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
EXAMPLE = ROOT / "examples" / "istio" / "dynamic-module.yaml"

# Istio 1.30's stats matcher, but for the annotation's prefixes.
ISTIO_PREFIXES = ["reporter=", "cluster_manager", "listener_manager", "server", "cluster.xds-grpc", "wasm"]
ISTIO_FIXED_PREFIXES = ["component", "istio"]
ISTIO_SUFFIXES = ["rbac.allowed", "rbac.denied", "shadow_allowed", "shadow_denied"]
ISTIO_REGEXES = [r"vhost\..*\.route\..*"]


def documents():
    found = {}
    for doc in yaml.safe_load_all(EXAMPLE.read_text()):
        if doc:
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def one_patch(docs, name, apply_to, optional=False):
    found = [p for p in docs[("EnvoyFilter", name)]["spec"]["configPatches"] if p["applyTo"] == apply_to]
    if optional and not found:
        return None
    if len(found) != 1:
        sys.exit(f"bootstrap.py: EnvoyFilter {name} has {len(found)} patches applied to {apply_to}, not one")
    return found[0]


def gateway(docs):
    (found,) = [doc for (kind, _), doc in docs.items() if kind == "Gateway"]
    return found


def deployment_patch(docs):
    reference = gateway(docs)["spec"]["infrastructure"]["parametersRef"]
    return yaml.safe_load(docs[("ConfigMap", reference["name"])]["data"]["deployment"])


def print_copy(docs):
    pod = deployment_patch(docs)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (proxy,) = [c for c in pod["containers"] if c["name"] == "istio-proxy"]
    env = {e["name"]: e["value"] for e in proxy["env"]}
    print(pathlib.PurePosixPath(init["command"][-1]).name, env["ENVOY_DYNAMIC_MODULES_SEARCH_PATH"])


def bootstrap(docs, listen, admin, upstream, istio_defaults):
    module = one_patch(docs, "bypass-marker-module", "HTTP_FILTER")
    if module["patch"]["operation"] != "INSERT_BEFORE" or \
            module["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] != "envoy.filters.http.router":
        sys.exit("bootstrap.py: the module's patch is not an INSERT_BEFORE the router")
    merge = one_patch(docs, "bypass-marker-buffer-limit", "LISTENER")
    if merge["patch"]["operation"] != "MERGE":
        sys.exit("bootstrap.py: the buffer limit's patch is not a MERGE")
    # The connection manager's fields the same EnvoyFilter merges (stream_idle_timeout, request_timeout).
    hcm_merge = one_patch(docs, "bypass-marker-buffer-limit", "NETWORK_FILTER", optional=True)
    hcm_fields = {}
    if hcm_merge is not None:
        if hcm_merge["patch"]["operation"] != "MERGE" or \
                hcm_merge["match"]["listener"]["filterChain"]["filter"]["name"] != "envoy.filters.network.http_connection_manager":
            sys.exit("bootstrap.py: the network filter patch is not a MERGE into the connection manager")
        hcm_fields = {k: v for k, v in hcm_merge["patch"]["value"]["typed_config"].items() if k != "@type"}
    annotations = gateway(docs)["spec"]["infrastructure"].get("annotations", {})
    # As Istio's getStatsOptions: the (deprecated) annotation's prefixes if it is set, else those of
    # the proxy configuration's proxyStatsMatcher (`proxy.istio.io/config`).
    proxy_config = yaml.safe_load(annotations.get("proxy.istio.io/config") or "{}") or {}
    from_config = (proxy_config.get("proxyStatsMatcher") or {}).get("inclusionPrefixes") or []
    from_annotation = [p for p in annotations.get("sidecar.istio.io/statsInclusionPrefixes", "").split(",") if p]
    asked = [] if istio_defaults else (from_annotation or from_config)
    patterns = ([{"prefix": "reporter="}] + [{"prefix": p} for p in asked + ISTIO_PREFIXES[1:]]
                + [{"suffix": s} for s in ISTIO_SUFFIXES]
                + [{"safe_regex": {"regex": r}} for r in ISTIO_REGEXES]
                + [{"prefix": p} for p in ISTIO_FIXED_PREFIXES])
    router = {"name": "envoy.filters.http.router",
              "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    listener = {
        "name": "gateway",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "outbound_0.0.0.0_80",
                "route_config": {"name": "http.80", "virtual_hosts": [{
                    "name": "dynamo", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "dynamo", "timeout": "0s"}}]}]},
                "http_filters": [module["patch"]["value"], router],
                **hcm_fields,
            }}]}],
    }
    listener.update(merge["patch"]["value"])
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "stats_config": {"use_all_default_tags": False, "stats_matcher": {"inclusion_list": {"patterns": patterns}}},
        "static_resources": {
            "listeners": [listener],
            "clusters": [{
                "name": "dynamo", "type": "STATIC", "connect_timeout": "5s",
                "load_assignment": {"cluster_name": "dynamo", "endpoints": [{"lb_endpoints": [{"endpoint": {
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": upstream}}}}]}]},
            }],
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", type=int)
    parser.add_argument("--admin", type=int)
    parser.add_argument("--upstream", type=int)
    parser.add_argument("--istio-defaults", action="store_true")
    parser.add_argument("--print-copy", action="store_true")
    args = parser.parse_args()
    docs = documents()
    if args.print_copy:
        print_copy(docs)
        return 0
    if None in (args.listen, args.admin, args.upstream):
        parser.error("--listen, --admin and --upstream are required")
    json.dump(bootstrap(docs, args.listen, args.admin, args.upstream, args.istio_defaults), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

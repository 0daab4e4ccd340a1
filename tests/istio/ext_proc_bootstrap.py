#!/usr/bin/env python3
"""Writes an Envoy bootstrap that carries what examples/istio/ext-proc.yaml gives a Gateway's
istio-proxy, for tests/istio/ext_proc.sh to run in the real Envoy with the real processor:

- the HTTP filter of the EnvoyFilter `bypass-marker-ext-proc`, inserted before the router as its
  patch says, taken from the file as written (its typed_config untouched);
- the cluster the same EnvoyFilter ADDs, as written but for its address: the Service's DNS name
  (STRICT_DNS) becomes 127.0.0.1 and the processor's port (STATIC), nothing else;
- the listener fields of the EnvoyFilter `bypass-marker-buffer-limit` (a MERGE into the listener)
  and the connection manager's fields it merges (`stream_idle_timeout`, `request_timeout`), read
  with tests/istio/bootstrap.py's helpers.

Two virtual hosts stand for the HTTPRoute's backend: requests with `host: upstream` go to
--recorder (tests/envoy/upstream.py, which records what it receives), every other to --upstream
(the simulated router). Istio's own stats settings are tests/istio/module.sh's concern; the
processor's counters are in its own /metrics.

    python3 tests/istio/ext_proc_bootstrap.py --listen PORT --admin PORT --upstream PORT \\
        --recorder PORT --ext-proc PORT
"""

import argparse
import copy
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bootstrap as istio  # noqa: E402  (tests/istio/bootstrap.py: documents, one_patch)

istio.EXAMPLE = istio.ROOT / "examples" / "istio" / "ext-proc.yaml"


def static_cluster(name, port):
    return {"name": name, "type": "STATIC", "connect_timeout": "5s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


def bootstrap(docs, listen, admin, upstream, recorder, ext_proc):
    filter_patch = istio.one_patch(docs, "bypass-marker-ext-proc", "HTTP_FILTER")
    if filter_patch["patch"]["operation"] != "INSERT_BEFORE" or \
            filter_patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] != "envoy.filters.http.router":
        sys.exit("ext_proc_bootstrap.py: the processor's filter is not an INSERT_BEFORE the router")
    cluster_patch = istio.one_patch(docs, "bypass-marker-ext-proc", "CLUSTER")
    if cluster_patch["patch"]["operation"] != "ADD":
        sys.exit("ext_proc_bootstrap.py: the processor's cluster is not an ADD")
    processor = copy.deepcopy(cluster_patch["patch"]["value"])
    endpoints = [e for group in processor["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
    if len(endpoints) != 1:
        sys.exit(f"ext_proc_bootstrap.py: the processor's cluster has {len(endpoints)} endpoints, not one")
    address = endpoints[0]["endpoint"]["address"]["socket_address"]
    address.update(address="127.0.0.1", port_value=ext_proc)
    processor["type"] = "STATIC"
    merge = istio.one_patch(docs, "bypass-marker-buffer-limit", "LISTENER")
    hcm_merge = istio.one_patch(docs, "bypass-marker-buffer-limit", "NETWORK_FILTER")
    if merge["patch"]["operation"] != "MERGE" or hcm_merge["patch"]["operation"] != "MERGE":
        sys.exit("ext_proc_bootstrap.py: the buffer limit's patches are not MERGEs")
    hcm_fields = {k: v for k, v in hcm_merge["patch"]["value"]["typed_config"].items() if k != "@type"}
    router = {"name": "envoy.filters.http.router",
              "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
    route = {"timeout": "0s"}  # the HTTPRoute's timeouts.request: 0s
    listener = {
        "name": "gateway",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "outbound_0.0.0.0_80",
                "route_config": {"name": "http.80", "virtual_hosts": [
                    {"name": "recorder", "domains": ["upstream"],
                     "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "recorder", **route}}]},
                    {"name": "dynamo", "domains": ["*"],
                     "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "dynamo", **route}}]}]},
                "http_filters": [filter_patch["patch"]["value"], router],
                **hcm_fields,
            }}]}],
    }
    listener.update(merge["patch"]["value"])
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [listener],
            "clusters": [static_cluster("dynamo", upstream), static_cluster("recorder", recorder), processor],
        },
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("--listen", "--admin", "--upstream", "--recorder", "--ext-proc"):
        parser.add_argument(name, type=int, required=True)
    args = parser.parse_args()
    json.dump(bootstrap(istio.documents(), args.listen, args.admin, args.upstream, args.recorder, args.ext_proc),
              sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

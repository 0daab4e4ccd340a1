#!/usr/bin/env python3
"""The checks of tests/envoy-gateway/module_xds.sh: Envoy Gateway's xDS for the dynamic module
(tests/envoy-gateway/module-xds.yaml) in the real Envoy, with tests/envoy/upstream.py behind it.

  module_xds.py bootstrap --bootstrap FILE --example FILE
      the bootstrap's module filter is the one Envoy Gateway generates from the example's
      EnvoyProxy and EnvoyExtensionPolicy: disabled in the chain, loaded by local filename,
      named after the policy, its filter_config the policy's config as JSON, enabled per route
  module_xds.py routes --envoy URL --upstream URL --admin URL
      the route with the per-route enable runs the module; the route without it does not
  module_xds.py per-route --bootstrap FILE
      prints the rendered bootstrap FILE with a real per-route config for the module (a
      DynamicModuleFilterPerRoute in place of the empty FilterConfig), which Envoy must refuse

Prints a PASS or FAIL line per check; exits non-zero if any failed.
"""

import argparse
import http.client
import json
import pathlib
import re
import sys
import urllib.parse
import urllib.request
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "envoy"))
import script  # noqa: E402  (tests/envoy/script.py: the upstream's streams)

failures = 0
FILTER = "envoy.filters.http.dynamic_modules/envoyextensionpolicy/dynamo/bypass-marker/dynamic-module/0"
FORGED = ["x-bypass-remote-prefill", "X-Prefill-Continue:1", "request_id"]


def check(ok, name):
    global failures
    print(("PASS " if ok else "FAIL ") + name, flush=True)
    failures += not ok


def post(base, path, body, test_id=None, timeout=30):
    """(status, headers, body bytes) of a POST of JSON `body` to base+path."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    if test_id:
        headers["x-test-id"] = test_id
    conn.request("POST", path, body=json.dumps(body).encode(), headers=headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, response.headers, data


def get_json(url):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


def stat(admin, series):
    text = urllib.request.urlopen(admin + "/stats/prometheus", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return int(line.split()[1])
    return 0


def bootstrap(args):
    import yaml

    boot = yaml.safe_load(open(args.bootstrap))
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    docs = {d["kind"]: d for d in yaml.safe_load_all(open(args.example)) if d}
    proxy, policy = docs["EnvoyProxy"], docs["EnvoyExtensionPolicy"]
    (entry,) = policy["spec"]["dynamicModule"]
    registered = {m["name"]: m for m in proxy["spec"]["dynamicModules"]}[entry["name"]]
    meta = policy["metadata"]
    name = f"envoy.filters.http.dynamic_modules/envoyextensionpolicy/{meta['namespace']}/{meta['name']}/dynamic-module/0"
    check(name == FILTER, f"the filter's name is Envoy Gateway's for the example's policy: {name}")
    module = [f for f in filters if f["name"] == name]
    check(len(module) == 1 and module[0].get("disabled") is True,
          "the module's filter is in the listener's chain with disabled: true")
    if len(module) != 1:
        return
    typed = module[0]["typed_config"]
    source = typed["dynamic_module_config"]
    check(set(source) == {"module"} and set(source["module"]) == {"local"}
          and set(source["module"]["local"]) == {"filename"},
          "dynamic_module_config has module.local.filename only (no name, no search path)")
    check(source["module"]["local"]["filename"] == registered["source"]["local"]["path"],
          f"module.local.filename is the EnvoyProxy's source.local.path {registered['source']['local']['path']}")
    check(typed["filter_name"] == entry["filterName"], f"filter_name is the policy's filterName {entry['filterName']}")
    config = json.loads(typed["filter_config"]["value"])
    check(config == entry["config"], f"filter_config is the policy's config as JSON: {typed['filter_config']['value']}")
    check(filters[-1]["name"] == "envoy.filters.http.router", "the router is the chain's last filter")
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    enabled = [r for r in routes if FILTER in r.get("typed_per_filter_config", {})]
    check(len(enabled) == 1 and enabled[0]["typed_per_filter_config"][FILTER]
          == {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}},
          "one route enables it with an empty envoy.config.route.v3.FilterConfig")
    check(len(routes) == 2 and not routes[1].get("typed_per_filter_config"),
          "one route has no typed_per_filter_config")


def routes(args):
    guarded, unguarded = "/v1/chat/completions", "/unguarded/v1/chat/completions"
    paced = {"model": "m", "stream": True, "test": {"kind": "paced", "events": 3, "interval_ms": 20}}
    raw = b"".join(script.paced(3))
    expected = script.paced_expected(3)
    removed = 'envoy_dynamicmodulescustom_bypass_marker_frames_removed{annotation="x-bypass-remote-prefill"}'

    # The upstream's own bytes: the control.
    status, _, direct = post(args.upstream, "/v1/chat/completions", paced)
    check(status == 200 and direct == raw and script.MARKER in direct,
          f"straight to the upstream: the marker is in the stream ({len(direct)} bytes)")

    before = stat(args.admin, removed)
    status, headers, body = post(args.envoy, guarded, paced)
    check(status == 200 and body == expected and script.MARKER not in body,
          f"{guarded} (enabled per route): the stream arrives without the marker, every other byte kept "
          f"(status {status}, {len(body)} bytes, expected {len(expected)})")
    after = stat(args.admin, removed)
    check(after - before == 3, f"{guarded}: the module counted 3 removed marker frames ({before} -> {after})")

    test_id = f"xds-guarded-{uuid.uuid4().hex}"
    status, _, _ = post(args.envoy, guarded, {"model": "m", "nvext": {"annotations": FORGED}}, test_id)
    seen = get_json(f"{args.upstream}/seen?test_id={test_id}")["body"]
    check(status == 200 and seen == {"model": "m", "nvext": {"annotations": ["request_id"]}},
          f"{guarded}: the forged router-owned names are stripped before the upstream (status {status}, "
          f"upstream got {json.dumps(seen)})")

    status, headers, body = post(args.envoy, unguarded, paced)
    check(status == 200 and body == direct,
          f"{unguarded} (no per-route enable): the stream passes byte for byte, marker included "
          f"(status {status}, {len(body)} bytes)")
    check(stat(args.admin, removed) == after, f"{unguarded}: the module counted nothing (it does not run)")

    test_id = f"xds-unguarded-{uuid.uuid4().hex}"
    sent = {"model": "m", "nvext": {"annotations": FORGED}}
    status, _, _ = post(args.envoy, unguarded, sent, test_id)
    seen = get_json(f"{args.upstream}/seen?test_id={test_id}")
    check(status == 200 and seen["body"] == sent and seen["raw"] == json.dumps(sent),
          f"{unguarded}: the forged names reach the upstream as sent (the module does not run: "
          f"the route is unguarded)")


def per_route(args):
    text = open(args.bootstrap).read()
    empty = (
        '"@type": type.googleapis.com/envoy.config.route.v3.FilterConfig\n'
        "                    config: {}\n"
    )
    assert text.count(empty) == 1, "the bootstrap's empty FilterConfig is not where it was"
    module = re.search(r"filename: (\S+)", text).group(1)
    pad = " " * 20
    sys.stdout.write(text.replace(empty, (
        '"@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilterPerRoute\n'
        f"{pad}dynamic_module_config: {{module: {{local: {{filename: {module}}}}}}}\n"
        f"{pad}filter_name: bypass_marker\n"
        f"{pad}filter_config: {{'@type': type.googleapis.com/google.protobuf.StringValue, value: '{{}}'}}\n"
    )))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bootstrap")
    b.add_argument("--bootstrap", required=True)
    b.add_argument("--example", required=True)
    r = sub.add_parser("routes")
    r.add_argument("--envoy", required=True)
    r.add_argument("--upstream", required=True)
    r.add_argument("--admin", required=True)
    p = sub.add_parser("per-route")
    p.add_argument("--bootstrap", required=True)
    args = parser.parse_args()
    {"bootstrap": bootstrap, "routes": routes, "per-route": per_route}[args.command](args)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Extracts the structure of released CRDs into tests/envoy-gateway/schemas/, for validate.py.

Keeps what validation needs (field names, types, formats, enums, patterns, bounds, defaults,
required fields, `x-kubernetes-*` markers and the CEL rules of `x-kubernetes-validations`) and
strips the prose (`description`, `example`), so the files are small and nothing in them is copied
documentation. Each output file names its source: repository, tag, commit and path.

Run by hand when a new release is to be checked, from clones of the two repositories (no
network needed in CI: the output is committed):

    python3 tests/envoy-gateway/extract.py --refresh \
        --envoy-gateway /path/to/envoyproxy/gateway --gateway-api /path/to/kubernetes-sigs/gateway-api

Without --refresh it checks that the committed files are what the clones give (exit 1 if not).
"""

import argparse
import json
import pathlib
import subprocess
import sys

import yaml

HERE = pathlib.Path(__file__).resolve().parent
SCHEMAS = HERE / "schemas"

# (folder, repository, tag, [paths]): the CRDs of the kinds examples/envoy-gateway/ uses.
EG_PATH = "charts/gateway-helm/charts/crds/crds/generated/gateway.envoyproxy.io_{}.yaml"
EG_KINDS = ["envoyproxies", "clienttrafficpolicies", "backendtrafficpolicies", "envoyextensionpolicies"]
GW_PATH = "config/crd/standard/gateway.networking.k8s.io_{}.yaml"
GW_KINDS = ["gateways", "httproutes"]
SOURCES = [
    # Envoy Gateway v1.8.3 bundles Gateway API v1.5.1 (its gatewayapi-crds.yaml says so), v1.9.0
    # bundles v1.6.1: each is checked against the Gateway API it ships with (standard channel).
    ("envoy-gateway-v1.8.3", "envoyproxy/gateway", "v1.8.3", [EG_PATH.format(k) for k in EG_KINDS]),
    ("envoy-gateway-v1.9.0", "envoyproxy/gateway", "v1.9.0", [EG_PATH.format(k) for k in EG_KINDS]),
    ("gateway-api-v1.5.1", "kubernetes-sigs/gateway-api", "v1.5.1", [GW_PATH.format(k) for k in GW_KINDS]),
    ("gateway-api-v1.6.1", "kubernetes-sigs/gateway-api", "v1.6.1", [GW_PATH.format(k) for k in GW_KINDS]),
]

# Keys of a schema node whose values are schema nodes (or maps/lists of them).
NODE_MAPS = ("properties", "patternProperties", "definitions")
NODE_ONE = ("items", "additionalProperties", "not")
NODE_LIST = ("anyOf", "allOf", "oneOf")
PROSE = ("description", "example", "examples", "title")


def strip(node):
    """A copy of schema node `node` without its prose, recursively (property names untouched)."""
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in PROSE:
            continue
        if key in NODE_MAPS:
            out[key] = {name: strip(child) for name, child in value.items()}
        elif key in NODE_ONE and isinstance(value, dict):
            out[key] = strip(value)
        elif key in NODE_LIST:
            out[key] = [strip(child) for child in value]
        else:
            out[key] = value
    return out


def extract(git_dir, repo, tag, path):
    commit = subprocess.run(["git", "-C", git_dir, "rev-parse", tag + "^{commit}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    text = subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout
    docs = [d for d in yaml.safe_load_all(text) if d]
    if len(docs) != 1 or docs[0].get("kind") != "CustomResourceDefinition":
        sys.exit(f"extract: {repo}@{tag}:{path} is not one CustomResourceDefinition")
    crd = docs[0]
    spec = crd["spec"]
    return {
        "source": {"repository": repo, "tag": tag, "commit": commit, "path": path,
                   "note": "structure only: descriptions stripped by tests/envoy-gateway/extract.py"},
        "group": spec["group"],
        "kind": spec["names"]["kind"],
        "versions": {v["name"]: strip(v["schema"]["openAPIV3Schema"]) for v in spec["versions"]
                     if v.get("served", True)},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envoy-gateway", required=True, help="a clone of envoyproxy/gateway (its tags)")
    parser.add_argument("--gateway-api", required=True, help="a clone of kubernetes-sigs/gateway-api")
    parser.add_argument("--refresh", action="store_true", help="write the files (default: compare)")
    args = parser.parse_args()
    clones = {"envoyproxy/gateway": args.envoy_gateway, "kubernetes-sigs/gateway-api": args.gateway_api}
    stale = 0
    for folder, repo, tag, paths in SOURCES:
        for path in paths:
            data = extract(clones[repo], repo, tag, path)
            out = SCHEMAS / folder / (data["kind"] + ".json")
            text = json.dumps(data, indent=1, sort_keys=True) + "\n"
            if args.refresh:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(text)
                print(f"extract: {out.relative_to(HERE)} ({len(text)} bytes) from {repo}@{tag}:{path}")
            elif not out.exists() or out.read_text() != text:
                print(f"extract: {out.relative_to(HERE)} differs from {repo}@{tag}:{path}")
                stale += 1
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

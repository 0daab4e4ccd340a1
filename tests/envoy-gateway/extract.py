#!/usr/bin/env python3
"""Extracts the structure of CRDs into tests/envoy-gateway/schemas/, tests/dynamo-operator/schemas/,
tests/istio/schemas/ and tests/agentgateway/schemas/, for validate.py.

Keeps what validation needs (field names, types, formats, enums, patterns, bounds, defaults,
required fields, `x-kubernetes-*` markers and the CEL rules of `x-kubernetes-validations`) and
strips the prose (`description`, `example`), so the files are small and nothing in them is copied
documentation. Each output file names its source: repository, commit, path, and the tag, or for a
plain commit its date and why that commit.

Run by hand when a new release is to be checked, from clones of the repositories (a work tree or a
bare git directory; no network needed in CI: the output is committed). Only the sources of the
repositories given are extracted:

    python3 tests/envoy-gateway/extract.py --refresh \
        --envoy-gateway /path/to/envoyproxy/gateway --gateway-api /path/to/kubernetes-sigs/gateway-api \
        --dynamo /path/to/ai-dynamo/dynamo.git --agentgateway /path/to/agentgateway/agentgateway \
        --istio /path/to/istio-1.30.3/customresourcedefinitions.gen.yaml

Istio publishes every CRD of a release in one file (istio/api, kubernetes/customresourcedefinitions.gen.yaml):
--istio takes that file as released (a copy of the tag's, e.g. ../shared/crds/istio-1.30.3/), or a
clone of istio/api holding the tag.

Without --refresh it checks that the committed files are what the clones give (exit 1 if not).
"""

import argparse
import json
import pathlib
import subprocess
import sys

import yaml

HERE = pathlib.Path(__file__).resolve().parent
TESTS = HERE.parent
SCHEMAS = HERE / "schemas"
DYNAMO_SCHEMAS = TESTS / "dynamo-operator" / "schemas"
ISTIO_SCHEMAS = TESTS / "istio" / "schemas"
AGENTGATEWAY_SCHEMAS = TESTS / "agentgateway" / "schemas"

# (schemas folder, folder, repository, tag or commit, [paths], note): the CRDs of the kinds
# examples/envoy-gateway/ and examples/dynamo-operator/ use.
EG_PATH = "charts/gateway-helm/charts/crds/crds/generated/gateway.envoyproxy.io_{}.yaml"
EG_KINDS = ["envoyproxies", "clienttrafficpolicies", "backendtrafficpolicies", "envoyextensionpolicies"]
GW_PATH = "config/crd/standard/gateway.networking.k8s.io_{}.yaml"
GW_KINDS = ["gateways", "httproutes"]
SOURCES = [
    # Envoy Gateway v1.8.3 bundles Gateway API v1.5.1 (its gatewayapi-crds.yaml says so), v1.9.0
    # bundles v1.6.1: each is checked against the Gateway API it ships with (standard channel).
    (SCHEMAS, "envoy-gateway-v1.8.3", "envoyproxy/gateway", "v1.8.3", [EG_PATH.format(k) for k in EG_KINDS], None),
    (SCHEMAS, "envoy-gateway-v1.9.0", "envoyproxy/gateway", "v1.9.0", [EG_PATH.format(k) for k in EG_KINDS], None),
    (SCHEMAS, "gateway-api-v1.5.1", "kubernetes-sigs/gateway-api", "v1.5.1", [GW_PATH.format(k) for k in GW_KINDS], None),
    (SCHEMAS, "gateway-api-v1.6.1", "kubernetes-sigs/gateway-api", "v1.6.1", [GW_PATH.format(k) for k in GW_KINDS], None),
    # The DynamoGraphDeployment CRD of Dynamo 1.6.1 could not be had where this was written (no
    # route to github.com, the repository too large to mirror whole, no 1.6.1 source on PyPI): the
    # newest whole copy reachable was this main commit, whose Cargo.toml still says 1.5.0.
    (DYNAMO_SCHEMAS, "dynamo-main-2026-08-21", "ai-dynamo/dynamo", "2a6da14c83617f5412caba5777dbf0e2399e9c5f",
     ["deploy/operator/config/crd/bases/nvidia.com_dynamographdeployments.yaml"],
     "main before the 1.6 release (version 1.5.0 in its Cargo.toml), standing in for the 1.6.1 tag's "
     "file, which could not be fetched here"),
    # agentgateway v1.4.1 (it builds against Gateway API v1.6.1): the policy that attaches an
    # ext_proc processor.
    (AGENTGATEWAY_SCHEMAS, "agentgateway-v1.4.1", "agentgateway/agentgateway", "v1.4.1",
     ["controller/install/helm/agentgateway-crds/templates/agentgateway.dev_agentgatewaypolicies.yaml"], None),
]

# Istio's CRDs of a release, all in one file of istio/api: (schemas folder, folder, repository,
# tag, commit, path, [kinds]). The kinds examples/istio/ uses.
ISTIO_SOURCES = [
    (ISTIO_SCHEMAS, "istio-1.30.3", "istio/api", "v1.30.3", "2e43f07b30b6744bc8252fce39fb58b03f85ff8b",
     "kubernetes/customresourcedefinitions.gen.yaml", ["WasmPlugin", "TrafficExtension", "EnvoyFilter"]),
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


def git(clone, *args):
    """The output of `git args` in `clone`, a work tree or a (bare) git directory."""
    git_dir = pathlib.Path(clone) / ".git"
    git_dir = git_dir if git_dir.exists() else pathlib.Path(clone)
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True,
                          capture_output=True, text=True).stdout


NOTE = "structure only: descriptions stripped by tests/envoy-gateway/extract.py"


def structure(crd, source):
    """The kept structure of CustomResourceDefinition `crd`, naming `source`."""
    spec = crd["spec"]
    return {
        "source": source,
        "group": spec["group"],
        "kind": spec["names"]["kind"],
        "versions": {v["name"]: strip(v["schema"]["openAPIV3Schema"]) for v in spec["versions"]
                     if v.get("served", True)},
    }


def extract(clone, repo, ref, path, why=None):
    """The kept structure of the CRD at `path` in `ref` (a tag, or a commit) of `clone`."""
    commit = git(clone, "rev-parse", "--verify", ref + "^{commit}").strip()
    text = git(clone, "show", f"{commit}:{path}")
    docs = [d for d in yaml.safe_load_all(text) if d]
    if len(docs) != 1 or docs[0].get("kind") != "CustomResourceDefinition":
        sys.exit(f"extract: {repo}@{ref}:{path} is not one CustomResourceDefinition")
    note = NOTE
    if commit.startswith(ref.lower()):
        # A plain commit: its date says how old it is, the note why it was taken.
        source = {"repository": repo, "commit": commit, "date": git(clone, "show", "-s", "--format=%cs", commit).strip(),
                  "path": path, "note": f"{note}; {why}" if why else note}
    else:
        source = {"repository": repo, "tag": ref, "commit": commit, "path": path, "note": note}
    return structure(docs[0], source)


def extract_bundle(given, repo, tag, commit, path, kinds):
    """The kept structures of `kinds` from a file of many CRDs: `given` is that file as released,
    or a clone of `repo` holding `tag` (which must be `commit`)."""
    given = pathlib.Path(given)
    if given.is_file():
        text = given.read_text()
    else:
        found = git(given, "rev-parse", "--verify", tag + "^{commit}").strip()
        if found != commit:
            sys.exit(f"extract: {repo}@{tag} is {found} in {given}, not {commit}")
        text = git(given, "show", f"{commit}:{path}")
    crds = {d["spec"]["names"]["kind"]: d for d in yaml.safe_load_all(text)
            if d and d.get("kind") == "CustomResourceDefinition"}
    missing = [kind for kind in kinds if kind not in crds]
    if missing:
        sys.exit(f"extract: no CRD of {', '.join(missing)} in {given}")
    source = {"repository": repo, "tag": tag, "commit": commit, "path": path, "note": NOTE}
    return [structure(crds[kind], source) for kind in kinds]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envoy-gateway", help="a clone of envoyproxy/gateway (its tags)")
    parser.add_argument("--gateway-api", help="a clone of kubernetes-sigs/gateway-api (its tags)")
    parser.add_argument("--dynamo", help="a clone or git directory of ai-dynamo/dynamo holding the commit")
    parser.add_argument("--istio", help="Istio's customresourcedefinitions.gen.yaml as released, or a clone of istio/api")
    parser.add_argument("--agentgateway", help="a clone or git directory of agentgateway/agentgateway (its tags)")
    parser.add_argument("--refresh", action="store_true", help="write the files (default: compare)")
    args = parser.parse_args()
    clones = {"envoyproxy/gateway": args.envoy_gateway, "kubernetes-sigs/gateway-api": args.gateway_api,
              "ai-dynamo/dynamo": args.dynamo, "istio/api": args.istio, "agentgateway/agentgateway": args.agentgateway}
    if not any(clones.values()):
        parser.error("give at least one of --envoy-gateway, --gateway-api, --dynamo, --istio, --agentgateway")
    found = []  # (schemas folder, folder, what it is from, data)
    for schemas, folder, repo, ref, paths, why in SOURCES:
        if clones[repo]:
            found += [(schemas, folder, f"{repo}@{ref}:{path}", extract(clones[repo], repo, ref, path, why))
                      for path in paths]
    for schemas, folder, repo, tag, commit, path, kinds in ISTIO_SOURCES:
        if clones[repo]:
            found += [(schemas, folder, f"{repo}@{tag}:{path}", data)
                      for data in extract_bundle(clones[repo], repo, tag, commit, path, kinds)]
    stale = 0
    for schemas, folder, origin, data in found:
        out = schemas / folder / (data["kind"] + ".json")
        shown = out.relative_to(TESTS)
        text = json.dumps(data, indent=1, sort_keys=True) + "\n"
        if args.refresh:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            print(f"extract: {shown} ({len(text)} bytes) from {origin}")
        elif not out.exists() or out.read_text() != text:
            print(f"extract: {shown} differs from {origin}")
            stale += 1
        else:
            print(f"extract: {shown} is what {origin} gives")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

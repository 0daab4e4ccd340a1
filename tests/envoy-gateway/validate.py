#!/usr/bin/env python3
"""Validates the custom resources under examples/envoy-gateway/ (and any files given) against the
CRD structures in tests/envoy-gateway/schemas/ (extract.py), offline, the way the API server
would on create:

1. the CRD's defaults are applied;
2. the OpenAPI schema is checked with `jsonschema` (PyPI), strict: a field the CRD does not
   declare is refused (structural schemas prune it; an operator's typo would be lost silently);
3. the CEL rules (`x-kubernetes-validations`) on every node the document reaches are evaluated
   with `cel-python` (PyPI, `celpy`). Transition rules (`oldSelf`) do not apply on create. A rule
   that calls a function of Kubernetes' CEL library that celpy does not have cannot be checked:
   such rules are printed, and the set must equal tests/envoy-gateway/unchecked.txt, so a new
   one cannot go unnoticed.

Each document is checked against every release in RELEASES; all must accept it.

    python3 tests/envoy-gateway/validate.py [FILE.yaml ...]      # default examples/envoy-gateway/*.yaml
    python3 tests/envoy-gateway/validate.py --self-test          # broken copies must be refused

Exit status 0 only if every document passes against every release.
"""

import copy
import json
import pathlib
import re
import sys

import celpy
import celpy.evaluation
import jsonschema
import yaml

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SCHEMAS = HERE / "schemas"
UNCHECKED = HERE / "unchecked.txt"

# Each Envoy Gateway release with the Gateway API release it bundles.
RELEASES = [
    ("Envoy Gateway v1.8.3 + Gateway API v1.5.1", ["envoy-gateway-v1.8.3", "gateway-api-v1.5.1"]),
    ("Envoy Gateway v1.9.0 + Gateway API v1.6.1", ["envoy-gateway-v1.9.0", "gateway-api-v1.6.1"]),
]

# metadata is `type: object` in a CRD; the API server checks it as an ObjectMeta. The fields an
# example may set, strictly.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": DNS1123_SUBDOMAIN},
        "namespace": {"type": "string", "maxLength": 63, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}

SCALAR_KEYS = ("enum", "pattern", "minLength", "maxLength", "minItems", "maxItems", "uniqueItems",
               "minProperties", "maxProperties", "multipleOf", "required", "format")


def to_json_schema(node):
    """The JSON Schema (draft 2020-12) of OpenAPI v3 structural schema `node`, unknown fields refused."""
    out = {}
    if node.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    elif "type" in node:
        out["type"] = [node["type"], "null"] if node.get("nullable") else node["type"]
    for key in SCALAR_KEYS:
        if key in node:
            out[key] = node[key]
    # OpenAPI 3.0's boolean exclusiveMinimum/Maximum.
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if bound in node:
            out[exclusive if node.get(exclusive) else bound] = node[bound]
    if "properties" in node:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(node["additionalProperties"])
    elif "additionalProperties" in node:
        out["additionalProperties"] = node["additionalProperties"]
    elif "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if "items" in node:
        out["items"] = to_json_schema(node["items"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out.setdefault("allOf", []).append({key: [to_json_schema(n) for n in node[key]]})
    if "not" in node:
        out["not"] = to_json_schema(node["not"])
    return out


def apply_defaults(node, value):
    """Sets the schema's defaults in `value` (in place), as the API server does before validating."""
    if isinstance(value, dict):
        for name, child in node.get("properties", {}).items():
            if name not in value and "default" in child:
                value[name] = copy.deepcopy(child["default"])
            if name in value:
                apply_defaults(child, value[name])
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            for name in value:
                if name not in node.get("properties", {}):
                    apply_defaults(extra, value[name])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            apply_defaults(node["items"], item)


class Rules:
    """The CEL rules reached by the documents: evaluated, failed, or not checkable with celpy."""

    def __init__(self):
        self.env = celpy.Environment()
        self.programs = {}
        self.checked = 0
        self.unchecked = set()  # (kind, path, rule, reason)

    def program(self, rule):
        if rule not in self.programs:
            self.programs[rule] = self.env.program(self.env.compile(rule))
        return self.programs[rule]

    def walk(self, kind, node, value, path, errors):
        """Evaluates every rule of `node` and its children on `value`; appends failures to `errors`."""
        for validation in node.get("x-kubernetes-validations", []):
            rule = validation["rule"]
            if re.search(r"\boldSelf\b", rule):
                continue  # a transition rule: no old object on create
            try:
                result = self.program(rule).evaluate({"self": celpy.json_to_cel(value)})
            except celpy.CELEvalError as error:
                result = error
            if isinstance(result, celpy.CELEvalError):
                reason = str(result.args[0]) if result.args else repr(result)
                missing = re.match(r"undeclared reference to '(\w+)'", reason)
                if missing:
                    self.unchecked.add((kind, schema_path(path), rule, f"celpy has no {missing.group(1)}()"))
                    continue
                errors.append(f"{path}: CEL rule {rule!r} fails to evaluate: {reason[:200]}")
                continue
            self.checked += 1
            if result is not True and not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
                message = validation.get("message") or validation.get("messageExpression") or rule
                errors.append(f"{path}: CEL rule {rule!r} refuses it: {message}")
        if isinstance(value, dict):
            props = node.get("properties", {})
            for name, child in value.items():
                if name in props:
                    self.walk(kind, props[name], child, f"{path}.{name}", errors)
                elif isinstance(node.get("additionalProperties"), dict):
                    self.walk(kind, node["additionalProperties"], child, f"{path}[{name!r}]", errors)
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            for index, item in enumerate(value):
                self.walk(kind, node["items"], item, f"{path}[{index}]", errors)
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in node.get(key, []):
                if sub.get("x-kubernetes-validations"):
                    self.walk(kind, sub, value, path, errors)


def schema_path(path):
    """`spec.listeners[0]` -> `spec.listeners[]`: the place in the schema, not in the document."""
    return re.sub(r"\[\d+\]", "[]", path)


def load_release(folders):
    crds = {}
    for folder in folders:
        for file in sorted((SCHEMAS / folder).glob("*.json")):
            data = json.loads(file.read_text())
            for version, schema in data["versions"].items():
                crds[(f"{data['group']}/{version}", data["kind"])] = (schema, data["source"])
    return crds


def check_document(doc, crds, rules):
    """The errors of one document against one release (empty if it passes)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in crds:
        return [f"no CRD for apiVersion {key[0]} kind {key[1]} in this release"]
    schema, _ = crds[key]
    schema = copy.deepcopy(schema)
    schema["properties"]["metadata"] = {}
    doc = copy.deepcopy(doc)
    apply_defaults(schema, doc)
    json_schema = to_json_schema(schema)
    json_schema["properties"]["metadata"] = OBJECT_META
    validator = jsonschema.Draft202012Validator(json_schema)
    errors = [f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message[:300]}"
              for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]
    if not errors:
        rules.walk(doc["kind"], schema, doc, doc["kind"], errors)
    return errors


def documents(files):
    for file in files:
        path = pathlib.Path(file).resolve()
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                yield f"{shown} #{index + 1} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}", doc


def validate(files, quiet=False):
    """(number of failures, Rules) for `files` against every release."""
    rules = Rules()
    failures = 0
    for release, folders in RELEASES:
        crds = load_release(folders)
        for name, doc in documents(files):
            errors = check_document(doc, crds, rules)
            failures += bool(errors)
            if not quiet:
                print(f"envoy-gateway: {'FAIL' if errors else 'ok  '} {name} against {release}")
            for error in errors:
                print(f"envoy-gateway:   {error}")
    return failures, rules


def self_test(files):
    """Broken copies of the examples must be refused: each mutation names what it breaks."""
    docs = [doc for _, doc in documents(files)]
    by_kind = {doc["kind"]: doc for doc in docs}

    def mutated(kind, change):
        doc = copy.deepcopy(by_kind[kind])
        change(doc)
        return doc

    cases = [
        ("an unknown field in spec", mutated("ClientTrafficPolicy", lambda d: d["spec"].update(bufferLimit="33Mi"))),
        ("an unknown field deep down", mutated("EnvoyProxy", lambda d: d["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"].update(volumeMount=[]))),
        ("a string where an integer goes", mutated("BackendTrafficPolicy", lambda d: d["spec"]["circuitBreaker"].update(maxConnections="many"))),
        ("a value outside an enum", mutated("EnvoyProxy", lambda d: d["spec"]["dynamicModules"][0]["source"].update(type="Image"))),
        ("a module name against its pattern", mutated("EnvoyProxy", lambda d: d["spec"]["dynamicModules"][0].update(name="Bypass_Marker"))),
        ("a CEL rule: a Local source without local", mutated("EnvoyProxy", lambda d: d["spec"]["dynamicModules"][0]["source"].pop("local"))),
        ("a CEL rule: a policy targeting nothing", mutated("EnvoyExtensionPolicy", lambda d: d["spec"].pop("targetRefs"))),
        ("a missing required field", mutated("HTTPRoute", lambda d: d["spec"]["rules"][0]["backendRefs"][0].pop("name"))),
        ("a bad metadata name", mutated("Gateway", lambda d: d["metadata"].update(name="Dynamo_Gateway"))),
    ]
    missed = 0
    for release, folders in RELEASES:
        crds = load_release(folders)
        for what, doc in cases:
            errors = check_document(doc, crds, Rules())
            print(f"envoy-gateway: self-test {'ok  ' if errors else 'MISS'} {what} ({release}): {errors[0] if errors else 'accepted'}")
            missed += not errors
    return missed


# CEL functions and macros celpy evaluates (its standard library); a rule calling anything else
# (Kubernetes' extensions: split, upperAscii, isURL, quantity, ...) cannot be checked here.
CELPY_FUNCTIONS = set(celpy.evaluation.base_functions) | {
    "has", "all", "exists", "exists_one", "map", "filter"}


def unsupported_rules():
    """Every CEL rule in the kept CRDs that calls a function celpy lacks: `release kind path rule`."""
    found = set()

    def walk(node, path, where):
        if not isinstance(node, dict):
            return
        for validation in node.get("x-kubernetes-validations", []):
            rule = validation["rule"]
            calls = set(re.findall(r"([A-Za-z_]\w*)\s*\(", re.sub(r"'[^']*'|\"[^\"]*\"", "", rule)))
            missing = sorted(calls - CELPY_FUNCTIONS)
            if missing:
                found.add(f"{where}\t{path}\t{rule.strip()}\tcelpy has no {', '.join(missing)}")
        for name, child in node.get("properties", {}).items():
            walk(child, f"{path}.{name}", where)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], path + ("[]" if key == "items" else "[*]"), where)
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in node.get(key, []):
                walk(sub, path, where)

    for folder in sorted(p.name for p in SCHEMAS.iterdir() if p.is_dir()):
        for file in sorted((SCHEMAS / folder).glob("*.json")):
            data = json.loads(file.read_text())
            for version, schema in data["versions"].items():
                walk(schema, data["kind"], f"{folder}\t{version}")
    return sorted(found)


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    files = args or sorted(str(p) for p in (ROOT / "examples" / "envoy-gateway").glob("*.yaml"))
    if "--self-test" in argv:
        missed = self_test(files)
        print(f"envoy-gateway: self-test: {missed} broken documents accepted")
        return 1 if missed else 0
    if "--write-unchecked" in argv:
        UNCHECKED.write_text("# The CEL rules of the kept CRDs that celpy cannot evaluate (validate.py --write-unchecked):\n"
                             "# folder\tversion\tpath\trule\treason. None is reached by examples/envoy-gateway/.\n"
                             + "".join(line + "\n" for line in unsupported_rules()))
        return 0
    failures, rules = validate(files)
    stale = False
    listed = [l for l in UNCHECKED.read_text().splitlines() if l and not l.startswith("#")]
    if listed != unsupported_rules():
        print(f"envoy-gateway: {UNCHECKED.relative_to(ROOT)} is not the list of the kept CRDs' rules celpy "
              "cannot evaluate: run validate.py --write-unchecked and read the new ones")
        stale = True
    for kind, path, rule, reason in sorted(rules.unchecked):
        print(f"envoy-gateway: REACHED, NOT CHECKED ({reason}): {kind} {path}: {rule}")
    print(f"envoy-gateway: {failures} documents refused, {rules.checked} CEL rule evaluations passed, "
          f"{len(rules.unchecked)} rules reached but not checked; {len(listed)} rules of the kept CRDs "
          f"celpy cannot evaluate ({UNCHECKED.relative_to(ROOT)}), none reached unless listed above")
    # A rule the examples reach must be checked: one that cannot be is a failure to look at.
    return 1 if failures or stale or rules.unchecked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Validates the custom resources of a suite's examples (and any files given) against the CRD
structures kept in the suite's folder (extract.py), offline, the way the API server would on
create. Four suites: `envoy-gateway` (examples/envoy-gateway/, tests/envoy-gateway/schemas/, the
default), `dynamo-operator` (examples/dynamo-operator/, tests/dynamo-operator/schemas/), `istio`
(examples/istio/, tests/istio/schemas/) and `agentgateway` (examples/agentgateway/,
tests/agentgateway/schemas/). A suite may use another's folder (`SUITE/schemas/FOLDER`).

1. the CRD's defaults are applied;
2. the OpenAPI schema is checked with `jsonschema` (PyPI), strict: a field the CRD does not
   declare is refused (structural schemas prune it; an operator's typo would be lost silently);
3. the CEL rules (`x-kubernetes-validations`) on every node the document reaches are evaluated
   with `cel-python` (PyPI, `celpy`), given the functions of Kubernetes' CEL libraries that the
   kept rules call (lowerAscii, upperAscii, split; isURL, url, getScheme, after Go's
   url.ParseRequestURI). Transition rules (`oldSelf`) do not
   apply on create, except those marked `optionalOldSelf`, where `oldSelf` is an empty optional.
   A rule that calls a function celpy does not have cannot be checked: such rules are printed,
   and the set must equal the suite's unchecked.txt, so a new one cannot go unnoticed;
4. lists typed `x-kubernetes-list-type: map` or `set` must not repeat a key or an item;
5. examples that say the same thing must say it alike, so they cannot drift apart: for
   dynamo-operator, the proxy container must be the one of examples/k8s/dynamo-frontend.yaml,
   setting for setting; for envoy-gateway, wasm.yaml's resources must be dynamic-module.yaml's
   (the Gateway but for its EnvoyProxy) and the plugin's config the module's; for istio, the
   WasmPlugin and the TrafficExtension must set the plugin alike, with the module's config and
   the failure policy of examples/envoy/wasm.yaml.

Each document is checked against every release of its suite; all must accept it.

    python3 tests/envoy-gateway/validate.py [--suite NAME] [FILE.yaml ...]  # default: the suite's examples
    python3 tests/envoy-gateway/validate.py [--suite NAME] --self-test      # broken copies must be refused

The envoy-gateway suite also needs ENVOY_LATEST and ENVOY_MODULE_OLDER from tests/versions.sh in
the environment (validate.sh exports them). Exit status 0 only if every document passes against
every release.
"""

import copy
import json
import os
import pathlib
import re
import string
import sys

import celpy
import celpy.celtypes
import celpy.evaluation
import jsonschema
import yaml

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent


class Suite:
    """Examples under examples/<name>/, their CRDs kept in tests/<name>/schemas/<folder>/."""

    def __init__(self, name, releases, cases, agree=lambda: []):
        self.name = name
        self.home = ROOT / "tests" / name
        self.schemas = self.home / "schemas"
        self.unchecked = self.home / "unchecked.txt"
        self.examples = ROOT / "examples" / name
        self.releases = releases  # [(what, [schema folders])]: each must accept every document
        self.cases = cases  # cases(mutated) -> [(what it breaks, broken document)]
        self.agree = agree  # agree() -> [how the examples disagree with another example]

    def say(self, line):
        print(f"{self.name}: {line}")

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


def ascii_case(upper):
    """Kubernetes' lowerAscii() / upperAscii(): only the ASCII letters change case."""
    lower, upper_ = string.ascii_lowercase, string.ascii_uppercase
    table = str.maketrans(lower, upper_) if upper else str.maketrans(upper_, lower)
    return lambda text: celpy.celtypes.StringType(str(text).translate(table))


def split(text, separator, limit=-1):
    """Kubernetes' split(): all the parts for a negative limit, none for 0, at most `limit` else."""
    limit = int(limit)
    parts = [] if limit == 0 else str(text).split(str(separator), -1 if limit < 0 else limit - 1)
    return celpy.celtypes.ListType([celpy.celtypes.StringType(part) for part in parts])


class GoURL:
    """What Go's url.ParseRequestURI makes of a string, as far as Kubernetes' CEL URL library reads
    it (isURL, url, getScheme): a port of net/url's parse(rawURL, viaRequest=true), refusing what
    it refuses."""

    def __init__(self, text):
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
            raise ValueError("invalid control character in URL")
        if text == "":
            raise ValueError("empty url")
        self.scheme = self.host = self.opaque = ""
        self.path = text
        if text == "*":
            return
        scheme, rest = self.split_scheme(text)
        self.scheme = scheme.lower()
        if rest.endswith("?") and rest.count("?") == 1:
            rest = rest[:-1]
        else:
            rest = rest.partition("?")[0]
        if not rest.startswith("/"):
            if not self.scheme:
                raise ValueError("invalid URI for request")
            self.opaque, self.path = rest, ""
            return
        if self.scheme and rest.startswith("//"):
            authority, slash, path = rest[2:].partition("/")
            rest = slash + path
            user, at, host = authority.rpartition("@")
            self.host = self.parse_host(host)
            if at and not re.fullmatch(r"[A-Za-z0-9\-._:~!$&'()*+,;=%@]*", user):
                raise ValueError("net/url: invalid userinfo")
        self.path = self.unescape(rest, host=False)

    @staticmethod
    def split_scheme(text):
        for index, char in enumerate(text):
            if char.isascii() and char.isalpha():
                continue
            if char.isascii() and (char.isdigit() or char in "+-."):
                if index == 0:
                    return "", text
                continue
            if char == ":":
                if index == 0:
                    raise ValueError("missing protocol scheme")
                return text[:index], text[index + 1:]
            return "", text
        return "", text

    @classmethod
    def parse_host(cls, host):
        if host.startswith("["):
            end = host.rfind("]")
            if end < 0:
                raise ValueError("missing ']' in host")
            if not re.fullmatch(r"(:[0-9]*)?", host[end + 1:]):
                raise ValueError(f"invalid port {host[end + 1:]!r} after host")
            return host
        colon = host.rfind(":")
        if colon >= 0 and not re.fullmatch(r":[0-9]*", host[colon:]):
            raise ValueError(f"invalid port {host[colon:]!r} after host")
        return cls.unescape(host, host=True)

    @staticmethod
    def unescape(text, host):
        index = 0
        while index < len(text):
            char = text[index]
            if char == "%":
                hex_digits = text[index + 1:index + 3]
                if len(hex_digits) < 2 or not all(c in string.hexdigits for c in hex_digits):
                    raise ValueError(f"invalid URL escape {text[index:index + 3]!r}")
                if host and int(hex_digits[0], 16) < 8 and text[index:index + 3] != "%25":
                    raise ValueError(f"invalid URL escape {text[index:index + 3]!r}")
                index += 3
                continue
            if host and ord(char) < 0x80 and not (char.isalnum() or char in "-_.~!$&'()*+,;=:[]<>\""):
                raise ValueError(f"invalid character {char!r} in host name")
            index += 1
        return text


def is_url(text):
    """Kubernetes' isURL(): whether Go's url.ParseRequestURI takes the string."""
    try:
        GoURL(str(text))
    except ValueError:
        return celpy.celtypes.BoolType(False)
    return celpy.celtypes.BoolType(True)


def to_url(text):
    """Kubernetes' url(): the URL, or an error for a string isURL() refuses."""
    try:
        return GoURL(str(text))
    except ValueError as error:
        return celpy.CELEvalError(f"URL parse error during conversion from string: {error}")


# The functions of Kubernetes' CEL libraries (strings, URLs) that rules of the kept CRDs call.
KUBERNETES_FUNCTIONS = {"lowerAscii": ascii_case(False), "upperAscii": ascii_case(True), "split": split,
                        "isURL": is_url, "url": to_url,
                        "getScheme": lambda u: celpy.celtypes.StringType(u.scheme)}


class Rules:
    """The CEL rules reached by the documents: evaluated, failed, or not checkable with celpy."""

    def __init__(self):
        self.env = celpy.Environment()
        self.programs = {}
        self.checked = 0
        self.unchecked = set()  # (kind, path, rule, reason)

    def program(self, rule):
        if rule not in self.programs:
            self.programs[rule] = self.env.program(self.env.compile(rule), functions=KUBERNETES_FUNCTIONS)
        return self.programs[rule]

    def walk(self, kind, node, value, path, errors):
        """Evaluates every rule of `node` and its children on `value`, and the uniqueness of list
        keys; appends failures to `errors`."""
        for validation in node.get("x-kubernetes-validations", []):
            rule = text = validation["rule"]
            if validation.get("optionalOldSelf"):
                # Applies on create too, with oldSelf an empty optional (which celpy lacks).
                text = re.sub(r"\boldSelf\.hasValue\(\)", "false", rule)
                if re.search(r"\boldSelf\b", text):
                    self.unchecked.add((kind, schema_path(path), rule, "celpy has no optional types"))
                    continue
            elif re.search(r"\boldSelf\b", rule):
                continue  # a transition rule: no old object on create
            try:
                result = self.program(text).evaluate({"self": celpy.json_to_cel(value)})
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
            list_type = node.get("x-kubernetes-list-type")
            if list_type in ("map", "set"):
                keys = node.get("x-kubernetes-list-map-keys", [])
                seen = set()
                for index, item in enumerate(value):
                    key = json.dumps([item.get(k) for k in keys] if list_type == "map" and isinstance(item, dict)
                                     else item, sort_keys=True)
                    if key in seen:
                        errors.append(f"{path}[{index}]: duplicate {'key ' + ', '.join(keys) if list_type == 'map' else 'item'} {key} in a list of type {list_type}")
                    seen.add(key)
            for index, item in enumerate(value):
                self.walk(kind, node["items"], item, f"{path}[{index}]", errors)
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in node.get(key, []):
                if sub.get("x-kubernetes-validations"):
                    self.walk(kind, sub, value, path, errors)


def schema_path(path):
    """`spec.listeners[0]` -> `spec.listeners[]`: the place in the schema, not in the document."""
    return re.sub(r"\[\d+\]", "[]", path)


def schema_folder(suite, folder):
    """A folder of the suite's schemas, or, given as `SUITE/schemas/FOLDER`, another suite's."""
    return ROOT / "tests" / folder if "/" in folder else suite.schemas / folder


def load_release(suite, folders):
    crds = {}
    for folder in folders:
        for file in sorted(schema_folder(suite, folder).glob("*.json")):
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
    # Every object has these; some CRDs (Istio's) leave them out of their schema.
    for field in ("apiVersion", "kind"):
        schema["properties"].setdefault(field, {"type": "string"})
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


def core_kind(doc):
    """A kind of Kubernetes' core group (`apiVersion: v1`): tests/k8s/validate.sh checks those."""
    return "/" not in str(doc.get("apiVersion", ""))


def validate(suite, files, quiet=False):
    """(number of failures, Rules) for `files` against every release of `suite`."""
    rules = Rules()
    failures = 0
    for release, folders in suite.releases:
        crds = load_release(suite, folders)
        for name, doc in documents(files):
            if core_kind(doc):
                if not quiet:
                    suite.say(f"core {name}: not a custom resource (tests/k8s/validate.sh checks it)")
                continue
            errors = check_document(doc, crds, rules)
            failures += bool(errors)
            if not quiet:
                suite.say(f"{'FAIL' if errors else 'ok  '} {name} against {release}")
            for error in errors:
                suite.say(f"  {error}")
    return failures, rules


def self_test(suite, files):
    """Broken copies of the examples must be refused: each mutation names what it breaks."""
    docs = [doc for _, doc in documents(files)]

    def mutated(kind, change, which=lambda doc: True):
        """A copy of the first document of `kind` that `which` accepts, after `change`."""
        doc = copy.deepcopy(next(d for d in docs if d["kind"] == kind and which(d)))
        change(doc)
        return doc

    missed = 0
    for release, folders in suite.releases:
        crds = load_release(suite, folders)
        for what, doc in suite.cases(mutated):
            errors = check_document(doc, crds, Rules())
            suite.say(f"self-test {'ok  ' if errors else 'MISS'} {what} ({release}): {errors[0] if errors else 'accepted'}")
            missed += not errors
    return missed


def envoy_gateway_cases(mutated):
    wasm = lambda d: "wasm" in d["spec"]  # noqa: E731  (wasm.yaml's policy)

    ext_proc = lambda d: "extProc" in d["spec"]  # noqa: E731  (ext-proc.yaml's policy)

    def plugin(doc):
        return doc["spec"]["wasm"][0]

    def processor(doc):
        return doc["spec"]["extProc"][0]

    return [
        ("a CEL rule: an Image code source without image", mutated("EnvoyExtensionPolicy", lambda d: plugin(d)["code"].pop("image"), wasm)),
        ("a CEL rule: an Image code source with http", mutated("EnvoyExtensionPolicy", lambda d: plugin(d)["code"].update(http={"url": "https://example.com/p.wasm"}), wasm)),
        ("a code source type outside the enum", mutated("EnvoyExtensionPolicy", lambda d: plugin(d)["code"].update(type="OCI"), wasm)),
        ("a string where failOpen's boolean goes", mutated("EnvoyExtensionPolicy", lambda d: plugin(d).update(failOpen="false"), wasm)),
        ("a misspelled field of the plugin", mutated("EnvoyExtensionPolicy", lambda d: plugin(d).update(failClosed=True), wasm)),
        ("an unknown field in spec", mutated("ClientTrafficPolicy", lambda d: d["spec"].update(bufferLimit="33Mi"))),
        ("an unknown field deep down", mutated("EnvoyProxy", lambda d: d["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"].update(volumeMount=[]))),
        ("a string where an integer goes", mutated("BackendTrafficPolicy", lambda d: d["spec"]["circuitBreaker"].update(maxConnections="many"))),
        ("a value outside an enum", mutated("EnvoyProxy", lambda d: d["spec"]["dynamicModules"][0]["source"].update(type="Image"))),
        ("a module name against its pattern", mutated("EnvoyProxy", lambda d: d["spec"]["dynamicModules"][0].update(name="Bypass_Marker"))),
        ("a CEL rule: a Local source without local", mutated("EnvoyProxy", lambda d: d["spec"]["dynamicModules"][0]["source"].pop("local"))),
        ("a CEL rule: a policy targeting nothing", mutated("EnvoyExtensionPolicy", lambda d: d["spec"].pop("targetRefs"))),
        ("a missing required field", mutated("HTTPRoute", lambda d: d["spec"]["rules"][0]["backendRefs"][0].pop("name"))),
        ("a bad metadata name", mutated("Gateway", lambda d: d["metadata"].update(name="Dynamo_Gateway"))),
        ("extProc with the singular backendRef", mutated("EnvoyExtensionPolicy", lambda d: processor(d).update(backendRef=processor(d)["backendRefs"][0]), ext_proc)),
        ("a CEL rule: extProc FullDuplexStreamed with failOpen", mutated("EnvoyExtensionPolicy", lambda d: processor(d).update(failOpen=True, processingMode={"request": {"body": "FullDuplexStreamed"}}), ext_proc)),
        ("an extProc body mode outside the enum", mutated("EnvoyExtensionPolicy", lambda d: processor(d)["processingMode"]["request"].update(body="BUFFERED"), ext_proc)),
        ("a CEL rule: an extProc backend of another kind", mutated("EnvoyExtensionPolicy", lambda d: processor(d)["backendRefs"][0].update(kind="Pod"), ext_proc)),
        ("a string where the processor's circuit breaker's integer goes", mutated("EnvoyExtensionPolicy", lambda d: processor(d)["backendSettings"]["circuitBreaker"].update(maxParallelRequests="16384"), ext_proc)),
        ("the processor's circuit breaker misspelt", mutated("EnvoyExtensionPolicy", lambda d: processor(d)["backendSettings"].update(circuitBreakers=processor(d)["backendSettings"].pop("circuitBreaker")), ext_proc)),
    ]


def dynamo_operator_cases(mutated):
    def frontend(doc):
        return next(c for c in doc["spec"]["components"] if c.get("type") == "frontend")

    def containers(doc):
        return frontend(doc)["podTemplate"]["spec"]["containers"]

    def sidecar(doc):
        return next(c for c in containers(doc) if c["name"] == "bypass-marker")

    def rename(mapping, old, new):
        mapping[new] = mapping.pop(old)

    dgd = "DynamoGraphDeployment"
    return [
        ("a misspelled field of a component", mutated(dgd, lambda d: rename(frontend(d), "replicas", "replica"))),
        ("a misspelled field of the sidecar", mutated(dgd, lambda d: rename(sidecar(d), "readinessProbe", "readynessProbe"))),
        ("a component without name", mutated(dgd, lambda d: frontend(d).pop("name"))),
        ("a component type outside the enum", mutated(dgd, lambda d: frontend(d).update(type="router"))),
        ("a string where an integer goes", mutated(dgd, lambda d: frontend(d).update(replicas="one"))),
        ("a port without containerPort", mutated(dgd, lambda d: sidecar(d)["ports"][0].pop("containerPort"))),
        ("a component name against its pattern", mutated(dgd, lambda d: frontend(d).update(name="front_end"))),
        ("a CEL rule: a sidecar without image", mutated(dgd, lambda d: sidecar(d).pop("image"))),
        ("a CEL rule: component names equal but for case", mutated(dgd, lambda d: d["spec"]["components"][1].update(name="FRONTEND"))),
        ("a CEL rule: restart set on create", mutated(dgd, lambda d: d["spec"].update(restart={"id": "now"}))),
        ("a list map: two containers named alike", mutated(dgd, lambda d: containers(d).append(copy.deepcopy(sidecar(d))))),
        ("a bad metadata name", mutated(dgd, lambda d: d["metadata"].update(name="vllm_agg"))),
    ]


def proxy_containers(file):
    """The `bypass-marker` containers of the pod templates in `file`: {where: container}."""
    found = {}
    for index, doc in enumerate(yaml.safe_load_all(file.read_text())):
        spec = (doc or {}).get("spec", {})
        templates = [("", spec.get("template", {}))] + [
            (f" component {c.get('name')}", c.get("podTemplate", {})) for c in spec.get("components", [])]
        for where, template in templates:
            for container in template.get("spec", {}).get("containers", []):
                if container.get("name") == "bypass-marker":
                    found[f"{file.relative_to(ROOT)} #{index + 1}{where}"] = container
    return found


def dynamo_operator_agrees():
    """The proxy beside the operator's frontend is the one of the plain Deployment, setting for setting."""
    plain = proxy_containers(ROOT / "examples" / "k8s" / "dynamo-frontend.yaml")
    if len(plain) != 1:
        return [f"examples/k8s/dynamo-frontend.yaml has {len(plain)} bypass-marker containers, not one"]
    (plain_where, plain_container), = plain.items()
    found = {}
    for file in sorted((ROOT / "examples" / "dynamo-operator").glob("*.yaml")):
        found.update(proxy_containers(file))
    problems = [] if found else ["no bypass-marker container in examples/dynamo-operator/"]
    for where, container in found.items():
        for key in sorted(set(container) | set(plain_container)):
            if container.get(key) != plain_container.get(key):
                problems.append(f"{where}: bypass-marker's {key} differs from {plain_where}'s")
    return problems


def istio_cases(mutated):
    extension = "TrafficExtension"
    module = lambda d: "parametersRef" in d["spec"].get("infrastructure", {})  # noqa: E731  (dynamic-module.yaml's Gateway)
    module_filter = lambda d: d["metadata"]["name"] == "bypass-marker-module"  # noqa: E731
    ext_proc_filter = lambda d: d["metadata"]["name"] == "bypass-marker-ext-proc"  # noqa: E731
    return [
        ("an unknown field in spec", mutated("WasmPlugin", lambda d: d["spec"].update(failPolicy="FAIL_CLOSE"))),
        ("a failStrategy outside the enum", mutated("WasmPlugin", lambda d: d["spec"].update(failStrategy="FAIL_CLOSED"))),
        ("a WasmPlugin without url", mutated("WasmPlugin", lambda d: d["spec"].pop("url"))),
        ("a CEL rule: a url of another scheme", mutated("WasmPlugin", lambda d: d["spec"].update(url="ftp://registry.example.com/bypass-marker-wasm:0.1.0"))),
        ("a CEL rule: targetRefs and selector both", mutated("WasmPlugin", lambda d: d["spec"].update(selector={"matchLabels": {"app": "dynamo"}}))),
        ("a CEL rule: a cross-namespace target", mutated("WasmPlugin", lambda d: d["spec"]["targetRefs"][0].update(namespace="other"))),
        ("a sha256 that is not one", mutated("WasmPlugin", lambda d: d["spec"].update(sha256="sha256:abc"))),
        ("a TrafficExtension with wasm and lua both", mutated(extension, lambda d: d["spec"].update(lua={"inlineCode": "-- nothing"}))),
        ("a TrafficExtension with neither wasm nor lua", mutated(extension, lambda d: d["spec"].pop("wasm"))),
        ("a CEL rule: a TrafficExtension url of another scheme", mutated(extension, lambda d: d["spec"]["wasm"].update(url="ftp://registry.example.com/x:1"))),
        ("the plugin's settings at the TrafficExtension's top", mutated(extension, lambda d: d["spec"].update(url=d["spec"]["wasm"]["url"]))),
        ("an EnvoyFilter patch applied to a thing that is not", mutated("EnvoyFilter", lambda d: d["spec"]["configPatches"][0].update(applyTo="LISTENERS"))),
        ("a bad metadata name", mutated("WasmPlugin", lambda d: d["metadata"].update(name="Bypass_Marker"))),
        ("a Gateway parametersRef without its name", mutated("Gateway", lambda d: d["spec"]["infrastructure"]["parametersRef"].pop("name"), module)),
        ("a module EnvoyFilter operation outside the enum", mutated("EnvoyFilter", lambda d: d["spec"]["configPatches"][0]["patch"].update(operation="INSERT_BEFORE_ROUTER"), module_filter)),
        ("a processor EnvoyFilter cluster patch with an operation outside the enum", mutated("EnvoyFilter", lambda d: d["spec"]["configPatches"][0]["patch"].update(operation="APPEND"), ext_proc_filter)),
        ("a processor EnvoyFilter patch without applyTo's enum", mutated("EnvoyFilter", lambda d: d["spec"]["configPatches"][1].update(applyTo="HTTP_FILTERS"), ext_proc_filter)),
        ("a module EnvoyFilter match context outside the enum", mutated("EnvoyFilter", lambda d: d["spec"]["configPatches"][0]["match"].update(context="GATEWAYS"), module_filter)),
        ("a CEL rule: an HTTPRoute Service backend without port", mutated("HTTPRoute", lambda d: d["spec"]["rules"][0]["backendRefs"][0].pop("port"))),
        ("a Gateway listener port of the wrong type", mutated("Gateway", lambda d: d["spec"]["listeners"][0].update(port="80"))),
    ]


def documents_of(*parts):
    """{kind: [document, ...]} of the file examples/<parts>."""
    found = {}
    for doc in yaml.safe_load_all((ROOT / "examples").joinpath(*parts).read_text()):
        if doc:
            found.setdefault(doc["kind"], []).append(doc)
    return found


def shared_config(config):
    """A plugin's config without the plugin's own keys: what it shares with the module. The
    gateways cannot set Envoy's allow_on_headers_stop_iteration, so their plugin must say
    `request-head: forwarded` (else its held head would stop its body hooks): None if it does not."""
    config = dict(config or {})
    if config.pop("request-head", None) != "forwarded":
        return None
    return config


def module_config():
    """The config of the dynamic module in examples/envoy-gateway/dynamic-module.yaml."""
    (policy,) = documents_of("envoy-gateway", "dynamic-module.yaml")["EnvoyExtensionPolicy"]
    (module,) = policy["spec"]["dynamicModule"]
    return module.get("config")


def envoy_gateway_agrees():
    """wasm.yaml and ext-proc.yaml are dynamic-module.yaml with the plugin or the processor for the
    module: the same Gateway (but for its EnvoyProxy), policies and route, on the same targets;
    the plugin's config the module's, fail-closed; the processor the Service of
    examples/k8s/ext-proc.yaml, fail-closed, with the bootstrap's modes and message timeout; the
    module's Envoy image pinned to a release the module is tested with."""
    module = documents_of("envoy-gateway", "dynamic-module.yaml")
    problems = []
    module_policy = module["EnvoyExtensionPolicy"][0]
    for name in ("wasm.yaml", "ext-proc.yaml"):
        other = documents_of("envoy-gateway", name)
        for kind in ("Gateway", "ClientTrafficPolicy", "HTTPRoute", "BackendTrafficPolicy"):
            expected = copy.deepcopy(module.get(kind))
            if kind == "Gateway" and expected:
                expected[0]["spec"].pop("infrastructure", None)
            if other.get(kind) != expected:
                problems.append(f"examples/envoy-gateway/{name}: its {kind} differs from dynamic-module.yaml's")
        if sorted(other) != sorted(set(module) - {"EnvoyProxy"}):
            problems.append(f"examples/envoy-gateway/{name} has the kinds {sorted(other)}, not dynamic-module.yaml's but EnvoyProxy")
        (policy,) = other.get("EnvoyExtensionPolicy", [{"spec": {}}])
        if policy["spec"].get("targetRefs") != module_policy["spec"]["targetRefs"]:
            problems.append(f"examples/envoy-gateway/{name}: the policy's targetRefs differ from dynamic-module.yaml's")
        if name == "wasm.yaml":
            plugins = policy["spec"].get("wasm", [])
            if len(plugins) != 1 or shared_config(plugins[0].get("config")) != module_config():
                problems.append("examples/envoy-gateway/wasm.yaml: the plugin's config is not the module's config "
                                "and request-head: forwarded")
            if any(p.get("failOpen") is not False for p in plugins):
                problems.append("examples/envoy-gateway/wasm.yaml: the plugin does not say failOpen: false")
        else:
            problems += ext_proc_agrees(policy)
    problems += envoy_image_pinned(module)
    return problems


def ext_proc_agrees(policy):
    """ext-proc.yaml's processor: the Service of examples/k8s/ext-proc.yaml, in the policy's
    namespace, fail-closed, with the modes and message timeout of examples/envoy/ext-proc.yaml."""
    where = "examples/envoy-gateway/ext-proc.yaml"
    problems = []
    processors = policy["spec"].get("extProc", [])
    if len(processors) != 1:
        return [f"{where}: {len(processors)} extProc entries, not one"]
    (processor,) = processors
    services = [d for d in yaml.safe_load_all((ROOT / "examples" / "k8s" / "ext-proc.yaml").read_text())
                if d and d.get("kind") == "Service"]
    expected = [{"name": s["metadata"]["name"], "port": port["port"]} for s in services for port in s["spec"]["ports"]
                if s["metadata"].get("namespace") == policy["metadata"].get("namespace")]
    if processor.get("backendRefs") != expected:
        problems.append(f"{where}: backendRefs {processor.get('backendRefs')} are not examples/k8s/ext-proc.yaml's Service {expected}")
    if processor.get("failOpen") is not False:
        problems.append(f"{where}: the processor does not say failOpen: false")
    bootstrap = (ROOT / "examples" / "envoy" / "ext-proc.yaml").read_text()
    timeout = re.search(r"^ +message_timeout: (\S+)", bootstrap, re.M)
    if not timeout or processor.get("messageTimeout") != timeout.group(1):
        problems.append(f"{where}: messageTimeout {processor.get('messageTimeout')} is not the bootstrap's message_timeout")
    # The processor's cluster: the bootstrap's max_requests on bypass_marker, as the circuit breaker.
    cluster = re.search(r"^  - name: bypass_marker\n(?:    .*\n|\s*#.*\n)*?        max_requests: (\d+)", bootstrap, re.M)
    breaker = (processor.get("backendSettings") or {}).get("circuitBreaker") or {}
    if not cluster or breaker.get("maxParallelRequests") != int(cluster.group(1)):
        problems.append(f"{where}: backendSettings.circuitBreaker.maxParallelRequests {breaker.get('maxParallelRequests')} "
                        f"is not the bootstrap's max_requests on the bypass_marker cluster "
                        f"({cluster.group(1) if cluster else 'not found'})")
    mode = processor.get("processingMode", {})
    if mode != {"request": {"body": "Buffered"}, "response": {"body": "Streamed"}, "allowModeOverride": True}:
        problems.append(f"{where}: processingMode {mode} is not the bootstrap's (request BUFFERED, response STREAMED, "
                        "allow_mode_override)")
    return problems


def envoy_image_pinned(module):
    """The module loads in the Envoy releases tests/envoy/module.sh runs it in, and no other is
    known: the EnvoyProxy pins Envoy's image to one of them. The releases are tests/versions.sh's
    ENVOY_LATEST and ENVOY_MODULE_OLDER, which validate.sh passes in the environment."""
    try:
        tested = [os.environ["ENVOY_LATEST"], *os.environ["ENVOY_MODULE_OLDER"].split()]
    except KeyError as missing:
        sys.exit(f"validate.py: {missing} is not set: run tests/envoy-gateway/validate.sh, which sources tests/versions.sh")
    (proxy,) = module["EnvoyProxy"]
    image = proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"].get("image", "")
    pinned = re.fullmatch(r"docker\.io/envoyproxy/envoy:distroless-v([0-9.]+)(@sha256:[0-9a-f]{64})?", image)
    if not pinned or pinned.group(1) not in tested:
        return [f"examples/envoy-gateway/dynamic-module.yaml: the EnvoyProxy's image {image!r} is not Envoy's distroless "
                f"image at a release the module is tested with ({', '.join(sorted(tested)) or 'none found'})"]
    return []


def istio_agrees():
    """The WasmPlugin and the TrafficExtension set the plugin alike (the TrafficExtension's `wasm`
    holds the WasmPlugin's plugin fields), fail closed as examples/envoy/wasm.yaml does, with the
    module's config; the three files carry the same Gateway (but for its infrastructure), HTTPRoute
    and buffer-limit EnvoyFilter; the plugin's Gateway asks for the tags examples/envoy/wasm.yaml
    extracts; the module's file loads the module as examples/envoy-gateway/dynamic-module.yaml does
    (its image, its copy, its config) from the directory Envoy searches."""
    plugin_file, extension_file = documents_of("istio", "wasm-plugin.yaml"), documents_of("istio", "traffic-extension.yaml")
    module_file = documents_of("istio", "dynamic-module.yaml")
    problems = []
    (plugin,) = plugin_file.get("WasmPlugin", [{"spec": {}}])
    (extension,) = extension_file.get("TrafficExtension", [{"spec": {}}])
    placement = ("targetRefs", "selector", "match", "phase", "priority")
    as_extension = {"wasm": {k: v for k, v in plugin["spec"].items() if k not in placement}}
    as_extension.update({k: v for k, v in plugin["spec"].items() if k in placement})
    if extension["spec"] != as_extension:
        problems.append("examples/istio/traffic-extension.yaml: its TrafficExtension is not wasm-plugin.yaml's WasmPlugin")
    # Fail closed (Istio passes requests through a failed plugin with FAIL_OPEN alone), and as the
    # shipped bootstrap: FAIL_RELOAD there, FAIL_RELOAD here; FAIL_CLOSED there, FAIL_CLOSE here.
    bootstrap_text = (ROOT / "examples" / "envoy" / "wasm.yaml").read_text()
    bootstrap = re.search(r"^ +failure_policy: (\w+)", bootstrap_text, re.M)
    expected = {"FAIL_RELOAD": "FAIL_RELOAD", "FAIL_CLOSED": "FAIL_CLOSE"}.get(bootstrap.group(1) if bootstrap else "")
    if not expected or plugin["spec"].get("failStrategy") != expected:
        problems.append(f"examples/istio/wasm-plugin.yaml: failStrategy {plugin['spec'].get('failStrategy')} is not "
                        f"the fail-closed {expected} that examples/envoy/wasm.yaml's failure_policy "
                        f"{bootstrap.group(1) if bootstrap else '(none)'} asks for")
    if shared_config(plugin["spec"].get("pluginConfig")) != module_config():
        problems.append("examples/istio/wasm-plugin.yaml: pluginConfig is not the module's config (examples/envoy-gateway/dynamic-module.yaml) "
                        "and request-head: forwarded")
    ext_proc_file = documents_of("istio", "ext-proc.yaml")
    files = {"wasm-plugin.yaml": plugin_file, "traffic-extension.yaml": extension_file, "dynamic-module.yaml": module_file,
             "ext-proc.yaml": ext_proc_file}
    kinds = {"wasm-plugin.yaml": ["WasmPlugin"], "traffic-extension.yaml": ["TrafficExtension"],
             "dynamic-module.yaml": ["ConfigMap"], "ext-proc.yaml": []}
    for name, docs in files.items():
        expected_kinds = sorted(kinds[name] + ["EnvoyFilter", "Gateway", "HTTPRoute"])
        if sorted(docs) != expected_kinds:
            problems.append(f"examples/istio/{name} has the kinds {sorted(docs)}, not {expected_kinds}")

    def buffer_limit(docs):
        return [d for d in docs.get("EnvoyFilter", []) if d["metadata"]["name"] == "bypass-marker-buffer-limit"]

    def gateway(docs, infrastructure):
        found = copy.deepcopy(docs.get("Gateway"))
        for doc in found or []:
            infrastructure.append(doc["spec"].pop("infrastructure", {}))
        return found

    infrastructures = {}
    reference = gateway(plugin_file, infrastructures.setdefault("wasm-plugin.yaml", []))
    for name, docs in files.items():
        if name != "wasm-plugin.yaml" and gateway(docs, infrastructures.setdefault(name, [])) != reference:
            problems.append(f"examples/istio/{name}: its Gateway differs from wasm-plugin.yaml's (but for infrastructure)")
        if docs.get("HTTPRoute") != plugin_file.get("HTTPRoute"):
            problems.append(f"examples/istio/{name}: its HTTPRoute differs from wasm-plugin.yaml's")
        if not buffer_limit(docs) or buffer_limit(docs) != buffer_limit(plugin_file):
            problems.append(f"examples/istio/{name}: its buffer-limit EnvoyFilter differs from wasm-plugin.yaml's")
    if any(d["spec"].get("gatewayClassName") != "istio" for d in reference or []):
        problems.append("examples/istio/wasm-plugin.yaml: the Gateway is not of the class istio")
    # The plugin's labels: Istio makes a stats tag `(NAME=\.=(.*?);\.;)` for each extraStatTags name,
    # as examples/envoy/wasm.yaml's stats_tags.
    tags = sorted(re.findall(r"tag_name: (\w+)", bootstrap_text))
    # Istio 1.30's bootstrap template writes `({{ $tag }}=\\.=(.*?);\\.;)` for each name: the same
    # regex as the shipped bootstrap's, or the labels would differ between the two.
    for name, regex in re.findall(r"tag_name: (\w+), regex: '([^']*)'", bootstrap_text):
        if regex != f"({name}=\\.=(.*?);\\.;)":
            problems.append(f"examples/envoy/wasm.yaml: the stats tag {name}'s regex {regex} is not the one Istio "
                            "generates from extraStatTags")
    for name in ("wasm-plugin.yaml", "traffic-extension.yaml"):
        infrastructure = (infrastructures[name] or [{}])[0]
        asked = sorted(proxy_config(infrastructure).get("extraStatTags") or [])
        problems += deprecated_istio_annotations(f"examples/istio/{name}", infrastructure)
        if not tags or asked != tags:
            problems.append(f"examples/istio/{name}: the Gateway's proxy.istio.io/config extraStatTags {asked} are not "
                            f"examples/envoy/wasm.yaml's stats_tags {tags}")
    problems += istio_module_agrees(module_file, infrastructures["dynamic-module.yaml"])
    problems += istio_ext_proc_agrees(ext_proc_file)
    return problems


def istio_ext_proc_agrees(docs):
    """examples/istio/ext-proc.yaml: its EnvoyFilter adds the bootstrap's processor cluster
    (examples/envoy/ext-proc.yaml's `bypass_marker`, but for its type and address: STRICT_DNS to the
    Service of examples/k8s/ext-proc.yaml in the Gateway's namespace) and inserts the bootstrap's
    ext_proc filter, naming that cluster, before the router, on the Gateway."""
    where = "examples/istio/ext-proc.yaml"
    bootstrap = yaml.safe_load((ROOT / "examples" / "envoy" / "ext-proc.yaml").read_text())
    (expected_cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "bypass_marker"]
    (hcm,) = [f for f in bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
              if f["name"] == "envoy.filters.network.http_connection_manager"]
    (expected_filter,) = [f for f in hcm["typed_config"]["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    filters = [d for d in docs.get("EnvoyFilter", []) if d["metadata"]["name"] == "bypass-marker-ext-proc"]
    if len(filters) != 1:
        return [f"{where}: {len(filters)} EnvoyFilters bypass-marker-ext-proc, not one"]
    (envoy_filter,) = filters
    problems = []
    if envoy_filter["spec"].get("targetRefs") != [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "dynamo"}]:
        problems.append(f"{where}: the processor's EnvoyFilter does not target the Gateway dynamo")
    patches = {p["applyTo"]: p for p in envoy_filter["spec"]["configPatches"]}
    if sorted(patches) != ["CLUSTER", "HTTP_FILTER"] or len(envoy_filter["spec"]["configPatches"]) != 2:
        return problems + [f"{where}: the processor's EnvoyFilter has the patches {sorted(patches)}, not one CLUSTER and one HTTP_FILTER"]
    cluster_patch, filter_patch = patches["CLUSTER"], patches["HTTP_FILTER"]
    if cluster_patch["patch"]["operation"] != "ADD" or cluster_patch["match"].get("context") != "GATEWAY":
        problems.append(f"{where}: the processor's cluster is not an ADD in the GATEWAY context")
    if filter_patch["patch"]["operation"] != "INSERT_BEFORE" or filter_patch["match"].get("context") != "GATEWAY" or \
            filter_patch["match"]["listener"]["filterChain"]["filter"].get("subFilter", {}).get("name") != "envoy.filters.http.router":
        problems.append(f"{where}: the ext_proc filter is not inserted before the router in the GATEWAY context")
    cluster = copy.deepcopy(cluster_patch["patch"]["value"])
    endpoints = [e["endpoint"]["address"]["socket_address"] for group in cluster.get("load_assignment", {}).get("endpoints", [])
                 for e in group.get("lb_endpoints", [])]
    namespace = envoy_filter["metadata"].get("namespace")
    services = [d for d in yaml.safe_load_all((ROOT / "examples" / "k8s" / "ext-proc.yaml").read_text())
                if d and d.get("kind") == "Service" and d["metadata"].get("namespace") == namespace]
    addresses = [{"address": f"{s['metadata']['name']}.{namespace}.svc.cluster.local", "port_value": port["port"]}
                 for s in services for port in s["spec"]["ports"]]
    if endpoints != addresses:
        problems.append(f"{where}: the processor's cluster reaches {endpoints}, not examples/k8s/ext-proc.yaml's Service {addresses}")
    if cluster.get("type") != "STRICT_DNS":
        problems.append(f"{where}: the processor's cluster is of type {cluster.get('type')}, not STRICT_DNS (a Service's name)")
    for c in (cluster, expected := copy.deepcopy(expected_cluster)):
        c.pop("type", None)
        c.pop("load_assignment", None)
    if cluster != expected:
        problems.append(f"{where}: the processor's cluster {cluster} is not examples/envoy/ext-proc.yaml's bypass_marker {expected}")
    value = filter_patch["patch"]["value"]
    if value != expected_filter:
        problems.append(f"{where}: the ext_proc filter {value} is not examples/envoy/ext-proc.yaml's {expected_filter}")
    if value.get("typed_config", {}).get("grpc_service", {}).get("envoy_grpc", {}).get("cluster_name") != cluster_patch["patch"]["value"].get("name"):
        problems.append(f"{where}: the ext_proc filter does not name the cluster the same EnvoyFilter adds")
    return problems


# Pod annotations istio/api marks `deprecated: true` (annotation/annotations.yaml, tag 1.30.3),
# each with what replaces it: the examples use the proxy configuration (`proxy.istio.io/config`,
# mesh/v1alpha1/proxy.proto's ProxyConfig), which Istio's bootstrap reads when they are absent
# (istio/istio pkg/bootstrap/config.go, getStatsOptions).
DEPRECATED_ISTIO_ANNOTATIONS = {
    "sidecar.istio.io/statsInclusionPrefixes": "proxyStatsMatcher.inclusionPrefixes",
    "sidecar.istio.io/statsInclusionSuffixes": "proxyStatsMatcher.inclusionSuffixes",
    "sidecar.istio.io/statsInclusionRegexps": "proxyStatsMatcher.inclusionRegexps",
    "sidecar.istio.io/extraStatTags": "extraStatTags",
}


def proxy_config(infrastructure):
    """The ProxyConfig a Gateway's `proxy.istio.io/config` annotation gives its pods ({} if none)."""
    text = infrastructure.get("annotations", {}).get("proxy.istio.io/config")
    config = yaml.safe_load(text) if text else {}
    return config if isinstance(config, dict) else {}


def deprecated_istio_annotations(where, infrastructure):
    return [f"{where}: the Gateway sets the deprecated annotation {name}: use proxy.istio.io/config's {instead}"
            for name, instead in DEPRECATED_ISTIO_ANNOTATIONS.items()
            if name in infrastructure.get("annotations", {})]


def istio_module_agrees(docs, infrastructures):
    """examples/istio/dynamic-module.yaml: the EnvoyFilter loads lib<name>.so with the module's
    config; the Gateway's ConfigMap patch copies that file, from the image and with the command of
    examples/envoy-gateway/dynamic-module.yaml's init container, into the directory istio-proxy
    mounts and names in ENVOY_DYNAMIC_MODULES_SEARCH_PATH; Istio keeps the module's counters."""
    where = "examples/istio/dynamic-module.yaml"
    problems = []
    filters = [d for d in docs.get("EnvoyFilter", []) if d["metadata"]["name"] == "bypass-marker-module"]
    try:
        (module_filter,) = filters
        (patch,) = module_filter["spec"]["configPatches"]
        typed = patch["patch"]["value"]["typed_config"]
        name = typed["dynamic_module_config"]["name"]
        config = json.loads(typed["filter_config"]["value"])
    except (ValueError, KeyError, TypeError) as error:
        return [f"{where}: no EnvoyFilter bypass-marker-module with one patch naming the module and its config ({error!r})"]
    if config != module_config():
        problems.append(f"{where}: the module's filter_config {config} is not examples/envoy-gateway/dynamic-module.yaml's config")
    if patch["applyTo"] != "HTTP_FILTER" or patch["patch"]["operation"] != "INSERT_BEFORE" or \
            patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] != "envoy.filters.http.router":
        problems.append(f"{where}: the module is not inserted before the router in the HTTP filter chain")
    if typed.get("filter_name") != "bypass_marker":
        problems.append(f"{where}: filter_name is not bypass_marker")
    if module_filter["spec"].get("targetRefs") != [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "dynamo"}]:
        problems.append(f"{where}: the module's EnvoyFilter does not target the Gateway dynamo")
    (infrastructure,) = infrastructures or [{}]
    matcher = proxy_config(infrastructure).get("proxyStatsMatcher") or {}
    if "dynamicmodulescustom" not in (matcher.get("inclusionPrefixes") or []):
        problems.append(f"{where}: the Gateway does not keep dynamicmodulescustom.* in istio-proxy's stats "
                        "(proxy.istio.io/config's proxyStatsMatcher.inclusionPrefixes)")
    problems += deprecated_istio_annotations(where, infrastructure)
    reference = infrastructure.get("parametersRef", {})
    maps = [d for d in docs.get("ConfigMap", []) if d["metadata"]["name"] == reference.get("name")]
    if reference.get("kind") != "ConfigMap" or reference.get("group") != "" or len(maps) != 1:
        return problems + [f"{where}: the Gateway's parametersRef names no ConfigMap of this file"]
    deployment = yaml.safe_load(maps[0]["data"]["deployment"])
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    (proxy,) = [c for c in pod.get("containers", []) if c["name"] == "istio-proxy"] or [{}]
    env = {e["name"]: e.get("value") for e in proxy.get("env", [])}
    mounts = {m["name"]: m["mountPath"] for m in proxy.get("volumeMounts", []) if m["name"] in volumes}
    search = env.get("ENVOY_DYNAMIC_MODULES_SEARCH_PATH")
    if search is None or search not in mounts.values():
        problems.append(f"{where}: ENVOY_DYNAMIC_MODULES_SEARCH_PATH ({search}) is not a volume istio-proxy mounts ({mounts})")
    (eg_proxy,) = documents_of("envoy-gateway", "dynamic-module.yaml")["EnvoyProxy"]
    (eg_init,) = eg_proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]["initContainers"]
    inits = pod.get("initContainers", [])
    if len(inits) != 1:
        return problems + [f"{where}: the Deployment patch has {len(inits)} init containers, not one"]
    (init,) = inits
    if init.get("image") != eg_init["image"] or init.get("command") != eg_init["command"]:
        problems.append(f"{where}: the init container's image and command are not examples/envoy-gateway/dynamic-module.yaml's")
    command = init.get("command", [])
    copied = pathlib.PurePosixPath(command[-1]) if command else None
    init_mounts = {m["mountPath"]: m["name"] for m in init.get("volumeMounts", [])}
    volume = init_mounts.get(str(copied.parent)) if copied else None
    if copied is None or copied.name != f"lib{name}.so":
        problems.append(f"{where}: the init container copies {copied}, not lib{name}.so that the EnvoyFilter loads")
    if volume is None or mounts.get(volume) != search:
        problems.append(f"{where}: the init container copies into {copied.parent if copied else None}, which is not the "
                        f"volume istio-proxy mounts at ENVOY_DYNAMIC_MODULES_SEARCH_PATH {search}")
    return problems


def agentgateway_cases(mutated):
    policy = "AgentgatewayPolicy"

    def processor(doc):
        return doc["spec"]["traffic"]["extProc"]

    return [
        ("a body mode outside the enum", mutated(policy, lambda d: processor(d)["processingOptions"].update(requestBodyMode="FULL_DUPLEX_STREAMED"))),
        ("a failure mode outside the enum", mutated(policy, lambda d: processor(d).update(failureMode="failClosed"))),
        ("a misspelt processing option", mutated(policy, lambda d: processor(d)["processingOptions"].update(requestBodyModes="Buffered"))),
        ("a CEL rule: a Service backend without port", mutated(policy, lambda d: processor(d)["backendRef"].pop("port"))),
        ("a CEL rule: extProc without backendRef", mutated(policy, lambda d: processor(d).pop("backendRef"))),
        ("a CEL rule: conditional with other fields", mutated(policy, lambda d: processor(d).update(conditional=[{"policy": {"backendRef": {"name": "x", "port": 1}}}]))),
        ("a CEL rule: targetRefs and targetSelectors both", mutated(policy, lambda d: d["spec"].update(targetSelectors=[{"group": "gateway.networking.k8s.io", "kind": "Gateway", "matchLabels": {"a": "b"}}]))),
        ("a CEL rule: a policy with no traffic, frontend or backend", mutated(policy, lambda d: d["spec"].pop("traffic"))),
        ("a CEL rule: traffic on a Service target", mutated(policy, lambda d: d["spec"]["targetRefs"][0].update(group="", kind="Service"))),
        ("a CEL rule: an HTTPRoute Service backend without port", mutated("HTTPRoute", lambda d: d["spec"]["rules"][0]["backendRefs"][0].pop("port"))),
    ]


def agentgateway_agrees():
    """The processor is examples/k8s/ext-proc.yaml's Service, fail-closed, in the mode it serves
    for agentgateway (FULL_DUPLEX_STREAMED both ways, trailers sent, no mode override), on the
    Gateway of the file; the route is the Istio and Envoy Gateway examples' route."""
    where = "examples/agentgateway/ext-proc.yaml"
    docs = documents_of("agentgateway", "ext-proc.yaml")
    problems = []
    if sorted(docs) != ["AgentgatewayPolicy", "Gateway", "HTTPRoute"]:
        problems.append(f"{where} has the kinds {sorted(docs)}, not AgentgatewayPolicy, Gateway and HTTPRoute")
    (policy,) = docs.get("AgentgatewayPolicy", [{"spec": {}, "metadata": {}}])
    (gateway,) = docs.get("Gateway", [{"metadata": {}}])
    if policy["spec"].get("targetRefs") != [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                              "name": gateway["metadata"].get("name")}]:
        problems.append(f"{where}: the policy does not target the file's Gateway")
    processor = policy["spec"].get("traffic", {}).get("extProc", {})
    services = [d for d in yaml.safe_load_all((ROOT / "examples" / "k8s" / "ext-proc.yaml").read_text())
                if d and d.get("kind") == "Service" and d["metadata"].get("namespace") == policy["metadata"].get("namespace")]
    expected = [{"name": s["metadata"]["name"], "port": port["port"]} for s in services for port in s["spec"]["ports"]]
    if [processor.get("backendRef")] != expected:
        problems.append(f"{where}: backendRef {processor.get('backendRef')} is not examples/k8s/ext-proc.yaml's Service {expected}")
    if processor.get("failureMode") != "FailClosed":
        problems.append(f"{where}: failureMode is not FailClosed")
    served = {"requestHeaderMode": "Send", "requestBodyMode": "FullDuplexStreamed", "requestTrailerMode": "Send",
              "responseHeaderMode": "Send", "responseBodyMode": "FullDuplexStreamed", "responseTrailerMode": "Send",
              "allowModeOverride": False}
    if processor.get("processingOptions") != served:
        problems.append(f"{where}: processingOptions {processor.get('processingOptions')} are not the mode the processor serves {served}")
    if docs.get("HTTPRoute") != documents_of("istio", "wasm-plugin.yaml").get("HTTPRoute"):
        problems.append(f"{where}: its HTTPRoute differs from examples/istio/wasm-plugin.yaml's")
    return problems


SUITES = {suite.name: suite for suite in [
    # Each Envoy Gateway release with the Gateway API release it bundles.
    Suite("envoy-gateway", [
        ("Envoy Gateway v1.8.3 + Gateway API v1.5.1", ["envoy-gateway-v1.8.3", "gateway-api-v1.5.1"]),
        ("Envoy Gateway v1.9.0 + Gateway API v1.6.1", ["envoy-gateway-v1.9.0", "gateway-api-v1.6.1"]),
    ], envoy_gateway_cases, envoy_gateway_agrees),
    # Dynamo 1.6.1's CRD could not be had here: main of 2026-08-21 (1.5.0) stands in (extract.py).
    Suite("dynamo-operator", [
        ("the Dynamo operator CRD of ai-dynamo/dynamo main 2026-08-21", ["dynamo-main-2026-08-21"]),
    ], dynamo_operator_cases, dynamo_operator_agrees),
    # Istio's CRDs of 1.30.3, from the release's customresourcedefinitions.gen.yaml (extract.py),
    # with the Gateway API release Istio 1.30 builds against (v1.5.1), and v1.6.1 for Istio 1.31
    # (which builds against v1.6.0), kept by the envoy-gateway suite.
    Suite("istio", [
        ("Istio 1.30.3 + Gateway API v1.5.1", ["istio-1.30.3", "envoy-gateway/schemas/gateway-api-v1.5.1"]),
        ("Istio 1.30.3 + Gateway API v1.6.1", ["istio-1.30.3", "envoy-gateway/schemas/gateway-api-v1.6.1"]),
    ], istio_cases, istio_agrees),
    # agentgateway v1.4.1's AgentgatewayPolicy (extract.py), with the Gateway API release it
    # builds against (v1.6.1), kept by the envoy-gateway suite.
    Suite("agentgateway", [
        ("agentgateway v1.4.1 + Gateway API v1.6.1", ["agentgateway-v1.4.1", "envoy-gateway/schemas/gateway-api-v1.6.1"]),
    ], agentgateway_cases, agentgateway_agrees),
]}


# CEL functions and macros celpy evaluates (its standard library and the Kubernetes functions
# given above); a rule calling anything else (isURL, quantity, ...) cannot be checked here.
CELPY_FUNCTIONS = set(celpy.evaluation.base_functions) | set(KUBERNETES_FUNCTIONS) | {
    "has", "all", "exists", "exists_one", "map", "filter"}


def unsupported_rules(suite):
    """Every CEL rule in the kept CRDs that calls a function celpy lacks: `release kind path rule`."""
    found = set()

    def walk(node, path, where):
        if not isinstance(node, dict):
            return
        for validation in node.get("x-kubernetes-validations", []):
            rule = validation["rule"]
            # As Rules.walk evaluates it: an empty optional's hasValue() is false.
            text = re.sub(r"\boldSelf\.hasValue\(\)", "false", rule) if validation.get("optionalOldSelf") else rule
            calls = set(re.findall(r"([A-Za-z_]\w*)\s*\(", re.sub(r"'[^']*'|\"[^\"]*\"", "", text)))
            missing = sorted(calls - CELPY_FUNCTIONS)
            if missing:
                found.add(f"{where}\t{path}\t{rule.strip()}\tcelpy has no {', '.join(missing)}")
            elif validation.get("optionalOldSelf") and re.search(r"\boldSelf\b", text):
                found.add(f"{where}\t{path}\t{rule.strip()}\tcelpy has no optional types")
        for name, child in node.get("properties", {}).items():
            walk(child, f"{path}.{name}", where)
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                walk(node[key], path + ("[]" if key == "items" else "[*]"), where)
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in node.get(key, []):
                walk(sub, path, where)

    for folder in sorted(p.name for p in suite.schemas.iterdir() if p.is_dir()):
        for file in sorted((suite.schemas / folder).glob("*.json")):
            data = json.loads(file.read_text())
            for version, schema in data["versions"].items():
                walk(schema, data["kind"], f"{folder}\t{version}")
    return sorted(found)


def main(argv):
    argv = list(argv)
    name = "envoy-gateway"
    if "--suite" in argv:
        at = argv.index("--suite")
        name = argv[at + 1] if at + 1 < len(argv) else ""
        del argv[at:at + 2]
    if name not in SUITES:
        sys.exit(f"validate.py: --suite must be one of {', '.join(SUITES)}")
    suite = SUITES[name]
    args = [a for a in argv if not a.startswith("--")]
    files = args or sorted(str(p) for p in suite.examples.glob("*.yaml"))
    unchecked = suite.unchecked.relative_to(ROOT)
    if "--self-test" in argv:
        missed = self_test(suite, files)
        suite.say(f"self-test: {missed} broken documents accepted")
        return 1 if missed else 0
    if "--write-unchecked" in argv:
        suite.unchecked.write_text("# The CEL rules of the kept CRDs that celpy cannot evaluate (validate.py --write-unchecked):\n"
                                   f"# folder\tversion\tpath\trule\treason. None is reached by examples/{suite.name}/.\n"
                                   + "".join(line + "\n" for line in unsupported_rules(suite)))
        return 0
    failures, rules = validate(suite, files)
    for problem in suite.agree():
        suite.say(f"DISAGREES {problem}")
        failures += 1
    stale = False
    listed = [l for l in suite.unchecked.read_text().splitlines() if l and not l.startswith("#")]
    if listed != unsupported_rules(suite):
        suite.say(f"{unchecked} is not the list of the kept CRDs' rules celpy cannot evaluate: "
                  f"run validate.py --suite {suite.name} --write-unchecked and read the new ones")
        stale = True
    for kind, path, rule, reason in sorted(rules.unchecked):
        suite.say(f"REACHED, NOT CHECKED ({reason}): {kind} {path}: {rule}")
    suite.say(f"{failures} documents refused, {rules.checked} CEL rule evaluations passed, "
              f"{len(rules.unchecked)} rules reached but not checked; {len(listed)} rules of the kept CRDs "
              f"celpy cannot evaluate ({unchecked}), none reached unless listed above")
    # A rule the examples reach must be checked: one that cannot be is a failure to look at.
    return 1 if failures or stale or rules.unchecked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Reads examples/dynamo-operator/*.yaml (or the files given) with Dynamo's own DGD model, the
pydantic `Config` of `dynamo.profiler.utils.config` in the installed ai-dynamo, and checks what
Dynamo's tools would see: every component parses, the frontend component's `main` container (as
`find_main_container` picks it) is Dynamo's frontend and not the proxy beside it, and the proxy
is still there after a round trip through the model.

Run with the python of a venv holding ai-dynamo (tests/dynamo/run.sh makes one for DYNAMO in
tests/versions.sh):

    .../venv-$DYNAMO/bin/python tests/dynamo-operator/check_model.py [FILE.yaml ...]

Importing `dynamo.profiler.utils.config` imports the `dynamo.planner` package, whose __init__
needs scikit-learn, which that venv leaves out (only the planner uses it). The two planner
modules config.py needs are plain; `dynamo.planner` is registered as a bare package so only
they are loaded. Exit status 0 only if every check passes.
"""

import importlib.metadata
import pathlib
import sys
import types

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
SIDECAR = "bypass-marker"


def load_model():
    import dynamo

    planner = types.ModuleType("dynamo.planner")
    planner.__path__ = [str(pathlib.Path(dynamo.__path__[0]) / "planner")]
    sys.modules.setdefault("dynamo.planner", planner)
    from dynamo.profiler.utils import config

    return config


def check(config, doc):
    """The problems Dynamo's model finds in DGD `doc` (empty if none)."""
    model = config.Config.model_validate(doc)
    problems = []
    frontends = [c for c in model.spec.components if c.component_type == "frontend"]
    if len(frontends) != 1:
        return [f"{len(frontends)} frontend components, not one"]
    frontend = frontends[0]
    main = config.find_main_container(frontend)
    if main is None:
        problems.append(f"find_main_container finds no container in component {frontend.name}")
    elif main.name != "main" or "dynamo.frontend" not in (main.command or []) + (main.args or []):
        problems.append(f"find_main_container picks {main.name!r} ({main.command} {main.args}), not Dynamo's frontend")
    names = [c.name for c in frontend.podTemplate.spec.containers]
    if SIDECAR not in names:
        problems.append(f"no {SIDECAR} container beside main in component {frontend.name}: {names}")
    # What Dynamo's tools write back keeps the proxy and its settings (the model allows extra fields).
    again = config.Config.model_validate(model.model_dump())
    kept = next((c for c in again.spec.components if c.name == frontend.name), None)
    sidecars = [c.model_dump() for c in kept.podTemplate.spec.containers if c.name == SIDECAR] if kept else []
    original = [c for comp in doc["spec"]["components"] if comp["name"] == frontend.name
                for c in comp["podTemplate"]["spec"]["containers"] if c["name"] == SIDECAR]
    if sidecars != original:
        problems.append(f"the {SIDECAR} container changes in a round trip through the model")
    for component in model.spec.components:
        if config.find_main_container(component) is None:
            problems.append(f"component {component.name} has no main container")
    return problems


def main(argv):
    files = argv or sorted(str(p) for p in (ROOT / "examples" / "dynamo-operator").glob("*.yaml"))
    config = load_model()
    version = importlib.metadata.version("ai-dynamo")
    failures = 0
    for file in files:
        for index, doc in enumerate(yaml.safe_load_all(pathlib.Path(file).read_text())):
            if not doc or doc.get("kind") != "DynamoGraphDeployment":
                continue
            name = f"{pathlib.Path(file).name} #{index + 1} {doc['metadata']['name']}"
            try:
                problems = check(config, doc)
            except Exception as error:  # a pydantic ValidationError, or a shape the model refuses
                problems = [f"{type(error).__name__}: {str(error)[:300]}"]
            failures += bool(problems)
            print(f"dynamo-operator: {'FAIL' if problems else 'ok  '} {name} with ai-dynamo {version}'s Config and find_main_container")
            for problem in problems:
                print(f"dynamo-operator:   {problem}")
    # A broken copy must be refused: the proxy first and named main, Dynamo's container renamed.
    doc = yaml.safe_load((ROOT / "examples" / "dynamo-operator" / "frontend-with-sidecar.yaml").read_text())
    frontend = next(c for c in doc["spec"]["components"] if c["type"] == "frontend")
    containers = frontend["podTemplate"]["spec"]["containers"]
    containers[0]["name"], containers[1]["name"] = "dynamo", "main"
    refused = bool(check(config, doc))
    print(f"dynamo-operator: self-test {'ok  ' if refused else 'MISS'} the proxy named main: "
          f"{'refused' if refused else 'accepted'}")
    return 1 if failures or not refused else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

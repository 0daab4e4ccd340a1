#!/usr/bin/env python3
"""Holds dist/grafana/bypass-marker.json to the metrics the front doors export (issue 49): every
metric a query names is one some front door exports, every label it groups by is one of that
metric's (or `front_door`, which the sidecar and the processor carry and the queries give the
module's and the plugin's series with label_replace, or `le` of a histogram's buckets), and each
exporter has a panel. Offline, the standard library only.

The exported names are read from the code that exports them, not from the docs:
- the sidecar and the processor (`bypass-marker proxy`, `bypass-marker ext-proc`): the table at
  the head of bypass-marker/src/metrics.rs (name, labels; a histogram gives _bucket, _sum and
  _count), each series with `front_door`;
- the Envoy dynamic module: bypass-marker-envoy-adapter/src/metrics.rs's counter names and LABELS,
  under Envoy's `envoy_dynamicmodulescustom_` namespace (docs/envoy.md, "The module");
- the proxy-wasm plugin: the same names and labels, as Envoy exports them (Envoy strips its
  `wasmcustom` namespace; the labels come from the bootstrap's stats_tags), and
  bypass-marker-wasm/src/metrics.rs's VM_MEMORY gauge.
The tower layer exposes an observer (FrameObserver) and no metric names of its own.

    python3 tests/grafana/check.py [DASHBOARD.json]   # default: dist/grafana/bypass-marker.json
    python3 tests/grafana/check.py --self-test        # broken queries must be refused
"""

import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
DASHBOARD = ROOT / "dist" / "grafana" / "bypass-marker.json"

# PromQL's functions, aggregations and keywords: identifiers that are not metric names.
PROMQL = set("""abs absent absent_over_time avg avg_over_time bottomk by ceil changes clamp clamp_max
clamp_min count count_over_time count_values day_of_month day_of_week days_in_month delta deriv
exp floor group group_left group_right histogram_quantile holt_winters hour idelta ignoring increase
irate label_join label_replace last_over_time ln log10 log2 max max_over_time min min_over_time
minute month on or and unless offset predict_linear quantile quantile_over_time rate resets round
scalar sgn sort sort_desc sqrt stddev stddev_over_time stdvar sum sum_over_time time timestamp topk
vector without year bool""".split())


def exporters():
    """{exporter: {metric name: set of labels}}."""
    out = {"bypass-marker (sidecar, ext-proc)": {}, "dynamic module": {}, "proxy-wasm plugin": {}}
    head = (ROOT / "bypass-marker" / "src" / "metrics.rs").read_text()
    for name, labels, what in re.findall(r"^//! \| `(bypass_marker_\w+)` \|([^|]*)\| (.*) \|$", head, re.M):
        labels = set(re.findall(r"`(\w+)`", labels)) | {"front_door"}
        if "histogram" in what:
            for suffix in ("_bucket", "_sum", "_count"):
                out["bypass-marker (sidecar, ext-proc)"][name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
        else:
            out["bypass-marker (sidecar, ext-proc)"][name] = labels
    adapter = (ROOT / "bypass-marker-envoy-adapter" / "src" / "metrics.rs").read_text()
    names = re.findall(r'^pub const [A-Z_]+: &str = "(bypass_marker_\w+)";', adapter, re.M)
    (labels,) = re.findall(r"^pub const LABELS: \[&str; \d+\] = \[([^\]]*)\];", adapter, re.M)
    labels = re.findall(r'"(\w+)"', labels)
    if len(names) != len(labels) or not names:
        sys.exit(f"check.py: the adapter's names {names} and LABELS {labels} do not pair up")
    for name, label in zip(names, labels):
        out["dynamic module"]["envoy_dynamicmodulescustom_" + name] = {label}
        out["proxy-wasm plugin"][name] = {label}
    wasm = (ROOT / "bypass-marker-wasm" / "src" / "metrics.rs").read_text()
    for name in re.findall(r'^pub const VM_MEMORY: &str = "(\w+)";', wasm, re.M):
        out["proxy-wasm plugin"][name] = set()
    for exporter, metrics in out.items():
        if not metrics:
            sys.exit(f"check.py: no metric names found for {exporter}")
    return out


def parse(expr):
    """(metric names, labels grouped by or matched) of a PromQL expression."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)           # string literals
    grouped = set()
    for labels in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", text):
        grouped |= {l.strip() for l in labels.split(",") if l.strip()}
    text = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    matched = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", " ".join(re.findall(r"\{([^}]*)\}", text))))
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)                    # ranges
    names = {t for t in re.findall(r"[A-Za-z_:][\w:]*", text) if t not in PROMQL}
    return names, grouped | matched


def check(dashboard, exported):
    """The problems of `dashboard` (a dict) against `exported`."""
    known = {name: labels for metrics in exported.values() for name, labels in metrics.items()}
    problems, used = [], set()
    queries = [(p.get("title", "?"), t.get("expr", "")) for p in dashboard.get("panels", []) for t in p.get("targets", [])]
    if not queries:
        return ["no panel has a query"]
    for title, expr in queries:
        names, labels = parse(expr)
        if not names:
            problems.append(f"{title!r}: {expr!r} names no metric")
        unknown = sorted(names - set(known))
        if unknown:
            problems.append(f"{title!r}: {expr!r} names {', '.join(unknown)}, which no front door exports")
        have = set().union(*(known[n] for n in names if n in known)) | {"front_door"}
        for label in sorted(labels - have):
            problems.append(f"{title!r}: {expr!r} uses the label {label}, which none of {sorted(names)} has")
        if "label_replace" in expr and "front_door" not in expr:
            problems.append(f"{title!r}: {expr!r} relabels without front_door")
        used |= names
    for exporter, metrics in exported.items():
        if not used & set(metrics):
            problems.append(f"no query names a metric of the {exporter}")
    return problems


def self_test(dashboard, exported):
    """Broken copies of the dashboard must be refused; returns how many were accepted."""
    first = dashboard["panels"][0]["targets"][0]["expr"]
    broken = {
        "a misspelled metric": first.replace("frames_removed", "frame_removed"),
        "a label the metric lacks": first.replace("annotation", "status"),
        "the module's name with _total": "sum(rate(envoy_dynamicmodulescustom_bypass_marker_frames_removed_total[5m]))",
        "the plugin's name with the module's prefix dropped and _total": "sum(rate(bypass_marker_vm_memory_bytes_total[5m]))",
        "no metric at all": "vector(1)",
    }
    accepted = 0
    for what, expr in broken.items():
        copy = json.loads(json.dumps(dashboard))
        copy["panels"][0]["targets"][0]["expr"] = expr
        problems = check(copy, exported)
        print(f"self-test {'ok  ' if problems else 'MISS'} {what}: {problems[0] if problems else 'accepted'}")
        accepted += not problems
    return accepted


def main(argv):
    exported = exporters()
    path = pathlib.Path(next((a for a in argv if not a.startswith("--")), DASHBOARD))
    dashboard = json.loads(path.read_text())
    if "--self-test" in argv:
        missed = self_test(dashboard, exported)
        print(f"grafana: self-test: {missed} broken dashboards accepted")
        return 1 if missed else 0
    problems = check(dashboard, exported)
    for problem in problems:
        print(f"FAIL {problem}")
    queries = sum(len(p.get("targets", [])) for p in dashboard.get("panels", []))
    names = sum(len(m) for m in exported.values())
    print(f"grafana: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: {queries} queries over "
          f"{len(dashboard.get('panels', []))} panels, against {names} exported names; {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

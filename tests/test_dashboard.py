"""dashboards/kvtrace-bpf.json: it loads, its variables chain (node ->
engine -> pid), it has the node view, and every panel's expression is
PromQL that Prometheus's own parser accepts (promtool check rules)."""

import json
import re
import subprocess

import yaml

from conftest import ROOT

DASHBOARD = ROOT / "dashboards" / "kvtrace-bpf.json"
PROMTOOL = ROOT / "build" / "promtool"
# what Grafana puts in place of its variables before it sends a query
GRAFANA = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def expressions(dash):
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def as_promql(expr, names):
    for k, v in GRAFANA.items():
        expr = expr.replace(k, v)
    for name in sorted(names, key=len, reverse=True):  # $model before $m
        expr = expr.replace("$" + name, ".*").replace("${" + name + "}", ".*")
    assert "$" not in expr, expr
    return expr


def promtool_rules(tmp_path, exprs):
    """promtool's check of exprs, each a recording rule's expression."""
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    assert PROMTOOL.exists(), f"{PROMTOOL} is missing: run make setup"
    return subprocess.run([str(PROMTOOL), "check", "rules", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_every_panel_expression_is_valid_promql(tmp_path):
    dash = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in dash["templating"]["list"]]
    exprs = [as_promql(e, names) for _, e in expressions(dash)]
    exprs += [as_promql(v["query"]["query"].split("(", 1)[1].rsplit(",", 1)[0], names)
              for v in dash["templating"]["list"] if v["type"] == "query"]
    r = promtool_rules(tmp_path, exprs)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(exprs)} rules found" in r.stdout, r.stdout


def test_the_check_refuses_bad_promql(tmp_path):
    r = promtool_rules(tmp_path, ['sum by (le (kvtrace_ops_total)'])
    assert r.returncode != 0


def test_engine_variable_and_node_view():
    dash = json.loads(DASHBOARD.read_text())
    tl = {v["name"]: v for v in dash["templating"]["list"]}
    assert "instance" in tl["node"]["query"]["query"]
    assert "model_name" in tl["engine"]["query"]["query"] and \
        "$node" in tl["engine"]["query"]["query"]
    assert "$engine" in tl["pid"]["query"]["query"]
    # every kvtrace panel follows the chosen node and engine
    for title, expr in expressions(dash):
        for sel in re.findall(r"kvtrace_\w+\{([^}]*)\}", expr):
            assert 'instance=~"$node"' in sel, (title, expr)
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    assert any(r["title"].startswith("Node") for r in rows)
    node = [p for p in dash["panels"] if p["gridPos"]["y"] > rows[0]["gridPos"]["y"]]
    assert any("kvtrace_targets" in e for p in node for t in p["targets"]
               for e in [t["expr"]])
    assert any("by (instance, model_name, port)" in t["expr"] for p in node
               for t in p["targets"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))

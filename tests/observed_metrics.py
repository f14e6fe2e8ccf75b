"""The metric names that kvbridge's Grafana dashboard and alert rules query, and the names that
real servers export: what tests/test_observability.py and the end-to-end check share."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from cli_procs import run_until_logged

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvbridge.json"
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
# Series Prometheus makes itself, not scraped from any target.
PROMETHEUS_OWN = {"up", "ALERTS", "ALERTS_FOR_STATE"}
# Grafana's variables, as a query is sent to Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h",
                     "$model": ".*"}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable, variables filled in."""
    out: list[tuple[str, str]] = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) \
            else variable["query"]
        # label_values(SERIES, LABEL) is Grafana's; SERIES is PromQL.
        found = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
        assert found, f"variable {variable['name']}: {query}"
        out.append((f"variable {variable['name']}", found[1]))
    return [(where, fill(expr)) for where, expr in out]


def fill(expr: str) -> str:
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    return expr


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def rule_queries() -> list[tuple[str, str]]:
    return [(f"alert {r.get('alert') or r.get('record')}", str(r["expr"])) for r in rules()]


def selected_metrics(expr: str) -> set[str]:
    """The metric names the query's selectors name (its AST, by promql-parser)."""
    import promql_parser

    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def queried_metrics() -> dict[str, list[str]]:
    """Every metric name queried -> where."""
    out: dict[str, list[str]] = {}
    for where, expr in dashboard_queries() + rule_queries():
        for name in selected_metrics(expr):
            out.setdefault(name, []).append(where)
    return out


_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                              "_created"),
             "summary": ("", "_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",),
             "gaugehistogram": ("_bucket", "_gsum", "_gcount")}


def series_names(exposition: str) -> set[str]:
    """The series names a /metrics text exposes, by its families (a labelled family with no
    sample yet counts: its series appear with the first event)."""
    from prometheus_client.parser import text_string_to_metric_families

    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names |= {family.name + s for s in _SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def scrape(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text: str = reply.read().decode()
    return text


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    if proc.stderr is not None:
        proc.stderr.close()


@contextmanager
def control_plane() -> Iterator[dict[str, str]]:
    """A real registry, router and gateway (`kvbridge ... serve`, insecure, on 127.0.0.1 port
    0, metrics on): their /metrics URLs by service."""
    procs: list[subprocess.Popen[str]] = []
    try:
        registry, started = run_until_logged(
            ["registry", "serve", "--insecure", "--listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0"],
            {"KVBRIDGE_REGISTRY_LOG_FORMAT": "json"}, "registry_started")
        procs.append(registry)
        urls = {"registry": f"http://127.0.0.1:{started['metrics_port']}/metrics"}
        registry_at = str(started["listen"])
        router, started = run_until_logged(
            ["router", "serve", "--insecure", "--listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0", "--registry", registry_at],
            {"KVBRIDGE_ROUTER_LOG_FORMAT": "json"}, "router_started")
        procs.append(router)
        urls["router"] = f"http://127.0.0.1:{started['metrics_port']}/metrics"
        gateway, started = run_until_logged(
            ["gateway", "serve", "--insecure", "--listen", "127.0.0.1:0",
             "--router", str(started["listen"]), "--registry", registry_at],
            {"KVBRIDGE_GATEWAY_LOG_FORMAT": "json"}, "gateway_started")
        procs.append(gateway)
        urls["gateway"] = f"{started['url']}/metrics"
        yield urls
    finally:
        for proc in reversed(procs):
            _stop(proc)

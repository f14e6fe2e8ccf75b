"""Generate the Kubernetes monitoring component's PrometheusRule from deploy/prometheus/alerts.yml.

    python scripts/gen_prometheusrule.py           # regenerate in place
    python scripts/gen_prometheusrule.py --check   # fail if the committed one is stale

The alert rules are written once, as a Prometheus rule file (what docker-compose's Prometheus
loads); the PrometheusRule carries the same groups under `spec`. Kustomize cannot read a file
outside its component's folder, so the PrometheusRule is committed, generated, and checked equal
by tests/test_observability.py. The rule file's text is indented as it is, so its comments and
block scalars stay readable in the generated object.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS_RULE = (ROOT / "deploy" / "kubernetes" / "components" / "monitoring"
                   / "prometheusrule.yaml")

HEADER = """\
# GENERATED from deploy/prometheus/alerts.yml by scripts/gen_prometheusrule.py: edit that file
# and run the script (tests/test_observability.py checks the two are equal). What each alert
# means and what to do: docs/observability.md.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kvbridge
  labels: {app.kubernetes.io/name: kvbridge}
spec:
"""


def render(rules_text: str) -> str:
    """The PrometheusRule for a rule file's text: its `groups:` on, indented under `spec`."""
    lines = rules_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("groups:")]
    if len(starts) != 1:
        raise ValueError("the rule file must have one top-level `groups:`")
    body = lines[starts[0]:]
    for line in body[1:]:
        if line and not line.startswith((" ", "#")):
            raise ValueError(f"the rule file has another top-level key after groups: {line!r}")
    return HEADER + "".join(f"  {line}\n" if line else "\n" for line in body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    args = parser.parse_args()
    text = render(RULES.read_text())
    if args.check:
        if PROMETHEUS_RULE.read_text() != text:
            print(f"{PROMETHEUS_RULE.relative_to(ROOT)} is stale: run "
                  "python scripts/gen_prometheusrule.py", file=sys.stderr)
            return 1
        return 0
    PROMETHEUS_RULE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

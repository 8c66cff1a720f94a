"""``remote-dspark dashboard``: the Grafana dashboard that ships with the package.

The JSON lives in ``remote_dspark/dashboards/`` (``dashboards/`` at the repository's top
is a link to it). Its datasource is the template variable ``datasource``; the engines'
panels read the families of :mod:`remote_dspark.engine.observe.metrics` of the engines
the variables ``job`` and ``instance`` pick, the worker row those of
:mod:`remote_dspark.worker.metrics` of the workers ``worker_job`` and ``worker_instance``
pick (each a multi-value variable whose "All" is ``.*``). Every query keeps ``job`` and
``instance`` in its aggregations, so two engines (or workers) are two lines, never one
sum, and rates use ``$__rate_interval``. docs/design/metrics.md says which families are
deliberately left off and why; the tests hold the queries to the tables.
"""

from __future__ import annotations

import argparse
import json
import re
from importlib import resources

NAME = "remote-dspark.json"


def text() -> str:
    return resources.files("remote_dspark").joinpath("dashboards", NAME).read_text()


def queries(dashboard: dict | None = None) -> list[str]:
    """Every PromQL expression of the dashboard, in panel order."""
    d = json.loads(text()) if dashboard is None else dashboard
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def variables(dashboard: dict | None = None) -> dict[str, str]:
    """The query variables (the datasource's aside), each with the value it takes at All."""
    d = json.loads(text()) if dashboard is None else dashboard
    return {v["name"]: v["allValue"] for v in d["templating"]["list"] if v["type"] == "query"}


def as_sent(expr: str, rate_interval: str = "1m", dashboard: dict | None = None) -> str:
    """``expr`` as Grafana sends it with every variable at All and ``$__rate_interval``
    at ``rate_interval``: the PromQL that Prometheus (or promtool) can check.

    Raises:
        ValueError: ``expr`` names a variable the dashboard does not define.
    """
    values = variables(dashboard) | {"__rate_interval": rate_interval}

    def value(m: re.Match) -> str:
        if m.group(1) not in values:
            raise ValueError(f"query {expr!r}: ${m.group(1)} is no variable of the dashboard ({sorted(values)})")
        return values[m.group(1)]

    return re.sub(r"\$(\w+)", value, expr)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "dashboard",
        help="print the Grafana dashboard JSON",
        description="Print the Grafana dashboard (import it in Grafana: Dashboards > New > "
        "Import). Pick the Prometheus datasource in its 'datasource' variable, and the engines "
        "and workers to show in its job and instance variables (All by default).",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write it to FILE instead of standard output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    body = text()
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(body)
        except OSError as e:
            raise ValueError(f"--output {args.output!r}: {e.strerror}") from e
    else:
        print(body, end="")
    return 0

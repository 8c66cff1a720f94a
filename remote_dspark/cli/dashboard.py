"""``remote-dspark dashboard``: the Grafana dashboard that ships with the package.

The JSON lives in ``remote_dspark/dashboards/`` (``dashboards/`` at the repository's top
is a link to it). Its datasource is the template variable ``datasource``; every query
uses the metrics of :mod:`remote_dspark.engine.observe.metrics` and ``$__rate_interval``.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources

NAME = "remote-dspark.json"


def text() -> str:
    return resources.files("remote_dspark").joinpath("dashboards", NAME).read_text()


def queries(dashboard: dict | None = None) -> list[str]:
    """Every PromQL expression of the dashboard, in panel order."""
    d = json.loads(text()) if dashboard is None else dashboard
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "dashboard",
        help="print the Grafana dashboard JSON",
        description="Print the Grafana dashboard (import it in Grafana: Dashboards > New > "
        "Import). Pick the Prometheus datasource in its 'datasource' variable.",
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

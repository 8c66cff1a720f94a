"""The Grafana dashboard: valid JSON for Grafana 10+, queries promtool accepts, every
query selected by the dashboard's variables and keeping one line per engine or worker,
each panel in the unit of what it shows, and every family of the engine's and the
worker's tables on a panel or named in docs/design/metrics.md as left off (and no query
naming a family nobody exports). The queries against a real Prometheus:
tests/engine/observe/test_metrics.py and tests/worker/test_worker_metrics.py."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from helpers import NEED_TOOLS, PROMTOOL, REPO

from remote_dspark.cli import dashboard
from remote_dspark.engine.observe.metrics import TABLE as ENGINE_TABLE
from remote_dspark.worker.metrics import TABLE as WORKER_TABLE

DASHBOARD = json.loads(dashboard.text())
PANELS = [p for p in DASHBOARD["panels"] if p["type"] != "row"]
METRIC = re.compile(r"\bdspark_(?:remote|worker)_[a-z0-9_]*[a-z0-9]")
SELECTORS = {  # the variables that select each side's series
    "dspark_remote_": '{job=~"$job", instance=~"$instance"}',
    "dspark_worker_": '{job=~"$worker_job", instance=~"$worker_instance"}',
}


def exported(*tables) -> dict[str, str]:
    """Every family the tables export, by its name as exposed, to its kind."""
    return {
        t.prefix + row.name + ("_total" if row.kind == "counter" else ""): row.kind for t in tables for row in t.rows
    }


def family_of(name: str, families: dict[str, str]) -> str | None:
    """The family a query's metric name reads (a histogram's through its series), or None."""
    if name in families:
        return name
    base, _, suffix = name.rpartition("_")
    return base if suffix in ("bucket", "sum", "count") and families.get(base) == "histogram" else None


def left_off() -> set[str]:
    """The families docs/design/metrics.md names as deliberately left off the dashboard."""
    text = (Path(REPO) / "docs" / "design" / "metrics.md").read_text()
    section = text.split("Left off the dashboard:", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^- `(dspark_[a-z0-9_]+)`", section, re.M))


def out_of_step(families: dict[str, str], queries: list[str], off: set[str]) -> list[str]:
    """What keeps the dashboard, the tables and the docs' list apart: empty when in step."""
    named = {m: family_of(m, families) for e in queries for m in METRIC.findall(e)}
    shown = {f for f in named.values() if f}
    return (
        [f"a query names {m}, which no table exports" for m, f in sorted(named.items()) if f is None]
        + [f"{f} is on no panel and not left off in the docs" for f in sorted(set(families) - shown - off)]
        + [f"{f} is left off in the docs but exported by no table" for f in sorted(off - set(families))]
        + [f"{f} is on a panel and left off in the docs" for f in sorted(shown & off)]
    )


def test_every_family_is_on_a_panel_or_left_off_in_the_docs():
    assert left_off() and out_of_step(exported(ENGINE_TABLE, WORKER_TABLE), dashboard.queries(), left_off()) == []


def test_a_family_added_to_a_table_or_a_query_of_nothing_puts_them_out_of_step():
    families, queries, off = exported(ENGINE_TABLE, WORKER_TABLE), dashboard.queries(), left_off()
    assert out_of_step(families | {"dspark_worker_new_total": "counter"}, queries, off) == [
        "dspark_worker_new_total is on no panel and not left off in the docs"
    ]
    assert out_of_step(families, [*queries, "rate(dspark_remote_gone_total[1m])"], off) == [
        "a query names dspark_remote_gone_total, which no table exports"
    ]
    assert out_of_step(families, [*queries, "dspark_remote_session_id"], off) == [
        "dspark_remote_session_id is on a panel and left off in the docs"
    ]


def test_dashboard_is_valid_grafana_json():
    d = DASHBOARD
    assert d["title"] and d["uid"] and d["schemaVersion"] == 39
    ds, *variables = d["templating"]["list"]
    assert (ds["name"], ds["type"], ds["query"]) == ("datasource", "datasource", "prometheus")
    assert [v["name"] for v in variables] == ["job", "instance", "worker_job", "worker_instance"]
    for v in variables:
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}" and v["multi"] and v["includeAll"]
        assert v["query"]["query"] == v["definition"] and v["definition"].startswith("label_values(")
    # instance is of the jobs picked: chained to its side's job variable
    assert '{job=~"$job"}' in variables[1]["definition"] and '{job=~"$worker_job"}' in variables[3]["definition"]
    assert len(PANELS) >= 20 and len({p["id"] for p in d["panels"]}) == len(d["panels"])
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert set(g) == {"x", "y", "w", "h"} and 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
    for p in PANELS:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"] and p["description"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def test_every_query_selects_by_the_variables_and_keeps_one_line_per_instance():
    for p in PANELS:
        for t in p["targets"]:
            e = t["expr"]
            for m in re.finditer(METRIC.pattern + r"(\{[^}]*\})?", e):
                want = SELECTORS[m.group(0)[: len("dspark_remote_")]]
                assert m.group(1) == want, f"{p['title']}: {m.group(0)} is not selected by {want}"
            for agg in re.finditer(
                r"\b(sum|max|min|avg|count|group|topk|bottomk|quantile)\b\s*(by\s*\(([^)]*)\))?\s*\(", e
            ):
                kept = {label.strip() for label in (agg.group(3) or "").split(",")}
                assert {"job", "instance"} <= kept, f"{p['title']}: {agg.group(0)} merges engines in {e}"
            assert "{{instance}}" in t["legendFormat"], f"{p['title']}: a legend that does not name the instance"


def expected_unit(expr: str) -> str:
    """The unit a query's series have, from its metric names' base units."""
    if "_bytes" in expr:
        return "bytes"
    if "_cpu_seconds_total" in expr:
        return "suffix: cores"  # CPU seconds a second
    if "time() -" in expr:
        return "s"
    if "histogram_quantile" in expr:
        return "s" if "_seconds_bucket" in expr else "percentunit" if "_ratio_bucket" in expr else "short"
    if "_sum{" in expr and "_count{" in expr:  # a histogram's mean
        return "s" if "_seconds_sum{" in expr else "short"
    if "_seconds_sum{" in expr or " / " in expr:  # a busy fraction; a ratio of two rates
        return "percentunit"
    if "rate(" in expr:
        return "ops"
    if re.search(r"_(state|up)\{", expr):
        return "bool"
    if "_info{" in expr:
        return "none"
    return "short"  # a count: slots, streams, blocks, connections, tokens


def test_every_panel_has_the_unit_of_what_it_shows():
    for p in PANELS:
        units = {o["matcher"]["options"]: o["properties"][0]["value"] for o in p["fieldConfig"]["overrides"]}
        for t in p["targets"]:
            unit = units.get(t["refId"], p["fieldConfig"]["defaults"].get("unit"))
            assert unit == expected_unit(t["expr"]), f"{p['title']} {t['refId']}: {unit} for {t['expr']}"
    units = {p["fieldConfig"]["defaults"]["unit"] for p in PANELS}
    assert {"bytes", "s", "percentunit", "suffix: cores", "ops", "bool"} <= units


def test_dashboard_queries_pass_promtool(tmp_path):
    assert PROMTOOL, NEED_TOOLS
    rules = [
        {"record": f"dashboard:query_{i}", "expr": dashboard.as_sent(e)} for i, e in enumerate(dashboard.queries())
    ]
    path = tmp_path / "rules.json"  # JSON is YAML
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_as_sent_fills_every_variable_and_refuses_an_unknown_one():
    assert dashboard.as_sent('rate(x{job=~"$worker_job"}[$__rate_interval])', "5s") == 'rate(x{job=~".*"}[5s])'
    assert all("$" not in dashboard.as_sent(e) for e in dashboard.queries())
    with pytest.raises(ValueError, match=r"\$engine is no variable"):
        dashboard.as_sent('x{instance=~"$engine"}')


def test_dashboard_command_prints_it(capsys):
    from remote_dspark.cli.main import main

    assert main(["dashboard"]) == 0
    assert json.loads(capsys.readouterr().out)["uid"] == "remote-dspark"

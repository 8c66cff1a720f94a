"""The one collector: a tiny table (an info, a counter with one label and one with two,
a gauge, a state gauge, a gauge present only sometimes, a histogram) walked over a record
gives exactly this exposition; rows that break the table's rules are refused."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from remote_dspark.histogram import Histogram
from remote_dspark.metrics.families import Family, Table, TableCollector, counter, gauge, histogram, info, one_hot

TINY = Table(
    "t_",
    (
        info("info", "What it is.", ("name", "version"), lambda r: ("tiny", r["version"])),
        counter("hits", "Hits by kind.", lambda r: r["hits"], labels=("kind",)),
        counter("pairs", "Pairs by side.", lambda r: {("a", "x"): 1}, labels=("left", "right")),
        gauge("level", "The level now.", lambda r: r["level"]),
        gauge("state", "1 for the current state.", lambda r: one_hot(("up", "down"), r["state"]), labels=("state",)),
        gauge("spare", "There only when the record says so.", lambda r: 1, when=lambda r: r["spare"]),
        histogram("wait_seconds", "Waits.", lambda r: Histogram((0.1, 1.0), (1, 2, r["slow"]), 4.5)),
    ),
)

EXPOSITION = """\
# HELP t_info What it is.
# TYPE t_info gauge
t_info{name="tiny",version="1"} 1.0
# HELP t_hits_total Hits by kind.
# TYPE t_hits_total counter
t_hits_total{kind="a"} 3.0
t_hits_total{kind="b"} 0.0
# HELP t_pairs_total Pairs by side.
# TYPE t_pairs_total counter
t_pairs_total{left="a",right="x"} 1.0
# HELP t_level The level now.
# TYPE t_level gauge
t_level 0.5
# HELP t_state 1 for the current state.
# TYPE t_state gauge
t_state{state="up"} 0.0
t_state{state="down"} 1.0
# HELP t_wait_seconds Waits.
# TYPE t_wait_seconds histogram
t_wait_seconds_bucket{le="0.1"} 1.0
t_wait_seconds_bucket{le="1.0"} 3.0
t_wait_seconds_bucket{le="+Inf"} 6.0
t_wait_seconds_count 6.0
t_wait_seconds_sum 4.5
"""


def record(**kw) -> dict:
    return dict(version="1", hits={"a": 3, "b": 0}, level=0.5, state="down", spare=False, slow=3) | kw


def exposition(read) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(TableCollector(TINY, read))
    return generate_latest(registry).decode()


def test_a_tiny_table_is_exposed_row_by_row_in_order():
    assert exposition(record) == EXPOSITION


def test_the_record_is_read_once_per_scrape_and_a_row_is_there_only_when_it_says():
    reads = []

    def read():
        reads.append(1)
        return record(spare=len(reads) == 2, level=float(len(reads)))

    # A registry that would collect at register time to learn the names: describe()
    # answers, so registering reads nothing.
    registry = CollectorRegistry(auto_describe=True)
    registry.register(TableCollector(TINY, read))
    assert reads == []
    first = generate_latest(registry).decode()
    assert len(reads) == 1
    second = generate_latest(registry).decode()
    assert len(reads) == 2
    assert "t_spare" not in first and "t_level 1.0" in first
    assert "# TYPE t_spare gauge\nt_spare 1.0\n" in second and "t_level 2.0" in second


def test_a_wrong_count_of_label_values_is_an_error_not_a_mislabelled_sample():
    with pytest.raises(ValueError, match="metric hits: label values"):
        list(TINY.collect(record(hits={("a", "extra"): 1})))


@pytest.mark.parametrize(
    "row, why",
    [
        (lambda: Family("summary", "x", "X.", lambda r: 0), "kind"),
        (lambda: Family("histogram", "x", "X.", lambda r: None, ("a",)), "takes no labels"),
        (lambda: info("about", "X.", ("a",), lambda r: ("1",)), "ending in info"),
        (lambda: info("info", "X.", (), lambda r: ()), "has labels"),
        (lambda: Table("t_", (gauge("x", "X.", lambda r: 0), counter("x", "X.", lambda r: 0))), "twice"),
    ],
)
def test_rows_that_break_the_tables_rules_are_refused(row, why):
    with pytest.raises(ValueError, match=why):
        row()


def test_one_hot_is_one_for_the_current_state_only():
    assert one_hot(("closed", "open", "probing"), "open") == {"closed": 0.0, "open": 1.0, "probing": 0.0}
    assert one_hot(("off", "none"), "gone") == {"off": 0.0, "none": 0.0}

"""Metric families declared as a table, and the one collector that walks it: the
engine's (:mod:`~remote_dspark.engine.observe.metrics`, ``dspark_remote_``) and the worker's
(:mod:`~remote_dspark.worker.metrics`, ``dspark_worker_``) are each a :class:`Table`.

A row (:class:`Family`) says everything about one family: its kind, its name under the
table's prefix, its help text, its label names, how its value comes from the record the
side reads once per scrape, and when it is there at all. :meth:`Table.collect` builds the
prometheus_client families from one record, row by row, in the table's order: what a
scrape shows is the table and nothing else, and a test can walk the same rows.

Imports prometheus_client: never imported by the proxy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..histogram import Histogram

R = TypeVar("R")

COUNTER, GAUGE, HISTOGRAM, INFO = "counter", "gauge", "histogram", "info"
KINDS = (COUNTER, GAUGE, HISTOGRAM, INFO)


@dataclass(frozen=True)
class Family(Generic[R]):
    """One row of a table: a metric family and where its value comes from.

    ``value(record)`` gives, by ``kind``:

    - counter or gauge without labels: the number;
    - counter or gauge with labels: a mapping from label value (a tuple of them when
      there are several labels) to number, one sample each, in the mapping's order;
    - histogram: a :class:`~remote_dspark.histogram.Histogram` (no labels);
    - info: the label values, in the order of ``labels``.

    ``name`` is as exposed, less the prefix and less the ``_total`` that prometheus_client
    adds to a counter; an info row's name is ``info`` or ends in ``_info``, as exposed.
    ``when(record)`` false leaves the family out of that scrape: absent, not zero, for a
    number the record does not have (no supervisor, margins not asked for, no cache).
    """

    kind: str
    name: str
    help: str
    value: Callable[[R], Any]
    labels: tuple[str, ...] = ()
    when: Callable[[R], bool] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"metric {self.name}: kind {self.kind!r}, expected one of {KINDS}")
        if self.kind == HISTOGRAM and self.labels:
            raise ValueError(f"metric {self.name}: a histogram row takes no labels")
        if self.kind == INFO and not (self.labels and (self.name == "info" or self.name.endswith("_info"))):
            raise ValueError(f"metric {self.name}: an info row has labels and a name ending in info")


# A constructor per kind, so that a table reads kind, name, help, value, labels, when.


def counter(name: str, doc: str, value: Callable[[R], Any], labels: tuple[str, ...] = (), when=None) -> Family[R]:
    return Family(COUNTER, name, doc, value, labels, when)


def gauge(name: str, doc: str, value: Callable[[R], Any], labels: tuple[str, ...] = (), when=None) -> Family[R]:
    return Family(GAUGE, name, doc, value, labels, when)


def histogram(name: str, doc: str, value: Callable[[R], Histogram], when=None) -> Family[R]:
    return Family(HISTOGRAM, name, doc, value, (), when)


def info(name: str, doc: str, labels: tuple[str, ...], value: Callable[[R], Iterable[str]]) -> Family[R]:
    return Family(INFO, name, doc, value, labels)


def one_hot(names: Iterable[str], current: object) -> dict[str, float]:
    """A state gauge's samples: 1 for the current state, 0 for every other."""
    return {name: 1.0 if name == current else 0.0 for name in names}


@dataclass(frozen=True)
class Table(Generic[R]):
    """A side's metric families under one name prefix, in exposition order."""

    prefix: str
    rows: tuple[Family[R], ...]

    def __post_init__(self):
        names = [row.name for row in self.rows]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.prefix} table: a family named twice")

    def collect(self, record: R) -> Iterator[Metric]:
        """The families of ``record``, one per row whose ``when`` holds, in row order."""
        for row in self.rows:
            if row.when is None or row.when(record):
                yield self.family(row, row.value(record))

    def family(self, row: Family[R], value: Any) -> Metric:
        """``row``'s prometheus_client family holding ``value`` (as :class:`Family` says)."""
        name = self.prefix + row.name
        if row.kind == INFO:
            fam = InfoMetricFamily(name.removesuffix("_info"), row.help)
            fam.add_metric([], dict(zip(row.labels, _label_values(row, value))))
            return fam
        if row.kind == HISTOGRAM:
            fam = HistogramMetricFamily(name, row.help)
            fam.add_metric([], value.cumulative(), value.sum)
            return fam
        cls = CounterMetricFamily if row.kind == COUNTER else GaugeMetricFamily
        if not row.labels:
            return cls(name, row.help, value=value)
        fam = cls(name, row.help, labels=row.labels)
        for key, number in value.items():
            fam.add_metric(_label_values(row, key), number)
        return fam


def _label_values(row: Family, key: str | Iterable[str]) -> list[str]:
    """One sample's label values: a lone string for a row of one label, else one value
    per label (a wrong count would expose the sample under the wrong labels)."""
    values = [key] if isinstance(key, str) else list(key)
    if len(values) != len(row.labels):
        raise ValueError(f"metric {row.name}: label values {values!r} for labels {row.labels!r}")
    return values


class TableCollector(Collector):
    """Walks ``table`` over ``read()``, called once per scrape: every family of a scrape
    comes from that one record, a consistent moment of its owners.

    :meth:`describe` is empty: which families a scrape has depends on the record (a
    row's ``when``), and a registry must not read it at register time (an engine that is
    not started has none)."""

    def __init__(self, table: Table[R], read: Callable[[], R]):
        self.table = table
        self.read = read

    def describe(self):
        return []

    def collect(self) -> Iterator[Metric]:
        return self.table.collect(self.read())

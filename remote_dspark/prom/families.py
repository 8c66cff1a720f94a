"""Prometheus metric families under one name prefix: the engine's collector
(:mod:`~remote_dspark.engine.metrics`, ``dspark_remote_``) and the worker's
(:mod:`~remote_dspark.worker.metrics`, ``dspark_worker_``) build theirs the same way.
Imports prometheus_client: never imported by the proxy."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..histogram import Histogram


class Families:
    def __init__(self, prefix: str):
        self.prefix = prefix

    def counter(self, name: str, doc: str, value: float | None = None, labels: tuple[str, ...] = ()):
        return CounterMetricFamily(self.prefix + name, doc, value=value, labels=labels or None)

    def gauge(self, name: str, doc: str, value: float | None = None, labels: tuple[str, ...] = ()):
        return GaugeMetricFamily(self.prefix + name, doc, value=value, labels=labels or None)

    def histogram(self, name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
        """From a non-cumulative :class:`~remote_dspark.histogram.Histogram` (its last
        bucket: +Inf)."""
        fam = HistogramMetricFamily(self.prefix + name, doc)
        fam.add_metric([], hist.cumulative(), hist.sum)
        return fam

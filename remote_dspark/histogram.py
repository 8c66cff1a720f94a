"""Fixed-bucket histograms: the frozen record both sides export, and the cheap counter
the worker observes into on its round path.

:class:`Histogram` is a snapshot (upper bounds, per-bucket counts with one more bucket
than bounds for +Inf, the sum), not cumulative; :meth:`Histogram.cumulative` gives the
``le`` buckets Prometheus wants. :class:`HistogramCounter` is the mutable side: one
``bisect`` and two additions per observation, no allocation. It has no lock of its own:
its owner observes and snapshots it under the lock that already guards its other
counters.

Lowest layer on purpose: the engine (``engine.observe.stats``, ``metrics``) and the worker
(``worker``, ``worker.metrics``) both use it, and neither side imports the other.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Seconds, 50 us to 10 s: a worker's round is 0.1-1 ms for the Markov drafter on loopback,
# tens of milliseconds for a neural one; a round past the engine's deadline still lands.
WORKER_SECONDS_BOUNDS = (
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True)
class Histogram:
    """Upper bounds and per-bucket counts (one more bucket than bounds: +Inf), and the
    sum of the observed values. Not cumulative."""

    bounds: tuple[float, ...]
    buckets: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.buckets)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of observations <= le)`` per bucket, ``le`` as Prometheus writes
        it (the last ``"+Inf"``)."""
        running, out = 0, []
        for bound, count in zip(list(self.bounds) + [float("inf")], self.buckets):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out

    @classmethod
    def from_region(cls, h) -> Histogram:
        """A region histogram (``shm.words.HistogramWords``: ``bounds_ns``, ``buckets``, ``sum_ns``) in seconds."""
        return cls(tuple(b / 1e9 for b in h.bounds_ns), tuple(h.buckets), h.sum_ns / 1e9)


class HistogramCounter:
    """Counts observations into fixed buckets (``bounds`` ascending; a value equal to a
    bound falls in that bound's bucket, as Prometheus's ``le``).

    Not thread-safe by itself: the caller holds the lock that guards it (one writer at a
    time), and :meth:`snapshot` under the same lock.
    """

    __slots__ = ("bounds", "buckets", "sum")

    def __init__(self, bounds: tuple[float, ...] = WORKER_SECONDS_BOUNDS):
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds {bounds!r}: must be strictly ascending")
        self.bounds = tuple(bounds)
        self.buckets = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.buckets[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> Histogram:
        return Histogram(self.bounds, tuple(self.buckets), self.sum)

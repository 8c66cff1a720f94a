"""The hand-off benchmark's options (:class:`HandoffOptions`), figures (:class:`LatencySummary`,
:class:`HandoffRow`) and timeouts, shared by its CPU rows (:mod:`.run`), its CUDA rows (:mod:`.cuda`) and their peers
(:mod:`.peers`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

ROUND_TIMEOUT_S = 30.0  # generous: a hog row waits up to a switch interval per call
HOLD_GIL_US = 50


@dataclass(frozen=True)
class LatencySummary:
    median_us: float
    p99_us: float
    max_us: float

    @classmethod
    def of(cls, ns: list[int]) -> LatencySummary:
        s = sorted(ns)
        return cls(s[len(s) // 2] / 1e3, s[max(0, math.ceil(0.99 * len(s)) - 1)] / 1e3, s[-1] / 1e3)


@dataclass(frozen=True)
class HandoffRow:
    mode: str
    hog: bool
    timed_in: str  # "C" or "Python"
    latency: LatencySummary
    gil_wait: LatencySummary | None  # only for rows timed in C
    after_idle: LatencySummary | None = (
        None  # rounds after an idle gap (the peer's wake-up; see run_all, bench.handoff.cuda)
    )
    slow: int | None = None  # CUDA rows: rounds over the p99 target


@dataclass(frozen=True)
class HandoffOptions:
    rounds: int
    warmup: int
    spin_us: int
    nap_us: int
    hold_gil_us: int = HOLD_GIL_US
    pin: bool = True
    idle_us: int = 0

    def pause(self) -> None:
        """The gap before a round (``--idle-us``)."""
        if self.idle_us:
            time.sleep(self.idle_us / 1e6)

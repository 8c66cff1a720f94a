"""The engine's periodic report: a log line every ``LOG_EVERY`` rounds and the JSON stats
file (``STATS_FILE``), both from the one :class:`~remote_dspark.engine.observe.stats.Stats`
record the metrics show too."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .stats import Stats
from .statsfile import write_json_atomic

log = logging.getLogger("remote_dspark.engine")

STATS_FILE_MIN_S = 2.0  # the stats file is rewritten every LOG_EVERY rounds, at most this often


class Report:
    """Owned by the engine thread (``round_done``) and ``close()`` (``write``)."""

    def __init__(self, log_every: int, stats_file: str, leader: Callable[[], bool]):
        self.log_every, self.stats_file, self._leader = log_every, stats_file, leader
        self.rounds = 0  # rounds and launches asked
        self._written_at = -STATS_FILE_MIN_S

    def round_done(self, stats: Callable[[], Stats]) -> None:
        """After every round or launch: the log line every LOG_EVERY of them, and the
        stats file then too, at most every STATS_FILE_MIN_S."""
        self.rounds += 1
        if not self.log_every or self.rounds % self.log_every:
            return
        s = stats()
        sup = s.supervisor
        log.info(
            "remote DSpark: %d rounds (%s); late %d; budget %s%s",
            s.total_rounds,
            " ".join(f"{o.label}={n}" for o, n in s.rounds.items() if n),
            s.link.late,
            sup.budget_left if sup else "-",
            f"; announcing {s.announce.announcing} slots" if s.announce.announcing else "",
        )
        now = time.monotonic()
        if now - self._written_at >= STATS_FILE_MIN_S:
            self._written_at = now
            self.write(s)

    def write(self, stats: Stats) -> None:
        """The stats file now (rank 0 only under tensor parallelism); a failure is one
        warning, never the engine's."""
        if not self.stats_file or not self._leader():
            return
        try:
            write_json_atomic(self.stats_file, stats.to_json())
        except (OSError, ValueError) as e:
            log.warning("remote DSpark: cannot write %s: %s", self.stats_file, e)

"""The worker's options: one frozen record (:class:`WorkerOptions`), checked when built.

The command line (``remote-dspark worker``) builds one from its flags; a test or a
script gives :class:`~remote_dspark.worker.server.Worker` the few it changes by name
(``Worker(drafter, "127.0.0.1", 0, window=16)``), the rest are these defaults.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import wire
from ..transport.auth import Key
from .fair import DEFAULT_CALL_SHARE
from .faults import Faults
from .limits import DEFAULT_MAX_ROW_BYTES, DEFAULT_MAX_SLOTS, DEFAULT_WINDOW, Limits
from .sessions import DEFAULT_HISTORY_MB, RECENT_S

ROUND_PATHS = ("served", "native", "python")  # WorkerOptions.round_path, --round-path


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """What a worker serves with. Its own limits (``window``, ``max_slots``,
    ``max_row_bytes``, ``max_round_tokens``, ``max_round_bytes``:
    :class:`~remote_dspark.worker.limits.Limits`) refuse a HELLO beyond them; admission
    (``max_pending``, ``hello_timeout_s``) and places (``max_connections`` served
    connections, ``max_engines`` sessions, none displaced within ``recent_s`` of its last
    round) are described in :mod:`~remote_dspark.worker.server`. ``sessions_clock``
    (``time.monotonic``) dates those places' HELLOs and rounds, and ``recent_s`` is
    measured on it (:class:`~remote_dspark.worker.sessions.Sessions`): a test passes a
    fake one and advances it.

    ``history_mb`` bounds the memory of all sessions' windows (:class:`~.sessions.Sessions`:
    a HELLO past it is refused busy).

    ``faults`` (None: none) makes replies late or garbled on purpose, for chaos runs and
    tests (:class:`~remote_dspark.worker.faults.Faults`, changed from any thread or a
    signal handler while the worker serves).

    ``key`` (None: none) is the pre-shared key (``--key-file``): each side proves it holds
    it before a HELLO is served (:mod:`.admission`); a failure is refused ``auth``.

    ``max_batch_entries``, ``max_batch_tokens`` (None: derived at start) bound one drafting
    call, ``batching`` (False: one round a call) is the scheduler's
    (:class:`~remote_dspark.worker.scheduler.Scheduler`); so is ``call_deadline_share``, the
    ceiling of a call's time budget as a share of the tightest deadline queued
    (:mod:`~remote_dspark.worker.fair`).

    ``round_path``: "served" (every round in C from its bytes in to its reply out: the
    Markov drafter's greedy sessions on their lanes, :mod:`.lane`, every other
    connection by the hub, :mod:`.hub`; with faults to inject, "native"), "native" (a
    thread a connection, the round in by C, :mod:`.native_round`) or "python" (the
    reference).

    ``metrics_port`` (None: off; 0: any free port) serves ``/metrics``, ``/healthz`` and
    ``/readyz`` on ``metrics_host`` (loopback by default) from ``start()`` to ``stop()``
    (:mod:`~remote_dspark.worker.metrics`, which needs prometheus_client: imported only then).

    Raises (at construction): ValueError naming the option and its value.
    """

    window: int = DEFAULT_WINDOW
    max_slots: int = DEFAULT_MAX_SLOTS
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    max_round_tokens: int | None = None
    max_round_bytes: int | None = None
    max_engines: int = 32
    history_mb: int = DEFAULT_HISTORY_MB
    max_connections: int = 32
    max_pending: int = 128
    hello_timeout_s: float = 2.0
    frame_timeout_s: float = 10.0
    recent_s: float = RECENT_S
    sessions_clock: Callable[[], float] = time.monotonic
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    faults: Faults | None = None
    key: Key | None = None
    max_batch_entries: int | None = None
    max_batch_tokens: int | None = None
    batching: bool = True
    call_deadline_share: float = DEFAULT_CALL_SHARE
    round_path: str = "served"
    limits: Limits = field(init=False, repr=False, compare=False)  # the first five, checked (Limits)

    def __post_init__(self):
        if self.round_path not in ROUND_PATHS:
            raise ValueError(f"round_path {self.round_path!r}: one of {', '.join(ROUND_PATHS)}")
        if not 1 <= self.window <= wire.MAX_CONTEXT:
            raise ValueError(f"window {self.window}: not in 1..{wire.MAX_CONTEXT}")
        if not 0 < self.call_deadline_share <= 1:
            raise ValueError(f"call_deadline_share {self.call_deadline_share}: not in (0, 1] (--call-deadline-share)")
        if self.history_mb < 1:
            raise ValueError(f"history_mb {self.history_mb}: must be >= 1 (--history-mb)")
        if self.max_connections < 1 or self.max_pending < 1:
            raise ValueError(f"max_connections {self.max_connections}, max_pending {self.max_pending}: must be >= 1")
        if not (self.hello_timeout_s > 0 and self.frame_timeout_s > 0):
            raise ValueError(
                f"hello_timeout_s {self.hello_timeout_s}, frame_timeout_s {self.frame_timeout_s}: must be > 0"
            )
        limits = Limits(
            self.max_slots, self.max_row_bytes, self.max_round_tokens, self.max_round_bytes, window=self.window
        )
        object.__setattr__(self, "limits", limits)  # derived once, here: the record stays frozen

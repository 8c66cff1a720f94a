"""The warm standby: a proxy process started ahead of need, so a lost proxy is replaced
in milliseconds instead of an interpreter's start (80-100 ms on a 2-core machine, more
under load).

A standby has started its interpreter, done its imports, loaded the native library and
mapped the region, then sleeps on the region's ``standby_go`` futex word
(``remote_dspark.proxy_proc.wait_for_promotion``). It takes no proxy role before its promotion: it has
not attached as the region's proxy, connected or said HELLO (the worker would take a
HELLO with this engine's id for a new session and drop the live one's windows). When
the supervisor loses its proxy and its budget allows a respawn, it promotes a ready
standby (``promote(pid, session, within_s)``: the new session in the header, then an
offer of the role in ``standby_go``, which the standby accepts from its wait) and starts
the next standby once the promoted one serves.

A standby proves it is alive before it is promoted: it must accept the offer within
``ANSWER_S`` (it answers within a futex wake-up, tens of microseconds). One that does
not (SIGSTOPped, hung, its SIGKILL pending: alive to its pidfd, yet it would never
serve) is never promoted: the offer is withdrawn (the native handshake has exactly one
winner, so it cannot take the role later), it is killed and counted as a standby
death, and the supervisor starts a fresh proxy on the same respawn. A standby still
starting is not offered the role (it could not answer yet): the fresh proxy replaces
it too.

:class:`Standby` is owned by the supervisor and used only under its lock, from its
watcher thread (and ``close``). A standby that dies before its promotion is replaced
without touching the respawn budget, after a back-off of its own; after
``GIVE_UP_AFTER`` deaths in a row (a planted module, a broken library: it would never
work) none is kept, and one error line says why.

Its lifecycle is one value (:data:`StandbyState`), changed only by :meth:`Standby._to`;
the process and its pidfd are carried by the states that have one:

    Idle --spawn--> Warming --says it is ready--> Ready
    Idle --spawn failed--+
    Warming --exit------+--> the GIVE_UP_AFTER-th in a row? --yes--> GivenUp
    Ready --exit---------+                                    --no---> Idle (a back-off)
    Ready --silent when offered the role: killed--+ (a death, as above)
    Ready --promoted, or stopped; Warming --stopped--> Idle (no back-off)
"""

from __future__ import annotations

import enum
import logging
import os
import select
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from ..proxy.spawn import end, kill, kill_by_pid, reap

log = logging.getLogger("remote_dspark.supervisor")

GIVE_UP_AFTER = 3  # standbys dying in a row before none is kept
# How long a ready standby has to accept its promotion. It answers within a futex
# wake-up: 50 us at the median on the 2-core machine at load 6, 5.5 ms at worst over 30
# promotions; the rest is room for a starved scheduler (a live standby found silent is
# killed and counted as a death). A frozen one costs this before the fresh start, which
# takes longer itself (0.1-0.5 s there).
ANSWER_S = 0.05
KILL_WAIT_S = 1.0  # for the exit of a standby SIGKILLed (silent when offered the role, or unwatchable)
BACKOFF_S = 0.5  # before the next standby after one died; doubles each time


class StandbyPhase(str, enum.Enum):
    """A standby state's name, as the supervisor's stats and the metrics say it."""

    NONE = "none"
    STARTING = "starting"
    READY = "ready"
    OFF = "off"


@dataclass(frozen=True)
class Idle:
    """No standby process: the next one starts once ``retry_at`` (monotonic) has passed."""

    in_a_row: int = 0  # standbys that died unpromoted since the last one that was ready
    retry_at: float = 0.0  # the back-off after a death; 0.0: at once
    phase: ClassVar[StandbyPhase] = StandbyPhase.NONE


@dataclass(frozen=True)
class Warming:
    """Spawned, not yet asleep on its futex word; a death now continues the run."""

    proc: subprocess.Popen
    pidfd: int
    in_a_row: int
    phase: ClassVar[StandbyPhase] = StandbyPhase.STARTING


@dataclass(frozen=True)
class Ready:
    """Asleep on ``standby_go``, ready to be promoted; its readiness ends the run of deaths."""

    proc: subprocess.Popen
    pidfd: int
    in_a_row: ClassVar[int] = 0
    phase: ClassVar[StandbyPhase] = StandbyPhase.READY


@dataclass(frozen=True)
class GivenUp:
    """GIVE_UP_AFTER standbys died in a row: none is kept from now on."""

    why: str  # the last failure
    phase: ClassVar[StandbyPhase] = StandbyPhase.OFF


StandbyState = Idle | Warming | Ready | GivenUp

# The transitions :meth:`Standby._to` allows, from each state.
_NEXT: dict[type, tuple[type, ...]] = {
    Idle: (Warming, Idle, GivenUp),
    Warming: (Ready, Idle, GivenUp),
    Ready: (Idle, GivenUp),
    GivenUp: (),
}


@dataclass(frozen=True)
class StandbyHooks:
    """The engine side's part: start a standby process, promote one, see one ready.
    ``promote(pid, session, within_s)`` offers the standby the role of ``session``'s
    proxy and says whether it accepted within ``within_s``; an offer it did not accept is
    withdrawn, so the standby never takes the role."""

    spawn: Callable[[], subprocess.Popen]
    promote: Callable[[int, int, float], bool]  # (pid, session, within_s) -> accepted
    ready: Callable[[int], bool]  # pid -> has it said it is ready


class Standby:
    """At most one standby process, with its pidfd, in its :data:`StandbyState`."""

    def __init__(self, hooks: StandbyHooks, clock: Callable[[], float] = time.monotonic):
        self._hooks = hooks
        self._clock = clock
        self.state: StandbyState = Idle()
        self.spawns = 0
        self.failures = 0  # deaths before promotion (and failed spawns), in all
        self.dead_cpu_s = 0.0  # CPU seconds of standbys reaped unpromoted

    @property
    def proc(self) -> subprocess.Popen | None:
        """The standby process, while one is kept."""
        state = self.state
        return state.proc if isinstance(state, (Warming, Ready)) else None

    @property
    def pidfd(self) -> int:
        """The standby's pidfd, for the watcher's ``select``; -1 while none is kept."""
        state = self.state
        return state.pidfd if isinstance(state, (Warming, Ready)) else -1

    def keep(self, wanted: bool) -> None:
        """Each watcher tick: start a standby when one is wanted and none is kept (after
        the back-off), see a starting one ready, stop the one kept when none is wanted
        (the budget is spent)."""
        state = self.state
        if not wanted:
            self._stop()
        elif isinstance(state, Warming):
            if self._hooks.ready(state.proc.pid):
                self._to(Ready(state.proc, state.pidfd))
        elif isinstance(state, Idle) and self._clock() >= state.retry_at:
            self._start(state.in_a_row)

    def died(self) -> None:
        """Its pidfd is readable: reap it and plan the next one."""
        state = self.state
        assert isinstance(state, (Warming, Ready)), f"a standby death seen while {state.phase.value}"
        self.dead_cpu_s += reap(state.proc, state.pidfd)
        self._failed(state.in_a_row, f"exited with status {state.proc.returncode}")

    def take(self, session: int) -> tuple[subprocess.Popen, int] | None:
        """Promote the ready standby to be the proxy of ``session``: its process and
        pidfd, the caller's from now on; None when no standby is promoted. Only a ready
        standby that proves it is alive, by accepting the role within ``ANSWER_S``, is
        promoted: one that has exited is reaped, one that does not answer (stopped, hung,
        its SIGKILL pending) is killed, each counted as a death; one still starting is
        left to :meth:`keep`, which stops it while no proxy serves."""
        state = self.state
        if not isinstance(state, Ready):
            return None
        if select.select([state.pidfd], [], [], 0)[0]:  # dead already (its exit not yet seen): not promoted
            self.died()
            return None
        if not self._hooks.promote(state.proc.pid, session, ANSWER_S):
            self.dead_cpu_s += kill(state.proc, state.pidfd, KILL_WAIT_S)
            silent = f"pid {state.proc.pid} did not answer its promotion within {ANSWER_S * 1e3:g} ms"
            self._failed(state.in_a_row, silent)
            return None
        self._to(Idle(state.in_a_row))
        return state.proc, state.pidfd

    def close(self, timeout_s: float) -> None:
        self._stop(timeout_s)

    # ------------------------------------------------------------------ internals

    def _to(self, state: StandbyState) -> None:
        """The one transition, checked against :data:`_NEXT`."""
        assert type(state) in _NEXT[type(self.state)], f"standby {self.state.phase.value} -> {state.phase.value}"
        self.state = state

    def _start(self, in_a_row: int) -> None:
        try:
            proc = self._hooks.spawn()
        except OSError as e:
            self._failed(in_a_row, f"could not start: {e}")
            return
        try:
            pidfd = os.pidfd_open(proc.pid)
        except BaseException as e:  # no fd left: a process nobody could watch is ended now
            kill_by_pid(proc, KILL_WAIT_S)
            if not isinstance(e, OSError):
                raise
            self._failed(in_a_row, f"could not watch it: {e}")
            return
        self._to(Warming(proc, pidfd, in_a_row))
        self.spawns += 1

    def _failed(self, in_a_row: int, why: str) -> None:
        """A standby died unpromoted (or could not start), the ``in_a_row``-th before it."""
        self.failures += 1
        in_a_row += 1
        if in_a_row >= GIVE_UP_AFTER:
            self._to(GivenUp(why))
            log.error(
                "standby proxy: %d in a row failed (the last %s); no standby from now on: a lost proxy "
                "is replaced by a fresh start",
                in_a_row,
                why,
            )
            return
        delay = BACKOFF_S * 2 ** (in_a_row - 1)
        log.warning("standby proxy %s; another in %.1f s", why, delay)
        self._to(Idle(in_a_row, self._clock() + delay))

    def _stop(self, timeout_s: float = 1.0) -> None:
        """End the standby kept, if any, whatever its ending raises (``spawn.end``)."""
        state = self.state
        if isinstance(state, (Warming, Ready)):
            self.dead_cpu_s += end(state.proc, state.pidfd, timeout_s)
            self._to(Idle(state.in_a_row))

"""The warm standby: a proxy process started ahead of need, so a lost proxy is replaced
in milliseconds instead of an interpreter's start (80-100 ms on a 2-core machine, more
under load).

A standby has started its interpreter, done its imports, loaded the native library and
mapped the region, then sleeps on the region's ``standby_go`` futex word
(``remote_dspark.proxy_proc.wait_for_promotion``). It takes no proxy role before its promotion: it has
not attached as the region's proxy, connected or said HELLO (the worker would take a
HELLO with this engine's id for a new session and drop the live one's windows). When
the supervisor loses its proxy and its budget allows a respawn, it promotes the standby
(``promote(pid, session)``: the new session in the header, then the standby's pid in
``standby_go``, and a wake) and starts the next standby.

:class:`Standby` is owned by the supervisor and used only under its lock, from its
watcher thread (and ``close``). A standby that dies before its promotion is replaced
without touching the respawn budget, after a back-off of its own; after
``GIVE_UP_AFTER`` deaths in a row (a planted module, a broken library: it would never
work) none is kept, and one error line says why.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..proxy.spawn import reap, terminate

log = logging.getLogger("remote_dspark.supervise.supervisor")

GIVE_UP_AFTER = 3  # standbys dying in a row before none is kept
BACKOFF_S = 0.5  # before the next standby after one died; doubles each time


@dataclass(frozen=True)
class StandbyHooks:
    """The engine side's part: start a standby process, promote one, see one ready."""

    spawn: Callable[[], subprocess.Popen]
    promote: Callable[[int, int], None]  # (pid, session)
    ready: Callable[[int], bool]  # pid -> has it said it is ready


class Standby:
    """At most one standby process, with its pidfd."""

    def __init__(self, hooks: StandbyHooks, clock: Callable[[], float] = time.monotonic):
        self._hooks = hooks
        self._clock = clock
        self.proc: subprocess.Popen | None = None
        self.pidfd = -1
        self.spawns = 0
        self.failures = 0  # deaths before promotion, in all
        self._in_a_row = 0
        self._retry_at = 0.0
        self._ready_seen = False
        self.given_up = False
        self.dead_cpu_s = 0.0  # CPU seconds of standbys reaped unpromoted

    @property
    def state(self) -> str:
        """off (given up), none, starting or ready."""
        if self.given_up:
            return "off"
        if self.proc is None:
            return "none"
        return "ready" if self._ready_seen or self._hooks.ready(self.proc.pid) else "starting"

    def keep(self, wanted: bool) -> None:
        """Each watcher tick: start a standby when one is wanted and none is kept (after
        the back-off), stop the one kept when none is wanted (the budget is spent)."""
        if not wanted:
            self._stop()
            return
        if self.proc is not None:
            if not self._ready_seen and self._hooks.ready(self.proc.pid):
                self._ready_seen, self._in_a_row = True, 0
            return
        if self.given_up or self._clock() < self._retry_at:
            return
        try:
            proc = self._hooks.spawn()
        except OSError as e:
            self._failed(f"could not start: {e}")
            return
        self.proc, self.pidfd, self._ready_seen = proc, os.pidfd_open(proc.pid), False
        self.spawns += 1

    def died(self) -> None:
        """Its pidfd is readable: reap it and plan the next one."""
        proc = self.proc
        self.dead_cpu_s += reap(proc, self.pidfd)
        self._forget()
        self._failed(f"exited with status {proc.returncode}")

    def take(self, session: int) -> tuple[subprocess.Popen, int] | None:
        """Promote the standby to be the proxy of ``session``: its process and pidfd,
        now the caller's; None when there is no standby. One that has exited is never
        promoted; one whose SIGKILL is still pending looks alive to any check, and if
        promoted is lost like any proxy."""
        proc, pidfd = self.proc, self.pidfd
        if proc is None:
            return None
        if select.select([pidfd], [], [], 0)[0]:  # dead already (its exit not yet seen): not promoted
            self.died()
            return None
        self.proc, self.pidfd = None, -1
        self._hooks.promote(proc.pid, session)
        return proc, pidfd

    def close(self, timeout_s: float) -> None:
        self._stop(timeout_s)

    # ------------------------------------------------------------------ internals

    def _failed(self, why: str) -> None:
        self.failures += 1
        self._in_a_row += 1
        if self._in_a_row >= GIVE_UP_AFTER:
            self.given_up = True
            log.error(
                "standby proxy: %d in a row failed (the last %s); no standby from now on: a lost proxy "
                "is replaced by a fresh start",
                self._in_a_row,
                why,
            )
            return
        delay = BACKOFF_S * 2 ** (self._in_a_row - 1)
        log.warning("standby proxy %s; another in %.1f s", why, delay)
        self._retry_at = self._clock() + delay

    def _stop(self, timeout_s: float = 1.0) -> None:
        proc = self.proc
        if proc is None:
            return
        self.dead_cpu_s += terminate(proc, self.pidfd, timeout_s)
        self._forget()

    def _forget(self) -> None:
        """Its process was reaped, its pidfd closed with it."""
        self.proc, self.pidfd, self._ready_seen = None, -1, False

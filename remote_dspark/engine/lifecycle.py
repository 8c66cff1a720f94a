"""The engine's lifecycle: its states, its errors, and :class:`Users`, which decides when
the resources a round touches (the region and its views, or the sync connection) may
be freed.

Why a forked copy is inert: ``fork()`` copies the engine's objects but none of its
threads (the watchdog, the proxy thread, the supervisor's watcher), and shares its
region, proxy process and sockets with the parent. A round from the copy would draft
through the parent's region or connection, and its ``close()`` would join threads that
do not exist there, signal the parent's proxy or shut the parent's socket down. So the
child's copy of a started engine is ``FORKED`` from the fork on (one hook, run by the
interpreter in the child before any other code): it refuses every round, naming the
fork, and its ``close()`` returns at once, touching nothing (its locks may have been
held by a thread fork did not copy, so it takes none).

Why a count of users rather than "close waits for the round": a round in flight may be
stuck where ``close()`` cannot reach it (a thread-mode proxy inside a connect, a claimer
still waiting for its worker), and ``close()`` must return within 2 s whatever the proxy
or the worker does. So ``close()`` shuts the door (no new user enters), releases what it
can (every round handed over, target-only, through the claim the watchdog uses),
waits a bounded time for the users to leave, then leaves itself: whoever leaves last,
``close()`` or a late round, frees the resources. Nothing is unmapped under a user, and
nobody waits on a peer it cannot hurry.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

log = logging.getLogger("remote_dspark.engine")


class EngineState(enum.Enum):
    """``RemoteDSpark``: new -> starting -> started -> closing -> closed (a failed start
    closes; close before start too). Rounds are taken only while started. In a child
    forked from the process that started it, a starting, started or closing engine is
    forked: inert for good."""

    NEW = "new"
    STARTING = "starting"
    STARTED = "started"
    CLOSING = "closing"
    CLOSED = "closed"
    FORKED = "forked"


# The transitions Lifecycle.to allows (FORKED is the fork hook's alone).
_NEXT = {
    EngineState.NEW: (EngineState.STARTING, EngineState.CLOSING),
    EngineState.STARTING: (EngineState.STARTED, EngineState.CLOSING),
    EngineState.STARTED: (EngineState.CLOSING,),
    EngineState.CLOSING: (EngineState.CLOSED,),
    EngineState.CLOSED: (),
    EngineState.FORKED: (),
}
_HOLDS = (EngineState.STARTING, EngineState.STARTED, EngineState.CLOSING)  # what a fork makes FORKED


class RemoteClosed(RuntimeError):
    """A round asked of a ``RemoteDSpark`` that is closing or closed."""


class RemoteForked(RemoteClosed):
    """A call on the copy of a started ``RemoteDSpark`` in a forked child: it belongs to
    the parent; the child starts its own."""


class Lifecycle:
    """One engine's :class:`EngineState`, and the processes a fork involves.

    Invariants: ``state`` changes only in :meth:`to` (under the engine's lock) and, in a
    forked child, in :func:`_after_fork_in_child` (run before any other code there);
    ``started_in`` is the pid that started the engine (0 before), ``forked_into`` the
    child's pid once FORKED.
    """

    def __init__(self) -> None:
        self.state = EngineState.NEW
        self.started_in = 0
        self.forked_into = 0
        _LIVES.add(self)

    def to(self, state: EngineState) -> None:
        """The one transition (asserted against ``_NEXT``)."""
        assert state in _NEXT[self.state], f"engine {self.state.value} -> {state.value}"
        if state is EngineState.STARTING:
            self.started_in = os.getpid()
        self.state = state

    @property
    def forked(self) -> bool:
        return self.state is EngineState.FORKED

    def refuse_forked(self, what: str) -> None:
        """Raise :class:`RemoteForked` for ``RemoteDSpark.what()`` when FORKED.
        A read of one attribute: no lock, no system call."""
        if self.state is EngineState.FORKED:
            raise RemoteForked(
                f"RemoteDSpark.{what}(): this engine was started in pid {self.started_in}; a forked child "
                f"(pid {self.forked_into}) cannot use it: start its own"
            )

    def _fork(self, child_pid: int) -> None:
        if self.state in _HOLDS:
            self.state = EngineState.FORKED
        if self.state is EngineState.FORKED:
            self.forked_into = child_pid


# Every Lifecycle alive, for the fork hook (weak: an engine's lifecycle goes with it).
_LIVES: weakref.WeakSet[Lifecycle] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """In a forked child, before any other code runs there: every engine copied from
    the parent that holds something of the parent's is FORKED."""
    pid = os.getpid()
    for life in list(_LIVES):
        life._fork(pid)


# One process-wide hook (os.fork, multiprocessing's fork, os.forkpty run it; a spawn
# with exec does not need it).
os.register_at_fork(after_in_child=_after_fork_in_child)


class RemoteRoundFailed(RuntimeError):
    """A capacity round failed with ``ON_FAIL=raise``."""


class Users:
    """The owner (counted from the start) and every thread inside the resources. The
    last to leave after :meth:`shut` runs ``free`` (once)."""

    def __init__(self, free: Callable[[], None]):
        self._free = free
        self._count = 1  # the owner
        self._open = True
        self._waiting = 0  # threads in wait_alone: a leave wakes them only when there are some
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    def enter(self) -> bool:
        """True: the caller may use the resources until its :meth:`leave`. False: shut."""
        with self._lock:
            if not self._open:
                return False
            self._count += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
            if self._waiting:
                self._cond.notify_all()
        if last:
            self._free()

    def shut(self) -> None:
        """No one enters from now on (idempotent)."""
        with self._cond:
            self._open = False

    def wait_alone(self, deadline: float) -> bool:
        """Wait until the owner is the only user, or ``deadline`` (monotonic)."""
        with self._cond:
            self._waiting += 1
            try:
                while self._count > 1:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._waiting -= 1

    @property
    def inside(self) -> int:
        """Users other than the owner (a reading, for logs and tests)."""
        return self._count - 1


def stop_in_caller(users: Users, interrupt: Callable[[], None], limit_s: float) -> None:
    """Close a path whose round runs on its caller's thread (sync, a tensor-parallel
    rank other than 0): shut the door, ``interrupt`` the round in flight, wait at most
    ``limit_s`` for it to leave. The owner's own leave is the caller's."""
    deadline = time.monotonic() + limit_s
    users.shut()
    interrupt()
    if not users.wait_alone(deadline):
        log.warning("remote DSpark: close: a round still in flight after %.1f s", limit_s)

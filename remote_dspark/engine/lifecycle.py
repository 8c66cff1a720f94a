"""The engine's lifecycle: its states, its errors, and :class:`Users`, which decides when
the resources a round touches (the region and its views, or the sync connection) may
be freed.

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
import threading
import time
from collections.abc import Callable

log = logging.getLogger("remote_dspark.engine")


class EngineState(enum.Enum):
    """``RemoteDSpark``: new -> starting -> started -> closing -> closed (a failed start
    closes). Rounds are taken only while started."""

    NEW = "new"
    STARTING = "starting"
    STARTED = "started"
    CLOSING = "closing"
    CLOSED = "closed"


class RemoteClosed(RuntimeError):
    """A round asked of a ``RemoteDSpark`` that is closing or closed."""


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

"""The supervisor's lifecycle as one typed value (:data:`Lifecycle`): each state carries
the facts it has (the proxy process, its session, since when, why it was lost), so no
field is meaningful in one state and stale in another. :mod:`.restarts` makes the
transitions."""

from __future__ import annotations

import enum
import subprocess
from dataclasses import dataclass


class Cause(str, enum.Enum):
    EXIT = "exit"  # the proxy exited by itself
    SIGNAL = "signal"  # killed by a signal it did not ask for (OOM killer, chaos, ...)
    STALL = "stall"  # alive but not serving: the supervisor killed it


@dataclass(frozen=True)
class Child:
    """A proxy process: its handle and its pidfd. The state that holds it owns it; whoever
    takes it out of the state (the exit handler, ``close``) reaps it."""

    proc: subprocess.Popen
    pidfd: int

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass(frozen=True)
class Starting:
    child: Child
    session: int
    since: float  # monotonic time of the spawn

    @property
    def pid(self) -> int:
        return self.child.pid


@dataclass(frozen=True)
class Up:
    child: Child
    session: int
    since: float  # monotonic time of the spawn (not of the first beat)

    @property
    def pid(self) -> int:
        return self.child.pid


@dataclass(frozen=True)
class Killing:
    """The supervisor has SIGKILLed ``proxy`` and waits for its exit, a loss of ``cause``."""

    proxy: Starting | Up  # the proxy being killed, as it was
    cause: Cause

    @property
    def child(self) -> Child:
        return self.proxy.child

    @property
    def pid(self) -> int:
        return self.proxy.pid

    @property
    def session(self) -> int:
        return self.proxy.session


@dataclass(frozen=True)
class Down:
    cause: Cause
    since: float  # between a loss and the next spawn


@dataclass(frozen=True)
class Spent:
    since: float  # the budget ran out: target-only for good


@dataclass(frozen=True)
class Closed:
    pass


Lifecycle = Starting | Up | Killing | Down | Spent | Closed

"""The circuit breaker: stop paying the round deadline to a remote that keeps failing.

After ``trip`` consecutive failed attempts (0 = never) the breaker opens: the next
``cooldown`` rounds skip the network (target-only). The round after them is one probe:
success closes the breaker, failure opens it again for another cooldown.

    CLOSED --trip failures--> OPEN --cooldown rounds--> PROBING --ok--> CLOSED
                                ^                          |
                                +--------- failure --------+

The state lives in a :class:`BreakerStore`: in process mode that is the breaker block
of the shared region (written only by the proxy), so it survives a proxy respawn and the
engine exports it; elsewhere a plain :class:`BreakerRecord`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from ..outcome import RoundEvent


class State(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    PROBING = 2


class BreakerStore(Protocol):
    state: int
    failures: int  # consecutive failed attempts while closed
    cooldown_left: int  # rounds still to skip while open
    trips: int  # times the breaker opened (monotonic)
    probes: int  # probe rounds sent (monotonic)


@dataclass
class BreakerRecord:
    state: int = State.CLOSED
    failures: int = 0
    cooldown_left: int = 0
    trips: int = 0
    probes: int = 0


# The breaker's verdict on each network event, for every path (the sync link, the ofl
# round and the native TCP round): a worker that answered, even with drafts that do not
# fit the round, is reachable; a silence or a broken connection is a failure; a round that
# never reached the network says nothing.
SUCCESS = frozenset({RoundEvent.OK, RoundEvent.BAD_REPLY})
FAILURE = frozenset({RoundEvent.TIMEOUT, RoundEvent.LOST, RoundEvent.PROTOCOL})


class Breaker:
    """Ask :meth:`allow` once per round; report what the attempt did with
    :meth:`observe`. Not thread-safe: one proxy owns it.

    Invariants: ``cooldown_left > 0`` only while OPEN; ``failures < trip`` while CLOSED.
    """

    def __init__(self, trip: int, cooldown: int, store: BreakerStore | None = None):
        if trip < 0 or cooldown < 1:
            raise ValueError(f"breaker trip={trip} (>= 0), cooldown={cooldown} (>= 1)")
        self.trip = trip
        self.cooldown = cooldown
        self.store = BreakerRecord() if store is None else store

    @property
    def state(self) -> State:
        return State(self.store.state)

    def allow(self) -> bool:
        """True when this round may use the network (a probe, if the cooldown just ended)."""
        s = self.store
        if s.state == State.OPEN:
            if s.cooldown_left > 0:
                s.cooldown_left -= 1
                return False
            s.state = State.PROBING
            s.probes += 1
        return True

    def observe(self, event: RoundEvent) -> None:
        """The one place an attempt's event becomes a success, a failure or nothing."""
        if event in SUCCESS:
            self.success()
        elif event in FAILURE:
            self.failure()

    def success(self) -> None:
        self.store.failures = 0
        self.store.state = State.CLOSED

    def reset(self) -> None:
        """A new remote (the link switched workers): the old one's failures and cooldown
        are not its own. The counts (trips, probes) stay."""
        s = self.store
        s.failures = s.cooldown_left = 0
        s.state = State.CLOSED

    def failure(self) -> None:
        s = self.store
        if self.trip == 0:
            return
        if s.state == State.PROBING:
            self._open()
            return
        s.failures += 1
        if s.failures >= self.trip:
            self._open()

    def _open(self) -> None:
        s = self.store
        s.failures = 0
        s.cooldown_left = self.cooldown
        s.trips += 1
        s.state = State.OPEN

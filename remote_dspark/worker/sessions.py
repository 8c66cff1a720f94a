"""The engines a worker holds windows for, and who gets a place when they are full.

One :class:`Session` per accepted HELLO; :class:`Sessions` maps each engine id to its
latest session. A session leaves when its connection ends (every new connection starts
with a new HELLO and the engine re-announces all its slots, so a closed connection's
windows are never read again), when a new session of its engine replaces it (a respawned
proxy), or when a newcomer evicts it.

A newcomer that finds all ``max_engines`` places taken evicts the least recently served
session, unless that one was served within ``recent_s`` (a minute): then every place is
in use and the newcomer is refused "busy" instead. So a flood of HELLOs with fresh
engine ids can never wipe the windows of an engine being served, whatever their order;
it can only be told to come back. An evicted session's connection is shut down: its
thread says BYE and closes it, and the engine reconnects and says HELLO again.

The same rule, :func:`displaceable`, gives a newcomer a served connection when all
``max_connections`` are taken (:meth:`Sessions.displace`): the connection of the least
recently served session goes if it idled ``recent_s``. So peers that say HELLO and idle
hold their connections only as long as an engine holds its place, never for good.

**Spares.** A HELLO with ``spare`` (an engine's standby connection to a second worker,
kept for a failover) makes a session marked spare, until its first ROUND makes it an
ordinary served one (:meth:`Sessions.engaged`). Who makes room for a newcomer, among the
engines or the served connections (:meth:`Sessions._victim`, the one place of the order):

1. the least recently served of the served sessions (not spare), if it idled
   ``recent_s`` (:func:`displaceable`): an idle engine goes before any spare;
2. else, for a newcomer that is not spare itself, the spare that said HELLO first: a
   spare does no work, so it needs no idling to go (its engine makes another elsewhere);
3. else none: the newcomer is refused "busy". A spare newcomer never evicts another
   spare: spares pushing each other out would chase round a fleet with every failover.

A spare HELLO of the session (the engine's proxy) that holds a session here already,
spare or active, is refused: two addresses may reach one worker, and a spare that
replaced its own proxy's connection here would take that connection's place and die
with it. A spare HELLO of another session of the engine (a new proxy: the old one is
gone) replaces the old session as any same-engine HELLO does, and so does an active
HELLO of an engine whose spare is here.

The sessions' windows are bounded too: every session's windows are registered in the
worker's :class:`~.history.History` (weakly: they go with their session), and a HELLO
whose windows would take the live ones past ``history_bytes`` (``--history-mb``) is
refused "busy", its reason naming the flag and the figures.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .history import History
from .windows import Windows

RECENT_S = 60.0
DEFAULT_HISTORY_MB = 2048  # a few dozen sessions of 1,024 slots x 8,192 kept tokens (32.3 MiB each)


@dataclass(eq=False)
class Session:
    session: int
    max_slots: int
    num_spec: int
    want_margin: bool
    windows: Windows
    row_bytes: int | None = None  # the HELLO's; None: not checked (tests that drive rounds directly)
    engine_id: int = 0
    last_served: float = 0.0  # Sessions.clock: its HELLO, then the end of every round it was answered
    evicted: bool = False  # a newcomer took its place; its connection says BYE and closes
    conn: socket.socket | None = None  # its connection (shut down on eviction), when it has one
    want_sampled: bool = False  # its HELLO's OPTION_SAMPLED: rounds carry temperatures and seeds
    # The worker's reader of its streams' tokens when its drafter keeps whole streams: the
    # session's batches carry it and ``kept_from`` (worker.round.kept_streams). None: not.
    history: History | None = None
    spare: bool = False  # its HELLO's OPTION_SPARE, until its first ROUND (Sessions.engaged)

    @classmethod
    def of_hello(
        cls,
        session: int,
        hello,
        window: int,
        conn: socket.socket | None = None,
        keep: int | None = None,
        history: History | None = None,
    ) -> Session:
        """The session a (checked) HELLO asks for, with new windows of ``window`` tokens
        keeping ``keep`` per slot (None: ``window``), read through ``history`` when its
        drafter keeps whole streams."""
        return cls(
            session,
            hello.max_slots,
            hello.num_spec,
            hello.want_margin,
            Windows(hello.max_slots, window, keep),
            row_bytes=hello.row_bytes,
            engine_id=hello.engine_id,
            conn=conn,
            want_sampled=hello.want_sampled,
            history=history,
            spare=hello.spare,
        )


class Sessions:
    """Engine id -> its latest session, at most ``max_engines`` of them.

    Invariants: every session here has ``evicted`` False; a session is here from its
    accepted HELLO until its connection ends, its engine's next HELLO replaces it, or a
    newcomer evicts it. ``admit`` and ``drop`` take the lock; ``served`` is one store.

    ``clock`` (``time.monotonic`` by default) dates every HELLO and round; ``recent_s``
    is measured on it, so a test that advances a fake clock decides who is recent.
    ``history`` registers every admitted session's windows; their bytes stay within
    ``history_bytes``.
    """

    def __init__(
        self,
        max_engines: int,
        recent_s: float = RECENT_S,
        clock: Callable[[], float] = time.monotonic,
        history_bytes: int = DEFAULT_HISTORY_MB << 20,
    ):
        if max_engines < 1:
            raise ValueError(f"max_engines {max_engines}: must be >= 1")
        self.max_engines = max_engines
        self.history, self.history_bytes = History(), history_bytes
        self.recent_s = recent_s
        self.clock = clock
        self._by_engine: dict[int, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_engine)

    def get(self, engine_id: int) -> Session | None:
        return self._by_engine.get(engine_id)

    def counts(self, leaving_out: Session | None = None) -> tuple[int, int]:
        """``(engines, spares)``: the sessions here now that are not spare, and those that
        are, ``leaving_out`` not counted (a HELLO_ACK's ``engines`` leaves its newcomer out)."""
        with self._lock:
            spares = sum(s.spare for s in self._by_engine.values() if s is not leaving_out)
            others = sum(1 for s in self._by_engine.values() if s is not leaving_out)
        return others - spares, spares

    def admit(self, new: Session) -> tuple[str | None, Session | None]:
        """Give ``new`` its engine's place. Returns ``(busy, evicted)``: ``busy`` is the
        refusal's reason when there is no place ("busy: ...") or ``new`` is a spare of a
        session connected here already ("refused: ..."; ``new`` is then not admitted),
        ``evicted`` the session that made room for it, if one did.

        A new session of the same engine replaces the old one at once: its windows go
        now, not when its connection closes (an old connection that still sends rounds
        gets RESYNC for every slot). A spare is refused beside its own session (the
        module docstring).
        """
        with self._lock:
            now = self.clock()
            victim = None
            old = self._by_engine.get(new.engine_id)
            if old is not None and new.spare and old.session == new.session:
                return (
                    f"refused: engine {new.engine_id:#x} session {new.session:#x} is connected to this worker "
                    "already; a spare must go to another worker"
                ), None
            if old is None and len(self._by_engine) >= self.max_engines:
                victim, idle = self._victim(self._by_engine.values(), now, new.spare)
                if victim is None:
                    return (
                        f"busy: all {self.max_engines} engine places are held by engines served within the "
                        f"last {self.recent_s:g} s (the least recently served {idle:.1f} s ago; "
                        "--max-engines){' or by spares' if new.spare else ''}; try again later"
                    ), None
            full = self._over_budget(new.windows, old or victim)  # what it replaces frees its windows
            if full is not None:
                return full, None
            if old is not None:
                del self._by_engine[new.engine_id]
                old.windows.forget_all()
            if victim is not None:
                self._evict(victim)
            new.last_served = now
            self._by_engine[new.engine_id] = new
            self.history.add(new.windows)
        if victim is not None:
            _shut(victim)
        return None, victim

    def _over_budget(self, windows: Windows, leaving: Session | None) -> str | None:
        """Under the lock: the busy reason when ``windows`` would take the live sessions'
        windows past ``history_bytes``, else None. The windows of ``leaving`` (the session
        the newcomer replaces or evicts) are not counted; those of sessions that left
        count until their connection's thread lets them go."""
        held, need = self.history.nbytes(), windows.nbytes
        if leaving is not None:
            held -= leaving.windows.nbytes
        if held + need <= self.history_bytes:
            return None
        mib = 1 << 20
        return (
            f"busy: a session of {windows.max_slots} slots x {windows.keep} kept tokens needs "
            f"{need / mib:.1f} MiB of windows; this worker's sessions hold {held / mib:.1f} MiB of its "
            f"{self.history_bytes / mib:g} MiB (--history-mb); try again later"
        )

    def displace(self, sessions: Iterable[Session], spare: bool = False) -> Session | None:
        """A newcomer (``spare``: its HELLO's) found every served connection taken: the
        session of ``sessions`` (those of the served connections) that makes room for it
        evicted, its connection shut down (:meth:`_victim`, as :meth:`admit`); else None."""
        with self._lock:
            victim, _ = self._victim(sessions, self.clock(), spare)
            if victim is not None:
                self._evict(victim)
        if victim is not None:
            _shut(victim)
        return victim

    def _victim(self, sessions: Iterable[Session], now: float, spare: bool) -> tuple[Session | None, float]:
        """Under the lock: the session of ``sessions`` not leaving already that makes room
        for a newcomer (``spare``: a spare newcomer), or None; and how long the least
        recently served of the served ones idled (inf: none). The order, written once
        (the module docstring): a :func:`displaceable` served session, stalest first;
        then, for a newcomer that is not spare, the spare that said HELLO first."""
        here = [s for s in sessions if not s.evicted]
        stalest = min((s for s in here if not s.spare), key=lambda s: s.last_served, default=None)
        idle = math.inf if stalest is None else now - stalest.last_served
        if stalest is not None and displaceable(stalest, idle, self.recent_s):
            return stalest, idle
        if spare:
            return None, idle
        # a spare's last_served is its HELLO's until its first round (then it is served)
        return min((s for s in here if s.spare), key=lambda s: s.last_served, default=None), idle

    def _evict(self, victim: Session) -> None:
        """Under the lock: ``victim`` leaves (if it still holds its engine's place) and is
        marked evicted; its windows go now."""
        if self._by_engine.get(victim.engine_id) is victim:
            del self._by_engine[victim.engine_id]
        victim.evicted = True
        victim.windows.forget_all()

    def served(self, session: Session) -> None:
        """``session`` was just answered a round (one float store: no lock)."""
        session.last_served = self.clock()

    @staticmethod
    def engaged(session: Session) -> None:
        """``session`` got a ROUND: a spare no more, an ordinary served session from now
        on (one store: no lock; each path calls it as it takes the round, before its reply,
        so a HELLO judged after the engine sees drafts never takes it for a spare)."""
        session.spare = False

    def drop(self, session: Session) -> None:
        """``session``'s connection ended: it leaves, unless it was replaced already."""
        with self._lock:
            if self._by_engine.get(session.engine_id) is session:
                del self._by_engine[session.engine_id]


def displaceable(session: Session, idle: float, recent_s: float) -> bool:
    """The rule for giving a newcomer a served (not spare) ``session``'s place, among the
    engines or among the served connections: it was last served ``idle`` seconds ago,
    ``recent_s`` or more. (A spare's rule is :meth:`Sessions._victim`'s.)"""
    return idle >= recent_s


def _shut(victim: Session) -> None:
    """Wakes an evicted session's thread out of recv: it says BYE and closes."""
    if victim.conn is not None:
        try:
            victim.conn.shutdown(socket.SHUT_RD)
        except OSError:
            pass

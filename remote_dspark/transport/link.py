"""The network side of a proxy: an active connection to one worker of the fleet, a spare
connection to another, failover in one round, and the breaker. Torch-free; the proxy
process, the thread proxy and synchronous rounds all use it.

The endpoint names a fleet (:mod:`.fleet`: its addresses, resolved off the round path
and ranked for this engine). Beside its **active** connection the link keeps one
**spare**: connected, HELLO'd (as a spare: the worker holds it idle) and authenticated to
another address, and kept alive by PINGs (:mod:`.keeper`, the thread that makes, pings
and replaces spares, watches the active for a peer that hung up, re-resolves, and
reconnects with back-off). When the active is lost the next round goes to the spare:

- the active's socket broke, was garbled, or its worker hung up (``LOST``,
  ``PROTOCOL``: from a round, or seen by the keeper between rounds);
- ``STALL_ROUNDS`` rounds in a row passed their deadline on it while a spare is ready
  (``STALL``; without a spare a timed-out round keeps the connection, its reply dropped
  as late when it comes).

The switch is one step under the link's lock (:meth:`_leave`): the spare becomes the
active with a new ``epoch``, the hooks hear it before a round can take it (``on_acked``:
its HELLO_ACK's context and round cap; ``on_change``: the proxy's native round and the
region's link words), the breaker forgets the old worker's failures, and the keeper
makes a new spare in the background. Every new active is a new HELLO, after which the
worker holds no window for this engine: a caller that sees ``epoch`` change re-announces
every slot (``resync_all``), and one that does not is answered RESYNC for each.

**Fencing.** Drafts are read only from the active connection: a connection left behind
is never read by a round again. One left after a stall (its worker may wake up and
answer) is drained by the keeper for ``keeper.FENCE_S`` and every DRAFTS on it is counted
``fenced`` and dropped; then it is closed.

A connection whose descriptor a round may still be using (one the keeper left) is shut
down at once but closed only by the round's own thread (:meth:`reap`, before its next
round), so no descriptor is reused under a round.

The reconnect back-off applies only when no address answers: with no active and no
spare the keeper tries the fleet's addresses in rank order and waits ``backoff_ms``,
doubling up to ``backoff_max_ms``, only after all of them failed. The breaker judges
one worker: a switch starts the new one with the breaker closed.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .. import wire
from ..outcome import DROPS_CONNECTION, OUTCOME_OF, Outcome, RoundEvent
from . import DeadlineExceeded, Endpoint, TransportError
from .auth import Key
from .breaker import Breaker
from .client import DraftClient
from .conn import Conn, Failover
from .fleet import Address, Fleet, Resolve
from .keeper import Keeper

log = logging.getLogger("remote_dspark.link")

CLOSE_JOIN_S = 0.2  # close(): how long it waits for the keeper thread
STALL_ROUNDS = 2  # rounds past their deadline in a row that leave an active for a ready spare


@dataclass(frozen=True)
class RoundResult:
    outcome: Outcome
    event: RoundEvent  # AT_ONCE: not sent (no connection, or the breaker open)
    drafts: wire.DraftsFrame | None = None


class RemoteLink:
    """One proxy's connections. ``round`` (or a native round and :meth:`observe`) is
    called from one thread at a time, the round thread; the keeper thread is the link's
    own.

    Invariants: ``_active`` and ``_spare`` change only under ``_lock``; a conn is in at
    most one of ``_active``, ``_spare``, ``_retired`` and the keeper's fenced list; the
    hooks hear every change of the active before a round can use it.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        hello: wire.Hello,
        session: int,
        *,
        connect_timeout_ms: int,
        backoff_ms: int,
        backoff_max_ms: int,
        breaker: Breaker,
        environ: Mapping[str, str] | None = None,
        on_connect: Callable[[], None] | None = None,
        on_acked: Callable[[int, int], None] | None = None,
        on_change: Callable[[Conn | None, Conn | None], None] | None = None,
        on_count: Callable[[str, int], None] | None = None,
        key: Key | None = None,
        resolve: Resolve | None = None,
    ):
        self.endpoint = endpoint
        self.hello = hello
        self._hello = dataclasses.replace(hello, spare=True)  # what every connection says
        self.session = session
        self.connect_timeout_s = connect_timeout_ms / 1000.0
        self.backoff_ms = backoff_ms
        self.backoff_max_ms = backoff_max_ms
        self.breaker = breaker
        self.environ = environ
        self.on_connect = on_connect
        self.on_acked = on_acked
        self.on_change = on_change
        self.on_count = on_count
        self.key = key
        self.fleet = Fleet(endpoint, timeout_s=self.connect_timeout_s, resolve=resolve)
        self.epoch = 0  # connections made active so far
        self.reconnects = 0  # of them, after the first
        self.attempts = 0  # rounds that used the network
        self.failovers = {c.value: 0 for c in Failover}  # actives left, by cause
        self.fenced = 0  # replies read from a connection left behind, dropped
        self.last_error = ""
        self._late_closed = 0  # late replies counted on connections now closed
        self._active: Conn | None = None
        self._spare: Conn | None = None
        self._retired: list[Conn] = []  # left while a round may use them: closed by reap
        self._fresh = False  # a new worker since the round thread last asked the breaker
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.keeper = Keeper(self)

    # ------------------------------------------------------------------ connections

    def connect(self) -> None:
        """The first connection now, within CONNECT_TIMEOUT_MS for each address tried
        (start-up), then the keeper starts (the spare, PINGs, reconnects).

        Raises:
            Refused, TransportError, wire.ProtocolError: no address took it (the first
            one's failure); the caller decides (STRICT_START raises, otherwise
            :meth:`start_reconnecting`).
        """
        try:
            self.keeper.connect_best()
        except BaseException:
            self.keeper.after_failed_start()
            raise
        self.start_reconnecting()

    def start_reconnecting(self) -> None:
        """Start the keeper (idempotent): it connects in the background after a failed
        start, and keeps the spare."""
        self.keeper.start()

    def dial(self, address: Address | None, timeout_s: float | None = None) -> Conn:
        """One connection and its HELLO, within ``timeout_s`` (CONNECT_TIMEOUT_MS unless
        given), authenticated with the key, if any. Every HELLO says spare: the worker
        holds the connection apart until its first ROUND makes it this engine's active
        one, so a connection can be either, and the choice is made after the HELLO_ACKs.
        Raises as :meth:`DraftClient.connect`."""
        timeout_s = self.connect_timeout_s if timeout_s is None else timeout_s
        client = DraftClient.connect(
            self.endpoint, self._hello, self.session, timeout_s, self.environ, key=self.key, address=address
        )
        return Conn(client)

    def install(self, conn: Conn, spare: Conn | None = None) -> bool:
        """Make ``conn`` the active connection (and ``spare`` the spare, if given and none
        is kept). False, and both closed, if the link was closed or has an active."""
        with self._lock:
            if self._closed.is_set() or self._active is not None:
                taken = False
            else:
                self._activate(conn)
                if spare is not None and self._spare is None:
                    self._spare, spare = _as_spare(spare), None
                    self._changed()
                taken = True
        for c in (spare,) if taken else (conn, spare):
            if c is not None:
                c.close()
        return taken

    def offer_spare(self, conn: Conn) -> bool:
        """Keep ``conn`` as the spare; with no active it becomes the active. False (and
        ``conn`` closed) when the link is closed or keeps a spare already."""
        with self._lock:
            ok = not self._closed.is_set() and self._spare is None
            if ok and self._active is None:
                self._activate(conn)
            elif ok:
                self._spare = _as_spare(conn)
                self._changed()
        if not ok:
            conn.close()
        return ok

    def drop_spare(self, conn: Conn, why: str) -> None:
        """The keeper found ``conn`` (the spare) dead or broken: closed, a new one later."""
        with self._lock:
            if self._spare is not conn:
                return
            self._spare = None
            self._changed()
        conn.close()
        self.keeper.lost(conn, broken=True)
        self.note_failure(f"spare {conn.address}: {why}")

    def on_spare(self, conn: Conn, fn: Callable[[], object]) -> tuple[bool, object]:
        """Keeper: ``fn()`` (a PING sent, a frame read) under the lock while ``conn`` is
        still the spare, so a promoted spare's socket is never shared with a round:
        (True, its result), or (False, None) when ``conn`` is no longer the spare."""
        with self._lock:
            if conn is not self._spare:
                return False, None
            return True, fn()

    def _activate(self, conn: Conn) -> None:
        """Under the lock: ``conn`` is the active from now on."""
        self.epoch += 1
        self.reconnects += self.epoch > 1
        conn.epoch, conn.timeouts = self.epoch, 0
        conn.client.chan.max_payload = wire.MAX_PAYLOAD  # (a spare's was 0)
        if self.on_acked is not None:  # before any round can take this connection
            self.on_acked(conn.client.ack.context_tokens, conn.client.ack.round_tokens)
        self._active = conn
        self._fresh = True
        self._changed()
        if self.on_connect is not None:
            self.on_connect()
        log.info("connected to %s (session %#x, epoch %d)", conn.address or self.endpoint, self.session, self.epoch)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self._active, self._spare)

    def leave(self, epoch: int, cause: Failover, why: str, *, in_use: bool) -> bool:
        """Leave the active connection of ``epoch`` (a stale epoch: already left, False)
        for the spare when one is kept. ``in_use``: a round may still be using its
        descriptor (the keeper's call): it is shut down now and closed by :meth:`reap`.
        A connection left after a stall is drained by the keeper (fencing). A closed link
        leaves nothing (False): a round that :meth:`interrupt` ended lost no worker."""
        with self._lock:
            conn = self._active
            if conn is None or conn.epoch != epoch or self._closed.is_set():
                return False
            self._active = None
            self._late_closed += conn.client.late
            self.failovers[cause.value] += 1
            if self.on_count is not None:
                self.on_count(f"failovers_{cause.value}", 1)
            if in_use:
                conn.shutdown()
                self._retired.append(conn)
            spare, self._spare = self._spare, None
            if spare is not None and spare.client.chan.mid_frame:
                # The keeper read part of a PING answer on it: a native reader would start
                # mid-frame. Never seen whole frames split so, but never promoted either.
                self._retired.append(spare)
                spare = None
            if spare is not None:
                self._activate(spare)
            else:
                if self.on_acked is not None:  # before the next connection's
                    self.on_acked(0, 0)
                self._changed()
        if not in_use:
            if cause is Failover.STALL:
                self.keeper.fence(conn)
            else:
                conn.close()
        self.keeper.lost(conn, broken=False)
        self.note_failure(why)
        self.keeper.wake()
        return True

    def drop(self, why: str) -> None:
        """Leave the active connection now (a caller's verdict: tests and tools; no
        native round may hold its descriptor)."""
        conn = self._active
        if conn is not None:
            self.leave(conn.epoch, Failover.LOST, why, in_use=False)

    def reap(self) -> None:
        """Round thread, between rounds: close the connections the keeper left."""
        if self._retired:
            with self._lock:
                retired, self._retired = self._retired, []
            for conn in retired:
                conn.close()

    def note_failure(self, why: str) -> None:
        if why != self.last_error:  # one log line per kind of failure, not per round
            log.warning("%s", why)
        self.last_error = why

    def count_fenced(self, n: int = 1) -> None:
        self.fenced += n
        if self.on_count is not None:
            self.on_count("fenced_replies", n)

    @property
    def active(self) -> Conn | None:
        return self._active

    @property
    def spare(self) -> Conn | None:
        return self._spare

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def connected(self) -> bool:
        return self._active is not None

    @property
    def context_tokens(self) -> int:
        """The context tokens per slot the active's HELLO_ACK named; 0: no connection."""
        conn = self._active
        return conn.client.ack.context_tokens if conn is not None else 0

    @property
    def round_tokens(self) -> int:
        """The most tokens a round may carry on the active (its HELLO_ACK); 0: none."""
        conn = self._active
        return conn.client.ack.round_tokens if conn is not None else 0

    def tcp_socket(self):
        """The active connection's socket when it is a TCP one, else None."""
        conn = self._active
        return conn.sock if conn is not None else None

    @property
    def late(self) -> int:
        """Replies that came after their round's deadline, dropped (all connections)."""
        conn = self._active
        return self._late_closed + (conn.client.late if conn else 0)

    # ------------------------------------------------------------------ rounds

    def allow(self) -> bool:
        """The breaker's word for the next round (round thread). A new worker since the
        last ask starts with a closed breaker: the old worker's failures are not its."""
        if self._fresh:
            self._fresh = False
            self.breaker.reset()
        return self.breaker.allow()

    def observe(self, epoch: int, event: RoundEvent, why: str = "", round_id: int = 0) -> None:
        """After a round sent on the active of ``epoch`` (here or natively): leave it when
        the event says so (the breaker heard the event already)."""
        conn = self._active
        if conn is None or conn.epoch != epoch:
            return
        where = f"round {round_id} on {conn.address or self.endpoint}"
        if event in DROPS_CONNECTION:
            cause = Failover.PROTOCOL if event is RoundEvent.PROTOCOL else Failover.LOST
            self.leave(epoch, cause, f"{where} failed: {why}", in_use=False)
        elif event is RoundEvent.TIMEOUT:
            conn.timeouts += 1
            if conn.timeouts >= STALL_ROUNDS and self._spare is not None:
                self.leave(epoch, Failover.STALL, f"{where}: {conn.timeouts} deadlines in a row", in_use=False)
        elif event is RoundEvent.OK:
            conn.timeouts = 0
        elif event is RoundEvent.BAD_REPLY:
            conn.timeouts = 0
            self.note_failure(f"{where}: worker reply refused: {why}")

    def round_entries(
        self, round_id: int, entries: Sequence[wire.Entry], rows, row_bytes: int, deadline_ms: int
    ) -> RoundResult:
        """:meth:`round` for records (the slow convenience for tests and tools)."""
        frame = wire.encode_round_entries(round_id, self.session, deadline_ms, entries, rows, row_bytes)
        return self.round(round_id, (frame,), deadline_ms)

    def round(
        self, round_id: int, parts: Sequence, deadline_ms: int, check: Callable[[wire.DraftsFrame], None] | None = None
    ) -> RoundResult:
        """Send the ROUND frame ``parts`` (buffers, sent uncopied) on the active
        connection and wait for its DRAFTS within ``deadline_ms``; never raises for a
        remote failure. No connection is an ERROR, unsent; the breaker hears every
        attempt's event.

        ``check`` holds the drafts to what the round asked before they are returned: its
        ``wire.BadReply`` is ``BAD_REPLY`` (ERROR, the connection kept), any other
        ``wire.ProtocolError`` is ``PROTOCOL`` (ERROR, the connection left), as
        ``hf_round`` answers the same replies; either way no drafts are returned."""
        self.reap()
        conn = self._active
        if conn is None:
            return RoundResult(Outcome.ERROR, RoundEvent.AT_ONCE)
        if not self.allow():
            return RoundResult(Outcome.BREAKER_SKIP, RoundEvent.AT_ONCE)
        self.attempts += 1
        drafts, why = None, ""
        try:
            drafts = conn.client.round(round_id, parts, deadline_ms, check)
            event = RoundEvent.OK
        except DeadlineExceeded:
            event = RoundEvent.TIMEOUT
        except wire.BadReply as e:
            event, why = RoundEvent.BAD_REPLY, str(e)
        except wire.ProtocolError as e:
            event, why = RoundEvent.PROTOCOL, str(e)
        except TransportError as e:
            event, why = RoundEvent.LOST, str(e)
        self.breaker.observe(event)
        self.observe(conn.epoch, event, why, round_id)
        return RoundResult(OUTCOME_OF[event], event, drafts)

    def interrupt(self) -> None:
        """Wake a round in flight on another thread (the engine is closing): a TCP
        connection is shut down, not closed, so that round ends at once (LOST) and its
        descriptor stays valid until the round's own thread drops it. The link is closed
        from here on (no failover, no reconnect: the shut-down socket is not a lost worker)."""
        self._closed.set()
        self.keeper.wake()
        conn = self._active
        if conn is not None:
            conn.shutdown()

    def close(self) -> None:
        """Say BYE on every connection and stop the keeper. Idempotent."""
        self._closed.set()
        self.keeper.wake()
        with self._lock:
            conns = [c for c in (self._active, self._spare) if c is not None]
            self._active = self._spare = None
            retired, self._retired = self._retired, []
        for conn in conns:
            conn.client.close()  # BYE
        for conn in retired:
            conn.close()
        # Bounded: a keeper inside a connect to a silent worker ends by itself (a daemon
        # thread; it closes what it made once it sees the link closed).
        self.keeper.join(CLOSE_JOIN_S)


def _as_spare(conn: Conn) -> Conn:
    """A spare is sent nothing but PING answers (empty): any frame with a payload is
    refused at its header, before a byte of it is read or allocated."""
    conn.client.chan.max_payload = 0
    return conn

"""The network side of a proxy: one connection to the worker, reconnect with back-off,
and the breaker. Torch-free; the proxy process, the thread proxy and synchronous rounds
all use it.

A round never waits for a connection: while there is none, rounds are target-only
(``BACKOFF``) and a connector thread reconnects after ``backoff_ms``, doubling up to
``backoff_max_ms``, reset by a successful HELLO. A timed-out round keeps the connection
(its reply is dropped as late when it comes); a broken or garbled one drops it.

Every new connection is a new HELLO, after which the worker has no windows for this
engine: the first round on it is answered with RESYNC for every slot and the engine
re-announces them (NEW_GEN). ``epoch`` counts connections so callers can do that
eagerly. Each HELLO_ACK names the context the worker keeps per slot and the most tokens
it takes in a round (``context_tokens`` and ``round_tokens``: the connection's, 0 while
there is none); ``on_acked`` hears both before a round can go out on the connection, and
hears 0 for both when the connection is dropped.
With a ``key`` every connection authenticates at HELLO (:mod:`remote_dspark.wire.auth`);
a failure either way is a refused HELLO like any other: rounds stay target-only and the
connector backs off.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .. import wire
from ..outcome import DROPS_CONNECTION, OUTCOME_OF, Outcome, RoundEvent
from . import DeadlineExceeded, Endpoint, TransportError
from .auth import Key
from .breaker import Breaker
from .client import DraftClient
from .tcp import TcpStream

log = logging.getLogger("remote_dspark.link")

CLOSE_JOIN_S = 0.2  # close(): how long it waits for a connector thread


@dataclass(frozen=True)
class RoundResult:
    outcome: Outcome
    event: RoundEvent  # AT_ONCE: not sent (no connection, or the breaker open)
    drafts: wire.DraftsFrame | None = None


class RemoteLink:
    """One proxy's connection. ``round`` is called from one thread at a time.

    Invariants: ``_client`` is only replaced under ``_lock``; the connector thread runs
    only while there is no client and the link is open.
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
        key: Key | None = None,
    ):
        self.endpoint = endpoint
        self.hello = hello
        self.session = session
        self.connect_timeout_s = connect_timeout_ms / 1000.0
        self.backoff_ms = backoff_ms
        self.backoff_max_ms = backoff_max_ms
        self.breaker = breaker
        self.environ = environ
        self.on_connect = on_connect
        self.on_acked = on_acked
        self.key = key
        self.epoch = 0  # successful HELLOs so far
        self.reconnects = 0  # successful HELLOs after the first
        self.attempts = 0  # rounds that used the network
        self.last_error = ""
        self._late_closed = 0  # late replies counted on connections now closed
        self._client: DraftClient | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._connector: threading.Thread | None = None
        self._connecting = False  # a connector thread owns the next connection (under _lock)
        self._delay_ms = backoff_ms

    # ------------------------------------------------------------------ connection

    def connect(self) -> None:
        """Connect and HELLO now, within CONNECT_TIMEOUT_MS (start-up).

        Raises:
            Refused, TransportError, wire.ProtocolError: the first try failed; the
            caller decides (STRICT_START raises, otherwise :meth:`start_reconnecting`).
        """
        self._install(self._dial())

    def _dial(self) -> DraftClient:
        """One connection and its HELLO (authenticated with the key, if any)."""
        return DraftClient.connect(
            self.endpoint, self.hello, self.session, self.connect_timeout_s, self.environ, key=self.key
        )

    def start_reconnecting(self) -> None:
        """Reconnect in the background after the current back-off."""
        with self._lock:
            if self._closed.is_set() or self._client is not None or self._connecting:
                return
            self._connecting = True
            self._connector = threading.Thread(target=self._reconnect_loop, name="link-connect", daemon=True)
            self._connector.start()

    def _reconnect_loop(self) -> None:
        while not self._closed.wait(self._delay_ms / 1000.0):
            try:
                client = self._dial()
            except Exception as e:  # whatever it is, this thread must go on retrying
                self._note_failure(f"reconnect to {self.endpoint} failed: {e}")
                self._delay_ms = min(2 * self._delay_ms, self.backoff_max_ms)
                continue
            if self._closed.is_set():
                client.close()
                return
            self._install(client)
            return
        with self._lock:
            self._connecting = False

    def _install(self, client: DraftClient) -> None:
        with self._lock:
            closed = self._closed.is_set()  # closed while this connection was made
            if closed:
                self._connecting = False
        if closed:
            client.close()
            return
        if self.on_acked is not None:  # before any round can take this connection
            self.on_acked(client.ack.context_tokens, client.ack.round_tokens)
        with self._lock:
            # From here a failed round may start a new connector at once, even while the
            # thread that made this connection is still finishing.
            self._connecting = False
            self._client = client
            self.reconnects += self.epoch > 0
            self.epoch += 1
            self._delay_ms = self.backoff_ms
        log.info("connected to %s (session %#x, epoch %d)", self.endpoint, self.session, self.epoch)
        if self.on_connect is not None:
            self.on_connect()

    def drop(self, why: str) -> None:
        """Close the connection (``why`` is logged once per kind) and reconnect after
        the back-off."""
        with self._lock:
            client, self._client = self._client, None
            if client is not None:
                self._late_closed += client.late
        if client is not None:
            client.chan.close()
            if self.on_acked is not None:  # before the next connection's
                self.on_acked(0, 0)
        self._note_failure(why)
        self.start_reconnecting()

    def _note_failure(self, why: str) -> None:
        if why != self.last_error:  # one log line per kind of failure, not per round
            log.warning("%s", why)
        self.last_error = why

    @property
    def connected(self) -> bool:
        return self._client is not None

    @property
    def context_tokens(self) -> int:
        """The context tokens per slot the connection's HELLO_ACK named; 0: no connection."""
        client = self._client
        return client.ack.context_tokens if client is not None else 0

    @property
    def round_tokens(self) -> int:
        """The most tokens a round may carry on the connection (its HELLO_ACK); 0: no
        connection."""
        client = self._client
        return client.ack.round_tokens if client is not None else 0

    def tcp_socket(self):
        """The connection's socket when it is a TCP one (HELLO done), else None."""
        client = self._client
        stream = client.chan.stream if client is not None else None
        return stream.sock if isinstance(stream, TcpStream) else None

    @property
    def late(self) -> int:
        """Replies that came after their round's deadline, dropped (all connections)."""
        client = self._client
        return self._late_closed + (client.late if client else 0)

    # ------------------------------------------------------------------ rounds

    def round_entries(
        self, round_id: int, entries: Sequence[wire.Entry], rows, row_bytes: int, deadline_ms: int
    ) -> RoundResult:
        """:meth:`round` for records (the slow convenience for tests and tools)."""
        frame = wire.encode_round_entries(round_id, self.session, deadline_ms, entries, rows, row_bytes)
        return self.round(round_id, (frame,), deadline_ms)

    def round(
        self, round_id: int, parts: Sequence, deadline_ms: int, check: Callable[[wire.DraftsFrame], None] | None = None
    ) -> RoundResult:
        """Send the ROUND frame ``parts`` (buffers, sent uncopied) and wait for its
        DRAFTS within ``deadline_ms``; never raises for a remote failure. No connection
        is an ERROR, unsent; the breaker hears every attempt's event.

        ``check`` holds the drafts to what the round asked before they are returned: its
        ``wire.BadReply`` is ``BAD_REPLY`` (ERROR, the connection kept), any other
        ``wire.ProtocolError`` is ``PROTOCOL`` (ERROR, the connection dropped), as
        ``hf_round`` answers the same replies; either way no drafts are returned."""
        client = self._client
        if client is None:
            return RoundResult(Outcome.ERROR, RoundEvent.AT_ONCE)
        if not self.breaker.allow():
            return RoundResult(Outcome.BREAKER_SKIP, RoundEvent.AT_ONCE)
        self.attempts += 1
        drafts, why = None, ""
        try:
            drafts = client.round(round_id, parts, deadline_ms, check)
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
        if event in DROPS_CONNECTION:
            self.drop(f"round {round_id} on {self.endpoint} failed: {why}")
        elif event is RoundEvent.BAD_REPLY:
            self._note_failure(f"round {round_id} on {self.endpoint}: worker reply refused: {why}")
        return RoundResult(OUTCOME_OF[event], event, drafts)

    def interrupt(self) -> None:
        """Wake a round in flight on another thread (the engine is closing): a TCP
        connection is shut down, not closed, so that round ends at once (LOST) and its
        descriptor stays valid until the round's own thread drops it."""
        sock = self.tcp_socket()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already down

    def close(self) -> None:
        """Say BYE and stop reconnecting. Idempotent."""
        self._closed.set()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
        if self._connector is not None:
            # Bounded: a connector inside a connect to a silent worker ends by itself (a
            # daemon thread; it closes what it made once it sees the link closed).
            self._connector.join(CLOSE_JOIN_S)

"""The worker's front door: accepting connections and reading their HELLO.

One thread, one selector, no thread per connection until it has said HELLO. The
selector holds the listening socket, the stop pipe and every connection that has not
said HELLO yet (the pre-HELLO pool, non-blocking sockets). Per connection the pool keeps
a fixed buffer the size of one HELLO frame and reads at most that frame, never a byte
of what follows; so before HELLO the worker never allocates what a header announces.

Rules, each with its reason:

- **Only a HELLO, under the HELLO's own cap.** The header is checked as soon as its 24
  bytes are in: another frame type, a bad magic or a length over the HELLO's cap drops
  the connection with one log line (``bad_frames``). Another protocol version is
  refused (``on_refused``: a REFUSE_VERSION ack), then closed.
- **A HELLO deadline** (``hello_timeout_s``, 2 s): an honest engine sends its HELLO right
  after connecting, so a connection still silent then is dropped (``hello_timeouts``).
- **The pool has its own size** (``max_pending``): a new connection that finds it full
  makes room by dropping the oldest connection in it still reading its HELLO
  (``displaced``). So silent sockets can never keep a HELLO out: to push a connection
  out before its HELLO is read, an attacker must open ``max_pending`` connections
  between the moment that connection is accepted and the next turn of this loop, which
  reads the pool before it accepts more (at most ``max_pending // 2`` accepts a turn).
  No limit per source address: an attacker may share the engine's host.
- **A connection mid-AUTH is kept ahead of silent ones** (with a key), up to half the
  pool: one that sent a whole HELLO and was sent the worker's AUTH has shown it speaks
  the protocol, and waits a round trip for the engine's answer. So a flood of silent
  sockets costs a keyed worker no more than a keyless one. But anyone can get that far
  (a HELLO costs no key), so once more than half the pool is mid-AUTH the oldest of
  those goes first: stalled HELLOs cannot push out a newcomer whose HELLO is on its way.
- **With a key, the engine proves it before anything is given** (``key``,
  :mod:`remote_dspark.wire.auth`): a HELLO without the engine's nonce, or an engine's
  AUTH whose proof does not hold, is refused (``on_refused``: REFUSE_AUTH, the ``auth``
  refusal) from this loop. The worker's AUTH (its nonce and proof, 88 bytes)
  is sent from here without waiting (it fits any fresh socket's send buffer), and the
  engine's answer is read into the same fixed buffer, under the same deadline. Only a
  proven HELLO is handed over; until then the connection has no thread, no session and
  no buffer beyond its own.
- **A whole HELLO is handed over** (``on_hello``): the worker decides there, busy or
  served; this loop never waits for a served connection.

Why a selector and not a thread per connection: a silent socket costs a thread for the
length of the HELLO deadline otherwise, and a pool of hundreds of threads started and
ended by whoever can connect is a thread-creation flood; here it costs one descriptor
and one small buffer. A served connection (after HELLO) keeps its own thread: it runs
the drafter, which may take a while, and their number is bounded (``max_connections``).

Out of descriptors (EMFILE) a pre-HELLO connection is dropped to make room (the one a
newcomer would displace), so the listener keeps being served.
"""

from __future__ import annotations

import enum
import errno
import logging
import math
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .. import wire
from ..transport.auth import Key
from ..transport.tcp import enable_keepalive

log = logging.getLogger("remote_dspark.worker")

HELLO_FRAME = wire.HEADER.size + wire.frame_cap(wire.HELLO)
ANSWER_FRAME = wire.HEADER.size + wire.PROOF_BYTES  # the engine's AUTH
PENDING_BUFFER = HELLO_FRAME + ANSWER_FRAME  # all a pre-HELLO connection is ever given


class Drop(enum.Enum):
    """Why a connection left the pool before its HELLO was whole (each has its counter)."""

    HELLO_TIMEOUT = enum.auto()  # no HELLO within hello_timeout_s
    DISPLACED = enum.auto()  # room made for a newer connection
    BAD_FRAME = enum.auto()  # anything but a HELLO, or a header over the HELLO's cap
    CLOSED = enum.auto()  # the peer closed (or reset) first


class Stage(enum.Enum):
    """Where a pre-HELLO connection is."""

    HELLO = "hello"  # reading its HELLO: the header, then the payload
    ANSWER = "answer"  # the worker's AUTH sent: reading the engine's AUTH (a key only)


@dataclass(eq=False)
class _Unadmitted:
    """A connection that has not said (and, with a key, proven) its HELLO yet. ``buf``
    holds its HELLO frame from offset 0, then the engine's AUTH frame."""

    sock: socket.socket
    peer: object
    deadline: float
    buf: bytearray
    stage: Stage = Stage.HELLO
    start: int = 0  # where the frame being read begins in buf: the HELLO's, then the AUTH's
    got: int = 0  # bytes of buf read so far
    need: int = wire.HEADER.size  # read up to here: the frame's header, then the whole frame
    header: wire.Header | None = None  # the header of the frame being read, once whole
    hello: wire.Header | None = None  # the HELLO's header, once whole
    nonce: bytes = b""  # the worker's nonce, once its AUTH is sent

    def hello_payload(self) -> memoryview:
        """The HELLO's payload (once whole)."""
        return memoryview(self.buf)[wire.HEADER.size : wire.HEADER.size + self.hello.payload_len]


@dataclass(frozen=True)
class AdmissionStats:
    pending: int  # connections in the pool now
    accepted: int  # connections accepted
    handed: int  # whole HELLOs handed over
    hello_timeouts: int
    displaced: int  # dropped to make room for a newer connection (pool full, or out of descriptors)
    bad_frames: int  # anything but a HELLO, or a header over the HELLO's cap
    closed: int  # the peer closed (or reset) before its HELLO was whole


class Admission:
    """The accept loop and the pre-HELLO pool (``run`` is the loop; one thread).

    ``on_hello(sock, peer, header, payload)`` gets each whole HELLO (the socket still
    non-blocking; the callee owns it from then on); with ``key``, each proven HELLO (the
    module's docstring). ``on_refused(sock, peer, session, code, reason, why)`` gets a
    connection refused at the door, to answer with ``code`` and ``reason`` and count
    under ``why`` (its owner from then on): a header of another protocol version
    (``version``) or a failed authentication (``auth``). ``on_drop(why)`` is told of each
    drop but the peer's own close (:class:`Drop`).
    """

    def __init__(
        self,
        listener: socket.socket,
        wake_fd: int,
        *,
        max_pending: int,
        hello_timeout_s: float,
        on_hello: Callable,
        on_refused: Callable,
        on_drop: Callable[[Drop], None] = lambda why: None,
        clock: Callable[[], float] = time.monotonic,
        key: Key | None = None,
    ):
        if max_pending < 1:
            raise ValueError(f"max_pending {max_pending}: must be >= 1")
        if not hello_timeout_s > 0:
            raise ValueError(f"hello_timeout_s {hello_timeout_s}: must be > 0")
        self.listener = listener
        self.wake_fd = wake_fd
        self.max_pending = max_pending
        self.hello_timeout_s = hello_timeout_s
        self.on_hello, self.on_refused, self.on_drop, self.clock = on_hello, on_refused, on_drop, clock
        self.key = key
        self._buffer = HELLO_FRAME if key is None else PENDING_BUFFER
        self._pool: OrderedDict[int, _Unadmitted] = OrderedDict()  # fd -> pending, oldest first
        self._sel: selectors.BaseSelector | None = None
        self._accepted = self._handed = 0
        self._drops = dict.fromkeys(Drop, 0)
        self._last_error = -math.inf  # when an accept error was last logged

    def statistics(self) -> AdmissionStats:
        drops = self._drops
        return AdmissionStats(
            len(self._pool),
            self._accepted,
            self._handed,
            drops[Drop.HELLO_TIMEOUT],
            drops[Drop.DISPLACED],
            drops[Drop.BAD_FRAME],
            drops[Drop.CLOSED],
        )

    def run(self, stopping: threading.Event) -> None:
        """Serve until ``stopping`` is set and the wake fd is readable; closes the
        listener and every pre-HELLO connection on the way out."""
        self.listener.setblocking(False)
        self._sel = sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(self.wake_fd, selectors.EVENT_READ)
        try:
            while not stopping.is_set():
                oldest = next(iter(self._pool.values()), None)
                timeout = None if oldest is None else max(0.0, oldest.deadline - self.clock())
                accept = False
                # The pool first, then new connections: a HELLO already here is never
                # displaced by connections accepted after it in the same turn.
                for key, _ in sel.select(timeout):
                    if key.data is not None:
                        self._read(key.data)
                    elif key.fileobj is self.listener:
                        accept = True
                if stopping.is_set():
                    break
                if accept:
                    self._accept_some()
                self._expire()
        finally:
            for p in list(self._pool.values()):
                self._remove(p)
                p.sock.close()
            sel.close()
            self.listener.close()

    # ------------------------------------------------------------------ the pool

    def _accept_some(self) -> None:
        for _ in range(max(1, self.max_pending // 2)):
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._pool:
                    self._drop(self._first_to_go(), Drop.DISPLACED)
                    continue
                now = self.clock()
                if now - self._last_error >= 10.0:
                    self._last_error = now
                    log.warning("accept failed: %s", e)
                time.sleep(0.01)  # nothing of ours to free: let served connections end
                return
            self._accepted += 1
            try:
                sock.setblocking(False)
                enable_keepalive(sock)
            except OSError:
                sock.close()
                continue
            if len(self._pool) >= self.max_pending:
                gone = self._first_to_go()
                log.debug("pre-HELLO pool full (%d): dropping %s (%s)", self.max_pending, gone.peer, gone.stage.value)
                self._drop(gone, Drop.DISPLACED)
            p = _Unadmitted(sock, peer, self.clock() + self.hello_timeout_s, bytearray(self._buffer))
            self._pool[sock.fileno()] = p
            self._sel.register(sock, selectors.EVENT_READ, p)

    def _first_to_go(self) -> _Unadmitted:
        """The connection a newcomer displaces from a full pool: the oldest still reading
        its HELLO, while at most half the pool is mid-AUTH; else the oldest mid-AUTH (the
        module docstring)."""
        oldest: dict[Stage, _Unadmitted] = {}
        for p in self._pool.values():  # oldest first (at most max_pending of them)
            oldest.setdefault(p.stage, p)
        mid_auth = sum(p.stage is Stage.ANSWER for p in self._pool.values())
        if Stage.HELLO in oldest and mid_auth <= self.max_pending // 2:
            return oldest[Stage.HELLO]
        return oldest[Stage.ANSWER]

    def _read(self, p: _Unadmitted) -> None:
        try:
            n = p.sock.recv_into(memoryview(p.buf)[p.got : p.need])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if n == 0:
            self._drop(p, Drop.CLOSED)
            return
        p.got += n
        if p.header is None and p.got == p.need and not self._judge_header(p):
            return
        if p.header is not None and p.got == p.need:
            if p.stage is Stage.HELLO:
                self._hello_read(p)
            else:
                self._answer_read(p)

    def _judge_header(self, p: _Unadmitted) -> bool:
        """The header of the frame being read is whole: True when the frame may go on
        (``p.header`` set, ``p.need`` past its payload), False when the connection left
        the pool (dropped as a bad frame, or refused for its protocol version)."""
        try:
            hdr = wire.decode_header(p.buf[p.start : p.start + wire.HEADER.size])
        except wire.VersionMismatch as e:
            if p.stage is not Stage.HELLO:
                self._bad(p, f"{e}, after a HELLO of this version")
                return False
            self._remove(p)
            self.on_refused(p.sock, p.peer, 0, wire.REFUSE_VERSION, str(e), "version")
            return False
        except wire.ProtocolError as e:
            self._bad(p, str(e))
            return False
        if p.stage is Stage.HELLO and hdr.type != wire.HELLO:
            self._bad(p, f"{hdr.name} of {hdr.payload_len} bytes before HELLO")
            return False
        if p.stage is Stage.ANSWER and (
            hdr.type != wire.AUTH or hdr.payload_len != wire.PROOF_BYTES or hdr.session != p.hello.session
        ):
            self._bad(
                p,
                f"{hdr.name} of {hdr.payload_len} bytes for session {hdr.session:#x} where the "
                f"engine's AUTH ({wire.PROOF_BYTES} bytes, session {p.hello.session:#x}) was expected",
            )
            return False
        p.header, p.need = hdr, p.start + wire.HEADER.size + hdr.payload_len
        return True

    def _hello_read(self, p: _Unadmitted) -> None:
        """A whole HELLO: handed over; with a key, challenged (the worker's AUTH sent) or,
        without the engine's nonce, refused."""
        p.hello = p.header
        if self.key is None:
            self._hand_over(p)
            return
        hello_payload = p.hello_payload()
        if len(hello_payload) != wire.HELLO_STRUCT.size + wire.NONCE_BYTES:
            self._refuse_auth(
                p,
                "this worker requires authentication (--key-file) and the HELLO carries no nonce: "
                "set VLLM_DSPARK_REMOTE_KEY_FILE to a file holding this worker's key",
            )
            return
        p.nonce = wire.auth.new_nonce()
        proof = wire.auth.proof(self.key.secret, wire.auth.WORKER, p.hello.session, hello_payload, p.nonce)
        frame = wire.auth.encode_challenge(p.hello.session, p.nonce, proof)
        try:
            sent = p.sock.send(frame)  # non-blocking: a fresh socket's buffer holds it whole
        except OSError:
            sent = 0
        if sent != len(frame):
            self._drop(p, Drop.CLOSED)
            return
        p.stage, p.start, p.header = Stage.ANSWER, p.need, None
        p.need = p.start + wire.HEADER.size

    def _answer_read(self, p: _Unadmitted) -> None:
        """The engine's AUTH, whole: a proof that holds hands the HELLO over; any other
        is refused."""
        proof = wire.auth.decode_answer(memoryview(p.buf)[p.start + wire.HEADER.size : p.need])
        if wire.auth.proof_holds(self.key.secret, wire.auth.ENGINE, p.hello.session, p.hello_payload(), p.nonce, proof):
            self._hand_over(p)
        else:
            self._refuse_auth(p, "the engine's proof does not hold for this worker's key: it holds another key")

    def _hand_over(self, p: _Unadmitted) -> None:
        self._remove(p)
        self._handed += 1
        self.on_hello(p.sock, p.peer, p.hello, bytes(p.hello_payload()))

    def _refuse_auth(self, p: _Unadmitted, reason: str) -> None:
        self._remove(p)
        self.on_refused(p.sock, p.peer, p.hello.session, wire.REFUSE_AUTH, reason, "auth")

    def _expire(self) -> None:
        now = self.clock()
        while self._pool:
            oldest = next(iter(self._pool.values()))
            if oldest.deadline > now:
                return
            log.debug("connection %s: no HELLO within %.1f s; dropped", oldest.peer, self.hello_timeout_s)
            self._drop(oldest, Drop.HELLO_TIMEOUT)

    def _bad(self, p: _Unadmitted, why: str) -> None:
        log.warning("connection %s: %s; dropped", p.peer, why)
        self._drop(p, Drop.BAD_FRAME)

    def _drop(self, p: _Unadmitted, why: Drop) -> None:
        self._drops[why] += 1  # counted before the close: whoever sees it closed sees it counted
        if why is not Drop.CLOSED:
            self.on_drop(why)
        self._remove(p)
        p.sock.close()

    def _remove(self, p: _Unadmitted) -> None:
        """Out of the pool and the selector (the socket stays open)."""
        del self._pool[p.sock.fileno()]
        self._sel.unregister(p.sock)

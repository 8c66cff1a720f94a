"""The reference remote drafter: a ``tcp://`` server speaking the wire contract.

One thread per connection (at most ``max_connections``), an accept loop woken by a
self-pipe so ``stop()`` (and SIGTERM in the CLI) ends it at once. Per connection:
HELLO first (identities checked, refused with a reason on mismatch), then ROUND frames
answered with DRAFTS, until BYE, a closed socket, or a bad frame, which closes that
connection only, with one log line.

Windows are kept per (engine, session, slot): the last ``window`` tokens of each slot
and the position the next token must have. A new session of the same engine (a
respawned proxy) replaces the old session's windows; a NEW_GEN entry rebuilds a slot;
an entry for a slot the worker does not know, or with a gap in its positions, is
answered with ``STATUS_RESYNC`` and no drafts, so the engine re-announces it.

Memory is bounded: ``max_engines`` engines (least recently seen dropped first), HELLO's
``max_slots`` (capped by the worker's own) slots per session, ``window`` tokens per slot,
and the wire caps on every frame.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from . import wire
from .markov import MarkovModel, builtin_model
from .transport import DeadlineExceeded, Disconnected, FrameChannel
from .transport.tcp import TcpStream

log = logging.getLogger("remote_dspark.worker")

DEFAULT_LISTEN = "127.0.0.1:18620"


class Drafter(Protocol):
    """What the worker needs of a drafter; ``--drafter module:factory`` supplies one.

    ``factory()`` returns an object with the two 32-byte identities the engine must
    match and a ``draft`` method called once per entry of every round.
    """

    drafter_identity: bytes
    markov_identity: bytes

    def draft(self, context: Sequence[int], n_out: int, row: memoryview) -> tuple[list[int], list[float]]:
        """Up to ``n_out`` tokens following ``context`` and their top1-top2 margins.
        ``row`` is the slot's opaque engine row for this round."""


class MarkovDrafter:
    """The default drafter: greedy drafting from a :class:`MarkovModel`."""

    def __init__(self, model: MarkovModel, drafter_identity: bytes | None = None):
        self.model = model
        self.markov_identity = model.identity
        self.drafter_identity = drafter_identity or default_drafter_identity(model)

    def draft(self, context, n_out, row):
        return self.model.draft(context, n_out)


def default_drafter_identity(model: MarkovModel) -> bytes:
    return hashlib.sha256(f"remote-dspark markov drafter v1 order={model.order}".encode()).digest()


def load_drafter(spec: str | None, markov_path: str | None = None, identity: bytes | None = None) -> Drafter:
    """The drafter named by ``module:factory``, or the Markov drafter.

    Raises: ValueError naming the spec or file that could not be used.
    """
    if spec:
        mod_name, sep, attr = spec.partition(":")
        if not sep or not mod_name or not attr:
            raise ValueError(f"--drafter {spec!r}: expected MODULE:FACTORY")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--drafter {spec!r}: {e}") from e
        drafter = factory()
        for name in ("drafter_identity", "markov_identity"):
            value = getattr(drafter, name, None)
            if not isinstance(value, bytes) or len(value) != 32:
                raise ValueError(f"--drafter {spec!r}: {name} must be 32 bytes, got {value!r}")
        return drafter
    try:
        model = MarkovModel.load(markov_path) if markov_path else builtin_model()
    except OSError as e:
        raise ValueError(f"--markov {markov_path!r}: {e}") from e
    return MarkovDrafter(model, identity)


@dataclass
class _Slot:
    tokens: deque
    next_position: int


@dataclass
class Session:
    session: int
    max_slots: int
    num_spec: int
    slots: dict[int, _Slot] = field(default_factory=dict)


@dataclass
class WorkerStats:
    connections: int = 0
    refused: int = 0
    bad_frames: int = 0
    rounds: int = 0
    entries: int = 0
    resyncs: int = 0
    draft_tokens: int = 0


class Worker:
    """The server. ``start()`` binds and serves in background threads; ``stop()`` ends
    everything (sends BYE to every open connection) and returns when all threads did."""

    def __init__(self, drafter: Drafter, host: str = "127.0.0.1", port: int = 18620, *,
                 window: int = 64, max_slots: int = wire.MAX_ENTRIES, max_engines: int = 64,
                 max_connections: int = 64, idle_timeout_s: float = 300.0):
        self.drafter = drafter
        self.host, self.port = host, port
        self.window = window
        self.max_slots = max_slots
        self.max_engines = max_engines
        self.max_connections = max_connections
        self.idle_timeout_s = idle_timeout_s
        self.stats = WorkerStats()
        # Fault injection (``remote-dspark worker --chaos``): answer every round this
        # late, and garble the next ``garble`` replies (random bytes for a DRAFTS frame).
        self.reply_delay_s = 0.0
        self.garble = 0
        self._engines: OrderedDict[int, Session] = OrderedDict()  # engine id -> session
        self._lock = threading.Lock()          # guards _engines, _conns, stats
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "Worker":
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise ValueError(f"--listen {self.host}:{self.port}: {e.strerror}") from e
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self._listener = sock
        self._acceptor = threading.Thread(target=self._accept_loop, name="worker-accept", daemon=True)
        self._acceptor.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        os.write(self._wake_w, b"x")
        if self._acceptor:
            self._acceptor.join(timeout_s)
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            # Wakes the connection's thread out of recv; it says BYE and closes.
            try:
                c.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        for t in list(self._threads):
            t.join(timeout_s)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ accept

    def _accept_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stopping.is_set():
                for key, _ in sel.select():
                    if key.fileobj is not self._listener or self._stopping.is_set():
                        continue
                    try:
                        conn, peer = self._listener.accept()
                    except OSError:
                        continue
                    self._admit(conn, peer)
        finally:
            sel.close()
            self._listener.close()

    def _admit(self, conn: socket.socket, peer) -> None:
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._conns) >= self.max_connections:
                log.warning("refusing connection from %s: %d connections open", peer, len(self._conns))
                conn.close()
                return
            self._conns.add(conn)
            self.stats.connections += 1
            t = threading.Thread(target=self._serve, args=(conn, peer), name=f"worker-conn-{peer}", daemon=True)
            self._threads.append(t)
        t.start()

    # ------------------------------------------------------------------ one connection

    def _serve(self, conn: socket.socket, peer) -> None:
        chan = FrameChannel(TcpStream(conn))
        session: Session | None = None
        try:
            while not self._stopping.is_set():
                hdr, payload = chan.recv_frame(time.monotonic() + self.idle_timeout_s)
                if hdr.type == wire.BYE:
                    return
                if session is None:
                    if hdr.type != wire.HELLO:
                        raise wire.ProtocolError(f"{hdr.name} before HELLO")
                    session = self._hello(chan, hdr, payload)
                    if session is None:
                        return
                elif hdr.type == wire.ROUND:
                    reply = self._round(session, hdr, payload)
                    if self.reply_delay_s:
                        time.sleep(self.reply_delay_s)
                    if self.garble > 0:
                        self.garble -= 1
                        reply = os.urandom(len(reply))
                    chan.send(reply)
                else:
                    raise wire.ProtocolError(f"unexpected {hdr.name} from the engine side")
        except wire.VersionMismatch as e:
            with self._lock:
                self.stats.bad_frames += 1
            log.warning("connection %s: %s; refused", peer, e)
            self._send_quietly(chan, self._ack(wire.REFUSE_VERSION, str(e), 0))
        except wire.ProtocolError as e:
            with self._lock:
                self.stats.bad_frames += 1
            log.warning("connection %s: bad frame, closing it: %s", peer, e)
        except (Disconnected, DeadlineExceeded):
            pass
        finally:
            if self._stopping.is_set():
                self._send_quietly(chan, wire.encode_bye(session.session if session else 0))
            chan.close()
            with self._lock:
                self._conns.discard(conn)

    def _hello(self, chan: FrameChannel, hdr: wire.Header, payload) -> Session | None:
        hello = wire.decode_hello(payload)
        code, reason = wire.ACCEPT, ""
        if hello.drafter_identity != self.drafter.drafter_identity:
            code = wire.REFUSE_DRAFTER
            reason = (f"drafter identity mismatch: engine {hello.drafter_identity.hex()}, "
                      f"worker {self.drafter.drafter_identity.hex()} (VLLM_DSPARK_REMOTE_IDENTITY)")
        elif hello.markov_identity != self.drafter.markov_identity:
            code = wire.REFUSE_MARKOV
            reason = (f"Markov identity mismatch: engine {hello.markov_identity.hex()}, "
                      f"worker {self.drafter.markov_identity.hex()} (VLLM_DSPARK_REMOTE_MARKOV_IDENTITY)")
        elif hello.max_slots > self.max_slots:
            code = wire.REFUSE_LIMITS
            reason = f"max_slots {hello.max_slots} over this worker's {self.max_slots}"
        if code != wire.ACCEPT:
            with self._lock:
                self.stats.refused += 1
            log.warning("refused HELLO of session %#x: %s", hdr.session, reason)
            chan.send(self._ack(code, reason, hdr.session))
            return None
        chan.send(self._ack(code, reason, hdr.session))
        session = Session(hdr.session, hello.max_slots, hello.num_spec)
        with self._lock:
            # A new session of the same engine (a respawned proxy) replaces the old one:
            # its windows go now, not when its connection closes; an old connection that
            # still sends rounds gets RESYNC for every slot. The least recently seen engine
            # beyond max_engines loses its windows the same way.
            old = self._engines.pop(hello.engine_id, None)
            if old is not None:
                old.slots.clear()
            self._engines[hello.engine_id] = session
            while len(self._engines) > self.max_engines:
                self._engines.popitem(last=False)[1].slots.clear()
        log.info("session %#x of engine %#x: %d slots, num_spec %d", hdr.session, hello.engine_id,
                 hello.max_slots, hello.num_spec)
        return session

    def _ack(self, code: int, reason: str, session: int) -> bytes:
        return wire.encode_hello_ack(
            wire.HelloAck(code, self.drafter.drafter_identity, self.drafter.markov_identity, reason), session)

    def _round(self, session: Session, hdr: wire.Header, payload) -> bytes:
        rnd = wire.decode_round(hdr, payload)
        n = len(rnd.entries)
        width = min(max((e.n_out for e in rnd.entries), default=0), session.num_spec)
        counts, statuses, tokens = [0] * n, [wire.STATUS_OK] * n, [0] * (n * width)
        margins = [0.0] * (n * width)
        for i, e in enumerate(rnd.entries):
            if e.slot >= session.max_slots:
                raise wire.ProtocolError(f"slot {e.slot} outside the session's {session.max_slots}")
            context = self._advance(session, e)
            if context is None:
                statuses[i] = wire.STATUS_RESYNC
                continue
            row = rnd.rows[i * rnd.row_bytes:(i + 1) * rnd.row_bytes]
            draft, margin = self.drafter.draft(context, min(e.n_out, width), row)
            draft, margin = draft[:width], margin[:width]
            counts[i] = len(draft)
            tokens[i * width:i * width + len(draft)] = draft
            margins[i * width:i * width + len(margin)] = margin
        with self._lock:
            self.stats.rounds += 1
            self.stats.entries += n
            self.stats.resyncs += statuses.count(wire.STATUS_RESYNC)
            self.stats.draft_tokens += sum(counts)
        return wire.encode_drafts(wire.Drafts(rnd.round_id, [e.slot for e in rnd.entries], counts,
                                              statuses, width, tokens, margins), hdr.session)

    def _advance(self, session: Session, e: wire.Entry) -> Sequence[int] | None:
        """Apply an entry to its slot's window; the context to draft from, or None
        when the slot must be re-announced."""
        slot = session.slots.get(e.slot)
        if e.new_gen:
            slot = session.slots[e.slot] = _Slot(deque(e.tokens, maxlen=self.window), 0)
        elif slot is None or e.position != slot.next_position:
            session.slots.pop(e.slot, None)
            return None
        else:
            slot.tokens.extend(e.tokens)
        slot.next_position = e.position + len(e.tokens)
        return list(slot.tokens)

    @staticmethod
    def _send_quietly(chan: FrameChannel, frame: bytes) -> None:
        try:
            chan.send(frame)
        except Disconnected:
            pass


def parse_listen(raw: str) -> tuple[str, int]:
    """``HOST:PORT`` for ``--listen``. Raises: ValueError naming the value."""
    host, sep, port_s = raw.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(f"--listen {raw!r}: expected HOST:PORT with PORT in 0..65535")
    return host, int(port_s)

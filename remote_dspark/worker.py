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
answered with ``STATUS_RESYNC`` and no drafts, and the slot is forgotten, so the engine
re-announces it.

A round is handled without a Python loop over its entries: the ROUND's sections are
read as numpy arrays in place; a session's windows
(:class:`~remote_dspark.worker_windows.Windows`) are updated for all entries at once;
the contexts go to the drafter as one ragged ``(tokens, offsets)`` pair
(:class:`~remote_dspark.drafter.DraftBatch`), and the DRAFTS reply is written from the
result's arrays into one buffer at ``wire.drafts_sections`` offsets.

Memory is bounded: ``max_engines`` engines (least recently seen dropped first), HELLO's
``max_slots`` (capped by the worker's own) slots per session, ``window`` tokens per slot,
and the wire caps on every frame.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from . import wire
from .drafter import (BatchedDrafter, DraftBatch, MarkovDrafter, PerEntryDrafterLike, as_batched,  # noqa: F401
                      check_result, default_drafter_identity, empty_result, load_drafter, vocab_size_of)
from .transport import DeadlineExceeded, Disconnected, FrameChannel
from .transport.tcp import TcpStream
from .worker_windows import Windows

log = logging.getLogger("remote_dspark.worker")

DEFAULT_LISTEN = "127.0.0.1:18620"

# The old name of the per-entry drafter protocol (still accepted: drafter.as_batched).
Drafter = PerEntryDrafterLike


@dataclass
class Session:
    session: int
    max_slots: int
    num_spec: int
    want_margin: bool
    windows: Windows


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

    def __init__(self, drafter: BatchedDrafter | Drafter, host: str = "127.0.0.1", port: int = 18620, *,
                 window: int = 64, max_slots: int = wire.MAX_ENTRIES, max_engines: int = 64,
                 max_connections: int = 64, idle_timeout_s: float = 300.0):
        if window < 1:
            raise ValueError(f"window {window}: must be >= 1")
        self.drafter = drafter                   # as given (its identities are checked at HELLO)
        self._batched = as_batched(drafter)      # what rounds call
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
        except Exception:   # the drafter (or this worker) failed: this connection only, loudly
            log.exception("connection %s: failed serving a round; closing it", peer)
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
        elif hello.vocab_size and vocab_size_of(self.drafter) > hello.vocab_size:
            code = wire.REFUSE_DRAFTER   # its drafts could name tokens the engine does not have
            reason = (f"vocabulary mismatch: the drafter's vocabulary is {vocab_size_of(self.drafter)} tokens, "
                      f"over the engine's {hello.vocab_size}")
        elif hello.max_slots > self.max_slots:
            code = wire.REFUSE_LIMITS
            reason = f"max_slots {hello.max_slots} over this worker's {self.max_slots}"
        if code != wire.ACCEPT:
            with self._lock:
                self.stats.refused += 1
            log.warning("refused HELLO of session %#x: %s", hdr.session, reason)
            chan.send(self._ack(code, reason, hdr.session))
            return None
        session = Session(hdr.session, hello.max_slots, hello.num_spec, hello.want_margin,
                          Windows(hello.max_slots, self.window))
        with self._lock:
            # A new session of the same engine (a respawned proxy) replaces the old one:
            # its windows go now, not when its connection closes; an old connection that
            # still sends rounds gets RESYNC for every slot. The least recently seen engine
            # beyond max_engines loses its windows the same way.
            old = self._engines.pop(hello.engine_id, None)
            if old is not None:
                old.windows.forget_all()
            self._engines[hello.engine_id] = session
            while len(self._engines) > self.max_engines:
                self._engines.popitem(last=False)[1].windows.forget_all()
        # Only now the ACK: once the engine side has it, the old windows are gone.
        chan.send(self._ack(code, reason, hdr.session))
        log.info("session %#x of engine %#x: %d slots, num_spec %d", hdr.session, hello.engine_id,
                 hello.max_slots, hello.num_spec)
        return session

    def _ack(self, code: int, reason: str, session: int) -> bytes:
        return wire.encode_hello_ack(
            wire.HelloAck(code, self.drafter.drafter_identity, self.drafter.markov_identity, reason), session)

    def _round(self, session: Session, hdr: wire.Header, payload) -> bytes:
        """One ROUND in, its DRAFTS frame out; no Python loop over the entries."""
        rnd = wire.decode_round(hdr, payload)
        n = len(rnd)
        slots = np.frombuffer(rnd.slots, np.uint32).astype(np.int64)
        n_out = np.frombuffer(rnd.n_out, np.uint32)
        session.windows.check_slots(slots)
        ok, ctx, ctx_offsets = session.windows.advance(
            slots, np.frombuffer(rnd.positions, np.uint32).astype(np.int64),
            (np.frombuffer(rnd.flags, np.uint32) & wire.FLAG_NEW_GEN) != 0,
            np.frombuffer(rnd.offsets, np.uint32).astype(np.int64), np.frombuffer(rnd.tokens, np.int32))
        width = min(int(n_out.max()) if n else 0, session.num_spec)
        all_ok = bool(ok.all())
        rows = np.frombuffer(rnd.rows, np.uint8).reshape(n, rnd.row_bytes)
        batch = DraftBatch(ctx, ctx_offsets, np.minimum(n_out if all_ok else n_out[ok], width).astype(np.int32),
                           rows if all_ok else rows[ok], session.want_margin, width)
        # No drafting entries (an empty round, or every slot to re-announce): no call.
        result = (check_result(self._batched.draft_batch(batch), batch) if len(batch)
                  else empty_result(0, width, session.want_margin))
        reply, out = _drafts_frame(hdr.session, rnd.round_id, n, width, result.margins is not None)
        out.slots[:] = slots
        out.statuses[:] = np.where(ok, wire.STATUS_OK, wire.STATUS_RESYNC)
        where = slice(None) if all_ok else ok
        out.counts[where] = result.counts
        out.tokens[where] = result.tokens
        if out.margins is not None:
            out.margins[where] = result.margins
        with self._lock:
            self.stats.rounds += 1
            self.stats.entries += n
            self.stats.resyncs += n - int(np.count_nonzero(ok))
            self.stats.draft_tokens += int(result.counts.sum())
        return reply

    @staticmethod
    def _send_quietly(chan: FrameChannel, frame: bytes) -> None:
        try:
            chan.send(frame)
        except Disconnected:
            pass


@dataclass
class _DraftsArrays:
    """Writable views of a DRAFTS frame's sections (``_drafts_frame``)."""

    slots: np.ndarray       # [n] u32
    counts: np.ndarray      # [n] u16
    statuses: np.ndarray    # [n] u16
    tokens: np.ndarray      # [n, width] i32
    margins: np.ndarray | None   # [n, width] f32


def _drafts_frame(session: int, round_id: int, n: int, width: int, margins: bool) -> tuple[bytearray, _DraftsArrays]:
    """A whole zeroed DRAFTS frame (header and fixed part written) and views of its
    sections, at ``wire.drafts_sections`` offsets, for the caller to fill."""
    sec = wire.drafts_sections(n, width, margins)
    at = wire.HEADER.size
    frame = bytearray(at + sec.size)
    frame[:at] = wire.encode_header(wire.DRAFTS, sec.size, session, round_id)
    wire.DRAFTS_FIXED.pack_into(frame, at, n, width, wire.DRAFTS_MARGINS if margins else 0)

    def view(dtype, offset: int, count: int) -> np.ndarray:
        return np.frombuffer(frame, dtype, count, at + offset)
    return frame, _DraftsArrays(
        view(np.uint32, sec.slots, n), view(np.uint16, sec.counts, n), view(np.uint16, sec.statuses, n),
        view(np.int32, sec.tokens, n * width).reshape(n, width),
        view(np.float32, sec.margins, n * width).reshape(n, width) if margins else None)


def parse_listen(raw: str) -> tuple[str, int]:
    """``HOST:PORT`` for ``--listen``. Raises: ValueError naming the value."""
    host, sep, port_s = raw.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(f"--listen {raw!r}: expected HOST:PORT with PORT in 0..65535")
    return host, int(port_s)

"""The reference remote drafter: a ``tcp://`` server speaking the wire contract.

An accept loop (:class:`~remote_dspark.worker.admission.Admission`, one thread with a
selector, woken by a self-pipe so ``stop()`` and SIGTERM end it at once) holds every
connection until it has said HELLO, under the HELLO's own small cap and a HELLO
deadline, in a pool of its own where the oldest silent one makes room for a newcomer.
A whole HELLO (with a key, proven: :mod:`remote_dspark.wire.auth`) gets a served
connection (a thread judges its HELLO; :mod:`.serving`); when ``max_connections`` are served, the connection of the
least recently served session makes room if it idled ``recent_s`` (the engines' rule,
:func:`~remote_dspark.worker.sessions.displaceable`), else a spare's (the order:
:mod:`.sessions`), else the HELLO is refused "busy".
Per served connection: the HELLO is checked (identities, this worker's
:class:`~remote_dspark.worker.limits.Limits`, a place among the engines:
:class:`~remote_dspark.worker.sessions.Sessions`), each refusal with its reason; then
ROUND frames are answered with DRAFTS until BYE, a closed socket, or a bad frame, which
closes that connection only, with one log line. A served connection may idle between
frames for as long as it likes (TCP keepalive finds a dead peer) while no newcomer needs
its place; a frame, once begun, must be whole within ``frame_timeout_s``.

Windows are kept per (engine, session, slot): the last ``window`` tokens of each slot
and the position the next token must have. A new session of the same engine (a
respawned proxy) replaces the old session's windows; a NEW_GEN entry rebuilds a slot;
an entry for a slot the worker does not know, or with a gap in its positions, is
answered with ``STATUS_RESYNC`` and no drafts, and the slot is forgotten, so the engine
re-announces it.

A round is handled without a Python loop over its entries. By default it never meets
the interpreter between its bytes in and its reply out: the hub (:mod:`.hub`) reads,
checks and applies every connection's frames in C on one I/O thread, the drafter's
thread drafts a call's worth, and C writes and sends the replies; with the built-in
greedy Markov drafter a connection's round is one C call on its own thread
(:mod:`.lane`). Otherwise (``--round-path native``, or faults to inject) one C call
checks the ROUND, updates the windows and writes the drafter's batch
(:mod:`.native_round`; the numpy reference, :mod:`.round`, when asked or when the
library cannot load), on the connection's own thread.

Memory is bounded by this worker's own numbers, never by what a peer announces
(docs/design/worker.md, "Memory bounds", writes them out).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time

from .. import wire
from ..drafter.contract import BatchedDrafter, PerEntryDrafterLike, as_batched, max_positions_of
from ..transport.tcp import SEND_TIMEOUT_S
from . import lane, native_round
from .admission import Admission, Drop
from .faults import Faults
from .hub import Hub
from .limits import stream_keep
from .options import WorkerOptions
from .scheduler import Scheduler
from .serving import Serving
from .sessions import Session, Sessions
from .stats import Health, WorkerStats

log = logging.getLogger("remote_dspark.worker")


class Worker(Serving):
    """The server. ``start()`` binds and serves in background threads; ``stop()`` ends
    everything (sends BYE to every open connection) and returns when all threads did.

    ``options`` (:class:`~remote_dspark.worker.options.WorkerOptions`, its defaults when
    not given) with ``changes``, its fields by name, replaced:
    ``Worker(drafter, "127.0.0.1", 0, window=16)``. ``self.round_path`` is the round path in
    use (no library: Python, with a warning).
    """

    def __init__(
        self,
        drafter: BatchedDrafter | PerEntryDrafterLike,
        host: str = "127.0.0.1",
        port: int = 18620,
        options: WorkerOptions | None = None,
        **changes,
    ):
        self.options = opts = dataclasses.replace(options or WorkerOptions(), **changes)
        self.drafter = drafter  # as given (its identities are checked at HELLO)
        self._max_positions = max_positions_of(drafter)  # entries past it get no drafts
        stream_keep(drafter, opts.window)  # a bad max_context stops the start, not a HELLO
        self._native = native_round.load() if opts.round_path != "python" else None
        self.host, self.port = host, port
        self.limits = opts.limits
        served = opts.round_path == "served" and self._native is not None and opts.faults is None
        self._lanes = None  # lane.Lanes when this worker's connections may serve rounds in C
        if served and lane.takes(self._native, drafter, opts.faults):
            self._lanes = lane.Lanes(self._native, drafter, self.limits, self._max_positions, opts.frame_timeout_s)
        self._hub = None  # every other connection's rounds in C (2 places a connection: one may be ending)
        if served:
            self._hub = Hub(
                self._native,
                2 * opts.max_connections,
                self.limits,
                self._max_positions,
                opts.frame_timeout_s,
                SEND_TIMEOUT_S,
                self._hub_event,
                self._hub_job,
                self._hub_call_answered,
                self._hub_failed,
                opts.window,
            )
        self.round_path = "served" if served else "native" if self._native else "python"
        # Every round goes through the drafter's own thread (continuous batching, fairness, deadlines)
        self._scheduler = Scheduler(
            as_batched(drafter),
            max_entries=opts.max_batch_entries,
            max_tokens=opts.max_batch_tokens,
            on_call=self._called,
            batching=opts.batching,
            call_share=opts.call_deadline_share,
            source=self._hub,
        )
        self.stats = WorkerStats()
        # This worker's own random nonzero id, in every HELLO_ACK: a worker restarted at the
        # same address is another one, its sessions and windows gone (drawn per Worker, so a
        # test's second worker in one process is another one too).
        self.incarnation = wire.random_id()
        self.metrics_port = opts.metrics_port  # the bound one once started
        self._metrics = None  # metrics.MetricsServer while started with a metrics port
        self._started = time.monotonic()
        self._sessions = Sessions(opts.max_engines, opts.recent_s, opts.sessions_clock, opts.history_mb << 20)
        self._lock = threading.Lock()  # guards _conns, _threads, stats
        # served connections (after HELLO) -> their session (None while the HELLO is judged)
        self._conns: dict[socket.socket, Session | None] = {}
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._admission: Admission | None = None
        self._acceptor: threading.Thread | None = None

    @property
    def faults(self) -> Faults | None:
        """The fault injector the options gave (None: none), for a test or a signal to change."""
        return self.options.faults

    @property
    def budget(self) -> tuple[int, int]:
        """A drafting call's entries and tokens at most (the tokens derived at start when not given)."""
        return self._scheduler.max_entries, self._scheduler.max_tokens

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Worker:
        self._scheduler.reserve()  # the drafter's working memory for a call at the budget
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise ValueError(f"--listen {self.host}:{self.port}: {e.strerror}") from e
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self._started = time.monotonic()
        if self.metrics_port is not None:
            from .metrics import MetricsServer  # lazily: prometheus_client only when asked for

            try:
                self._metrics = MetricsServer(self, self.options.metrics_host, self.metrics_port)
            except BaseException:
                sock.close()
                raise
            self.metrics_port = self._metrics.port
        self._admission = Admission(
            sock,
            self._wake_r,
            max_pending=self.options.max_pending,
            hello_timeout_s=self.options.hello_timeout_s,
            on_hello=self._on_hello,
            on_refused=self._refused_at_door,
            on_drop=self._dropped_at_door,
            key=self.options.key,
        )
        self._scheduler.start()
        if self._hub is not None:
            self._hub.start()
        self._acceptor = threading.Thread(
            target=self._admission.run, args=(self._stopping,), name="worker-accept", daemon=True
        )
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
        self._drain(timeout_s)  # the hub's: their rounds in flight answered, then ended
        self._scheduler.stop(timeout_s)  # after the connections: their rounds in flight are answered
        if self._hub is not None:
            self._drain(timeout_s)  # (rounds the scheduler failed: their connections end now)
            self._hub.stop(timeout_s)
            if self._hub.alive() or self._scheduler.alive():  # a call or an end still running: theirs
                log.warning("the worker's threads did not stop within %.1f s; its connections are left", timeout_s)
            else:
                for hc in self._hub.connections():  # what did not end in time: ended here, both threads gone
                    self._hub.remove(hc)
                    self._ended(hc.sock, hc.peer, hc.session, hc.chan, None)
                self._hub.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._metrics is not None:  # last: /healthz says "stopping" (503) while the rest stops
            self._metrics.close(timeout_s)

    def _drain(self, timeout_s: float) -> None:
        """Wait (bounded) until the hub's connections, shut for reading, have ended."""
        deadline = time.monotonic() + timeout_s
        while self._hub is not None and self._hub.connections() and time.monotonic() < deadline:
            time.sleep(0.002)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def admission(self):
        """The front door's statistics (:class:`~remote_dspark.worker.admission.AdmissionStats`)."""
        return self._admission.statistics() if self._admission else None

    def statistics(self) -> WorkerStats:
        """A consistent copy of :attr:`stats` (taken under the lock), with the PINGs the
        hub answered in C (its I/O thread's count) added to those answered in Python."""
        with self._lock:
            stats = self.stats.copy()
        if self._hub is not None:
            stats.pings += self._hub.pings()
        return stats

    def sessions_now(self) -> tuple[int, int]:
        """``(engines, spares)``: the sessions held now that are not spare, and the spares."""
        return self._sessions.counts()

    def served_now(self) -> int:
        """Connections served at this moment."""
        with self._lock:
            return len(self._conns)

    def health(self) -> Health:
        with self._lock:
            served, connections, rounds = len(self._conns), self.stats.connections, self.stats.rounds
        serving = not self._stopping.is_set()
        return Health(
            "serving" if serving else "stopping",
            time.monotonic() - self._started,
            connections,
            served,
            rounds,
            serving and served < self.options.max_connections,
        )

    def _called(self, *call) -> None:
        """The scheduler's word of one drafter call (:meth:`WorkerStats.add_call`'s arguments)."""
        with self._lock:
            self.stats.add_call(*call)

    def _dropped_at_door(self, why: Drop) -> None:
        """A connection the front door dropped before its HELLO, counted by why."""
        with self._lock:
            if why is Drop.HELLO_TIMEOUT:
                self.stats.hello_timeouts += 1
            elif why is Drop.DISPLACED:
                self.stats.displaced += 1
            elif why is Drop.BAD_FRAME:
                self.stats.bad_frames += 1

    def _refuse(self, reason: str) -> None:
        with self._lock:
            self.stats.refusals[reason] += 1

    # ------------------------------------------------------------------ admission (the accept thread)

    def _on_hello(self, conn: socket.socket, peer, hdr: wire.Header, payload: bytes) -> None:
        """A whole HELLO from the pre-HELLO pool: a served connection and its thread, or
        "busy" when ``max_connections`` are served and none idled past ``recent_s``
        (then the least recently served one is displaced for it:
        :meth:`~remote_dspark.worker.sessions.Sessions.displace`). Answered from here,
        not blocking: the ack fits any fresh socket's send buffer."""
        if self._stopping.is_set():
            conn.close()
            return
        victim = None
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            busy = len(self._conns) >= self.options.max_connections
            if busy:
                served = (s for s in self._conns.values() if s is not None)
                victim = self._sessions.displace(served, _says_spare(payload))
                if victim is not None:  # out of the count now; its thread says BYE and ends
                    self._conns.pop(victim.conn, None)
                    self.stats.evicted += 1
                    busy = False
            if busy:
                self.stats.refusals["busy"] += 1
            else:
                self._conns[conn] = None
                self.stats.connections += 1
                t = threading.Thread(
                    target=self._serve, args=(conn, peer, hdr, payload), name=f"worker-conn-{peer}", daemon=True
                )
                self._threads.append(t)
        if busy:
            reason = f"busy: {self.options.max_connections} connections served (--max-connections); try again later"
            log.warning("refused HELLO of session %#x from %s: %s", hdr.session, peer, reason)
            self._answer_and_close(conn, self._ack(wire.REFUSE_LIMITS, reason, hdr.session))
            return
        if victim is not None:
            why = "a spare" if victim.spare else f"idle {self._sessions.recent_s:g} s or more"
            log.info("connection of engine %#x displaced for %s: %s", victim.engine_id, peer, why)
        t.start()

    def _refused_at_door(self, conn: socket.socket, peer, session: int, code: int, reason: str, why: str) -> None:
        """Another protocol version or a failed authentication: counted, answered, closed."""
        self._refuse(why)
        log.warning("connection %s (session %#x): %s; refused", peer, session, reason)
        self._answer_and_close(conn, self._ack(code, reason, session))

    @staticmethod
    def _answer_and_close(conn: socket.socket, frame: bytes) -> None:
        try:
            conn.send(frame)  # non-blocking: what does not fit is not waited for
        except OSError:
            pass
        conn.close()


def _says_spare(payload: bytes) -> bool:
    """Whether a HELLO's payload asks for a spare (one whose payload does not decode says
    no: its thread refuses it)."""
    try:
        return wire.decode_hello(payload).spare
    except wire.ProtocolError:
        return False

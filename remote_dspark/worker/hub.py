"""The hub: every served connection's frames, windows and replies in C, the interpreter
working per drafting call, not per round (``native/worker_hub.c``).

Why: a worker that pools drafting for many engines spends its round on what surrounds
the drafter: the receive, the checks, the windows, the reply and the send. With a
Python thread per connection each of those runs under the one interpreter lock, every
round wakes a thread, and a storm's Python work holds the lock an honest round needs.
Here one I/O thread waits in C (the GIL released) on every connection at once (epoll),
reads each frame as its bytes come, checks a ROUND and applies it to its session's
windows (``hf_worker_round``, the code of :mod:`.native_round`) into the connection's
own batch arrays, and puts the connection on the ready ring. The drafter's thread
(:class:`~.scheduler.Scheduler`, with this hub as its source) takes the ready rounds
when it is free (:meth:`Hub.take`, the wait in C too), drafts a call's worth, and
:meth:`Connection.reply` writes each round's DRAFTS from the result's arrays and sends
it in C; a reply the socket cannot take at once is finished by the I/O thread.

A PING of the connection's session (empty: the wire's cap) is answered by the I/O thread
in C at once (``pong`` in the C; counted in :meth:`Hub.pings`), so a spare's liveness
never waits for the drafter; one with a payload or of another session is a bad frame
(:func:`~.hello.pong` names it).

What is Python's: anything but a ROUND the C takes, a PING, a reply, or a wait. A BYE, a ROUND
the C check refuses (checked again by the reference to name its culprit), a header of
another type, version or cap, a closed, failed or stalled peer and a reply that could
not be sent each hand the connection to Python (``on_event``, on the I/O thread), which
ends it as the Python loop ends its own (:meth:`Connection.error` gives the exception
that loop would have raised). A connection has one round in flight: its next frame is
read once its reply is sent.

Which connections: every TCP connection of a worker on the ``served`` round path with
the C library and no injected faults, but those the Markov lane serves (:mod:`.lane`).
The Python path (a thread per connection, :mod:`.round`) is the reference the tests
hold the hub to, reply for reply.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import threading
from collections.abc import Callable

import numpy as np

from .. import wire
from ..drafter.contract import DraftResult
from ..transport import DeadlineExceeded, Disconnected, FrameChannel
from .hello import pong
from .hub_arrays import CallArrays, result_of
from .jobs import Job
from .lane import Why, ns_of
from .native_round import NativeRounds, arrays_of, batch_arrays, written
from .sessions import Session, Sessions

log = logging.getLogger("remote_dspark.worker")


class ConnState(enum.IntEnum):
    """Where a connection is (worker_hub.c's HUB_*): whose it is."""

    RECV = 0  # reading its next frame (the I/O thread's)
    QUEUED = 1  # a round applied, ready to draft (the drafter's thread's)
    SEND = 2  # its reply partly sent (the I/O thread's)
    PYTHON = 3  # handed to Python (on_event), which ends it
    DROPPED = 4  # ended by the drafter's thread (drop), for the I/O thread to hand to Python


class _Io(enum.IntEnum):
    """What ``hf_hub_io`` returned."""

    EVENT = 0
    STOPPED = 1
    FAILED = 2


class Connection:
    """One connection served by the hub: its session, socket and the buffers C reads and
    writes (each sized at HELLO for the session's largest frame and reply, allocated
    once: a round allocates nothing). ``peer`` names it in logs; ``failed`` is set when
    a drafting call raised for its round (its ending says so)."""

    def __init__(self, hub: Hub, cid: int, session: Session, chan: FrameChannel, peer, view):
        from ..native import HubConn

        self.hub, self.session, self.chan, self.peer = hub, session, chan, peer
        self.sock = chan.stream.sock
        self.failed: BaseException | None = None
        n, window, sampled = session.max_slots, session.windows.window, session.want_sampled
        self.rx = np.empty(chan.max_payload, np.uint8)
        # room for the most a reply can hold (margins counted whatever the session asked: the C's bound)
        self.tx = np.empty(wire.HEADER.size + wire.drafts_sections(n, session.num_spec, True, sampled).size, np.uint8)
        self._buf, self._out, parts = batch_arrays(n, window, sampled)
        self._arrays = arrays_of(self._buf, parts)
        self._view = view  # the session's WindowsView (kept alive with the connection)
        self.c = HubConn(
            fd=self.sock.fileno(),
            id=cid,
            w=ctypes.addressof(view),
            b=ctypes.addressof(self._out),
            rx=self.rx.ctypes.data,
            tx=self.tx.ctypes.data,
            tx_size=len(self.tx),
            max_payload=chan.max_payload,
            want_margin=int(session.want_margin),
            serial=session.windows.serial,
            session=session.session,
        )
        self._hdr = np.ctypeslib.as_array(self.c.hdr)  # the frame in hand's header, a view
        self.received = 0.0  # time.monotonic() seconds: the round in hand was whole

    def header(self) -> wire.Header:
        return wire.decode_header(self._hdr.tobytes())

    def payload(self) -> memoryview:
        """The frame in hand's payload (C read it whole)."""
        return memoryview(self.rx)[: int(self._hdr[8:12].view(np.uint32)[0])]

    def round(self):
        """The round in hand, as :meth:`NativeRounds.drafting_batch` gives it (C applied
        it): ``(deadline_ms, slots, ok, drafted, width, batch)``."""
        self.received = self.c.received_ns / 1e9
        data = np.frombuffer(self.payload(), np.uint8)
        return written(self.session, self._arrays, self._out, data)

    def entries(self) -> tuple[int, int]:
        """The round in hand's entries, and those of them with a window (not RESYNC)."""
        return self._out.n, self._out.n_ok

    def reply(self, result: DraftResult | None) -> bool:
        """Answer the round in hand with ``result`` (its drafted entries' drafts; None:
        none, an expired round) and send it. False when the send failed (the connection
        is then ending: the I/O thread finds it closed)."""
        r, _keep = result_of(result)
        return self.hub.lib.hub_reply(self.hub.state_ref, ctypes.byref(self.c), ctypes.byref(r)) >= 0

    def drop(self) -> None:
        """End the connection of a round in hand that will get no reply (its call failed,
        or the worker stops): the I/O thread finds it closed."""
        self.hub.lib.hub_drop(self.hub.state_ref, ctypes.byref(self.c))

    def error(self) -> BaseException | None:
        """What the Python loop would have raised for the frame or the ending that handed
        this connection to Python: None for a BYE."""
        c, why = self.c, Why(self.c.why)
        if why is Why.FRAME:
            hdr = self.header()
            if hdr.type == wire.BYE:
                return None
            try:  # a ROUND the C refused: the reference's checks name the culprit
                NativeRounds.refused(self.session, hdr, self.payload(), self.hub.limits, None)
            except (wire.ProtocolError, RuntimeError) as e:
                return e
        if why is Why.HEADER:
            try:
                hdr = self.chan.check_header(self._hdr.tobytes())
                if hdr.type == wire.PING:  # (an empty one of another session: C answers its own)
                    pong(self.session, hdr)
            except wire.ProtocolError as e:  # VersionMismatch among them
                return e
            return wire.ProtocolError(f"unexpected {hdr.name} from the engine side")
        if why is Why.STALLED:
            want = int(self._hdr[8:12].view(np.uint32)[0])
            return DeadlineExceeded(f"deadline passed with {c.got - wire.HEADER.size} of {want} bytes read")
        if why is Why.CLOSED:
            return Disconnected("peer closed the connection")
        if why is Why.LOST:
            return Disconnected(f"receive failed: {os.strerror(c.err)}")
        return Disconnected(f"send failed: {os.strerror(c.err)}")


class Hub:
    """The hub of a worker (module docstring): ``start()`` its I/O thread, ``open()`` each
    connection once its HELLO is answered, :meth:`take` from the drafter's thread,
    ``stop()`` at the end. ``on_event(connection)`` runs on the I/O thread for each
    connection handed to Python, which removes it (:meth:`remove`) and closes it;
    ``make_job(connection)`` turns a taken connection's round into the scheduler's
    :class:`~.jobs.Job`, or None when it was answered at once (nothing to draft);
    ``on_answered(connections, facts, sent, received)`` counts a call of whole rounds
    answered by :meth:`answer` (``facts``: entries, RESYNCs, past the positions, drafts;
    ``sent`` each reply's send, ``received`` each round's receipt), and
    ``on_failed(connection, error)`` a round whose call raised. ``window``: the
    worker's, for the call's context tokens."""

    def __init__(
        self,
        rounds: NativeRounds,
        room: int,
        limits,
        max_positions: int | None,
        frame_timeout_s: float,
        send_timeout_s: float,
        on_event: Callable[[Connection], None],
        make_job: Callable[[Connection], Job | None],
        on_answered: Callable,
        on_failed: Callable[[Connection, BaseException], None],
        window: int,
    ):
        from ..native import HubState

        self.rounds, self.lib = rounds, rounds.lib
        self.on_answered, self.on_failed, self.window = on_answered, on_failed, window
        self._call: CallArrays | None = None  # a call's arrays, made at the first gather
        self.limits, self.max_positions = limits, max_positions
        self.on_event, self.make_job = on_event, make_job
        self._conns_c = (ctypes.c_void_p * room)()
        self._ready = np.zeros(room, np.uint32)
        self._taken = np.zeros(room, np.uint32)
        self.state = HubState(room=room, frame_ns=ns_of(frame_timeout_s), send_ns=ns_of(send_timeout_s))
        self.state.conns = ctypes.addressof(self._conns_c)
        self.state.ready = self._ready.ctypes.data
        self.state_ref = ctypes.byref(self.state)
        self._lock = threading.Lock()  # guards _by_id and _free
        self._by_id: list[Connection | None] = [None] * room
        self._free = list(range(room - 1, -1, -1))
        self._thread = threading.Thread(target=self._io, name="worker-io", daemon=True)
        self._open = False  # the epoll set and eventfd exist (start() to close())

    def takes(self, chan: FrameChannel) -> bool:
        """Whether the hub can serve ``chan``: a TCP socket, with a place free."""
        sock = getattr(chan.stream, "sock", None)
        return sock is not None and sock.family in (2, 10) and bool(self._free)  # AF_INET, AF_INET6

    def start(self) -> Hub:
        """The epoll set made and the I/O thread started.

        Raises: OSError when the system refuses an epoll set or an eventfd."""
        from ..native import check

        check(self.lib.hub_open(self.state_ref), "hf_hub_open")
        self._open = True
        self._thread.start()
        return self

    def open(self, session: Session, chan: FrameChannel, peer) -> Connection:
        """Serve ``chan`` (``session``'s, its HELLO answered) from now on.

        Raises: OSError when epoll refuses it; RuntimeError with no place free."""
        from ..native import check  # (the library is loaded: the worker has its rounds)

        view = self.rounds.view(session, self.limits, self.max_positions)
        with self._lock:
            if not self._free:
                raise RuntimeError("the hub has no place free")
            cid = self._free.pop()
            conn = self._by_id[cid] = Connection(self, cid, session, chan, peer, view)
        try:
            check(self.lib.hub_add(self.state_ref, ctypes.byref(conn.c)), "hf_hub_add")
        except BaseException:
            self._release(conn)
            raise
        return conn

    def remove(self, conn: Connection) -> None:
        """Stop serving ``conn`` (Python's: handed over, or the hub stopped); its place is
        free again. The caller closes its socket."""
        self.lib.hub_remove(self.state_ref, ctypes.byref(conn.c))
        self._release(conn)

    def _release(self, conn: Connection) -> None:
        with self._lock:
            self._by_id[conn.c.id] = None
            self._free.append(conn.c.id)

    def connections(self) -> list[Connection]:
        with self._lock:
            return [c for c in self._by_id if c is not None]

    def ready(self, timeout_s: float) -> np.ndarray:
        """The drafter's thread: the ids of the connections with a round ready to draft,
        each the caller's until answered (waiting in C up to ``timeout_s`` for one; a
        :meth:`poke` ends the wait)."""
        from ..native import deadline_ns

        until = deadline_ns(timeout_s) if timeout_s > 0 else 0
        n = self.lib.hub_take(self.state_ref, self._taken.ctypes.data, len(self._taken), until)
        return self._taken[:n].copy()

    def jobs(self, ids: np.ndarray) -> list[Job]:
        """The rounds of ``ids`` as the scheduler's jobs, those with nothing to draft
        answered at once instead."""
        jobs = []
        for cid in ids.tolist():
            conn = self._by_id[cid]
            try:
                job = self.make_job(conn)
            except Exception as e:  # (that round's connection ends; the others go on)
                self.on_failed(conn, e)
                continue
            if job is not None:
                jobs.append(job)
        return jobs

    def gather(self, ids: np.ndarray, max_entries: int):
        """The rounds of ``ids`` as one call's batch (``hf_hub_gather``: views of arrays
        reused by every call), with each round's receipt and deadline (time.monotonic()
        seconds; inf: none); None when they cannot make one call of at most
        ``max_entries`` entries (greedy and sampled, drafts or rows of two sizes)."""
        if self._call is None or self._call.room < max_entries:
            self._call = CallArrays(max_entries, self.window, len(self._taken))
        call = self._call
        first = self._by_id[int(ids[0])].session
        call.c.keep_streams = first.history is not None
        while True:
            got = self.lib.hub_gather(self.state_ref, ids.ctypes.data, len(ids), ctypes.byref(call.c))
            if got != 2 or call.c.m > max_entries or not call.grow_rows(call.c.n_rows):
                break
        if got:
            return None
        return (
            call.batch(first.history, first.windows.serial if len(ids) == 1 else None),
            call.received[: len(ids)] / 1e9,
            call.deadlines(len(ids)),
        )

    def answer(self, ids: np.ndarray, result: DraftResult | None) -> None:
        """The call gathered from ``ids`` answered with ``result`` (its rows in their
        order): each round's reply written and sent in C, then counted (``on_answered``).
        Never raises: a fault before the replies are written fails the rounds (:meth:`fail`);
        one counting them after is logged (their connections read their next frames already:
        the rounds are never queued again)."""
        try:
            r, _keep = result_of(result)
        except Exception as e:
            self.fail(ids, e)
            return
        conns = [self._by_id[cid] for cid in ids.tolist()]  # (once a reply is sent, its connection may end)
        for conn in conns:
            if conn.session.spare:  # its first round: an engine from now on, before its reply goes
                Sessions.engaged(conn.session)
        facts = np.zeros(4, np.uint64)
        sent = np.zeros(len(ids), np.int32)
        received = self._call.received[: len(ids)] / 1e9
        self.lib.hub_answer(
            self.state_ref, ids.ctypes.data, len(ids), ctypes.byref(r), facts.ctypes.data, sent.ctypes.data
        )
        try:
            self.on_answered(conns, facts.tolist(), sent, received)
        except Exception:  # (the rounds are answered: never again, as jobs)
            log.exception("counting a call of whole rounds failed")

    def fail(self, ids: np.ndarray, error: BaseException) -> None:
        """The call gathered from ``ids`` raised: each round's connection ends."""
        for cid in ids.tolist():
            self.on_failed(self._by_id[cid], error)

    def pings(self) -> int:
        """PINGs answered in C (one aligned word the I/O thread alone writes)."""
        return self.state.pings

    def waiting(self) -> int:
        """Rounds ready to draft, not taken yet."""
        return (self.state.tail - self.state.head) & 0xFFFFFFFF

    def poke(self) -> None:
        """End the drafter's thread's wait in :meth:`take` now."""
        self.lib.hub_poke(self.state_ref)

    def stop(self, timeout_s: float) -> None:
        """The I/O thread ends (the connections stay, for the caller to end)."""
        self.lib.hub_stop(self.state_ref)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def alive(self) -> bool:
        """The I/O thread runs."""
        return self._thread.is_alive()

    def close(self) -> None:
        """The epoll set and its eventfd closed (after :meth:`stop`)."""
        if self._open:
            self._open = False
            self.lib.hub_close(self.state_ref)

    def _io(self) -> None:
        """The I/O thread: C serves every connection; each one handed to Python goes to
        ``on_event``."""
        cid = ctypes.c_uint32()
        while True:
            got = _Io(self.lib.hub_io(self.state_ref, ctypes.byref(cid)))
            if got is _Io.STOPPED:
                return
            if got is _Io.FAILED:
                log.error("the worker's I/O thread failed: %s", os.strerror(ctypes.get_errno()))
                return
            conn = self._by_id[cid.value]
            if conn is not None:
                try:
                    self.on_event(conn)
                except Exception:  # never the I/O thread: every other connection needs it
                    log.exception("connection %s: failed ending it", conn.peer)

"""A connection whose rounds are served whole in C (``hf_worker_serve``,
``native/worker_serve.c``): the worker's round with the built-in greedy Markov drafter,
from the ROUND's bytes in to the DRAFTS' bytes out, without the interpreter.

Why: with that drafter a round is a table lookup, and what is left of it is the Python
around it (the receive, the round's arrays, the scheduler, the reply, the send), which
on a host whose interpreter runs cold after every wait costs several times its own
drafting. :class:`Lane` waits for the next frame in C with the GIL released; a ROUND
the session can take is checked and applied to its windows by ``hf_worker_round`` (the
code and rules of :mod:`.native_round`), drafted from the table's arrays and answered,
and the call returns with the round's facts, which :meth:`Lane.next_frame` hands to the
worker's accounting while the engine already reads its drafts. Every other frame comes
back to the worker's own loop as :meth:`FrameChannel.recv_frame
<remote_dspark.transport.FrameChannel.recv_frame>` would return it or raise, so a BYE, a
refused ROUND (checked again by the reference to name its culprit), a bad header, a
stall or a closed peer end the same way on either path. One difference, on purpose: a
header of a type a served connection never takes (a HELLO, a DRAFTS) is refused on its
header, a bad frame at once, where the Python loop first waits for its payload (a stall
if it never comes).

Which connections: a greedy session (:meth:`Lanes.open`) of a worker whose drafter is exactly
:class:`~remote_dspark.drafter.markov.MarkovDrafter`, with the native round path and no
injected faults (:func:`takes`). Its drafting bypasses the scheduler: the lookup is a
pure function of the round's contexts that runs in microseconds without the GIL and
holds no memory beyond the connection's own buffers, so it needs neither a call's budget
nor a turn among engines, and the accounting counts it as a call of one round, as the
scheduler's lone round is. The reference it is held to is the worker's Python path with
the same drafter (``tests/worker/test_lane.py``: reply for reply, counter for counter).
"""

from __future__ import annotations

import ctypes
import enum
import os
import select
import socket
from collections.abc import Callable

import numpy as np

from .. import wire
from ..drafter.markov import MarkovDrafter
from ..transport import DeadlineExceeded, Disconnected, FrameChannel
from .native_round import NativeRounds, batch_arrays
from .sessions import Session

RX_FIRST = 64 << 10  # the payload buffer's first size; it grows as a payload's bytes come
_NO_CONTEXT_READ = (1 << 32) - 1  # hf_markov's context_read of a drafter that reads whole contexts
_NO_LIMIT_NS = (1 << 64) - 1  # hf_serve's frame_ns and send_ns: no limit


def ns_of(seconds: float) -> int:
    """``seconds`` as hf_serve's nanoseconds (infinite or past the u64: no limit)."""
    return _NO_LIMIT_NS if not seconds * 1e9 < _NO_LIMIT_NS else int(seconds * 1e9)


class Why(enum.IntEnum):
    """Why ``hf_worker_serve`` returned (worker_serve.c's SV_*)."""

    ROUND = 0  # a round answered and sent
    FRAME = 1  # a whole frame for the worker's loop
    HEADER = 2  # a header the worker's loop must judge
    GROW = 3  # the payload buffer is full and the payload goes on
    CLOSED = 4
    STALLED = 5  # a frame not whole within the frame timeout
    LOST = 6  # the receive failed
    UNSENT = 7  # the reply's send failed or missed its deadline


def markov_table(drafter: MarkovDrafter):
    """``hf_markov`` of ``drafter``'s model (its ``draft_batch`` arrays), and the arrays it
    points into, which the caller keeps alive with it."""
    from ..native import MarkovTable

    a = drafter.model.tables()
    dense = None if a.dense is None else np.ascontiguousarray(a.dense, np.int64)
    arrays = (
        np.ascontiguousarray(a.ctx, np.int32),
        np.ascontiguousarray(a.first, np.int32),
        np.ascontiguousarray(a.margin, np.float32),
        np.ascontiguousarray(a.succ, np.int64),
        dense,
    )
    ctx, first, margin, succ, _ = arrays
    read = drafter.context_read
    table = MarkovTable(
        ctx=ctx.ctypes.data,
        first=first.ctypes.data,
        margin=margin.ctypes.data,
        succ=succ.ctypes.data,
        dense=None if dense is None else dense.ctypes.data,
        lo=a.lo if dense is not None else 0,
        radix=a.radix if dense is not None else 0,
        rows=a.none,
        order=drafter.model.order,
        context_read=_NO_CONTEXT_READ if read is None else read,
    )
    return table, arrays


def takes(rounds: NativeRounds | None, drafter, faults) -> bool:
    """Whether a worker's connections may take a lane: the native round path, the
    built-in Markov drafter itself (a subclass may draft otherwise) and no faults to
    inject (they act on the reply in Python)."""
    return rounds is not None and faults is None and type(drafter) is MarkovDrafter


class Lanes:
    """A worker's lanes (when :func:`takes`): the table they share and the worker's terms
    (``limits``, the drafter's ``max_positions``, ``frame_timeout_s``)."""

    def __init__(self, rounds: NativeRounds, drafter: MarkovDrafter, limits, max_positions, frame_timeout_s: float):
        self.rounds = rounds
        self.limits, self.max_positions, self.frame_timeout_s = limits, max_positions, frame_timeout_s
        self.table, self._arrays = markov_table(drafter)

    def open(self, session: Session, chan: FrameChannel, on_round: Callable[[object, bool], None]) -> Lane | None:
        """A lane for ``session``'s connection ``chan`` (``on_round(facts, sent)`` counts
        each round it answers: ``sent`` False when its reply's send failed), or None: a
        sampled session, or a connection that is not a TCP socket. A spare's connection
        gets its lane too: the worker's loop peeks at each of its frames' headers
        (:meth:`round_is_next`) until a ROUND comes, makes the session an engine, and only
        then lets the lane read and answer it (``Serving._loop``): a spare must be a spare
        no more before its first round is answered, and a lane answers in C before Python
        hears of a round."""
        sock = getattr(chan.stream, "sock", None)
        tcp = sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6)
        if session.want_sampled or not tcp:
            return None
        return Lane(self, session, chan, sock.fileno(), chan.stream.send_timeout_s, on_round)


class Lane:
    """One connection's rounds in C: :meth:`next_frame` in place of
    ``chan.recv_frame(math.inf, frame_timeout_s)``, in the connection's own thread."""

    def __init__(
        self,
        lanes: Lanes,
        session: Session,
        chan: FrameChannel,
        fd: int,
        send_timeout_s: float,
        on_round: Callable[[object, bool], None],
    ):
        from ..native import ServeState

        self._serve = lanes.rounds.lib.worker_serve
        self._chan, self._on_round, self._lanes = chan, on_round, lanes
        self._view = lanes.rounds.view(session, lanes.limits, lanes.max_positions)
        n, width = session.max_slots, session.num_spec
        self._batch_buf, self._batch, _ = batch_arrays(n, session.windows.window, False)
        self._tx = np.empty(wire.HEADER.size + wire.DRAFTS_FIXED.size + n * (8 + 8 * width), np.uint8)
        self._rx = np.empty(min(RX_FIRST, chan.max_payload), np.uint8)
        self.state = ServeState(
            fd=fd,
            want_margin=int(session.want_margin),
            w=ctypes.addressof(self._view),
            b=ctypes.addressof(self._batch),
            m=ctypes.addressof(lanes.table),
            rx=self._rx.ctypes.data,
            tx=self._tx.ctypes.data,
            rx_size=len(self._rx),
            tx_size=len(self._tx),
            max_payload=chan.max_payload,
            frame_ns=ns_of(lanes.frame_timeout_s),
            send_ns=ns_of(send_timeout_s),
        )

    def round_is_next(self) -> bool:
        """Whether the connection's next frame is a ROUND, its header whole: waited for as
        :meth:`next_frame` waits between frames (no deadline; the worker's stop and an
        eviction shut the socket, which ends the wait), and peeked at, not read. False
        for any other frame, a header not whole yet or a socket that failed: the read
        that follows takes it, and names whatever is wrong with it."""
        sock = self._chan.stream.sock
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.poll()
        try:
            head = sock.recv(wire.HEADER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return len(head) == wire.HEADER.size and wire.decode_header(head).type == wire.ROUND
        except (OSError, wire.ProtocolError):
            return False

    def next_frame(self) -> tuple[wire.Header, memoryview] | tuple[None, None]:
        """The next frame: ``(None, None)`` for a ROUND served here (and counted), so the
        worker's loop checks whether to go on between rounds as it does between its own;
        any other frame as ``recv_frame`` would return it (a frame of a type the
        connection never takes comes with its header only: the loop drops the connection
        on it).

        Raises: what ``recv_frame`` raises for the same bytes (Disconnected,
        DeadlineExceeded, wire.ProtocolError), and Disconnected for a reply not sent
        (its round counted first, as the loop counts its own before sending)."""
        s = self.state
        while True:
            why = Why(self._serve(ctypes.byref(s)))
            if why is Why.ROUND:
                self._on_round(s, True)
                return None, None
            elif why is Why.GROW:
                self._grow()
            elif why is Why.FRAME:
                header = wire.decode_header(bytes(s.hdr))
                return header, memoryview(self._rx)[: header.payload_len]
            elif why is Why.HEADER:
                return self._chan.check_header(bytes(s.hdr)), memoryview(b"")
            elif why is Why.CLOSED:
                raise Disconnected("peer closed the connection")
            elif why is Why.STALLED:
                want = int.from_bytes(bytes(s.hdr[8:12]), "little")
                raise DeadlineExceeded(f"deadline passed with {s.got - wire.HEADER.size} of {want} bytes read")
            elif why is Why.LOST:
                raise Disconnected(f"receive failed: {os.strerror(s.err)}")
            else:
                self._on_round(s, False)
                raise Disconnected(f"send failed: {os.strerror(s.err)}")

    def _grow(self) -> None:
        """A payload buffer twice as large (at least ``FrameChannel.GROW_MIN``, at most the
        payload) holding what was read."""
        s = self.state
        want = int.from_bytes(bytes(s.hdr[8:12]), "little")
        have = s.got - wire.HEADER.size
        rx = np.empty(min(want, max(2 * len(self._rx), FrameChannel.GROW_MIN)), np.uint8)
        rx[:have] = self._rx[:have]
        self._rx = rx
        s.rx, s.rx_size = rx.ctypes.data, len(rx)

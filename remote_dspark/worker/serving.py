"""How the worker serves one connection once its HELLO is whole (:class:`Serving`, the
:class:`~remote_dspark.worker.server.Worker`'s half that runs per connection): the HELLO
judged and answered, then its rounds on its own thread (the Python or native path, or
the Markov lane), or by the hub (:mod:`.hub`: the I/O in C, the drafting by the
scheduler's thread, the reply in C); and its end, counted, logged and closed the same
way whoever served it. A PING is answered where the connection's frames are read
(:func:`~.hello.pong`): here on the connection's own thread (the Markov lane hands it
here whole), in C on the hub's I/O thread.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
import time

from .. import wire
from ..transport import DeadlineExceeded, Disconnected, FrameChannel
from ..transport.tcp import TcpStream
from . import lane
from .hello import hello_ack, judge_hello, pong
from .jobs import Answered, Failed, Job
from .round import Told, answer
from .sessions import Session

log = logging.getLogger("remote_dspark.worker")


class Serving:
    """The per-connection methods of :class:`~remote_dspark.worker.server.Worker` (a
    mixin: the state is the worker's, named in its ``__init__``)."""

    def _served(self, session: Session, facts, sent: bool) -> None:
        """A round served in C (its ``lane`` facts) counted, as :meth:`_serve` counts its own."""
        if sent:
            self._sessions.served(session)
        with self._lock:
            self.stats.add_served(facts, sent)

    def _serve(self, conn: socket.socket, peer, hello_hdr: wire.Header, hello_payload: bytes) -> None:
        conn.setblocking(True)
        chan = FrameChannel(TcpStream(conn))
        session: Session | None = None
        try:
            session = self._hello(chan, hello_hdr, hello_payload, conn)
            if session is not None:
                with self._lock:
                    self._conns[conn] = session  # from now on it may be displaced once it idles
                served = self._lanes and self._lanes.open(session, chan, functools.partial(self._served, session))
                if not served and self._hub is not None and self._hub.takes(chan):
                    self._hub.open(session, chan, peer)
                    return  # the hub serves it from now on; _hub_event ends it
                self._loop(session, chan, served)
        except Exception as e:
            self._ended(conn, peer, session, chan, e)
        else:
            self._ended(conn, peer, session, chan, None)

    def _loop(self, session: Session, chan: FrameChannel, served: lane.Lane | None) -> None:
        """A connection's rounds on its own thread (on its lane, when ``served``: a spare's
        frames are peeked at until its first ROUND, which makes it an engine before the
        lane reads and answers that round), until BYE, the worker stopping or the session
        evicted; raises what ends it otherwise."""
        while not self._stopping.is_set() and not session.evicted:
            # No deadline between frames (an engine may idle for minutes; keepalive
            # finds a dead one); a frame, once begun, within frame_timeout_s. (Python
            # reads whole frames only, so the lane takes over at a frame's start.)
            on_lane = served and not session.spare
            if served and session.spare and served.round_is_next():
                self._sessions.engaged(session)  # (before the lane answers it)
                on_lane = True
            hdr, payload = served.next_frame() if on_lane else chan.recv_frame(math.inf, self.options.frame_timeout_s)
            if hdr is None:  # a ROUND the lane served and counted
                continue
            if hdr.type == wire.BYE:
                return
            elif hdr.type == wire.PING:
                answer = pong(session, hdr)
                with self._lock:  # counted before it is sent, as the hub's C counts its own
                    self.stats.pings += 1
                chan.send(answer)
            elif hdr.type == wire.ROUND:
                self._sessions.engaged(session)
                t0 = time.perf_counter()
                reply = self._round(session, hdr, payload, time.monotonic())
                if self.faults is not None:
                    reply = self.faults.apply(reply)
                chan.send(reply)
                self._sessions.served(session)
                took = time.perf_counter() - t0
                with self._lock:
                    self.stats.round_seconds.observe(took)
            else:
                raise wire.ProtocolError(f"unexpected {hdr.name} from the engine side")

    def _ended(self, conn: socket.socket, peer, session: Session | None, chan: FrameChannel, error) -> None:
        """A served connection's end, whoever served it: ``error`` (what ended it; None: a
        BYE, the worker stopping, an eviction or a refused HELLO) counted and logged once,
        BYE said when the worker stops or the session was evicted, the socket closed and
        the session dropped."""
        if isinstance(error, wire.VersionMismatch):
            with self._lock:
                self.stats.bad_frames += 1
            log.warning("connection %s: %s; refused", peer, error)
            self._send_quietly(chan, self._ack(wire.REFUSE_VERSION, str(error), 0))
        elif isinstance(error, wire.ProtocolError):
            with self._lock:
                self.stats.bad_frames += 1
            log.warning("connection %s: bad frame, closing it: %s", peer, error)
        elif isinstance(error, DeadlineExceeded):
            with self._lock:
                self.stats.stalled += 1
            log.warning(
                "connection %s: a frame not whole within %.1f s (%s); closing it",
                peer,
                self.options.frame_timeout_s,
                error,
            )
        elif error is not None and not isinstance(error, Disconnected):
            # the drafter (or this worker) failed: this connection only, loudly
            with self._lock:
                self.stats.round_failures += 1
            log.error("connection %s: failed serving a round; closing it", peer, exc_info=error)
        if self._stopping.is_set() or (session is not None and session.evicted):
            self._send_quietly(chan, wire.encode_bye(session.session if session else 0))
        chan.close()
        if session is not None:
            self._sessions.drop(session)
        with self._lock:
            self._conns.pop(conn, None)

    # ------------------------------------------------------------------ the hub's connections

    def _hub_job(self, conn) -> Job | None:
        """The drafter thread: a connection's round the hub applied, as the scheduler's
        job (its reply sent by :meth:`_hub_answered`), or answered now when it has nothing
        to draft (empty, or every slot to re-announce)."""
        self._sessions.engaged(conn.session)
        deadline_ms, _, _, _, _, batch = conn.round()
        job = Job(conn.session.windows.serial, batch, math.inf, None, self._scheduler.clock())
        job.deliver = functools.partial(self._hub_answered, conn)
        if not len(batch):
            job.state = Answered(None)
            self._hub_answered(conn, job, drafted=False)
            return None
        if deadline_ms:
            job.deadline = conn.received + deadline_ms / 1000
        return job

    def _hub_answered(self, conn, job: Job, drafted: bool = True) -> None:
        """A hub round's job ended: its reply written and sent, the round counted (or, when
        its call failed, its connection ended: counted and logged here, ended by the hub)."""
        state = job.state
        if isinstance(state, Failed):
            self._hub_failed(conn, state.error)
            return
        result = state.result
        n, n_ok = conn.entries()  # (all read before the reply: once it is out, the next round may come in)
        draft_tokens = int(result.counts.sum()) if result is not None else 0
        told = Told(n, n - n_ok, n_ok - len(job.batch), draft_tokens, drafted and result is None)
        took = time.monotonic() - conn.received
        if conn.reply(result):
            self._sessions.served(conn.session)
        with self._lock:  # (nothing after the reply may fail its round: the connection is the hub's again)
            self.stats.add_round(told)
            self.stats.round_seconds.observe(took)

    def _hub_failed(self, conn, error: BaseException) -> None:
        """A hub round whose call raised: counted and logged here, its connection ended by
        the hub."""
        with self._lock:
            self.stats.round_failures += 1
        log.error("connection %s: failed serving a round; closing it", conn.peer, exc_info=error)
        conn.failed = error
        conn.drop()

    def _hub_call_answered(self, conns: list, facts: list, sent, received) -> None:
        """A call of whole hub rounds answered (:meth:`Hub.answer`): counted once, as its
        rounds one by one would be."""
        now = time.monotonic()
        entries, resyncs, beyond, drafts = facts
        for conn, ok in zip(conns, sent.tolist(), strict=True):
            if ok >= 0:
                self._sessions.served(conn.session)
        with self._lock:
            self.stats.add_rounds(len(conns), entries, resyncs, beyond, drafts)
            for took in (now - received).tolist():
                self.stats.round_seconds.observe(took)

    def _hub_event(self, conn) -> None:
        """The I/O thread: a hub connection handed to Python, ended as its own thread
        would end it (a connection whose round failed was counted then)."""
        self._hub.remove(conn)
        error = conn.error()
        self._ended(conn.sock, conn.peer, conn.session, conn.chan, None if conn.failed else error)

    def _hello(
        self, chan: FrameChannel, hdr: wire.Header, payload, conn: socket.socket | None = None
    ) -> Session | None:
        """The HELLO's verdict (:func:`~remote_dspark.worker.hello.judge_hello`) counted,
        then told: the session admitted, or None."""
        hello = wire.decode_hello(payload)
        verdict = judge_hello(hdr, hello, conn, self.drafter, self.limits, self._scheduler.max_tokens, self._sessions)
        engines, _ = self._sessions.counts(leaving_out=verdict.session)
        if verdict.session is None:
            self._refuse(verdict.why)
            chan.send(self._ack(verdict.code, verdict.reason, hdr.session, engines))
            return None
        if verdict.evicted is not None:
            with self._lock:
                self.stats.evicted += 1
        chan.max_payload = self.limits.frame_cap(hello)
        # Only now the ACK: once the engine side has it, the old windows are gone.
        chan.send(self._ack(verdict.code, verdict.reason, hdr.session, engines))
        shape = (hdr.session, hello.engine_id, hello.max_slots, hello.num_spec, " (spare)" if hello.spare else "")
        log.info("session %#x of engine %#x: %d slots, num_spec %d%s", *shape)
        return verdict.session

    def _ack(self, code: int, reason: str, session: int, engines: int | None = None) -> bytes:
        """A HELLO_ACK of this worker: its incarnation, and ``engines`` served now (None:
        all of its sessions not spare, for a HELLO refused before it had one)."""
        if engines is None:
            engines, _ = self._sessions.counts()
        return hello_ack(self.drafter, code, reason, session, self.limits, engines, self.incarnation)

    def _round(self, session: Session, hdr: wire.Header, payload, received: float | None = None) -> bytes:
        """One ROUND in (``received``: ``time.monotonic()`` at its receipt, which its
        relative deadline counts from; None: now), its DRAFTS frame out; no Python loop
        over the entries."""
        received = time.monotonic() if received is None else received
        reply, told = answer(
            session, hdr, payload, self.limits, self._max_positions, self._scheduler.draft, received, self._native
        )
        with self._lock:
            self.stats.add_round(told)
        return reply

    @staticmethod
    def _send_quietly(chan: FrameChannel, frame: bytes) -> None:
        try:
            chan.send(frame)
        except Disconnected:
            pass

"""The link's keeper: one thread per :class:`~remote_dspark.transport.link.RemoteLink`
that does everything the round path must never wait for.

- **Connects.** With no active connection it dials the fleet's addresses in this
  engine's rank order (:func:`.fleet.rank`: rendezvous hashing on the engine id, so
  engines spread over the fleet and each comes back to the same first choice). It dials
  the first two that answer and makes the active the one whose HELLO_ACK names fewer
  engines served (ties: the better ranked), the other the spare: two choices, the less
  loaded taken, keep a fleet even where hashing alone would not. Only when no address
  answers does it wait ``backoff_ms``, doubling to ``backoff_max_ms``, and re-resolve.
- **Keeps a spare** beside the active, to the best ranked other address that answers
  (never one a fenced connection still reaches: that worker holds this session until
  the connection closes, and would refuse it; dialled on a thread of its own, so a
  silent host never blinds the keeper; an address that failed is avoided for a back-off
  of its own), and PINGs it every ``PING_S``: one with no answer within
  ``PING_TIMEOUT_S`` is dropped and replaced, so a dead spare is found in about two
  seconds (TCP keepalive takes a minute).
- **Watches the active** between rounds: a peer that hung up (a killed worker's kernel
  closes its sockets) makes the spare the active at once, before the next round.
- **Drains fenced connections** (left after a stall) for ``FENCE_S``, counting and
  dropping every DRAFTS they bring.
- **Re-resolves** the fleet on its schedule (:class:`.fleet.Fleet`).
- **Avoids an address that flaps**: a spare it drops, or a connection lost within
  ``SHORT_LIFE_S`` of its HELLO, keeps its address out of the dials for a back-off, as a
  dial that fails does (a worker that accepts and hangs up at once answers every dial).

A spare's frames are read (held to a PING answer's size: no payload), and its PINGs
sent, under the link's lock and only while it is still the spare, so a promoted spare's
socket is never shared with a round; a PING answer that reaches a promoted spare is
skipped by the round's reader (``recv_drafts``, ``hf_round``). Every wait is a ``poll``
with a timeout, woken through a pipe by the link (a change, or close).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import select
import threading
import time

from .. import wire
from . import DeadlineExceeded, Disconnected, TransportError
from .conn import Conn, Failover
from .fleet import Address, rank

log = logging.getLogger("remote_dspark.link")

PING_S = 1.0  # a spare's PING period
SECOND_S = 0.1  # connect_best: the second choice's time, once the first answered
FENCE_S = 2.0  # how long a connection left after a stall is drained (its replies counted fenced)
PING_TIMEOUT_S = 1.0  # a PING's answer deadline
WAIT_MAX_S = 1.0  # the keeper's longest poll
READ_S = 0.002  # a readable frame's read deadline (a partial frame resumes next time)
SEND_S = 0.05  # a PING's send deadline, from the send (a spare's send buffer is empty: only a full one waits)
SHORT_LIFE_S = 1.0  # a connection lost sooner after its HELLO: its address avoided (a worker that flaps)
_HUP = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


class Keeper:
    """The keeper of one link. Its state is its thread's own, but for ``_fenced`` (a
    deque the round thread appends to), ``_avoid`` (:meth:`lost` may run on the round
    thread: one dict store, atomic under the GIL) and the start and pipe under
    ``_start_lock``."""

    def __init__(self, link):  # the transport.link.RemoteLink it keeps (which imports this module)
        self.link = link
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._fenced: collections.deque[tuple[Conn, float]] = collections.deque()
        self._avoid: dict[Address, tuple[float, float]] = {}  # address: (until, its back-off s)
        self._delay_s = link.backoff_ms / 1000.0  # the back-off while no address answers
        self._retry_at = 0.0  # no active before this (the back-off)
        self._spare_at = 0.0  # no spare dial before this
        self._ping: tuple[Conn, int, float] | None = None  # the PING awaited: spare, number, deadline
        self._ping_at = 0.0
        self._dialer: threading.Thread | None = None  # the spare's dial under way
        self._seq = 0

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self.link.closed:
                self._thread = threading.Thread(target=self._run, name="link-keeper", daemon=True)
                self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the thread (the link is closed); one still inside
        a connect ends by itself and lets its pipe go then."""
        with self._start_lock:
            thread = self._thread
            if thread is None:
                self._thread = threading.current_thread()  # never to start now
        if thread is None:
            self._close_pipe()
        else:
            thread.join(timeout_s)

    def _close_pipe(self) -> None:
        with self._start_lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def wake(self) -> None:
        with self._start_lock:  # (never a closed pipe's descriptor, reused since)
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # the pipe is full: a wake is pending anyway

    def lost(self, conn: Conn, *, broken: bool) -> None:
        """The link let ``conn`` go: its address is avoided for a while when the keeper
        found it ``broken`` (a spare) or it lived less than SHORT_LIFE_S."""
        if broken or time.monotonic() - conn.since < SHORT_LIFE_S:
            self._avoid_for_a_while(conn.address)

    def fence(self, conn: Conn) -> None:
        """Drain ``conn`` (left after a stall) for FENCE_S, then close it."""
        self._fenced.append((conn, time.monotonic() + FENCE_S))
        self.wake()

    # ------------------------------------------------------------------ connecting

    def candidates(self, exclude: Address | None = None) -> list[Address]:
        now = time.monotonic()
        fleet = self.link.fleet.addresses()
        for gone in set(list(self._avoid)) - set(fleet):  # (list(): one step, lost() may add)
            self._avoid.pop(gone, None)  # its back-off goes with it: the table stays in the fleet's cap
        addrs = [a for a in fleet if a != exclude and self._avoid.get(a, (0.0, 0.0))[0] <= now]
        return rank(self.link.hello.engine_id, addrs)

    def _avoid_for_a_while(self, address: Address | None) -> None:
        """``address`` failed a dial: not tried again for a back-off of its own (doubling
        from BACKOFF_MS to BACKOFF_MAX_MS, forgotten when it answers), and the fleet is
        looked up again (at most once a second: it may have moved)."""
        if address is None:
            return
        _, last = self._avoid.get(address, (0.0, 0.0))
        backoff = min(max(2 * last, self.link.backoff_ms / 1000.0), self.link.backoff_max_ms / 1000.0)
        self._avoid[address] = (time.monotonic() + backoff, backoff)
        self.link.fleet.refresh(force=True)

    def connect_best(self) -> None:
        """Dial the best ranked addresses until two answer (or none is left), then make
        the less loaded the active and the other the spare. Once one answered the rest
        get SECOND_S in all: a slow second choice never holds the first connection back
        (the keeper dials the spare afterwards with the whole CONNECT_TIMEOUT_MS).

        Raises: the first failure, when no address answered."""
        link = self.link
        if not link.fleet.addresses():
            link.fleet.refresh(force=True)
        got: list[Conn] = []
        error: BaseException | None = None
        second_by = float("inf")
        for address in self.candidates():
            left = second_by - time.monotonic()
            if len(got) == 2 or link.closed or left <= 0:
                break
            try:
                got.append(link.dial(address, min(left, link.connect_timeout_s)))
                second_by = min(second_by, time.monotonic() + SECOND_S)
            except Exception as e:  # refused, unreachable, garbled: the next address
                error = error or e
                self._avoid_for_a_while(address)
                continue
            self._avoid.pop(address, None)  # it answers: its back-off starts afresh
        if not got:
            known = len(link.fleet.addresses())
            why = link.fleet.last_error or f"{known} known, each avoided after a failure"
            raise error or TransportError(f"{link.endpoint}: no address to dial now ({why})")
        got.sort(key=lambda c: c.client.ack.engines)  # stable: the better ranked first on a tie
        link.install(got[0], got[1] if len(got) > 1 else None)

    def _reconnect(self, now: float) -> None:
        """No active connection: the spare's promotion happened in ``leave`` if there was
        one; dial now, or back off when no address answered."""
        if now < self._retry_at:
            return
        try:
            self.connect_best()
        except Exception as e:
            self.link.note_failure(f"reconnect to {self.link.endpoint} failed: {e}")
            self._retry_at = now + self._delay_s
            self._delay_s = min(2 * self._delay_s, self.link.backoff_max_ms / 1000.0)
            return
        self._delay_s = self.link.backoff_ms / 1000.0

    def after_failed_start(self) -> None:
        """The start's own connect failed: the keeper's first try waits the back-off."""
        self._retry_at = time.monotonic() + self._delay_s
        self._delay_s = min(2 * self._delay_s, self.link.backoff_max_ms / 1000.0)

    def _make_spare(self, now: float) -> None:
        """Dial a spare to the best ranked other address, on a thread of its own: a dial
        may take CONNECT_TIMEOUT_MS (a silent host), and meanwhile the keeper goes on
        watching the active (a hang-up seen between rounds costs no round)."""
        active = self.link.active
        if now < self._spare_at or active is None or (self._dialer is not None and self._dialer.is_alive()):
            return
        for address in self.spare_candidates():
            self._dialer = threading.Thread(target=self._dial_spare, args=(address,), name="link-spare", daemon=True)
            self._dialer.start()
            return
        self._spare_at = now + WAIT_MAX_S  # no other address now (or a fence's end wakes it)

    def spare_candidates(self) -> list[Address]:
        """Where a spare may go, best first: neither the active's worker nor one that a
        fenced connection still reaches (it holds this session until that connection
        closes, and refuses a second of it)."""
        active = self.link.active
        fenced = {conn.address for conn, _ in tuple(self._fenced)}  # (a copy: the round thread may append)
        return [a for a in self.candidates(exclude=None if active is None else active.address) if a not in fenced]

    def _dial_spare(self, address: Address) -> None:
        try:
            conn = self.link.dial(address)
        except Exception as e:  # refused, unreachable, garbled: another address next turn
            self.link.note_failure(f"spare to {address} failed: {e}")
            self._avoid_for_a_while(address)
        else:
            self._avoid.pop(address, None)  # it answers: its back-off starts afresh
            if self.link.offer_spare(conn):
                self._ping_at = time.monotonic() + PING_S
        finally:
            self.wake()

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        link = self.link
        while not link.closed:
            try:
                self._turn()
            except Exception:  # noqa: BLE001 (a keeper that died would leave the link for good)
                log.exception("link keeper: a turn failed; the next one in %g s", WAIT_MAX_S)
                if not link.closed:
                    self._wait_for(WAIT_MAX_S)
        while self._fenced:
            self._fenced.popleft()[0].close()
        self._close_pipe()

    def _turn(self) -> None:
        link = self.link
        now = time.monotonic()
        if link.active is None:
            self._reconnect(now)
        elif link.spare is None:
            self._make_spare(now)
        if link.fleet.due_in() <= 0:
            link.fleet.refresh()
        self._send_ping(time.monotonic())
        self._wait()

    def _wait_for(self, timeout_s: float) -> None:
        """Sleep ``timeout_s``, woken early by the link (close)."""
        select.select([self._wake_r], [], [], timeout_s)
        self._drain_wake()

    def _send_ping(self, now: float) -> None:
        spare = self.link.spare
        if self._ping is not None:
            conn, seq, deadline = self._ping
            if conn is not spare:
                self._ping = None  # promoted or dropped: its answer is skipped by the round's reader
            elif now > deadline:
                self._ping = None
                self.link.drop_spare(conn, f"no PING answer within {PING_TIMEOUT_S:g} s")
            return
        if spare is None or now < self._ping_at:
            return
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        frame = wire.encode_ping(self.link.session, self._seq)
        try:
            # The deadline from the send itself: the lock may have kept this turn waiting.
            sent, _ = self.link.on_spare(spare, lambda: spare.client.send((frame,), time.monotonic() + SEND_S))
        except Disconnected as e:
            self.link.drop_spare(spare, f"PING not sent: {e}")
            return
        if sent:
            self._ping = (spare, self._seq, now + PING_TIMEOUT_S)
            self._ping_at = now + PING_S

    def _spare_frame(self, spare: Conn) -> None:
        """The spare is readable: its PING answer, or the end of it."""
        try:
            still, hdr = self.link.on_spare(spare, lambda: _read_ping(spare))
        except DeadlineExceeded:
            return  # a frame not whole yet: the next read resumes it
        except (Disconnected, wire.ProtocolError) as e:
            self.link.drop_spare(spare, str(e))
            return
        if not still:
            return  # no longer the spare
        ping = self._ping
        if hdr.type == wire.PING and ping is not None and (hdr.session, hdr.round) == (self.link.session, ping[1]):
            self._ping = None
        else:
            self.link.drop_spare(spare, f"{hdr.name} (number {hdr.round}) on a spare that awaits no such frame")

    def _wait(self) -> None:
        link = self.link
        now = time.monotonic()
        timeout = min(WAIT_MAX_S, max(0.0, link.fleet.due_in()))
        if link.active is None:
            timeout = min(timeout, max(0.0, self._retry_at - now))
        elif link.spare is None and not (self._dialer is not None and self._dialer.is_alive()):
            timeout = min(timeout, max(0.0, self._spare_at - now))  # (a dial under way wakes it)
        if link.spare is not None:  # its PING due, or the answer awaited
            timeout = min(timeout, max(0.0, (self._ping[2] if self._ping else self._ping_at) - now))
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        watched: dict[int, tuple[str, Conn]] = {}
        for role, conn, events in (
            ("active", link.active, _HUP),
            ("spare", link.spare, select.POLLIN | _HUP),
        ):
            sock = conn.sock if conn is not None else None
            if sock is not None and sock.fileno() >= 0:
                watched[sock.fileno()] = (role, conn)
                poller.register(sock.fileno(), events)
        for conn, until in tuple(self._fenced):  # (a copy: the round thread may append)
            sock = conn.sock
            if sock is not None and sock.fileno() >= 0:
                watched[sock.fileno()] = ("fenced", conn)
                poller.register(sock.fileno(), select.POLLIN)
            timeout = min(timeout, max(0.0, until - now))
        try:
            ready = poller.poll(timeout * 1000.0)
        except InterruptedError:
            return
        for fd, flags in ready:
            if fd == self._wake_r:
                self._drain_wake()
                continue
            role, conn = watched[fd]
            if role == "active" and flags & _HUP and not link.closed:
                link.leave(conn.epoch, Failover.LOST, f"worker {conn.address} hung up", in_use=True)
            elif role == "spare":
                self._spare_frame(conn)
            elif role == "fenced":
                self._fenced_frame(conn)
        self._expire_fenced(time.monotonic())

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 64):
                pass
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise

    def _fenced_frame(self, conn: Conn) -> None:
        try:
            hdr, _ = conn.client.chan.recv_frame(time.monotonic() + READ_S)
        except DeadlineExceeded:
            return
        except (Disconnected, wire.ProtocolError):
            self._forget_fenced(conn)
            return
        if hdr.type == wire.DRAFTS:
            self.link.count_fenced()

    def _forget_fenced(self, conn: Conn) -> None:
        for item in tuple(self._fenced):
            if item[0] is conn:
                self._fenced.remove(item)
        conn.close()
        self._spare_at = 0.0  # its worker may take the spare now

    def _expire_fenced(self, now: float) -> None:
        while self._fenced and self._fenced[0][1] <= now:
            self._fenced.popleft()[0].close()
            self._spare_at = 0.0  # its worker may take the spare now


def _read_ping(spare: Conn) -> wire.Header:
    """The spare's next frame's header, under the link's lock (a spare's channel takes no
    payload: a header announcing one is refused before a byte of it is read, so a hostile
    spare costs no buffer). Raises as ``FrameChannel.recv_frame``."""
    return spare.client.chan.recv_frame(time.monotonic() + READ_S)[0]

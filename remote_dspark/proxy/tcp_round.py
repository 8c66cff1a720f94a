"""The proxy's round on a TCP connection as one native call (``hf_round``).

From the moment a round is gathered until it is released the proxy runs no Python:
``hf_round`` takes the round, checks its descriptor (the engine's metadata, perhaps
written by a GPU stream: every size, offset, slot, n_out and flag; a bad one is answered
ERROR, counted ``rounds_bad_desc`` and not sent), sends its ROUND frame straight from
the region (header, the descriptor's block, the staging rows: ``sendmsg``, the rows as a
CPU engine counts them into staging, ``hf_rows_pending``), waits for the DRAFTS
(spinning on the socket for ``ASYNC_SPIN_US``, then in ``ppoll``), checks them by the
wire's rules, against the round's entries and the session's terms (the reply rule of
``engine.values.reply``, written in C), writes them (each row widened to num_spec, zero past
its count) and publishes ``released``. Python decides
before the call whether the round may use the network (the connection, the breaker's
``allow``) and does the accounting after it (the breaker, the attempts and late
counters, the log, dropping a broken connection), when the engine already has its
drafts.

Why C: a proxy that waited idle is slow on its first Python after the wait. On the H200
host, from seeing a round to releasing it, two ctypes calls with a Python loop between
them took 0.9 us on back-to-back rounds but 4.5 us on a round after an idle gap, and 32
us while a Python thread of the engine kept its other CPUs busy; the stream's poll of
``released`` turns every microsecond of that into up to ten (docs/design/proxy.md, "The
proxy's round is one native call").

A round not sent (no connection, the breaker open, or a caller that answers at once) is
answered by the same call with the status it is given, so it too never enters Python;
one call answers any number of those in a row (``at_once_max``).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

from .. import native, wire
from ..outcome import Outcome, RoundEvent
from ..shm.ring import seq_add
from .ring_end import NO_CONN, ProxyEnd

DRAFTS_CAP = wire.frame_cap(wire.DRAFTS)  # the wire's: no DRAFTS payload is larger


def rx_cap(end: ProxyEnd) -> int:
    """The largest DRAFTS payload a round of ``end``'s region can be answered with (every
    entry, num_spec wide, margins, and a sampled region's distributions): a longer reply
    breaks the contract before it is read, and the buffer stays small (a 64-slot
    region's is 3 KB, not the wire's megabytes), so a proxy builds it in microseconds
    when it starts, or is promoted."""
    lay = end.layout
    return min(DRAFTS_CAP, wire.drafts_sections(lay.max_slots, lay.num_spec, True, lay.sampled).size)


_EVENTS = tuple(RoundEvent)


class Served(NamedTuple):
    """One round served by :meth:`TcpRounds.serve` (a tuple: it is built on the proxy's
    way back to its wait, where every microsecond can land on the next round)."""

    count: int  # rounds answered by the call (more than one only at once)
    round: int  # the last of them
    event: RoundEvent
    epoch: int  # the link epoch of the connection it took (0: none)
    sent: bool  # the ROUND went on the wire (an attempt)
    released: bool  # this answer was published (False: another claimer was first, counted late)
    late: int  # replies to earlier rounds dropped while waiting
    net_s: float  # send to reply, or to giving up
    why: str  # what broke, for every event but OK and AT_ONCE


class TcpRounds:
    """``hf_round`` over one proxy end and the link's active connection. One thread
    serves rounds (the proxy loop); :meth:`publish` may be called from any (the link,
    under its lock, whenever its active changes).

    Invariants: the native receive state belongs to the connection it was read from (C
    starts it afresh on another); Python reads nothing from the active socket.
    """

    def __init__(self, end: ProxyEnd, *, session: int, default_deadline_ms: int):
        self._end = end
        cap = rx_cap(end)
        self._rx = (ctypes.c_char * cap)()
        self._state = end.new_link(
            ctypes.addressof(self._rx), cap, session=session, default_deadline_ms=default_deadline_ms
        )
        self._addr = ctypes.addressof(self._state)
        self._conn_addr = self._addr + native.LinkState.conn.offset

    def publish(self, epoch: int, fd: int) -> None:
        """The connection the next round takes: ``fd`` (connected, HELLO done, nothing
        read since) of link epoch ``epoch``, or none (``fd`` -1). One atomic store; the
        round after the current one's wait loads it."""
        word = NO_CONN if fd < 0 else (epoch << 32) | fd
        self._end.lib.store64(self._conn_addr, word)

    def attach(self, fd: int, epoch: int = 1) -> None:
        """:meth:`publish` for a caller with one connection (tests, tools)."""
        self.publish(epoch, fd)

    def detach(self) -> None:
        self.publish(0, -1)

    @property
    def attached(self) -> bool:
        return self._end.lib.load64(self._conn_addr) != NO_CONN

    def serve(self, timeout_s: float, *, send: bool, at_once: Outcome, at_once_max: int = 1) -> Served | None:
        """Take the next round within ``timeout_s`` (None if none came) and answer it:
        over the attached connection when ``send``, else at once with ``at_once``. Rounds
        answered at once are answered up to ``at_once_max`` in the one call, until none
        is waiting once ``timeout_s`` has passed.

        Raises:
            ValueError: ``at_once`` is not a status the proxy writes.
            RuntimeError: a ring invariant is broken (``native.check``), or the previous
                round's claimer never released it.
        """
        if not Outcome.OK <= at_once <= Outcome.BREAKER_SKIP:
            raise ValueError(f"at_once={at_once!r} is not a status the proxy writes")
        st = self._state
        st.send, st.at_once, st.at_once_max = bool(send), at_once, max(1, at_once_max)
        timeout_ns = int(timeout_s * 1e9) if timeout_s > 0 else 0
        rc = self._end.lib.round(self._end.state_addr, self._addr, timeout_ns)
        if rc < 0:
            native.check(-rc, "take a round")  # TIMEOUT: the wait has no other failure
            return None
        answer = st.answer
        if answer and native.check(answer, f"answer round {st.round}") is native.Status.TIMEOUT:
            raise RuntimeError(
                f"round {st.round} is claimed but round {seq_add(st.round, -1)}'s "
                "claimer did not release it; the engine must release_orphans"
            )
        return Served(
            st.served,
            st.round,
            _EVENTS[rc],
            0 if st.used == NO_CONN else st.used >> 32,
            st.sent == 1,
            answer == 0,
            st.late,
            st.net_ns / 1e9,
            st.why.decode(errors="replace") if rc > RoundEvent.AT_ONCE else "",
        )

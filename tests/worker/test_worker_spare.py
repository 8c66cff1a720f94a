"""A worker in a fleet: its HELLO_ACK's load (``engines``) and ``incarnation``, spare
sessions (who makes room for a newcomer, a spare refused beside its own engine, a spare
served from its first ROUND) and PING, answered on every serving path at once, even
while the drafter is busy, a bad PING dropping its own connection only. In-process
workers on 127.0.0.1; every wait bounded; every worker stopped by its test."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from helpers import COUNTING, connect, do_round, recv_exactly, until

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.transport import Disconnected
from remote_dspark.transport.client import Refused
from remote_dspark.worker import Worker
from remote_dspark.worker.sessions import Session, Sessions
from remote_dspark.worker.windows import Windows

WAIT_S = 5.0
FIRST = wire.Entry(0, 3, 0, (1, 2), True)  # COUNTING: 1 -> 2 -> 3 -> 4 -> 1


class Gated(MarkovDrafter):
    """The Markov drafter under another class (the hub serves it, not the lane), drafting
    only while ``gate`` is set (bounded wait); ``entered`` once a call began."""

    def __init__(self):
        super().__init__(COUNTING)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def draft_batch(self, batch):
        self.entered.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        return super().draft_batch(batch)


# Which code reads a connection's frames: (round path, drafter class, spare).
PATHS = {
    "lane": ("served", MarkovDrafter, False),  # the Markov lane (C) hands a PING to its thread
    "hub": ("served", Gated, False),  # the hub's I/O thread answers it in C
    "lane-spare": ("served", MarkovDrafter, True),  # a spare's lane: Python until its first ROUND
    "python": ("python", Gated, False),  # the connection's own thread
}


def make(round_path="served", drafter_cls=MarkovDrafter, **kw) -> Worker:
    drafter = drafter_cls() if drafter_cls is Gated else drafter_cls(COUNTING)
    return Worker(drafter, "127.0.0.1", 0, window=16, round_path=round_path, **kw).start()


def ping(c, seq: int) -> wire.Header:
    """Send a PING of ``c``'s session with ``seq``; the frame that answers it."""
    c.chan.send(wire.encode_ping(c.session, seq))
    hdr, _ = c.chan.recv_frame(time.monotonic() + WAIT_S)
    return hdr


def served_by(w: Worker, path: str) -> bool:
    """Whether the hub serves connections exactly when ``path`` is a hub's: waited for,
    bounded (the hub takes a connection just after its HELLO_ACK)."""

    def now() -> bool:
        return bool(w._hub is not None and w._hub.connections()) == path.startswith("hub")

    return until(now, WAIT_S)


# --------------------------------------------------------------------------- the ACK


def test_the_ack_tells_the_engines_served_and_one_incarnation_per_worker():
    a, b = make(max_engines=3), make()
    clients = []
    try:
        assert a.incarnation != b.incarnation and a.incarnation and b.incarnation
        first = connect(a, session=1, engine_id=1)
        clients.append(first)
        assert first.ack.engines == 0 and first.ack.incarnation == a.incarnation  # the newcomer not counted
        clients.append(connect(a, session=2, engine_id=2, spare=True))
        third = connect(a, session=3, engine_id=3)
        clients.append(third)
        assert third.ack.engines == 1 and third.ack.incarnation == a.incarnation  # the spare not counted
        with pytest.raises(Refused) as e:  # full of recent engines and a spare: busy, told the same
            connect(a, session=4, engine_id=4, spare=True)
        assert "busy" in e.value.reason
        refusal = wire.decode_hello_ack(_raw_ack(a, wire.Hello(b"\1" * 32, b"\2" * 32, 9, 8, 4, 3)))
        assert refusal.code == wire.REFUSE_DRAFTER and (refusal.engines, refusal.incarnation) == (2, a.incarnation)
        assert connect(b, session=1, engine_id=1).ack.incarnation == b.incarnation
    finally:
        for c in clients:
            c.close()
        a.stop()
        b.stop()


def _raw_ack(w: Worker, h: wire.Hello) -> bytes:
    with socket.create_connection(("127.0.0.1", w.port), timeout=WAIT_S) as s:
        s.sendall(wire.encode_hello(h, 77))
        hdr = wire.decode_header(recv_exactly(s, wire.HEADER.size))
        return recv_exactly(s, hdr.payload_len)


# --------------------------------------------------------------------------- spares


def test_a_newcomer_evicts_an_idle_served_session_then_the_oldest_spare_then_is_refused():
    now = [100.0]
    sessions = Sessions(3, recent_s=60, clock=lambda: now[0])

    def new(engine_id: int, spare: bool = False) -> Session:
        return Session(engine_id, 4, 3, False, Windows(4, 8), engine_id=engine_id, spare=spare)

    s1, s2, idle = new(1, spare=True), new(2, spare=True), new(3)
    for s in (s1, s2):  # the spares say HELLO first, at 100
        assert sessions.admit(s) == (None, None)
    now[0] = 101.0
    assert sessions.admit(idle) == (None, None)
    now[0] = 170.0  # the served one idled 69 s: it goes before either spare
    a = new(4)
    assert sessions.admit(a) == (None, idle) and not s1.evicted and sessions.counts() == (1, 2)
    now[0] = 171.0  # no idle served session: the spare that said HELLO first goes
    b = new(5)
    assert sessions.admit(b) == (None, s1) and s1.evicted and not s2.evicted
    busy, _ = sessions.admit(new(6, spare=True))  # a spare never evicts a spare
    assert busy.startswith("busy") and "spares" in busy and not s2.evicted
    assert sessions.admit(new(7)) == (None, s2)  # ... an engine does
    busy, evicted = sessions.admit(new(8))  # only recent engines left: refused
    assert busy.startswith("busy") and evicted is None and sessions.counts() == (3, 0)


def test_at_the_connection_cap_a_spare_goes_before_an_engine_served_lately():
    now = [0.0]
    w = make(max_connections=2, recent_s=1.0, sessions_clock=lambda: now[0])
    clients = []
    try:
        spare = connect(w, session=1, engine_id=1, spare=True)
        clients.append(spare)
        lately = connect(w, session=2, engine_id=2)
        clients.append(lately)
        now[0] = 0.5
        do_round(lately, 1, [FIRST])
        newcomer = connect(w, session=3, engine_id=3)  # the spare idled 0.5 s only: it goes all the same
        clients.append(newcomer)
        hdr, _ = spare.chan.recv_frame(time.monotonic() + WAIT_S)
        assert hdr.type == wire.BYE and w.statistics().evicted == 1
        assert do_round(lately, 2, [wire.Entry(0, 3, 2, (3,))]).row(0) == [4, 1, 2]
        assert w.sessions_now() == (2, 0)
    finally:
        for c in clients:
            c.close()
        w.stop()


def test_a_spare_is_refused_beside_its_own_session_and_replaced_by_its_engines_active():
    """The same proxy's spare (its session) reaching this worker by a second address is
    refused, beside its active or its spare; a new proxy's (another session) replaces."""
    w = make()
    clients = []
    try:
        active = connect(w, session=1, engine_id=0x51)
        clients.append(active)
        with pytest.raises(Refused) as e:
            connect(w, session=1, engine_id=0x51, spare=True)
        assert e.value.code == wire.REFUSE_LIMITS
        assert "engine 0x51 session 0x1" in e.value.reason and "a spare must go to another worker" in e.value.reason
        assert w.statistics().refusals["limits"] == 1
        assert do_round(active, 1, [FIRST]).row(0) == [3, 4, 1]  # untouched
        clients.append(connect(w, session=9, engine_id=0x53, spare=True))
        with pytest.raises(Refused):
            connect(w, session=9, engine_id=0x53, spare=True)  # beside its own spare too
        assert w.statistics().refusals["limits"] == 2
        clients.append(connect(w, session=3, engine_id=0x52, spare=True))
        assert w.sessions_now() == (1, 2)
        clients.append(connect(w, session=4, engine_id=0x52))  # its engine's active HELLO replaces it
        assert w.sessions_now() == (2, 1)
    finally:
        for c in clients:
            c.close()
        w.stop()


@pytest.mark.parametrize("path", ["lane", "hub", "python"])
def test_a_spare_is_an_engine_served_from_its_first_round(path, monkeypatch):
    """On every path the first ROUND makes a spare an engine before that round is
    answered; on a lane (its header peeked at first) the lane answers it, and every one
    after it."""
    w = make("python" if path == "python" else "served", Gated if path == "hub" else MarkovDrafter)
    on_lane, engaged = [], []
    served = w._served
    w._served = lambda *a: (on_lane.append(1), served(*a))  # the lane's count of a round, after its reply
    made_engine = Sessions.engaged
    monkeypatch.setattr(
        Sessions, "engaged", staticmethod(lambda s: (engaged.append((s.spare, len(on_lane))), made_engine(s)))
    )
    clients = []
    try:
        spare = connect(w, session=1, engine_id=1, spare=True)
        clients.append(spare)
        assert w.sessions_now() == (0, 1)
        assert do_round(spare, 1, [FIRST]).row(0) == [3, 4, 1]
        assert engaged[0] == (True, 0)  # a spare, made an engine before any lane answered
        assert w.sessions_now() == (1, 0) and served_by(w, path)
        # (the lane counts a round after its reply is sent: waited for, bounded)
        assert until(lambda: len(on_lane) == 1) if path == "lane" else not on_lane
        assert do_round(spare, 2, [wire.Entry(0, 3, 2, (3,))]).row(0) == [4, 1, 2]
        assert until(lambda: len(on_lane) == 2) if path == "lane" else not on_lane
        later = connect(w, session=2, engine_id=2)
        clients.append(later)
        assert later.ack.engines == 1
    finally:
        for c in clients:
            c.close()
        w.stop()


# --------------------------------------------------------------------------- PING


@pytest.mark.parametrize("path", PATHS)
def test_a_ping_is_answered_at_once_on_every_path_even_while_the_drafter_is_busy(path):
    round_path, drafter_cls, spare = PATHS[path]
    w = make(round_path, drafter_cls)
    clients = []
    try:
        c = connect(w, session=0xAB, engine_id=1, spare=spare)
        clients.append(c)
        for seq in (0, 7, 0xFFFFFFFF):
            assert ping(c, seq) == wire.Header(wire.PING, 0, 0xAB, seq)
        assert served_by(w, path)
        assert do_round(c, 1, [FIRST]).row(0) == [3, 4, 1]  # the connection goes on
        if drafter_cls is Gated:  # another engine's round holds the drafter: the PING never waits for it
            other = connect(w, session=0xCD, engine_id=2)
            clients.append(other)
            w.drafter.gate.clear()
            w.drafter.entered.clear()
            other.send([wire.encode_round_entries(1, 0xCD, 1000, [FIRST], bytes(4), 4)])
            assert w.drafter.entered.wait(WAIT_S)
            assert ping(c, 8) == wire.Header(wire.PING, 0, 0xAB, 8)
            w.drafter.gate.set()
            assert other.recv_drafts(1, time.monotonic() + WAIT_S).row(0) == [3, 4, 1]
        assert w.statistics().pings == 3 + (drafter_cls is Gated)  # counted before they were answered
    finally:
        if drafter_cls is Gated:
            w.drafter.gate.set()
        for c in clients:
            c.close()
        w.stop()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", ["payload", "session"])
def test_a_ping_with_a_payload_or_of_another_session_drops_only_its_connection(path, bad):
    round_path, drafter_cls, spare = PATHS[path]
    w = make(round_path, drafter_cls)
    clients = []
    try:
        c = connect(w, session=1, engine_id=1, spare=spare)
        clients.append(c)
        keep = connect(w, session=2, engine_id=2, spare=spare)
        clients.append(keep)
        assert served_by(w, path)
        if bad == "payload":
            c.chan.stream.sock.sendall(wire.encode_header(wire.PING, 4, 1, 3) + b"ping")
        else:
            c.chan.stream.sock.sendall(wire.encode_ping(2, 3))
        with pytest.raises(Disconnected):  # closed on it, no answer
            c.chan.recv_frame(time.monotonic() + WAIT_S)
        assert until(lambda: w.statistics().bad_frames == 1, WAIT_S)
        assert ping(keep, 9) == wire.Header(wire.PING, 0, 2, 9)
        assert do_round(keep, 1, [FIRST]).row(0) == [3, 4, 1]
        assert w.statistics().pings == 1
    finally:
        for c in clients:
            c.close()
        w.stop()

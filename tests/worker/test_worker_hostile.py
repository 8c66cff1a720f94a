"""The reference worker under hostile peers: nothing but a small HELLO is read
before HELLO, the worker's own limits, admission that favours whoever says HELLO, and
places among the engines by least recent service. All on 127.0.0.1; every wait is
bounded and every socket and worker is closed. Memory as RSS is the benchmark's
(``bench worker-hostile``); here allocation is checked with tracemalloc."""

from __future__ import annotations

import re
import socket
import time
import tracemalloc

import pytest
from helpers import connect, do_round, until

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.contract import PerEntryDrafter, needs_rows_of
from remote_dspark.drafter.markov import MarkovModel
from remote_dspark.transport import Disconnected
from remote_dspark.transport.client import Refused
from remote_dspark.transport.tcp import KEEPALIVE_IDLE_S, TcpStream
from remote_dspark.worker import Worker
from remote_dspark.worker.sessions import Session, Sessions
from remote_dspark.worker.windows import Windows

MODEL = MarkovModel.from_tokens([1, 2, 3, 4, 5] * 20, order=1, top=2)


def make(**kw) -> Worker:
    return Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, window=8, **kw).start()


@pytest.fixture
def worker():
    w = make()
    yield w
    w.stop()


def raw(w) -> socket.socket:
    return socket.create_connection(("127.0.0.1", w.port), timeout=5)


def closed_within(s: socket.socket, timeout_s: float) -> bool:
    """The worker closed ``s`` within ``timeout_s`` (EOF or reset); False if it is still open."""
    s.settimeout(timeout_s)
    try:
        while True:
            if s.recv(4096) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def open_now(s: socket.socket) -> bool:
    """``s`` has not been closed by the worker (nothing to read, no EOF, right now)."""
    return not closed_within(s, 0.05)


# --------------------------------------------------------------------------- before HELLO


def test_a_huge_header_before_hello_is_dropped_without_allocating_it(worker, caplog):
    tracemalloc.start()
    try:
        s = raw(worker)
        try:
            s.sendall(wire.encode_header(wire.ROUND, wire.MAX_PAYLOAD, 1, 1))
            assert closed_within(s, 5)
        finally:
            s.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # nothing near the 64 MiB announced
    assert until(lambda: worker.stats.bad_frames == 1)
    assert worker.stats.connections == 0  # never a served connection, never a thread
    assert f"ROUND of {wire.MAX_PAYLOAD} bytes before HELLO" in caplog.text


@pytest.mark.parametrize(
    "frame,what",
    [
        (wire.encode_header(wire.DRAFTS, wire.frame_cap(wire.DRAFTS)), "DRAFTS of"),  # announced, never sent
        (wire.encode_bye(), "BYE of 0 bytes before HELLO"),
        (wire.encode_header(wire.HELLO_ACK, 16), "HELLO_ACK of 16 bytes before HELLO"),
        (wire.encode_header(wire.HELLO, wire.frame_cap(wire.HELLO) + 1), "exceeds the cap"),
    ],
)
def test_anything_but_a_hello_first_drops_the_connection_with_one_line(worker, caplog, frame, what):
    s = raw(worker)
    try:
        s.sendall(frame)
        assert closed_within(s, 5)  # at once: the payload is never waited for
    finally:
        s.close()
    assert until(lambda: worker.admission().bad_frames == 1)
    assert worker.stats.bad_frames == 1 and worker.stats.connections == 0
    assert [r.message for r in caplog.records if what in r.message] != []


def test_hello_deadline_closes_a_silent_connection():
    w = make(hello_timeout_s=0.3)
    s = raw(w)
    try:
        assert closed_within(s, 5)
        assert w.stats.hello_timeouts == 1 and w.admission().pending == 0
        c = connect(w)  # an honest HELLO in time is served
        assert do_round(c, 1, [wire.Entry(0, 2, 0, (1,), True)]).row(0) == [2, 3]
        c.close()
    finally:
        s.close()
        w.stop()


def test_silent_sockets_beyond_the_pool_never_keep_a_hello_out_and_the_oldest_goes():
    w = make(max_pending=4, hello_timeout_s=30)
    silent = []
    try:
        for _ in range(10):
            silent.append(raw(w))
            n = len(silent)
            assert until(lambda n=n: w.admission().accepted == n, timeout=5)
        # The pool holds the 4 newest; the 6 oldest were dropped, oldest first.
        assert all(closed_within(s, 5) for s in silent[:6])
        assert all(open_now(s) for s in silent[6:])
        assert w.stats.displaced == 6
        c = connect(w)  # a HELLO is served with the pool full of silent sockets (connect's own 2 s bound)
        assert do_round(c, 1, [wire.Entry(0, 1, 0, (4,), True)]).row(0) == [5]
        c.close()
        # The honest connection took the place of the oldest silent one.
        assert closed_within(silent[6], 5) and all(open_now(s) for s in silent[7:])
        assert w.stats.displaced == 7 and w.stats.connections == 1
    finally:
        for s in silent:
            s.close()
        w.stop()


def test_busy_when_served_connections_are_at_their_maximum():
    w = make(max_connections=1)
    try:
        a = connect(w)
        with pytest.raises(Refused) as e:
            connect(w, session=2, engine_id=43)
        assert e.value.code == wire.REFUSE_LIMITS
        assert e.value.reason.startswith("busy:") and "--max-connections" in e.value.reason
        assert w.stats.busy == 1
        assert do_round(a, 1, [wire.Entry(0, 1, 0, (1,), True)]).row(0) == [2]  # still served
        a.close()
        assert until(lambda: not w._conns)
        b = connect(w, session=2, engine_id=43)  # the place is free again
        b.close()
    finally:
        w.stop()


def test_served_and_connecting_sockets_have_keepalive():
    w = make()
    try:
        c = connect(w)
        assert until(lambda: len(w._conns) == 1)
        served = next(iter(w._conns))
        for sock in (served, c.chan.stream.sock):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
        c.close()
        engine_side = TcpStream.connect("127.0.0.1", w.port, 2.0)
        assert engine_side.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        engine_side.close()
    finally:
        w.stop()


# --------------------------------------------------------------------------- the worker's limits


@pytest.mark.parametrize(
    "kw,fields,why",
    [
        ({"max_slots": 4}, {"max_slots": 8}, "max_slots 8 over this worker's 4 (--max-slots)"),
        ({"max_row_bytes": 2}, {"row_bytes": 4}, "row_bytes 4 over this worker's 2 (--max-row-bytes)"),
        ({"max_round_bytes": 64}, {"max_slots": 8, "row_bytes": 4}, "over this worker's 64 (--max-round-bytes)"),
    ],
)
def test_hello_beyond_the_workers_limits_is_refused_with_the_limits_reason(kw, fields, why):
    w = make(**kw)
    try:
        with pytest.raises(Refused) as e:
            connect(w, **fields)
        assert e.value.code == wire.REFUSE_LIMITS and why in e.value.reason
        assert w.stats.refused == 1 and w.stats.busy == 0
    finally:
        w.stop()


class RowsDrafter(MarkovDrafter):
    needs_rows = True  # reads the engine's rows


@pytest.mark.parametrize("drafter", [RowsDrafter(MODEL), PerEntryDrafter(RowsDrafter(MODEL))])
def test_a_drafter_that_needs_rows_refuses_an_engine_without_them(drafter):
    w = Worker(drafter, "127.0.0.1", 0, window=8).start()
    try:
        with pytest.raises(Refused) as e:
            connect(w, row_bytes=0)
        assert e.value.code == wire.REFUSE_LIMITS
        assert "row_bytes 0 (no rows), but the drafter " in e.value.reason and "needs_rows" in e.value.reason
        assert w.stats.refused == 1 and w.statistics().refusals["limits"] == 1
        c = connect(w, session=2, row_bytes=4)  # with rows: served
        try:
            assert do_round(c, 1, [wire.Entry(0, 3, 0, (1,), new_gen=True)]).row(0) == [2, 3, 4]
        finally:
            c.close()
    finally:
        w.stop()


def test_a_drafter_that_does_not_need_rows_serves_an_engine_without_them(worker):
    c = connect(worker, row_bytes=0)
    try:
        rnd = wire.encode_round_entries(1, c.session, 1000, [wire.Entry(0, 3, 0, (1,), new_gen=True)], b"", 0)
        assert c.round(1, [rnd], 2000).row(0) == [2, 3, 4]
    finally:
        c.close()


def test_a_needs_rows_that_is_not_a_bool_is_named():
    class Odd(MarkovDrafter):
        needs_rows = "yes"

    with pytest.raises(ValueError, match="drafter needs_rows 'yes': expected a bool"):
        needs_rows_of(Odd(MODEL))


def test_after_hello_the_cap_is_the_sessions_and_a_stalled_header_costs_nothing():
    w = make(frame_timeout_s=0.5)
    try:
        c = connect(w, max_slots=8, row_bytes=4)
        cap = wire.round_sections(8, w.limits.max_round_tokens, 4).size
        tracemalloc.start()
        try:
            c.chan.send(wire.encode_header(wire.ROUND, cap, c.session, 1))  # announced, then stalled
            assert closed_within(c.chan.stream.sock, 5)  # at the frame timeout
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < cap // 2 and w.stats.stalled == 1
        c.chan.close()
        c = connect(w, session=2, max_slots=8, row_bytes=4)
        c.chan.send(wire.encode_header(wire.ROUND, cap + 1, c.session, 1))  # over the session's cap
        assert closed_within(c.chan.stream.sock, 5)
        assert until(lambda: w.stats.bad_frames == 1)
        c.chan.close()
    finally:
        w.stop()


def test_a_round_over_the_token_limit_or_with_other_rows_drops_the_connection():
    w = make(max_round_tokens=4)
    try:
        c = connect(w)
        assert do_round(c, 1, [wire.Entry(0, 1, 0, (1, 2, 3, 4), True)]).row(0) == [5]
        with pytest.raises(Disconnected):
            do_round(c, 2, [wire.Entry(1, 1, 0, (1, 2, 3, 4, 5), True)])
        assert until(lambda: w.stats.bad_frames == 1)
        c.chan.close()
        c = connect(w, session=2)
        frame = wire.encode_round_entries(1, 2, 1000, [wire.Entry(0, 1, 0, (1,), True)], bytes(8), 8)
        with pytest.raises(Disconnected):
            c.round(1, [frame], 2000)
        assert until(lambda: w.stats.bad_frames == 2)
        c.chan.close()
    finally:
        w.stop()


# --------------------------------------------------------------------------- places among the engines


def test_a_flood_of_new_engine_ids_never_evicts_an_engine_served_recently():
    w = make(max_engines=2, max_connections=16)
    clients = []
    try:
        a = connect(w, session=1, engine_id=1)
        clients.append(a)
        assert do_round(a, 1, [wire.Entry(0, 3, 0, (1, 2), True)]).row(0) == [3, 4, 5]
        clients.append(connect(w, session=2, engine_id=2))
        for i in range(10):
            with pytest.raises(Refused) as e:
                connect(w, session=10 + i, engine_id=100 + i)
            assert e.value.code == wire.REFUSE_LIMITS and e.value.reason.startswith("busy:")
            assert "--max-engines" in e.value.reason
        assert w.stats.busy == 10 and w.stats.evicted == 0
        d = do_round(a, 2, [wire.Entry(0, 3, 2, (3,))])  # A's window is still there
        assert list(d.statuses) == [wire.STATUS_OK] and d.row(0) == [4, 5, 1]
    finally:
        for c in clients:
            c.close()
        w.stop()


def test_sessions_evict_the_least_recently_served_only_once_it_idled_recent_s():
    now = [100.0]
    sessions = Sessions(2, recent_s=60, clock=lambda: now[0])

    def new(engine_id: int) -> Session:
        return Session(engine_id, 4, 3, False, Windows(4, 8), engine_id=engine_id)

    a, b = new(1), new(2)
    assert sessions.admit(a) == (None, None) and sessions.admit(b) == (None, None)  # both at 100
    now[0] = 130.0
    sessions.served(a)
    now[0] = 159.9  # B idled 59.9 s: still recent
    busy, evicted = sessions.admit(new(3))
    assert busy.startswith("busy: all 2 engine places") and evicted is None and len(sessions) == 2
    now[0] = 160.0  # B idled recent_s: it makes room; A (served at 130) stays
    c = new(3)
    assert sessions.admit(c) == (None, b)
    assert b.evicted and sessions.get(2) is None and sessions.get(3) is c and c.last_served == 160.0
    busy, _ = sessions.admit(new(4))  # A idled 30 s, C none
    assert busy is not None and not a.evicted


def served_at(w: Worker, engine_id: int, when: float) -> bool:
    """The worker's thread has dated engine ``engine_id``'s last round (it does so just
    after sending the reply) at ``when``."""
    return until(lambda: w._sessions.get(engine_id).last_served == when)


def test_eviction_takes_the_least_recently_served_engine_not_the_first_to_say_hello():
    now = [0.0]
    w = make(max_engines=2, recent_s=0.2, sessions_clock=lambda: now[0])
    try:
        a = connect(w, session=1, engine_id=1)  # says HELLO first ...
        b = connect(w, session=2, engine_id=2)
        now[0] = 0.3
        do_round(b, 1, [wire.Entry(0, 3, 0, (1,), True)])
        assert served_at(w, 2, 0.3)
        now[0] = 0.6
        assert do_round(a, 1, [wire.Entry(0, 3, 0, (1, 2), True)]).row(0) == [3, 4, 5]  # ... served last
        assert served_at(w, 1, 0.6)
        now[0] = 0.9  # both idle longer than recent_s now
        c = connect(w, session=3, engine_id=3)
        assert w.stats.evicted == 1
        hdr, _ = b.chan.recv_frame(time.monotonic() + 5)  # B lost its place: BYE, then closed
        assert hdr.type == wire.BYE
        d = do_round(a, 2, [wire.Entry(0, 3, 2, (3,))])
        assert list(d.statuses) == [wire.STATUS_OK]
        a.close()
        c.close()
        b.chan.close()
    finally:
        w.stop()


def test_at_the_connection_cap_a_newcomer_displaces_a_connection_idle_past_recent_s():
    """``max_connections`` peers said HELLO; one idles, one was served lately. A newcomer
    once the idle one has idled ``recent_s`` is served and the idle one is told BYE and
    closed (the rule that evicts engines); the one served within ``recent_s`` is never
    displaced: the next newcomer is told busy, and it is still served."""
    now = [0.0]
    w = make(max_connections=2, max_engines=8, recent_s=1.0, sessions_clock=lambda: now[0])
    clients = []
    try:
        idle = connect(w, session=1, engine_id=1)
        clients.append(idle)
        lately = connect(w, session=2, engine_id=2)
        clients.append(lately)
        now[0] = 0.5
        do_round(lately, 1, [wire.Entry(0, 3, 0, (1,), True)])
        assert served_at(w, 2, 0.5)
        now[0] = 1.2  # the idle one idled 1.2 s, the other 0.7 s
        newcomer = connect(w, session=3, engine_id=3)
        clients.append(newcomer)
        hdr, _ = idle.chan.recv_frame(time.monotonic() + 5)  # the stalest lost its connection: BYE, then closed
        assert hdr.type == wire.BYE and w.stats.evicted == 1
        with pytest.raises(Refused) as e:  # the rest were served within recent_s: busy
            connect(w, session=4, engine_id=4)
        assert "--max-connections" in e.value.reason
        assert do_round(lately, 2, [wire.Entry(0, 3, 1, (2,))]).row(0) == [3, 4, 5]
        assert do_round(newcomer, 1, [wire.Entry(0, 3, 0, (1,), True)]).row(0) == [2, 3, 4]
        assert w._sessions.get(1) is None and w.served_now() == 2
    finally:
        for c in clients:
            c.close()
        w.stop()


def test_a_closed_connection_gives_its_engine_place_back():
    w = make(max_engines=1)
    try:
        a = connect(w, session=1, engine_id=1)
        do_round(a, 1, [wire.Entry(0, 3, 0, (1,), True)])
        a.close()
        assert until(lambda: len(w._sessions) == 0)
        b = connect(w, session=2, engine_id=2)  # served at once, no eviction, no busy
        assert w.stats.busy == 0 and w.stats.evicted == 0
        b.close()
    finally:
        w.stop()


@pytest.mark.parametrize(
    "kw,why",
    [
        ({"max_slots": 5000}, "max_slots 5000: not in 1..4096 (--max-slots)"),
        ({"max_row_bytes": -1}, "max_row_bytes -1"),
        ({"max_round_bytes": 4}, "max_round_bytes 4"),
    ],
)
def test_limits_out_of_the_wires_range_are_refused_naming_the_option(kw, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, **kw)

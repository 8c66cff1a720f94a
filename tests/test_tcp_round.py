"""``hf_round``: the proxy's whole round in one native call, against a worker played by
the test on the other end of a socket pair (replies are queued before the call, so no
test thread races the proxy)."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from remote_dspark import ring, shm, streamsync, wire
from remote_dspark.ring import Outcome
from remote_dspark.tcp_round import RoundEvent, TcpRounds
from helpers import until

SESSION = 0xC0FFEE
LAYOUT = shm.Layout(depth=4, max_slots=4, row_bytes=8, num_spec=4, max_tokens=32)


class Rig:
    def __init__(self, lib, layout=LAYOUT):
        self.lib = lib
        self.region = shm.Region.create(layout)
        self.eng = ring.EngineEnd(self.region, lib)
        self.sync = streamsync.HostFlagSync(self.region, lib)
        self.end = ring.ProxyEnd(self.region, lib, spin_us=50)
        self.rounds = TcpRounds(self.end, session=SESSION, default_deadline_ms=2000)
        self.proxy_sock, self.worker = socket.socketpair()
        self.worker.settimeout(2.0)
        self.rounds.attach(self.proxy_sock.fileno())

    def gather(self, slots=(3,), deadline_ms=0, rows=None) -> int:
        r = self.eng.reserve(1)
        self.eng.write_descriptor(r, [wire.Entry(s, 4, 10 + s, [s, s + 1]) for s in slots], deadline_ms)
        if rows is not None:
            self.eng.staging(r)[:len(rows)] = rows
        self.sync.signal(r)
        return r

    def reply(self, r, slots=(3,), width=2, counts=None, margins=False) -> bytes:
        n = len(slots)
        d = wire.Drafts(r, list(slots), counts or [width] * n, [wire.STATUS_OK] * n, width,
                        list(range(100, 100 + n * width)), [0.25] * (n * width) if margins else None)
        return wire.encode_drafts(d, SESSION)

    def serve(self, send=True, at_once=Outcome.BREAKER_SKIP):
        served = self.rounds.serve(2.0, send=send, at_once=at_once)
        assert served is not None
        return served

    def sent_round(self) -> wire.Round:
        hdr = wire.decode_header(self.worker.recv(wire.HEADER.size, socket.MSG_WAITALL))
        assert hdr.type == wire.ROUND and hdr.session == SESSION
        return wire.decode_round(hdr, self.worker.recv(hdr.payload_len, socket.MSG_WAITALL))

    def nothing_sent(self) -> bool:
        self.worker.settimeout(0)
        try:
            self.worker.recv(1)
        except BlockingIOError:
            return True
        finally:
            self.worker.settimeout(2.0)
        return False

    def close(self):
        self.proxy_sock.close()
        self.worker.close()
        self.region.close()


@pytest.fixture
def rig(lib):
    r = Rig(lib)
    yield r
    r.close()


def test_a_round_goes_out_from_the_region_and_its_drafts_come_back(rig):
    r = rig.gather(slots=(3, 1), deadline_ms=700, rows=bytes(range(16)))
    rig.worker.sendall(rig.reply(r, slots=(3, 1), width=2, counts=[2, 1], margins=True))
    s = rig.serve()
    assert (s.round, s.event, s.sent, s.released, s.late, s.why) == (r, RoundEvent.OK, True, True, 0, "")
    sent = rig.sent_round()
    assert (sent.round_id, sent.deadline_ms, bytes(sent.rows)) == (r, 700, bytes(range(16)))
    assert [(e.slot, e.position, tuple(e.tokens)) for e in sent.entries] == [(3, 13, (3, 4)), (1, 11, (1, 2))]
    d = rig.eng.drafts(r)
    assert d.outcome == Outcome.OK and d.counts == (2, 1)
    assert d.tokens == ((100, 101), (102,)) and d.margins == ((0.25, 0.25), (0.25,))
    c = rig.end.counters.snapshot().counters
    assert (c["rounds_ok"], c["drafts"], c["draft_tokens"]) == (1, 2, 3)


def test_a_timeout_keeps_the_stream_in_step_and_late_replies_are_dropped_and_counted(rig):
    r1 = rig.gather(deadline_ms=30)
    s = rig.serve()
    assert s.event == RoundEvent.TIMEOUT and rig.eng.drafts(r1).outcome == Outcome.TIMEOUT
    late = rig.reply(r1)
    r2 = rig.gather(deadline_ms=30)
    rig.worker.sendall(late[:10])   # round 1's reply begins, then the deadline passes mid-frame
    assert rig.serve().event == RoundEvent.TIMEOUT
    r3 = rig.gather()
    rig.worker.sendall(late[10:] + rig.reply(r2) + rig.reply(r3))
    s = rig.serve()
    assert (s.event, s.late) == (RoundEvent.OK, 2) and rig.eng.drafts(r3).tokens == ((100, 101),)
    c = rig.end.counters.snapshot().counters
    assert (c["rounds_timeout"], c["rounds_ok"]) == (2, 1)


def _frame(ftype, payload=b"", r=1, magic=b"DSPW", version=wire.PROTOCOL_VERSION):
    return wire.HEADER.pack(magic, version, ftype, len(payload), SESSION, r) + payload


BAD_REPLIES = {
    "bad magic": (lambda rig, r: _frame(wire.DRAFTS, r=r, magic=b"XXXX"), RoundEvent.PROTOCOL, "bad magic"),
    "version": (lambda rig, r: _frame(wire.DRAFTS, r=r, version=9), RoundEvent.PROTOCOL, "protocol version 9"),
    "bye": (lambda rig, r: wire.encode_bye(SESSION), RoundEvent.LOST, "said BYE"),
    "not drafts": (lambda rig, r: _frame(wire.HELLO_ACK, r=r), RoundEvent.PROTOCOL, "where DRAFTS was expected"),
    "never sent": (lambda rig, r: rig.reply(r + 5), RoundEvent.PROTOCOL, "round {}, which was never sent"),
    "over the cap": (lambda rig, r: wire.encode_header(wire.DRAFTS, 1 << 30, SESSION, r),
                     RoundEvent.PROTOCOL, "exceeds the cap"),
    "short": (lambda rig, r: _frame(wire.DRAFTS, rig.reply(r)[wire.HEADER.size:-4], r=r),
              RoundEvent.PROTOCOL, "its fields say"),
    "count over width": (lambda rig, r: rig.reply(r, counts=[3]), RoundEvent.PROTOCOL, "count 3 (width 2)"),
    "wrong slot": (lambda rig, r: rig.reply(r, slots=(2,)), RoundEvent.BAD_REPLY, "slot 2, the round has slot 3"),
    "wrong entries": (lambda rig, r: rig.reply(r, slots=(3, 2)), RoundEvent.BAD_REPLY, "2 entries, the round has 1"),
    "too wide": (lambda rig, r: rig.reply(r, width=5), RoundEvent.BAD_REPLY, "width 5 over num_spec=4"),
}


@pytest.mark.parametrize("case", sorted(BAD_REPLIES))
def test_a_bad_reply_is_answered_error_and_says_why(rig, case):
    make, event, why = BAD_REPLIES[case]
    r = rig.gather()
    rig.worker.sendall(make(rig, r))
    s = rig.serve()
    assert s.event == event and s.released and s.sent
    assert why.format(r + 5) in s.why
    assert rig.eng.drafts(r).outcome == Outcome.ERROR
    assert rig.end.counters.snapshot().counters["rounds_error"] == 1


@pytest.mark.parametrize("how,why", [("close", "send failed: Broken pipe"),
                                     ("shut_wr", "the worker closed the connection")])
def test_a_closed_connection_is_lost(rig, how, why):
    r = rig.gather()
    if how == "close":
        rig.worker.close()
    else:
        rig.worker.shutdown(socket.SHUT_WR)
    s = rig.serve()
    assert (s.event, s.why) == (RoundEvent.LOST, why)
    assert rig.eng.drafts(r).outcome == Outcome.ERROR


def test_a_descriptor_that_is_not_the_rounds_is_answered_without_sending(rig):
    r = rig.gather()
    with rig.region.descriptor(r & (LAYOUT.depth - 1)) as d:
        struct.pack_into("<I", d, shm.DESC_ROUND, r + 4)
    s = rig.serve()
    assert (s.event, s.sent) == (RoundEvent.BAD_DESC, False) and f"holds round {r + 4}" in s.why
    assert rig.nothing_sent() and rig.eng.drafts(r).outcome == Outcome.ERROR


@pytest.mark.parametrize("attached", [True, False])
def test_a_round_not_sent_is_answered_at_once_with_the_status_given(rig, attached):
    if not attached:
        rig.rounds.detach()
    r = rig.gather()
    s = rig.serve(send=attached is False, at_once=Outcome.BREAKER_SKIP)   # detached: never sent
    assert (s.event, s.sent, s.released) == (RoundEvent.AT_ONCE, False, True)
    assert rig.nothing_sent() and rig.eng.drafts(r).outcome == Outcome.BREAKER_SKIP
    with pytest.raises(ValueError, match="at_once=<Outcome.WATCHDOG: 4>"):
        rig.rounds.serve(0.01, send=False, at_once=Outcome.WATCHDOG)


def test_no_round_within_the_timeout_is_none(rig):
    assert rig.rounds.serve(0.01, send=True, at_once=Outcome.ERROR) is None


def test_a_reply_after_the_watchdog_answered_is_dropped_as_late(rig):
    rig.eng.start_watchdog(20)
    r = rig.gather(deadline_ms=5000)

    def worker():   # replies once the watchdog has released the round
        if until(lambda: rig.eng.released() == r, timeout=5.0):
            rig.worker.sendall(rig.reply(r))
    t = threading.Thread(target=worker)
    t.start()
    try:
        s = rig.serve()
    finally:
        t.join(10)
    assert (s.event, s.released) == (RoundEvent.OK, False)
    assert rig.eng.drafts(r).outcome == Outcome.WATCHDOG
    assert rig.end.counters.snapshot().counters["rounds_late"] == 1


@pytest.mark.parametrize("at_once_max,count", [(10, 3), (2, 2)])
def test_one_call_answers_the_waiting_rounds_at_once_up_to_its_bound(rig, at_once_max, count):
    rs = [rig.gather() for _ in range(3)]
    s = rig.rounds.serve(0.05, send=False, at_once=Outcome.ERROR, at_once_max=at_once_max)
    assert (s.count, s.round, s.event) == (count, rs[count - 1], RoundEvent.AT_ONCE)
    assert rig.eng.released() == rs[count - 1] and rig.nothing_sent()
    assert rig.end.counters.snapshot().counters["rounds_error"] == count


def test_a_send_the_worker_never_reads_loses_the_connection_at_the_round_deadline(lib):
    big = shm.Layout(depth=4, max_slots=4, row_bytes=1 << 20, num_spec=4, max_tokens=32)
    rig = Rig(lib, big)   # 4 MiB of rows: more than the socket pair buffers
    try:
        r = rig.gather(slots=(0, 1, 2, 3), deadline_ms=50)
        s = rig.serve()
        assert (s.event, s.why) == (RoundEvent.LOST, f"send of round {r} stalled past its deadline")
        assert 0.05 <= s.net_s < 2.0 and rig.eng.drafts(r).outcome == Outcome.ERROR
    finally:
        rig.close()

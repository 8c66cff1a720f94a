"""``hf_round``: the proxy's whole round in one native call, against a worker played by
the test on the other end of a socket pair (replies are queued before the call, so no
test thread races the proxy)."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
from helpers import recv_exactly, until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.outcome import Outcome, RoundEvent
from remote_dspark.proxy import ring_end
from remote_dspark.proxy.tcp_round import TcpRounds
from remote_dspark.shm import layout, memfd, ring, streamsync

SESSION = 0xC0FFEE
LAYOUT = layout.Layout(depth=4, max_slots=4, row_bytes=8, num_spec=4, max_tokens=32)


class Rig:
    def __init__(self, lib, layout=LAYOUT, **session):
        """``session``: the ProxyEnd's terms of the session (``vocab_size``, ``want_margin``)."""
        self.lib = lib
        self.region = memfd.Region.create(layout)
        self.eng = ring.EngineEnd(self.region, lib)
        self.sync = streamsync.HostFlagSync(self.region, lib)
        self.end = ring_end.ProxyEnd(self.region, lib, spin_us=50, **session)
        self.rounds = TcpRounds(self.end, session=SESSION, default_deadline_ms=2000)
        self.proxy_sock, self.worker = socket.socketpair()
        self.worker.settimeout(2.0)
        self.rounds.attach(self.proxy_sock.fileno())

    def gather(self, slots=(3,), deadline_ms=0, rows=None, entries=None, corrupt=None, pending=0) -> int:
        """Write a round (``entries``, or one per slot) and gather it; ``corrupt(d, n,
        n_tokens)`` may then write into the descriptor's ROUND payload ``d``; ``pending``:
        the entries whose rows are still to come (``set_pending`` counts them down), as a
        CPU engine's C hand-over publishes a round."""
        r = self.eng.reserve(1)
        if entries is None:
            entries = [wire.Entry(s, 4, 10 + s, [s, s + 1]) for s in slots]
        self.eng.write_entries(r, entries, deadline_ms)
        if rows is not None:
            with self.eng.staging(r) as staging:
                staging[: len(rows)] = rows
        if corrupt is not None:
            at = self.region.layout.desc(r & (self.region.layout.depth - 1)) + layout.DESC_FIXED
            with self.region.view(at, self.region.layout.desc_stride - layout.DESC_FIXED) as d:
                corrupt(d, len(entries), sum(len(e.tokens) for e in entries))
        self.set_pending(r, pending)
        self.sync.signal(r)
        return r

    def set_pending(self, r, pending: int) -> None:
        """Store round ``r``'s rows-pending count (a release store, as the engine's)."""
        lay = self.region.layout
        self.lib.store32(self.region.addr(lay.desc(r & (lay.depth - 1)) + layout.DESC_PENDING), pending)

    def reply(self, r, slots=(3,), width=2, counts=None, margins=False) -> bytes:
        n = len(slots)
        d = wire.DraftsFrame(
            r,
            list(slots),
            counts or [width] * n,
            [wire.STATUS_OK] * n,
            width,
            list(range(100, 100 + n * width)),
            [0.25] * (n * width) if margins else None,
        )
        return wire.encode_drafts(d, SESSION)

    def serve(self, send=True, at_once=Outcome.BREAKER_SKIP):
        served = self.rounds.serve(2.0, send=send, at_once=at_once)
        assert served is not None
        return served

    def sent_frame(self) -> bytes:
        head = recv_exactly(self.worker, wire.HEADER.size)
        hdr = wire.decode_header(head)
        assert hdr.type == wire.ROUND and hdr.session == SESSION
        return head + recv_exactly(self.worker, hdr.payload_len)

    def sent_round(self) -> wire.Round:
        frame = self.sent_frame()
        return wire.decode_round(wire.decode_header(frame[: wire.HEADER.size]), frame[wire.HEADER.size :])

    def raw_drafts(self, r) -> tuple:
        """The drafts slot of ``r`` as written: (status, n, flags, counts, statuses,
        tokens [n][K], margins [n][K] or None), every row whole (past the counts too)."""
        lay, K = self.region.layout, self.region.layout.num_spec
        with self.region.drafts(r & (lay.depth - 1)) as d:
            rnd, status, n, flags = layout.DRAFTS_HEAD.unpack_from(d, 0)
            assert rnd == r

            def rows(fmt, at):
                return [list(struct.unpack_from(f"<{K}{fmt}", d, at + 4 * K * i)) for i in range(n)]

            return (
                status,
                n,
                flags,
                list(struct.unpack_from(f"<{n}i", d, layout.D_COUNTS)),
                list(struct.unpack_from(f"<{n}i", d, lay.d_entry_status)),
                rows("i", lay.d_tokens),
                rows("f", lay.d_margins) if flags & layout.DRAFTS_MARGINS else None,
            )

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


@pytest.fixture
def rig_m(lib):
    """A rig whose session asked for margins."""
    r = Rig(lib, want_margin=True)
    yield r
    r.close()


def test_a_round_goes_out_from_the_region_and_its_drafts_come_back(rig_m):
    rig = rig_m
    r = rig.gather(slots=(3, 1), deadline_ms=700, rows=bytes(range(16)))
    rig.worker.sendall(rig.reply(r, slots=(3, 1), width=2, counts=[2, 1], margins=True))
    s = rig.serve()
    assert (s.round, s.event, s.sent, s.released, s.late, s.why) == (r, RoundEvent.OK, True, True, 0, "")
    sent = rig.sent_round()
    assert (sent.round_id, sent.deadline_ms, sent.row_bytes, bytes(sent.rows)) == (r, 700, 8, bytes(range(16)))
    assert (list(sent.slots), list(sent.positions), list(sent.n_out), list(sent.flags)) == (
        [3, 1],
        [13, 11],
        [4, 4],
        [0, 0],
    )
    assert (list(sent.offsets), list(sent.tokens)) == ([0, 2, 4], [3, 4, 1, 2])
    d = rig.eng.drafts(r)
    assert d.outcome == Outcome.OK and d.counts == (2, 1)
    assert d.tokens == ((100, 101), (102,)) and d.margins == ((0.25, 0.25), (0.25,))
    c = rig.end.counters.snapshot().counters
    assert (c["rounds_ok"], c["drafts"], c["draft_tokens"]) == (1, 2, 3)


@pytest.mark.parametrize("path", ["hf_round", "ofl"])
def test_a_round_of_an_engine_without_rows_goes_out_with_an_empty_rows_section(lib, path):
    """``row_bytes=0``: no staging in the region; the frame is the descriptor's block alone
    (in C, an empty rows iovec; in Python, an empty rows view)."""
    rig = Rig(lib, layout.Layout(depth=4, max_slots=4, row_bytes=0, num_spec=4, max_tokens=32))
    try:
        r = rig.gather(slots=(3, 1), deadline_ms=700)
        entries = [wire.Entry(s, 4, 10 + s, [s, s + 1]) for s in (3, 1)]
        want = wire.encode_round_entries(r, SESSION, 700, entries, b"", 0)
        reply = rig.reply(r, slots=(3, 1), width=2, counts=[2, 1])
        if path == "hf_round":
            rig.worker.sendall(reply)
            s = rig.serve()
            assert (s.event, s.sent, s.released, s.why) == (RoundEvent.OK, True, True, "")
            assert rig.sent_frame() == want
        else:
            rnd = rig.end.next_round(1)
            parts = rnd.wire_parts(SESSION)
            assert b"".join(bytes(p) for p in parts) == want and parts[-1].nbytes == 0
            for p in parts[1:]:
                p.release()
            hdr = wire.decode_header(reply[: wire.HEADER.size])
            assert rig.end.complete(rnd, wire.decode_drafts(hdr, reply[wire.HEADER.size :]))
        sent = wire.decode_round(wire.decode_header(want[: wire.HEADER.size]), want[wire.HEADER.size :])
        assert (sent.row_bytes, bytes(sent.rows), list(sent.slots)) == (0, b"", [3, 1])
        d = rig.eng.drafts(r)
        assert d.outcome == Outcome.OK and d.counts == (2, 1) and d.tokens == ((100, 101), (102,))
    finally:
        rig.close()


def test_a_timeout_keeps_the_stream_in_step_and_late_replies_are_dropped_and_counted(rig):
    r1 = rig.gather(deadline_ms=30)
    s = rig.serve()
    assert s.event == RoundEvent.TIMEOUT and rig.eng.drafts(r1).outcome == Outcome.TIMEOUT
    late = rig.reply(r1)
    r2 = rig.gather(deadline_ms=30)
    rig.worker.sendall(late[:10])  # round 1's reply begins, then the deadline passes mid-frame
    assert rig.serve().event == RoundEvent.TIMEOUT
    r3 = rig.gather()
    rig.worker.sendall(late[10:] + rig.reply(r2) + rig.reply(r3))
    s = rig.serve()
    assert (s.event, s.late) == (RoundEvent.OK, 2) and rig.eng.drafts(r3).tokens == ((100, 101),)
    c = rig.end.counters.snapshot().counters
    assert (c["rounds_timeout"], c["rounds_ok"]) == (2, 1)


def _frame(ftype, payload=b"", r=1, magic=b"DSPW", version=wire.PROTOCOL_VERSION):
    return wire.HEADER.pack(magic, version, ftype, len(payload), SESSION, r) + payload


def _patched(frame: bytes, at: int, fmt: str, value: int) -> bytes:
    """``frame`` with ``value`` written at payload offset ``at``."""
    out = bytearray(frame)
    struct.pack_into(fmt, out, wire.HEADER.size + at, value)
    return bytes(out)


BAD_REPLIES = {
    "bad magic": (lambda rig, r: _frame(wire.DRAFTS, r=r, magic=b"XXXX"), RoundEvent.PROTOCOL, "bad magic"),
    "version": (lambda rig, r: _frame(wire.DRAFTS, r=r, version=9), RoundEvent.PROTOCOL, "protocol version 9"),
    "bye": (lambda rig, r: wire.encode_bye(SESSION), RoundEvent.LOST, "said BYE"),
    "not drafts": (lambda rig, r: _frame(wire.HELLO_ACK, r=r), RoundEvent.PROTOCOL, "where DRAFTS was expected"),
    "never sent": (lambda rig, r: rig.reply(r + 5), RoundEvent.PROTOCOL, "round {}, which was never sent"),
    "over the cap": (
        lambda rig, r: wire.encode_header(wire.DRAFTS, 1 << 30, SESSION, r),
        RoundEvent.PROTOCOL,
        "exceeds the cap",
    ),
    "short": (
        lambda rig, r: _frame(wire.DRAFTS, rig.reply(r)[wire.HEADER.size : -4], r=r),
        RoundEvent.PROTOCOL,
        "its fields say",
    ),
    "count over width": (lambda rig, r: rig.reply(r, counts=[3]), RoundEvent.PROTOCOL, "count 3 (width 2)"),
    "unknown status": (
        lambda rig, r: _patched(rig.reply(r), 8 + 4 + 2, "<H", 2),
        RoundEvent.PROTOCOL,
        "entry 0: count 2 (width 2), status 2",
    ),
    "unknown flags": (lambda rig, r: _patched(rig.reply(r), 6, "<H", 4), RoundEvent.PROTOCOL, "unknown flags 0x4"),
    "over the caps": (
        lambda rig, r: _patched(rig.reply(r), 0, "<I", wire.MAX_ENTRIES + 1),
        RoundEvent.PROTOCOL,
        f"{wire.MAX_ENTRIES + 1} entries x 2 over the caps",
    ),
    "under the fixed part": (
        lambda rig, r: _frame(wire.DRAFTS, b"\0" * 7, r=r),
        RoundEvent.PROTOCOL,
        "payload of 7 bytes, under 8",
    ),
    "wrong slot": (lambda rig, r: rig.reply(r, slots=(2,)), RoundEvent.BAD_REPLY, "slot 2, the round has slot 3"),
    "wrong entries": (lambda rig, r: rig.reply(r, slots=(3, 2)), RoundEvent.BAD_REPLY, "2 entries, the round has 1"),
    "too wide": (lambda rig, r: rig.reply(r, width=5), RoundEvent.PROTOCOL, "width 5 over num_spec=4"),
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


@pytest.mark.parametrize(
    "how,why", [("close", "send failed: Broken pipe"), ("shut_wr", "the worker closed the connection")]
)
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
        struct.pack_into("<I", d, layout.DESC_ROUND, r + 4)
    s = rig.serve()
    assert (s.event, s.sent) == (RoundEvent.BAD_DESC, False) and f"holds round {r + 4}" in s.why
    assert rig.nothing_sent() and rig.eng.drafts(r).outcome == Outcome.ERROR


@pytest.mark.parametrize("attached", [True, False])
def test_a_round_not_sent_is_answered_at_once_with_the_status_given(rig, attached):
    """Attached, the caller's status; with no connection (the link left it, perhaps
    during the call's wait) never sent and ERROR, whatever the caller expected."""
    if not attached:
        rig.rounds.detach()
    r = rig.gather()
    s = rig.serve(send=attached is False, at_once=Outcome.BREAKER_SKIP)  # detached: never sent
    assert (s.event, s.sent, s.released, s.epoch) == (RoundEvent.AT_ONCE, False, True, 1 if attached else 0)
    expected = Outcome.BREAKER_SKIP if attached else Outcome.ERROR
    assert rig.nothing_sent() and rig.eng.drafts(r).outcome == expected
    with pytest.raises(ValueError, match="at_once=<Outcome.WATCHDOG: 4>"):
        rig.rounds.serve(0.01, send=False, at_once=Outcome.WATCHDOG)


def test_no_round_within_the_timeout_is_none(rig):
    assert rig.rounds.serve(0.01, send=True, at_once=Outcome.ERROR) is None


def test_a_reply_after_the_watchdog_answered_is_dropped_as_late(rig):
    rig.eng.start_watchdog(20)
    r = rig.gather(deadline_ms=5000)

    def worker():  # replies once the watchdog has released the round
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
    big = layout.Layout(depth=4, max_slots=4, row_bytes=1 << 20, num_spec=4, max_tokens=32)
    rig = Rig(lib, big)  # 4 MiB of rows: more than the socket pair buffers
    try:
        r = rig.gather(slots=(0, 1, 2, 3), deadline_ms=50)
        s = rig.serve()
        assert (s.event, s.why) == (RoundEvent.LOST, f"send of round {r} stalled past its deadline")
        assert s.net_s >= 0.05 and rig.eng.drafts(r).outcome == Outcome.ERROR  # given up at the deadline, not before
    finally:
        rig.close()


def test_a_streamed_rounds_rows_go_out_only_once_the_engine_counts_them_in(rig):
    """A round published before its rows (a CPU engine's C hand-over) goes out as they are
    counted in: the header and descriptor at once, each row only once the pending count no
    longer covers it. Staging holds a marker until the test writes each real row, so a
    row sent early would arrive as the marker."""
    lay = rig.region.layout
    slots, R = (0, 1, 2), lay.row_bytes
    real = bytes(range(1, 1 + 3 * R))
    r = rig.gather(slots=slots, rows=b"\xee" * (3 * R), pending=3)
    served = []
    proxy = threading.Thread(target=lambda: served.append(rig.serve()))
    rig.worker.sendall(rig.reply(r, slots=slots))  # queued: the proxy reads it once it has sent the round
    proxy.start()
    try:
        head = recv_exactly(rig.worker, wire.HEADER.size)
        hdr = wire.decode_header(head)
        block = recv_exactly(rig.worker, hdr.payload_len - 3 * R)
        got = b""
        for k in range(3):  # one row at a time: written, then counted in
            with rig.eng.staging(r) as staging:
                staging[k * R : (k + 1) * R] = real[k * R : (k + 1) * R]
            rig.set_pending(r, 2 - k)
            got += recv_exactly(rig.worker, R)
        assert got == real
        proxy.join(5.0)
        assert not proxy.is_alive() and served[0].event == RoundEvent.OK
        frame = wire.decode_round(hdr, block + got)
        assert list(frame.slots) == list(slots) and bytes(frame.rows) == real
    finally:
        rig.set_pending(r, 0)
        proxy.join(5.0)


def test_rows_the_engine_never_counts_in_lose_the_connection_at_the_round_deadline(rig):
    r = rig.gather(slots=(0, 1), rows=bytes(2 * LAYOUT.row_bytes), deadline_ms=50, pending=1)
    s = rig.serve()
    assert (s.event, s.why) == (RoundEvent.LOST, f"round {r}: 1 of its 2 rows not gathered by its deadline")
    assert s.net_s >= 0.05 and rig.eng.drafts(r).outcome == Outcome.ERROR


def test_a_python_network_round_is_taken_only_once_its_rows_are_all_in(rig):
    """hf_take (a proxy that sends the round itself) returns a round only once its rows are
    all in staging; one whose rows are still coming is left for the next call."""
    r = rig.gather(slots=(0, 1), pending=1)
    assert rig.end.next_round(0.02) is None and rig.end.next == r
    rig.set_pending(r, 0)
    taken = rig.end.next_round(1.0)
    assert taken is not None and taken.round == r


# --------------------------------------------------------------------------- bad descriptors

TWO = [wire.Entry(3, 4, 10, [1, 2]), wire.Entry(1, 2, 0, [5, 6], new_gen=True)]  # n = 2, 4 tokens
_SEC = wire.round_sections(2, 4, LAYOUT.row_bytes)


def _u32(at):
    return lambda value: lambda d, n, t: struct.pack_into("<I", d, at, value)


# Each rule of hf_round's descriptor check: the field corrupted (offsets from
# wire.round_sections, relative to the descriptor's ROUND payload), and the why.
BAD_DESCS = {
    "n_entries": (_u32(4)(LAYOUT.max_slots + 1), f"n_entries 5 over max_slots={LAYOUT.max_slots}"),
    "row_bytes": (_u32(8)(LAYOUT.row_bytes + 1), "row_bytes 9, the layout's is 8"),
    "n_tokens": (_u32(12)(LAYOUT.max_tokens + 1), f"n_tokens 33 over max_tokens={LAYOUT.max_tokens}"),
    "offsets[0]": (_u32(_SEC.offsets)(1), "offsets run from 1 to 4, expected 0 to n_tokens=4"),
    "offsets[n]": (_u32(_SEC.offsets + 8)(3), "offsets run from 0 to 3, expected 0 to n_tokens=4"),
    "offsets back": (_u32(_SEC.offsets + 4)(5), "entry 1: offsets go back (5, then 4)"),
    "slot range": (_u32(_SEC.slots + 4)(LAYOUT.max_slots), "entry 1: slot 4 not below max_slots=4"),
    "slot twice": (_u32(_SEC.slots + 4)(3), "entry 1: slot 3 twice in the round"),
    "n_out": (_u32(_SEC.n_out)(LAYOUT.num_spec + 1), "entry 0: n_out 5 over num_spec=4"),
    "flags": (_u32(_SEC.flags + 4)(3), "entry 1: flags 0x3, only NEW_GEN (1) is known"),
}


@pytest.mark.parametrize("case", sorted(BAD_DESCS))
def test_a_bad_descriptor_is_answered_error_unsent_and_counted_and_the_connection_kept(rig, case):
    corrupt, why = BAD_DESCS[case]
    r = rig.gather(entries=TWO, corrupt=corrupt)
    s = rig.serve()
    assert (s.event, s.sent, s.released, s.why) == (RoundEvent.BAD_DESC, False, True, why)
    assert rig.nothing_sent() and rig.eng.drafts(r).outcome == Outcome.ERROR
    c = rig.end.counters.snapshot().counters
    assert (c["rounds_bad_desc"], c["rounds_error"], c["attempts"]) == (1, 1, 0)
    r2 = rig.gather(entries=TWO)  # the same slots, checked again: no stale "twice"
    rig.worker.sendall(rig.reply(r2, slots=(3, 1)))
    assert rig.serve().event == RoundEvent.OK and rig.sent_round().round_id == r2
    # The ofl path's check is the same C, with the same verdict.
    r3 = rig.gather(entries=TWO, corrupt=corrupt)
    rnd = rig.end.next_round(1)
    assert rnd.round == r3
    with pytest.raises(ValueError, match=f"round {r3}: " + why.replace("(", r"\(").replace(")", r"\)")):
        rnd.wire_parts(SESSION)
    assert rig.end.complete(rnd, None, Outcome.ERROR)


@pytest.mark.parametrize("token", [1000, -1])
def test_a_descriptor_token_outside_the_vocabulary_is_answered_error_unsent_and_counted(lib, token):
    """Metadata written on the device is never read by the host (device_meta.write_meta_in_stream),
    so its token ids meet the vocabulary here, in the proxy's descriptor check."""
    rig = Rig(lib, vocab_size=1000)  # the rig's honest drafts are ids 100..
    try:
        r = rig.gather(entries=TWO, corrupt=lambda d, n, t: struct.pack_into("<i", d, _SEC.tokens + 8, token))
        s = rig.serve()
        assert (s.event, s.sent, s.released) == (RoundEvent.BAD_DESC, False, True)
        assert s.why == f"tokens: {token} (token 2) outside 0..999, the vocabulary"
        assert rig.nothing_sent() and rig.eng.drafts(r).outcome == Outcome.ERROR
        assert rig.end.counters.snapshot().counters["rounds_bad_desc"] == 1
        r2 = rig.gather(entries=TWO)  # ids 1, 2, 5, 6: inside the vocabulary
        rig.worker.sendall(rig.reply(r2, slots=(3, 1)))
        assert rig.serve().event == RoundEvent.OK and rig.sent_round().round_id == r2
    finally:
        rig.close()


def test_the_round_id_is_checked_first(rig):
    r = rig.gather(entries=TWO, corrupt=lambda d, n, t: struct.pack_into("<I", d, 0x10, 99))
    with rig.region.descriptor(r & (LAYOUT.depth - 1)) as d:
        struct.pack_into("<I", d, layout.DESC_ROUND, r + 4)
    s = rig.serve()
    assert s.why == f"descriptor {r & (LAYOUT.depth - 1)} holds round {r + 4}, not round {r}"
    assert rig.end.counters.snapshot().counters["rounds_bad_desc"] == 1


# --------------------------------------------------------------------------- properties

PROP = layout.Layout(depth=4, max_slots=6, row_bytes=8, num_spec=4, max_tokens=24)
_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def rounds(draw):
    """(deadline_ms, entries, rows) of a valid round of PROP."""
    n = draw(st.integers(0, PROP.max_slots))
    slots = draw(st.permutations(range(PROP.max_slots)))[:n]
    budget, entries = PROP.max_tokens, []
    for slot in slots:
        toks = draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=min(budget, 8)))
        budget -= len(toks)
        entries.append(
            wire.Entry(
                slot, draw(st.integers(0, PROP.num_spec)), draw(st.integers(0, 2**32 - 1)), toks, draw(st.booleans())
            )
        )
    return (
        draw(st.integers(0, 60_000)),
        entries,
        draw(st.binary(min_size=n * PROP.row_bytes, max_size=n * PROP.row_bytes)),
    )


@st.composite
def replies(draw, entries):
    """(width, counts, statuses, tokens, margins or None) of a valid DRAFTS for the round's
    entries (counts within each n_out, none with RESYNC, counted tokens non-negative and
    margins in [0, 1]); what lies past each count is anything (the proxy must zero it)."""
    n = len(entries)
    width = draw(st.integers(0, PROP.num_spec))
    statuses = draw(st.lists(st.sampled_from([wire.STATUS_OK, wire.STATUS_RESYNC]), min_size=n, max_size=n))
    counts = [
        draw(st.integers(0, min(width, e.n_out))) if s == wire.STATUS_OK else 0 for e, s in zip(entries, statuses)
    ]
    live = [j < counts[i] for i in range(n) for j in range(width)]
    tokens = [draw(st.integers(0, 2**31 - 1) if c else st.integers(-(2**31), 2**31 - 1)) for c in live]
    with_margins = draw(st.booleans())
    margins = [draw(st.floats(0, 1, width=32) if c else _f32) for c in live] if with_margins else None
    return width, counts, statuses, tokens, margins


def expected_slot(n, width, counts, statuses, tokens, margins):
    """The slow reference: what the drafts slot must hold (rows widened to num_spec,
    zero past each count)."""
    K = PROP.num_spec

    def rows(flat):
        return [list(flat[i * width : i * width + counts[i]]) + [0] * (K - counts[i]) for i in range(n)]

    return (
        Outcome.OK,
        n,
        int(margins is not None),
        counts,
        statuses,
        rows(tokens),
        None if margins is None else rows(margins),
    )


@pytest.mark.parametrize("path", ["hf_round", "ofl"])
def test_random_valid_rounds_go_out_exactly_and_their_drafts_land_exactly(lib, path):
    rigs = {m: Rig(lib, PROP, want_margin=m) for m in (False, True)}  # sessions without and with margins
    try:

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def check(data):
            deadline_ms, entries, rows = data.draw(rounds())
            width, counts, statuses, tokens, margins = data.draw(replies(entries))
            rig = rigs[margins is not None]
            r = rig.gather(entries=entries, deadline_ms=deadline_ms, rows=rows)
            want = wire.encode_round_entries(r, SESSION, deadline_ms, entries, rows, PROP.row_bytes)
            reply = wire.encode_drafts(
                wire.DraftsFrame(r, [e.slot for e in entries], counts, statuses, width, tokens, margins), SESSION
            )
            if path == "hf_round":
                rig.worker.sendall(reply)
                s = rig.serve()
                assert (s.event, s.why) == (RoundEvent.OK, "")
                assert rig.sent_frame() == want
            else:
                rnd = rig.end.next_round(1)
                parts = rnd.wire_parts(SESSION)
                assert b"".join(bytes(p) for p in parts) == want
                for p in parts[1:]:
                    p.release()
                hdr = wire.decode_header(reply[: wire.HEADER.size])
                assert rig.end.complete(rnd, wire.decode_drafts(hdr, reply[wire.HEADER.size :]))
            assert rig.raw_drafts(r) == expected_slot(len(entries), width, counts, statuses, tokens, margins)

        check()
    finally:
        for rig in rigs.values():
            rig.close()

"""Rounds served whole in C (worker.lane, ``hf_worker_serve``) against the worker's Python
path with the same drafter.

Two workers serve the same built-in Markov drafter, one on the lane ("served") and one
on the path it bypasses ("native": the round in by C, the scheduler, numpy drafting, the
reply in Python). The same random rounds (new generations, continuing entries, gaps,
unknown slots, contexts the table knows and tokens it does not, rows large enough to
grow the receive buffer) must get byte-identical DRAFTS and add the same counters, and
every frame the lane hands back must end its connection as the Python loop would.
"""

import ctypes
import gc
import logging
import math
import random
import socket
import struct
import time

import numpy as np
import pytest
from helpers import connect, until
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.drafter.markov import MarkovDrafter, MarkovModel, SyntheticLanguage, builtin_model
from remote_dspark.worker import Worker
from remote_dspark.worker.lane import markov_table

WAIT_S = 5.0
TEXT = SyntheticLanguage().text(4000, seed=3)


def _spied(round_path: str, **kw) -> Worker:
    """A started worker of the built-in drafter whose rounds served in C are counted in
    ``w.lane_rounds``."""
    w = Worker(MarkovDrafter(builtin_model()), "127.0.0.1", 0, window=16, round_path=round_path, **kw)
    w.lane_rounds = 0
    served = w._served

    def counting(session, facts, sent):
        w.lane_rounds += 1
        served(session, facts, sent)

    w._served = counting
    return w.start()


@pytest.fixture(scope="module")
def pair():
    served, native = _spied("served"), _spied("native")
    assert (served.round_path, native.round_path) == ("served", "native")
    yield served, native
    served.stop()
    native.stop()


class Engine:
    """An engine's side of random rounds: the slots it announced and their next positions."""

    def __init__(self, rng: random.Random, max_slots: int, num_spec: int, row_bytes: int):
        self.rng, self.max_slots, self.num_spec, self.row_bytes = rng, max_slots, num_spec, row_bytes
        self.next_pos: dict[int, int] = {}

    def _tokens(self, k: int) -> list[int]:
        if self.rng.random() < 0.8:  # the language the table was learned from
            at = self.rng.randrange(len(TEXT) - k)
            return TEXT[at : at + k]
        return [self.rng.randint(-3, 140) for _ in range(k)]  # tokens the table does not know

    def frame(self, round_id: int, session: int) -> bytes:
        rng = self.rng
        slots = rng.sample(range(self.max_slots), rng.randint(0, self.max_slots))
        entries = []
        for s in slots:
            new = s not in self.next_pos or rng.random() < 0.15
            k = rng.choice([0, 1, 2, 3]) if not new else rng.choice([0, 1, 2, 5, 16, 40])
            pos = rng.randint(0, 99) if new else self.next_pos[s] + (rng.randint(1, 2) if rng.random() < 0.1 else 0)
            if rng.random() < 0.05:
                pos = rng.randint(0, 99)  # an unknown slot's or a stale position
            entries.append(wire.Entry(s, rng.randint(0, self.num_spec + 2), pos, self._tokens(k), new))
            self.next_pos[s] = pos + k
        rows = rng.randbytes(len(entries) * self.row_bytes)
        return wire.encode_round_entries(round_id, session, 0, entries, rows, self.row_bytes)


def _reply(c) -> bytes:
    hdr, payload = c.chan.recv_frame(time.monotonic() + WAIT_S)
    return wire.encode_header(hdr.type, hdr.payload_len, hdr.session, hdr.round) + bytes(payload)


COUNTERS = ("rounds", "entries", "resyncs", "beyond_positions", "draft_tokens", "expired", "drafter_calls")
HISTOGRAMS = ("call_rounds", "call_entries", "call_tokens", "queue_seconds")


def _counted(w: Worker) -> dict:
    st = w.statistics()
    out = {name: getattr(st, name) for name in COUNTERS}
    out.update({name: list(getattr(st, name).buckets) for name in HISTOGRAMS})
    out.update(
        round_seconds=st.round_seconds.count if hasattr(st.round_seconds, "count") else sum(st.round_seconds.buckets)
    )
    return out


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    max_slots=st.sampled_from([1, 5, 64]),
    num_spec=st.integers(1, 6),
    row_bytes=st.sampled_from([0, 4, 3000]),
    want_margin=st.booleans(),
    rounds=st.integers(1, 8),
)
def test_served_rounds_are_the_python_paths_byte_for_byte(
    pair, seed, max_slots, num_spec, row_bytes, want_margin, rounds
):
    served, native = pair
    before = [_counted(w) for w in pair]
    lane_before = served.lane_rounds
    terms = dict(max_slots=max_slots, num_spec=num_spec, row_bytes=row_bytes, want_margin=want_margin, engine_id=7)
    clients = [connect(w, session=seed % 1000 + 1, **terms) for w in pair]
    try:
        engines = [Engine(random.Random(seed), max_slots, num_spec, row_bytes) for _ in pair]
        for rid in range(1, rounds + 1):
            replies = []
            for c, e in zip(clients, engines):
                c.chan.send(e.frame(rid, c.session))
                replies.append(_reply(c))
            assert replies[0] == replies[1], f"round {rid}"
    finally:
        for c in clients:
            c.close()
    # Every round was the lane's (each counted once its reply is out).
    assert until(lambda: served.lane_rounds - lane_before == rounds, WAIT_S)
    assert until(lambda: all(_counted(w)["round_seconds"] - b["round_seconds"] == rounds for w, b in zip(pair, before)))
    after = [_counted(w) for w in pair]
    grown = [
        {
            k: (a - b if isinstance(a, int) else [x - y for x, y in zip(a, b)])
            for (k, a), b in zip(af.items(), bf.values())
        }
        for af, bf in zip(after, before)
    ]
    assert grown[0] == grown[1]
    assert grown[0]["rounds"] == rounds


# (order, the model's tokens, whether its table has a dense index): small alphabets have
# one; wide ones (a radix past DENSE_MAX, or past 63 bits: byte keys) are searched.
TABLES = [
    (1, list(range(6)), True),
    (3, list(range(9)), True),
    (2, [0, 7, 1 << 20, (1 << 20) + 3, -5], False),
    (3, [-(1 << 30), 0, 1, 1 << 29, (1 << 30) + 1], False),
]


@pytest.mark.parametrize("order, alphabet, dense", TABLES)
def test_the_c_table_drafts_what_numpy_drafts(lib, order, alphabet, dense):
    rng = np.random.default_rng(5)
    pick = np.array(alphabet + [min(alphabet) - 1, max(alphabet) + 1], np.int32)  # and tokens it never saw
    model = MarkovModel.from_tokens(rng.choice(alphabet, 3000).tolist(), order=order, top=3)
    table, keep = markov_table(MarkovDrafter(model))
    assert (keep[-1] is not None) == dense
    n, width = 400, 7
    lengths = rng.integers(0, order + 4, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.choice(pick, int(offsets[-1]), p=[0.9 / len(alphabet)] * len(alphabet) + [0.05, 0.05])
    n_out = rng.integers(0, width + 1, n).astype(np.int32)
    want_d, want_c, want_m = model.draft_batch(tokens, offsets, n_out, width, margins=True)
    drafts, margins = np.full((n, width), 9, np.int32), np.full((n, width), 9, np.float32)
    counts = np.full(n, -1, np.int32)
    args = [a.ctypes.data for a in (tokens, offsets, n_out)]
    lib.markov_draft(ctypes.byref(table), *args, n, width, drafts.ctypes.data, counts.ctypes.data, margins.ctypes.data)
    assert np.array_equal(counts, want_c) and np.array_equal(drafts, want_d)
    assert np.array_equal(margins, want_m)
    assert want_c.max() > 0 and (want_c < n_out).any()  # drafts made, and drafts cut short
    lib.markov_draft(ctypes.byref(table), *args, n, width, drafts.ctypes.data, counts.ctypes.data, None)
    assert np.array_equal(drafts, want_d)


def _raw(w, **kw) -> socket.socket:
    """The socket of a HELLO'd connection to ``w`` (the client's, taken over)."""
    return connect(w, **kw).chan.stream.sock


def test_a_bye_ends_a_served_connection_quietly(pair):
    served, _ = pair
    before = served.statistics()
    sock = _raw(served)
    sock.sendall(wire.encode_header(wire.BYE, 0, 1))
    sock.settimeout(WAIT_S)
    assert sock.recv(1) == b""  # closed, with nothing said
    sock.close()
    after = served.statistics()
    assert (after.bad_frames, after.stalled, after.round_failures) == (
        before.bad_frames,
        before.stalled,
        before.round_failures,
    )


BAD = {
    "bad magic": (lambda: b"XXXX" + wire.encode_header(wire.ROUND, 0, 1)[4:], "bad magic"),
    "over the cap": (lambda: wire.encode_header(wire.ROUND, 40 << 20, 1), "exceeds this connection's cap"),
    "a second HELLO": (lambda: wire.encode_header(wire.HELLO, 10, 1), "unexpected HELLO"),
    "a BYE with a payload": (lambda: wire.encode_header(wire.BYE, 1000, 1), "BYE payload of 1000 bytes exceeds"),
    "a slot twice": (
        lambda: wire.encode_round_entries(1, 1, 0, [wire.Entry(0, 2, 0, [1], True)] * 2, bytes(8), 4),
        "slot 0 already named by entry 0",
    ),
    # a fixed part whose sizes wrap the u64 to the payload's length (before 90 GB, rows
    # past 2^64): read whole and refused, never read past its length
    "sizes that wrap to the length": (
        lambda: (
            wire.encode_header(wire.ROUND, 24, 1)
            + struct.pack("<IIII", 0, 4294967276, 4294967295, 1073741920)
            + bytes(8)
        ),
        "ROUND with 4294967276 entries over the cap 4096",
    ),
    # refused once the bytes before its rows are in; its rows, past the receive buffer's
    # first size, still come back whole to the Python checks, which decode the whole frame
    "rows of another size, past the buffer": (
        lambda: wire.encode_round_entries(
            1, 1, 0, [wire.Entry(s, 2, 0, [1], True) for s in range(2)], bytes(80_000), 40_000
        ),
        "ROUND row_bytes 40000, the session said 4",
    ),
}


@pytest.mark.parametrize("why", BAD)
def test_a_bad_frame_drops_the_served_connection_with_the_python_loops_words(pair, caplog, why):
    served, _ = pair
    frame, words = BAD[why]
    before = served.statistics().bad_frames
    sock = _raw(served)
    with caplog.at_level(logging.WARNING, logger="remote_dspark.worker"):
        sock.sendall(frame())
        sock.settimeout(WAIT_S)
        while sock.recv(4096):  # to the close
            pass
        assert until(lambda: served.statistics().bad_frames == before + 1, WAIT_S)
    sock.close()
    assert words in caplog.text


@pytest.mark.parametrize("cut", ["in the metadata", "in the rows"])
def test_a_frame_not_whole_in_time_is_a_stall(cut):
    """A frame cut short stalls and closes the connection with nothing sent, wherever the
    cut is; cut in its rows, the round was already applied and drafted, and its DRAFTS
    still never go out (the windows it moved end with the connection)."""
    w = Worker(MarkovDrafter(builtin_model()), "127.0.0.1", 0, frame_timeout_s=0.2).start()
    try:
        sock = _raw(w)
        frame = wire.encode_round_entries(1, 1, 0, [wire.Entry(0, 2, 0, [1, 2], True)], bytes(4), 4)
        sock.sendall(frame[: 30 if cut == "in the metadata" else -3])
        sock.settimeout(WAIT_S)
        assert sock.recv(4096) == b""
        assert until(lambda: w.statistics().stalled == 1, WAIT_S)
        sock.close()
    finally:
        w.stop()


def test_a_round_whose_part_before_its_rows_outgrows_the_buffer_is_the_python_paths(pair):
    """1,024 entries of 40 tokens: 184 KiB before the rows, so the receive buffer grows
    twice (64 KiB first) before the round is applied; the reply is the native path's."""
    entries = [wire.Entry(s, 3, 0, TEXT[s : s + 40], True) for s in range(1024)]
    replies = []
    for w in pair:
        c = connect(w, max_slots=1024, row_bytes=64)
        try:
            frame = wire.encode_round_entries(1, c.session, 0, entries, bytes(1024 * 64), 64)
            assert len(frame) - 1024 * 64 > 2 * 64 << 10
            c.chan.send(frame)
            replies.append(_reply(c))
        finally:
            c.close()
    assert replies[0] == replies[1] and wire.decode_header(replies[0][: wire.HEADER.size]).type == wire.DRAFTS


def test_a_rounds_rows_are_dropped_as_they_come(pair, monkeypatch):
    """The table never reads a round's rows: they never enter the lane's receive buffer
    (64 KiB here, the rows 8 times that), the round is drafted once the bytes before them
    are in, and its time counts none of the wait for them."""
    from remote_dspark.worker import lane

    served, _ = pair
    grown = []
    monkeypatch.setattr(lane.Lane, "_grow", lambda self: grown.append(self) or pytest.fail("rx grew"))
    seen = lambda: (sum(served.statistics().round_seconds.buckets), served.statistics().round_seconds.sum)  # noqa: E731
    before = seen()
    c = connect(served, max_slots=64, row_bytes=8192)
    entries = [wire.Entry(s, 3, 0, TEXT[s : s + 6], True) for s in range(64)]
    frame = wire.encode_round_entries(1, c.session, 0, entries, bytes(64 * 8192), 8192)
    rows_at = len(frame) - 64 * 8192
    try:
        c.chan.stream.sock.sendall(frame[:rows_at])
        time.sleep(0.3)  # the engine's rows late: the worker waits for them, not counted as its time
        c.chan.stream.sock.sendall(frame[rows_at:])
        hdr, payload = c.chan.recv_frame(time.monotonic() + WAIT_S)
        assert hdr.type == wire.DRAFTS and sum(wire.decode_drafts(hdr, payload).counts) > 0 and not grown
    finally:
        c.close()
    assert until(lambda: seen()[0] == before[0] + 1, WAIT_S)
    assert seen()[1] - before[1] < 0.3


def test_a_replaced_sessions_windows_are_forgotten_on_the_lane(pair):
    served, _ = pair
    old = connect(served, engine_id=99)
    entries = [wire.Entry(s, 3, 0, TEXT[s : s + 4], True) for s in range(4)]
    first = old.round(1, [wire.encode_round_entries(1, old.session, 0, entries, bytes(16), 4)], 2000)
    assert list(first.statuses) == [wire.STATUS_OK] * 4
    new = connect(served, session=2, engine_id=99)  # the same engine: the old windows go now
    going_on = [wire.Entry(s, 3, 4, [TEXT[s + 4]], False) for s in range(4)]
    second = old.round(2, [wire.encode_round_entries(2, old.session, 0, going_on, bytes(16), 4)], 2000)
    assert list(second.statuses) == [wire.STATUS_RESYNC] * 4
    old.close()
    new.close()


def test_stop_says_bye_to_an_idle_served_connection():
    w = _spied("served")
    c = connect(w)
    entries = [wire.Entry(0, 3, 0, TEXT[:5], True)]
    assert c.round(1, [wire.encode_round_entries(1, c.session, 0, entries, bytes(4), 4)], 2000).counts[0] == 3
    assert until(lambda: w.lane_rounds == 1, WAIT_S)  # counted once the reply is out
    w.stop(timeout_s=WAIT_S)
    hdr, _ = c.chan.recv_frame(time.monotonic() + WAIT_S)
    assert hdr.type == wire.BYE and w.served_now() == 0
    c.close()


class Subclassed(MarkovDrafter):
    pass


@pytest.mark.parametrize(
    "make, path",
    [
        (lambda: Worker(MarkovDrafter(builtin_model()), "127.0.0.1", 0), "served"),
        (lambda: Worker(Subclassed(builtin_model()), "127.0.0.1", 0), "served"),  # by the hub
        (lambda: Worker(MarkovDrafter(builtin_model()), "127.0.0.1", 0, round_path="native"), "native"),
        (lambda: Worker(MarkovDrafter(builtin_model()), "127.0.0.1", 0, round_path="python"), "python"),
    ],
)
def test_which_workers_serve_rounds_in_c(make, path):
    assert make().round_path == path


def test_a_sampled_session_takes_the_python_loop():
    w = _spied("served")
    try:
        c = connect(w, want_sampled=True)
        frame = wire.encode_round(
            1, c.session, 0, slots=[0], positions=[0], n_out=[2], flags=[wire.FLAG_NEW_GEN], offsets=[0, 3],
            tokens=TEXT[:3], rows=bytes(4), row_bytes=4, temperature=[1.0], seed=[5],
        )  # fmt: skip
        c.chan.send(frame)
        hdr, _ = c.chan.recv_frame(time.monotonic() + WAIT_S)
        assert hdr.type == wire.DRAFTS and w.lane_rounds == 0
        assert until(lambda: w.statistics().rounds == 1, WAIT_S)  # counted once its reply is out
        c.close()
    finally:
        w.stop()


def test_an_evicted_session_is_served_no_round_after_the_one_in_hand():
    """The worker's loop decides between the lane's rounds whether to go on: rounds
    queued behind an eviction are not served (the connection says BYE)."""
    w = _spied("served")
    served = w._served

    def evict_at_first(session, facts, sent):
        served(session, facts, sent)
        session.evicted = True  # as Sessions.admit marks a victim (its shutdown aside)

    w._served = evict_at_first
    try:
        c = connect(w)
        frames = [
            wire.encode_round_entries(
                rid, c.session, 0, [wire.Entry(0, 3, rid - 1, TEXT[rid : rid + 1], rid == 1)], bytes(4), 4
            )
            for rid in range(1, 30)
        ]
        c.chan.send(b"".join(frames))  # queued at once, behind the first
        types = [c.chan.recv_frame(time.monotonic() + WAIT_S)[0].type for _ in range(2)]
        assert types == [wire.DRAFTS, wire.BYE]
        assert w.lane_rounds == 1 and w.statistics().rounds == 1
        c.close()
    finally:
        w.stop()


def test_a_worker_without_a_frame_timeout_serves_rounds_in_c():
    w = _spied("served", frame_timeout_s=math.inf)
    try:
        c = connect(w)
        entries = [wire.Entry(0, 3, 0, TEXT[:5], True)]
        assert c.round(1, [wire.encode_round_entries(1, c.session, 0, entries, bytes(4), 4)], 2000).counts[0] == 3
        assert until(lambda: w.lane_rounds == 1, WAIT_S)
        c.close()
    finally:
        w.stop()


def test_a_round_whose_reply_was_not_sent_is_counted_without_its_time():
    from remote_dspark.native import ServeState
    from remote_dspark.worker.stats import WorkerStats

    st = WorkerStats()
    facts = ServeState(entries=4, resyncs=1, beyond_positions=0, draft_tokens=6, drafted=3, call_tokens=9)
    st.add_served(facts, sent=False)
    assert (st.rounds, st.entries, st.resyncs, st.draft_tokens, st.drafter_calls) == (1, 4, 1, 6, 1)
    assert sum(st.round_seconds.buckets) == 0
    st.add_served(facts)
    assert st.rounds == 2 and sum(st.round_seconds.buckets) == 1


def test_a_windows_forget_outlives_the_native_rounds_that_set_it(lib):
    from remote_dspark.worker.limits import Limits
    from remote_dspark.worker.native_round import NativeRounds
    from remote_dspark.worker.sessions import Session
    from remote_dspark.worker.windows import Windows

    session = Session(1, 4, 3, False, Windows(4, 8))
    rounds = NativeRounds(lib)
    rounds.view(session, Limits(max_slots=4, window=8), None)
    del rounds
    gc.collect()
    session.windows.known[:] = True
    session.windows.forget_all()  # through the C forget, on the windows' own guard word
    assert not session.windows.known.any() and session.windows.guard[0] == 0

"""The worker's vectorized round logic against a slow per-entry reference.

Random rounds (unique slots, NEW_GEN or continuing entries, positions that continue or
gap, empty token lists, n_out 0..k, windows small enough to wrap) go through
``Worker._round`` (decode, windows, one batched drafter call, DRAFTS written in place)
on one session, several rounds in a row; the reference is per-entry
logic (a deque per slot) with per-entry ``MarkovModel.draft``. Statuses, the contexts
the drafter saw, the windows left behind, drafts, counts and margins must all agree.
No sockets here: test_worker.py covers the connection side.
"""

import random
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.drafter.contract import PerEntryDrafter
from remote_dspark.drafter.markov import MarkovDrafter, MarkovModel
from remote_dspark.worker import Worker
from remote_dspark.worker.sessions import Session
from remote_dspark.worker.windows import Windows

MAX_SLOTS = 6
VOCAB = 5  # tokens 0..4 in the models; rounds also carry 5..6 and -1 (outside)


def _model(order, seed):
    rng = random.Random(seed)
    return MarkovModel.from_tokens([rng.randrange(VOCAB) for _ in range(300)], order=order, top=3)


MODELS = [_model(1, 1), _model(2, 2)]


class RecordingDrafter(MarkovDrafter):
    """The batched Markov drafter, keeping each batch's contexts for the test."""

    def __init__(self, model):
        super().__init__(model)
        self.contexts, self.positions = [], []

    def draft_batch(self, batch):
        self.contexts = [batch.context(i).tolist() for i in range(len(batch))]
        self.positions = batch.positions.tolist()
        return super().draft_batch(batch)


class Reference:
    """Today's per-entry semantics: a deque per slot, then ``MarkovModel.draft``."""

    def __init__(self, model, window, num_spec):
        self.model, self.window, self.num_spec = model, window, num_spec
        self.slots = {}  # slot -> [deque of tokens, next position]
        self.starts = []  # the last round's OK entries: each context's first position

    def round(self, entries):
        width = min(max((e.n_out for e in entries), default=0), self.num_spec)
        statuses, contexts, drafts = [], [], []
        self.starts = []
        for e in entries:
            slot = self.slots.get(e.slot)
            if e.new_gen:
                slot = self.slots[e.slot] = [deque(e.tokens, maxlen=self.window), 0]
            elif slot is None or e.position != slot[1]:
                self.slots.pop(e.slot, None)
                statuses.append(wire.STATUS_RESYNC)
                drafts.append(([], []))
                continue
            else:
                slot[0].extend(e.tokens)
            slot[1] = e.position + len(e.tokens)
            self.starts.append(slot[1] - len(slot[0]))
            statuses.append(wire.STATUS_OK)
            contexts.append(list(slot[0]))
            drafts.append(self.model.draft(list(slot[0]), min(e.n_out, width)))
        return width, statuses, contexts, drafts


ENTRY = st.tuples(
    st.booleans(),  # new_gen
    st.booleans(),  # continue the slot's positions
    st.integers(0, 12),  # else this position
    st.lists(st.sampled_from([0, 1, 2, 3, 4, 0, 1, 2, 5, 6, -1]), max_size=7),
    st.integers(0, 4),
)  # n_out
ROUND = st.lists(st.tuples(st.integers(0, MAX_SLOTS - 1), ENTRY), max_size=MAX_SLOTS, unique_by=lambda se: se[0])


def _entries(ref, drawn):
    out = []
    for slot, (new_gen, cont, pos, tokens, n_out) in drawn:
        if cont and slot in ref.slots:
            pos = ref.slots[slot][1]
        out.append(wire.Entry(slot, n_out, pos, tokens, new_gen))
    return out


def _frame(round_id, entries, row_bytes=3):
    rows = bytes(range(len(entries) * row_bytes))
    # No deadline (0): a loaded machine's pause (a garbage collection) must not turn a
    # round into an expired one with no drafts; this test is about what is drafted.
    frame = wire.encode_round_entries(round_id, 9, 0, entries, rows, row_bytes)
    return wire.decode_header(frame[: wire.HEADER.size]), frame[wire.HEADER.size :]


@pytest.fixture(scope="module")
def worker_pool():
    workers = []

    def make(drafter, window):
        w = Worker(drafter, "127.0.0.1", 0, window=window).start()  # its drafter thread drafts the rounds
        workers.append(w)
        return w

    yield make
    for w in workers:
        w.stop()


@settings(max_examples=60, deadline=None)
@given(
    model_i=st.integers(0, 1),
    window=st.integers(1, 5),
    num_spec=st.integers(1, 3),
    want_margin=st.booleans(),
    rounds=st.lists(ROUND, min_size=1, max_size=5),
)
def test_rounds_match_the_per_entry_reference(worker_pool, model_i, window, num_spec, want_margin, rounds):
    model = MODELS[model_i]
    drafter = RecordingDrafter(model)
    w = worker_pool(drafter, window)
    session = Session(9, MAX_SLOTS, num_spec, want_margin, Windows(MAX_SLOTS, window))
    ref = Reference(model, window, num_spec)
    for rid, drawn in enumerate(rounds, 1):
        entries = _entries(ref, drawn)
        width, statuses, contexts, drafts = ref.round(entries)
        drafter.contexts, drafter.positions = [], []
        hdr, payload = _frame(rid, entries)
        reply = w._round(session, hdr, payload)
        d = wire.decode_drafts(wire.decode_header(reply[: wire.HEADER.size]), reply[wire.HEADER.size :])
        assert d.round_id == rid and d.width == width
        assert list(d.slots) == [e.slot for e in entries]
        assert list(d.statuses) == statuses
        assert drafter.contexts == contexts
        assert drafter.positions == (ref.starts if contexts else [])
        assert (d.margins is not None) == want_margin
        for i, (tokens, margins) in enumerate(drafts):
            assert d.row(i) == tokens
            assert list(d.tokens[i * width : (i + 1) * width]) == tokens + [0] * (width - len(tokens))
            if want_margin:
                assert list(d.margins[i * width : (i + 1) * width]) == [float(np.float32(m)) for m in margins] + [
                    0.0
                ] * (width - len(margins))
        for slot in range(MAX_SLOTS):
            want = list(ref.slots[slot][0]) if slot in ref.slots else None
            assert session.windows.window_of(slot) == want
            if want is not None:
                assert session.windows.next_pos[slot] == ref.slots[slot][1]


class TableDrafter(RecordingDrafter):
    """A drafter whose model has ``max_positions`` positions."""

    def __init__(self, model, max_positions):
        super().__init__(model)
        self.max_positions = max_positions


@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(1, 5),
    num_spec=st.integers(1, 3),
    table=st.integers(6, 20),
    rounds=st.lists(ROUND, min_size=1, max_size=5),
)
def test_an_entry_past_the_position_table_gets_no_drafts_and_is_counted(worker_pool, window, num_spec, table, rounds):
    """An OK entry whose context (at its true position) and the round's width pass the
    drafter's position table is answered OK with no drafts, never shown to the drafter,
    and counted; the others are drafted as ever."""
    model = MODELS[0]
    drafter = TableDrafter(model, table)
    w = worker_pool(drafter, window)
    session = Session(9, MAX_SLOTS, num_spec, False, Windows(MAX_SLOTS, window))
    ref = Reference(model, window, num_spec)
    beyond = 0
    for rid, drawn in enumerate(rounds, 1):
        entries = _entries(ref, drawn)
        width, statuses, contexts, drafts = ref.round(entries)
        past = [bool(c) and start + len(c) + width > table for c, start in zip(contexts, ref.starts)]
        beyond += sum(past)
        drafter.contexts, drafter.positions = [], []
        reply = w._round(session, *_frame(rid, entries))
        d = wire.decode_drafts(wire.decode_header(reply[: wire.HEADER.size]), reply[wire.HEADER.size :])
        assert list(d.statuses) == statuses
        assert drafter.contexts == [c for c, p in zip(contexts, past) if not p]
        assert drafter.positions == [s for s, p in zip(ref.starts, past) if not p]
        ok_past = iter(past)
        for i, status in enumerate(statuses):
            want = drafts[i][0] if status == wire.STATUS_OK and not next(ok_past) else []
            assert d.row(i) == want
        assert w.stats.beyond_positions == beyond


@settings(max_examples=25, deadline=None)
@given(window=st.integers(1, 4), rounds=st.lists(ROUND, min_size=1, max_size=4))
def test_a_per_entry_drafter_gets_the_same_answers(worker_pool, window, rounds):
    """The slow path (PerEntryDrafter) answers like the batched Markov drafter, and its
    ``draft`` sees each entry's context and row."""
    seen = []

    class PerEntry:
        drafter_identity = b"d" * 32
        markov_identity = MODELS[1].identity

        def draft(self, context, n_out, row):
            seen.append((list(context), bytes(row)))
            return MODELS[1].draft(context, n_out)

    fast_w, slow_w = worker_pool(MarkovDrafter(MODELS[1]), window), worker_pool(PerEntry(), window)
    assert isinstance(slow_w._scheduler.drafter, PerEntryDrafter)
    fast = Session(9, MAX_SLOTS, 3, True, Windows(MAX_SLOTS, window))
    slow = Session(9, MAX_SLOTS, 3, True, Windows(MAX_SLOTS, window))
    ref = Reference(MODELS[1], window, 3)
    for rid, drawn in enumerate(rounds, 1):
        entries = _entries(ref, drawn)
        _, statuses, contexts, _ = ref.round(entries)
        seen.clear()
        hdr, payload = _frame(rid, entries)
        assert fast_w._round(fast, hdr, payload) == slow_w._round(slow, hdr, payload)
        ok = [i for i, s in enumerate(statuses) if s == wire.STATUS_OK]
        assert seen == [(c, bytes(range(3 * i, 3 * i + 3))) for c, i in zip(contexts, ok)]


@pytest.mark.parametrize(
    "slots,why",
    [
        ([0, 3, 0], r"slots\[2\]: slot 0 already named by entry 0"),
        ([1, MAX_SLOTS], rf"slots\[1\]: slot {MAX_SLOTS} outside"),
    ],
)
def test_bad_slots_are_protocol_errors_before_any_window_changes(worker_pool, slots, why):
    w = worker_pool(MarkovDrafter(MODELS[0]), 4)
    session = Session(9, MAX_SLOTS, 3, False, Windows(MAX_SLOTS, 4))
    w._round(session, *_frame(1, [wire.Entry(1, 2, 0, [1, 2], True)]))
    with pytest.raises(wire.ProtocolError, match=why):
        w._round(session, *_frame(2, [wire.Entry(s, 1, 9, [3], True) for s in slots]))
    assert session.windows.window_of(1) == [1, 2] and session.windows.window_of(0) is None


def test_long_new_gen_and_long_appends_keep_the_last_window_tokens(worker_pool):
    w = worker_pool(MarkovDrafter(MODELS[0]), 3)
    session = Session(9, MAX_SLOTS, 3, False, Windows(MAX_SLOTS, 3))
    w._round(session, *_frame(1, [wire.Entry(2, 0, 10, list(range(10)), True)]))
    assert session.windows.window_of(2) == [7, 8, 9] and session.windows.next_pos[2] == 20
    w._round(session, *_frame(2, [wire.Entry(2, 0, 20, [40, 41, 42, 43, 44])]))
    assert session.windows.window_of(2) == [42, 43, 44] and session.windows.next_pos[2] == 25
    w._round(session, *_frame(3, [wire.Entry(2, 0, 25, [])]))  # nothing accepted: same window
    assert session.windows.window_of(2) == [42, 43, 44]
    w._round(session, *_frame(4, []))  # an empty round is fine
    assert session.windows.window_of(2) == [42, 43, 44]

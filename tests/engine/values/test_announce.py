"""Long contexts announced in chunks (``engine.values.announce``): every round within its
budget, every context reaching a worker's windows whole and in order, the oldest request
first, and drafts asked for a slot only once its context is whole."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark.engine import Batch
from remote_dspark.engine.values.announce import Announcer
from remote_dspark.engine.values.meta import host_meta
from remote_dspark.worker.windows import Windows

SLOTS, CAP, K = 6, 16, 3


def plan(a: Announcer, w: Windows, budget: int, slots, tokens, positions, new_gen):
    """One batch planned within ``budget`` and applied to a worker's windows ``w``: the
    planned round."""
    b = Batch.from_lists(list(slots), [list(t) for t in tokens], list(positions), list(new_gen))
    meta = host_meta(b, max_slots=SLOTS, num_spec=K, max_tokens=1 << 20, n_out_default=K, context_tokens=CAP)
    p = a.plan(meta, CAP, budget)
    m = p.meta
    assert m.n_tokens <= budget, "a round over its budget"
    adv = w.advance(m.slots, m.positions, m.new_gen, m.offsets, m.tokens.astype(np.int32))
    assert adv.ok.all(), "an entry the worker answers RESYNC (a gap, or a slot it does not know)"
    return p


def test_the_oldest_request_goes_first_and_drafts_wait_for_a_whole_context():
    a, w, b = Announcer(SLOTS, CAP), Windows(SLOTS, CAP), 20
    ctx = {0: list(range(100, 112)), 1: list(range(200, 216)), 2: list(range(300, 310))}
    p = plan(a, w, b, [0, 1, 2], ctx.values(), [0, 0, 0], [True] * 3)
    assert p.meta.offsets.tolist() == [0, 12, 20, 20]  # 12 whole, 8 of 16, none (an empty NEW_GEN)
    assert p.meta.new_gen.tolist() == [True, True, True] and p.meta.n_out.tolist() == [K, 0, 0]
    assert p.announcing.tolist() == [1, 2] and a.pending == 2
    # The next round, its entries in another order: the whole slot's token first, then the
    # older requests (slot 1 came before slot 2), each continuing at its next position.
    p = plan(a, w, b, [2, 1, 0], [[310], [216], [112]], [10, 16, 12], [False] * 3)
    assert p.meta.positions.tolist() == [0, 8, 12] and not p.meta.new_gen.any()
    assert p.meta.offsets.tolist() == [0, 10, 19, 20]  # slot 2 gets what is left: 10 of its 11
    assert p.meta.n_out.tolist() == [0, K, K] and p.announcing.tolist() == [2]
    assert w.window_of(1) == (ctx[1] + [216])[-CAP:] and w.window_of(0) == ctx[0] + [112]
    p = plan(a, w, b, [2], [[311]], [11], [False])
    assert p.meta.positions.tolist() == [10] and p.meta.n_out.tolist() == [K]
    assert w.window_of(2) == ctx[2] + [310, 311] and a.pending == 0


def test_a_new_context_drops_what_its_slot_held_and_a_gap_goes_as_given():
    a, w, b = Announcer(SLOTS, CAP), Windows(SLOTS, CAP), 4
    plan(a, w, b, [0], [range(10)], [0], [True])
    assert a.pending == 1 and a.count[0] == 6
    p = plan(a, w, b, [0], [range(50, 53)], [7], [True])  # a new request on slot 0
    assert p.meta.new_gen.tolist() == [True] and p.meta.positions.tolist() == [7] and a.pending == 0
    plan(a, w, b, [1], [range(10)], [0], [True])
    p = a.plan(  # a continuing entry that does not follow what slot 1 holds
        host_meta(
            Batch.from_lists([1], [[9]], [40], [False]),
            max_slots=SLOTS, num_spec=K, max_tokens=99, n_out_default=K, context_tokens=CAP,
        ),
        CAP,
        b,
    )  # fmt: skip
    assert p.meta.positions.tolist() == [40] and p.meta.tokens.tolist() == [9] and a.pending == 0


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 40),
    st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(0, SLOTS - 1), st.booleans(), st.integers(0, 3 * CAP)), max_size=SLOTS),
            st.lists(st.integers(0, SLOTS - 1), max_size=2),  # slots whose requests end after the round
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_every_context_reaches_the_worker_whole_and_in_order(budget, steps):
    """Random batches (new contexts of any length, continuing entries of the tokens the
    target accepted, requests that skip rounds, requests that end mid-announcement) under
    a random budget: every round within it, no entry ever a gap for the worker, a slot
    asked for drafts exactly when its window holds the last tokens of everything the
    caller gave it (as the engine's window would without chunks), and a slot the engine
    frees let go (nothing of it held, never sent again), so once every request has ended
    nothing is pending."""
    a, w, b = Announcer(SLOTS, CAP), Windows(SLOTS, CAP), budget
    seq: dict[int, list[int]] = {}  # the caller's tokens of each slot since its NEW_GEN (cut)
    base: dict[int, int] = {}  # the position of seq[slot][0]
    nxt = 1000
    for step, ended in steps:
        step_round(a, w, b, step, seq, base, nxt)
        nxt += 10 * CAP * SLOTS
        for s in ended:  # the engine frees the slot: its next request comes NEW_GEN
            a.release([s])
            seq.pop(s, None)
            assert a.count[s] == 0 and a.state[s] == 0
        assert a.pending == int((a.count > 0).sum()) == int((a.state != 0).sum())
    a.release(range(SLOTS))  # every request ended: nothing is held, a round goes as it is
    assert a.pending == 0 and a.fits(1, 1)


def step_round(a: Announcer, w: Windows, b: int, step, seq: dict, base: dict, nxt: int) -> None:
    """One random batch of the property above, planned and checked against the worker."""
    batch = {}
    for slot, new, length in step:
        if slot in batch or (not new and slot not in seq):
            continue
        toks = list(range(nxt, nxt + (length if new else 1 + length % 3)))
        nxt += len(toks) + 1
        batch[slot] = (toks, new)
    if not batch:
        return
    slots = list(batch)
    positions = []
    for s in slots:
        toks, new = batch[s]
        positions.append(0 if new else base[s] + len(seq[s]))
        if new:  # at position 0, cut to its last CAP: its first token sent is at len - CAP
            seq[s], base[s] = toks[-CAP:], max(len(toks) - CAP, 0)
        else:
            seq[s] = seq[s] + toks
    p = plan(a, w, b, slots, [batch[s][0] for s in slots], positions, [batch[s][1] for s in slots])
    whole = (p.meta.n_out > 0).tolist()
    for s, drafted in zip(slots, whole):
        window, end = w.window_of(s), int(w.next_pos[s]) - base[s]
        assert window == seq[s][max(end - len(window), 0) : end], f"slot {s}: its window out of order"
        if drafted:
            assert end == len(seq[s]) and window == seq[s][-CAP:], f"slot {s}: drafted before it is whole"
    assert set(p.announcing.tolist()) == {s for s, d in zip(slots, whole) if not d}

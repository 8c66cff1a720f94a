"""The torch model drafter (remote_dspark.drafter.lm): batched drafts against one entry
at a time, the KV cache against re-encoding through the worker's own windows, the cache's
bound, identities, the HELLO's vocabulary rule, the model's position table, the command line.
CPU float32 throughout."""

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, until
from hypothesis import given, settings
from hypothesis import strategies as st
from lm_common import STREAM_ROUNDS, Engine, Streams, agreeing_prefix, assert_same_drafts, batch_of, connect, hello

from remote_dspark import wire
from remote_dspark.cli import worker as worker_cli
from remote_dspark.drafter.lm import drafter as drafter_module
from remote_dspark.drafter.lm import pool as pool_module
from remote_dspark.drafter.lm.cache import PROTECT_CALLS, SlotCache
from remote_dspark.drafter.lm.drafter import LMDrafter
from remote_dspark.drafter.lm.model import LMConfig, TinyLM
from remote_dspark.drafter.lm.pool import BLOCK, MIN_SCRATCH, KVStore
from remote_dspark.transport import Disconnected
from remote_dspark.transport.client import Refused
from remote_dspark.worker import Worker
from remote_dspark.worker.batching import merge, part
from remote_dspark.worker.drafters import load_drafter
from remote_dspark.worker.scheduler import Scheduler

ROOT = Path(REPO)
PLAIN = LMDrafter(device="cpu", cache_slots=0, window=16)  # re-encodes every round

# --- batched against one entry at a time ---------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.tuples(st.lists(st.integers(0, 127), max_size=30), st.integers(0, 4)), min_size=1, max_size=6),
    st.integers(1, 4),
)
def test_batched_drafts_equal_greedy_decoding_one_entry_at_a_time(entries, width):
    contexts = [c for c, _ in entries] + [[7]]  # a length-1 context in every batch
    n_out = [min(k, width) for _, k in entries] + [width]
    got = PLAIN.draft_batch(batch_of(contexts, n_out, width))
    assert got.tokens.shape == (len(contexts), width) and got.margins.dtype == np.float32
    for i, (context, k) in enumerate(zip(contexts, n_out)):
        want = k if context else 0  # an empty context gets no drafts
        assert got.counts[i] == want
        assert not got.tokens[i, want:].any() and not got.margins[i, want:].any()
        if want:
            tokens, margins = PLAIN.greedy_one(context, want)
            a, b = agreeing_prefix(tokens, margins, got.tokens[i, :want].tolist())
            assert a == b, f"entry {i}: context {context}"
            k_tie = len(a)
            np.testing.assert_allclose(got.margins[i, :k_tie], margins[:k_tie], atol=1e-4)
    assert ((got.margins >= 0) & (got.margins <= 1)).all()


def test_no_margins_unless_asked_and_an_empty_batch():
    assert PLAIN.draft_batch(batch_of([[1, 2]], [2], 2, want_margin=False)).margins is None
    empty = PLAIN.draft_batch(batch_of([], [], 3))
    assert empty.tokens.shape == (0, 3) and len(empty.counts) == 0


# --- the cache against re-encoding, through the worker's own windows -----------------------


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded"])
def test_the_cache_drafts_what_re_encoding_drafts_across_rounds_new_gen_resync_and_sessions(graphs):
    """Also on the padded shapes the GPU's graphs use (run eagerly here): what a row holds
    from earlier rounds past an entry's positions, and what padding writes, is never read."""
    window, width = 12, 3
    cached = LMDrafter(device="cpu", cache_slots=4, window=window, graphs=graphs)  # 6 slots, 4 rows: evictions too
    rng = np.random.default_rng(5)
    engine, had, known = Engine(window), {}, set()
    compared = 0
    for rnd in range(60):
        if rnd in (25, 45):  # a new session (a respawned proxy): nothing carries over
            engine, had, known = Engine(window), {}, set()
        entries = []
        for slot in rng.choice(6, size=rng.integers(1, 5), replace=False).tolist():
            grow = int(rng.integers(0, 4))
            if slot not in known or had[slot] + grow > window or rng.random() < 0.1:
                ctx = rng.integers(0, 128, int(rng.integers(1, window + 1))).tolist()
                entries.append((slot, ctx, True, False))  # NEW_GEN
                had[slot] = len(ctx)
                known.add(slot)
            elif rng.random() < 0.08:
                entries.append((slot, [1], False, True))  # a gap: RESYNC, the slot forgotten
                known.discard(slot)
            else:
                entries.append((slot, rng.integers(0, 128, grow).tolist(), False, False))
                had[slot] += grow
        batch, ok = engine.batch(entries, width)
        assert all(ok[i] == (not e[3]) for i, e in enumerate(entries))
        if len(batch):
            assert int(batch.lengths.max()) <= window  # every stream within its window
            assert_same_drafts(cached.draft_batch(batch), PLAIN.draft_batch(batch))
            compared += len(batch)
    info = cached.cache_info()
    assert compared > 100 and info.hits > 30 and info.misses > 10
    assert info.slots <= info.capacity == 4


def block_bytes(d: LMDrafter) -> int:
    return d.store.block_bytes()


def pooled(blocks, **kw) -> LMDrafter:
    """A CPU drafter (``kw``: LMDrafter's) whose pool holds ``blocks`` blocks: an int, or
    of the drafter's store (its ``max_blocks``: a whole stream's) when callable."""
    shape = {k: kw[k] for k in ("window", "max_context") if k in kw}
    probe = LMDrafter(device="cpu", cache_slots=1, **shape).store
    n = blocks(probe) if callable(blocks) else blocks
    return LMDrafter(device="cpu", kv_bytes=n * probe.block_bytes(), **kw)


def one_stream(store) -> int:
    """A pool of one whole stream and the trash block."""
    return store.max_blocks + 1


def small_store(rows: int, blocks: int = 64, columns: int = 64) -> KVStore:
    """A pool of ``blocks`` one-float blocks (the bookkeeping's tests need no model)."""
    return KVStore(blocks, rows, columns, 1, 1, 1)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded"])
@settings(max_examples=15, deadline=None)
@given(rounds=STREAM_ROUNDS, blocks=st.integers(7, 12))
def test_every_draft_equals_a_fresh_encode_of_the_whole_stream_at_its_true_positions(graphs, rounds, blocks):
    """Streams through a real ``Windows`` and a worker's whole-stream reader (appends,
    NEW_GENs anywhere in a sequence, gaps that RESYNC, streams far past the 6-token
    window), three cache rows for four slots and a pool of a few blocks: streams are
    evicted and re-encoded from the worker's tokens, and every entry drafted drafts what
    encoding its stream's whole sequence afresh at its true positions drafts. An entry
    left without blocks (a round whose streams pass the pool) gets no drafts."""
    window, width = 6, 2
    cached = pooled(blocks, cache_slots=3, window=window, max_context=32, graphs=graphs)
    streams = Streams(window, whole=True)
    for ops in rounds:
        batch = streams.round(ops, width)
        got = cached.draft_batch(batch)
        for i in range(len(batch)):
            if not got.counts[i]:
                continue
            first, seq = streams.span(int(batch.slots[i]))
            tokens, margins = PLAIN.greedy_one(seq, width, first)
            a, b = agreeing_prefix(tokens, margins, got.tokens[i].tolist())
            assert a == b, f"entry {i}"
    info = cached.cache_info()
    assert info.blocks_used + info.blocks_free == blocks - 1  # the trash block is never a stream's


def test_a_stream_far_past_its_window_drafts_from_its_whole_sequence_kept_in_its_blocks():
    """One stream of 200 tokens through a 4-token window: every round a hit (only the new
    tokens encoded), its blocks growing with it, and its drafts what a fresh encode of all
    200 tokens drafts. A pool of one whole stream: another stream's 300 tokens evict it,
    and it is re-encoded whole from the worker's tokens, evicting the other in turn."""
    window, width = 4, 3
    cached = pooled(one_stream, cache_slots=2, window=window)
    streams = Streams(window, max_slots=2, whole=True)
    rng = np.random.default_rng(1)
    streams.round([(0, "new_gen", 7, [3, 4])], width)
    cached.draft_batch(streams.round([(0, "append", 0, [5])], width))
    for _ in range(66):
        batch = streams.round([(0, "append", 0, rng.integers(0, 128, 3).tolist())], width)
        got = cached.draft_batch(batch)

    def fresh(slot):
        first, seq = streams.span(slot)
        return PLAIN.draft_batch(batch_of([seq], [width], width, positions=np.array([first])))

    assert len(streams.span(0)[1]) == 201 and cached.cache.held(batch.session, 0) == (7, 201)
    assert_same_drafts(got, fresh(0))
    info = cached.cache_info()
    assert info.hits == 66 and info.blocks_used == -(-(201 + width) // BLOCK)
    other = streams.round([(1, "new_gen", 0, rng.integers(0, 128, 14).tolist())], width)
    cached.draft_batch(other)
    for _ in range(96):  # slot 1 grows to 302 tokens: slot 0's KV evicted for its blocks
        cached.draft_batch(streams.round([(1, "append", 0, rng.integers(0, 128, 3).tolist())], width))
    info = cached.cache_info()
    assert info.evicted == 1 and cached.cache.held(batch.session, 0) is None
    assert info.blocks_used == -(-(302 + width) // BLOCK)
    reads = streams.engine.whole.reads
    batch = streams.round([(0, "append", 0, [9])], width)
    assert_same_drafts(cached.draft_batch(batch), fresh(0))  # re-encoded from the worker's 202 tokens
    assert streams.engine.whole.reads == reads + 1 and cached.cache_info().evicted == 2


def test_a_long_row_beside_a_long_re_encode_stays_within_the_models_positions():
    """Padding of a hit with a large base never reaches past the learned positions."""
    d = LMDrafter(TinyLM(LMConfig(max_positions=64)), device="cpu", cache_slots=2, window=24)  # 64-token rows
    ctx = list(range(24))

    def round_of(lengths, gens):
        return d.draft_batch(
            batch_of(
                [ctx] * 2,
                [2, 2],
                2,
                session=1,
                slots=np.arange(2),
                gens=np.array(gens, np.int64),
                lengths=np.array(lengths, np.int64),
            )
        )

    round_of([24, 24], [1, 1])
    for length in range(30, 62, 6):  # slot 0 appends (its base grows), slot 1 is re-encoded
        assert round_of([length, 24], [1, length]).counts.tolist() == [2, 2]
    assert d.cache_info().hits == 6


def test_the_cache_keeps_its_bound_and_drops_the_least_recently_used():
    """Three cache rows hold three streams; a round of more entries than rows drafts the
    one left without in a scratch row of the table (MIN_SCRATCH of them, made once), its
    blocks given back after the round. The pool's memory never changes."""
    d = LMDrafter(device="cpu", cache_slots=3, window=8)
    size = d.cache_info().bytes
    c = LMConfig()
    blocks = max(3, MIN_SCRATCH) * d.columns // BLOCK + 1  # the default pool: every stream whole
    assert size == blocks * c.n_layers * 2 * c.n_heads * BLOCK * c.head_dim * 4

    def round_of(slots, lengths):
        n = len(slots)
        b = batch_of(
            [[5] * k for k in lengths],
            [2] * n,
            2,
            session=1,
            slots=np.array(slots, np.int64),
            gens=np.ones(n, np.int64),
            lengths=np.array(lengths, np.int64),
        )
        before = d.cache_info()
        d.draft_batch(b)
        after = d.cache_info()
        assert after.slots <= after.capacity == 3
        return after.hits - before.hits, after.misses - before.misses

    for slot in range(3):
        assert round_of([slot], [2]) == (0, 1)
    assert round_of([1], [3]) == (1, 0)  # slot 1 used again: 0 is now the oldest
    assert round_of([3], [2]) == (0, 1)  # a newcomer takes slot 0's row
    assert round_of([0], [3]) == (0, 1)  # gone: encoded from the start
    assert round_of([1, 3], [4, 3]) == (2, 0)
    assert d.cache_info().bytes == size
    assert round_of([0, 1, 2, 3], [4, 5, 3, 4]) == (3, 1)  # more entries than rows: one left without
    assert d.cache_info().slots == 3 and d.store.rows == 3 + MIN_SCRATCH
    assert round_of([0, 1, 2, 3], [5, 6, 4, 5]) == (3, 1)  # the scratch rows are kept
    assert d.store.rows == 3 + MIN_SCRATCH and d.cache_info().bytes == size
    assert d.cache_info().blocks_used == 3  # the three streams' blocks; the scratch row's went back


def test_a_pool_over_the_free_memory_or_under_one_stream_is_refused_naming_the_flag(monkeypatch):
    """The pool is allocated at start: more than the device's free memory, or too few
    blocks for one whole stream, stops the drafter there, naming --lm-kv-mb."""
    probe = LMDrafter(device="cpu", cache_slots=1, window=8)
    with pytest.raises(ValueError, match=r"^a KV pool of 3 blocks .*--lm-kv-mb.* cannot hold one whole stream"):
        LMDrafter(device="cpu", cache_slots=1, window=8, kv_bytes=3 * probe.store.block_bytes())
    monkeypatch.setattr(pool_module, "memory_free", lambda device: 1000)
    with pytest.raises(ValueError, match=r"^a KV pool of [\d,]+ MiB \(--lm-kv-mb\) needs more than the 0 MiB free"):
        LMDrafter(device="cpu", cache_slots=1, window=8, kv_bytes=1 << 24)


def test_a_round_whose_streams_pass_the_pool_runs_in_waves_and_drafts_every_entry():
    """A pool of one whole stream and one block more, two streams of five blocks each in
    one round: the round runs in two waves, the second evicting the first's stream, and
    both draft what a fresh encode drafts; so does a drafter without a cache whose round
    of 40 entries passes its pool many times over."""
    d = pooled(lambda store: store.max_blocks + 2, cache_slots=2, window=8, max_context=32)
    ctx = [list(range(1, 71)), list(range(3, 73))]  # 70 tokens and 2 drafts: 5 blocks each
    both = dict(session=1, slots=np.arange(2), gens=np.ones(2, np.int64), lengths=np.array([70, 70], np.int64))
    got = d.draft_batch(batch_of(ctx, [2, 2], 2, **both))
    assert [got.tokens[i].tolist() for i in range(2)] == [PLAIN.greedy_one(c, 2)[0] for c in ctx]
    assert d.cache_info().evicted == 1 and d.cache_info().blocks_used == -(-72 // BLOCK)
    rng = np.random.default_rng(2)
    many = [rng.integers(0, 128, 40).tolist() for _ in range(40)]
    uncached = pooled(lambda store: store.max_blocks + 2, cache_slots=0, window=8, max_context=32)
    assert_same_drafts(
        uncached.draft_batch(batch_of(many, [2] * 40, 2)), PLAIN.draft_batch(batch_of(many, [2] * 40, 2))
    )
    assert uncached.cache_info().blocks_used == 0


def test_another_engines_guarded_streams_never_fail_a_round_that_needs_their_blocks():
    """A pool of one whole stream: engine 1's stream, hot and within its share, and engine
    2's fill it; engine 2's new 64-token stream needs blocks only engine 1 holds. The guard
    is a preference: the round evicts engine 1's stream rather than fail, and drafts what
    a fresh encode drafts (an attacker within its share once failed other engines' rounds
    so, and every round merged with them)."""
    d = pooled(one_stream, cache_slots=4, window=8, max_context=64)
    rng = np.random.default_rng(0)
    ctx = {(s, slot): rng.integers(0, 128, n).tolist() for s, slot, n in ((1, 0, 50), (2, 0, 50), (2, 1, 64))}

    def round_of(session, slots, lengths):
        n = len(slots)
        contexts = [ctx[session, slot][:length] for slot, length in zip(slots, lengths)]
        stream = dict(slots=np.array(slots), gens=np.ones(n, np.int64), lengths=np.array(lengths, np.int64))
        return d.draft_batch(batch_of(contexts, [3] * n, 3, session=session, **stream))

    round_of(1, [0], [49])
    round_of(2, [0], [50])
    round_of(1, [0], [50])  # engine 1 hits: hot, within its share
    got = round_of(2, [0, 1], [50, 64])  # its own stream, and a new one needing engine 1's blocks
    assert got.counts.tolist() == [3, 3]
    assert got.tokens[1].tolist() == PLAIN.greedy_one(ctx[2, 1], 3)[0]
    assert d.cache.held(1, 0) is None and d.cache_info().evicted >= 1


def test_a_round_whose_own_streams_hold_the_pool_drafts_its_first_and_lets_the_others_go():
    """A pool of one whole stream (8 blocks) held by one engine's two streams of 4 blocks,
    both growing past them in one round: nothing else to evict, so the first entry runs and
    the second gets no drafts, its blocks given back; next round it is re-encoded whole."""
    d = pooled(one_stream, cache_slots=4, window=8, max_context=64)
    rng = np.random.default_rng(1)
    ctx = [rng.integers(0, 128, 62).tolist() for _ in range(2)]

    def round_of(slots, length):
        n = len(slots)
        stream = dict(slots=np.array(slots), gens=np.ones(n, np.int64), lengths=np.full(n, length, np.int64))
        return d.draft_batch(batch_of([ctx[s][:length] for s in slots], [3] * n, 3, session=1, **stream))

    assert round_of([0, 1], 50).counts.tolist() == [3, 3]  # 53 columns each: 4 blocks
    got = round_of([0, 1], 62)  # 65 columns each: 5 blocks, 10 in all
    assert got.counts.tolist() == [3, 0] and got.tokens[0].tolist() == PLAIN.greedy_one(ctx[0], 3)[0]
    assert d.cache.held(1, 1) is None
    got = round_of([1], 62)
    assert got.counts.tolist() == [3] and got.tokens[0].tolist() == PLAIN.greedy_one(ctx[1], 3)[0]


def test_token_ids_past_the_models_vocabulary_are_drafted_from_never_indexed():
    """An engine's vocabulary may be larger than the drafter's (the same tokenizer), and a
    peer may send any int32: such ids are read as the model's last id, so the call never
    raises (it would fail every round merged into it) and the other entries draft as alone."""
    d = LMDrafter(device="cpu", cache_slots=4, window=8)
    ok, odd = [5, 9, 14], [5, 5000, -7, 14]
    got = d.draft_batch(
        batch_of(
            [ok, odd],
            [3, 3],
            3,
            session=1,
            slots=np.arange(2),
            gens=np.ones(2, np.int64),
            lengths=np.array([3, 4], np.int64),
        )
    )
    assert got.counts.tolist() == [3, 3]
    assert got.tokens[0].tolist() == PLAIN.greedy_one(ok, 3)[0]
    assert got.tokens[1].tolist() == PLAIN.greedy_one([5, 127, 0, 14], 3)[0]


@settings(max_examples=8, deadline=None)
@given(rounds=STREAM_ROUNDS, other=STREAM_ROUNDS)
def test_two_sessions_drafted_in_one_call_draft_what_each_drafts_alone(rounds, other):
    """The worker's scheduler merges engines' rounds into one call (a session per entry):
    the model drafter, its cache keyed per stream, drafts each session's entries as a
    drafter serving that session alone does (up to float rounding: wherever the choice
    is clear). Rows for every stream on both sides: an eviction changes a row's history
    past the window, and with it the drafts, whoever shares the cache."""
    window, width = 6, 2
    shared = LMDrafter(device="cpu", cache_slots=8, window=window)  # two sessions of 4 slots
    alone = [shared.sibling(4), shared.sibling(4)]
    streams = [Streams(window), Streams(window)]
    for ops in zip(rounds, other):
        batches = [s.round(o, width) for s, o in zip(streams, ops)]
        if not all(len(b) for b in batches):
            continue
        merged = merge(batches)
        assert len(set(merged.sessions().tolist())) == 2
        result = shared.draft_batch(merged)
        start = 0
        for b, own in zip(batches, alone):
            got, want = part(result, start, b), own.draft_batch(b)
            start += len(b)
            for i in range(len(b)):
                ref, _ = agreeing_prefix(want.tokens[i], want.margins[i], got.tokens[i])
                assert got.tokens[i][: len(ref)].tolist() == list(ref)


def test_a_round_of_two_sessions_never_gives_one_row_to_two_entries():
    """Four streams of two sessions in one round over three rows: three get a row each,
    distinct (a later session's newcomer never takes a row an earlier session's entry
    took this round), and one drafts without."""
    cache = SlotCache(small_store(3))
    n = np.ones(4, np.int64)
    plan = cache.plan(np.array([1, 1, 2, 2]), np.array([0, 1, 0, 1]), n, n * 2, n * 2, n * 0, 2, None)
    rows = plan.rows[plan.rows >= 0]
    assert len(rows) == 3 and len(set(rows.tolist())) == 3
    again = cache.plan(np.array([2, 2, 1, 1]), np.array([0, 1, 0, 1]), n, n * 3, n * 3, n * 0, 2, None)
    assert len(set(again.rows[again.rows >= 0].tolist())) == (again.rows >= 0).sum() == 3


def test_a_round_over_the_workers_budget_is_drafted_in_pieces_within_its_reserved_rows(monkeypatch):
    """A drafter without a cache under a worker's budget of 16 entries: its scratch rows
    are reserved at start (16), a round of 40 entries is drafted in pieces and the table
    never grows; the drafts are what one call over all 40 drafts (up to float rounding).
    A budget over the free memory stops the worker at start, naming the flag."""
    d = LMDrafter(device="cpu", cache_slots=0, window=8)
    s = Scheduler(d, max_entries=16, max_tokens=1 << 15)
    s.reserve()
    reserved = d.cache_info().bytes
    assert d.store.rows == 16
    rng = np.random.default_rng(4)
    batch = batch_of([rng.integers(0, 128, 6).tolist() for _ in range(40)], [3] * 40, 3)
    s.start()
    try:
        got = s.draft(1, batch)
    finally:
        s.stop()
    assert d.store.rows == 16 and d.cache_info().bytes == reserved
    assert d.cache_info().blocks_used == 0  # every scratch row's blocks went back
    want = LMDrafter(device="cpu", cache_slots=0, window=8).draft_batch(batch)
    for i in range(40):
        ref, _ = agreeing_prefix(want.tokens[i], want.margins[i], got.tokens[i])
        assert got.tokens[i][: len(ref)].tolist() == list(ref)
    over = Scheduler(LMDrafter(device="cpu", cache_slots=0, window=8), max_entries=64, max_tokens=4096)
    monkeypatch.setattr(drafter_module, "memory_free", lambda device: 1000)
    refusal = r"^--max-batch-entries 64, --max-batch-tokens 4096: a call of 64 entries and 4096 tokens needs"
    with pytest.raises(ValueError, match=refusal):
        over.reserve()


# --- identity, vocabulary, the HELLO -------------------------------------------------------


def test_identity_is_deterministic_and_changes_with_a_weight():
    d = LMDrafter(device="cpu", cache_slots=0)
    assert d.drafter_identity == LMDrafter(device="cpu", cache_slots=0).drafter_identity == TinyLM().identity()
    assert len(d.drafter_identity) == 32 and d.markov_identity == bytes(32) and d.vocab_size == 128
    model = TinyLM()
    with torch.no_grad():
        model.blocks[1].fc2.weight[0, 0] += 1e-3
    assert model.identity() != d.drafter_identity
    assert TinyLM(LMConfig(seed=1)).identity() != d.drafter_identity


def test_a_worker_refuses_an_engine_with_a_smaller_vocabulary_and_serves_the_same_one():
    d = LMDrafter(device="cpu", cache_slots=8, window=8)
    with Worker(d, "127.0.0.1", 0, window=8) as w:
        with pytest.raises(Refused, match="vocabulary .* 128 tokens, over the engine's 100") as e:
            connect(w.port, hello(d, vocab_size=100))
        assert e.value.code == wire.REFUSE_DRAFTER
        c = connect(w.port, hello(d, vocab_size=128))
        try:
            entries = [wire.Entry(2, 3, 0, (1, 2, 3), new_gen=True), wire.Entry(5, 1, 0, (9,), new_gen=True)]
            got = c.round(1, [wire.encode_round_entries(1, 1, 1000, entries, b"", 0)], 5000)
            assert got.row(0) == d.greedy_one([1, 2, 3], 3)[0] and got.row(1) == d.greedy_one([9], 1)[0]
            got = c.round(2, [wire.encode_round_entries(2, 1, 1000, [wire.Entry(2, 3, 3, (4,))], b"", 0)], 5000)
            assert got.row(0) == d.greedy_one([1, 2, 3, 4], 3)[0]
        finally:
            c.close()
    assert d.cache_info().hits == 1


def test_a_hello_wider_than_a_row_holds_is_refused_and_a_drafter_failure_is_counted():
    """num_spec over the drafter's max_width (what a row holds past a window) is refused at
    HELLO, naming it; a round whose drafting raises costs its connection, counted."""
    d = LMDrafter(device="cpu", cache_slots=8, window=40, max_context=32)  # streams of 96 columns: max_width 56
    assert d.max_width == d.columns - 40 == 56
    with Worker(d, "127.0.0.1", 0, window=40) as w:
        with pytest.raises(Refused, match="num_spec 57 is over the drafter's 56") as e:
            connect(w.port, hello(d, num_spec=57))
        assert e.value.code == wire.REFUSE_LIMITS and w.statistics().refusals["limits"] == 1
        c = connect(w.port, hello(d, num_spec=56))
        d.draft_batch = lambda batch: 1 / 0  # a drafter's bug
        try:
            with pytest.raises(Disconnected):
                c.round(
                    1, [wire.encode_round_entries(1, 1, 1000, [wire.Entry(2, 3, 0, (1,), new_gen=True)], b"", 0)], 5000
                )
        finally:
            c.close()
        assert until(lambda: w.statistics().round_failures == 1)


def test_a_row_kept_short_by_a_wide_round_is_not_a_hit():
    """A row re-encoded for a wide round keeps only the tokens that left room for it; a
    narrower round next must not draft from that shorter history (it re-encodes)."""
    window = 64
    cached = LMDrafter(device="cpu", cache_slots=4, window=window, max_context=32)  # streams of 96 columns
    engine = Engine(window)
    ctx = list(range(3, 63))  # 60 tokens: a stream for a width of 40 keeps 56
    first, _ = engine.batch([(0, ctx, True, False)], 40)
    assert cached.draft_batch(first).counts.tolist() == [40]
    second, _ = engine.batch([(0, [20], False, False)], 2)
    assert_same_drafts(cached.draft_batch(second), PLAIN.draft_batch(second))
    assert cached.cache_info().hits == 0


# --- load_drafter and the command line -----------------------------------------------------


def test_load_drafter_builds_the_model_drafters_and_names_bad_flags(tmp_path):
    d = load_drafter("lm", lm_device="cpu", lm_cache_slots=5, window=8)
    assert isinstance(d, LMDrafter) and d.cache_info().capacity == 5 and d.columns == d.max_context == 512
    assert load_drafter("lm", identity=b"i" * 32, lm_device="cpu", lm_cache_slots=0).drafter_identity == b"i" * 32
    assert load_drafter("lm", lm_device="cpu", lm_cache_slots=0).cache_info().capacity == 0
    with pytest.raises(ValueError, match="--lm-cache-slots -1"):
        load_drafter("lm", lm_cache_slots=-1)
    with pytest.raises(ValueError, match="--lm-device 'tpu'"):
        load_drafter("lm", lm_device="tpu")
    with pytest.raises(ValueError, match="window 600 .--window.: the model has 512 positions"):
        load_drafter("lm", lm_device="cpu", window=600)
    d = load_drafter("lm", lm_device="cpu", lm_cache_slots=2, max_context=100, lm_kv_mb=1, window=8)
    assert (d.max_context, d.columns, d.max_width) == (100, 176, 64)
    assert d.cache_info().bytes == (1 << 20) // d.store.block_bytes() * d.store.block_bytes()
    with pytest.raises(ValueError, match="--lm-kv-mb 0: must be >= 1"):
        load_drafter("lm", lm_device="cpu", lm_kv_mb=0, window=8)
    with pytest.raises(ValueError, match=r"--max-context 0: not in 1\.\."):
        load_drafter("lm", lm_device="cpu", max_context=0, window=8)
    # tables over the free memory are refused before anything is allocated, naming the flag
    with pytest.raises(ValueError, match=r"block tables of 1000000000000 streams \(--lm-cache-slots\)"):
        load_drafter("lm", lm_device="cpu", lm_cache_slots=10**12, window=8)
    with pytest.raises(ValueError, match="--markov"):
        load_drafter("lm", "some.markov")
    with pytest.raises(ValueError, match="--hf-model .* --drafter 'mod:f'"):
        load_drafter("mod:f", hf_model=str(tmp_path))
    with pytest.raises(ValueError, match=f"--hf-model '{tmp_path / 'none'}'.*not a local directory"):
        load_drafter(None, hf_model=str(tmp_path / "none"))
    assert load_drafter("markov").markov_identity != bytes(32)


def test_worker_cli_refuses_bad_model_flags_naming_them():
    parser = argparse.ArgumentParser()
    worker_cli.add_parser(parser.add_subparsers())
    for flags, name in (
        (["--lm-cache-slots", "-2"], "--lm-cache-slots"),
        (["--lm-device", "gpu"], "--lm-device"),
        (["--lm-kv-mb", "0"], "--lm-kv-mb"),
        (["--max-context", "0"], "--max-context"),
    ):
        args = parser.parse_args(["worker", "--listen", "127.0.0.1:0", "--drafter", "lm", *flags])
        with pytest.raises(ValueError, match=name):
            worker_cli.run(args)


def lines_of(proc) -> "queue.Queue[str]":
    """The process's stdout lines, read on a thread (so every wait for one is bounded)."""
    q: queue.Queue[str] = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return q


@pytest.mark.slow
def test_worker_command_with_the_lm_drafter_serves_a_round():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "remote_dspark",
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--drafter",
            "lm",
            "--lm-device",
            "cpu",
            "--lm-cache-slots",
            "8",
            "--window",
            "16",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        q = lines_of(proc)
        lines = [q.get(timeout=60) for _ in range(3)]
        assert lines[0].startswith("remote-dspark worker listening on tcp://127.0.0.1:")
        d = LMDrafter(device="cpu", cache_slots=0)
        assert lines[1].strip() == f"VLLM_DSPARK_REMOTE_IDENTITY={d.drafter_identity.hex()}"
        assert lines[2].strip() == f"VLLM_DSPARK_REMOTE_MARKOV_IDENTITY={'00' * 32}"
        c = connect(int(lines[0].rsplit(":", 1)[1]), hello(d, vocab_size=128))
        got = c.round(1, [wire.encode_round_entries(1, 1, 1000, [wire.Entry(0, 2, 0, (5, 6), True)], b"", 0)], 10000)
        assert got.row(0) == d.greedy_one([5, 6], 2)[0]
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


@pytest.mark.gpu
def test_on_cuda_in_bf16_the_cache_drafts_what_re_encoding_drafts_and_the_cpu_agrees_on_clear_choices():
    """The CUDA path (bf16 model and store, the rounds as CUDA graphs): cached rounds
    through the worker's windows draft what eager re-encoding drafts on the same device,
    and what the CPU float32 drafter drafts wherever its choice is clear (bf16's rounding
    may flip a choice whose margin is small)."""
    window, width = 16, 4
    cuda = LMDrafter(device="cuda", cache_slots=8, window=window)
    plain = LMDrafter(device="cuda", cache_slots=0, window=window, graphs=False)
    assert cuda._rounds.capture and not plain._rounds.capture and not plain._rounds.padded
    assert cuda.dtype == torch.bfloat16 and cuda.drafter_identity == PLAIN.drafter_identity
    rng = np.random.default_rng(9)
    engine, had = Engine(window), {}
    agree = compared = 0
    for _ in range(20):
        entries = []
        for slot in range(6):
            if slot not in had or had[slot] + 3 > window:
                ctx = rng.integers(0, 128, 8).tolist()
                entries.append((slot, ctx, True, False))
                had[slot] = len(ctx)
            else:
                entries.append((slot, rng.integers(0, 128, 3).tolist(), False, False))
                had[slot] += 3
        batch, _ = engine.batch(entries, width)
        got, same_device, cpu = cuda.draft_batch(batch), plain.draft_batch(batch), PLAIN.draft_batch(batch)
        assert got.counts.tolist() == same_device.counts.tolist() == cpu.counts.tolist()
        for i in range(len(batch)):
            k = next((j for j, m in enumerate(cpu.margins[i]) if m <= 0.05), width)
            agree += got.tokens[i, :k].tolist() == cpu.tokens[i, :k].tolist()
            compared += 1
            j = next((j for j, m in enumerate(same_device.margins[i]) if m <= 0.02), width)
            assert got.tokens[i, :j].tolist() == same_device.tokens[i, :j].tolist()
    assert cuda.cache_info().hits > 50 and cuda._rounds.graphs  # replayed graphs drafted them
    assert agree >= 0.95 * compared


def test_an_entry_past_the_models_positions_gets_no_drafts_counted_and_the_rest_are_drafted():
    """The built-in model of 64 positions: an entry whose context ends within them with
    room for the round's drafts is drafted at its true positions; one whose drafts would
    pass them is answered with none (never wrapped), and counted in the worker's metric."""
    from helpers import value

    d = LMDrafter(TinyLM(LMConfig(max_positions=64)), device="cpu", cache_slots=4, window=16)
    ctx, late = list(range(10, 20)), list(range(30, 37))
    with Worker(d, "127.0.0.1", 0, window=16, metrics_port=0) as w:
        c = connect(w.port, hello(d, vocab_size=128))
        try:
            entries = [wire.Entry(0, 3, 40, tuple(ctx), new_gen=True), wire.Entry(1, 3, 55, tuple(late), new_gen=True)]
            got = c.round(1, [wire.encode_round_entries(1, 1, 1000, entries, b"", 0)], 5000)
            assert list(got.statuses) == [wire.STATUS_OK] * 2  # ends at 50 + 3 drafts; at 62 + 3 > 64
            assert got.row(0) == d.greedy_one(ctx, 3, 40)[0] and got.row(1) == []
            more = tuple(range(50, 62))
            got = c.round(2, [wire.encode_round_entries(2, 1, 1000, [wire.Entry(0, 3, 50, more)], b"", 0)], 5000)
            assert list(got.statuses) == [wire.STATUS_OK] and got.row(0) == []
            # (a served round is counted just after its reply goes out: waited for, bounded)
            assert until(lambda: w.statistics().beyond_positions == 2)
            with urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=5) as r:
                text = r.read().decode()
        finally:
            c.close()
        assert value(text, "dspark_worker_entries_beyond_positions_total") == 2
    with pytest.raises(ValueError, match="pass the model's 64 positions"):  # the drafter alone: never wrapped
        d.draft_batch(batch_of([late], [3], 3, positions=np.array([55], np.int64)))


def test_a_flood_of_streams_that_never_hit_takes_its_own_rows_not_a_drafting_engines():
    """Four cache rows, two engines: an honest one whose two streams hit round after round,
    and a storm of 6 slots sending NEW_GEN every round (a new generation each time: never
    a hit). The storm's newcomers take the rows beyond the honest engine's share (its own,
    least recently used first) and the rest draft from scratch rows; the honest streams
    keep theirs and go on hitting. Once the honest engine stops, its rows go cold and the
    storm takes them after PROTECT_CALLS calls."""
    cache = SlotCache(small_store(4))
    two = np.ones(2, np.int64)

    def honest(length):
        return cache.plan(two, np.arange(2), two, length * two, 8 * two, length * two - 8, 2, None)

    def storm(gen):
        six = np.ones(6, np.int64)
        return cache.plan(2 * six, np.arange(6), gen * six, 8 * six, 8 * six, 0 * six, 2, None)

    honest(8)
    for r in range(1, 10):
        assert honest(8 + r).hit.all(), r  # the honest streams draft from their rows every round
        assert (storm(r).rows >= 0).sum() == 2  # the storm: two rows, the rest from scratch rows
    assert cache.held(1, 0) is not None and cache.held(1, 1) is not None
    for r in range(10, 10 + PROTECT_CALLS + 2):  # the honest engine is gone: its rows go cold
        storm(r)
    assert cache.held(1, 0) is None and cache.held(1, 1) is None
    assert (storm(99).rows >= 0).sum() == 4

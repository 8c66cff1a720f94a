"""The torch model drafter's sampled rounds (remote_dspark.drafter.lm): drafts
drawn by the sampling rule (remote_dspark.drafter.sampling) inside the batched round,
against the rule recomputed in numpy, a one-entry reference, the greedy round, and their
own reported distributions. CPU float32 (eager and padded shapes, cache on and off),
and one GPU test (bf16, CUDA graphs).

Float rounding: two computations of the same logits (a batched round and a whole-sequence
forward, or the cache against re-encoding) agree to ~1e-6, not bit for bit; a weight may
then move by a unit, and a draw whose uniform falls within a few units of a cumulative
weight may flip. :func:`agreeing_drafts` compares two rounds' drafts up to the first
position where that could happen (the comparison is exact before it), and the tests
require most positions to be compared.

The statistical test uses fixed seeds; it passes when a chi-square p-value is above 1e-4
(a false failure probability of 1e-4 over the choice of seeds, none once fixed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import P_VALUE_MIN, chi2_p
from hypothesis import given, settings
from hypothesis import strategies as st
from lm_common import STREAM_ROUNDS, Streams, agreeing_prefix, batch_of

from remote_dspark.drafter import sampling as ns
from remote_dspark.drafter.answer import check_result
from remote_dspark.drafter.lm.drafter import LMDrafter

WINDOW = 16
NEAR = 4  # weight units: a draw this close to a cumulative weight may flip under rounding


def contexts_of(seed: int, n: int, longest: int = 20) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, int(rng.integers(1, longest))).tolist() for _ in range(n)]


def sampled(batch, temperature, seeds):
    n = len(batch)
    return dataclasses.replace(
        batch,
        temperature=np.broadcast_to(np.asarray(temperature, np.float32), (n,)).copy(),
        seed=np.asarray(seeds, np.uint64),
    )


def stream_batch(contexts, width, positions, cached: bool, **kw):
    """A batch with true positions; with ``cached``, each entry its own stream (slot i)."""
    positions = np.asarray(positions, np.int64)
    stream = dict(positions=positions)
    if cached:
        n = len(contexts)
        lens = np.array([len(c) for c in contexts], np.int64)
        stream.update(slots=np.arange(n), gens=np.zeros(n, np.int64), lengths=positions + lens)
    return batch_of(contexts, [width] * len(contexts), width, **stream, **kw)


def uniforms(batch) -> np.ndarray:
    """[n, width] uint32: the rule's uniform of each draft (p = start + len + j)."""
    j = np.arange(batch.width)
    first = batch.starts() + np.diff(batch.offsets)
    return ns.uniform_u32(np.asarray(batch.seed, np.uint64)[:, None], first[:, None] + j, j)


def assert_drafts_follow_the_rule(result, batch):
    """check_result passes, and every drafted token is the pick of its reported q."""
    checked = check_result(result, batch)
    live = np.arange(batch.width) < checked.counts[:, None]
    want = ns.pick(checked.q_ids, checked.q_weights, uniforms(batch))
    assert (checked.tokens[live] == want[live]).all()
    assert (checked.q_weights.astype(np.int64).sum(-1)[live] == ns.TOTAL).all()


def comparable(ids_a, w_a, ids_b, w_b, u) -> bool:
    """Whether two distributions of one draw pick the same token for ``u`` whatever
    rounding separates them: same ids in the same order, weights within a unit or two,
    and the draw's r clear of every cumulative weight by NEAR units."""
    if (ids_a != ids_b).any() or np.abs(w_a.astype(np.int64) - w_b).max() > 2:
        return False
    r = (int(u) * ns.TOTAL) >> 32
    return bool(np.abs(np.cumsum(w_a.astype(np.int64)) - r).min() > NEAR)


def agreeing_drafts(a_ids, a_w, a_tok, b_ids, b_w, b_tok, u) -> int:
    """Compares two entries' drafts step by step while :func:`comparable`: asserts the
    tokens equal there; returns how many steps were compared."""
    for j in range(len(a_tok)):
        if not comparable(a_ids[j], a_w[j], b_ids[j], b_w[j], u[j]):
            return j
        assert a_tok[j] == b_tok[j], f"draft {j}"
    return len(a_tok)


def assert_same_sampled(got, want, batch) -> float:
    """Two sampled results of ``batch`` agree (counts equal, drafts up to each entry's
    first position where rounding could flip); returns the share of drafts compared."""
    assert (got.counts == want.counts).all()
    u, compared = uniforms(batch), 0
    for i, k in enumerate(want.counts.tolist()):
        compared += agreeing_drafts(
            got.q_ids[i, :k], got.q_weights[i, :k], got.tokens[i, :k],
            want.q_ids[i, :k], want.q_weights[i, :k], want.tokens[i, :k], u[i, :k],
        )  # fmt: skip
    return compared / max(int(want.counts.sum()), 1)


MODES = [(False, 0), (False, 16), (True, 0), (True, 16)]
MODE_IDS = ["eager", "eager-cached", "padded", "padded-cached"]


@pytest.mark.parametrize(("graphs", "slots"), MODES, ids=MODE_IDS)
def test_temperature_zero_is_the_greedy_round_with_one_hot_weights(graphs, slots):
    width = 4
    contexts = contexts_of(1, 9) + [[]]  # an empty context: no drafts
    batch = stream_batch(contexts, width, np.arange(10) * 5, cached=slots > 0)
    greedy = LMDrafter(device="cpu", cache_slots=slots, window=WINDOW, graphs=graphs).draft_batch(batch)
    d = LMDrafter(device="cpu", cache_slots=slots, window=WINDOW, graphs=graphs)
    cold = sampled(batch, 0.0, np.arange(10, dtype=np.uint64) + np.uint64(2**63))
    got = d.draft_batch(cold)
    assert_drafts_follow_the_rule(got, cold)
    assert (got.tokens == greedy.tokens).all() and (got.counts == greedy.counts).all()
    np.testing.assert_array_equal(got.margins, greedy.margins)  # the same rule, the same logits
    live = np.arange(width) < got.counts[:, None]
    assert (got.q_ids[..., 0][live] == got.tokens[live]).all()
    assert (got.q_weights[..., 0][live] == ns.TOTAL).all() and not got.q_weights[..., 1:].any()
    assert not got.q_ids[~live].any() and got.counts[-1] == 0


@pytest.mark.parametrize(("graphs", "slots"), MODES, ids=MODE_IDS)
def test_drafts_are_the_pick_of_their_reported_distributions_at_their_positions(graphs, slots):
    """Mixed temperatures (0 among them), 64-bit seeds, true positions, and a second round
    of the same streams (a cache hit where cached): every draft is pick(q, uniform)."""
    width, n = 5, 12
    rng = np.random.default_rng(2)
    d = LMDrafter(device="cpu", cache_slots=slots, window=WINDOW, graphs=graphs)
    contexts = contexts_of(3, n, longest=10)
    positions = rng.integers(0, 200, n)
    temperature = np.where(np.arange(n) % 4 == 0, 0.0, rng.uniform(0.3, 3.0, n))
    seeds = rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    first = sampled(stream_batch(contexts, width, positions, cached=slots > 0), temperature, seeds)
    assert_drafts_follow_the_rule(d.draft_batch(first), first)
    grown = [c + rng.integers(0, 128, 2).tolist() for c in contexts]
    second = sampled(stream_batch(grown, width, positions, cached=slots > 0), temperature, seeds)
    result = d.draft_batch(second)
    assert_drafts_follow_the_rule(result, second)
    if slots:
        assert d.cache_info().hits == n
    assert result.margins.shape == (n, width) and ((result.margins >= 0) & (result.margins <= 1)).all()


def sampled_one(d: LMDrafter, context, n: int, start: int, temperature: float, seed: int):
    """The reference: ``n`` drafts after ``context`` alone, the whole sequence re-encoded
    by the model's plain forward per draft (as ``greedy_one``), each drawn by the numpy
    rule; returns (tokens, ids [n, TOP], weights [n, TOP])."""
    seq, tokens, ids, weights = [int(t) for t in context], [], [], []
    with torch.inference_mode():
        for j in range(n):
            logits = d.model(torch.tensor([seq], dtype=torch.long), start)[:, -1].numpy()
            q_ids, q_w = ns.top32(logits, np.float32([temperature]))
            u = ns.uniform_u32(np.uint64(seed), start + len(context) + j, j)
            tokens.append(int(ns.pick(q_ids, q_w, u)[0]))
            ids.append(q_ids[0])
            weights.append(q_w[0])
            seq.append(tokens[-1])
    return np.array(tokens), np.array(ids), np.array(weights)


@pytest.mark.parametrize(("graphs", "slots"), MODES, ids=MODE_IDS)
def test_batched_sampled_drafts_equal_a_whole_sequence_reference_one_entry_at_a_time(graphs, slots):
    width, n = 5, 8
    rng = np.random.default_rng(4)
    d = LMDrafter(device="cpu", cache_slots=slots, window=WINDOW, graphs=graphs)
    contexts, positions = contexts_of(5, n, longest=12), rng.integers(0, 100, n)
    temperature, seeds = rng.uniform(0.5, 2.5, n), np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    batch = sampled(stream_batch(contexts, width, positions, cached=slots > 0), temperature, seeds)
    got = d.draft_batch(batch)
    u, compared = uniforms(batch), 0
    for i in range(n):
        tokens, ids, weights = sampled_one(
            d, contexts[i], width, int(positions[i]), float(temperature[i]), int(seeds[i])
        )
        compared += agreeing_drafts(got.q_ids[i], got.q_weights[i], got.tokens[i], ids, weights, tokens, u[i])
    assert compared >= 0.8 * n * width  # rounding stops few comparisons


def test_sampled_drafts_are_reproducible_across_calls_cache_and_padding():
    width, n = 4, 16
    rng = np.random.default_rng(6)
    contexts, positions = contexts_of(7, n), rng.integers(0, 100, n)
    temperature, seeds = rng.uniform(0.5, 2.0, n), rng.integers(0, 2**63, n).astype(np.uint64)
    plain = sampled(stream_batch(contexts, width, positions, cached=False), temperature, seeds)
    want = LMDrafter(device="cpu", cache_slots=0, window=WINDOW).draft_batch(plain)
    again = LMDrafter(device="cpu", cache_slots=0, window=WINDOW).draft_batch(plain)
    for name in ("tokens", "counts", "margins", "q_ids", "q_weights"):  # the same computation: bit for bit
        np.testing.assert_array_equal(getattr(again, name), getattr(want, name))
    for graphs in (False, True):
        d = LMDrafter(device="cpu", cache_slots=16, window=WINDOW, graphs=graphs)
        batch = sampled(stream_batch(contexts, width, positions, cached=True), temperature, seeds)
        for _ in range(2):  # a miss, then a hit (the last token again)
            assert assert_same_sampled(d.draft_batch(batch), want, batch) >= 0.8
        assert d.cache_info().hits == n


def test_different_seeds_draw_different_drafts_and_the_same_seed_the_same():
    n, width = 64, 4
    d = LMDrafter(device="cpu", cache_slots=0, window=WINDOW)
    batch = batch_of([[5, 9, 14, 3]] * n, [width] * n, width)
    got = d.draft_batch(sampled(batch, 2.0, np.arange(n)))
    assert len({tuple(row) for row in got.tokens.tolist()}) > n // 4
    same = d.draft_batch(sampled(batch, 2.0, np.full(n, 12345)))
    assert len({tuple(row) for row in same.tokens.tolist()}) == 1


@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_first_drafts_of_one_context_over_many_seeds_follow_the_reported_distribution(temperature):
    n = 4000
    d = LMDrafter(device="cpu", cache_slots=0, window=8)
    batch = sampled(
        batch_of([[17, 4, 99]] * n, [2] * n, 2, positions=np.full(n, 40)), temperature, np.arange(n) * 7 + 1
    )
    got = d.draft_batch(batch)
    ids, weights = got.q_ids[:, 0], got.q_weights[:, 0].astype(np.int64)
    assert (ids == ids[0]).all() and (np.abs(weights - weights[0]).max() <= 1)  # one context: one q
    expected = np.zeros(d.vocab_size)
    expected[ids[0]] = weights[0] / ns.TOTAL * n
    observed = np.bincount(got.tokens[:, 0], minlength=d.vocab_size)
    assert (expected > 0).sum() > 5  # a real distribution, not a near-greedy one
    assert chi2_p(observed, expected) > P_VALUE_MIN


def test_a_round_in_parts_samples_each_entry_with_its_own_inputs():
    """Two whole windows beside 60 short contexts at a limit of 1024 padded tokens: the
    round runs in parts (entries reordered), and every draft is still the pick of its own
    seed and position; the drafts agree with the unsplit round's."""
    rng = np.random.default_rng(8)
    contexts = [rng.integers(0, 128, 60).tolist() for _ in range(2)] + contexts_of(9, 60, longest=5)
    n = len(contexts)
    batch = sampled(
        stream_batch(contexts, 4, rng.integers(0, 50, n), cached=False), rng.uniform(0.5, 2.0, n), np.arange(n) + 99
    )
    whole = LMDrafter(device="cpu", cache_slots=0, window=64).draft_batch(batch)
    d = LMDrafter(device="cpu", cache_slots=0, window=64, graphs=True)
    d._rounds.limit = 1024
    got = d.draft_batch(batch)
    assert_drafts_follow_the_rule(got, batch)
    assert assert_same_sampled(got, whole, batch) >= 0.8


def test_a_sampled_round_refuses_bad_temperatures_and_seeds():
    d = LMDrafter(device="cpu", cache_slots=0, window=WINDOW)
    batch = batch_of([[1, 2], [3]], [2, 2], 2)
    for temperature, seed, culprit in [
        ([1.0, -0.5], [1, 2], "temperature"),
        ([1.0, np.inf], [1, 2], "temperature"),
        ([1.0], [1, 2], "temperature"),
        ([1.0, 1.0], [1], "seed"),
    ]:
        bad = dataclasses.replace(batch, temperature=np.float32(temperature), seed=np.uint64(seed))
        with pytest.raises(ValueError, match=culprit):
            d.draft_batch(bad)
    assert d.samples
    from remote_dspark.drafter.lm.model import LMConfig, TinyLM

    small = LMDrafter(TinyLM(LMConfig(vocab_size=16)), device="cpu", cache_slots=0, window=WINDOW)
    assert not small.samples
    with pytest.raises(ValueError, match="vocabulary"):
        small.draft_batch(sampled(batch, 1.0, [1, 2]))


@pytest.mark.gpu
def test_cuda_graphs_sample_in_bf16_without_a_host_sync():
    """bf16 on CUDA, the round a replayed graph: drafts per check_result and the numpy
    rule, bit for bit across replays, temperature 0 the greedy drafts (up to near-ties of
    the greedy margins), and the round's ops free of host syncs (run eagerly under
    torch's sync debug mode; the capture itself would fail on one)."""
    width, n = 5, 40
    rng = np.random.default_rng(10)
    d = LMDrafter(device="cuda", cache_slots=0, window=WINDOW)
    assert d._rounds.capture
    contexts, positions = contexts_of(11, n), rng.integers(0, 200, n)
    batch = sampled(stream_batch(contexts, width, positions, cached=False), rng.uniform(0.3, 3.0, n), np.arange(n) * 3)
    got = d.draft_batch(batch)
    assert any(sampled_shape for *_, sampled_shape in d._rounds.graphs)  # captured, replayed
    assert_drafts_follow_the_rule(got, batch)
    again = d.draft_batch(batch)
    for name in ("tokens", "counts", "margins", "q_ids", "q_weights"):
        np.testing.assert_array_equal(getattr(again, name), getattr(got, name))
    greedy = d.draft_batch(dataclasses.replace(batch, temperature=None, seed=None))
    cold = d.draft_batch(sampled(batch, 0.0, np.arange(n)))
    assert_drafts_follow_the_rule(cold, sampled(batch, 0.0, np.arange(n)))
    for i in range(n):
        a, b = agreeing_prefix(greedy.tokens[i].tolist(), greedy.margins[i].tolist(), cold.tokens[i].tolist())
        assert a == b, f"entry {i}"
    shape = next(k for k in d._rounds.graphs if k[3])
    _, inp, _ = d._rounds.graphs[shape]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():  # as draft_batch runs it
            d._rounds._round(inp, shape)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@settings(max_examples=10, deadline=None)
@given(rounds=STREAM_ROUNDS, blocks=st.integers(7, 12), encodes=st.lists(st.booleans(), max_size=12))
def test_sampled_drafts_of_kept_streams_equal_a_fresh_encode_of_the_whole_sequence(rounds, blocks, encodes):
    """Streams through a worker's windows and its whole-stream reader, some rounds encodes
    only (``n_out`` 0, as the first chunks of a long context are), a pool of a few blocks
    (evictions, re-encodes from the worker's tokens, rounds in waves): every sampled draft
    is what the rule draws from a fresh encode of the stream's whole sequence at its true
    positions, up to rounding's flips."""
    width = 2
    probe = LMDrafter(device="cpu", cache_slots=1, window=6, max_context=32)
    d = LMDrafter(device="cpu", cache_slots=3, window=6, max_context=32, kv_bytes=blocks * probe.store.block_bytes())
    plain = LMDrafter(device="cpu", cache_slots=0, window=6, max_context=32)
    streams = Streams(6, whole=True)
    compared = []
    for r, ops in enumerate(rounds):
        batch = streams.round(ops, width)
        if not len(batch):  # every slot to re-announce
            continue
        seeds = np.arange(len(batch), dtype=np.uint64) * 7 + np.uint64(r)
        if r < len(encodes) and encodes[r]:  # an encode only: kept, nothing drafted
            got = d.draft_batch(sampled(dataclasses.replace(batch, n_out=np.zeros(len(batch), np.int32)), 0.8, seeds))
            assert not got.counts.any()
            continue
        got = d.draft_batch(sampled(batch, 0.8, seeds))
        spans = [streams.span(int(slot)) for slot in batch.slots]
        whole = batch_of([s for _, s in spans], batch.n_out, width, positions=np.array([f for f, _ in spans]))
        whole = sampled(whole, 0.8, seeds)
        drafts = int(got.counts.sum())
        compared.append((assert_same_sampled(got, plain.draft_batch(whole), whole) * drafts, drafts))
    # Most drafts compared, pooled (a round of two drafts may lose one to rounding's flip)
    done, total = np.sum(compared, axis=0) if compared else (0, 0)
    assert total < 10 or done >= 0.8 * total

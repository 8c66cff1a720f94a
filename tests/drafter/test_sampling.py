"""Sampled drafts' primitives (remote_dspark.drafter.sampling and its torch twin): the
counter-based randomness, bit for bit in numpy and torch, and uniform; the top-32
distribution with its exact weights; the pick; from_counts' pads; the check rule.

Statistical tests use fixed inputs and pass when a chi-square p-value is above 1e-4:
deterministic, and for a correct implementation a 1e-4 chance per test that the fixed
inputs were unlucky (they were not: the thresholds were met when written)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import P_VALUE_MIN, chi2_p
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark.drafter import sampling as ns
from remote_dspark.drafter.lm import sampling as ts

U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
U32 = st.integers(0, 2**32 - 1)


def bits(x: np.ndarray) -> torch.Tensor:
    """The int64 tensor holding a uint64 array's bits."""
    return torch.from_numpy(np.asarray(x, np.uint64).view(np.int64).copy())


def u32_torch(seed, position, draft) -> np.ndarray:
    return ts.uniform_u32(bits(seed), torch.tensor(position, dtype=torch.long), draft).numpy()


# ---------------------------------------------------------------- randomness


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(U64, I64, U32), min_size=1, max_size=20))
def test_uniform_u32_is_bit_identical_in_numpy_and_torch(rows):
    seed = np.array([r[0] for r in rows], np.uint64)
    position = np.array([r[1] for r in rows], np.int64)
    draft = np.array([r[2] for r in rows], np.int64)
    ours = ns.uniform_u32(seed, position, draft)
    assert ours.dtype == np.uint32
    theirs = u32_torch(seed, position, torch.from_numpy(draft))
    assert theirs.dtype == np.int64 and (theirs >= 0).all() and (theirs < 2**32).all()
    assert np.array_equal(ours.astype(np.int64), theirs)
    one = int(draft[0])  # a draft index as a Python int (what a captured graph passes)
    assert np.array_equal(ns.uniform_u32(seed, position, one).astype(np.int64), u32_torch(seed, position, one))


def test_uniform_u32_broadcasts_and_int64_seeds_are_their_bits():
    seed = np.array([[2**63 + 3], [5]], np.uint64)
    grid = ns.uniform_u32(seed, np.arange(4), 1)
    assert grid.shape == (2, 4)
    assert np.array_equal(grid, ns.uniform_u32(seed.view(np.int64), np.arange(4), 1))
    assert len(set(grid.ravel().tolist())) == 8
    with pytest.raises(ValueError, match="draft"):
        ns.uniform_u32(1, 2, -1)


def test_uniform_u32_is_uniform_over_high_and_low_bytes():
    """262,144 numbers of consecutive counters (64 seeds x 1024 positions x 4 drafts):
    their top and bottom bytes each fill 256 buckets evenly."""
    seed = np.arange(64, dtype=np.uint64)[:, None, None] * np.uint64(0x100000001)
    u = ns.uniform_u32(seed, np.arange(1024)[None, :, None], np.arange(4)[None, None, :]).ravel()
    expected = np.full(256, len(u) / 256)
    for byte in (u >> 24, u & 0xFF, (u >> 12) & 0xFF):
        assert chi2_p(np.bincount(byte, minlength=256), expected) > P_VALUE_MIN


def test_uniform_u32_avalanche():
    """Flipping any one input bit (64 of the seed, 64 of the position, 32 of the draft)
    flips each output bit with probability near 1/2: over 2048 fixed inputs, the mean
    number of flipped bits is within 16 +- 0.6 (about 10 standard errors) and no output
    bit flips less than 40% or more than 60% of the time (about 9)."""
    rng = np.random.default_rng(11)
    seed = rng.integers(0, 2**64 - 1, 2048, dtype=np.uint64, endpoint=True)
    position = rng.integers(0, 2**20, 2048).astype(np.int64)
    draft = rng.integers(0, 16, 2048).astype(np.int64)
    base = ns.uniform_u32(seed, position, draft)
    flips = [(seed ^ np.uint64(1 << b), position, draft) for b in range(64)]
    flips += [(seed, (position.view(np.uint64) ^ np.uint64(1 << b)).view(np.int64), draft) for b in range(64)]
    flips += [(seed, position, draft ^ (1 << b)) for b in range(32)]
    shifts = np.arange(32, dtype=np.uint32)
    for i, args in enumerate(flips):
        changed = (ns.uniform_u32(*args) ^ base)[:, None] >> shifts & 1  # [2048, 32]
        per_bit = changed.mean(axis=0)
        assert abs(changed.sum(axis=1).mean() - 16) < 0.6, f"input bit {i}"
        assert per_bit.min() > 0.4 and per_bit.max() < 0.6, f"input bit {i}: {per_bit.min()}..{per_bit.max()}"


# ---------------------------------------------------------------- pick


def valid_weights(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, 32] uint16 summing to 65535, with zeros among them."""
    raw = rng.exponential(size=(n, ns.TOP)) * (rng.random((n, ns.TOP)) < 0.7)
    raw[:, 0] += 1e-3
    w = np.floor(raw / raw.sum(1, keepdims=True) * ns.TOTAL).astype(np.int64)
    w[:, 0] += ns.TOTAL - w.sum(1)
    return w.astype(np.uint16)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(U32, min_size=1, max_size=16))
def test_pick_is_bit_identical_in_numpy_and_torch(wseed, u):
    rng = np.random.default_rng(wseed)
    u = np.array(u, np.uint32)
    w = valid_weights(rng, len(u))
    ids = np.stack([rng.permutation(1000)[: ns.TOP] for _ in u]).astype(np.int32)
    ours = ns.pick(ids, w, u)
    theirs = ts.pick(torch.from_numpy(ids), torch.from_numpy(w.astype(np.int32)), torch.from_numpy(u.astype(np.int64)))
    assert np.array_equal(ours, theirs.numpy())


def test_pick_cuts_at_the_cumulative_weights():
    """r = (u * 65535) >> 32; the token is the first id whose cumulative weight passes r:
    at each boundary the smallest u of r = cum - 1 and of r = cum are on either side."""
    w = np.array([[0, 3, 0, 65500] + [1] * 27 + [5]], np.uint16)  # zeros, ones, and 65535 in all
    ids = np.arange(100, 100 + ns.TOP, dtype=np.int32)[None]
    cum = np.cumsum(w[0].astype(np.int64))

    def first_u(r: int) -> int:  # the smallest u32 with (u * 65535) >> 32 == r
        return -(-(r << 32) // ns.TOTAL)

    for i in np.flatnonzero(w[0]):
        lo = 0 if i == 0 else int(cum[i - 1])
        for u in (first_u(lo), first_u(int(cum[i])) - 1):
            assert ns.pick(ids, w, np.array([u], np.uint32))[0] == 100 + i, (i, u)
    assert ns.pick(ids, w, np.array([2**32 - 1], np.uint32))[0] == 100 + int(np.flatnonzero(w[0])[-1])
    assert ns.pick(ids[0], w[0], np.uint32(0)) == 101  # one row, a scalar counter: a scalar token


def test_pick_draws_w_over_65535():
    """200,000 draws from counter randomness follow each of three distributions."""
    rng = np.random.default_rng(5)
    w = valid_weights(rng, 3)
    ids = np.arange(ns.TOP, dtype=np.int32)[None].repeat(200_000, 0)
    for row in w:
        u = ns.uniform_u32(np.uint64(0xDEADBEEF12345678), np.arange(200_000), 2)
        got = np.bincount(ns.pick(ids, np.broadcast_to(row, ids.shape), u), minlength=ns.TOP)
        assert chi2_p(got, row.astype(np.float64) / ns.TOTAL * len(u)) > P_VALUE_MIN


# ---------------------------------------------------------------- top32


def reference_top(scores: np.ndarray) -> np.ndarray:
    """The rule's ids by a full sort: score descending, then id ascending."""
    v = np.arange(scores.shape[1])
    return np.stack([np.lexsort((v, -row.astype(np.float64)))[: ns.TOP] for row in scores])


def torch_top32(scores, temperature, **kw):
    ids, w = ts.top32(torch.from_numpy(scores), torch.from_numpy(np.asarray(temperature, np.float32)), **kw)
    return ids.numpy(), w.numpy()


@pytest.mark.parametrize("vocab", [32, 33, 1000, 50257])
def test_top32_numpy_and_torch_agree_on_separated_scores(vocab):
    rng = np.random.default_rng(vocab)
    scores = (rng.normal(size=(8, vocab)) * 4).astype(np.float32)
    temperature = np.array([1, 0.3, 2, 0, 0.05, 1.7, 1e-6, 50], np.float32)
    ids, w = ns.top32(scores, temperature)
    assert ids.dtype == np.int32 and w.dtype == np.uint16
    assert np.array_equal(ids, reference_top(scores))
    assert (w.astype(np.int64).sum(1) == ns.TOTAL).all()
    for sync_free in (False, True):
        t_ids, t_w = torch_top32(scores, temperature, sync_free=sync_free)
        assert np.array_equal(ids, t_ids) and np.array_equal(w, t_w)


def test_top32_weights_are_the_softmax_at_temperature_floored():
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(4, 200)).astype(np.float32)
    temperature = np.array([1, 0.5, 2, 0.25], np.float32)
    ids, w = ns.top32(scores, temperature)
    top = np.take_along_axis(scores, ids, 1).astype(np.float64) / temperature[:, None]
    p = np.exp(top - top.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    floor = np.floor(p * ns.TOTAL)
    assert np.array_equal(w[:, 1:], floor[:, 1:])
    assert (0 <= w[:, 0] - floor[:, 0]).all() and (w[:, 0] - floor[:, 0] < ns.TOP).all()
    assert (np.diff(w[:, 1:].astype(np.int64), axis=1) <= 0).all()  # descending, as the scores


def test_top32_ties_go_to_the_smaller_id_in_both():
    """Few distinct values: ties everywhere, inside the 32 and across its edge."""
    rng = np.random.default_rng(9)
    scores = rng.integers(0, 4, size=(16, 300)).astype(np.float32)
    scores[3] = 0
    scores[4, 250:] = 9  # 50 tied at the top
    scores[5, :] = -np.inf
    scores[5, 100] = 1
    temperature = np.linspace(0, 3, 16).astype(np.float32)
    ids, w = ns.top32(scores, temperature)
    assert np.array_equal(ids, reference_top(scores))
    for sync_free in (False, True):
        t_ids, t_w = torch_top32(scores, temperature, sync_free=sync_free)
        assert np.array_equal(ids, t_ids) and np.array_equal(w, t_w)
    assert ids[5, 0] == 100 and w[5, 0] == ns.TOTAL  # -inf scores weigh nothing


def test_temperature_zero_is_the_argmax_with_the_whole_weight():
    scores = np.zeros((2, 64), np.float32)
    scores[0, 40] = 1
    scores[1, [7, 3, 50]] = 2  # tied: the smaller id
    ids, w = ns.top32(scores, np.zeros(2, np.float32))
    assert ids[:, 0].tolist() == [40, 3] and (w[:, 0] == ns.TOTAL).all() and (w[:, 1:] == 0).all()
    t_ids, t_w = torch_top32(scores, np.zeros(2))
    assert np.array_equal(ids, t_ids) and np.array_equal(w, t_w)


def test_rows_without_a_finite_softmax_are_greedy_and_valid():
    scores = np.zeros((4, 40), np.float32)
    scores[0] = -np.inf
    scores[1, 5] = np.inf
    scores[2, 9] = np.nan
    scores[3, ::3] = np.nan
    one = np.ones(4, np.float32)
    for ids, w in (ns.top32(scores, one), torch_top32(scores, one), torch_top32(scores, one, sync_free=True)):
        assert (w.astype(np.int64).sum(1) == ns.TOTAL).all()
        assert ns.check_sampled(ids, w, ns.pick(ids, w, np.zeros(4, np.uint32)), 40) is None
        assert ids[1, 0] == 5 and w[1, 0] == ns.TOTAL


def test_torch_greedy_for_temperatures_numpy_refuses():
    scores = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32)
    bad = np.array([-1, np.nan, np.inf], np.float32)
    _, w = torch_top32(scores, bad)
    assert (w[:, 0] == ns.TOTAL).all()
    for t in bad:
        with pytest.raises(ValueError, match="temperature"):
            ns.top32(scores, np.full(3, t, np.float32))
    with pytest.raises(ValueError, match="temperature"):
        ns.top32(scores, np.ones(2, np.float32))
    with pytest.raises(ValueError, match="scores"):
        ns.top32(scores[:, :31], np.ones(3, np.float32))
    with pytest.raises(ValueError, match="scores"):
        ts.top32(torch.zeros(3, 31), torch.ones(3))


# ---------------------------------------------------------------- from_counts


def test_from_counts_pads_with_the_smallest_free_ids():
    cand = np.array([[5, 3, 0, 1], [40, 0, 2, 7], [9, 9, 9, 9]])
    counts = np.array([[10, 30, 0, 10], [1, 1, 1, 0], [0, 0, 0, 0]])
    ids, w = ns.from_counts(cand, counts, np.ones(3, np.float32), vocab=100)
    assert ids[0, :3].tolist() == [3, 1, 5]  # count descending, ties to the smaller id
    assert ids[0, 3:].tolist() == [0, 2, 4] + list(range(6, 32))
    assert ids[1, :3].tolist() == [0, 2, 40] and ids[1, 3:].tolist() == [1] + list(range(3, 31))
    assert ids[2].tolist() == list(range(32)) and w[2, 0] == ns.TOTAL  # no candidate
    assert (w[:, 3:] == 0).all() and (w.astype(np.int64).sum(1) == ns.TOTAL).all()
    for row in range(3):
        assert len(set(ids[row].tolist())) == ns.TOP


def test_from_counts_temperature_on_counts():
    cand = np.array([[4, 8, 6]] * 3)
    counts = np.array([[6, 3, 3]] * 3)
    ids, w = ns.from_counts(cand, counts, np.array([1, 0.5, 0], np.float32), vocab=64)
    assert ids[:, :3].tolist() == [[4, 6, 8]] * 3
    assert w[0, :3].tolist() == [32769, 16383, 16383]  # floor(65535 / 2, / 4, / 4), the deficit 2 to the first
    assert w[1, :3].tolist() == [43691, 10922, 10922]  # 36 : 9 : 9, the deficit 1 to the first
    assert w[2, :3].tolist() == [ns.TOTAL, 0, 0]  # T = 0: the largest count


def test_from_counts_refuses_what_would_break_the_rule():
    one = np.ones(1, np.float32)
    with pytest.raises(ValueError, match="vocab"):
        ns.from_counts([[1]], [[1]], one, vocab=31)
    with pytest.raises(ValueError, match="repeated"):
        ns.from_counts([[1, 1]], [[2, 1]], one, vocab=64)
    with pytest.raises(ValueError, match="cand_ids"):
        ns.from_counts([[64]], [[1]], one, vocab=64)
    with pytest.raises(ValueError, match="counts"):
        ns.from_counts([[1]], [[-1]], one, vocab=64)
    with pytest.raises(ValueError, match="temperature"):
        ns.from_counts([[1]], [[1]], -one, vocab=64)
    ids, _ = ns.from_counts([[1, 1]], [[2, 0]], one, vocab=64)  # a dead slot's id is ignored
    assert ids[0, :2].tolist() == [1, 0]


# ---------------------------------------------------------------- check_sampled


@pytest.fixture
def sampled():
    rng = np.random.default_rng(2)
    ids, w = ns.top32(rng.normal(size=(5, 100)).astype(np.float32), np.ones(5, np.float32))
    return ids, w, ns.pick(ids, w, ns.uniform_u32(np.uint64(1), np.arange(5), 0))


def test_check_sampled_passes_valid_output(sampled):
    assert ns.check_sampled(*sampled, vocab=100) is None


def test_check_sampled_catches_an_id_out_of_the_vocabulary(sampled):
    ids, w, tokens = sampled
    ids[2, 31] = 100
    assert ns.check_sampled(ids, w, tokens, 100) == "position 2: id 100 outside 0..99"
    ids[2, 31] = -1
    assert "outside" in ns.check_sampled(ids, w, tokens, 100)


def test_check_sampled_catches_a_repeated_id(sampled):
    ids, w, tokens = sampled
    ids[4, 30] = ids[4, 3]
    assert ns.check_sampled(ids, w, tokens, 100) == f"position 4: id {ids[4, 3]} repeated"


def test_check_sampled_catches_weights_off_the_exact_sum(sampled):
    ids, w, tokens = sampled
    w[1, 0] -= 1
    assert "position 1: weights sum to 65534" in ns.check_sampled(ids, w, tokens, 100)


def test_check_sampled_catches_a_token_not_among_the_ids(sampled):
    ids, w, tokens = sampled
    tokens[3] = next(t for t in range(100) if t not in ids[3])
    assert (
        ns.check_sampled(ids, w, tokens, 100)
        == f"position 3: drafted token {tokens[3]} not among its ids of weight > 0"
    )


def test_check_sampled_catches_a_token_of_weight_zero(sampled):
    ids, w, tokens = sampled
    w[0, 0] += w[0, 31]
    w[0, 31] = 0
    tokens[0] = ids[0, 31]
    assert "position 0: drafted token" in ns.check_sampled(ids, w, tokens, 100)


def test_check_sampled_catches_shapes(sampled):
    ids, w, tokens = sampled
    assert "shapes" in ns.check_sampled(ids[:, :31], w[:, :31], tokens, 100)
    assert "shapes" in ns.check_sampled(ids, w, tokens[:4], 100)


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_is_bit_identical_with_numpy():
    """On CUDA (the sync-free tie path by default): the same numbers, ids, weights and
    picks as numpy, on separated and on tied scores."""
    rng = np.random.default_rng(17)
    seed = rng.integers(0, 2**64 - 1, 256, dtype=np.uint64, endpoint=True)
    position = rng.integers(-(2**40), 2**40, 256)
    u = ns.uniform_u32(seed, position, 3)
    cuda_u = ts.uniform_u32(bits(seed).cuda(), torch.from_numpy(position).cuda(), 3)
    assert np.array_equal(u.astype(np.int64), cuda_u.cpu().numpy())
    for scores in (
        (rng.normal(size=(256, 50257)) * 4).astype(np.float32),
        rng.integers(0, 5, (256, 3000)).astype(np.float32),
    ):
        temperature = rng.uniform(0, 2, 256).astype(np.float32)
        ids, w = ns.top32(scores, temperature)
        c_ids, c_w = ts.top32(torch.from_numpy(scores).cuda(), torch.from_numpy(temperature).cuda())
        assert np.array_equal(ids, c_ids.cpu().numpy()) and np.array_equal(w, c_w.cpu().numpy())
        assert np.array_equal(ns.pick(ids, w, u), ts.pick(c_ids, c_w, cuda_u).cpu().numpy())

"""The sampled drafts' hash and pick in C (``native/sampled_pick.h``: rules 1 and 3, what
the proxy's reply check holds each draft to) against their numpy twin
(``remote_dspark.sampled``: ``uniform_u32``, ``threshold``, ``pick_index``), bit for
bit over many random inputs: seeds over the whole u64 range, positions over the whole
i64 range (past 2**32 and negative bits included), draft indices over u32, and weights
of every shape the pick meets (one-hot, spread, a sliver, zeros, sums short of TOTAL)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from remote_dspark.sampled import TOP, TOTAL, pick_index, threshold, uniform_u32


def c_picks(lib, seed, position, draft, weights) -> tuple[np.ndarray, np.ndarray]:
    """``hf_sampled_picks``: rule 1's number and rule 3's index of each row, in C."""
    seed = np.ascontiguousarray(seed, np.uint64)
    position = np.ascontiguousarray(position, np.int64)
    draft = np.ascontiguousarray(draft, np.uint32)
    weights = np.ascontiguousarray(weights, np.uint16)
    n = len(seed)
    u32, index = np.zeros(n, np.uint32), np.zeros(n, np.uint32)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    lib.sampled_picks(ptr(seed), ptr(position), ptr(draft), ptr(weights), n, ptr(u32), ptr(index))
    return u32, index


def random_weights(rng, n: int) -> np.ndarray:
    """[n, TOP] uint16 weights of several kinds: random cuts of TOTAL, one-hot at a random
    index, a sliver of 1 among big ones, sums short of TOTAL (the pick's clip)."""
    cuts = np.sort(rng.integers(0, TOTAL + 1, (n, TOP - 1)), axis=1)
    w = np.diff(np.concatenate([np.zeros((n, 1), np.int64), cuts, np.full((n, 1), TOTAL)], axis=1))
    kind = rng.integers(0, 4, n)
    hot = kind == 1
    w[hot] = 0
    w[hot, rng.integers(0, TOP, hot.sum())] = TOTAL
    sliver = kind == 2
    w[sliver] = np.sort(w[sliver], axis=1)[:, ::-1]
    w[sliver, rng.integers(0, TOP, sliver.sum())] = 1
    short = kind == 3
    w[short] //= 2
    return w.astype(np.uint16)


@pytest.mark.parametrize("seed_of_test", [0, 1, 2])
def test_the_c_hash_and_pick_equal_numpy_bit_for_bit(lib, seed_of_test):
    rng = np.random.default_rng(seed_of_test)
    n = 100_000
    seed = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
    seed[:4] = [0, 1, 2**63, 2**64 - 1]
    position = rng.integers(-(2**63), 2**63, n, dtype=np.int64)
    position[4 : n // 2] = rng.integers(0, 2**34, n // 2 - 4)  # ROUND-sized ones, past 2**32 too
    position[4:8] = [0, 2**32 - 1, 2**32, 2**32 + 5]
    draft = rng.integers(0, 2**32, n, dtype=np.uint64)
    draft[8 : n // 2] = rng.integers(0, 16, n // 2 - 8)
    draft[8:10] = [0, 2**32 - 1]
    w = random_weights(rng, n)
    u32, index = c_picks(lib, seed, position, draft, w)
    ours = uniform_u32(seed, position, draft.astype(np.int64))
    assert np.array_equal(u32, ours)
    r = threshold(ours.astype(np.uint64)).astype(np.int64)
    assert np.array_equal(index, pick_index(w.astype(np.int64), r))
    assert len(np.unique(index)) == TOP  # every index reached: the comparison is not vacuous
    # r landing exactly on a running sum (the pick passes over it) happens here ~50 times
    on_edge = (np.cumsum(w.astype(np.int64), axis=1) == r[:, None]).any(axis=1)
    assert on_edge.sum() >= 10

"""Sampled drafts (SAMPLED_TOP32): the one rule every drafter samples by, in numpy.

A drafter that samples its drafts says, for each drafted position, exactly the
distribution the draft was drawn from: 32 distinct token ids and integer weights. This
module is the rule's home: its statement below, and rule 2 in numpy (:func:`top32`,
:func:`from_counts`; :func:`add_deficit`, its exact sum, written once for numpy and
torch). Rules 1 and 3 (:func:`mix32`, :func:`hash_halves`, :func:`uniform_u32`;
:func:`threshold`, :func:`pick_index`, :func:`pick`) and the constants are written once
in :mod:`remote_dspark.sampled`, the shared vocabulary, since the engine checks every
draft by them, and re-exported here. :mod:`remote_dspark.drafter.lm.sampling` is the
torch twin (the model drafters, CPU and CUDA) for what cannot be written once: the
top-32 selection and its ties (numpy's partition and sort; on CUDA ``topk`` and a
search with no host sync, so a round can be a graph), the softmax without a host check
of the temperatures, and the gathers. ``native/sampled_pick.h`` is the C twin of rules 1
and 3 (the proxy's reply check). ``tests/drafter/test_sampling.py`` holds the twins
together: rules 1 and 3 bit for bit, rule 2's ids equal and weights up to float64
rounding (``tests/native/test_sampled_pick.py``: C and numpy bit for bit). Nothing of
the package's ``__init__`` imports either (numpy is imported here at module level).

1. **Randomness is counter-based.** A draft's uniform 32-bit number is
   :func:`uniform_u32` ``(seed, position, draft)``: a stateless hash of the entry's
   seed (uint64), the draft's absolute position in its sequence (int64) and its index
   in the round (0..2**32-1). No state per entry, no loop, and no number repeats across
   rounds (the position moves on). The hash works on 32-bit values held in 64-bit
   integers: every product is of a value below 2**32 and an odd constant below 2**31,
   so below 2**63 (no overflow in torch's int64), masked back to 32 bits; every shift is
   of a non-negative value. Two lanes of 32 bits, one keyed by each half of the seed,
   each absorb the position's low half, its high half and the draft index through the
   bijective mixer :func:`mix32`; the output mixes the two lanes. Since each lane's
   steps are bijections of its state, no two seeds share a whole stream of numbers, and
   no two counters share the numbers of every seed.

2. **The distribution.** For a row of scores and a temperature ``T > 0``: the ``TOP``
   (32) most likely ids, by score descending, ties to the smaller id; over those,
   ``p = softmax(score / T)`` (in float64); the weights ``w = floor(p * TOTAL)``
   (``TOTAL`` = 65535) with the deficit ``TOTAL - sum(w)`` (below 33; below 32 in exact
   arithmetic) added to the most likely id's weight. So ``w`` (uint16) sums to exactly
   ``TOTAL`` and ``q = w / TOTAL`` *is* the distribution sampled from. ``T == 0`` is
   greedy: the whole weight on the first id (the argmax, smaller id on ties). A row
   whose softmax is not finite (its best score infinite or NaN) is greedy too. Ids come
   in that order (weight descending for distinct scores, so the weights never rise
   along the ids: rule 4 holds them to it), all distinct and in the vocabulary: a row
   with fewer candidates (:func:`from_counts`: the Markov model's at most 16 next
   tokens, ``p`` proportional to ``count ** (1 / T)``) pads with weight 0 and the
   smallest ids that are not candidates, in ascending order. NaN scores give an
   unspecified but valid answer (distinct ids, weights summing to ``TOTAL``).

3. **The pick.** :func:`pick` ``(ids, weights, u32)``: ``r = (u32 * TOTAL) >> 32`` in
   ``0..TOTAL-1``; the token is ``ids[i]`` for the first ``i`` with
   ``cumsum(w)[i] > r``. Each ``r`` is hit by 65537 of the 2**32 values of ``u32``
   (one ``r`` by 65538), so a token is drawn with probability within ``2**-32`` of
   ``w / TOTAL`` (within ``TOTAL / 2**32`` a fortiori).

4. **The check.** :func:`~remote_dspark.sampled.check_sampled` (shared with the wire
   and the engine, :mod:`remote_dspark.sampled`): what the engine holds a reply's sampled
   section to, at drafted positions: ids in the vocabulary and distinct, weights
   summing to ``TOTAL``, the drafted token among the ids of weight > 0, the weights
   non-increasing along the ids (rule 2's order; equal weights in any id order), and
   the drafted token the pick (rule 3) at the entry's seed, the draft's absolute
   position and its index (rule 1). What it cannot hold: a drafter that chooses ``q``
   after computing the draw (the seed travels in the ROUND) can put a sliver of weight
   exactly where the draw lands and pass; only an engine that redraws each draft with
   its own randomness is exact against any worker.
"""

from __future__ import annotations

import numpy as np

# The shared terms, rules 1 and 3 (written once, in the shared vocabulary: the engine
# checks each draft by them) and rule 4.
from ..sampled import (
    LANE_KEYS,
    MASK32,
    MIX_MULTIPLIERS,
    MIX_SHIFTS,
    TOP,
    TOTAL,
    check_sampled,
    hash_halves,
    mix32,
    pick,
    pick_index,
    threshold,
    uniform_u32,
)

__all__ = [
    "LANE_KEYS",
    "MASK32",
    "MIX_MULTIPLIERS",
    "MIX_SHIFTS",
    "TOP",
    "TOTAL",
    "add_deficit",
    "check_sampled",
    "from_counts",
    "hash_halves",
    "mix32",
    "pick",
    "pick_index",
    "threshold",
    "top32",
    "uniform_u32",
    "weights_of",
]


def _check_temperature(temperature, n: int) -> np.ndarray:
    t = np.asarray(temperature, dtype=np.float32)
    if t.shape != (n,):
        raise ValueError(f"temperature: shape {t.shape}, expected {(n,)}")
    bad = ~(np.isfinite(t) & (t >= 0))
    if bad.any():
        raise ValueError(f"temperature {t[bad][0]!r} (entry {int(np.argmax(bad))}): expected a finite value >= 0")
    return t


def add_deficit(w):
    """Rule 2's last step, in place: each row's deficit ``TOTAL - sum(w)`` added to its
    most likely id's weight, so the row sums to exactly TOTAL (all of it for a greedy
    row). ``w`` [n, TOP] int64 (numpy or torch); written once, for both twins."""
    w[:, 0] += TOTAL - w.sum(1)
    return w


def weights_of(top: np.ndarray, temperature: np.ndarray) -> np.ndarray:
    """Rule 2's weights: ``top`` [n, TOP] scores, most likely first (descending),
    ``temperature`` [n] float32 (checked). Returns [n, TOP] uint16 summing to TOTAL."""
    t = np.asarray(temperature, dtype=np.float64)[:, None]
    v = np.asarray(top, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        p = np.exp((v - v[:, :1]) / np.where(t > 0, t, 1.0))
        p /= p.sum(axis=1, keepdims=True)
        ok = (t[:, 0] > 0) & np.isfinite(p).all(axis=1)
        w = np.floor(np.where(ok[:, None], p, 0.0) * TOTAL).astype(np.int64)
    return add_deficit(w).astype(np.uint16)


def top32(scores, temperature) -> tuple[np.ndarray, np.ndarray]:
    """Rule 2 over a row of scores each: the TOP most likely ids and their weights.

    Args:
        scores: [n, V] float (logits, or any scores), V >= TOP.
        temperature: [n] float32, finite and >= 0 (0: greedy).

    Returns: (ids [n, TOP] int32, weights [n, TOP] uint16): score descending, ties to
    the smaller id; weights sum to exactly TOTAL per row.

    Raises:
        ValueError: naming ``scores`` (not 2-D, fewer than TOP columns) or ``temperature``.
    """
    scores = np.asarray(scores)
    if scores.ndim != 2 or scores.shape[1] < TOP:
        raise ValueError(f"scores: shape {scores.shape}, expected [n, V] with V >= {TOP}")
    n, vocab = scores.shape
    t = _check_temperature(temperature, n)
    # The TOP + 1 largest, the (TOP + 1)-th in place: equal to the TOP-th, there are
    # ties at the edge and the ids partition chose among them are arbitrary.
    edge = max(vocab - TOP - 1, 0)
    part = np.argpartition(scores, edge, axis=1)
    ids = part[:, vocab - TOP :]
    kth = np.take_along_axis(scores, ids, 1).min(axis=1)
    tied = (scores[np.arange(n), part[:, edge]] == kth) & (vocab > TOP)
    if tied.any():  # those rows exactly: a stable sort by score descending (rare)
        ids[tied] = np.argsort(-scores[tied], axis=1, kind="stable")[:, :TOP]
    vals = np.take_along_axis(scores, ids, 1)
    order = np.lexsort((ids, -vals.astype(np.float64)), axis=1)
    ids, vals = np.take_along_axis(ids, order, 1), np.take_along_axis(vals, order, 1)
    return ids.astype(np.int32), weights_of(vals, t)


def from_counts(cand_ids, counts, temperature, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Rule 2 over candidate counts (the Markov model): ``p`` proportional to
    ``count ** (1 / T)``; ``T == 0``: the largest count (smaller id on ties).

    Args:
        cand_ids: [n, c] int, c <= TOP: each row's candidate next tokens.
        counts: [n, c] non-negative ints; 0 marks no candidate (its id is ignored).
        temperature: [n] float32, finite and >= 0.
        vocab: the vocabulary size, >= TOP (the pads are ids below it).

    Returns: (ids [n, TOP] int32, weights [n, TOP] uint16): the candidates by count
    descending (ties: smaller id), then pads of weight 0: the smallest ids that are not
    candidates, ascending. A row with no candidate is all pads, its whole weight on the
    first (id 0 or the smallest free): the caller drafts nothing there.

    Raises:
        ValueError: naming ``vocab``, ``cand_ids`` (shape, an id out of range or
            repeated in a row), ``counts`` (shape, negative) or ``temperature``.
    """
    if vocab < TOP:
        raise ValueError(f"vocab {vocab}: sampled drafts need at least {TOP} ids")
    cand, cnt = np.asarray(cand_ids, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    if cand.ndim != 2 or cand.shape[1] > TOP:
        raise ValueError(f"cand_ids: shape {cand.shape}, expected [n, c] with c <= {TOP}")
    if cnt.shape != cand.shape:
        raise ValueError(f"counts: shape {cnt.shape}, expected {cand.shape} (as cand_ids)")
    if (cnt < 0).any():
        raise ValueError(f"counts: {cnt.min()} is negative")
    n, c = cand.shape
    t = _check_temperature(temperature, n)
    live = cnt > 0
    if ((cand < 0) | (cand >= vocab))[live].any():
        raise ValueError(f"cand_ids: {cand[live & ((cand < 0) | (cand >= vocab))][0]} outside 0..{vocab - 1}")
    key = np.where(live, cand, -1 - np.arange(c))  # dead slots: distinct negatives
    srt = np.sort(key, axis=1)
    if (srt[:, 1:] == srt[:, :-1]).any():
        raise ValueError("cand_ids: an id repeated among a row's candidates")
    order = np.lexsort((np.where(live, cand, vocab), -cnt), axis=1)  # count desc, id asc
    cand, cnt, live = (np.take_along_axis(a, order, 1) for a in (cand, cnt, live))
    # Pads: the free ids among 0..TOP+c-1 (at most c are taken, so TOP are free), ascending.
    taken = np.zeros((n, TOP + c), bool)
    rows = np.broadcast_to(np.arange(n)[:, None], cand.shape)
    near = live & (cand < TOP + c)
    taken[rows[near], cand[near]] = True
    free = np.argsort(taken, axis=1, kind="stable")[:, :TOP]
    k = live.sum(axis=1, keepdims=True)  # the live candidates come first after the sort
    slot = np.arange(TOP)
    padded = np.zeros((n, TOP), np.int64)
    padded[:, :c] = cand
    ids = np.where(slot < k, padded, np.take_along_axis(free, np.maximum(slot - k, 0), 1))
    with np.errstate(divide="ignore"):
        logc = np.log(cnt.astype(np.float64))  # -inf for no candidate: weight 0
    scores = np.full((n, TOP), -np.inf)
    scores[:, :c] = np.where(live, logc, -np.inf)
    return ids.astype(np.int32), weights_of(scores, t)

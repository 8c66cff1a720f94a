"""Sampled drafts' shared terms (SAMPLED_TOP32): the numbers both sides hold a draft's
distribution to, and the one check of it, for the drafter (:mod:`remote_dspark.drafter.sampling`,
which states the whole rule), the wire (:mod:`remote_dspark.wire`: its sections' sizes) and
the engine (:mod:`remote_dspark.engine.values.reply`: a reply's distributions). The proxy's
rounds hold a reply to the same check in C (``check_distributions`` in
``native/reply_check.c``, its twin: same order, same words).

A drafted position's distribution is ``TOP`` token ids and integer weights summing to
exactly ``TOTAL``: ``q = w / TOTAL`` is the distribution the draft was drawn from.

Part of the package's shared vocabulary: it imports nothing of the package, and numpy
only inside :func:`check_sampled` (the proxy process imports the wire, never numpy).
"""

from __future__ import annotations

TOP = 32  # ids per drafted position
TOTAL = 65535  # the weights' exact sum: q = w / TOTAL


def violation(ids, weights, tokens, vocab: int) -> tuple[int, str] | None:
    """The first drafted position (in row order) whose distribution breaks the rule, and
    the first part of the rule it breaks, in this order: an id outside ``0..vocab-1``, an
    id repeated, weights not summing to exactly ``TOTAL`` (or one outside 0..TOTAL), the
    drafted token not among the ids of weight > 0. None when every position holds.

    Args: ``ids`` and ``weights`` ``[m, TOP]`` integers, ``tokens`` ``[m]`` (shapes the
    caller's to check: :func:`check_sampled` does)."""
    import numpy as np

    ids, w, tokens = np.asarray(ids), np.asarray(weights), np.asarray(tokens)
    if w.dtype != np.uint16:  # any other integers: their values, in a range that cannot wrap
        w = w.astype(np.int64)
    if ids.dtype != np.int32:
        ids = ids.astype(np.int64)
    srt = np.sort(ids, axis=1)
    if _holds(np, ids, srt, w, tokens, vocab):
        return None
    # Something is wrong: the per-position masks, to name the first position and part.
    outside = ((ids < 0) | (ids >= vocab)).any(axis=1)
    same = srt[:, 1:] == srt[:, :-1]
    total = w.sum(axis=1, dtype=np.int64)
    weights_off = total != TOTAL
    if w.dtype != np.uint16:  # (a uint16 is always within 0..TOTAL)
        weights_off |= ((w < 0) | (w > TOTAL)).any(axis=1)
    absent = ~((ids == tokens[:, None]) & (w > 0)).any(axis=1)
    at = int(np.argmax(outside | same.any(axis=1) | weights_off | absent))
    if outside[at]:
        return at, f"id {ids[at][(ids[at] < 0) | (ids[at] >= vocab)][0]} outside 0..{vocab - 1}"
    if same[at].any():
        return at, f"id {srt[at, 1:][same[at]][0]} repeated"
    if weights_off[at]:
        return at, f"weights sum to {total[at]} (each 0..{TOTAL}), expected exactly {TOTAL}"
    return at, f"drafted token {tokens[at]} not among its ids of weight > 0"


def _holds(np, ids, srt, w, tokens, vocab: int) -> bool:
    """Whether every position keeps the rule, by whole-array tests (no per-row reduction
    but the weights' sums, which BLAS does for uint16 weights: float32 sums of at most
    32 x 65535 are exact)."""
    if ids.dtype == np.int32 and vocab <= 2**31:
        if (ids.view(np.uint32) >= vocab).any():  # a negative id is >= 2**31 as uint32
            return False
    elif ((ids < 0) | (ids >= vocab)).any():
        return False
    if (srt[:, 1:] == srt[:, :-1]).any():
        return False
    if w.dtype == np.uint16:
        total = w.astype(np.float32) @ np.ones(w.shape[1], np.float32)
    else:
        total = w.sum(axis=1)
        if ((w < 0) | (w > TOTAL)).any():
            return False
    if (total != TOTAL).any():
        return False
    # The ids are distinct (checked above), so each position lists its token at most once:
    # "among its ids of weight > 0" everywhere is one match per position.
    return int(np.count_nonzero((ids == tokens[:, None]) & (w > 0))) == len(tokens)


def check_sampled(ids, weights, tokens, vocab: int) -> str | None:
    """None when a reply's sampled section is valid at its drafted positions, else the
    reason (:func:`violation`), naming the position (in row order) and what is wrong.

    Args:
        ids: [m, TOP] token ids per drafted position.
        weights: [m, TOP] integer weights.
        tokens: [m] the drafted tokens.
        vocab: the engine's vocabulary size.
    """
    import numpy as np

    ids, w, tokens = np.asarray(ids), np.asarray(weights), np.asarray(tokens)
    m = len(tokens)
    if tokens.shape != (m,) or ids.shape != (m, TOP) or w.shape != (m, TOP):
        return f"shapes: ids {ids.shape}, weights {w.shape}, tokens {tokens.shape}; expected [m, {TOP}] twice and [m]"
    found = violation(ids, w, tokens, vocab)
    return None if found is None else f"position {found[0]}: {found[1]}"

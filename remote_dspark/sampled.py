"""Sampled drafts' shared terms (SAMPLED_TOP32): the numbers both sides hold a draft's
distribution to, the rule's randomness and pick (written once), and the one check of a
drafted position, for the drafter (:mod:`remote_dspark.drafter.sampling`, which states
the whole rule and re-exports these), the wire (:mod:`remote_dspark.wire`: its sections'
sizes) and the engine (:mod:`remote_dspark.engine.values.reply`: a reply's
distributions). The proxy's rounds hold a reply to the same check in C
(``check_distributions`` in ``native/reply_check.c``, its twin: same order, same words;
the hash and the pick in ``native/sampled_pick.h``, held equal bit for bit).

A drafted position's distribution is ``TOP`` token ids and integer weights summing to
exactly ``TOTAL``: ``q = w / TOTAL`` is the distribution the draft was drawn from, and
the draft is the pick (rule 3) from it at the entry's seed, the draft's absolute
position and its index (rule 1). Rules 1 and 3 live here, not beside rule 2 in the
drafter, because the engine checks every draft by them.

Part of the package's shared vocabulary: it imports nothing of the package, and numpy
only inside the functions that need it (the proxy process imports the wire, never
numpy). :func:`mix32`, :func:`hash_halves`, :func:`threshold` and :func:`pick_index`
use only operators, so the torch twin (:mod:`remote_dspark.drafter.lm.sampling`) runs
the same code.
"""

from __future__ import annotations

TOP = 32  # ids per drafted position
TOTAL = 65535  # the weights' exact sum: q = w / TOTAL
MASK32 = 0xFFFFFFFF
# mix32's odd multipliers, both below 2**31 (C. Wellons' hash-prospector 32-bit mixer
# with shifts 16, 15, 15; bias 0.108), and the lanes' keys (from the golden ratio).
# native/sampled_pick.h has the same numbers.
MIX_MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)
MIX_SHIFTS = (16, 15, 15)
LANE_KEYS = (0x9E3779B9, 0x7F4A7C15)


def mix32(x):
    """The bijective 32-bit mixer: ``x`` holds values in 0..2**32-1 (numpy uint64, or
    torch int64), the answer too. Written once, for both: only ``^``, ``>>``, ``*`` by
    a constant below 2**31 and ``&`` are used, on non-negative values."""
    (s0, s1, s2), (m0, m1) = MIX_SHIFTS, MIX_MULTIPLIERS
    x = x ^ (x >> s0)
    x = (x * m0) & MASK32
    x = x ^ (x >> s1)
    x = (x * m1) & MASK32
    return x ^ (x >> s2)


def hash_halves(seed_lo, seed_hi, pos_lo, pos_hi, draft):
    """Rule 1's hash of its five 32-bit inputs (each 0..2**32-1, broadcast together;
    numpy uint64 or torch int64), shared by both twins."""
    a = mix32(seed_lo ^ LANE_KEYS[0])
    b = mix32(seed_hi ^ LANE_KEYS[1])
    for x in (pos_lo, pos_hi, draft):
        a = mix32(a ^ x)
        b = mix32(b ^ x ^ LANE_KEYS[1])  # not a's step: equal lanes must not stay equal
    return mix32(a ^ b)


def _halves(np, x):
    bits = np.asarray(x).astype(np.uint64)  # int64 -> the same bits (two's complement)
    return bits & np.uint64(MASK32), bits >> np.uint64(32)


def uniform_u32(seed, position, draft):
    """Rule 1: a uniform uint32 per (seed, position, draft), broadcast together (numpy).

    Args:
        seed: uint64 per entry (int64 is read as the same bits).
        position: int64, the draft's absolute position in its sequence.
        draft: the draft's index in its round, 0..2**32-1.

    Returns: uint32 array of the broadcast shape.

    Raises:
        ValueError: a ``draft`` outside 0..2**32-1.
    """
    import numpy as np

    draft = np.asarray(draft, dtype=np.int64)
    if draft.size and (draft.min() < 0 or draft.max() > MASK32):
        raise ValueError(f"draft index {draft.min()}..{draft.max()}: expected 0..{MASK32}")
    s_lo, s_hi = _halves(np, seed)
    p_lo, p_hi = _halves(np, np.asarray(position, dtype=np.int64))
    return hash_halves(s_lo, s_hi, p_lo, p_hi, draft.astype(np.uint64)).astype(np.uint32)


def threshold(u32):
    """Rule 3's ``r = (u32 * TOTAL) >> 32``, in 0..TOTAL-1: ``u32`` holds values below
    2**32 (numpy uint64, or torch int64), so the product stays below 2**48. Written once,
    for both twins."""
    return (u32 * TOTAL) >> 32


def pick_index(weights, r):
    """Rule 3's index: the first ``i`` with ``cumsum(weights)[i] > r``, at most TOP - 1
    (only weights short of TOTAL get past it). ``weights`` [..., TOP] and ``r`` [...],
    both int64 (numpy or torch); written once, for both twins."""
    return (weights.cumsum(-1) <= r[..., None]).sum(-1).clip(max=TOP - 1)


def pick(ids, weights, u32):
    """Rule 3: the drawn token of each row (``ids``, ``weights`` [..., TOP]; ``u32``
    [...] uint32), in numpy. Returns [...] int32."""
    import numpy as np

    ids, w = np.asarray(ids), np.asarray(weights, dtype=np.int64)
    r = threshold(np.asarray(u32).astype(np.uint64)).astype(np.int64)
    i = np.asarray(pick_index(w, r))  # (a single row's index is a scalar)
    return np.take_along_axis(ids, i[..., None], -1)[..., 0].astype(np.int32)


def violation(ids, weights, tokens, vocab: int, at=None) -> tuple[int, str] | None:
    """The first drafted position (in row order) whose distribution breaks the rule, and
    the first part of the rule it breaks, in this order: an id outside ``0..vocab-1``, an
    id repeated, weights not summing to exactly ``TOTAL`` (or one outside 0..TOTAL), the
    drafted token not among the ids of weight > 0, weights that rise along the ids (rule
    2 lists them non-increasing; equal weights in any order), the drafted token not the
    pick (rule 3) at its draw (``at``). None when every position holds.

    Args: ``ids`` and ``weights`` ``[m, TOP]`` integers, ``tokens`` ``[m]`` (shapes the
    caller's to check: :func:`check_sampled` does); ``at``: ``(seed, position, draft)``,
    each ``[m]``, the draw of each position (rule 1's inputs: the entry's seed, the
    draft's absolute position and its index), or None to leave the pick unchecked."""
    import numpy as np

    ids, w, tokens = np.asarray(ids), np.asarray(weights), np.asarray(tokens)
    if w.dtype != np.uint16:  # any other integers: their values, in a range that cannot wrap
        w = w.astype(np.int64)
    if ids.dtype != np.int32:
        ids = ids.astype(np.int64)
    srt = np.sort(ids, axis=1)
    rising = w[:, 1:] > w[:, :-1]
    picked = None if at is None else pick(ids, w, uniform_u32(*at))
    if _holds(np, ids, srt, w, tokens, vocab, rising, picked):
        return None
    # Something is wrong: the per-position masks, to name the first position and part.
    outside = ((ids < 0) | (ids >= vocab)).any(axis=1)
    same = srt[:, 1:] == srt[:, :-1]
    total = w.sum(axis=1, dtype=np.int64)
    weights_off = total != TOTAL
    if w.dtype != np.uint16:  # (a uint16 is always within 0..TOTAL)
        weights_off |= ((w < 0) | (w > TOTAL)).any(axis=1)
    absent = ~((ids == tokens[:, None]) & (w > 0)).any(axis=1)
    other = np.zeros(len(tokens), bool) if picked is None else picked != tokens
    at_ = int(np.argmax(outside | same.any(axis=1) | weights_off | absent | rising.any(axis=1) | other))
    if outside[at_]:
        return at_, f"id {ids[at_][(ids[at_] < 0) | (ids[at_] >= vocab)][0]} outside 0..{vocab - 1}"
    if same[at_].any():
        return at_, f"id {srt[at_, 1:][same[at_]][0]} repeated"
    if weights_off[at_]:
        return at_, f"weights sum to {total[at_]} (each 0..{TOTAL}), expected exactly {TOTAL}"
    if absent[at_]:
        return at_, f"drafted token {tokens[at_]} not among its ids of weight > 0"
    if rising[at_].any():
        k = int(np.argmax(rising[at_]))
        return at_, f"weights rise at index {k + 1} ({w[at_, k]}, then {w[at_, k + 1]}): expected non-increasing"
    position = int(np.asarray(at[1])[at_])
    return at_, f"drafted token {tokens[at_]}, the pick at its seed and position {position} is {picked[at_]}"


def _holds(np, ids, srt, w, tokens, vocab: int, rising, picked) -> bool:
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
    if (total != TOTAL).any() or rising.any():
        return False
    if picked is not None:  # the pick holds weight > 0 (the sum is TOTAL): so the token is listed
        return bool((picked == tokens).all())
    # The ids are distinct (checked above), so each position lists its token at most once:
    # "among its ids of weight > 0" everywhere is one match per position.
    return int(np.count_nonzero((ids == tokens[:, None]) & (w > 0))) == len(tokens)


def check_sampled(ids, weights, tokens, vocab: int, at=None) -> str | None:
    """None when a reply's sampled section is valid at its drafted positions, else the
    reason (:func:`violation`), naming the position (in row order) and what is wrong.

    Args:
        ids: [m, TOP] token ids per drafted position.
        weights: [m, TOP] integer weights.
        tokens: [m] the drafted tokens.
        vocab: the engine's vocabulary size.
        at: ``(seed, position, draft)``, each [m]: each position's draw (rule 1), so
            that its token is held to the pick; None: the pick unchecked.
    """
    import numpy as np

    ids, w, tokens = np.asarray(ids), np.asarray(weights), np.asarray(tokens)
    m = len(tokens)
    if tokens.shape != (m,) or ids.shape != (m, TOP) or w.shape != (m, TOP):
        return f"shapes: ids {ids.shape}, weights {w.shape}, tokens {tokens.shape}; expected [m, {TOP}] twice and [m]"
    if at is not None and any(np.shape(a) != (m,) for a in at):
        return f"draws: shapes {[np.shape(a) for a in at]}, expected [m] each (seed, position, draft)"
    found = violation(ids, w, tokens, vocab, at)
    return None if found is None else f"position {found[0]}: {found[1]}"

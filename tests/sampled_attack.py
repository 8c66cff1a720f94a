"""Sampled-draft attackers, for tests of the engine's defences (not a test module).

A worker that wants the engine to emit its token ``t`` drafts ``t`` and reports a ``q``
giving ``t`` as little weight as it can: the exact sampler accepts a draft with
probability ``min(1, p(t) / q(t))``, so the smaller ``q(t)``, the likelier ``t`` is kept.

- :func:`naive_q`: ``t`` listed last with weight 1, the rest spread (non-increasing).
  Every other part of the rule holds; the draft is not the pick at its draw, which the
  reply check refuses.
- :func:`adaptive_q`: the attacker knows the draw (the seed and the position travel in
  the ROUND), so it builds a ``q`` that is valid in every way (distinct ids, weights
  non-increasing and summing to 65535) and whose pick at that draw is ``t``, with the
  least weight ``t`` can have there. The reply check cannot tell it from an honest
  drafter's; only an engine that redraws each draft with its own randomness can.
"""

from __future__ import annotations

import numpy as np

from remote_dspark.sampled import TOP, TOTAL, threshold, uniform_u32


def _others(token: int) -> list[int]:
    """TOP - 1 distinct ids other than ``token`` (any will do: the smallest)."""
    return [i for i in range(TOP + 1) if i != token][: TOP - 1]


def naive_q(token: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [TOP] int32, weights [TOP] uint16): ``token`` last with weight 1, the other
    ids sharing 65534 evenly (larger shares first)."""
    spread = [(TOTAL - 1) // (TOP - 1) + (m < (TOTAL - 1) % (TOP - 1)) for m in range(TOP - 1)]
    return np.array(_others(token) + [token], np.int32), np.array(spread + [1], np.uint16)


def least_weight(r: int, top: int = TOP, total: int = TOTAL) -> tuple[int, int]:
    """(weight, index): the least weight an id can have and still be rule 3's pick for
    threshold ``r`` in a valid non-increasing ``q`` of ``top`` ids summing to ``total``,
    and where it goes.

    At index ``i`` the pick needs the ``i`` ids before it to sum to at most ``r`` and
    the token's weight ``w`` to take the sum past ``r``; the ids after it hold at most
    ``w`` each. So ``r + (top - i) * w >= total`` (the sum is reached) and, for
    ``i > 0``, ``i * w <= r`` (the ids before it weigh at least ``w``); at ``i = 0``,
    ``w > r`` and ``top * w >= total``. The least ``w`` over all ``i``."""
    best = (max(r + 1, -(-total // top)), 0)
    for i in range(1, top):
        w = max(1, -(-(total - r) // (top - i)))
        if i * w <= r and w < best[0]:
            best = (w, i)
    return best


def adaptive_rows(r, token: int, others) -> tuple[np.ndarray, np.ndarray]:
    """(ids [..., TOP] int32, weights [..., TOP] uint16) for thresholds ``r`` [...]: for
    each, a ``q`` valid in every way whose pick at ``r`` is ``token`` with the least
    weight :func:`least_weight` finds, ``others`` (TOP - 1 distinct ids without
    ``token``) filling the other places. As arrays, for many draws at once: ``token``
    second, after one weight of ``r``, with ``ceil((TOTAL - r) / (TOP - 1))`` where
    ``r`` is at least that (index 1 is the least weight when it is allowed at all),
    else first with ``max(r + 1, ceil(TOTAL / TOP))``; the rest spread evenly."""
    r = np.asarray(r, np.int64)
    w2 = np.maximum(1, -(-(TOTAL - r) // (TOP - 1)))
    second = r >= w2
    w1 = np.maximum(r + 1, -(-TOTAL // TOP))

    def spread(total, slots):  # non-increasing, summing to total
        return total[..., None] // slots + (np.arange(slots) < (total % slots)[..., None])

    as_second = np.concatenate((r[..., None], w2[..., None], spread(TOTAL - r - w2, TOP - 2)), -1)
    as_first = np.concatenate((w1[..., None], spread(TOTAL - w1, TOP - 1)), -1)
    others = np.asarray(others, np.int64)
    ids = np.where(second[..., None], np.r_[others[:1], token, others[1:]], np.r_[token, others])
    return ids.astype(np.int32), np.where(second[..., None], as_second, as_first).astype(np.uint16)


def adaptive_q(seed: int, position: int, draft_index: int, token: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [TOP] int32, weights [TOP] uint16): :func:`adaptive_rows` at the draw of
    (``seed``, ``position``, ``draft_index``), the other ids 0..TOP without ``token`` (a
    vocabulary of at least TOP + 1 ids)."""
    u = uniform_u32(np.uint64(seed), np.int64(position), draft_index)
    return adaptive_rows(threshold(np.uint64(u)).astype(np.int64), token, _others(token))

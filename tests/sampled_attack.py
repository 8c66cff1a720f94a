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


def adaptive_q(seed: int, position: int, draft_index: int, token: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [TOP] int32, weights [TOP] uint16): a ``q`` valid in every way whose pick at
    (``seed``, ``position``, ``draft_index``) is ``token``, with the least weight on
    ``token`` (:func:`least_weight`). Ids other than ``token`` are 0..TOP (a vocabulary
    of at least TOP + 1 ids)."""
    u = uniform_u32(np.uint64(seed), np.int64(position), draft_index)
    r = int(threshold(np.uint64(u)))
    w, i = least_weight(r)
    prefix = [r - (i - 1) * w] + [w] * (i - 1) if i else []  # sums to r, each >= w
    rest = TOTAL - sum(prefix) - w
    tail = []
    for _ in range(TOP - 1 - i):  # at most w each, non-increasing, the rest of TOTAL
        tail.append(min(w, rest))
        rest -= tail[-1]
    assert rest == 0, (r, w, i)
    others = _others(token)
    return np.array(others[:i] + [token] + others[i:], np.int32), np.array(prefix + [w] + tail, np.uint16)

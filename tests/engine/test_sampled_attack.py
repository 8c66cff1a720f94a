"""What the reply check's pick rule stops, and what it cannot (``tests/sampled_attack.py``'s
attackers against ``remote_dspark.sampled.check_sampled`` and the engine's exact sampler).

The naive attacker (its token listed last with weight 1) is refused: its draft is not
the pick. The adaptive attacker, which reads the seed and the position in the ROUND and
builds ``q`` around the draw, passes the check at every draw and, through
``rejection_sample`` with a uniform target (p(token) = 1%), still has its token emitted
first in about two thirds of rounds: the residual hole, which only an engine that
redraws each draft closes. Fixed seeds throughout."""

from __future__ import annotations

import numpy as np
import torch
from sampled_attack import adaptive_q, least_weight, naive_q

from remote_dspark.engine.sampler import rejection_sample
from remote_dspark.sampled import TOP, TOTAL, check_sampled, pick, threshold, uniform_u32

VOCAB, TOKEN = 100, 7


def draws(n: int, k: int, seed: int = 48) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seed [n * k], position [n * k], draft [n * k]): k drafts of n entries, the seeds
    over the whole u64 range, positions past 2**32 too."""
    rng = np.random.default_rng(seed)
    seeds = rng.integers(0, 2**64, n, dtype=np.uint64)
    first = rng.integers(0, 2**33, n).astype(np.int64)
    j = np.arange(k)
    return np.repeat(seeds, k), (first[:, None] + j).ravel(), np.tile(j, n)


def test_the_naive_attacker_s_draft_is_not_the_pick_and_is_refused():
    seed, position, draft = draws(200, 3)
    ids, w = naive_q(TOKEN)
    ids, w = np.broadcast_to(ids, (600, TOP)), np.broadcast_to(w, (600, TOP))
    why = check_sampled(ids, w, np.full(600, TOKEN), VOCAB, (seed, position, draft))
    assert why is not None and f"drafted token {TOKEN}, the pick at its seed and position" in why
    assert check_sampled(ids, w, np.full(600, TOKEN), VOCAB) is None  # all else holds: only the pick refuses it


def test_the_adaptive_attacker_passes_the_check_and_lands_on_its_token_with_the_least_weight():
    seed, position, draft = draws(300, 3)
    q = [adaptive_q(int(s), int(p), int(j), TOKEN) for s, p, j in zip(seed, position, draft)]
    ids, w = np.stack([a for a, _ in q]), np.stack([b for _, b in q])
    assert (w.astype(np.int64).sum(axis=1) == TOTAL).all() and not (w[:, 1:] > w[:, :-1]).any()
    assert check_sampled(ids, w, np.full(len(q), TOKEN), VOCAB, (seed, position, draft)) is None
    assert (pick(ids, w, uniform_u32(seed, position, draft)) == TOKEN).all()
    held = w[ids == TOKEN]
    r = threshold(uniform_u32(seed, position, draft).astype(np.uint64)).astype(np.int64)
    assert held.tolist() == [least_weight(int(x))[0] for x in r]
    # far below an honest drafter's share wherever the draw is high: a sliver of weight
    assert (held[r >= TOTAL - 31] == 1).all() and np.median(held) < 2 * TOTAL // TOP


def test_least_weight_is_the_least_over_every_valid_non_increasing_q():
    """Brute force over a 4-id toy of the same rule (weights summing to 12): for each
    threshold r, the least weight an id can have where the pick lands on it, over every
    non-increasing q, is ``least_weight``'s."""
    import itertools

    top, total = 4, 12
    for r in range(total):
        brute = min(
            ws[i]
            for ws in itertools.product(range(total + 1), repeat=top)
            if sum(ws) == total and all(a >= b for a, b in zip(ws, ws[1:]))
            for i in range(top)
            if sum(ws[:i]) <= r < sum(ws[: i + 1])
        )
        assert least_weight(r, top, total)[0] == brute, r


def emitted_first(ids, w, tokens, n: int, k: int) -> float:
    """The fraction of n rounds whose first emitted token is TOKEN, through the exact
    sampler with a uniform target over VOCAB (p(TOKEN) = 1%)."""
    p = torch.full((n, k + 1, VOCAB), 1.0 / VOCAB)
    out, _ = rejection_sample(
        p,
        torch.from_numpy(tokens.reshape(n, k).astype(np.int64)),
        torch.full((n,), k),
        torch.from_numpy(ids.reshape(n, k, TOP).astype(np.int32)),
        torch.from_numpy(w.reshape(n, k, TOP).astype(np.uint16)),
        generator=torch.Generator().manual_seed(7),
    )
    return float((out[:, 0] == TOKEN).double().mean())


def test_the_adaptive_attacker_still_moves_the_output_the_residual_hole():
    """1,000 rounds of 3 drafts: token 7 comes first in about 67% (the binomial's standard
    error is 1.5%; the bound is 10 of them away), where the target gives it 1%."""
    n, k = 1000, 3
    seed, position, draft = draws(n, k)
    q = [adaptive_q(int(s), int(p), int(j), TOKEN) for s, p, j in zip(seed, position, draft)]
    ids, w = np.stack([a for a, _ in q]), np.stack([b for _, b in q])
    assert emitted_first(ids, w, np.full(n * k, TOKEN), n, k) > 0.5

"""``engine.sampler.redraw``: the engine's own draws make speculative sampling exact
whatever the worker sends.

The target is context-free (p_j, the distribution of a round's (j+1)-th token, is fixed),
so a round is exact when, for every l, the l-th emitted token, given that it is emitted
and given the tokens before it, is distributed as p_{l-1}. Three workers: an honest one
(its drafts drawn from its q at its uniforms), a naive attacker (token 7 drafted, listed
last with weight 1) and an adaptive one (it knows where its uniform lands and gives token
7 the least weight, with the weights still non-increasing, that makes the pick land on
it). Checked two ways: sampled (20,000 rounds of seeded generators, total variation against
p) and exactly (every engine draw enumerated, the sampler's rule written out in
fractions). Each test also shows the check has teeth: without the redraw the attackers
move the output, and the two near variants of the redraw (dropping the mismatching
position; keeping the worker's draft there) fail it.

An adaptive worker is a mixture of fixed (drafts, q) replies chosen before the engine
draws, so the exact check over fixed replies covers it.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch
from sampled_attack import adaptive_rows

from remote_dspark.drafter.lm.sampling import pick
from remote_dspark.engine.sampler import Q_SCALE, redraw, rejection_sample

V, K, TOP, N = 40, 3, 32, 20_000
BAD = 7  # the attackers' token; p(7) = 1 % at every position
NOISE_X = 2.5  # a check's bound: this many times the total variation sampling alone gives, on average


def target() -> torch.Tensor:
    """p_0 .. p_K [K + 1, V] float32: 70 % on token 3 + j, 1 % on token 7, the rest random."""
    gen = torch.Generator().manual_seed(11)
    p = torch.rand(K + 1, V, generator=gen, dtype=torch.float64)
    p[:, BAD] = 0
    for j in range(K + 1):
        p[j, 3 + j] = 0
    p = p / p.sum(1, keepdim=True) * 0.29
    p[:, BAD] = 0.01
    for j in range(K + 1):
        p[j, 3 + j] = 0.7
    return p.float()


def honest_q(p: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An honest drafter's q per position [K, 32]: the top 32 of a distribution near
    p_j, weights descending, summing to 65535."""
    r = torch.softmax(p[:K].double().log() + 0.5 * torch.randn(K, V, generator=gen, dtype=torch.float64), dim=1)
    top, ids = r.topk(TOP, dim=1)
    w = torch.floor(top / top.sum(1, keepdim=True) * Q_SCALE).long()
    w[:, 0] += Q_SCALE - w.sum(1)
    return ids.int(), w


def u32_of(r: torch.Tensor) -> torch.Tensor:
    """The least u32 whose pick threshold ``(u32 * 65535) >> 32`` is ``r``."""
    return (r.long() * 2**32 + Q_SCALE - 1) // Q_SCALE


def workers(p: torch.Tensor, n: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """name -> (drafts [n, K], q_ids [n, K, 32], q_weights [n, K, 32]) of each worker."""
    gen = torch.Generator().manual_seed(seed)
    ids, w = honest_q(p, gen)
    ids, w = ids.expand(n, K, TOP), w.expand(n, K, TOP)
    r = torch.randint(0, Q_SCALE, (n, K), generator=gen)  # the workers' uniforms (the worker knows them)
    out = {"honest": (pick(ids, w, u32_of(r)), ids, w)}
    others = torch.tensor([t for t in range(V) if t != BAD][:31], dtype=torch.int32)
    # Naive: 31 honest-looking weights over the other tokens, then token 7 with weight 1.
    nw = torch.tensor([65534 // 31] * 31 + [1])  # 31 x 2114 = 65534, then 1
    nids = torch.cat((others, torch.tensor([BAD], dtype=torch.int32)))
    out["naive"] = (torch.full((n, K), BAD), nids.expand(n, K, TOP), nw.expand(n, K, TOP))
    ids_a, w_a = adaptive_rows(r.numpy(), BAD, others.numpy())
    out["adaptive"] = (torch.full((n, K), BAD), torch.from_numpy(ids_a), torch.from_numpy(w_a.astype("int64")))
    for name, (d, i, wt) in out.items():
        assert (wt.sum(-1) == Q_SCALE).all() and (wt[..., :-1] >= wt[..., 1:]).all(), name
        is_pick = torch.equal(pick(i, wt, u32_of(r)).long(), d.long())
        assert is_pick == (name != "naive"), name  # the naive draft is no pick; the others pass that check
    return out


# --- the variants: the redraw, and two that look like it and are not exact ------------


def first_mismatch(tokens, counts, q_ids, q_weights, u32):
    """The engine's picks x [n, K] and m [n], the first drafted j with x_j != d_j (c if none)."""
    x = pick(q_ids, q_weights, u32).long()
    drafted = torch.arange(K) < counts.long().unsqueeze(1)
    same = ~(drafted & (x != tokens.long()))
    return x, torch.minimum(same.long().cumprod(1).sum(1), counts.long())


def drop_mismatch(tokens, counts, q_ids, q_weights, u32):
    """NOT exact: drafts only while the engine's draw equals the worker's (count' = m)."""
    x, m = first_mismatch(tokens, counts, q_ids, q_weights, u32)
    return torch.where(torch.arange(K) < m.unsqueeze(1), x, 0), m


def keep_worker_draft(tokens, counts, q_ids, q_weights, u32):
    """NOT exact: as the redraw, but the worker's draft at the mismatching position."""
    x, m = first_mismatch(tokens, counts, q_ids, q_weights, u32)
    kept = torch.minimum(m + 1, counts.long())
    columns = torch.arange(K)
    x = torch.where(columns == m.unsqueeze(1), tokens.long(), x)
    return torch.where(columns < kept.unsqueeze(1), x, 0), kept


def none(tokens, counts, q_ids, q_weights, u32):
    return tokens, counts


def exact(tokens, counts, q_ids, q_weights, u32):
    return redraw(tokens, counts, q_ids, q_weights, u32=u32)


VARIANTS = {"redraw": exact, "none": none, "drop": drop_mismatch, "keep": keep_worker_draft}


def tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    """Total variation of ``samples``' frequencies from ``p``, over :func:`noise`'s bound
    for their number: below 1 passes the check."""
    freq = torch.bincount(samples.long(), minlength=V).double() / len(samples)
    return 0.5 * float((freq - p.double()).abs().sum()) / (NOISE_X * noise(p, len(samples)))


def noise(p: torch.Tensor, n: int) -> float:
    """The mean total variation of n samples of p from p (normal approximation, about
    0.01 at n = 20,000 here; its spread is a few percent of it)."""
    p = p.double()
    return 0.5 * float((2 * p * (1 - p) / (torch.pi * n)).sqrt().sum())


def emitted_distance(variant: str, worker: str) -> tuple[float, float, float]:
    """(the first emitted token's distance from p_0, the second's, where one came, from
    p_1, each over its bound (:func:`tv`), the first token's rate of 7) over N rounds."""
    p = target()
    d, ids, w = workers(p, N, seed=5)[worker]
    counts = torch.full((N,), K, dtype=torch.int32)
    u32 = u32_of(torch.randint(0, Q_SCALE, (N, K), generator=torch.Generator().manual_seed(6)))
    tokens, counts = VARIANTS[variant](d.int(), counts, ids, w.to(torch.uint16), u32)
    out, emitted = rejection_sample(
        p.expand(N, K + 1, V), tokens, counts, ids, w.to(torch.uint16), generator=torch.Generator().manual_seed(7)
    )
    two = emitted >= 2
    return tv(out[:, 0], p[0]), tv(out[two, 1], p[1]), float((out[:, 0] == BAD).double().mean())


@pytest.mark.parametrize("worker", ["honest", "naive", "adaptive"])
def test_redrawn_drafts_emit_the_target_whatever_the_worker(worker):
    first, second, bad = emitted_distance("redraw", worker)
    assert first < 1 and second < 1, (first, second)
    assert bad < 0.02, bad  # p(7) = 1 %


@pytest.mark.parametrize("worker", ["naive", "adaptive"])
def test_without_the_redraw_the_attackers_move_the_output(worker):
    first, _, bad = emitted_distance("none", worker)
    assert first > 10 and bad > 0.2, (first, bad)


@pytest.mark.parametrize(("variant", "worker"), [("drop", "honest"), ("keep", "naive"), ("keep", "adaptive")])
def test_the_near_variants_fail_the_same_check(variant, worker):
    first, second, _ = emitted_distance(variant, worker)
    assert max(first, second) > 2, (first, second)


# --- exactly: every engine draw enumerated, the sampler's rule in fractions ------------

P_SMALL = [  # context-free rows over tokens 0..3 (the rest of the 32 ids: 0)
    [Fraction(1, 2), Fraction(1, 4), Fraction(1, 4), 0],
    [Fraction(1, 5), Fraction(2, 5), Fraction(1, 5), Fraction(1, 5)],
    [Fraction(1, 3), 0, Fraction(1, 3), Fraction(1, 3)],
]
Q_SMALL = [[30000, 20000, 15534, 1], [65535 - 3, 1, 1, 1]]  # weights over ids 0..3 per position


def outcomes(x, c, q, p) -> dict[tuple[int, ...], Fraction]:
    """The sampler's rule as fractions: the emitted sequences of a round verifying drafts
    ``x[:c]`` under ``q`` (weights per position) and ``p`` (rows), with their probabilities."""
    out: dict[tuple[int, ...], Fraction] = {}
    reach = Fraction(1)
    for j in range(c + 1):
        if j == c:  # every draft accepted: the bonus row
            for t, pt in enumerate(p[j]):
                out[tuple(x[:j]) + (t,)] = out.get(tuple(x[:j]) + (t,), 0) + reach * pt
            break
        qj = [Fraction(w, Q_SCALE) for w in q[j]]
        accept = min(Fraction(1), p[j][x[j]] / qj[x[j]])
        residual = [max(Fraction(0), p[j][t] - qj[t]) for t in range(4)]
        total = sum(residual)
        rows = residual if total else p[j]
        for t in range(4):
            if rows[t]:
                key = tuple(x[:j]) + (t,)
                out[key] = out.get(key, 0) + reach * (1 - accept) * rows[t] / (total or 1)
        reach *= accept
    return out


def round_law(variant, d: list[int], c: int) -> dict[tuple[int, ...], Fraction]:
    """The emitted sequences' law for a worker's fixed drafts ``d`` (count ``c``) over every
    engine draw (ids 0..3 at each position with probability weight / 65535)."""
    law: dict[tuple[int, ...], Fraction] = {}
    ids = torch.arange(TOP, dtype=torch.int32).expand(1, K, TOP)
    w = torch.zeros(1, K, TOP, dtype=torch.int64)
    for j in range(c):
        w[0, j, :4] = torch.tensor(Q_SMALL[j])
    for draw in itertools.product(range(4), repeat=c):
        chance = Fraction(1)
        r = torch.zeros(1, K, dtype=torch.int64)
        for j, i in enumerate(draw):
            chance *= Fraction(Q_SMALL[j][i], Q_SCALE)
            r[0, j] = sum(Q_SMALL[j][:i])  # the first threshold that picks id i
        tokens = torch.tensor([d + [0] * (K - c)], dtype=torch.int32)
        x, kept = VARIANTS[variant](tokens, torch.tensor([c], dtype=torch.int32), ids, w, u32_of(r))
        for seq, prob in outcomes(x[0].tolist(), int(kept[0]), Q_SMALL, P_SMALL).items():
            law[seq] = law.get(seq, 0) + chance * prob
    return law


def is_target(law: dict[tuple[int, ...], Fraction]) -> bool:
    """Each emitted token, given that it is emitted and the tokens before it, is p's."""
    for prefix in {s[:length] for s in law for length in range(len(s))}:
        reach = sum(v for s, v in law.items() if len(s) > len(prefix) and s[: len(prefix)] == prefix)
        j = len(prefix)
        for t in range(4):
            here = sum(v for s, v in law.items() if len(s) > j and s[: j + 1] == prefix + (t,))
            if here != reach * P_SMALL[j][t]:
                return False
    return True


@pytest.mark.parametrize("c", [1, 2])
def test_the_redraw_is_exact_for_every_reply(c):
    """Every fixed reply (drafts among ids 0..3, the sliver-weight id 3 included) over
    every engine draw: the redraw's law is the target's exactly; without it, or with
    either near variant, some reply's is not."""
    replies = list(itertools.product(range(4), repeat=c))
    assert all(is_target(round_law("redraw", list(d), c)) for d in replies)
    for variant in ("none", "drop", "keep"):
        assert not all(is_target(round_law(variant, list(d), c)) for d in replies), variant


def test_redraw_keeps_matching_drafts_and_the_first_mismatch():
    """Two positions: the engine's picks by hand. q = ids 0, 1 at weights 30000, 35535."""
    ids = torch.arange(TOP, dtype=torch.int32).expand(3, 2, TOP)
    w = torch.zeros(3, 2, TOP, dtype=torch.int64)
    w[..., 0], w[..., 1] = 30000, 35535
    r = torch.tensor([[0, 40000], [40000, 40000], [0, 0]])  # picks 0,1 / 1,1 / 0,0
    tokens = torch.tensor([[0, 0], [1, 1], [1, 0]], dtype=torch.int32)
    out, kept = redraw(tokens, torch.tensor([2, 2, 1], dtype=torch.int32), ids, w, u32=u32_of(r))
    assert kept.tolist() == [2, 2, 1] and out.tolist() == [[0, 1], [1, 1], [0, 0]]
    assert out.dtype == torch.int32 and kept.dtype == torch.int32
    out, kept = redraw(tokens, torch.tensor([0, 1, 2], dtype=torch.int32), ids, w, u32=u32_of(r))
    assert kept.tolist() == [0, 1, 1] and out.tolist() == [[0, 0], [1, 0], [0, 0]]


def test_redraw_draws_each_id_with_its_weight():
    """The engine's own uniforms: an id of weight w comes w / 65535 of the time."""
    n = 200_000
    ids = torch.arange(TOP, dtype=torch.int32).expand(n, 1, TOP)
    w = torch.zeros(n, 1, TOP, dtype=torch.int64)
    w[..., 0], w[..., 1] = 6553, Q_SCALE - 6553
    out, _ = redraw(
        torch.ones(n, 1, dtype=torch.int32),
        torch.ones(n, dtype=torch.int32),
        ids,
        w.to(torch.uint16),
        generator=torch.Generator().manual_seed(3),
    )
    rate = float((out[:, 0] == 0).double().mean())
    assert abs(rate - 0.1) < 5 * (0.1 * 0.9 / n) ** 0.5, rate


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tokens": torch.zeros(2, 3, 4, dtype=torch.int32)}, "tokens"),
        ({"counts": torch.zeros(3, dtype=torch.int32)}, "counts"),
        ({"q_ids": torch.zeros(2, 3, 16, dtype=torch.int32)}, "q_ids"),
        ({"q_weights": torch.zeros(2, 3, 32)}, "q_weights"),
        ({"u32": torch.zeros(2, 2, dtype=torch.int64)}, "u32"),
        ({"tokens": torch.zeros(2, 3)}, "tokens"),
        ({"counts": torch.zeros(2, dtype=torch.int32, device="meta")}, "counts"),
    ],
)
def test_redraw_names_a_bad_argument(change, named):
    args = {
        "tokens": torch.zeros(2, 3, dtype=torch.int32),
        "counts": torch.zeros(2, dtype=torch.int32),
        "q_ids": torch.zeros(2, 3, TOP, dtype=torch.int32),
        "q_weights": torch.zeros(2, 3, TOP, dtype=torch.uint16),
    } | change
    with pytest.raises(ValueError, match=f"^{named} "):
        redraw(**args)

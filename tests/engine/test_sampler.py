"""The batched rejection sampler (engine.sampler): equal to the rule written with loops
and exact fractions, lossless in distribution, greedy as token matching, the same on a
GPU with no host sync, and shape errors named."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from helpers import P_VALUE_MIN, chi2_p
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark.engine.sampler import Q_SCALE, q_dense, rejection_sample

K = 32
BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))
"""The largest float32 below 1: the most extreme uniform."""


# --- cases --------------------------------------------------------------------------


def weights_summing(rng, raw) -> np.ndarray:
    """Integer weights proportional to ``raw`` (non-negative, some > 0) summing to 65535."""
    w = np.floor(raw / raw.sum() * Q_SCALE).astype(np.int64)
    w[np.argmax(raw)] += Q_SCALE - w.sum()
    return w


def make_case(seed: int, n: int, k: int, vocab: int, flavour: str, extremes: bool):
    """A round as numpy arrays: p (float32, NaN in rows past the bonus row), drafts
    sampled from q, counts, q's ids and weights (garbage at padding), uniforms."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(vocab)[:K] for _ in range(n * max(k, 1))])[: n * k].reshape(n, k, K)
    raw = rng.integers(0, 6, (n, k, K)) * rng.integers(1, 1000, (n, k, K)) + 0.0
    raw[..., 0] += 1  # some weight somewhere
    weights = (
        np.stack([weights_summing(rng, r) for r in raw.reshape(-1, K)]).reshape(n, k, K) if k else raw.astype(np.int64)
    )
    drafts = np.zeros((n, k), np.int64)
    for i, j in np.ndindex(n, k):
        drafts[i, j] = ids[i, j, rng.choice(K, p=weights[i, j] / Q_SCALE)]
    ints = rng.integers(0, 9, (n, k + 1, vocab)) * (rng.random((n, k + 1, vocab)) < 0.6)
    ints[..., rng.integers(vocab)] += 1
    p = (ints / ints.sum(-1, keepdims=True)).astype(np.float32)
    for i, j in np.ndindex(n, k):
        dense = np.zeros(vocab, np.float64)
        dense[ids[i, j]] = weights[i, j] / Q_SCALE
        if flavour == "p_like_q" and rng.random() < 0.7:  # q rounded down: p <= q everywhere
            near = dense.astype(np.float32)
            p[i, j] = np.where(near > dense, np.nextafter(near, np.float32(0)), near)
        elif flavour == "one_hot":  # greedy: q one-hot on the draft, p one-hot half the time on it
            weights[i, j] = 0
            weights[i, j, 0] = Q_SCALE
            drafts[i, j] = ids[i, j, 0]
            p[i, j] = 0
            p[i, j, drafts[i, j] if rng.random() < 0.5 else rng.integers(vocab)] = 1
    counts = rng.integers(0, k + 1, n)
    u = rng.random((n, k + 1), dtype=np.float32)
    if extremes:
        u[rng.random(u.shape) < 0.3] = 0.0
        u[rng.random(u.shape) < 0.3] = BELOW_ONE
    for i in range(n):  # padding: anything at all
        drafts[i, counts[i] :] = -7
        ids[i, counts[i] :] = 10**6
        weights[i, counts[i] :] = 1234
        p[i, counts[i] + 1 :] = np.nan
    return p, drafts, counts, ids.astype(np.int32), weights.astype(np.uint16), u


def as_tensors(case, device="cpu"):
    p, drafts, counts, ids, weights, u = case
    out = [torch.from_numpy(a).to(device) for a in (p, drafts, counts, ids)]
    out.append(torch.from_numpy(weights.astype(np.int32)).to(torch.uint16).to(device))
    out.append(torch.from_numpy(u).to(device))
    return out


# --- the rule, with loops and exact fractions -----------------------------------------


def inverse_cdf(mass: list[Fraction], u: Fraction) -> int:
    target, running = u * sum(mass), Fraction(0)
    for token, m in enumerate(mass):
        running += m
        if running > target:
            return token
    raise AssertionError("no mass")


def reference(p, drafts, counts, ids, weights, u):
    """The rule for each entry in turn: accept d_j iff u_j < p_j(d_j) / q_j(d_j); at the
    first rejection draw from max(0, p_j - q_j) (p_j when that is all zero), else from
    the bonus row; the draw is the inverse CDF at u[:, k]."""
    n, rows, vocab = p.shape
    k = rows - 1
    tokens, emitted = np.zeros((n, k + 1), np.int64), np.zeros(n, np.int64)
    for i in range(n):
        out, mass = [], None
        for j in range(int(counts[i])):
            q = {int(t): Fraction(int(w), Q_SCALE) for t, w in zip(ids[i, j], weights[i, j])}
            pj = [Fraction(float(x)) for x in p[i, j]]
            d = int(drafts[i, j])
            if Fraction(float(u[i, j])) < pj[d] / q[d]:
                out.append(d)
                continue
            mass = [max(Fraction(0), pj[x] - q.get(x, 0)) for x in range(vocab)]
            mass = mass if sum(mass) else pj
            break
        if mass is None:
            mass = [Fraction(float(x)) for x in p[i, len(out)]]
        out.append(inverse_cdf(mass, Fraction(float(u[i, k]))))
        tokens[i, : len(out)] = out
        emitted[i] = len(out)
    return tokens, emitted


CASES = st.tuples(
    st.integers(0, 2**32 - 1),
    st.integers(1, 4),
    st.integers(0, 5),
    st.integers(33, 64),
    st.sampled_from(["random", "p_like_q", "one_hot"]),
    st.booleans(),
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(CASES)
def test_equals_the_rule_written_with_loops(args):
    case = make_case(*args)
    tokens, emitted = rejection_sample(*as_tensors(case)[:5], uniforms=as_tensors(case)[5])
    want_tokens, want_emitted = reference(*case)
    assert tokens.dtype == emitted.dtype == torch.int64
    np.testing.assert_array_equal(emitted.numpy(), want_emitted)
    np.testing.assert_array_equal(tokens.numpy(), want_tokens)


def test_greedy_entries_are_exact_token_matching():
    """q one-hot on the draft and p one-hot on the target's token: the drafts are kept up
    to the first mismatch, then the target's token, whatever the uniforms."""
    gen = torch.Generator().manual_seed(3)
    n, k, vocab = 500, 4, 40
    target = torch.randint(vocab, (n, k + 1), generator=gen)
    drafts = torch.where(
        torch.rand(n, k, generator=gen) < 0.7, target[:, :k], torch.randint(vocab, (n, k), generator=gen)
    )
    counts = torch.randint(0, k + 1, (n,), generator=gen)
    p = torch.nn.functional.one_hot(target, vocab).float()
    ids = (drafts.unsqueeze(2) + torch.arange(K)) % vocab  # distinct, the draft first
    weights = torch.zeros(n, k, K, dtype=torch.int32)
    weights[..., 0] = Q_SCALE
    u = torch.rand(n, k + 1, generator=gen)
    u[:100] = BELOW_ONE
    u[100:200] = 0.0
    tokens, emitted = rejection_sample(p, drafts, counts, ids, weights, uniforms=u)
    steps = torch.arange(k).view(1, k)
    matched = ((drafts == target[:, :k]) & (steps < counts.view(n, 1))).long().cumprod(1).sum(1)
    assert torch.equal(emitted, matched + 1)
    want = torch.where(torch.arange(k + 1).view(1, -1) <= matched.view(n, 1), target, 0)
    assert torch.equal(tokens, want)
    assert 0 < (matched < counts).sum() < n, "both rejections and full acceptances occur"


def test_a_residual_of_zero_draws_from_p():
    """q one-hot on t and p(t) one float32 step below 1 (nothing elsewhere): the most
    extreme uniform rejects t, max(0, p - q) is zero, and the token comes from p: t."""
    p = torch.zeros(1, 2, 40)
    p[0, :, 5] = BELOW_ONE
    ids = torch.arange(K, dtype=torch.int32).view(1, 1, K)
    weights = torch.zeros(1, 1, K, dtype=torch.int32)
    weights[0, 0, 5] = Q_SCALE
    drafts, counts = torch.tensor([[5]]), torch.tensor([1])
    tokens, emitted = rejection_sample(p, drafts, counts, ids, weights, uniforms=torch.tensor([[BELOW_ONE, 0.5]]))
    assert emitted.tolist() == [1] and tokens.tolist() == [[5, 0]]
    tokens, emitted = rejection_sample(p, drafts, counts, ids, weights, uniforms=torch.tensor([[0.999, 0.5]]))
    assert emitted.tolist() == [2] and tokens.tolist() == [[5, 5]]


def test_q_dense_scatters_the_weights():
    ids = torch.tensor([[[3, 0, 7]]], dtype=torch.int32)
    weights = torch.tensor([[[65535 - 100, 100, 0]]], dtype=torch.uint16)
    dense = q_dense(ids, weights, 9, dtype=torch.float64)
    want = torch.zeros(1, 1, 9, dtype=torch.float64)
    want[0, 0, 3], want[0, 0, 0] = (65535 - 100) / 65535, 100 / 65535
    assert torch.equal(dense, want)
    assert q_dense(ids, weights, 9).dtype == torch.float32


# --- statistics: the emitted tokens are the target's, whatever q is -------------------


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """``helpers.chi2_p`` of counts ``observed`` against probabilities ``expected_probs``."""
    probs = expected_probs.double()
    return chi2_p(observed.numpy(), (probs / probs.sum() * observed.sum()).numpy())


def poor_round(n=20_000, k=3, vocab=48, seed=11):
    """p the same at every position (8 of 48 tokens impossible); q over 32 random ids
    (the 16 left out hold most of p), its weight on the tokens p likes least
    (impossible ones included), one weight in five 0; drafts drawn from q."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) * 1.5
    logits[torch.randperm(vocab, generator=gen)[:8]] = -float("inf")
    p_row = torch.softmax(logits, 0)
    ids = torch.randperm(vocab, generator=gen)[:K]
    raw = (1.0 / (p_row[ids].double() + 0.05)) * (torch.arange(K) % 5 != 4)
    weights = torch.from_numpy(weights_summing(None, raw.numpy()))
    q_row = torch.zeros(vocab, dtype=torch.float64).index_put_((ids,), weights.double() / Q_SCALE)
    drafts = ids[torch.multinomial(weights.double(), n * k, replacement=True, generator=gen)].view(n, k)
    p = p_row.expand(n, k + 1, vocab)
    q_ids, q_weights = ids.int().expand(n, k, K), weights.to(torch.int32).expand(n, k, K)
    tokens, emitted = rejection_sample(p, drafts, torch.full((n,), k), q_ids, q_weights, generator=gen)
    return p_row.double(), q_row, tokens, emitted


def test_emitted_tokens_follow_the_target_whatever_q():
    p, q, tokens, emitted = poor_round()
    n, vocab = tokens.shape[0], p.numel()
    accept = torch.minimum(p, q).sum()  # the closed form of one draft's acceptance rate
    assert 0.1 < accept < 0.5 and p[q == 0].sum() > 0.1, "q is poor, and truncated"
    # First token: the target's, with drafts accepted and residual draws mixed.
    assert chi_square_p_value(torch.bincount(tokens[:, 0], minlength=vocab), p) > P_VALUE_MIN
    # A draft is accepted at the closed-form rate, within 4 standard errors.
    rate = (emitted >= 2).double().mean()
    assert abs(rate - accept) < 4 * (accept * (1 - accept) / n) ** 0.5
    # The number emitted: truncated geometric, P(m) = a^(m-1) (1 - a), P(4) = a^3.
    law = torch.stack([accept ** (m - 1) * (1 - accept) for m in (1, 2, 3)] + [accept**3])
    assert chi_square_p_value(torch.bincount(emitted - 1, minlength=4), law) > P_VALUE_MIN
    # An accepted first draft is distributed as min(p, q) / accept, and what follows it
    # as the target again (the rows are equal, so token 2's marginal is p).
    kept = emitted >= 2
    assert chi_square_p_value(torch.bincount(tokens[kept, 0], minlength=vocab), torch.minimum(p, q)) > P_VALUE_MIN
    assert chi_square_p_value(torch.bincount(tokens[kept, 1], minlength=vocab), p) > P_VALUE_MIN


def test_a_wrong_sampler_fails_the_statistics():
    """The check has teeth: drawing from p rather than max(0, p - q) after a rejection (a
    classic bug) gives min(p, q) + (1 - accept) p, which it tells from p."""
    p, q, tokens, emitted = poor_round()
    vocab = p.numel()
    gen = torch.Generator().manual_seed(12)
    biased = torch.where(
        emitted >= 2, tokens[:, 0], torch.multinomial(p, tokens.shape[0], replacement=True, generator=gen)
    )
    assert chi_square_p_value(torch.bincount(biased, minlength=vocab), p) < 1e-12


# --- bad input ------------------------------------------------------------------------


def good_args(n=3, k=2, vocab=40):
    ids = torch.arange(K, dtype=torch.int32).expand(n, k, K).clone()
    weights = torch.zeros(n, k, K, dtype=torch.int32)
    weights[..., 0] = Q_SCALE
    return {
        "p": torch.full((n, k + 1, vocab), 1 / vocab),
        "draft_tokens": torch.zeros(n, k, dtype=torch.int64),
        "counts": torch.full((n,), k),
        "q_ids": ids,
        "q_weights": weights,
        "uniforms": torch.rand(n, k + 1),
    }


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("p", torch.full((3, 40), 0.025)),
        ("p", torch.ones(3, 3, 40, dtype=torch.int64)),
        ("draft_tokens", torch.zeros(3, 3, dtype=torch.int64)),
        ("draft_tokens", torch.zeros(3, 2)),
        ("counts", torch.zeros(4, dtype=torch.int64)),
        ("counts", torch.zeros(3)),
        ("q_ids", torch.zeros(3, 1, K, dtype=torch.int32)),
        ("q_ids", torch.zeros(3, 2, K)),
        ("q_weights", torch.zeros(3, 2, K - 1, dtype=torch.int32)),
        ("q_weights", torch.zeros(3, 2, K)),
        ("uniforms", torch.rand(3, 2)),
        ("uniforms", torch.zeros(3, 3, dtype=torch.int64)),
    ],
)
def test_mismatched_arguments_are_named(name, bad):
    args = good_args()
    rejection_sample(**args)  # the good ones pass
    args[name] = bad
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        rejection_sample(**args)


def test_q_dense_names_mismatched_weights():
    with pytest.raises(ValueError, match="^q_weights"):
        q_dense(torch.zeros(2, K, dtype=torch.int32), torch.zeros(2, K - 1, dtype=torch.int32), 40)


# --- on a GPU -------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_equals_cpu_with_no_host_sync():
    """The same rounds on CUDA give the CPU's tokens for the same uniforms, and neither
    that call nor one drawing its own uniforms synchronises with the host."""
    cases = [
        make_case(seed, 4, k, 33 + seed % 32, flavour, seed % 2 == 0)
        for seed in range(30)
        for k, flavour in [(5, "random"), (3, "p_like_q"), (4, "one_hot")]
    ]
    torch.cuda.synchronize()
    for case in cases:
        cpu = rejection_sample(*as_tensors(case)[:5], uniforms=as_tensors(case)[5])
        args = as_tensors(case, "cuda")
        gen = torch.Generator("cuda").manual_seed(1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            gpu = rejection_sample(*args[:5], uniforms=args[5])
            rejection_sample(*args[:5], generator=gen)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])


@pytest.mark.gpu
def test_gpu_round_of_engine_size_has_no_host_sync():
    """256 entries, 5 drafts, a 152k vocabulary: no sync, and the CPU's answer."""
    n, k, vocab = 256, 5, 152_064
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(n, k + 1, vocab, generator=gen) * 4, -1)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:K] for _ in range(n * k)]).view(n, k, K).int()
    raw = torch.rand(n * k, K, generator=gen).double().numpy()
    weights = torch.from_numpy(np.stack([weights_summing(None, r) for r in raw])).view(n, k, K).int()
    drafts = ids[..., 0].long()
    counts = torch.randint(0, k + 1, (n,), generator=gen)
    u = torch.rand(n, k + 1, generator=gen)
    args = [p, drafts, counts, ids, weights]
    cpu = rejection_sample(*args, uniforms=u)
    cuda = [a.cuda() for a in args]
    u_cuda = u.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = rejection_sample(*cuda, uniforms=u_cuda)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])

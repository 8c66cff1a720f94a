"""Exact speculative sampling of a round of sampled drafts, batched, with no host sync.

The rule (Leviathan et al. 2023; Chen et al. 2023). For entry i, with ``c = counts[i]``
drafts ``d_0 .. d_{c-1}``, the target's distributions ``p_0 .. p_c`` (``p_j`` is the
target's distribution for the token after j accepted drafts; ``p_c`` is the bonus row)
and the drafter's ``q_0 .. q_{c-1}``:

- for j = 0, 1, ..: accept ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``;
- at the first rejection j, emit one token drawn from ``max(0, p_j - q_j)``, normalised,
  and stop (from ``p_j`` itself when that residual is all zero: ``p_j <= q_j``
  everywhere, so a rejection had probability zero up to float error);
- when all c drafts are accepted, emit one token drawn from the bonus row ``p_c``.

Whatever q is, the emitted tokens are distributed exactly as tokens drawn one by one from
the target; q only decides how many come per round. A greedy entry is the special case
of one-hot q (weight 65535 on the draft) and one-hot p: a draft is accepted exactly when
it is the target's token, and the target's token is emitted at the first mismatch.

Shapes and dtypes (n entries, k draft positions, K listed ids, V the vocabulary):

    p             [n, k + 1, V]  float    the target after the engine's own processing
                                          (temperature, top-k/top-p); rows sum to 1;
                                          rows past counts[i] are never read (NaN is fine)
    draft_tokens  [n, k]         integer  d_j, among its position's ids with weight > 0
    counts        [n]            integer  drafts per entry, 0 <= counts[i] <= k; positions
                                          at and past counts[i] are padding, never read
                                          for their values (they may hold anything)
    q_ids         [n, k, K]      integer  the ids q_j is over, distinct, in [0, V)
    q_weights     [n, k, K]      uint16/int32/int64  q_j(id) = weight / 65535; the K
                                          weights of a drafted position sum to 65535;
                                          an id not listed has q = 0
    uniforms      [n, k + 1]     float    in [0, 1): column j < k is draft j's acceptance
                                          test, column k the final token's draw
    -> tokens     [n, k + 1]     int64    the accepted drafts, then the one extra token,
                                          then zeros
    -> emitted    [n]            int64    accepted + 1 (1 .. counts[i] + 1)

How the uniforms are used, so that a test can pass its own:

- draft j is accepted iff ``u[i, j] * w < p_j(d_j) * 65535`` with w its integer weight,
  compared in float64. For p and u in float32 (or narrower) both products are exact, so this
  is ``u < p/q`` exactly: a draft with p = 0 is always rejected, one with p >= q always
  accepted.
- the extra token is the inverse CDF at ``u[i, k]``: the first token whose cumulative
  mass (float64 cumsum of the chosen distribution) exceeds ``u[i, k] * total``. A token
  with zero mass is never chosen. The residual ``p - q`` is computed in float64, where
  its sign is exact for float32 p (a non-zero ``p - w/65535`` is far above float64's
  rounding), so "all zero" is a test of the exact residual.

No host synchronisation: every step is a fixed-shape tensor operation on ``p``'s device
(acceptance by cumulative product, the first rejection by a sum, sampling by cumsum and
searchsorted); nothing is read back to Python, and the checks that raise ValueError look
at shapes, dtypes and devices only. Values are trusted: an invalid value (a draft not
among its ids, a weight sum off 65535) gives a wrong draw, not an error.

Memory: beyond the inputs, one ``[n, V]`` row in p's dtype and one in float64 (the
chosen row, then its CDF in place), whatever k is; q is never made dense.

The redraw (:func:`redraw`): exact against any worker. The rule above is exact when each
draft d_j was drawn from the q_j it is verified against; the engine cannot see how a
worker drew its drafts, and one that lists its chosen token with a sliver of weight
(where the pick lands at its known seed) has it accepted with probability near 1. An
engine that does not trust its worker redraws before its verify pass: x_j = pick(q_j,
u_j) with uniforms of its own, m the first j < c with x_j != d_j (m = c if none), and it
verifies x_0 .. x_{min(m, c-1)}: ``count' = min(m + 1, c)``, the engine's own draws
*including* the mismatching x_m as the last draft, over the same q. Every draft verified
is then an engine draw from its q, independent of what came before it, and whether the
next position is offered depends only on drafts already drawn (x_j against d_j): a
stopping rule, so the emitted tokens are the target's whatever the worker sent, provided
the target's rows (the bonus row p_{m+1} included) are computed over the redrawn tokens.
The worker's drafts only decide how far the engine goes: past position j while its draw
equals d_j, for an honest worker with probability sum_t q_j(t)^2 (the redraw's cost).
Two near variants are not exact: dropping the mismatching position (count' = m, the bonus
from p_m) offers a position only when the engine's draw equals d_m, so the verified
token there is d_m, not a draw from q (q = p = (1/2, 1/2) emits d first with probability
3/4); and verifying the worker's d_m in place of x_m keeps the attack at position m.
"""

from __future__ import annotations

import torch

from ..sampled import TOP, pick_index, threshold

Q_SCALE = 65535
"""A weight of Q_SCALE is probability 1: q(id) = weight / Q_SCALE."""


def q_dense(q_ids: torch.Tensor, q_weights: torch.Tensor, vocab: int, *, dtype=torch.float32) -> torch.Tensor:
    """q scattered over the vocabulary: ``[..., K]`` ids and weights -> ``[..., vocab]``
    probabilities, ``weight / 65535`` at each listed id, 0 elsewhere.

    Every position given is scattered, so its ids must be distinct and in [0, vocab)
    (pass only drafted positions, or padding with valid ids). For a reference or a dense
    view; the sampler itself touches only the K listed ids of the one row it needs.

    Raises:
        ValueError: ``q_weights`` not the shape of ``q_ids``, either not integer, or
            ``vocab`` below 1.
    """
    if q_ids.dtype.is_floating_point or q_ids.dtype == torch.bool:
        raise ValueError(f"q_ids must be an integer tensor, got {q_ids.dtype}")
    if q_weights.dtype.is_floating_point or q_weights.dtype == torch.bool:
        raise ValueError(f"q_weights must be an integer tensor, got {q_weights.dtype}")
    if q_weights.shape != q_ids.shape:
        raise ValueError(f"q_weights has shape {tuple(q_weights.shape)}, q_ids {tuple(q_ids.shape)}: they must match")
    if vocab < 1:
        raise ValueError(f"vocab must be at least 1, got {vocab}")
    out = torch.zeros((*q_ids.shape[:-1], vocab), dtype=dtype, device=q_ids.device)
    values = q_weights.to(torch.int32).to(dtype) / Q_SCALE
    return out.scatter_(-1, q_ids.long(), values)


def rejection_sample(
    p: torch.Tensor,
    draft_tokens: torch.Tensor,
    counts: torch.Tensor,
    q_ids: torch.Tensor,
    q_weights: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's accepted tokens under the rule above: ``(tokens [n, k + 1] int64,
    emitted [n] int64)``, ``tokens[i, :emitted[i]]`` the accepted drafts and the one
    extra token, zeros after. All on ``p``'s device; no host sync.

    ``uniforms`` ([n, k + 1] float in [0, 1), see the module docstring for what each
    column decides) makes the draw reproducible; without it they are drawn with
    ``generator`` (which must be on ``p``'s device) or the device's default one.

    Raises:
        ValueError: an argument whose shape, dtype or device does not fit the others;
            the message names it.
    """
    n, k, vocab = _check(p, draft_tokens, counts, q_ids, q_weights, uniforms)
    if uniforms is None:
        uniforms = torch.rand((n, k + 1), generator=generator, device=p.device)
    counts = counts.long().clamp(0, k)
    q_weights = q_weights.to(torch.int32)  # uint16 has few kernels (no gather on CPU)
    accepted = _accepted(p, draft_tokens, counts, q_ids, q_weights, uniforms[:, :k])
    extra = _extra_token(p, accepted, counts, q_ids, q_weights, uniforms[:, k])
    columns = torch.arange(k + 1, device=p.device).view(1, k + 1)
    drafts = torch.zeros((n, k + 1), dtype=torch.int64, device=p.device)
    drafts[:, :k] = draft_tokens
    tokens = torch.where(columns < accepted.view(n, 1), drafts, 0)
    tokens.scatter_(1, accepted.view(n, 1), extra.view(n, 1))
    return tokens, accepted + 1


def _accepted(p, draft_tokens, counts, q_ids, q_weights, uniforms) -> torch.Tensor:
    """[n] int64: how many leading drafts of each entry pass their acceptance test."""
    n, k = draft_tokens.shape
    if k == 0:
        return torch.zeros(n, dtype=torch.int64, device=p.device)
    drafted = torch.arange(k, device=p.device).view(1, k) < counts.view(n, 1)
    # Padding may hold anything: read only drafted positions' values.
    draft = torch.where(drafted, draft_tokens.long(), 0)
    p_draft = p[:, :k].gather(2, draft.unsqueeze(2)).squeeze(2).to(torch.float64)
    match = q_ids.long() == draft.unsqueeze(2)
    weight = torch.where(match, q_weights, 0).sum(dim=2).to(torch.float64)
    # u < p/q as u * w < p * 65535: both products exact in float64 for float32 u and p,
    # and p = 0 never passes (u * w >= 0).
    passed = (uniforms.to(torch.float64) * weight < p_draft * Q_SCALE) & drafted
    return passed.to(torch.int64).cumprod(dim=1).sum(dim=1)


def _extra_token(p, accepted, counts, q_ids, q_weights, u) -> torch.Tensor:
    """[n] int64: the token after the accepted drafts, drawn at ``u`` ([n]) from
    max(0, p_a - q_a) after a rejection at a (from p_a where that is all zero), from the
    bonus row p_a when every draft was accepted.

    q is zero off its K ids, so the residual is the row of p with K entries replaced: a
    float64 copy of the one row and a scatter of K values, not a dense q over V."""
    n, rows, vocab = p.shape
    k = rows - 1
    row = p.gather(1, accepted.view(n, 1, 1).expand(n, 1, vocab)).squeeze(1)
    dist = row.to(torch.float64)
    if k == 0:
        return _inverse_cdf(dist, u)[0]
    at = accepted.clamp(max=k - 1).view(n, 1, 1).expand(n, 1, q_ids.shape[-1])
    rejected = (accepted < counts).view(n, 1)
    # Every draft accepted: the bonus row, no q (id 0 with weight 0, K times, changes nothing).
    ids = torch.where(rejected, q_ids.gather(1, at).squeeze(1).long(), 0)
    weights = torch.where(rejected, q_weights.gather(1, at).squeeze(1), 0)
    residual = (dist.gather(1, ids) - weights.to(torch.float64) / Q_SCALE).clamp_(min=0)
    token, empty = _inverse_cdf(dist.scatter_(1, ids, residual), u)
    # All zero: p <= q everywhere, so p's support lies among the K ids. Drawn there in
    # token order, this is the draw over all V (a zero adds nothing to a cumsum).
    ids = ids.sort(dim=1).values
    on_ids, _ = _inverse_cdf(row.gather(1, ids).to(torch.float64), u)
    return torch.where(empty, ids.gather(1, on_ids.view(n, 1)).squeeze(1), token)


def _inverse_cdf(dist: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] int64, [n] bool): per row of ``dist`` ([n, V] float64, non-negative, summed
    in place), the first index whose cumulative mass exceeds ``u * total``, and whether
    the row has no mass at all (its index is then meaningless). For u < 1 the target is
    strictly below the total (u * total rounds down in float64), so an index of zero
    mass is never returned; the clamp only guards an empty row."""
    cdf = dist.cumsum_(dim=1)
    total = cdf[:, -1:]
    index = torch.searchsorted(cdf, u.to(torch.float64).view(-1, 1) * total, right=True)
    return index.squeeze(1).clamp_(max=dist.shape[1] - 1), total.squeeze(1) == 0


def _check(p, draft_tokens, counts, q_ids, q_weights, uniforms) -> tuple[int, int, int]:
    """(n, k, V) after checking shapes, dtypes and devices only (nothing that syncs)."""
    if p.dim() != 3 or not p.dtype.is_floating_point:
        raise ValueError(f"p must be a float [n, k + 1, V] tensor, got {p.dtype} of shape {tuple(p.shape)}")
    n, rows, vocab = p.shape
    if draft_tokens.dim() != 2 or draft_tokens.shape[0] != n or draft_tokens.shape[1] != rows - 1:
        raise ValueError(f"draft_tokens must be [n, k] = [{n}, {rows - 1}] (from p), got {tuple(draft_tokens.shape)}")
    k = rows - 1
    if counts.shape != (n,):
        raise ValueError(f"counts must be [n] = [{n}] (from p), got {tuple(counts.shape)}")
    if q_ids.dim() != 3 or q_ids.shape[:2] != (n, k) or q_ids.shape[2] < 1:
        raise ValueError(f"q_ids must be [n, k, K] with n, k = {n}, {k} and K >= 1, got {tuple(q_ids.shape)}")
    if q_weights.shape != q_ids.shape:
        raise ValueError(f"q_weights must be the shape of q_ids {tuple(q_ids.shape)}, got {tuple(q_weights.shape)}")
    if uniforms is not None and (uniforms.shape != (n, k + 1) or not uniforms.dtype.is_floating_point):
        raise ValueError(
            f"uniforms must be float [n, k + 1] = [{n}, {k + 1}], got {uniforms.dtype} {tuple(uniforms.shape)}"
        )
    named = {"draft_tokens": draft_tokens, "counts": counts, "q_ids": q_ids, "q_weights": q_weights}
    for name, tensor in named.items():
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")
    if uniforms is not None:
        named["uniforms"] = uniforms
    for name, tensor in named.items():
        if tensor.device != p.device:
            raise ValueError(f"{name} is on {tensor.device}, p on {p.device}: they must share a device")
    return n, k, vocab


def redraw(
    tokens: torch.Tensor,
    counts: torch.Tensor,
    q_ids: torch.Tensor,
    q_weights: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
    u32: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A worker's sampled drafts redrawn by the engine (module docstring): ``(tokens'
    [n, k], counts' [n])`` in the dtypes of ``tokens`` and ``counts``, on their device,
    ``tokens'[i, :counts'[i]]`` the engine's picks from ``q`` up to and including its
    first draw that differs from the worker's draft, zeros after; ``counts' <= counts``.
    Verify them against the same ``q_ids`` / ``q_weights``. No host sync.

    Args:
        tokens: [n, k] integer, the worker's drafts (anything past ``counts``).
        counts: [n] integer, drafts per entry (clamped to 0..k).
        q_ids, q_weights: [n, k, 32] integer, each drafted position's distribution
            (weights summing to 65535: a reply that passed the engine's check).
        generator: the engine's randomness, on ``tokens``' device; it draws each pick's
            threshold ``r`` uniformly in 0..65534 (rule 3's ``r``, drawn directly), so
            an id is drawn with probability exactly ``weight / 65535``.
        u32: [n, k] integer in 0..2**32-1, the picks' uniforms instead (tests).

    Raises:
        ValueError: an argument whose shape, dtype or device does not fit; the message names it.
    """
    n, k = _check_redraw(tokens, counts, q_ids, q_weights, generator, u32)
    device = tokens.device
    if u32 is None:  # rule 3's threshold, drawn uniformly: each id exactly weight / 65535
        r = torch.randint(0, Q_SCALE, (n, k), generator=generator, device=device, dtype=torch.int64)
    else:
        r = threshold(u32.long())
    drawn = q_ids.long().gather(-1, pick_index(q_weights.long(), r)[..., None])[..., 0]  # rule 3's pick
    columns = torch.arange(k, device=device).view(1, k)
    drafted = columns < counts.long().view(n, 1)
    # Leading positions whose draw equals the draft (undrafted ones never differ), then
    # one more, the first that differs, within the count.
    same = ~(drafted & (drawn != tokens.long()))
    kept = torch.minimum(same.to(torch.int64).cumprod(dim=1).sum(dim=1) + 1, counts.long().clamp(0, k))
    out = torch.where(columns < kept.view(n, 1), drawn, 0)
    return out.to(tokens.dtype), kept.to(counts.dtype)


def _check_redraw(tokens, counts, q_ids, q_weights, generator, u32) -> tuple[int, int]:
    """(n, k) after checking shapes, dtypes and devices only (nothing that syncs)."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [n, k], got shape {tuple(tokens.shape)}")
    n, k = tokens.shape
    if counts.shape != (n,):
        raise ValueError(f"counts must be [n] = [{n}] (from tokens), got {tuple(counts.shape)}")
    if q_ids.shape != (n, k, TOP):
        raise ValueError(f"q_ids must be [n, k, {TOP}] = [{n}, {k}, {TOP}], got {tuple(q_ids.shape)}")
    if q_weights.shape != q_ids.shape:
        raise ValueError(f"q_weights must be the shape of q_ids {tuple(q_ids.shape)}, got {tuple(q_weights.shape)}")
    if u32 is not None and u32.shape != (n, k):
        raise ValueError(f"u32 must be [n, k] = [{n}, {k}], got {tuple(u32.shape)}")
    named = {"tokens": tokens, "counts": counts, "q_ids": q_ids, "q_weights": q_weights}
    if u32 is not None:
        named["u32"] = u32
    for name, tensor in named.items():
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {tensor.dtype}")
        if tensor.device != tokens.device:
            raise ValueError(f"{name} is on {tensor.device}, tokens on {tokens.device}: they must share a device")
    if generator is not None and torch.device(generator.device).type != tokens.device.type:
        raise ValueError(f"generator is on {generator.device}, tokens on {tokens.device}: they must share a device")
    return n, k

"""Sampled drafts in torch: the twin of :mod:`remote_dspark.drafter.sampling` (the rule's
home: its statement, its constants and the steps written once for both, which this
module calls), for the model drafters on the CPU and on CUDA.

Batched, and on CUDA free of host syncs (so a round that samples can be captured as a
graph). :func:`uniform_u32` and :func:`pick` are bit-identical to numpy's on the same
inputs; :func:`top32` gives numpy's ids, and its weights up to float64 rounding in the
softmax (the same for scores that are not within a few ulps of a weight's boundary).
Differences of form: integers are int64 tensors holding the values (a uint64 seed as
the same bits in int64, a uint32 as its value); :func:`top32` returns int32 ids and
int32 weights (torch has no uint16 arithmetic), and treats a temperature that is not a
finite positive number as 0 (greedy) where numpy raises: it cannot look at the values
without a sync. Callers check their temperatures where they arrive.

Top-32 ties: ``torch.topk`` finds the 32 largest values exactly, but which of several
ids tied at the 32nd value it returns is unspecified. A row whose 33rd value equals its 32nd
(``topk`` asks for 33) takes its tied ids from the smallest up (a cumulative count of the
ties and a ``searchsorted``); on the CPU only when some row needs it (a host check is
free there), on CUDA always (no sync, a few passes over the scores).
"""

from __future__ import annotations

import torch

from ..sampling import MASK32, TOP, TOTAL, add_deficit, hash_halves, pick_index, threshold


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and high 32 bits of int64 ``x`` (two's complement), shifting only a
    non-negative value: the sign bit is put back by hand."""
    low = x & MASK32
    high = ((x & 0x7FFFFFFFFFFFFFFF) >> 32) | ((x < 0).long() << 31)
    return low, high


def uniform_u32(seed: torch.Tensor, position: torch.Tensor, draft: torch.Tensor | int) -> torch.Tensor:
    """Rule 1 (numpy's :func:`~remote_dspark.drafter.sampling.uniform_u32`, bit for
    bit): int64 tensors ``seed`` (a uint64's bits) and ``position``, ``draft`` an int or
    an integer tensor in 0..2**32-1, broadcast together, on one device. Returns int64
    values in 0..2**32-1."""
    if not isinstance(draft, int):
        draft = draft.long()
    draft = draft & MASK32  # an int stays one: no copy to the device (graph capture)
    s_lo, s_hi = _halves(seed.long())
    p_lo, p_hi = _halves(position.long())
    return hash_halves(s_lo, s_hi, p_lo, p_hi, draft)


def weights_of(top: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Rule 2's weights: ``top`` [n, TOP] scores, most likely first; ``temperature``
    [n]. Returns [n, TOP] int32 summing to TOTAL (greedy where the temperature is not
    finite and positive, or the softmax is not finite)."""
    t = temperature.to(torch.float32).double()[:, None]
    v = top.double()
    hot = (t > 0) & torch.isfinite(t)
    p = torch.exp((v - v[:, :1]) / torch.where(hot, t, 1.0))
    p = p / p.sum(1, keepdim=True)
    ok = hot & torch.isfinite(p).all(1, keepdim=True)
    return add_deficit(torch.floor(torch.where(ok, p, 0.0) * TOTAL).long()).int()


def top32(
    scores: torch.Tensor, temperature: torch.Tensor, sync_free: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule 2 (numpy's :func:`~remote_dspark.drafter.sampling.top32`): ``scores`` [n, V]
    float (V >= TOP), ``temperature`` [n]. Returns (ids [n, TOP] int32, weights [n, TOP]
    int32), score descending, ties to the smaller id. ``sync_free``: take the tie path
    for every row, with no host check (default: on CUDA only; True tests it on the CPU).

    Raises:
        ValueError: ``scores`` not [n, V] with V >= TOP.
    """
    if scores.dim() != 2 or scores.shape[1] < TOP:
        raise ValueError(f"scores: shape {tuple(scores.shape)}, expected [n, V] with V >= {TOP}")
    # One more than TOP: a row whose next value equals its TOP-th has ties at the edge
    # (a NaN there compares unequal: such a row keeps topk's ids, valid all the same).
    vals, ids = torch.topk(scores, min(TOP + 1, scores.shape[1]), dim=1)
    kth = vals[:, TOP - 1 : TOP]
    tied = vals[:, TOP:] == kth if scores.shape[1] > TOP else torch.zeros_like(kth, dtype=torch.bool)
    vals, ids = vals[:, :TOP], ids[:, :TOP]
    if sync_free is None:
        sync_free = scores.device.type != "cpu"
    if sync_free or bool(tied.any()):
        ids = _ties_from_smallest(scores, vals, ids, kth, tied)
    # Sort by (score descending, id ascending): by id, then stably by score.
    ids, by_id = ids.sort(dim=1)
    vals = vals.gather(1, by_id)
    vals, by_score = vals.sort(dim=1, descending=True, stable=True)
    return ids.gather(1, by_score).int(), weights_of(vals, temperature)


def _ties_from_smallest(scores, vals, ids, kth, tied) -> torch.Tensor:
    """In rows marked ``tied`` ([n, 1]), the slots of value ``kth`` take the smallest
    ids of that value, in order; the other slots (larger values, or NaN) keep topk's."""
    at_kth = vals == kth  # [n, TOP]
    want = at_kth.cumsum(1, dtype=torch.int32).clamp(min=1)  # the j-th tie, j from 1
    rank = (scores == kth).cumsum(1, dtype=torch.int32)  # [n, V]: ties so far
    nth = torch.searchsorted(rank, want).clamp(max=scores.shape[1] - 1)
    return torch.where(tied & at_kth, nth, ids)


def pick(ids: torch.Tensor, weights: torch.Tensor, u32: torch.Tensor) -> torch.Tensor:
    """Rule 3 (numpy's :func:`~remote_dspark.drafter.sampling.pick`, bit for bit):
    ``ids``, ``weights`` [..., TOP] ints, ``u32`` [...] int64 in 0..2**32-1. Returns
    [...] of ``ids``' dtype."""
    i = pick_index(weights.long(), threshold(u32.long()))
    return ids.gather(-1, i[..., None])[..., 0]

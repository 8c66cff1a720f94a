"""Attention over the KV store's rows in place: each entry's queries read their own row.

The drafter's KV store (:class:`~remote_dspark.drafter.lm.cache.KVStore`) holds one row
per stream, ``[rows, layers, 2, kv_heads, columns, head_dim]``; a round's entries name
their rows (``rows [n]``) and their queries' columns (``positions [n, Q]``). A query at
column c attends to its row's columns 0..c (:func:`visible_keys`:
never the last, the trash column where padding writes): the row is read where it lies,
so no round gathers rows into a working copy or writes them back.

:func:`paged_attention` is the one entry point of both models:

* on CUDA in 16-bit floats, a Triton kernel (flash attention's online softmax over one
  row per program: entry x query head x block of queries). It reads only the columns up
  to its queries' last one, so a round's attention costs the columns its rows hold, not
  the row's length;
* elsewhere (the CPU; float32), :func:`reference_attention`: the rows gathered, then
  ``scaled_dot_product_attention`` with the mask. The GPU tests hold the kernel to it.

Grouped-query models keep fewer key heads than they query with: query head h reads key
head ``h // (query heads / key heads)``.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def visible_keys(positions: torch.Tensor, columns: int) -> torch.Tensor:
    """[n, 1, Q, columns] bool: the keys each query at column ``positions`` [n, Q] sees in a
    KV buffer of ``columns``: its row's columns up to its own, never the last (the trash
    column, where padding writes). The rule of every model the drafter drives."""
    keys = torch.arange(columns, device=positions.device)
    return ((keys <= positions[..., None]) & (keys < columns - 1))[:, None]


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`paged_attention` by gathering the rows (module docstring)."""
    mask = visible_keys(positions, k.shape[2])
    first = None
    if q.device.type == "cpu":  # no sync to pay here: only the columns some query sees; consecutive rows as a view
        seen = min(int(positions.max()) + 1, k.shape[2])
        k, v, mask = k[:, :, :seen], v[:, :, :seen], mask[..., :seen]
        if torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + len(rows))):
            first = int(rows[0])  # scratch rows, a single entry
    if first is None:
        keys, values = k.index_select(0, rows), v.index_select(0, rows)
    else:
        keys, values = k[first : first + len(rows)], v[first : first + len(rows)]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Queries ``q [n, q_heads, Q, head_dim]`` against the store's rows: ``k``, ``v``
    ``[rows, kv_heads, columns, head_dim]`` (one layer's view of the store, any strides),
    entry i's row ``rows[i]``, its queries at columns ``positions [n, Q]`` (int64).
    ``scale``: the logits' factor (None: ``head_dim ** -0.5``). Returns
    ``[n, q_heads, Q, head_dim]`` in ``q``'s dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads over {k.shape[1]} key heads: not a multiple")
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return reference_attention(q, k, v, rows, positions, scale)
    from ._kernels import attention

    return attention(q, k, v, rows, positions, scale)

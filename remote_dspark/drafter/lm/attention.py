"""Attention over the KV pool's blocks in place: each entry's queries read their stream's
blocks through its block table.

The drafter's KV pool (:class:`~remote_dspark.drafter.lm.pool.KVStore`) holds fixed-size
blocks, ``[blocks, layers, 2, kv_heads, BLOCK, head_dim]``; a stream's column c (its
token at absolute position ``origin + c``) lies in block ``table[row, c // BLOCK]`` at
offset ``c % BLOCK``, ``row`` the stream's row of the block table. A round's entries name
their table rows (``rows [n]``) and their queries' columns (``positions [n, Q]``); a
query at column c attends to its row's columns 0..c (:func:`visible_keys`), read where
they lie: no round gathers a stream into a working copy or writes it back.

:func:`paged_attention` is the one entry point of both models:

* on CUDA in 16-bit floats, a Triton kernel (:mod:`._kernels`: flash attention's online
  softmax, one program per entry x key head x tile of its grouped heads' queries,
  walking its stream's blocks through the table up to its last query's column), so a
  round's attention costs the columns its streams hold, not the table's width, and reads
  them at nearly the card's bandwidth whatever the block size;
* elsewhere (the CPU; float32), :func:`reference_attention`: the blocks gathered, then
  ``scaled_dot_product_attention`` with the mask. The GPU tests hold the kernel to it.

Grouped-query models keep fewer key heads than they query with: query head h reads key
head ``h // (query heads / key heads)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn import functional as F


class Pages(NamedTuple):
    """The KV pool and its block table as a round's models see them (module docstring)."""

    kv: torch.Tensor  # [blocks, layers, 2, kv_heads, BLOCK, head_dim]; block 0: trash
    table: torch.Tensor  # [table rows, max_blocks] int64

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values ``[n, kv_heads, Q, head_dim]`` into ``layer`` at ``blocks``,
        ``offsets [n, Q]`` (a stream's column c: its table row's block ``c // BLOCK``, offset
        ``c % BLOCK``; padding: the trash block): one indexed write of both."""
        pool = self.kv[:, layer].permute(0, 3, 1, 2, 4)  # [blocks, BLOCK, 2, kv_heads, head_dim]
        pool[blocks, offsets] = torch.stack((k, v), 2).transpose(1, 3).to(pool.dtype)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s keys and values, ``[blocks, kv_heads, BLOCK, head_dim]`` views."""
        return self.kv[:, layer, 0], self.kv[:, layer, 1]


def visible_keys(positions: torch.Tensor, columns: int) -> torch.Tensor:
    """[n, 1, Q, columns] bool: the keys each query at column ``positions`` [n, Q] sees
    among a row's first ``columns``: its row's columns up to its own. The rule of every
    model the drafter drives."""
    keys = torch.arange(columns, device=positions.device)
    return (keys <= positions[..., None])[:, None]


REFERENCE_BYTES = 1 << 26  # the CPU reference's gathered blocks and scores at once, a chunk's


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`paged_attention` by gathering each entry's blocks (module docstring): only
    the blocks some query sees (one host read of the round's last column), in chunks of
    entries and queries whose gathered blocks and scores stay within ``REFERENCE_BYTES``
    (one entry and one query at least): a long stream's prefill never holds queries x
    columns scores at once."""
    block = k.shape[2]
    n, heads, queries, head_dim = q.shape
    used = min(int(positions.max()) // block + 1, table.shape[1])
    blocks = table.index_select(0, rows)[:, :used]  # [n, used]
    cols = used * block
    per_entry = 2 * heads * cols * head_dim * q.element_size()  # its blocks gathered, at the query heads
    per_query = heads * cols * 8  # scores and their softmax, float32
    span = max(1, min(queries, (REFERENCE_BYTES - per_entry) // per_query))
    group = max(1, REFERENCE_BYTES // (per_entry + span * per_query))
    groups = heads // k.shape[1]

    def gather(x: torch.Tensor, which: torch.Tensor) -> torch.Tensor:  # [m, kv_heads, cols, head_dim]
        g = x.index_select(0, which.reshape(-1)).view(len(which), used, *x.shape[1:])
        g = g.transpose(1, 2).reshape(len(which), x.shape[1], cols, x.shape[3])
        return g.repeat_interleave(groups, 1) if groups > 1 else g

    out = torch.empty_like(q)
    for i in range(0, n, group):
        keys, values = gather(k, blocks[i : i + group]), gather(v, blocks[i : i + group])
        for j in range(0, queries, span):
            mask = visible_keys(positions[i : i + group, j : j + span], cols)
            out[i : i + group, :, j : j + span] = F.scaled_dot_product_attention(
                q[i : i + group, :, j : j + span], keys, values, attn_mask=mask, scale=scale
            )
    return out


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Queries ``q [n, q_heads, Q, head_dim]`` against the pool's blocks: ``k``, ``v``
    ``[blocks, kv_heads, BLOCK, head_dim]`` (one layer's view of the pool, any strides),
    through the block table ``table [table rows, max blocks]`` (int64), entry i's table
    row ``rows[i]``, its queries at columns ``positions [n, Q]`` (int64, below ``max
    blocks x BLOCK``). ``scale``: the logits' factor (None: ``head_dim ** -0.5``).
    Returns ``[n, q_heads, Q, head_dim]`` in ``q``'s dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads over {k.shape[1]} key heads: not a multiple")
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return reference_attention(q, k, v, table, rows, positions, scale)
    from ._kernels import attention

    return attention(q, k, v, table, rows, positions, scale)

"""The model drafter's Triton kernels (CUDA only: imported when a CUDA round first needs
them): attention over the KV pool's blocks in place, and the greedy token with its margin.

:func:`attention` (:func:`remote_dspark.drafter.lm.attention.paged_attention`): one
program per (entry, key head, tile of ``BLOCK_M`` rows), a row one query of one of the
key head's grouped query heads (query j of group member g at row ``j x groups + g``), so
a grouped-query model reads each key head's blocks once, not once per query head. It
loads its rows' queries and columns, then walks its entry's stream from column 0 to its
last row's column in tiles of ``BLOCK_N`` keys, any multiple or fraction of the pool's
block: each key's block is read from the entry's row of the block table (the cells a
tile spans), each key at its offset in its block. Flash attention's online softmax
(running maximum, running sum, rescaled accumulator; float32). A key is seen by a query
at a column at least its own (the causal rule within the stream); a key past the tile's
last column is never loaded, so a stream's unused cells (the trash block) are never
read; masked scores are a large negative number, not -inf, so a tile of padding rows
never makes a NaN. Head sizes that are not a power of two (or under 16, what ``tl.dot``
needs) are padded with zeros. :func:`tiles` holds the tiles measured best on an H100
(``remote_dspark.bench.attention``: 256 entries of a 2,048-token history, one query
each, GPT-2 small's heads, read at 3.05 TB/s, about 91% of the card, whatever the block
size; the contiguous rows before the pool read at 3.09).

:func:`top2` (:func:`remote_dspark.drafter.lm.graphs.top2`): one program per row of
logits, one pass over the vocabulary in the logits' own dtype: each lane keeps its best
value and index, its runner-up and a running sum of exponentials (online softmax), and
the lanes are reduced at the end. The first of equal best logits wins (``argmax``'s
rule); an equal runner-up makes the margin 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attention_kernel(
    Q, K, V, OUT, TABLE, ROWS, POS,
    scale,
    sq_n, sq_h, sq_q, sq_d,
    sk_b, sk_h, sk_t, sk_d,
    sv_b, sv_h, sv_t, sv_d,
    so_n, so_h, so_q, so_d,
    st_r, st_c, sp_n, sp_q,
    n_queries, groups, head_dim,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    entry, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(ROWS + entry).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query j of head g at j x groups + g
    query, head = offs_m // groups, kv_head * groups + offs_m % groups
    offs_d = tl.arange(0, BLOCK_D)
    live_m, live_d = query < n_queries, offs_d < head_dim
    pos = tl.load(POS + entry * sp_n + query * sp_q, mask=live_m, other=-1)
    q = tl.load(
        Q + entry * sq_n + head[:, None] * sq_h + query[:, None] * sq_q + offs_d[None, :] * sq_d,
        mask=live_m[:, None] & live_d[None, :],
        other=0.0,
    )
    cells_row = TABLE + row * st_r
    k_head, v_head = K + kv_head * sk_h, V + kv_head * sv_h
    end = tl.max(pos, 0) + 1  # the tile's last query's column, and the keys before it
    high = tl.full([BLOCK_M], -1.0e30, tl.float32)
    m_i = high
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        live_n = offs_n < end
        # each key's block, a table cell per key (BLOCK_N / BLOCK cells, the repeats from the
        # L1 cache): twice as fast as loading each cell once and broadcasting it over its keys
        blocks = tl.load(cells_row + offs_n // BLOCK * st_c, mask=live_n, other=0).to(tl.int64)
        k_at = blocks * sk_b + (offs_n % BLOCK) * sk_t
        k = tl.load(k_head + k_at[None, :] + offs_d[:, None] * sk_d, mask=live_n[None, :] & live_d[:, None], other=0.0)
        s = tl.dot(q, k) * scale
        s = tl.where(offs_n[None, :] <= pos[:, None], s, high[:, None])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_at = blocks * sv_b + (offs_n % BLOCK) * sv_t
        v = tl.load(v_head + v_at[:, None] + offs_d[None, :] * sv_d, mask=live_n[:, None] & live_d[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        OUT + entry * so_n + head[:, None] * so_h + query[:, None] * so_q + offs_d[None, :] * so_d,
        out.to(OUT.dtype.element_ty),
        mask=live_m[:, None] & live_d[None, :],
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`~remote_dspark.drafter.lm.attention.paged_attention` on CUDA (its arguments),
    with the tile sizes measured best (module docstring)."""
    return launch(q, k, v, table, rows, positions, scale, *tiles(q.shape[1] // k.shape[1] * q.shape[2]))


def tiles(rows: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a program's ``rows`` (its queries
    x grouped heads), whatever the pool's block size."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    block_n, stages = (128, 2) if block_m == 16 else (64, 3)
    return block_m, block_n, 4, stages


def launch(q, k, v, table, rows, positions, scale, block_m, block_n, warps, stages) -> torch.Tensor:
    """:func:`attention` with its tiles named (the benchmark's sweep)."""
    n, heads, queries, head_dim = q.shape
    out = torch.empty_like(q)
    if n == 0 or queries == 0:
        return out
    groups = heads // k.shape[1]
    grid = (n, k.shape[1], triton.cdiv(queries * groups, block_m))
    _attention_kernel[grid](
        q, k, v, out, table, rows, positions,
        scale,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *table.stride(), *positions.stride(),
        queries, groups, head_dim,
        BLOCK=k.shape[2], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


@triton.jit
def _top2_kernel(X, stride, vocab, TOKEN, MARGIN, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    low = -1.0e30
    best = tl.full([BLOCK], low, tl.float32)
    second = tl.full([BLOCK], low, tl.float32)
    index = tl.zeros([BLOCK], tl.int64)
    peak = tl.full([BLOCK], low, tl.float32)  # each lane's running maximum and sum of exp(x - peak)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        at = start + lanes
        x = tl.load(X + row * stride + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
        better = x > best
        second = tl.where(better, best, tl.maximum(second, x))
        index = tl.where(better, at.to(tl.int64), index)
        best = tl.where(better, x, best)
        top = tl.maximum(peak, x)
        total = total * tl.exp(peak - top) + tl.exp(x - top)
        peak = top
    b = tl.max(best, 0)
    i = tl.min(tl.where(best == b, index, vocab), 0)  # the first of equal best logits
    r = tl.maximum(tl.max(second, 0), tl.max(tl.where(index == i, low, best), 0))
    m = tl.max(peak, 0)
    lse = m + tl.log(tl.sum(total * tl.exp(peak - m), 0))
    tl.store(TOKEN + row, i)
    tl.store(MARGIN + row, tl.exp(b - lse) - tl.exp(r - lse))


def top2(logits: torch.Tensor, block: int = 4096, num_warps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    n, vocab = logits.shape
    token = torch.empty(n, dtype=torch.int64, device=logits.device)
    margin = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        _top2_kernel[(n,)](logits, logits.stride(0), vocab, token, margin, BLOCK=block, num_warps=num_warps)
    return token, margin

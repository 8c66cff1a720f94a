"""The model drafter's Triton kernels (CUDA only: imported when a CUDA round first needs
them): attention over the store's rows in place, and the greedy token with its margin.

:func:`attention` (:func:`remote_dspark.drafter.lm.attention.paged_attention`): one
program per (entry, query head, block of ``BLOCK_M`` queries) loads its queries and their
columns, then walks its entry's row from column 0 to its last query's column in steps of
``BLOCK_N`` keys (tuned per query block) with flash attention's online softmax (running maximum, running sum,
rescaled accumulator; float32). A key is seen by a query at a column at least its own
(the causal rule within the row); masked scores are a large negative number, not -inf,
so a block of padding queries never makes a NaN. Head sizes that are not a power of two
(or under 16, what ``tl.dot`` needs) are padded with zeros.

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
    Q, K, V, OUT, ROWS, POS,
    scale,
    sq_n, sq_h, sq_q, sq_d,
    sk_r, sk_h, sk_t, sk_d,
    sv_r, sv_h, sv_t, sv_d,
    so_n, so_h, so_q, so_d,
    sp_n, sp_q,
    n_queries, groups, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    entry, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(ROWS + entry).to(tl.int64)
    kv_head = head // groups
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    live_m, live_d = offs_m < n_queries, offs_d < head_dim
    pos = tl.load(POS + entry * sp_n + offs_m * sp_q, mask=live_m, other=-1)
    q = tl.load(
        Q + entry * sq_n + head * sq_h + offs_m[:, None] * sq_q + offs_d[None, :] * sq_d,
        mask=live_m[:, None] & live_d[None, :],
        other=0.0,
    )
    k_row = K + row * sk_r + kv_head * sk_h
    v_row = V + row * sv_r + kv_head * sv_h
    end = tl.max(pos, 0) + 1  # the block's last query's column, and the keys before it
    high = tl.full([BLOCK_M], -1.0e30, tl.float32)
    m_i = high
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        live_n = offs_n < end
        k = tl.load(
            k_row + offs_n[None, :] * sk_t + offs_d[:, None] * sk_d, mask=live_n[None, :] & live_d[:, None], other=0.0
        )
        s = tl.dot(q, k) * scale
        s = tl.where(offs_n[None, :] <= pos[:, None], s, high[:, None])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_row + offs_n[:, None] * sv_t + offs_d[None, :] * sv_d, mask=live_n[:, None] & live_d[None, :], other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        OUT + entry * so_n + head * so_h + offs_m[:, None] * so_q + offs_d[None, :] * so_d,
        out.to(OUT.dtype.element_ty),
        mask=live_m[:, None] & live_d[None, :],
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    n, heads, queries, head_dim = q.shape
    out = torch.empty_like(q)
    if n == 0 or queries == 0:
        return out
    block_m = min(64, max(16, triton.next_power_of_2(queries)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    # measured on an H200 (GPT-2 small's heads, 256 rows of ~90 columns): a few queries
    # stream longer key blocks; a prefill's 64 pipelines more stages of shorter ones
    block_n, stages = (128, 2) if block_m == 16 else (64, 3)
    grid = (n, heads, triton.cdiv(queries, block_m))
    _attention_kernel[grid](
        q, k, v, out, rows, positions,
        scale,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *positions.stride(),
        queries, heads // k.shape[1], head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4, num_stages=stages,
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

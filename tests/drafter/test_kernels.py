"""The round's two kernels. Attention over the KV pool's blocks in place
(remote_dspark.drafter.lm.attention): each entry's queries see their own stream's columns
up to their own, read through its block table wherever its blocks lie, never another
stream's, never the trash block; the Triton kernel agrees with the gathering reference
(in Triton's interpreter on the CPU, compiled on CUDA: blocks of 16, 32 and 64 tokens,
grouped key heads, head sizes under 16 and not powers of two, one query and a prefill of
many, rows in any order, padding queries finite). The greedy token and its margin
(remote_dspark.drafter.lm.graphs.top2): softmax's top two, on the CPU and on CUDA."""

import math
import os

import pytest
import torch

from remote_dspark.drafter.lm.attention import paged_attention, reference_attention
from remote_dspark.drafter.lm.graphs import top2

TRASH = 1e4  # the trash block's keys and values: huge, so a query that saw one would show it


def pool_and_queries(
    block: int, q_heads: int, kv_heads: int, head_dim: int, n: int, queries: int, longest: int, seed=0
):
    """A layer's views of a pool (``k``, ``v``: ``[blocks, kv_heads, block, head_dim]``,
    strided like the real pool's: slices of ``[blocks, layers, 2, ...]``) whose blocks are
    dealt shuffled to the streams of a block table of ``n + 3`` rows (cells past a
    stream's blocks 0: the trash block, filled with ``TRASH``); ``n`` entries over a
    permutation of the table's rows, each entry's ``queries`` columns ending at a random
    column of its stream (at most ``longest``), and ``q``."""
    g = torch.Generator().manual_seed(seed)
    table_rows, width = n + 3, longest // block + 1
    lengths = torch.randint(queries, longest + 1, (table_rows,), generator=g)  # columns held
    held = (lengths + block - 1) // block
    dealt = 1 + torch.randperm(int(held.sum()), generator=g)  # block 0 is the trash block
    table = torch.zeros(table_rows, width, dtype=torch.int64)
    for r, (start, count) in enumerate(zip((held.cumsum(0) - held).tolist(), held.tolist())):
        table[r, :count] = dealt[start : start + count]
    whole = torch.randn(1 + len(dealt), 3, 2, kv_heads, block, head_dim, generator=g)
    whole[0] = TRASH
    k, v = whole[:, 1, 0], whole[:, 1, 1]
    rows = torch.randperm(table_rows, generator=g)[:n]
    last = (torch.rand(n, generator=g) * (lengths[rows] - queries + 1)).long() + queries - 1
    positions = last[:, None] - torch.arange(queries - 1, -1, -1)  # each entry's queries end at its last
    q = torch.randn(n, q_heads, queries, head_dim, generator=g)
    return q, k, v, table, rows, positions


def naive(q, k, v, table, rows, positions, scale):
    """One entry, one head, one query at a time: softmax over the stream's columns 0..c,
    each column looked up in the table on its own."""
    out = torch.zeros_like(q)
    groups, block = q.shape[1] // k.shape[1], k.shape[2]
    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            for j in range(q.shape[2]):
                cols = range(int(positions[i, j]) + 1)
                at = [(int(table[rows[i], c // block]), c % block) for c in cols]
                keys = torch.stack([k[b, h // groups, o] for b, o in at])
                values = torch.stack([v[b, h // groups, o] for b, o in at])
                out[i, h, j] = torch.softmax(keys @ q[i, h, j] * scale, 0) @ values
    return out


@pytest.mark.parametrize(
    "block,q_heads,kv_heads,head_dim,queries", [(16, 2, 2, 16, 1), (4, 4, 2, 8, 3), (8, 3, 1, 20, 5)]
)
def test_the_reference_sees_each_streams_own_columns_up_to_each_querys(block, q_heads, kv_heads, head_dim, queries):
    q, k, v, table, rows, positions = pool_and_queries(block, q_heads, kv_heads, head_dim, 5, queries, 40)
    got = reference_attention(q, k, v, table, rows, positions, 0.3)
    assert torch.allclose(got, naive(q, k, v, table, rows, positions, 0.3), atol=1e-5)
    assert got.abs().max() < 10  # no trash seen


def test_uneven_heads_are_refused_naming_both():
    q, k, v, table, rows, positions = pool_and_queries(16, 3, 2, 8, 2, 1, 20)
    with pytest.raises(ValueError, match="3 query heads over 2 key heads"):
        paged_attention(q, k, v, table, rows, positions)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter runs on CPU tensors only")
@pytest.mark.parametrize(
    "block,q_heads,kv_heads,head_dim,queries,block_n",
    [(16, 2, 2, 16, 1, 32), (4, 4, 2, 8, 3, 16), (8, 3, 1, 20, 5, 8), (16, 2, 1, 12, 20, 64)],
)
def test_the_kernel_in_the_interpreter_agrees_with_the_reference(block, q_heads, kv_heads, head_dim, queries, block_n):
    """The kernel's paging on the CPU (key tiles of one block and of several, grouped
    heads packed into one program's rows, a tile spanning two heads' queries)."""
    from remote_dspark.drafter.lm import _kernels

    q, k, v, table, rows, positions = pool_and_queries(block, q_heads, kv_heads, head_dim, 4, queries, 70, seed=1)
    want = reference_attention(q, k, v, table, rows, positions, 0.3)
    got = _kernels.launch(q, k, v, table, rows, positions, 0.3, 16, block_n, 4, 1)
    assert torch.allclose(got, want, atol=1e-4)


def on_cuda_bf16(*tensors):
    return [t.cuda().bfloat16() if t.is_floating_point() else t.cuda() for t in tensors]


@pytest.mark.gpu
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,queries,longest",
    [(12, 12, 64, 1, 700), (12, 12, 64, 4, 145), (4, 2, 8, 3, 33), (8, 2, 128, 70, 300), (3, 3, 80, 17, 90),
     (32, 8, 64, 1, 2100), (12, 12, 64, 512, 600)],
)  # fmt: skip
def test_the_cuda_kernel_agrees_with_the_reference(block, q_heads, kv_heads, head_dim, queries, longest):
    q, k, v, table, rows, positions = pool_and_queries(block, q_heads, kv_heads, head_dim, 24, queries, longest, seed=3)
    scale = 1 / math.sqrt(head_dim) / 2
    want = reference_attention(q, k, v, table, rows, positions, scale)
    k[0] = v[0] = math.nan  # the kernel never reads the trash block for a real query: not even a NaN there shows
    got = paged_attention(*on_cuda_bf16(q, k, v, table, rows, positions), scale)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.allclose(got.float().cpu(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [16, 64])
def test_the_cuda_kernels_padding_queries_are_finite(block):
    """A round padded for its CUDA graph: padding entries at column 0 and at other columns
    of real streams (their writes went to the trash block), and of a stream with no
    blocks (the trash block itself: huge values)."""
    q, k, v, table, rows, positions = pool_and_queries(block, 4, 2, 64, 16, 4, 200, seed=5)
    table[rows[0]] = 0  # a stream with no blocks
    positions[:4] = 0
    positions[4:8] = torch.arange(4)
    got = paged_attention(*on_cuda_bf16(q, k, v, table, rows, positions), 0.125)
    assert torch.isfinite(got).all()
    want = reference_attention(q, k, v, table, rows, positions, 0.125)
    assert torch.allclose(got[1:].float().cpu(), want[1:], atol=3e-2, rtol=3e-2)


def softmax_top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first of the best logits and softmax's margin over the runner-up (float64):
    of equal best logits the first wins and the margin is 0."""
    x = logits.double()
    first = (x == x.max(-1, keepdim=True).values).double().argmax(-1)
    probs = torch.softmax(x, -1)
    best = probs.gather(-1, first[:, None])[:, 0]
    runner_up = probs.scatter(-1, first[:, None], -1.0).max(-1).values
    return first, (best - runner_up).float()


def test_top2_is_softmaxs_best_token_and_its_margin_over_the_runner_up():
    logits = torch.randn(9, 300, generator=torch.Generator().manual_seed(1)) * 4
    logits[3, 17] = logits[3, 40] = logits[3].max() + 1  # a tie: margin 0
    token, margin = top2(logits.clone())
    want_token, want_margin = softmax_top2(logits)
    assert token.tolist() == want_token.tolist() and want_token[3] == 17
    assert torch.allclose(margin, want_margin, atol=1e-6) and margin[3] == 0


@pytest.mark.gpu
def test_the_cuda_top2_agrees_with_softmax_over_a_padded_heads_bf16_logits():
    """GPT-2's vocabulary of 50,257 read through a view of a 50,304-wide head's output; bf16
    logits tie often, and the first of equal best logits wins."""
    g = torch.Generator().manual_seed(2)
    padded = (torch.randn(300, 50304, generator=g) * 3).bfloat16()
    padded[7, 5] = padded[7, 50000] = padded[7].max() + 1  # a tie: margin 0
    padded[8, 50256] = 100  # the last of the vocabulary
    padded[9, 50300] = 100  # past it: never seen
    token, margin = top2(padded.cuda()[:, :50257])
    want_token, want_margin = softmax_top2(padded[:, :50257])
    assert token.cpu().tolist() == want_token.tolist() and token[7] == 5 and token[8] == 50256
    assert torch.allclose(margin.cpu(), want_margin, atol=1e-5) and margin[7] == 0 and token[9] != 50300

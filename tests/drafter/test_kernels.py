"""The round's two kernels. Attention over the KV store's rows in place
(remote_dspark.drafter.lm.attention): each entry's queries see their own row's columns up
to their own, never another row's, never the trash column; the CUDA kernel agrees with
the gathering reference (grouped key heads, head sizes under 16 and not powers of two,
one query and many, rows in any order). The greedy token and its margin
(remote_dspark.drafter.lm.graphs.top2): softmax's top two, on the CPU and on CUDA."""

import math

import pytest
import torch

from remote_dspark.drafter.lm.attention import paged_attention, reference_attention
from remote_dspark.drafter.lm.graphs import top2


def store_and_queries(
    rows: int, q_heads: int, kv_heads: int, columns: int, head_dim: int, n: int, queries: int, seed=0
):
    """A layer's store view [rows, kv_heads, columns, head_dim] with a stride like the real
    one's (a slice of a bigger tensor), queries of ``n`` entries over a permutation of
    rows, and each entry's query columns (increasing, under the trash column)."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(rows, 3, 2, kv_heads, columns, head_dim, generator=g)
    k, v = whole[:, 1, 0], whole[:, 1, 1]
    q = torch.randn(n, q_heads, queries, head_dim, generator=g)
    which = torch.randperm(rows, generator=g)[:n]
    last = torch.randint(queries - 1, columns - 1, (n, 1), generator=g)
    positions = last - torch.arange(queries - 1, -1, -1)  # each entry's queries end at its last column
    return q, k, v, which, positions


def naive(q, k, v, rows, positions, scale):
    """One entry, one head, one query at a time: softmax over the row's columns 0..c."""
    out = torch.zeros_like(q)
    groups = q.shape[1] // k.shape[1]
    for i in range(q.shape[0]):
        for h in range(q.shape[1]):
            for j in range(q.shape[2]):
                c = int(positions[i, j])
                keys, values = k[rows[i], h // groups, : c + 1], v[rows[i], h // groups, : c + 1]
                out[i, h, j] = torch.softmax(keys @ q[i, h, j] * scale, 0) @ values
    return out


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,queries", [(2, 2, 16, 1), (4, 2, 8, 3), (3, 1, 20, 5)])
def test_the_reference_sees_each_entrys_own_row_up_to_each_querys_column(q_heads, kv_heads, head_dim, queries):
    q, k, v, rows, positions = store_and_queries(6, q_heads, kv_heads, 11, head_dim, 4, queries)
    got = reference_attention(q, k, v, rows, positions, 0.3)
    assert torch.allclose(got, naive(q, k, v, rows, positions, 0.3), atol=1e-5)
    k[:, :, -1] = 1e4  # the trash column: never seen
    assert torch.allclose(reference_attention(q, k, v, rows, positions, 0.3), got, atol=1e-5)


def test_uneven_heads_are_refused_naming_both():
    q, k, v, rows, positions = store_and_queries(4, 3, 2, 8, 8, 2, 1)
    with pytest.raises(ValueError, match="3 query heads over 2 key heads"):
        paged_attention(q, k, v, rows, positions)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,queries,columns",
    [(12, 12, 64, 1, 145), (12, 12, 64, 4, 145), (4, 2, 8, 3, 33), (8, 2, 128, 70, 300), (3, 3, 80, 17, 90)],
)
def test_the_cuda_kernel_agrees_with_the_reference(q_heads, kv_heads, head_dim, queries, columns):
    q, k, v, rows, positions = store_and_queries(40, q_heads, kv_heads, columns, head_dim, 24, queries, seed=3)
    scale = 1 / math.sqrt(head_dim) / 2
    want = reference_attention(q, k, v, rows, positions, scale)
    on = [t.cuda() for t in (q, k, v, rows, positions)]
    got = paged_attention(*(t.bfloat16() if t.is_floating_point() else t for t in on), scale)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.allclose(got.float().cpu(), want, atol=3e-2, rtol=3e-2)


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

"""A model drafter's working memory for one call, and the call budget that fits it.

The store (:class:`~remote_dspark.drafter.lm.pool.KVStore`) is the drafter's fixed
memory; what a call adds is transient: the activations of one part of the round
(:func:`~remote_dspark.drafter.lm.graphs.parts`: at most ``limit`` padded tokens through
the model) and a row of logits per entry at each draft step. Its bound
(:func:`working_bytes`), with T = ``limit``, R = the call's rows rounded up to a power
of two, H the model's hidden width, F its widest layer matrix, V its head's rows and C a
stream's columns, b the dtype's bytes::

    T x b x (4 H + 2 F)                 hidden states, a layer's widest output, residuals
    R x V x (b + 8)                     logits, and their float32 copy and scratch (top2)
    off CUDA, the reference attention (no kernel) adds, whatever the part:
    2 x max(REFERENCE_BYTES, one entry) its chunks' gathered blocks and scores (float32),
                                        one entry's being 2 x heads x C x head_dim x b
                                        and heads x C x 8 for one query

On CUDA the memory of the round's graphs is this bound too: they share one pool and
never run at once (:mod:`.graphs`); the caching allocator hands out memory in segments
of 2 MiB, so the bound adds ``SEGMENTS`` (four of them) there. Not in it: what the libraries allocate once, on the
first call (cuBLAS keeps a workspace per stream: two, the round's and the captures'
warm-up stream, tens of MiB each on a recent GPU).

The worker's call budget (``--max-batch-entries``, ``--max-batch-tokens``) sets T and
R: a part is at most ``2 x`` the budget's tokens rounded up to a power of two
(:func:`part_limit`), so that any call within the budget is one part unless its
contexts are very uneven, and R is the entries rounded up. :func:`fitting_tokens`
derives the token budget from the memory free on the device, when the worker is not
told one.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import REFERENCE_BYTES
from .graphs import LONG_QUERIES, MIN_ROWS, padded

HEADROOM = 2  # a derived budget leaves the working set this share of the free memory (1 / HEADROOM)
SEGMENTS = 4 << 21  # on CUDA: the caching allocator's granularity, four segments of 2 MiB


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def part_limit(max_tokens: int, columns: int) -> int:
    """Padded tokens of one part of a call within a budget of ``max_tokens`` tokens: twice
    the budget rounded up to a power of two, and at least the largest padded shape of one
    entry of up to ``columns`` tokens (so every entry fits a part: :func:`.graphs.padded`;
    an entry of at most ``LONG_QUERIES`` pads to ``MIN_ROWS`` rows, which for a short
    budget is more than one whole stream of ``columns`` padded from 1)."""
    alone = max(rows * queries for rows, queries in (padded(1, q) for q in (columns, min(columns, LONG_QUERIES))))
    return max(2 * _pow2(max_tokens), alone)


def widths(model: nn.Module) -> tuple[int, int, int]:
    """The model's hidden width, its widest layer matrix (an MLP's inner width, fused QKV)
    and its head's rows, read from its weights: every matrix outside its embeddings and
    its head (``model.head``, or transformers' output embeddings) is a layer's."""
    heads = [getattr(model, "head", None)]
    lm = getattr(model, "lm", None)
    if lm is not None:
        heads.append(lm.get_output_embeddings())
    skip = {id(m) for m in heads if m is not None}
    hidden, widest = 0, 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            hidden = max(hidden, module.embedding_dim)
            continue
        weight = getattr(module, "weight", None)
        if id(module) in skip or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        widest = max(widest, *weight.shape)
    head = next((m for m in heads if m is not None), None)
    rows = head.weight.shape[0] if head is not None else model.config.vocab_size
    return hidden, max(widest, hidden), int(rows)


def working_bytes(model: nn.Module, store, entries: int, limit: int) -> int:
    """An upper bound of one call's transient memory (module docstring): ``entries``
    rows, parts of at most ``limit`` padded tokens, on ``store``'s device and dtype."""
    hidden, widest, vocab = widths(model)
    b = store.kv.element_size()
    rows = max(MIN_ROWS, _pow2(entries))
    total = limit * b * (4 * hidden + 2 * widest) + rows * vocab * (b + 8)
    if store.device.type == "cuda":
        total += SEGMENTS
    else:
        head_dim = model.config.head_dim
        heads = max(model.config.n_heads, hidden // head_dim)  # query heads (grouped keys are repeated)
        total += reference_bytes(heads, head_dim, store.columns, b)
    return int(total)


def reference_bytes(heads: int, head_dim: int, columns: int, b: int) -> int:
    """The most the CPU's reference attention holds at once (:func:`.attention.reference_attention`:
    chunks of entries and queries within ``REFERENCE_BYTES``, one entry and query at least)."""
    return 2 * max(REFERENCE_BYTES, 2 * heads * columns * head_dim * b + heads * columns * 8)


def fitting_tokens(model: nn.Module, store, entries: int, ceiling: int, free: int) -> int:
    """The most tokens, a power of two up to ``ceiling`` (or ``ceiling`` itself), whose
    call of ``entries`` entries needs at most ``free / HEADROOM`` bytes.

    Raises: ValueError when not even 1024 tokens do."""
    tokens = ceiling
    while working_bytes(model, store, entries, part_limit(tokens, store.columns)) > free // HEADROOM:
        if tokens <= 1024:
            need = working_bytes(model, store, entries, part_limit(tokens, store.columns))
            raise ValueError(
                f"a call of {entries} entries and {tokens} tokens needs {need / 2**20:,.0f} MiB of working "
                f"memory; {free / 2**20:,.0f} MiB are free on {store.device}, half of it for calls"
            )
        tokens = _pow2(tokens) // 2
    return tokens

"""A model drafter's round as arrays on the host, before and after the model runs: each
entry's tokens to encode (:func:`stream_window`: from its context, or its whole stream
through the worker's reader), a sampled round's integers (:func:`sampling_rows`) and the
round's answer (:func:`greedy_result`, :func:`round_result`). No loop over entries."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..contract import DraftBatch, DraftResult, sampling_inputs
from ..sampling import TOP
from ..streams import context_lengths, stream_tokens


def sampling_rows(batch: DraftBatch, ctx_lens: np.ndarray) -> np.ndarray:
    """A sampled round's integers per entry, for :meth:`.graphs.Rounds.run`: [3, n] int64,
    each entry's temperature (its float32 bits), seed (its uint64 bits) and its draft 0's
    absolute position (``starts + ctx_lens``).

    Raises: ValueError naming ``temperature`` or ``seed`` (:func:`~..contract.sampling_inputs`)."""
    t, seed = sampling_inputs(batch)
    out = np.empty((3, len(batch)), np.int64)
    out[0] = t.view(np.int32)  # every temperature's bits below 2**31 (-0.0 is +0.0 there)
    out[1] = seed.view(np.int64)
    out[2] = batch.starts() + ctx_lens
    return out


def greedy_result(batch: DraftBatch, ctx_lens: np.ndarray, tokens: np.ndarray, margins: np.ndarray) -> DraftResult:
    """The round's answer from ``width`` greedy steps for every entry: ``min(n_out,
    width)`` drafts each (none for an empty context), zeros past the counts."""
    counts = np.where(ctx_lens > 0, np.minimum(batch.n_out, batch.width), 0).astype(np.int32)
    live = np.arange(batch.width) < counts[:, None]
    return DraftResult(
        np.where(live, tokens, 0).astype(np.int32),
        counts,
        np.where(live, margins, 0).astype(np.float32) if batch.want_margin else None,
    )


def round_result(batch: DraftBatch, ctx_lens: np.ndarray, out: np.ndarray) -> DraftResult:
    """The round's answer from :meth:`.graphs.Rounds.run`'s ``out`` [n, columns]: greedy
    (:func:`greedy_result`), or sampled with each drafted position's distribution
    (``q_ids`` int32, ``q_weights`` uint16 ``[n, width, TOP]``, zeros past the counts)."""
    n, width = len(batch), batch.width
    result = greedy_result(batch, ctx_lens, out[:, :width], out[:, width : 2 * width])
    if not batch.sampled:
        return result
    q = out[:, 2 * width :].reshape(n, 2, width, TOP)
    live = (np.arange(width) < result.counts[:, None])[..., None]
    q_ids = np.where(live, q[:, 0], 0).astype(np.int32)
    q_weights = np.where(live, q[:, 1], 0).astype(np.uint16)
    return dataclasses.replace(result, q_ids=q_ids, q_weights=q_weights)


def stream_window(batch: DraftBatch, take: np.ndarray, q: int) -> np.ndarray:
    """[n, q] int64: each entry's last ``take[i]`` stream tokens, left-aligned, zeros past
    them: from the contexts (one gather) when they hold them, else read through
    :func:`~remote_dspark.drafter.streams.stream_tokens` (a stream re-encoded whole)."""
    n = len(batch)
    ctx_lens = context_lengths(batch)
    if bool((take <= ctx_lens).all()):
        src = batch.tokens if len(batch.tokens) else np.zeros(1, np.int32)
        idx = (batch.offsets[1:] - take)[:, None] + np.arange(q)
        return np.where(np.arange(q) < take[:, None], src[np.clip(idx, 0, len(src) - 1)], 0)
    tok = np.zeros((n, q), np.int64)
    some = np.flatnonzero(take > 0)
    lengths = np.asarray(batch.lengths, np.int64)[some]
    flat, offsets = stream_tokens(batch, some, lengths - take[some], lengths)
    row = np.repeat(some, take[some])
    tok[row, np.arange(len(flat)) - np.repeat(offsets[:-1], take[some])] = flat
    return tok

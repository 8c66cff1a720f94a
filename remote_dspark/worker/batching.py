"""A drafting call's arithmetic: what an entry costs in a call's budget, several rounds
merged into one call's batch and the answer split back, a round's pieces gathered.

The scheduler (:mod:`.scheduler`) decides what one call takes; these functions are the
arrays' side of it, with no state of their own. The worker's limits use the entry's
cost to refuse a HELLO whose entry could never fit a call (:mod:`.limits`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..drafter.contract import DraftBatch, DraftResult


def entry_cost(context, width: int, context_read: int | None):
    """An entry's cost in a call's budget (``context`` its context's length, or an array
    of them): the tokens the drafter runs for it, the context it reads (all of it, or its
    last ``context_read`` tokens: the drafter's
    :func:`~remote_dspark.drafter.contract.context_read_of`) and its drafts (``width``; at
    least one)."""
    return (context if context_read is None else np.minimum(context, context_read)) + max(1, width)


def entry_costs(batch: DraftBatch, context_read: int | None) -> np.ndarray:
    """[n] each entry's cost in a call's budget (:func:`entry_cost`)."""
    return entry_cost(np.diff(batch.offsets), batch.width, context_read)


def call_cost(batch: DraftBatch, context_read: int | None) -> int:
    """The whole batch's cost (:func:`entry_costs` summed)."""
    if context_read is None:  # no prefix work: the common case of a drafter reading whole contexts
        return int(batch.offsets[-1]) + len(batch) * max(1, batch.width)
    return int(entry_costs(batch, context_read).sum())


def merge(batches: list[DraftBatch]) -> DraftBatch:
    """One batch of several sessions' rounds (the same row size, all sampled or none; the
    scheduler merges rounds of one width, any works), entry order kept: a session per
    entry, the widest width, margins when any round asks."""
    sizes = [len(b) for b in batches]
    lens = np.concatenate([np.diff(b.offsets) for b in batches])
    offsets = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return DraftBatch(
        np.concatenate([b.tokens for b in batches]),
        offsets,
        np.concatenate([b.n_out for b in batches]),
        np.concatenate([b.rows for b in batches]),
        any(b.want_margin for b in batches),
        max(b.width for b in batches),
        session=np.repeat([int(b.session) for b in batches], sizes).astype(np.int64),
        slots=np.concatenate([b.slots for b in batches]),
        gens=np.concatenate([b.gens for b in batches]),
        lengths=np.concatenate([b.lengths for b in batches]),
        positions=np.concatenate([b.starts() for b in batches]),
        temperature=np.concatenate([b.temperature for b in batches]) if batches[0].sampled else None,
        seed=np.concatenate([b.seed for b in batches]) if batches[0].sampled else None,
    )


def part(result: DraftResult, start: int, batch: DraftBatch) -> DraftResult:
    """``batch``'s part of a merged call's ``result`` (its entries from ``start``), in its
    own width and with margins only if it asked."""
    rows, cols = slice(start, start + len(batch)), slice(0, batch.width)
    margins = result.margins[rows, cols] if batch.want_margin and result.margins is not None else None
    q = (result.q_ids[rows, cols], result.q_weights[rows, cols]) if batch.sampled else (None, None)
    return DraftResult(result.tokens[rows, cols], result.counts[rows], margins, *q)


def gather(parts: DraftResult | None, n: int, start: int, got: DraftResult) -> DraftResult:
    """A piece's drafts (``got``, entries from ``start``) into a round of ``n`` entries'
    drafts gathered so far (``parts``; None: none yet): ``got`` itself when it is the whole
    round, else ``parts`` (made on the first piece) with the piece's rows written."""
    if len(got.counts) == n:
        return got
    if parts is None:

        def like(a):  # the whole round's array of a piece's
            return None if a is None else np.zeros((n, *a.shape[1:]), a.dtype)

        parts = DraftResult(*(like(getattr(got, f.name)) for f in dataclasses.fields(DraftResult)))
    rows = slice(start, start + len(got.counts))
    for f in dataclasses.fields(DraftResult):
        if getattr(got, f.name) is not None:
            getattr(parts, f.name)[rows] = getattr(got, f.name)
    return parts

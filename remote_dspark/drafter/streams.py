"""A stream's tokens beyond its context: what a drafter that keeps whole streams reads.

A worker serving a drafter that keeps its streams' state (``keeps_streams``: a model
drafter's KV) keeps each stream's tokens too, up to the drafter's ``max_context`` per
stream (4 bytes a token), apart from the drafter's state. A batch then names, besides
each entry's context (its stream's last tokens), the first stream index the worker still
holds (``DraftBatch.kept_from``) and the worker's reader (``DraftBatch.history``, a
:class:`TokenReader`). A drafter whose state for a stream was dropped (evicted, or never
made) re-encodes the stream from what the worker holds, not from its context only;
:func:`stream_tokens` reads any span of it.

Stream indices count a stream's tokens since its NEW_GEN: entry i's context is its
stream's indices ``lengths[i] - len(context)`` to ``lengths[i] - 1``, and stream index j
sits at absolute position ``origins(batch)[i] + j``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from .contract import DraftBatch


class TokenReader(Protocol):
    """The worker's tokens of every stream it serves (one reader for all sessions)."""

    def read(
        self, sessions: np.ndarray, slots: np.ndarray, first: np.ndarray, stop: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Stream ``(sessions[i], slots[i])``'s tokens at indices ``first[i]`` to
        ``stop[i] - 1`` (int64 arrays; within what the worker holds now), as one flat int32
        array and its ``[m + 1]`` int64 offsets."""


def context_lengths(batch: DraftBatch) -> np.ndarray:
    """[n] int64: each entry's context length."""
    return np.diff(batch.offsets).astype(np.int64)


def kept(batch: DraftBatch) -> np.ndarray:
    """[n] int64: each entry's first stream index a drafter can read: ``kept_from``, or
    where the batch names none its context's first (``lengths - len(context)``; 0 for a
    batch without lengths, whose contexts are whole)."""
    ctx = context_lengths(batch)
    if batch.lengths is None:
        return np.zeros(len(batch), np.int64)
    first = np.asarray(batch.lengths, np.int64) - ctx
    return first if batch.kept_from is None or batch.history is None else np.asarray(batch.kept_from, np.int64)


def origins(batch: DraftBatch) -> np.ndarray:
    """[n] int64: the absolute position of each entry's stream index 0."""
    if batch.lengths is None:
        return batch.starts()
    return batch.starts() + context_lengths(batch) - np.asarray(batch.lengths, np.int64)


def stream_tokens(
    batch: DraftBatch, idx: np.ndarray, first: np.ndarray, stop: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Entries ``idx``'s stream tokens at indices ``first`` to ``stop - 1`` (int64 [m]
    each): from the context where it holds them, else from the worker's reader; one flat
    int32 array and its ``[m + 1]`` int64 offsets.

    Raises: ValueError for a span outside ``kept(batch)`` to ``lengths`` (or the context,
    for a batch without lengths)."""
    idx, first, stop = (np.asarray(a, np.int64) for a in (idx, first, stop))
    ctx = context_lengths(batch)[idx]
    end = ctx if batch.lengths is None else np.asarray(batch.lengths, np.int64)[idx]
    low = kept(batch)[idx]
    bad = (first < low) | (stop < first) | (stop > end)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"stream tokens {int(first[i])}..{int(stop[i])} of entry {int(idx[i])}: "
            f"the worker holds {int(low[i])}..{int(end[i])}"
        )
    counts = stop - first
    offsets = np.zeros(len(idx) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    out = np.empty(int(offsets[-1]), np.int32)
    in_ctx = first >= end - ctx
    c = np.flatnonzero(in_ctx & (counts > 0))
    if len(c):  # one gather: each span's indices in the context
        out[_spans(offsets[c], counts[c])] = batch.tokens[
            _spans(batch.offsets[idx[c]] + first[c] - (end[c] - ctx[c]), counts[c])
        ]
    h = np.flatnonzero(~in_ctx & (counts > 0))
    if len(h):
        sessions = batch.sessions()[idx[h]]
        tokens, _ = batch.history.read(sessions, np.asarray(batch.slots, np.int64)[idx[h]], first[h], stop[h])
        out[_spans(offsets[h], counts[h])] = tokens
    return out, offsets


def _spans(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices ``starts[i] .. starts[i] + counts[i] - 1`` of every span, concatenated."""
    total = int(counts.sum())
    lead = np.repeat(starts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return lead + np.arange(total)

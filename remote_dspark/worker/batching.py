"""A drafting call's arithmetic: what an entry costs in a call's budget, several rounds
merged into one call's batch and the answer split back, a round's pieces gathered.

The scheduler (:mod:`.scheduler`) decides what one call takes; these functions are the
arrays' side of it, with no state of their own. What an entry costs is :class:`Charge`'s
(the one place of that rule); the worker's limits use it to refuse a HELLO whose entry
could never fit a call (:mod:`.limits`).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from ..drafter.contract import DraftBatch, DraftResult, context_read_of, encodes_of, keeps_streams_of
from ..drafter.streams import kept, origins, stream_tokens

log = logging.getLogger("remote_dspark.worker")


def entry_cost(context, width: int, context_read: int | None):
    """The most an entry of ``context`` tokens (or an array of lengths) can cost in a call's
    budget (a re-encode): the context it reads (all of it, or its last ``context_read``
    tokens: :func:`~remote_dspark.drafter.contract.context_read_of`) and its drafts
    (``width``; at least one). What it costs in a call is :meth:`Charge.costs`."""
    return (context if context_read is None else np.minimum(context, context_read)) + max(1, width)


class Charge:
    """What each entry costs in a call's budget, for one drafter: the one place of the rule.

    An entry costs the tokens its drafter runs for it: the tokens it encodes or reads of
    its context, then its drafts (the call's width, for an entry that asks for any), one
    token at least. What it encodes is the drafter's word where it says (``encodes``: a
    model drafter's new tokens on a cache hit, its re-encode on a miss; asked when the
    round is first taken, when the drafter is between calls), else its whole context, or
    its last ``context_read`` tokens (a Markov model of order k reads k).

    A drafter that keeps its streams' state across calls (``keeps_streams`` with
    ``encodes``) has an entry's encode taken in **pieces** (:attr:`pieces`): an entry that
    costs more than a whole call is first encoded in calls of its own share, as entries of
    no drafts whose streams are the entry's cut short (:func:`encode_piece`), and
    drafted in the call that takes its last tokens: one engine's long context never holds
    another's round longer than one call."""

    def __init__(self, drafter):
        self.context_read = context_read_of(drafter)
        self._encodes = encodes_of(drafter)
        self.pieces = self._encodes is not None and keeps_streams_of(drafter)
        self.cpu_seconds = 0.0  # the thread CPU its ``encodes`` took (the drafter's host work), read by its owner

    def take_cpu(self) -> float:
        """The CPU seconds ``encodes`` took since the last take (its owner's lock held)."""
        cpu, self.cpu_seconds = self.cpu_seconds, 0.0
        return cpu

    def costs(self, batch: DraftBatch) -> np.ndarray:
        """[n] int64: each entry's cost in a call (the class docstring)."""
        reads = None
        if self._encodes is not None:
            # The drafter's own code, run under the scheduler's lock: whatever it raises or
            # returns amiss costs this round its estimate (a whole read), never the
            # scheduler (the call itself then fails only its own rounds, if it must).
            cpu0 = time.thread_time()
            try:
                reads = np.asarray(self._encodes(batch), np.int64)
            except Exception as e:
                log.warning("the drafter's encodes() raised %r: the round is charged its whole contexts", e)
            else:
                if reads.shape != (len(batch),):
                    log.warning(
                        "the drafter's encodes() gave shape %s for %d entries: ignored", reads.shape, len(batch)
                    )
                    reads = None
            finally:
                self.cpu_seconds += time.thread_time() - cpu0
        if reads is None:
            reads = entry_cost(np.diff(batch.offsets), 0, self.context_read) - 1
        return np.maximum(1, reads + np.where(batch.n_out > 0, batch.width, 0)).astype(np.int64)

    def most(self, window: int, width: int) -> int:
        """The most an entry of a whole window and ``width`` drafts must have of one call:
        its whole re-encode, or with pieces its last piece (a token and its drafts)."""
        return 1 + width if self.pieces else int(entry_cost(window, width, self.context_read))


def encode_piece(batch: DraftBatch, i: int, cut: int) -> DraftBatch:
    """A piece of entry ``i``'s encode (:class:`Charge`): the same stream with its last
    ``cut`` tokens cut off, and no drafts. Its context is the stream's last tokens ending
    at the cut (as many as the entry's context at most, from what the worker keeps:
    :func:`~remote_dspark.drafter.streams.stream_tokens`, through the batch's history
    where the context does not hold them), at their own positions.

    Raises: ValueError, a cut past what the worker keeps of the stream."""
    one = batch.entries(i, i + 1)
    ctx = int(one.offsets[1])
    end = (ctx if one.lengths is None else int(one.lengths[0])) - cut
    first = max(int(kept(one)[0]), end - ctx)
    tokens, _ = stream_tokens(one, np.zeros(1, np.int64), np.array([first]), np.array([end]))
    return dataclasses.replace(
        one,
        tokens=tokens,
        offsets=np.array([0, end - first], np.int64),
        n_out=np.zeros(1, np.int32),
        lengths=None if one.lengths is None else np.array([end], np.int64),
        positions=one.positions if one.lengths is None else origins(one) + first,
    )


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
        kept_from=np.concatenate([kept(b) for b in batches]) if batches[0].history is not None else None,
        history=batches[0].history,  # the worker's one reader, every session's
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

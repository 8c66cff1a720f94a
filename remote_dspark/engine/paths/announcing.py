"""Rounds of at most ``round_tokens`` tokens: :class:`AnnouncingPath` wraps the path that
sends (sync or the hand-off) and gives it, of each batch, the round its
:class:`~..values.announce.Announcer` plans: long NEW_GEN contexts go over the next
rounds in chunks at their true positions (the rule is :mod:`..values.announce`'s).

A round's budget is the smaller of ``round_tokens`` and the most the worker's HELLO_ACK
said it takes in a round (``Spec.round_budget``), read once per round. Most rounds go as
they are: with nothing held and a batch of no more tokens than the budget (its tokens'
*shape*, before any cut), nothing is read and nothing is planned. Otherwise the batch's
metadata is checked and cut on the host, planned, and the planned round goes to the
inner path as a batch of host arrays (its rows, index and sampling fields as given),
which the inner path writes as any other.

``launch()`` never reads metadata on the host: it takes its decision from what the host
has (the held slots' count and the batch's shapes). A batch whose metadata is on the
host is planned there as for ``round()``; one whose metadata is on the device goes as it
is when nothing is held and the budget holds any batch once its contexts are cut on the
device (``max_slots x (cut + num_spec + 1)``: the default ``round_tokens`` does); one
that may need chunking (a smaller budget with more tokens than it, or slots still held)
is refused with a ``ValueError`` naming ``round_tokens``: chunking on the device is a
later step.

Each answer's lost slots (RESYNC, ``resync_all``) are told to the announcer, which counts
the NEW_GEN entries that re-announce them (:class:`~..observe.stats.AnnounceStats`,
with the chunks sent and the slots still announcing: this path's :meth:`stats` adds them
to the inner path's). A batch that went as it is is read for that only while a slot is
owed, after the inner path took it (its metadata checked), and only on the host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ..observe.stats import AnnounceStats, PathStats
from ..spec import Spec
from ..values.announce import Announcer
from ..values.batch import Batch, meta_to_host
from ..values.drafts import Drafts, Launched
from .base import Path, Wrapping


class AnnouncingPath(Wrapping):
    """A :class:`~.base.Path` whose rounds are planned by one :class:`Announcer` (this
    path its one owner; the engine thread its one caller); every other call goes to
    ``inner`` as it is."""

    def __init__(self, inner: Path, spec: Spec):
        super().__init__(inner)
        self.spec = spec
        self.announcer = Announcer(spec.max_slots, spec.context_tokens)
        self._answering = False  # inside a launch() that blocks: its round() is planned already

    def round(self, batch: Batch) -> Drafts:
        if self._answering:  # a blocking launch's answer: its batch is the planned round
            return self.inner.round(batch)
        planned, announcing = self._plan(batch, in_stream=False)
        d = self.inner.round(planned)
        self._answered(batch, planned, d.resync, d.resync_all)
        d.announcing = announcing
        return d

    def launch(self, batch: Batch, answer: Callable[[Batch], Drafts], out=(), status=None) -> Launched:
        planned, announcing = self._plan(batch, in_stream=True)
        self._answering = True
        try:
            launched = self.inner.launch(planned, answer, out, status)
        finally:
            self._answering = False
        self._answered(batch, planned, launched.resync, launched.resync_all)
        launched.announcing = announcing
        return launched

    def stats(self) -> PathStats:
        a = self.announcer
        return dataclasses.replace(self.inner.stats(), announce=AnnounceStats(a.chunks, a.pending, a.reannounced))

    def _answered(self, batch: Batch, planned: Batch, resync, resync_all) -> None:
        """After the inner path took ``planned``: a batch that went as it is pays the
        slots it re-announces (a planned one paid in ``plan``; device metadata is not
        read), then the answer's lost slots are owed."""
        a = self.announcer
        if planned is batch and a.owing and not batch.meta_on_device:
            a.sent(np.asarray(batch.slots, np.int64), np.asarray(batch.new_gen, bool))
        if resync or resync_all:
            a.lost(resync or (), every=bool(resync_all))

    def _plan(self, batch: Batch, in_stream: bool) -> tuple[Batch, tuple[int, ...]]:
        """``batch``'s round and the slots it leaves announcing (see the module docstring).

        Raises:
            ValueError: ``host_meta``'s, naming the field; in stream (``launch()``), a
                batch whose metadata is on the device and may need chunking."""
        a, spec = self.announcer, self.spec
        if a.fits(int(batch.tokens.shape[0]), spec.round_budget(self.inner.acked_round_tokens)):
            return batch, ()  # (the common round: one word read, nothing planned)
        # Once each, the context first (HeaderWords.set_acked stores the cap before it):
        # the cut, the check and the plan agree.
        acked = self.inner.acked_context
        budget = spec.round_budget(self.inner.acked_round_tokens)
        cut = spec.context_cut(acked)
        if batch.meta_on_device and not a.pending and budget >= spec.max_slots * (cut + spec.num_spec + 1):
            return batch, ()  # any batch, its contexts cut on the device, fits: it goes as it is
        if batch.meta_on_device:
            if in_stream:
                raise ValueError(
                    f"round_tokens={spec.max_tokens}: a launch() whose metadata is on the device goes as it is "
                    f"only within a round's tokens ({budget}: round_tokens or the worker's cap on a round's "
                    f"tokens, the smaller) and with no slot still being announced (this batch: "
                    f"{int(batch.tokens.shape[0])} tokens; slots still being announced: {a.pending}); give "
                    "this batch's metadata on the host (launch() then chunks it there) or a larger round_tokens"
                )
            batch = meta_to_host(batch)  # round() blocks anyway
        plan = a.plan(spec.meta(batch, acked, max_tokens=spec.batch_tokens), cut, budget)
        m = plan.meta
        planned = Batch(
            slots=m.slots,
            tokens=m.tokens,
            token_offsets=m.offsets,
            positions=m.positions,
            new_gen=m.new_gen,
            rows=batch.rows,
            row_index=batch.row_index,
            n_out=m.n_out,
            temperature=batch.temperature,
            seed=batch.seed,
        )
        return planned, tuple(np.asarray(plan.announcing).tolist())

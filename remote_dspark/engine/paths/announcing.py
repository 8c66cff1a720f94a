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

Metadata on the device is never read on the host: such a batch goes as it is when
nothing is held (here or on the device) and it fits the budget by its shape, or when the
budget holds any batch once its contexts are cut on the device (``max_slots x (cut +
num_spec + 1)``); else it is planned on the device (:mod:`..values.device_announce`, the
same rule in stream-ordered torch operations), whose state then owns the held slots: what
the host held moves there first, and a batch of host metadata that comes while the
device may still hold a slot is checked and cut on the host, then planned there too.
A ``launch()`` of device metadata always answers in stream order: its
``Launched.announcing`` is None and ``announcing_mask`` (bool ``[max_slots]`` on the
metadata's device) names the slots still announcing, whether the round was planned there
or went as it is (then none: a zero mask, one small fill enqueued).
A host batch planned on the device answers the same way; ``round()`` reads the mask (it
blocks anyway).

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
import torch

from ..observe.stats import AnnounceStats, PathStats
from ..spec import Spec
from ..values.announce import Announcer
from ..values.batch import Batch
from ..values.device_announce import DeviceAnnouncer
from ..values.drafts import Drafts, Launched
from ..writers.device_meta import check_meta_shapes
from .base import Path, Wrapping


class AnnouncingPath(Wrapping):
    """A :class:`~.base.Path` whose rounds are planned by one :class:`Announcer` (this
    path its one owner; the engine thread its one caller); every other call goes to
    ``inner`` as it is."""

    def __init__(self, inner: Path, spec: Spec):
        super().__init__(inner)
        self.spec = spec
        self.announcer = Announcer(spec.max_slots, spec.context_tokens)
        self.on_device: DeviceAnnouncer | None = None  # made at the first round planned on the device
        self._answering = False  # inside a launch() that blocks: its round() is planned already

    def round(self, batch: Batch) -> Drafts:
        if self._answering:  # a blocking launch's answer: its batch is the planned round
            return self.inner.round(batch)
        planned, announcing, mask = self._plan(batch)
        d = self.inner.round(planned)
        self._answered(batch, planned, d.resync, d.resync_all)
        d.announcing = announcing if mask is None else tuple(torch.nonzero(mask).flatten().tolist())
        return d

    def launch(self, batch: Batch, answer: Callable[[Batch], Drafts], out=(), status=None) -> Launched:
        planned, announcing, mask = self._plan(batch)
        self._answering = True
        try:
            launched = self.inner.launch(planned, answer, out, status)
        finally:
            self._answering = False
        self._answered(batch, planned, launched.resync, launched.resync_all)
        if mask is None and batch.meta_on_device:  # went as it is: a mask of no slot (the caller's to keep)
            announcing, mask = None, torch.zeros(self.spec.max_slots, dtype=torch.bool, device=_device_of(batch))
        launched.announcing = announcing
        if mask is not None:
            launched.announcing_mask = mask
        return launched

    def release(self, slots) -> None:
        """The engine freed ``slots``: what they hold is let go (:meth:`Announcer.release`)."""
        self.announcer.release(slots)
        if self.on_device is not None:
            self.on_device.release(slots)

    def stats(self) -> PathStats:
        a = self.announcer
        held, chunks = self.on_device.counts() if self.on_device is not None else (0, 0)
        stats = AnnounceStats(a.chunks + chunks, a.pending + held, a.reannounced)
        return dataclasses.replace(self.inner.stats(), announce=stats)

    def _answered(self, batch: Batch, planned: Batch, resync, resync_all) -> None:
        """After the inner path took ``planned``: a batch that went as it is pays the
        slots it re-announces (a planned one paid in ``plan``; device metadata is not
        read), then the answer's lost slots are owed."""
        a = self.announcer
        if planned is batch and a.owing and not batch.meta_on_device:
            a.sent(np.asarray(batch.slots, np.int64), np.asarray(batch.new_gen, bool))
        if resync or resync_all:
            a.lost(resync or (), every=bool(resync_all))

    def _plan(self, batch: Batch) -> tuple[Batch, tuple[int, ...] | None, torch.Tensor | None]:
        """``batch``'s round, the slots it leaves announcing (None: on the device) and, for
        a round planned on the device, their mask (see the module docstring).

        Raises:
            ValueError: ``host_meta``'s or ``check_meta_shapes``'s, naming the field."""
        a, spec, dev = self.announcer, self.spec, self.on_device
        held_there = dev is not None and dev.maybe_held()
        if not held_there and a.fits(int(batch.tokens.shape[0]), spec.round_budget(self.inner.acked_round_tokens)):
            return batch, (), None  # (the common round: one word read, nothing planned)
        # Once each, the context first (HeaderWords.set_acked stores the cap before it):
        # the cut, the check and the plan agree.
        acked = self.inner.acked_context
        budget = spec.round_budget(self.inner.acked_round_tokens)
        cut = spec.context_cut(acked)
        if batch.meta_on_device:
            if not (a.pending or held_there) and budget >= spec.max_slots * (cut + spec.num_spec + 1):
                return batch, (), None  # any batch, its contexts cut on the device, fits: it goes as it is
            check_meta_shapes(batch, spec.max_slots, spec.sampled)
            return self._plan_on_device(batch, _device_of(batch), cut, budget)
        meta = spec.meta(batch, acked, max_tokens=spec.batch_tokens)
        if held_there:  # the device holds slots: this batch, checked and cut here, is planned there
            a.sent(meta.slots, meta.new_gen)
            host = Batch(meta.slots, meta.tokens, meta.offsets, meta.positions, meta.new_gen, batch.rows,
                         batch.row_index, meta.n_out if not isinstance(meta.n_out, int) else None,
                         batch.temperature, batch.seed)  # fmt: skip
            return self._plan_on_device(host, dev.state.device, cut, budget)
        plan = a.plan(meta, cut, budget)
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
        return planned, tuple(np.asarray(plan.announcing).tolist()), None

    def _plan_on_device(self, batch: Batch, device, cut: int, budget: int) -> tuple[Batch, None, torch.Tensor]:
        """``batch`` planned by the device's announcer (made on ``device`` at its first
        round), which first takes over what the host holds."""
        if self.on_device is None:
            self.on_device = DeviceAnnouncer(self.spec.max_slots, self.spec.context_tokens, device)
        if self.announcer.pending:
            self.on_device.take(self.announcer)
        planned, mask = self.on_device.plan(batch, cut, budget, self.spec.n_out_for(len(batch)))
        return planned, None, mask


def _device_of(batch: Batch) -> torch.device:
    """The accelerator a batch's metadata lives on (its first tensor not on the CPU; else
    the CPU: the tests' stand-in for a device)."""
    fields = (batch.tokens, batch.slots, batch.token_offsets, batch.positions, batch.new_gen, batch.n_out)
    tensors = [t for t in fields if isinstance(t, torch.Tensor)]
    return next((t.device for t in tensors if not t.is_cpu), tensors[0].device)

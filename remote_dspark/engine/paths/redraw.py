"""``VLLM_DSPARK_REMOTE_SAMPLED_REDRAW=1``: the engine's sampled drafts redrawn with its
own randomness before it gets them (:func:`remote_dspark.engine.sampler.redraw`, whose
docstring says why that is exact against any worker and what it costs).

:class:`RedrawPath` wraps the round path of rank 0 (or of the one engine), so every way
drafts leave the facade takes it: ``round()`` (and through it the transformers
integration and the vLLM proposer), ``launch()`` in stream order, and under tensor
parallelism the answer rank 0 broadcasts (the other ranks take it as it is: they hold no
generator, and all ranks verify the same drafts). The redraw happens before the caller
sees a draft, so before its verify pass: the target's rows, the bonus row included, are
computed over the redrawn tokens. A local drafter's drafts (one-hot q) are not the
path's and need none: a pick from a one-hot q is its draft.

The randomness: one ``torch.Generator`` per device, seeded from ``secrets`` (never
torch's default seed, which a worker could know), never shared with the worker.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable

import torch

from ..sampler import redraw
from ..values.batch import Batch
from ..values.drafts import Drafts, Launched
from .base import Path, Wrapping


class RedrawPath(Wrapping):
    """A :class:`~.base.Path` whose sampled drafts are redrawn (module docstring); every
    other call goes to ``inner`` as it is."""

    def __init__(self, inner: Path):
        super().__init__(inner)
        self._generators: dict[torch.device, torch.Generator] = {}

    def round(self, batch: Batch) -> Drafts:
        d = self.inner.round(batch)
        # The statistics count the worker's drafts, as launch() does (there the redrawn
        # counts are on the stream, not the host): what the redraw cuts shows in acceptance.
        sums = d.sums if d.sums is not None else (int(torch.count_nonzero(d.counts)), int(d.counts.sum()))
        tokens, counts = self._redraw(d.tokens, d.counts, d.q_ids, d.q_weights)
        q_ids, q_weights = _zero_past(counts, d.q_ids.clone(), d.q_weights.clone())
        return dataclasses.replace(d, tokens=tokens, counts=counts, q_ids=q_ids, q_weights=q_weights, sums=sums)

    def launch(self, batch: Batch, answer: Callable[[Batch], Drafts], out=(), status=None) -> Launched:
        """The inner launch; its drafts redrawn in place, in stream order, unless it ran
        ``answer`` (a path that blocks: the round went through :meth:`round` already)."""
        answered = False

        def answer_once(b: Batch) -> Drafts:
            nonlocal answered
            answered = True
            return answer(b)

        launched = self.inner.launch(batch, answer_once, out, status)
        if not answered:
            tokens, counts = self._redraw(launched.tokens, launched.counts, launched.q_ids, launched.q_weights)
            launched.tokens.copy_(tokens)  # in place: ``out`` may be a tensor-parallel record's views
            launched.counts.copy_(counts)
            _zero_past(launched.counts, launched.q_ids, launched.q_weights)
        return launched

    def _redraw(self, tokens, counts, q_ids, q_weights) -> tuple[torch.Tensor, torch.Tensor]:
        if q_ids is None or q_weights is None:
            raise RuntimeError("VLLM_DSPARK_REMOTE_SAMPLED_REDRAW: drafts without distributions (not a sampled path)")
        device = tokens.device
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
            generator.manual_seed(secrets.randbits(64))
        return redraw(tokens, counts, q_ids, q_weights, generator=generator)


def _zero_past(counts: torch.Tensor, q_ids: torch.Tensor, q_weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``q_ids`` and ``q_weights`` zeroed in place past ``counts`` (``Drafts``' promise)."""
    k = q_ids.shape[1]
    live = (torch.arange(k, device=q_ids.device).view(1, k) < counts.long().view(-1, 1)).unsqueeze(-1)
    q_weights.view(torch.int16).masked_fill_(~live, 0)  # (uint16 has no masked_fill: zero is zero)
    return q_ids.masked_fill_(~live, 0), q_weights

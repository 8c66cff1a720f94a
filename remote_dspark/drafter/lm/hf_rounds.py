"""The transformers drafter's rounds (:class:`HFDrafter`); loading a model and its
identity are :mod:`remote_dspark.drafter.lm.hf`.

A round re-encodes every entry's window: one left-padded batch with its
``attention_mask`` and ``position_ids`` (each context at its true positions,
``DraftBatch.positions``; padding at the context's first position, masked out), then
``width - 1`` greedy steps on the model's own KV cache (``past_key_values``; ``cache``
in transformers 5), one forward over all entries per step.
"""

from __future__ import annotations

import inspect
import threading

import numpy as np
import torch

from ..contract import DraftBatch, DraftResult, empty_result
from .drafter import MARKOV_NONE, greedy_result, top2


class HFDrafter:
    """Greedy drafting from a transformers causal LM, every window re-encoded per round.

    Args: the loaded model (on ``device``), its vocabulary size, its drafter identity,
    the worker's ``--window`` and the model's position table (None: unbounded).
    """

    def __init__(
        self,
        model,
        *,
        vocab_size: int,
        identity: bytes,
        device: torch.device,
        window: int,
        max_positions: int | None,
    ):
        self.model, self.device = model, device
        self.vocab_size = vocab_size
        self.drafter_identity = identity
        self.markov_identity = MARKOV_NONE
        self.max_positions = max_positions  # an entry past them gets no drafts (the worker's rule)
        # drafts per entry the positions leave beside a whole window (None: no table)
        self.max_width = max_positions - window if max_positions is not None else None
        self._lock = threading.Lock()  # the worker's connection threads share one drafter
        # The KV cache's argument and output name: ``cache`` in transformers 5, before it
        # ``past_key_values`` (probed, not version-checked).
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def draft_batch(self, batch: DraftBatch) -> DraftResult:
        """Raises: ValueError for an entry past the position table (the worker drops
        those: :meth:`~remote_dspark.drafter.contract.DraftBatch.beyond`)."""
        n, width = len(batch), batch.width
        if n == 0 or width == 0:
            return empty_result(n, width, batch.want_margin)
        if batch.beyond(self.max_positions).any():
            raise ValueError(f"an entry's context and {width} drafts pass the model's {self.max_positions} positions")
        ctx_lens = np.diff(batch.offsets).astype(np.int64)
        take = np.maximum(ctx_lens, 1)  # an empty context: one dummy token, no drafts
        s = int(take.max())
        cols = np.arange(s)
        valid = cols >= (s - take)[:, None]  # left padding
        src = batch.tokens if len(batch.tokens) else np.zeros(1, np.int32)
        idx = np.clip(batch.offsets[1:, None] - s + cols, 0, len(src) - 1)
        tok = np.where(valid, src[idx], 0)
        ints = torch.from_numpy(np.stack([tok, valid]).astype(np.int64)).to(self.device)  # the one copy in
        ids, mask = ints[0], ints[1]
        first = torch.from_numpy(np.where(ctx_lens > 0, batch.starts(), 0)).to(self.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0) + first[:, None]  # padding: the first position
        with self._lock, torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            token, margin = top2(out.logits[:, -1, : self.vocab_size])
            tokens, margins = [token], [margin]
            last = pos[:, -1:]
            for _ in range(1, width):  # one batched forward per draft step
                last = last + 1
                mask = torch.cat([mask, torch.ones_like(last)], 1)
                out = self.model(
                    input_ids=token[:, None],
                    attention_mask=mask,
                    position_ids=last,
                    use_cache=True,
                    **{self._cache_arg: getattr(out, self._cache_arg)},
                )
                token, margin = top2(out.logits[:, -1, : self.vocab_size])
                tokens.append(token)
                margins.append(margin)
            res = torch.cat([torch.stack(tokens, 1).float(), torch.stack(margins, 1)], 1).cpu().numpy()
        return greedy_result(batch, ctx_lens, res[:, :width], res[:, width:])

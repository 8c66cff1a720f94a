"""``bench round``'s batches (:class:`Feeder`).

Batches are built the way an engine builds them, by :class:`Feeder`, outside the timed
region: per-slot state in a few arrays (position, NEW_GEN mask), the round's tokens as
one flat array with offsets. The first round announces every slot (NEW_GEN, a 16-token
prompt of synthetic-language text); every later round carries 3 tokens per slot from
where the slot stands (a sampled feeder's entries also carry temperature 1 and a seed per
slot: its drafts' randomness still differs every round, by position); a slot named in
``Drafts.resync`` (every slot on ``resync_all``) starts over with NEW_GEN on the next
round. The first round is always a warm-up round
(``--warmup`` >= 1), so the figures are steady-state rounds.
"""

from __future__ import annotations

from .options import PROMPT_TOKENS, SAMPLED_TEMPERATURE, STEP_TOKENS, TEXT_TOKENS


class Feeder:
    """Builds each round's ``Batch`` the way an engine does, from per-slot arrays.

    State per slot: ``position`` (tokens the drafter has of the slot's context),
    ``offset`` (where the slot reads the synthetic text: every slot its own stretch) and
    the ``new_gen`` mask. :meth:`next_batch` builds the round from them, vectorized;
    :meth:`after` takes the round's ``Drafts`` (or ``Launched``): every slot advances by
    what it sent, and the slots the drafter lost are NEW_GEN next round (a fresh
    16-token prompt at a new stretch of text: the context is synthetic anyway).
    """

    def __init__(
        self,
        slots: int,
        row_bytes: int,
        *,
        device: str = "cpu",
        metadata_device: str = "cpu",
        seed: int = 1,
        sampled: bool = False,
    ):
        import numpy as np
        import torch

        from ...drafter.markov import splitmix64

        self.n = slots
        self.text = np.asarray(synthetic_text(seed), dtype=np.int32)
        self.rng = np.random.default_rng(splitmix64(seed) & 0xFFFFFFFF)
        self.offset = self.rng.integers(0, len(self.text), slots, dtype=np.int64)
        self.position = np.zeros(slots, dtype=np.int64)
        self.new_gen = np.ones(slots, dtype=bool)
        self._sent = np.zeros(slots, dtype=np.int64)
        self.meta_device = metadata_device
        # The engine tensor whose rows go with the round (hidden states, say): uint8 rows
        # of row_bytes, one per slot, on the engine's device.
        gen = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, 256, (slots, row_bytes), dtype=torch.uint8, generator=gen).to(device)
        self.slot_ids = torch.arange(slots, dtype=torch.int32).to(metadata_device)
        # Where the rows are, as an engine's gather index is (from its query_start_loc).
        self.row_index = torch.arange(slots, dtype=torch.int64).to(device)
        self.sampling = {}
        if sampled:
            self.sampling = {
                "temperature": torch.full((slots,), SAMPLED_TEMPERATURE, dtype=torch.float32).to(metadata_device),
                "seed": (torch.arange(slots, dtype=torch.int64) + seed).to(metadata_device),
            }

    def next_batch(self):
        """This round's batch: NEW_GEN slots with their prompt from position 0, the others
        with STEP_TOKENS tokens from their position."""
        import numpy as np
        import torch

        from ...engine import Batch

        ng = self.new_gen
        start = np.where(ng, 0, self.position)
        count = np.where(ng, PROMPT_TOKENS, STEP_TOKENS)
        offsets = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(count, out=offsets[1:])
        within = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], count)
        at = np.repeat(self.offset + start, count) + within
        tokens = self.text[at % len(self.text)]
        self._sent = start + count
        dev, t = self.meta_device, torch.from_numpy
        return Batch(
            slots=self.slot_ids,
            tokens=t(tokens).to(dev),
            token_offsets=t(offsets).to(dev),
            positions=t(start.astype(np.int32)).to(dev),
            new_gen=t(ng.copy()).to(dev),
            rows=self.rows,
            row_index=self.row_index,
            n_out=None,
            **self.sampling,
        )

    def after(self, out) -> None:
        """The round was sent (whatever its outcome): advance; re-announce lost slots
        (those a tensor-parallel rank other than 0 has only on the device: read here,
        outside the figures, so that every rank's batches stay rank 0's)."""
        import numpy as np

        self.position = self._sent
        self.new_gen = np.zeros(self.n, dtype=bool)
        if out.resync is None:
            lost = out.resync_mask.nonzero().flatten().cpu().numpy()
            lost = lost[lost < self.n]
        else:
            lost = np.asarray(out.resync, dtype=np.int64)
        if out.resync_all:
            lost = np.arange(self.n)
        if len(lost):
            self.new_gen[lost] = True
            self.offset[lost] = self.rng.integers(0, len(self.text), len(lost))


def synthetic_text(seed: int) -> list[int]:
    from ...drafter.markov import SyntheticLanguage

    return SyntheticLanguage().text(TEXT_TOKENS, seed=seed)

"""A simulated engine: request slots decoding the synthetic language, held as arrays.

The target model is the :class:`~remote_dspark.drafter.markov.SyntheticLanguage` itself: each
generation has a fixed true continuation (seeded per generation), drafts are verified
against it position by position, and every round the target adds one token of its own
after the accepted drafts, as speculative decoding does.

Per-slot state lives in a few arrays indexed by slot, as an engine's input batch keeps
it (vLLM's ``InputBatch``): the true continuation ``truth`` [slots, longest], how far
each slot has decoded (``done``), how much of that the drafter has seen (``sent``) and
whether the slot's generation has been announced. A round's batch is built by slicing
those arrays (:meth:`SimEngine.arrays`), verification is whole-array comparisons; the
only loop over slots is over the generations that finished this round (a new request
each), and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..drafter.markov import SyntheticLanguage, splitmix64


@dataclass(frozen=True)
class RoundArrays:
    """One round's metadata as an engine hands it over (host arrays)."""

    slots: np.ndarray  # [n] int64
    tokens: np.ndarray  # [T] int64, flat
    offsets: np.ndarray  # [n + 1] int64
    positions: np.ndarray  # [n] int64
    new_gen: np.ndarray  # [n] bool


class SimEngine:
    """``max_slots`` slots, each decoding generations of ``prompt`` + ``length`` tokens.

    Per round: :meth:`arrays` says what every slot sends, :meth:`sent` marks it seen,
    :meth:`verify` takes the drafts (zero counts for a target-only round) and advances
    every slot.
    """

    def __init__(
        self,
        max_slots: int,
        num_spec: int,
        *,
        seed: int = 1,
        prompt: int = 16,
        length: tuple[int, int] = (64, 256),
        language: SyntheticLanguage | None = None,
    ):
        self.num_spec = num_spec
        self.lang = language or SyntheticLanguage()
        self.prompt = prompt
        self.length = length
        self.n_slots = max_slots
        self._seed = seed
        width = prompt + length[1] + num_spec + 1
        self.truth = np.zeros((max_slots, width), dtype=np.int64)
        self.end = np.zeros(max_slots, dtype=np.int64)  # where each generation stops
        self.done = np.zeros(max_slots, dtype=np.int64)  # tokens decoded (the context)
        self.sent = np.zeros(max_slots, dtype=np.int64)  # of those, seen by the drafter
        self.announced = np.zeros(max_slots, dtype=bool)
        for slot in range(max_slots):  # a new request per slot
            self._new_generation(slot)
        self.rounds = 0
        self.tokens = 0
        self.generations = 0
        self.accepted_at = np.zeros(num_spec, dtype=np.int64)  # drafts accepted at position i
        self.offered_at = np.zeros(num_spec, dtype=np.int64)  # drafts offered at position i

    def _rand(self) -> int:
        self._seed = splitmix64(self._seed)
        return self._seed

    def _new_generation(self, slot: int) -> None:
        seed = self._rand()
        lo, hi = self.length
        length = lo + seed % (hi - lo + 1)
        truth = [seed % self.lang.vocab, (seed >> 16) % self.lang.vocab]
        state = seed
        while len(truth) < self.truth.shape[1]:
            state = splitmix64(state)
            u = (state >> 11) / float(1 << 53)
            state = splitmix64(state)
            truth.append(self.lang.next_token(truth[-2], truth[-1], u, state))
        self.truth[slot] = truth
        self.end[slot] = self.prompt + length
        self.done[slot] = self.prompt
        self.sent[slot] = 0
        self.announced[slot] = False

    def arrays(self) -> RoundArrays:
        """Every slot's entry: an announced slot sends the tokens decoded since the
        drafter last saw it, a new one its whole context (NEW_GEN, position 0)."""
        slots = np.arange(self.n_slots, dtype=np.int64)
        start = np.where(self.announced, self.sent, 0)
        lengths = self.done - start
        offsets = np.zeros(self.n_slots + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        rows = np.repeat(slots, lengths)
        cols = np.repeat(start - offsets[:-1], lengths) + np.arange(offsets[-1])
        return RoundArrays(slots, self.truth[rows, cols], offsets, start, ~self.announced)

    def mark_sent(self) -> None:
        """The round's entries reached the drafter: NEW_GENs are announced, all seen."""
        self.announced[:] = True
        self.sent[:] = self.done

    def reannounce(self, slots=None) -> None:
        """The drafter lost these slots (all when ``None``): NEW_GEN on the next round."""
        if slots is None:
            self.announced[:] = False
        else:
            self.announced[np.asarray(slots, dtype=np.int64)] = False

    def verify(self, tokens: np.ndarray, counts: np.ndarray) -> int:
        """Advance every slot by its accepted drafts (``tokens`` [slots, >= num_spec],
        ``counts`` [slots]) plus the target's own token. Returns the drafts accepted."""
        k = self.num_spec
        cols = np.arange(k)
        counts = np.minimum(counts, k)
        truth_next = np.take_along_axis(self.truth, self.done[:, None] + cols, axis=1)
        match = (tokens[:, :k] == truth_next) & (cols < counts[:, None])
        accepted = np.cumprod(match, axis=1).sum(axis=1)
        offered = np.minimum(counts, accepted + 1)  # up to and including the first miss
        self.accepted_at += (cols < accepted[:, None]).sum(axis=0)
        self.offered_at += (cols < offered[:, None]).sum(axis=0)
        self.done += accepted + 1
        self.tokens += int((accepted + 1).sum())
        finished = np.flatnonzero(self.done >= self.end)
        for slot in finished.tolist():  # the slots whose request finished: a new one each
            self._new_generation(slot)
        self.generations += len(finished)
        self.rounds += 1
        return int(accepted.sum())

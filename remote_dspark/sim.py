"""A simulated engine: request slots decoding the synthetic language.

The target model is the :class:`~remote_dspark.markov.SyntheticLanguage` itself: each
generation has a fixed true continuation (seeded per generation), drafts are verified
against it position by position, and every round the target adds one token of its own
after the accepted drafts, as speculative decoding does. The harness is torch-free so
the first demo, benchmarks and chaos runs share it; the engine demo puts torch rows on
top.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from . import wire
from .markov import SyntheticLanguage, splitmix64


@dataclass
class _Generation:
    seed: int
    truth: list[int]
    length: int
    done: int            # tokens of truth already decoded (the context)
    pending: list[int] = field(default_factory=list)   # accepted, not yet sent to the drafter
    announced: bool = False


class SimEngine:
    """``max_slots`` slots, each decoding generations of ``prompt`` + ``length`` tokens.

    Per round: :meth:`entries` says what each live slot sends, :meth:`verify` takes
    the drafts (``None`` for a target-only round) and advances every slot.
    """

    def __init__(self, max_slots: int, num_spec: int, *, seed: int = 1, prompt: int = 16,
                 length: tuple[int, int] = (64, 256), language: SyntheticLanguage | None = None):
        self.num_spec = num_spec
        self.lang = language or SyntheticLanguage()
        self.prompt = prompt
        self.length = length
        self._seed = seed
        self.slots: list[_Generation] = [self._new_generation() for _ in range(max_slots)]
        self.rounds = 0
        self.tokens = 0
        self.generations = 0
        self.accepted_at = [0] * num_spec     # drafts accepted at position i
        self.offered_at = [0] * num_spec      # drafts offered at position i

    def _rand(self) -> int:
        self._seed = splitmix64(self._seed)
        return self._seed

    def _new_generation(self) -> _Generation:
        seed = self._rand()
        lo, hi = self.length
        length = lo + seed % (hi - lo + 1)
        truth = [seed % self.lang.vocab, (seed >> 16) % self.lang.vocab]
        state = seed
        while len(truth) < self.prompt + length + self.num_spec + 1:
            state = splitmix64(state)
            u = (state >> 11) / float(1 << 53)
            state = splitmix64(state)
            truth.append(self.lang.next_token(truth[-2], truth[-1], u, state))
        return _Generation(seed, truth, self.prompt + length, self.prompt)

    def entries(self) -> list[wire.Entry]:
        out = []
        for slot, g in enumerate(self.slots):
            if not g.announced:
                out.append(wire.Entry(slot, self.num_spec, 0, g.truth[:g.done], new_gen=True))
            else:
                out.append(wire.Entry(slot, self.num_spec, g.done - len(g.pending), list(g.pending)))
        return out

    def sent(self) -> None:
        """The round's entries reached the drafter: NEW_GENs are announced, pending sent."""
        for g in self.slots:
            g.announced = True
            g.pending = []

    def reannounce(self, slots: Sequence[int] | None = None) -> None:
        """The drafter lost these slots (all when ``None``): NEW_GEN on the next round."""
        for i in range(len(self.slots)) if slots is None else slots:
            self.slots[i].announced = False

    def verify(self, drafts: Sequence[Sequence[int]] | None) -> int:
        """Advance every slot by its accepted drafts plus the target's own token.
        Returns the number of drafts accepted this round."""
        accepted_total = 0
        for i, g in enumerate(self.slots):
            draft = drafts[i] if drafts is not None else ()
            accepted = 0
            for pos, tok in enumerate(draft[:self.num_spec]):
                self.offered_at[pos] += 1
                if tok != g.truth[g.done + pos]:
                    break
                self.accepted_at[pos] += 1
                accepted += 1
            new = g.truth[g.done:g.done + accepted + 1]
            g.pending.extend(new)
            g.done += len(new)
            self.tokens += len(new)
            accepted_total += accepted
            if g.done >= g.length:
                self.generations += 1
                self.slots[i] = self._new_generation()
        self.rounds += 1
        return accepted_total

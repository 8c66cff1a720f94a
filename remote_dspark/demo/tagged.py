"""Drafters that sign their drafts: the chaos run's way to tell which worker drafted a round.

Worker ``i`` of a chaos fleet runs ``--drafter remote_dspark.demo.tagged:worker_i``: the
built-in Markov drafter (same identities, so one engine configuration fits the whole
fleet) whose every drafted entry ends in token ``i`` (:data:`TAG_BASE` + i), in place
of its last draft. The engine's drafts then say which worker made them: the tag of an
entry's last draft. Acceptance drops a little (the last draft is rarely right), which a
chaos run does not measure.
"""

from __future__ import annotations

import functools

import numpy as np

from ..drafter.contract import DraftBatch, DraftResult
from ..drafter.markov import MarkovDrafter, builtin_model

TAG_BASE = 0  # worker i's tag token (token ids every vocabulary has)
MAX_WORKERS = 8  # factories worker_0 .. worker_7 (127.0.0.1 .. 127.0.0.8)


def tag_of(worker: int) -> int:
    return TAG_BASE + worker


def tags_of(tokens: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The tag of every drafted entry of a round (``tokens`` [n, k], ``counts`` [n]):
    its last draft; entries with no draft have none."""
    drafted = np.flatnonzero(counts > 0)
    return tokens[drafted, counts[drafted] - 1]


class TaggedDrafter(MarkovDrafter):
    """The built-in Markov drafter; each drafted entry's last draft is ``tag_of(worker)``.
    (A subclass: the worker's C lane, for the plain Markov drafter only, never takes it.)"""

    def __init__(self, worker: int):
        if not 0 <= worker < MAX_WORKERS:
            raise ValueError(f"worker {worker}: not in 0..{MAX_WORKERS - 1}")
        super().__init__(builtin_model())
        self.tag = tag_of(worker)

    def draft_batch(self, batch: DraftBatch) -> DraftResult:
        result = super().draft_batch(batch)
        drafted = np.flatnonzero(result.counts > 0)
        result.tokens[drafted, result.counts[drafted] - 1] = self.tag
        return result


# The factories ``--drafter`` names (MODULE:FACTORY): worker_0 .. worker_7.
for _i in range(MAX_WORKERS):
    globals()[f"worker_{_i}"] = functools.partial(TaggedDrafter, _i)

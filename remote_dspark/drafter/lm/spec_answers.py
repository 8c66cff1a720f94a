"""The speculation cache's arrays (:mod:`.speculate`): each stream's last answer and
each branch's (:class:`Answers`), a round's hits merged with its drafted entries
(:class:`Hits`), and what the engines were seen to accept (:class:`Acceptance`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contract import DraftResult
from ..sampling import TOP, TOTAL
from .graphs import RANK, SAMPLED


@dataclass
class Answers:
    """Answers by row (a stream's last, or a branch's), as arrays: drafts ``[rows, w]``,
    margins, each position's ranked ids and probabilities ``[rows, w, RANK]``, and for
    sampled rounds ``q`` (``[rows, w, TOP]``, allocated at the first one)."""

    drafts: np.ndarray
    margins: np.ndarray
    ids: np.ndarray
    probs: np.ndarray
    q_ids: np.ndarray | None = None
    q_weights: np.ndarray | None = None

    @classmethod
    def empty(cls, rows: int, width: int) -> Answers:
        """Answers of ``rows`` rows of ``width`` positions, their memory taken now (written
        once: a worker's resident set holds them from its start, as it does the KV pool)."""
        out = cls(
            np.empty((rows, width), np.int64),
            np.empty((rows, width), np.float32),
            np.empty((rows, width, RANK), np.int32),
            np.empty((rows, width, RANK), np.float32),
        )
        for a in (out.drafts, out.margins, out.ids, out.probs):
            a.fill(0)
        return out

    def put(self, rows: np.ndarray, out: np.ndarray, width: int, kind: int, shift: int = 0) -> None:
        """Store a round's answer ``out`` (:func:`.graphs.columns`'s layout, ``width +
        shift`` drafts: the first ``shift`` dropped) into ``rows``."""
        w = width + shift
        self.drafts[rows, :width] = out[:, shift:w]
        self.margins[rows, :width] = out[:, w + shift : 2 * w]
        per = TOP if kind == SAMPLED else RANK
        ids = out[:, 2 * w : 2 * w + w * per].reshape(-1, w, per)[:, shift:]
        second = out[:, 2 * w + w * per :].reshape(-1, w, per)[:, shift:]
        self.ids[rows, :width] = ids[:, :, :RANK]
        self.probs[rows, :width] = second[:, :, :RANK] / TOTAL if kind == SAMPLED else second
        if kind == SAMPLED:
            if self.q_ids is None:
                self.q_ids = np.zeros((len(self.drafts), self.drafts.shape[1], TOP), np.int32)
                self.q_weights = np.zeros((len(self.drafts), self.drafts.shape[1], TOP), np.uint16)
            self.q_ids[rows, :width] = ids
            self.q_weights[rows, :width] = second

    def copy(self, dst: np.ndarray, src: Answers, rows: np.ndarray, width: int) -> None:
        """Rows ``rows`` of ``src`` into rows ``dst`` of these, their first ``width``
        positions (q only where ``src`` has it)."""
        for name in ("drafts", "margins", "ids", "probs"):
            getattr(self, name)[dst, :width] = getattr(src, name)[rows, :width]
        if src.q_ids is not None:
            if self.q_ids is None:
                self.q_ids = np.zeros((len(self.drafts), *src.q_ids.shape[1:]), np.int32)
                self.q_weights = np.zeros((len(self.drafts), *src.q_ids.shape[1:]), np.uint16)
            self.q_ids[dst, :width] = src.q_ids[rows, :width]
            self.q_weights[dst, :width] = src.q_weights[rows, :width]


@dataclass(frozen=True)
class Hits:
    """A round's entries answered from branches (``mask`` [n]) and their answer, in
    entry order."""

    mask: np.ndarray
    result: DraftResult

    def merged(self, rest: DraftResult | None) -> DraftResult:
        """The round's whole answer: the hits' and ``rest``'s (the other entries', in
        order; None when every entry hit)."""
        if rest is None:
            return self.result
        out = {}
        for name in ("tokens", "counts", "margins", "q_ids", "q_weights"):
            mine, theirs = getattr(self.result, name), getattr(rest, name)
            if mine is None or theirs is None:
                out[name] = None
                continue
            whole = np.zeros((len(self.mask), *mine.shape[1:]), mine.dtype)
            whole[self.mask], whole[~self.mask] = mine, theirs
            out[name] = whole
        return DraftResult(**out)


DECAY = 0.998  # each outcome seen weighs the older ones by this (about the last 500 count)


class Acceptance:
    """What the engines were seen to accept of their streams' last answers, decayed: the
    rounds that accepted ``j`` drafts (``seen``, a uniform prior), and the drafts accepted
    of those sent (``accepted`` / ``sent``, a prior of one half)."""

    def __init__(self, width: int):
        self.seen = np.ones(width + 1)
        self.accepted, self.sent = 1.0, 2.0

    def count(self, j: np.ndarray, sent: np.ndarray) -> None:
        """Rounds that accepted ``j`` of their ``sent`` drafts."""
        decay = DECAY ** len(j)
        self.seen *= decay
        np.add.at(self.seen, j, 1.0)
        self.accepted = self.accepted * decay + float(j.sum())
        self.sent = self.sent * decay + float(sent.sum())

    def p_j(self, sent: np.ndarray) -> np.ndarray:
        """[n, width + 1]: ``P(j)`` for streams that were sent ``sent`` drafts (0 past them)."""
        seen = np.where(np.arange(len(self.seen)) <= sent[:, None], self.seen, 0.0)
        return seen / seen.sum(1, keepdims=True)

    def rate(self) -> float:
        """The share of drafts accepted (a draft's chance)."""
        return self.accepted / max(self.sent, 1e-9)

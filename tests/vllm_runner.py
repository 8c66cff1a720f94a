"""vLLM's model runner, as far as the vLLM proposer sees it (``Runner``), its configuration
(``vllm_config``) and a language the drafter knows, for ``tests/integrations/test_vllm*.py``.

The language: each request continues with a constant stride (the target's next token is
``2 * t[-1] - t[-2]`` mod V), and the loopback worker's order-2 Markov drafter
(``markov_drafter``) knows it, so a draft for the right stream is always accepted and one
for another stream (a row mapped to the wrong slot) is not.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import MarkovModel
from remote_dspark.integrations.vllm import RemoteProposer

V, K, MAX_REQS, MAX_LEN = 64, 4, 6, 200
STRIDES = (1, 3, 5, 7)
STALE = 63  # what vLLM leaves past a row's tokens (its draft tokens): the proposer must not read it


def target_next(tokens: list[int]) -> int:
    """The target model: the stride of the last two tokens, continued."""
    return (2 * tokens[-1] - tokens[-2]) % V


def prompt(start: int, stride: int, length: int = 4) -> list[int]:
    return [(start + i * stride) % V for i in range(length)]


def markov_drafter() -> MarkovDrafter:
    """An order-2 Markov drafter of every stride (each cycle twice, so the pairs at the
    seams between cycles never win)."""
    tokens = [t for d in STRIDES for t in prompt(0, d, 2 * V)]
    return MarkovDrafter(MarkovModel.from_tokens(tokens, order=2, top=1))


def vllm_config(k=K, max_num_seqs=MAX_REQS, max_model_len=MAX_LEN, tp=1, drop=()):
    """What the proposer reads of vLLM's VllmConfig; ``drop`` names sections to leave out."""
    sections = dict(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=SimpleNamespace(
            max_model_len=max_model_len, hf_config=SimpleNamespace(vocab_size=V), get_vocab_size=lambda: V
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )
    return SimpleNamespace(**{name: s for name, s in sections.items() if name not in drop})


class Runner:
    """vLLM's model runner, as far as the proposer sees it (``gpu_model_runner`` and
    ``InputBatch``). ``step`` does what a step does: remove finished requests (holes), add
    new ones (the smallest hole, else append), condense, optionally swap two rows, verify
    each row's drafts of last step as the scheduler cut them (the longest prefix the
    target agrees with, plus the target's bonus token), then ``propose`` inside
    ``torch.inference_mode()`` with ``slot_mappings`` a dict of tensors, unless a row is
    within K tokens of ``max_len``: then, as vLLM does, no ``propose`` this step and K
    zeros as every row's drafts. It records each request's slot per step (``slots``),
    the rounds' batches (``batches``) and per-position acceptance of the proposer's
    drafts in steps that called ``propose`` (``offered_at``, ``accepted_at``)."""

    def __init__(self, proposer: RemoteProposer, max_reqs: int = MAX_REQS, max_len: int = MAX_LEN):
        self.proposer, self.max_len = proposer, max_len
        self.token_ids = np.full((max_reqs, max_len), STALE, dtype=np.int32)
        self.num_tokens = np.zeros(max_reqs, dtype=np.int32)
        self.rows: list[str | None] = []  # the request at each row; None: a hole
        self.drafts: dict[str, tuple[list[int], bool]] = {}  # drafts to verify; the proposer's?
        self.slots: dict[str, list[int]] = {}  # request -> its slot at each step it drafted
        self.batches: list = []
        self.accepted_at, self.offered_at = np.zeros(K, np.int64), np.zeros(K, np.int64)
        self.skipped = 0  # steps without propose
        rd = proposer.rd
        real_round = rd.round
        rd.round = lambda batch: self.batches.append(batch) or real_round(batch)

    def row(self, req: str) -> int:
        return self.rows.index(req)

    def step(self, add=(), finish=(), swap=None, chunked=()) -> list[list[int]]:
        for req in finish:
            self.rows[self.row(req)] = None
            self.drafts.pop(req, None)
        for req, tokens in add:
            row = self.rows.index(None) if None in self.rows else len(self.rows)
            self.rows[row : row + 1] = [req]
            self.token_ids[row, : len(tokens)] = tokens
            self.num_tokens[row] = len(tokens)
        self.condense()
        if swap is not None:
            i, j = swap
            self.rows[i], self.rows[j] = self.rows[j], self.rows[i]
            self.token_ids[[i, j]] = self.token_ids[[j, i]]
            self.num_tokens[[i, j]] = self.num_tokens[[j, i]]
        tally = np.zeros((2, K), np.int64)  # the proposer's drafts this step: offered, accepted
        seq_lens: list[int] = []
        sampled = [[] if req in chunked else self.verify(i, req, tally, seq_lens) for i, req in enumerate(self.rows)]
        if max(seq_lens, default=0) + K > self.max_len:  # vLLM's _input_fits_in_drafter: no propose
            self.skipped += 1
            self.drafts = {req: ([0] * K, False) for req in self.rows}
            return None
        self.offered_at += tally[0]
        self.accepted_at += tally[1]
        slot_mappings = {f"model.layers.{i}.self_attn.attn": torch.arange(sum(seq_lens)) for i in range(2)}
        with torch.inference_mode():
            out = self.proposer.propose(sampled, self.num_tokens, self.token_ids, slot_mappings=slot_mappings)
        assert isinstance(out, list) and len(out) == len(self.rows)
        for drafts, got in zip(out, sampled):
            assert isinstance(drafts, list) and all(type(t) is int for t in drafts) and len(drafts) <= K
            assert got or drafts == [], "a row that sampled nothing gets no drafts"
        row_slot = self.proposer.slot_map.row_slot
        for i, req in enumerate(self.rows):
            self.drafts[req] = (out[i], True)
            if sampled[i]:
                self.slots.setdefault(req, []).append(int(row_slot[i]))
        return out

    def condense(self) -> None:
        """vLLM's condense: the last live row into the smallest hole, until none is left."""
        while None in self.rows:
            hole = self.rows.index(None)
            last = len(self.rows) - 1
            if last > hole and self.rows[last] is not None:
                n = self.num_tokens[last]
                self.token_ids[hole, :n] = self.token_ids[last, :n]
                self.num_tokens[hole] = n
                self.rows[hole] = self.rows[last]
            self.rows.pop()

    def verify(self, row: int, req: str, tally: np.ndarray, seq_lens: list[int]) -> list[int]:
        """The target's tokens for the row: its drafts' agreeing prefix, then its own.
        The scheduler cuts the drafts so that the row's tokens, its drafts and the token
        sampled after them fit ``max_len``."""
        n = int(self.num_tokens[row])
        seq = self.token_ids[row, :n].tolist()
        drafts, ours = self.drafts.pop(req, ([], False))
        drafts = drafts[: max(self.max_len - n - 1, 0)]
        seq_lens.append(n + len(drafts))
        out: list[int] = []
        for d in drafts:
            if d != target_next(seq + out):
                break
            out.append(d)
        if ours:
            tally[0, : len(drafts)] += 1
            tally[1, : len(out)] += 1
        out.append(target_next(seq + out))
        self.token_ids[row, n : n + len(out)] = out
        self.token_ids[row, n + len(out) : n + len(out) + K] = STALE  # vLLM's draft tokens go there
        self.num_tokens[row] = n + len(out)
        return out

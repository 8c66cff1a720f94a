"""A drafter for vLLM's ``custom_class`` speculative method, drafting remotely.

    speculative_config={
        "method": "custom_class",
        "model": "remote_dspark.integrations.vllm.RemoteProposer",
        "num_speculative_tokens": 4,
    }

The interface followed is vLLM's ``vllm/v1/spec_decode/custom_class_proposer.py``, as
vLLM 0.33.0's source has it: vLLM builds ``RemoteProposer(vllm_config)`` (an exception
there reaches the user as a ``RuntimeError`` whose cause is it) and, after each step's
bookkeeping, on every tensor-parallel rank, inside ``torch.inference_mode()``, calls
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``
(``slot_mappings``: a dict of KV slot tensors, unused here):

- ``sampled_token_ids``: one list per row of the persistent batch (rows 0..n-1), the
  tokens the row accepted this step (1 + accepted drafts), empty for a row whose output
  was discarded (a partial prefill chunk): it gets no drafts;
- ``num_tokens_no_spec`` [max_num_reqs] and ``token_ids_cpu`` [max_num_reqs,
  max_model_len]: row i's tokens are ``token_ids_cpu[i, :num_tokens_no_spec[i]]``
  (prompt and output, this step's included); past them the buffer is stale;
- it returns one list of at most K draft tokens per row, in row order.

vLLM passes no request ids, and a row is not a request: finished requests leave holes,
new ones fill the smallest, and vLLM condenses its batch (the last row moves into the
smallest hole) and may swap rows. So each row is matched to a slot of the remote drafter
by what the proposer sees (:class:`SlotMap`): the slot whose stream the worker has seen
up to exactly the tokens this row had before this step, with the same fingerprint. A
matched row sends only its new tokens; any other row takes a fresh slot and sends its
whole context with NEW_GEN. A wrong match costs drafts (the worker's position check
answers RESYNC, or the drafts are not accepted), never output: vLLM verifies every draft.
A slot no row kept (its request finished, or left the batch) is released before the
step's round (``RemoteDSpark.release``): a long context still being announced there in
chunks is let go, and the slot's next request starts whole.

vLLM skips ``propose`` for a whole step while any row is within K tokens of
``max_model_len`` (and verifies K zeros as each row's drafts): a row that stayed at its
row then continues its slot from the tokens the worker has, sending all it missed; the
drafts verified in between are counted nowhere. A row that moved meanwhile is announced
whole.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..config.api import RemoteConfig
from ..engine import Batch, Drafts, RemoteDSpark
from ..engine.values.batch import require_integers

HEAD = 16  # fingerprint: the stream's first tokens ...
TAIL = 16  # ... and the last ones the worker has seen
# One odd 64-bit multiplier per fingerprint column, the same in every process (every
# tensor-parallel rank must map rows to the same slots).
_MULTIPLIERS = np.random.default_rng(0x5EED_D5).integers(1, 2**63, size=HEAD + TAIL, dtype=np.uint64) * 2 + 1
# What a RemoteDSpark argument is called in vLLM's configuration, and what to change, for its errors.
_VLLM_NAMES = {
    "num_spec": ("speculative_config.num_speculative_tokens", ""),
    "max_slots": ("scheduler_config.max_num_seqs", "; one slot per row of vLLM's batch: lower --max-num-seqs"),
    "vocab_size": ("model_config's vocabulary size", ""),
}


@dataclass(frozen=True)
class VllmFacts:
    """What the proposer takes from vLLM's configuration."""

    num_spec: int  # speculative_config.num_speculative_tokens
    max_num_seqs: int  # scheduler_config.max_num_seqs: rows of the persistent batch, and slots
    max_model_len: int  # model_config.max_model_len: no draft past it
    vocab_size: int  # model_config.get_vocab_size() (or hf_config.vocab_size)
    tp_size: int  # parallel_config.tensor_parallel_size

    @classmethod
    def of(cls, vllm_config) -> VllmFacts:
        """Raises:
        ValueError: a field missing or not a positive int, naming it."""
        model = _field(vllm_config, "model_config")
        vocab = model.get_vocab_size() if callable(getattr(model, "get_vocab_size", None)) else None
        return cls(
            _int_field(vllm_config, "speculative_config.num_speculative_tokens"),
            _int_field(vllm_config, "scheduler_config.max_num_seqs"),
            _int_field(vllm_config, "model_config.max_model_len"),
            _int_field(vllm_config, "model_config.hf_config.vocab_size", vocab),
            _int_field(vllm_config, "parallel_config.tensor_parallel_size"),
        )


def _field(obj, path: str):
    """``vllm_config``'s field at the dotted ``path``; a ValueError names the first part missing."""
    names = path.split(".")
    for depth, name in enumerate(names, 1):
        if not hasattr(obj, name):
            raise ValueError(f"vllm_config.{'.'.join(names[:depth])}: missing (is this a vLLM VllmConfig?)")
        obj = getattr(obj, name)
    return obj


def _int_field(vllm_config, path: str, value=None) -> int:
    value = _field(vllm_config, path) if value is None else value
    if isinstance(value, bool) or not hasattr(value, "__index__") or value < 1:
        raise ValueError(f"vllm_config.{path}={value!r}: expected a positive int")
    return int(value)


def fingerprint(token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A 64-bit fingerprint of each of ``rows``' first ``lengths`` tokens: the first
    ``HEAD`` of them and the last ``TAIL``, each column weighted by its own multiplier
    (wrapping uint64 arithmetic), absent columns (a short stream) zero. One gather."""
    columns = np.concatenate([np.arange(HEAD), np.arange(-TAIL, 0)])
    index = np.where(columns < 0, lengths[:, None] + columns, columns)
    present = (index >= 0) & (index < lengths[:, None])
    values = token_ids[rows[:, None], np.clip(index, 0, token_ids.shape[1] - 1)].astype(np.uint64) + np.uint64(1)
    return (np.where(present, values, np.uint64(0)) * _MULTIPLIERS).sum(axis=1, dtype=np.uint64)


@dataclass(frozen=True)
class Step:
    """One step's rows as :meth:`SlotMap.assign` maps them (index: row, 0..n-1)."""

    slots: np.ndarray  # [n] int64: the row's slot, -1 for a row without drafts (empty sampled)
    new_gen: np.ndarray  # [n] bool: announce the row whole (a fresh slot, or a slot to re-announce)
    seen: np.ndarray  # [n] int64: tokens the worker has of the row's stream (0 on NEW_GEN; the round sends the rest)
    lengths: np.ndarray  # [n] int64: the row's tokens now
    offered: np.ndarray  # [n] int64: drafts vLLM verified this step, as far as known (0: new, or steps skipped)
    freed: np.ndarray  # [m] int64: slots whose stream ended this step (no row kept it), to release


class SlotMap:
    """Rows of vLLM's persistent batch to slots of the remote drafter, step by step.

    Per slot (index: slot): ``live`` (a request holds it), ``seen`` (tokens its stream has
    sent the worker), ``key`` (the fingerprint of those tokens), ``offered`` (drafts it
    was offered last step), ``announce`` (the worker lost it: NEW_GEN next step). Per row
    of the last step: ``row_slot``.

    Invariants: the live slots are exactly the slots of last step's rows with drafts
    (so at most ``max_num_seqs``); no two rows of a step share a slot.

    A row that sampled ``m`` tokens had ``length - m`` before this step. It keeps a slot
    when that slot saw exactly that many tokens with the same fingerprint: first the slot
    it held at the same row last time (rows mostly stay; after steps vLLM ran without
    ``propose`` that slot saw fewer, the start of the row's tokens), then, for rows that moved
    (condensed, swapped), the one unclaimed live slot with its fingerprint and length,
    when exactly one row and one slot have it. Anything else (a new request, a
    resumed one, two identical streams that both moved) takes a free slot with NEW_GEN;
    a slot no row kept this step is free (its request finished, or left the batch), and
    its stream ended (``Step.freed``: the proposer releases it, even when a new row
    takes it in the same step).
    """

    def __init__(self, max_num_seqs: int):
        self.live = np.zeros(max_num_seqs, dtype=bool)
        self.seen = np.zeros(max_num_seqs, dtype=np.int64)
        self.key = np.zeros(max_num_seqs, dtype=np.uint64)
        self.offered = np.zeros(max_num_seqs, dtype=np.int64)
        self.announce = np.zeros(max_num_seqs, dtype=bool)
        self.row_slot = np.full(max_num_seqs, -1, dtype=np.int64)

    def assign(self, sampled: np.ndarray, lengths: np.ndarray, token_ids: np.ndarray) -> Step:
        """Map this step's rows (``sampled`` [n]: tokens each sampled, ``lengths`` [n]:
        tokens each has now) to slots, and record the slots' new state (their streams
        seen up to ``lengths``, as the round about to be sent tells the worker)."""
        n = sampled.shape[0]
        before = lengths - sampled
        drafting = sampled > 0
        keys = fingerprint(token_ids, np.arange(n), np.where(drafting, before, 0))
        slots = np.full(n, -1, dtype=np.int64)
        held = np.flatnonzero(drafting & (self.row_slot[:n] >= 0))
        held = held[self._stays(token_ids, held, self.row_slot[held], before[held])]
        slots[held] = self.row_slot[held]
        stays = slots >= 0
        claimed = np.zeros_like(self.live)
        claimed[slots[stays]] = True
        moved = np.flatnonzero(drafting & ~stays)
        slots[moved] = self._follow(moved, before[moved], keys[moved], np.flatnonzero(self.live & ~claimed))
        kept = slots >= 0
        claimed[slots[kept]] = True
        freed = np.flatnonzero(self.live & ~claimed)  # no row kept its stream: it ended
        fresh = drafting & ~kept
        slots[fresh] = np.flatnonzero(~claimed)[: int(fresh.sum())]
        new_gen = fresh | (kept & self.announce[np.maximum(slots, 0)])
        seen = np.where(kept & ~new_gen, self.seen[np.maximum(slots, 0)], 0)
        # Last step's drafts were verified in this step only when no step came between.
        offered = np.where(kept & (seen == before), self.offered[np.maximum(slots, 0)], 0)

        mine = slots[drafting]
        self.live[:] = False
        self.live[mine] = True
        self.seen[mine] = lengths[drafting]
        self.key[mine] = fingerprint(token_ids, np.flatnonzero(drafting), lengths[drafting])
        self.offered[mine] = 0
        self.announce[mine] = False
        self.row_slot[:] = -1
        self.row_slot[:n] = slots
        return Step(slots, new_gen, seen, lengths, offered, freed)

    def _stays(self, token_ids: np.ndarray, rows: np.ndarray, slots: np.ndarray, before: np.ndarray) -> np.ndarray:
        """Whether each row continues the slot it held at the same row last time: the
        slot's stream (``seen`` tokens, fingerprint ``key``) is the start of the row's
        ``before`` tokens. Longer than it only after steps vLLM did not call ``propose``:
        the row sends everything past it."""
        had = np.minimum(self.seen[slots], before)
        same = fingerprint(token_ids, rows, had) == self.key[slots]
        return self.live[slots] & (self.seen[slots] <= before) & same

    def _continues(self, slots: np.ndarray, before: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Whether each row's stream (``before`` tokens, fingerprint ``keys``) is what
        its candidate slot has seen."""
        return self.live[slots] & (self.seen[slots] == before) & (self.key[slots] == keys)

    def _follow(self, rows: np.ndarray, before: np.ndarray, keys: np.ndarray, candidates: np.ndarray) -> np.ndarray:
        """The slot of each moved row among ``candidates`` (-1: none, or ambiguous): the
        one candidate with its fingerprint, when no other moved row has it too."""
        found = np.full(rows.shape[0], -1, dtype=np.int64)
        if not rows.size or not candidates.size:
            return found
        order = np.argsort(self.key[candidates], kind="stable")
        sorted_keys = self.key[candidates][order]
        first = np.searchsorted(sorted_keys, keys, side="left")
        once = np.searchsorted(sorted_keys, keys, side="right") - first == 1
        slot = candidates[order[np.minimum(first, candidates.size - 1)]]
        _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        unique = once & (counts[inverse] == 1) & self._continues(slot, before, keys)
        found[unique] = slot[unique]
        return found

    def drafted(self, slots: np.ndarray, counts: np.ndarray, out: Drafts) -> None:
        """After the round: what each slot was offered, and the slots the worker lost."""
        self.offered[slots] = counts
        self.announce[list(out.resync)] = True
        if out.resync_all:
            self.announce[:] = True


class RemoteProposer:
    """vLLM's ``custom_class`` drafter (see the module docstring): one started
    ``RemoteDSpark`` from the ``VLLM_DSPARK_REMOTE*`` environment, rowless, on the CPU,
    with ``max_num_seqs`` slots and K = ``num_speculative_tokens``.

    ``environ`` (default ``os.environ``) and ``tp_group`` are for tests and for callers
    outside vLLM: with ``tensor_parallel_size`` > 1 and no ``tp_group`` the proposer takes
    vLLM's tensor-parallel group (its gloo ``cpu_group``: the drafts are host lists, so
    rank 0's answer travels as CPU tensors, with no device copy or CUDA sync).

    Raises:
        ValueError: a ``vllm_config`` field missing or out of range, a bad variable
            (each named), or vLLM's group unavailable with tensor parallelism.
    """

    def __init__(self, vllm_config, *, environ: Mapping[str, str] | None = None, tp_group=None):
        self.facts = facts = VllmFacts.of(vllm_config)
        cfg = RemoteConfig.from_env(environ)
        if tp_group is None and facts.tp_size > 1:
            tp_group = vllm_tp_group(facts.tp_size)
        try:
            rd = RemoteDSpark(
                cfg,
                num_spec=facts.num_spec,
                max_slots=facts.max_num_seqs,
                row_bytes=0,
                vocab_size=facts.vocab_size,
                environ=environ,
                tp_group=tp_group,
            )
        except ValueError as e:
            name, fix = next((v for k, v in _VLLM_NAMES.items() if str(e).startswith(f"{k}=")), (None, ""))
            raise ValueError(f"vllm_config.{name}: {e}{fix}" if name else str(e)) from e
        self.rd = rd.start()
        self.slot_map = SlotMap(facts.max_num_seqs)
        self._close = weakref.finalize(self, rd.close)  # at exit too, if vLLM never closes it

    def load_model(self, target_model=None) -> None:
        """vLLM's hook: the drafter's model is on the worker, nothing to load here."""

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings=None,
    ) -> list[list[int]]:
        """Drafts for rows 0..len(sampled_token_ids)-1, each a list of at most K tokens
        ([] for a row that sampled nothing). ``slot_mappings`` (vLLM's KV slots) is unused.

        Raises:
            ValueError: inputs of the wrong shape, or token ids or counts not of an
                integer dtype, naming them.
            RemoteRoundFailed: ``ON_FAIL=raise`` and a failed round.
            RemoteForked: in a child forked from the process that built the proposer (its
                engine is the parent's; its ``close()`` and finalizer touch nothing there).
        """
        sampled, lengths = self._check(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        step = self.slot_map.assign(sampled, lengths, token_ids_cpu)
        if step.freed.size:  # requests that ended: a context still being announced there is let go
            self.rd.release(step.freed.tolist())
        self._record_accepted(step, sampled)
        entries = np.flatnonzero(step.slots >= 0)
        if not entries.size:
            return [[] for _ in range(sampled.shape[0])]
        out = self.rd.round(self._batch(step, entries, token_ids_cpu))
        counts = out.counts.numpy().astype(np.int64)
        self.slot_map.drafted(step.slots[entries], counts, out)
        drafts: list[list[int]] = [[] for _ in range(sampled.shape[0])]
        for row, tokens, count in zip(entries.tolist(), out.tokens.tolist(), counts.tolist()):
            drafts[row] = tokens[:count]
        return drafts

    def _check(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> tuple[np.ndarray, np.ndarray]:
        """The step's sampled counts and lengths [n] as int64, checked against vLLM's shapes
        and held to integer dtypes (``Batch``'s rule, :func:`require_integers`)."""
        n = len(sampled_token_ids)
        if n > self.facts.max_num_seqs:
            raise ValueError(f"sampled_token_ids: {n} rows, over max_num_seqs={self.facts.max_num_seqs}")
        if token_ids_cpu.ndim != 2 or token_ids_cpu.shape[0] < n or num_tokens_no_spec.shape[0] < n:
            raise ValueError(
                f"token_ids_cpu {token_ids_cpu.shape} / num_tokens_no_spec {num_tokens_no_spec.shape}: "
                f"expected [>= {n}, max_model_len] / [>= {n}]"
            )
        require_integers(token_ids_cpu, "token_ids_cpu")  # never truncated, in the fingerprint or the round
        require_integers(num_tokens_no_spec, "num_tokens_no_spec")
        sampled = np.fromiter(map(len, sampled_token_ids), dtype=np.int64, count=n)
        lengths = num_tokens_no_spec[:n].astype(np.int64)
        if n and ((lengths < sampled).any() or lengths.max() > token_ids_cpu.shape[1] or lengths.min() < 1):
            bad = int(np.argmax((lengths < sampled) | (lengths > token_ids_cpu.shape[1]) | (lengths < 1)))
            raise ValueError(
                f"num_tokens_no_spec[{bad}]={lengths[bad]}: outside {max(1, sampled[bad])}.."
                f"{token_ids_cpu.shape[1]} (the row sampled {sampled[bad]} tokens; token_ids_cpu's width)"
            )
        return sampled, lengths

    def _batch(self, step: Step, entries: np.ndarray, token_ids_cpu: np.ndarray) -> Batch:
        """The round's batch: per entry the tokens its slot has not seen (a NEW_GEN entry
        its last ``context_tokens``, the most the engine ever sends), from ``token_ids_cpu``
        with one gather; drafts capped where vLLM's scheduler cuts them, so that the row's
        tokens, its drafts and the token sampled after them fit ``max_model_len``."""
        lengths = step.lengths[entries]
        first = np.where(step.new_gen[entries], np.maximum(lengths - self.rd.context_tokens, 0), step.seen[entries])
        sizes = lengths - first
        offsets = np.zeros(entries.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        columns = np.repeat(first - offsets[:-1], sizes) + np.arange(offsets[-1])
        return Batch(
            slots=step.slots[entries],
            tokens=token_ids_cpu[np.repeat(entries, sizes), columns],
            token_offsets=offsets,
            positions=first,
            new_gen=step.new_gen[entries],
            n_out=np.clip(self.facts.max_model_len - lengths - 1, 0, self.facts.num_spec),
        )

    def _record_accepted(self, step: Step, sampled: np.ndarray) -> None:
        """vLLM accepted ``sampled - 1`` of the drafts each continuing row was offered."""
        offered = step.offered
        if not offered.any():
            return
        accepted = np.minimum(np.maximum(sampled - 1, 0), offered)
        position = np.arange(self.facts.num_spec)
        self.rd.record_accepted(
            (accepted[:, None] > position).sum(axis=0).tolist(), (offered[:, None] > position).sum(axis=0).tolist()
        )

    def close(self) -> None:
        """Close the ``RemoteDSpark`` (idempotent; within 2 s)."""
        self._close()


def vllm_tp_group(tp_size: int):
    """vLLM's tensor-parallel group as ``RemoteDSpark(tp_group=...)`` takes it: the gloo
    ``cpu_group`` of ``vllm.distributed.parallel_state.get_tp_group()``.

    Raises:
        ValueError: vLLM's group cannot be had, naming ``tensor_parallel_size``.
    """
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().cpu_group
    except (ImportError, AssertionError, AttributeError) as e:
        raise ValueError(
            f"vllm_config.parallel_config.tensor_parallel_size={tp_size}: needs vLLM's tensor-parallel "
            f"group (vllm.distributed.parallel_state.get_tp_group().cpu_group), not available: {e!r}"
        ) from e

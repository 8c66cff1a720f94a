"""transformers' assisted ``generate()`` with drafts from a remote worker.

One entry point::

    from remote_dspark.integrations.transformers import generate

    out = generate(model, input_ids, rd, max_new_tokens=200)  # as model.generate(input_ids, ...)

``rd`` is a started :class:`~remote_dspark.engine.RemoteDSpark` (``row_bytes=0``: no
rows). The call returns what ``model.generate(input_ids, **generate_kwargs)`` returns:
assisted decoding verifies every draft against the model, so the drafts change how many
forwards a generation takes, never its tokens (greedy), and a round that fails or drafts
nothing costs one ordinary step. Batch size 1, as transformers' assisted decoding.

How it enters transformers: ``generate``'s public ``custom_generate=`` callable receives
the prepared logits processors, stopping criteria, configuration and cache, and runs
transformers' own assisted loop (``GenerationMixin._assisted_decoding``) with
:class:`RemoteCandidates` as its candidate generator. The loop takes its generator from
``self._get_candidate_generator``; it runs here on a thin view of the model
(:class:`_Assisted`) whose only own attribute is that method, so nothing is patched, on
the class or the instance, and concurrent generations on one model do not meet. Those
two private names are the only ones used; they are checked at import
(:data:`MISSING`), and a transformers without them is refused by :func:`generate`,
naming the versions this was tested with.

One ``rd`` serves concurrent generations (threads), each on a slot of its own
(:class:`Slots`): ``rd.round()`` is single-threaded, so the rounds take turns under the
slots' lock, and a ``resync_all`` (a new connection: the worker holds nothing) reaches
every live generation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import weakref

import numpy as np
import torch

from ..engine import Batch, RemoteDSpark

TESTED_WITH = "transformers 5.17 and 5.25"


def _probe() -> tuple[type, str | None]:
    """(the base class of candidate generators, what this transformers lacks of what
    :func:`generate` uses: None when nothing)."""
    try:
        from transformers.generation.candidate_generator import CandidateGenerator
        from transformers.generation.utils import GenerationMixin
    except ImportError as e:
        return object, f"transformers, importable ({e})"
    for name in ("_assisted_decoding", "_get_candidate_generator"):
        if not hasattr(GenerationMixin, name):
            return CandidateGenerator, f"GenerationMixin.{name}"
    if "custom_generate" not in inspect.signature(GenerationMixin.generate).parameters:
        return CandidateGenerator, "generate(custom_generate=...)"
    return CandidateGenerator, None


_CANDIDATE_BASE, MISSING = _probe()


class Slots:
    """The slots of one ``rd`` shared by its generations: which are taken, which must be
    announced again (NEW_GEN) at their next round, and the lock the rounds take turns
    under. One per ``rd`` (:func:`slots_of`)."""

    def __init__(self, rd: RemoteDSpark):
        self.rd = rd
        self.lock = threading.Lock()
        self._free = list(range(rd.spec.max_slots - 1, -1, -1))
        self._stale: set[int] = set()  # slots the worker lost: NEW_GEN at their next round

    @contextlib.contextmanager
    def slot(self):
        """A free slot for the ``with`` block. Raises: RuntimeError when all are taken."""
        with self.lock:
            if not self._free:
                raise RuntimeError(f"all {self.rd.spec.max_slots} slots (max_slots) of this RemoteDSpark are taken")
            slot = self._free.pop()
        try:
            yield slot
        finally:
            with self.lock:
                self._stale.discard(slot)
                self._free.append(slot)

    def round(self, slot: int, tokens: np.ndarray, position: int, new_gen: bool, n_out: int) -> tuple[np.ndarray, bool]:
        """One round for ``slot`` (its tokens since its last round, the first at
        ``position``; ``new_gen``: its whole context). Returns (its drafts, whether the
        worker lost its window: announce it again)."""
        batch = Batch(
            slots=np.array([slot], np.int64),
            tokens=tokens.astype(np.int64),
            token_offsets=np.array([0, len(tokens)], np.int64),
            positions=np.array([position], np.int64),
            new_gen=np.array([new_gen]),
            n_out=np.array([n_out], np.int64),
        )
        with self.lock:
            out = self.rd.round(batch)
            if out.resync_all:  # every generating slot
                self._stale.update(set(range(self.rd.spec.max_slots)).difference(self._free))
            self._stale.update(int(s) for s in out.resync)
            lost = slot in self._stale
            self._stale.discard(slot)
        drafts = np.asarray(out.tokens[0][: int(out.counts[0])])
        return (drafts[:0] if lost else drafts), lost


_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SLOTS_LOCK = threading.Lock()


def slots_of(rd: RemoteDSpark) -> Slots:
    with _SLOTS_LOCK:
        slots = _SLOTS.get(rd)
        if slots is None:
            slots = _SLOTS[rd] = Slots(rd)
        return slots


class RemoteCandidates(_CANDIDATE_BASE):
    """transformers' candidate generator over one slot of ``rd``: each ``get_candidates``
    is one round. The worker is told only what it has not seen: the whole context at the
    first round (and after it lost the slot), then the tokens accepted since. Drafts are
    capped as transformers caps its own assistant's (``max_length - length - 1``); no
    drafts hand back ``(input_ids, None)``, what transformers' own generators do."""

    requires_model_outputs = False

    def __init__(self, slots: Slots, slot: int, max_length: int):
        self.slots, self.slot, self.max_length = slots, slot, max_length
        self.num_drafting_tokens = slots.rd.spec.num_spec  # what the loop keeps room for
        self._seen = 0  # tokens of the sequence the worker has (0: announce it whole)
        self._offered = 0

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        length = input_ids.shape[1]
        n_out = min(self.num_drafting_tokens, self.max_length - length - 1)
        self._offered = 0
        if n_out < 1:
            return input_ids, None
        new_gen = self._seen == 0
        tokens = input_ids[0, self._seen :].cpu().numpy()
        drafts, lost = self.slots.round(self.slot, tokens, self._seen, new_gen, n_out)
        self._seen = 0 if lost else length
        if not len(drafts):
            return input_ids, None
        self._offered = len(drafts)
        candidates = torch.as_tensor(drafts, dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, candidates[None]], 1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        positions = np.arange(self.num_drafting_tokens)
        accepted = min(int(num_matches), self._offered)  # a tensor on some devices and versions
        self.slots.rd.record_accepted(
            (positions < accepted).astype(int).tolist(),
            (positions < self._offered).astype(int).tolist(),
        )


class _Assisted:
    """The model as transformers' assisted loop sees it, its candidate generator ours:
    every other attribute is the model's (module docstring)."""

    def __init__(self, model, candidates: RemoteCandidates):
        self._model, self._candidates = model, candidates

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        return self._model(*args, **kwargs)

    def _get_candidate_generator(self, *args, **kwargs) -> RemoteCandidates:
        return self._candidates


def _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, *, slots, slot, streamer, **rest):
    """``generate``'s ``custom_generate``: transformers' assisted loop with our drafts.
    (``generate`` hands a custom callable its model inputs but not the streamer: it comes
    through :func:`generate`.)"""
    from transformers.generation.utils import GenerationMixin

    candidates = RemoteCandidates(slots, slot, generation_config.max_length)
    assisted = _Assisted(model, candidates)
    return GenerationMixin._assisted_decoding(
        assisted, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer, **rest
    )


def generate(model, input_ids: torch.LongTensor, rd: RemoteDSpark, **generate_kwargs):
    """``model.generate(input_ids, **generate_kwargs)`` with drafts from ``rd`` (module
    docstring): the same return value, one slot of ``rd`` taken for the call.

    Raises: RuntimeError for a transformers without the hooks used, or a batch of more
    than one sequence; whatever ``model.generate`` raises for its arguments."""
    if MISSING is not None:
        raise RuntimeError(
            f"remote_dspark.integrations.transformers needs {MISSING}, which this transformers lacks "
            f"(tested with {TESTED_WITH})"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise RuntimeError(f"input_ids of shape {tuple(input_ids.shape)}: assisted generation takes [1, n]")
    for name in ("custom_generate", "assistant_model", "prompt_lookup_num_tokens"):
        if name in generate_kwargs:
            raise RuntimeError(f"generate(..., {name}=...): the drafts come from rd; leave {name} out")
    slots = slots_of(rd)
    with slots.slot() as slot:
        decode = functools.partial(_decode, slots=slots, slot=slot, streamer=generate_kwargs.get("streamer"))
        return model.generate(input_ids, custom_generate=decode, **generate_kwargs)

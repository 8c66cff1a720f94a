"""transformers' assisted ``generate()`` with drafts from a remote worker.

One entry point::

    from remote_dspark.integrations.transformers import generate

    out = generate(model, input_ids, rd, max_new_tokens=200)  # as model.generate(input_ids, ...)

``rd`` is a started :class:`~remote_dspark.engine.RemoteDSpark` (``row_bytes=0``: no
rows). The call returns what ``model.generate(input_ids, **generate_kwargs)`` returns:
assisted decoding verifies every draft against the model, so the drafts change how many
forwards a generation takes, never its tokens (greedy) nor their distribution
(``do_sample=True``), and a round that fails or drafts nothing costs one ordinary step.
Batch size 1, as transformers' assisted decoding.

Sampling (``do_sample=True``) takes one of two exact paths, by ``rd``:

- an ``rd`` with sampled drafts (``VLLM_DSPARK_SAMPLED_TOP32=1``): each round asks for
  drafts sampled at the generation's ``temperature`` (1 when unset) with the call's
  ``draft_seed``, and hands transformers each drafted position's distribution ``q`` as
  candidate logits (:func:`candidate_logits`: ``log q`` at its 32 ids, ``-inf``
  elsewhere, so ``softmax`` of them is ``q``). transformers then runs speculative
  sampling (``_speculative_sampling``: accept a draft with probability
  ``min(1, p/q)``, else draw from ``max(0, p - q)``), ``p`` the target's distribution
  after its own temperature, top-k and top-p. Any ``q`` keeps the output exact: the
  draft's temperature is the target's because that ``q`` is nearest ``p`` (the most
  accepted), not for exactness. The drafts' randomness is the worker's, keyed by
  ``draft_seed`` and each draft's position (:mod:`remote_dspark.drafter.sampling`);
  without an explicit ``draft_seed`` it is drawn from torch's default generator, so
  ``torch.manual_seed(s)`` makes a whole call reproducible.
- any other ``rd``: token matching (transformers' own path without candidate logits: a
  draft is kept while it equals the token the target samples). Exact too, but a draft
  is kept with probability ``p(draft)`` rather than ``min(1, p/q)``: fewer accepted.

A sampled ``rd`` with ``do_sample=False`` drafts at temperature 0 (greedy) and hands no
candidate logits: the greedy path above.

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
every live generation. A generation's end releases its slot (``rd.release``): a long
prompt still being announced in chunks there is let go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import threading
import weakref

import numpy as np
import torch

from ..engine import Batch, RemoteClosed, RemoteDSpark
from ..wire import SAMPLED_TOP as TOP
from ..wire import SAMPLED_TOTAL as TOTAL

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
        """A free slot for the ``with`` block, released in ``rd`` at its end (the
        generation ended: a context still being announced there is let go, and the
        slot's next generation starts whole). Raises: RuntimeError when all are taken."""
        with self.lock:
            if not self._free:
                raise RuntimeError(f"all {self.rd.spec.max_slots} slots (max_slots) of this RemoteDSpark are taken")
            slot = self._free.pop()
        try:
            yield slot
        finally:
            with self.lock:  # (the rounds' lock: rd's calls take turns)
                with contextlib.suppress(RemoteClosed):  # a closed rd holds nothing
                    self.rd.release([slot])
                self._stale.discard(slot)
                self._free.append(slot)

    def round(
        self, slot: int, tokens: np.ndarray, position: int, new_gen: bool, n_out: int, sampling: DraftSampling
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None, bool]:
        """One round for ``slot`` (its tokens since its last round, the first at
        ``position``; ``new_gen``: its whole context; ``sampling``: the draft's
        temperature and seed, sent only when the rd is sampled). Returns (its drafts
        [c], their distributions (ids, weights) [c, 32] when the rd is sampled, whether
        the worker lost its window: announce it again)."""
        sampled = self.rd.spec.sampled
        batch = Batch(
            slots=np.array([slot], np.int64),
            tokens=tokens.astype(np.int64),
            token_offsets=np.array([0, len(tokens)], np.int64),
            positions=np.array([position], np.int64),
            new_gen=np.array([new_gen]),
            n_out=np.array([n_out], np.int64),
            temperature=np.array([sampling.temperature], np.float32) if sampled else None,
            seed=np.array([sampling.seed], np.uint64) if sampled else None,
        )
        with self.lock:
            out = self.rd.round(batch)
            if out.resync_all:  # every generating slot
                self._stale.update(set(range(self.rd.spec.max_slots)).difference(self._free))
            self._stale.update(int(s) for s in out.resync)
            lost = slot in self._stale
            self._stale.discard(slot)
        count = 0 if lost else int(out.counts[0])
        drafts = np.asarray(out.tokens[0][:count])
        q = None if out.q_ids is None else (out.q_ids[0, :count].numpy(), out.q_weights[0, :count].numpy())
        return drafts, q, lost


@dataclasses.dataclass(frozen=True)
class DraftSampling:
    """How one generation's drafts are drawn: ``temperature`` (0: greedy), ``seed`` (the
    worker's randomness, a u64), and ``width``: the target's logits' width when the
    candidates carry their distributions (candidate logits), else 0 (token matching)."""

    temperature: float = 0.0
    seed: int = 0
    width: int = 0


GREEDY = DraftSampling()


def candidate_logits(ids: np.ndarray, weights: np.ndarray, width: int) -> torch.Tensor:
    """transformers' candidate logits of sampled drafts: ``[1, c, width]`` float32, ``log
    q`` at each drafted position's listed ids (``q = weight / 65535``; weight 0: ``-inf``)
    and ``-inf`` elsewhere, so that ``softmax`` over the last axis is ``q``.

    Args:
        ids: [c, 32] int, distinct per position, in 0..width-1.
        weights: [c, 32] integer weights, summing to 65535 per position.
        width: the target's logits' width.

    Raises:
        ValueError: naming ``ids`` or ``weights`` (shape) or an id outside 0..width-1.
    """
    ids, weights = np.asarray(ids), np.asarray(weights)
    if ids.ndim != 2 or ids.shape[1] != TOP or weights.shape != ids.shape:
        raise ValueError(f"ids {ids.shape}, weights {weights.shape}: expected [c, {TOP}] both")
    if ids.size and (ids.min() < 0 or ids.max() >= width):
        raise ValueError(f"ids: {ids.min()}..{ids.max()} outside the target's logits 0..{width - 1}")
    q = torch.from_numpy(weights.astype(np.float64) / TOTAL)
    out = torch.full((1, ids.shape[0], width), -torch.inf, dtype=torch.float32)
    out[0].scatter_(1, torch.from_numpy(ids.astype(np.int64)), q.log().to(torch.float32))
    return out


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
    drafts hand back ``(input_ids, None)``, what transformers' own generators do. With
    ``sampling.width`` the drafts come with their candidate logits
    (:func:`candidate_logits`), else with None."""

    requires_model_outputs = False

    def __init__(self, slots: Slots, slot: int, max_length: int, sampling: DraftSampling = GREEDY):
        self.slots, self.slot, self.max_length, self.sampling = slots, slot, max_length, sampling
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
        drafts, q, lost = self.slots.round(self.slot, tokens, self._seen, new_gen, n_out, self.sampling)
        self._seen = 0 if lost else length
        if not len(drafts):
            return input_ids, None
        self._offered = len(drafts)
        candidates = torch.as_tensor(drafts, dtype=input_ids.dtype, device=input_ids.device)
        logits = None
        if self.sampling.width and q is not None:
            logits = candidate_logits(q[0], q[1], self.sampling.width).to(input_ids.device)
        return torch.cat([input_ids, candidates[None]], 1), logits

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


def logits_width(model) -> int:
    """The width of ``model``'s logits: its output embeddings' rows (a head may pad the
    vocabulary), else its configuration's ``vocab_size``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None:
        return int(weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def sampling_of(model, rd: RemoteDSpark, generation_config, draft_seed: int | None) -> DraftSampling:
    """How a generation's drafts are drawn (module docstring): greedy for an unsampled
    ``rd`` or ``do_sample=False``; else at the generation's temperature (1 when unset),
    seeded by ``draft_seed`` or, when None, by a number drawn from torch's default
    generator, with candidate logits as wide as the model's.

    Raises:
        ValueError: a sampled ``rd`` whose ``vocab_size`` is unknown or wider than the
            model's logits (a draft could be a token the model has no logit for)."""
    if not (rd.spec.sampled and generation_config.do_sample):
        return GREEDY
    width = logits_width(model)
    if not 1 <= rd.spec.vocab_size <= width:
        raise ValueError(
            f"rd's vocab_size={rd.spec.vocab_size}: sampled drafts need it known and within the model's "
            f"{width} logits (RemoteDSpark(vocab_size=...))"
        )
    temperature = 1.0 if generation_config.temperature is None else float(generation_config.temperature)
    if draft_seed is None:
        draft_seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    return DraftSampling(temperature, draft_seed % 2**64, width)


def _decode(model, input_ids, logits_processor, stopping_criteria, generation_config, *, slots, slot, **rest):
    """``generate``'s ``custom_generate``: transformers' assisted loop with our drafts.
    (``generate`` hands a custom callable its model inputs but not the streamer: it comes
    through :func:`generate`.)"""
    from transformers.generation.utils import GenerationMixin

    streamer, draft_seed = rest.pop("streamer"), rest.pop("draft_seed")
    sampling = sampling_of(model, slots.rd, generation_config, draft_seed)
    candidates = RemoteCandidates(slots, slot, generation_config.max_length, sampling)
    assisted = _Assisted(model, candidates)
    return GenerationMixin._assisted_decoding(
        assisted, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer, **rest
    )


def generate(model, input_ids: torch.LongTensor, rd: RemoteDSpark, *, draft_seed: int | None = None, **generate_kwargs):
    """``model.generate(input_ids, **generate_kwargs)`` with drafts from ``rd`` (module
    docstring): the same return value (with ``do_sample=True``, the same distribution),
    one slot of ``rd`` taken for the call. ``draft_seed``: the drafts' randomness with a
    sampled ``rd`` and ``do_sample=True`` (an int, its low 64 bits taken; None: drawn
    from torch's default generator); unused otherwise.

    Raises: RuntimeError for a transformers without the hooks used, or a batch of more
    than one sequence; ValueError for a sampled ``rd`` whose vocabulary does not fit the
    model (:func:`sampling_of`); whatever ``model.generate`` raises for its arguments."""
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
        streamer = generate_kwargs.get("streamer")
        decode = functools.partial(_decode, slots=slots, slot=slot, streamer=streamer, draft_seed=draft_seed)
        return model.generate(input_ids, custom_generate=decode, **generate_kwargs)

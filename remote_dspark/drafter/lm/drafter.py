"""The batched model drafter: greedy or sampled drafts from a causal LM, with a KV cache
per stream.

One round (:meth:`LMDrafter.draft_batch`) is, for its n entries at once:

1. a plan (:meth:`remote_dspark.drafter.lm.cache.SlotCache.plan`, numpy): each entry's
   cache row, the positions kept from it and the tokens to encode (all of a context on a
   miss, the new ones on a hit); entries without a cache row get scratch rows of the
   store (:class:`~remote_dspark.drafter.lm.cache.KVStore`);
2. one host-to-device copy of every integer the round needs (padded tokens, positions,
   rows), packed into one array;
3. one forward over the padded ragged batch, then ``width - 1`` batched steps (one
   forward over all n entries each), every query writing its K/V into its entry's row
   and attending to that row in place (:mod:`.attention`): no row is copied in or out;
4. one device-to-host copy of tokens and margins (and a sampled round's distributions).
   The drafts' K/V stay in the rows past each row's ``fill``, dead.

A sampled round (``batch.sampled``) draws each step's token by the sampling rule
(:mod:`remote_dspark.drafter.sampling`; on the device its twin, :mod:`.sampling`) instead
of taking the argmax, and feeds the drawn token to the next step: draft j of entry i is
``pick(q_ids[i, j], q_weights[i, j], uniform_u32(seed[i], p, j))`` with ``p =
batch.starts()[i] + len(context_i) + j``, its distribution given the drafts before it.
Temperature 0 is greedy (the argmax, one-hot weights). Its temperatures (float32 bits),
seeds (uint64 bits) and first positions go up in the round's one integer copy
(:meth:`.graphs.Rounds.run`); its margins are the greedy round's rule (softmax's top1 -
top2 at temperature 1) over the same logits.

No Python loop over entries: the loops are over draft steps and layers. Margins are the
softmax's top1 - top2 (float32). On CUDA the model and the store are bf16, on CPU float32,
and the round is a CUDA graph (:mod:`.graphs`).

Threads: the worker serves each engine's connection on its own thread, and all of them
share one drafter; a lock serializes rounds (a GPU runs them one after another anyway).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..contract import CacheInfo, DraftBatch, DraftResult, empty_result, sampling_inputs
from ..sampling import TOP
from .budget import fitting_tokens, part_limit, working_bytes
from .cache import KVStore, Plan, SlotCache, memory_free, row_tokens, uncached_plan
from .graphs import Rounds, columns, top2
from .model import TinyLM

if TYPE_CHECKING:
    from .hf_model import HFModel

MARKOV_NONE = bytes(32)  # the contract's Markov identity of a drafter without a Markov model


def pick_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"``: CUDA when present, else the CPU.

    Raises: ValueError for CUDA asked for where there is none, or a name torch does not know.
    """
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA device here")
    return dev


def sampling_rows(batch: DraftBatch, ctx_lens: np.ndarray) -> np.ndarray:
    """A sampled round's integers per entry, for :meth:`.graphs.Rounds.run`: [3, n] int64,
    each entry's temperature (its float32 bits), seed (its uint64 bits) and its draft 0's
    absolute position (``starts + ctx_lens``).

    Raises: ValueError naming ``temperature`` or ``seed`` (:func:`~..contract.sampling_inputs`)."""
    t, seed = sampling_inputs(batch)
    out = np.empty((3, len(batch)), np.int64)
    out[0] = t.view(np.int32)  # every temperature's bits below 2**31 (-0.0 is +0.0 there)
    out[1] = seed.view(np.int64)
    out[2] = batch.starts() + ctx_lens
    return out


def greedy_result(batch: DraftBatch, ctx_lens: np.ndarray, tokens: np.ndarray, margins: np.ndarray) -> DraftResult:
    """The round's answer from ``width`` greedy steps for every entry: ``min(n_out,
    width)`` drafts each (none for an empty context), zeros past the counts."""
    counts = np.where(ctx_lens > 0, np.minimum(batch.n_out, batch.width), 0).astype(np.int32)
    live = np.arange(batch.width) < counts[:, None]
    return DraftResult(
        np.where(live, tokens, 0).astype(np.int32),
        counts,
        np.where(live, margins, 0).astype(np.float32) if batch.want_margin else None,
    )


def round_result(batch: DraftBatch, ctx_lens: np.ndarray, out: np.ndarray) -> DraftResult:
    """The round's answer from :meth:`.graphs.Rounds.run`'s ``out`` [n, columns]: greedy
    (:func:`greedy_result`), or sampled with each drafted position's distribution
    (``q_ids`` int32, ``q_weights`` uint16 ``[n, width, TOP]``, zeros past the counts)."""
    n, width = len(batch), batch.width
    result = greedy_result(batch, ctx_lens, out[:, :width], out[:, width : 2 * width])
    if not batch.sampled:
        return result
    q = out[:, 2 * width :].reshape(n, 2, width, TOP)
    live = (np.arange(width) < result.counts[:, None])[..., None]
    q_ids = np.where(live, q[:, 0], 0).astype(np.int32)
    q_weights = np.where(live, q[:, 1], 0).astype(np.uint16)
    return dataclasses.replace(result, q_ids=q_ids, q_weights=q_weights)


class LMDrafter:
    """Greedy or sampled drafting from a causal LM, batched, with a KV cache per stream kept across
    rounds: a :class:`~remote_dspark.drafter.lm.model.TinyLM` (the built-in one by default)
    or a transformers model (:class:`~remote_dspark.drafter.lm.hf_model.HFModel`), one code.
    A batch may mix sessions (the cache keys each entry's stream by its own session).

    Args:
        model: the model (float32 weights: its identity is taken before any cast).
        identity: its drafter identity, when not ``model.identity()`` (a drafter made from a
            model already cast: :meth:`sibling`).
        device: ``"auto"`` (default: CUDA when present), ``"cpu"``, ``"cuda"``...
        cache_slots: streams cached at most (the least recently used is dropped beyond);
            0: no cache, every round re-encodes every context.
        window: the worker's ``--window``: ``max_tokens`` defaults to ``2 * window + 16``
            (at most the model's positions), so a stream re-encoded from its window has
            ``window`` more tokens of room before its next re-encode, with 16 draft
            positions besides. ``max_width`` (``max_tokens - window``) is the widest round
            a row holds beside a whole window: the worker refuses a HELLO whose
            ``num_spec`` is wider.
        max_tokens: positions of a cache row (at most the model's ``max_positions``).
        graphs: the round on padded shapes, replayed as CUDA graphs on CUDA
            (:mod:`.graphs`). None (default): on CUDA only; False: eager, the round's own
            shapes launched op by op; True: also on the CPU (padded, run eagerly: tests).
    """

    mixed_sessions = True
    samples = True  # sampled rounds (False for a vocabulary under TOP ids: set in __init__)

    def __init__(
        self,
        model: TinyLM | HFModel | None = None,
        *,
        identity: bytes | None = None,
        device: str | torch.device | None = None,
        cache_slots: int = 1024,
        window: int = 64,
        max_tokens: int | None = None,
        graphs: bool | None = None,
    ):
        model = model or TinyLM()
        c = model.config
        if c.max_positions is not None and window + 16 > c.max_positions:
            raise ValueError(
                f"window {window} (--window): the model has {c.max_positions} positions, "
                "for a window and 16 drafts at least"
            )
        self.max_tokens = row_tokens(window, c.max_positions, max_tokens)
        # The widest round a row holds beside a whole window: the worker refuses a HELLO
        # whose num_spec is wider (worker.limits.hello_refusal), so no round fails for it.
        self.max_width = self.max_tokens - window
        self.max_positions = c.max_positions  # an entry past them gets no drafts (the worker's rule)
        if cache_slots < 0:
            raise ValueError(f"cache_slots {cache_slots}: must be >= 0")
        self.device = pick_device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.drafter_identity = identity or model.identity()
        self.markov_identity = MARKOV_NONE
        self.vocab_size = c.vocab_size
        if c.vocab_size < TOP:
            self.samples = False
        self.model = model.to(self.device, self.dtype).eval()
        self.store = KVStore(cache_slots, c.n_layers, c.n_heads, c.head_dim, self.max_tokens, self.device, self.dtype)
        self.cache = SlotCache(cache_slots, self.max_tokens, self.store.row_bytes()) if cache_slots else None
        self.keeps_streams = self.cache is not None  # an encode (n_out 0) is kept; a long one taken in pieces
        padded = graphs if graphs is not None else self.device.type == "cuda"
        self._rounds = Rounds(self.model, self.store, padded)
        self._lock = threading.Lock()
        self.window, self._graphs_asked = window, graphs

    def sibling(self, cache_slots: int, max_tokens: int | None = None) -> LMDrafter:
        """A drafter of the same model (shared, not copied) with a cache of its own."""
        return LMDrafter(
            self.model,
            identity=self.drafter_identity,
            device=self.device,
            cache_slots=cache_slots,
            window=self.window,
            max_tokens=max_tokens,
            graphs=self._graphs_asked,
        )

    def reserve(self, max_entries: int, max_tokens: int, *, derive: bool = False) -> int:
        """The worker's call budget: the scratch rows a call of ``max_entries`` entries can
        need (those beyond the cache's rows), allocated now, so that no call within the
        budget grows the store; and the parts a round runs in (:func:`.graphs.parts`),
        sized for ``max_tokens``. With ``derive``, ``max_tokens`` is a ceiling: the budget
        is the most tokens whose working set (:mod:`.budget`) fits in half the memory free
        once the rows are allocated. Returns the token budget.

        Raises: ValueError when the rows, or a call's working set, do not fit in the
        device's free memory."""
        with self._lock:
            rowless = max_entries - (self.cache.capacity if self.cache is not None else 0)
            if rowless > 0:
                self.store.scratch(rowless)
            free = memory_free(self.device)
            if derive:
                max_tokens = fitting_tokens(self.model, self.store, max_entries, max_tokens, free)
            limit = part_limit(max_tokens, self.store.columns)
            need = working_bytes(self.model, self.store, max_entries, limit)
            if need > free:
                raise ValueError(
                    f"a call of {max_entries} entries and {max_tokens} tokens needs {need / 2**20:,.0f} MiB of "
                    f"working memory; {free / 2**20:,.0f} MiB are free on {self.device}"
                )
            self._rounds.limit = limit
            return max_tokens

    def cache_info(self) -> CacheInfo:
        """The cache's streams and counts; ``bytes`` is the whole store's, its scratch rows
        (which grow with the largest round of entries without a cache row) counted."""
        with self._lock:
            info = self.cache.info() if self.cache is not None else CacheInfo(0, 0, 0, 0, 0)
            return dataclasses.replace(info, bytes=self.store.nbytes())

    def draft_batch(self, batch: DraftBatch) -> DraftResult:
        """Drafts for every entry (module docstring), each context at its true positions;
        sampled, with their distributions, when ``batch.sampled``. An entry with ``n_out``
        0 is encoded into its stream's row and takes no draft steps (a call of only such
        entries encodes too); without a cache row to keep them, it is not run at all.
        Raises: ValueError for a width that leaves no room in a row (``width >=
        max_tokens``), an entry past the position table (the worker drops those:
        :meth:`~remote_dspark.drafter.contract.DraftBatch.beyond`), or a sampled round's
        ``temperature`` or ``seed`` of the wrong shape, or a temperature that is not
        finite and >= 0 (:func:`sampling_rows`)."""
        n, width = len(batch), batch.width
        if n == 0:
            return empty_result(n, width, batch.want_margin)
        if width >= self.max_tokens:
            raise ValueError(f"width {width}: no room in a {self.max_tokens}-token row (max_tokens)")
        if batch.beyond(self.max_positions).any():
            raise ValueError(f"an entry's context and {width} drafts pass the model's {self.max_positions} positions")
        if batch.sampled and not self.samples:
            raise ValueError(f"a sampled round: the model's vocabulary of {self.vocab_size} is under {TOP} ids")
        ctx_lens = np.diff(batch.offsets).astype(np.int64)
        sampling = sampling_rows(batch, ctx_lens) if batch.sampled else None
        # An empty context: no drafts, any valid position. None: numbered from each row's start.
        starts = None if batch.positions is None else np.where(ctx_lens > 0, batch.starts(), 0)
        widths = np.where(batch.n_out > 0, width, 0)  # an encode only takes no draft steps
        cached = self.cache is not None and batch.slots is not None
        with self._lock, torch.inference_mode():
            if cached:
                plan = self.cache.plan(*self._streams(batch), ctx_lens, widths, starts)
            else:
                plan = uncached_plan(ctx_lens, widths, self.max_tokens, starts)
            try:
                out = self._draft(batch, plan, width, sampling, widths > 0, cached)
            except BaseException:
                if cached:
                    self.cache.forget(plan.rows)
                raise
        return round_result(batch, ctx_lens, out)

    def encodes(self, batch: DraftBatch) -> np.ndarray:
        """[n] int64: the tokens :meth:`draft_batch` would encode for each entry now (the
        contract's ``encodes``: the worker charges them in a call's budget): a stream's new
        tokens when its row holds the rest, else its re-encode; none for an encode only
        (``n_out`` 0) that has no row to keep it. Nothing changes."""
        ctx_lens = np.diff(batch.offsets).astype(np.int64)
        widths = np.where(batch.n_out > 0, batch.width, 0)
        starts = None if batch.positions is None else np.where(ctx_lens > 0, batch.starts(), 0)
        if self.cache is None or batch.slots is None:
            return np.where(widths > 0, np.minimum(ctx_lens, self.max_tokens - widths), 0)
        _, slots, gens, lengths = self._streams(batch)
        sessions = batch.session if np.ndim(batch.session) == 0 else batch.sessions()
        with self._lock:
            return self.cache.encodes(sessions, slots, gens, lengths, ctx_lens, widths, starts)

    @staticmethod
    def _streams(batch: DraftBatch) -> tuple[np.ndarray, ...]:
        """The batch's stream fields as the cache takes them: sessions, slots, gens, lengths."""
        return (
            batch.sessions(),
            np.asarray(batch.slots, np.int64),
            np.asarray(batch.gens, np.int64),
            np.asarray(batch.lengths, np.int64),
        )

    def _draft(self, batch, plan: Plan, width: int, sampling, drafting: np.ndarray, cached: bool) -> np.ndarray:
        """The round's answer ([n, columns] float32, :meth:`.graphs.Rounds.run`): the
        ``drafting`` entries' ``width`` steps, and the others encoded with none (when
        ``cached``: a row keeps them), in a round of their own."""
        take = np.maximum(plan.take, 1)  # an empty context: one dummy token, no drafts counted
        q = int(take.max())
        src = batch.tokens if len(batch.tokens) else np.zeros(1, np.int32)
        idx = (batch.offsets[1:] - take)[:, None] + np.arange(q)
        tok = np.where(np.arange(q) < take[:, None], src[np.clip(idx, 0, len(src) - 1)], 0)
        rows = plan.rows.copy()
        rowless = rows < 0
        rows[rowless] = self.store.scratch(int(rowless.sum()))
        if drafting.all():  # the common round: every entry drafts
            return self._rounds.run(tok, plan.base, take, plan.origin, rows, width, sampling)

        def run(which: np.ndarray, steps: int, part) -> np.ndarray:
            q = int(take[which].max())  # tokens are left-aligned: the entries' first q columns
            base, origin = plan.base[which], plan.origin[which]
            return self._rounds.run(tok[which, :q], base, take[which], origin, rows[which], steps, part)

        encode = ~drafting & (plan.rows >= 0) if cached else np.zeros(len(take), bool)
        if encode.any():
            run(encode, 0, None)  # no drafts: the model's body only, no logits
        out = np.zeros((len(take), columns(width, sampling is not None)), np.float32)
        if drafting.any():
            out[drafting] = run(drafting, width, None if sampling is None else sampling[:, drafting])
        return out

    def greedy_one(self, context, n: int, start: int = 0) -> tuple[list[int], list[float]]:
        """The reference: ``n`` greedy tokens after ``context`` alone, its first token at
        position ``start`` (no padding, no cache; the whole sequence re-encoded per token)
        and their margins. Equal to
        :meth:`draft_batch` up to float rounding for contexts of at most ``max_tokens -
        width`` tokens."""
        seq = [int(t) for t in context]
        tokens, margins = [], []
        with torch.inference_mode():
            for _ in range(n):
                x = torch.tensor([seq], dtype=torch.long, device=self.device)
                token, margin = top2(self.model(x, start)[:, -1])
                tokens.append(int(token))
                margins.append(float(margin))
                seq.append(tokens[-1])
        return tokens, margins

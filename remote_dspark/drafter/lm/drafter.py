"""The batched model drafter: greedy or sampled drafts from a causal LM, each stream's KV
kept across rounds in a paged pool.

One round (:meth:`LMDrafter.draft_batch`) is, for its n entries at once:

1. a plan (:meth:`remote_dspark.drafter.lm.cache.SlotCache.plan`, numpy): each entry's
   cache row, the columns kept from it and the tokens to encode (the new ones on a hit,
   on a miss all the worker holds of the stream: :mod:`remote_dspark.drafter.streams`);
   entries without a cache row get scratch rows of the block table
   (:class:`~remote_dspark.drafter.lm.pool.KVStore`);
2. the blocks each stream needs, taken from the pool (whole streams evicted for room,
   the round run in waves when the pool cannot hold it at once: :meth:`LMDrafter._draft`);
3. per part of the round (:func:`.graphs.parts`), one host-to-device copy of every
   integer it needs (padded tokens, positions, each write's block and offset, the table's
   new cells), one forward over the padded ragged batch, then ``width - 1`` batched steps
   (one forward over all its entries each), every query writing its K/V into its stream's
   blocks and attending to them in place (:mod:`.attention`): no stream is copied in or
   out; and one device-to-host copy of tokens and margins (and a sampled round's
   distributions). The drafts' K/V stay in the blocks past each stream's ``fill``, dead.

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
softmax's top1 - top2 (float32). On CUDA the model and the pool are bf16, on CPU float32,
and the round is a CUDA graph (:mod:`.graphs`).

Threads: the worker serves each engine's connection on its own thread, and all of them
share one drafter; a lock serializes rounds (a GPU runs them one after another anyway).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..contract import CacheInfo, DraftBatch, DraftResult, SpecInfo, empty_result
from ..sampling import TOP
from ..streams import context_lengths, kept
from .arrays import round_result, sampling_rows, stream_window
from .budget import fitting_tokens, part_limit, working_bytes
from .cache import Plan, SlotCache, uncached_plan
from .graphs import Rounds, top2
from .model import TinyLM
from .pool import BLOCK, MAX_WIDTH, MIN_SCRATCH, KVStore, memory_free, pool_bytes, stream_columns
from .speculate import MAX_BRANCHES, Speculation

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


class LMDrafter:
    """Greedy or sampled drafting from a causal LM, batched, with the KV of each stream kept
    across rounds in a paged pool (:mod:`.cache`): a
    :class:`~remote_dspark.drafter.lm.model.TinyLM` (the built-in one by default) or a
    transformers model (:class:`~remote_dspark.drafter.lm.hf_model.HFModel`), one code. A
    batch may mix sessions (the cache keys each entry's stream by its own session).

    Args:
        model: the model (float32 weights: its identity is taken before any cast).
        identity: its drafter identity, when not ``model.identity()`` (a drafter made from a
            model already cast: :meth:`sibling`).
        device: ``"auto"`` (default: CUDA when present), ``"cpu"``, ``"cuda"``...
        cache_slots: streams cached at most (the least recently used is dropped beyond);
            0: no cache, every round re-encodes every stream.
        window: the worker's ``--window``, the context a batch carries; a stream holds
            more than it (``max_context``).
        max_context: the tokens a stream keeps (its whole sequence up to them: the worker
            keeps as many, and the engine sends NEW_GEN contexts up to them); None:
            ``DEFAULT_CONTEXT``; at most the model's positions. A stream holds
            ``max_width`` more columns for a round's drafts: the worker refuses a HELLO
            whose ``num_spec`` is wider.
        kv_bytes: the KV pool's memory (None: :func:`~.pool.pool_bytes`, a share of what
            is free after the weights).
        graphs: the round on padded shapes, replayed as CUDA graphs on CUDA
            (:mod:`.graphs`). None (default): on CUDA only; False: eager, the round's own
            shapes launched op by op; True: also on the CPU (padded, run eagerly: tests).
        speculate: outcomes of each stream's next round pre-drafted in the worker's idle
            time (:mod:`.speculate`, :meth:`predraft`); 0 (default): none. Needs a cache.
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
        max_context: int | None = None,
        kv_bytes: int | None = None,
        graphs: bool | None = None,
        speculate: int = 0,
    ):
        model = model or TinyLM()
        c = model.config
        if c.max_positions is not None and window + 16 > c.max_positions:
            raise ValueError(
                f"window {window} (--window): the model has {c.max_positions} positions, "
                "for a window and 16 drafts at least"
            )
        self.max_context, self.columns = stream_columns(max_context, c.max_positions)
        if self.columns <= window:
            raise ValueError(f"--max-context {max_context}: must be more than --window {window}")
        # The widest round a stream holds: the worker refuses a HELLO whose num_spec is
        # wider (worker.limits.hello_refusal), so no round fails for it.
        self.max_width = min(MAX_WIDTH, self.columns - window)
        self.max_positions = c.max_positions  # an entry past them gets no drafts (the worker's rule)
        if cache_slots < 0:
            raise ValueError(f"cache_slots {cache_slots}: must be >= 0")
        if speculate < 0 or (speculate and not cache_slots):
            raise ValueError(f"speculate {speculate}: must be >= 0, and 0 without a cache (cache_slots 0)")
        branches = min(cache_slots * speculate, MAX_BRANCHES)
        self.device = pick_device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.drafter_identity = identity or model.identity()
        self.markov_identity = MARKOV_NONE
        self.vocab_size = c.vocab_size
        if c.vocab_size < TOP:
            self.samples = False
        self.model = model.to(self.device, self.dtype).eval()
        shape = (c.n_layers, c.n_heads, c.head_dim)
        blocks = self._blocks(kv_bytes, cache_slots, shape, branches * (2 + self.max_width // BLOCK))
        self.store = KVStore(blocks, cache_slots, self.columns, *shape, self.device, self.dtype, branches)
        self.cache = SlotCache(self.store) if cache_slots else None
        self.keeps_streams = self.cache is not None  # an encode (n_out 0) is kept; a long one taken in pieces
        padded = graphs if graphs is not None else self.device.type == "cuda"
        self._rounds = Rounds(self.model, self.store, padded, ranked=bool(speculate))
        self.spec = None
        self.speculates = bool(speculate)  # (the contract's: the worker calls predraft in idle time)
        if speculate:
            self.spec = Speculation(self.store, self.cache, self._rounds, speculate, self.max_width, c.max_positions)
        self._lock = threading.Lock()
        self.window, self._graphs_asked, self._kv_bytes = window, graphs, kv_bytes
        self._speculate = speculate

    def _blocks(self, kv_bytes: int | None, cache_slots: int, shape: tuple[int, int, int], extra: int = 0) -> int:
        """The pool's blocks: ``kv_bytes`` of them, or the default budget's
        (:func:`~.pool.pool_bytes`) for every cached stream's whole context at most and
        ``extra`` blocks (every pre-draft's own)."""
        layers, heads, head_dim = shape
        block_bytes = layers * 2 * heads * BLOCK * head_dim * torch.finfo(self.dtype).bits // 8
        per_stream = self.columns // BLOCK
        if kv_bytes is None:
            kv_bytes = pool_bytes(self.device, (max(cache_slots, MIN_SCRATCH) * per_stream + 1 + extra) * block_bytes)
        return max(1, int(kv_bytes) // block_bytes)

    def sibling(self, cache_slots: int, max_context: int | None = None) -> LMDrafter:
        """A drafter of the same model (shared, not copied) with a cache of its own."""
        return LMDrafter(
            self.model,
            identity=self.drafter_identity,
            device=self.device,
            cache_slots=cache_slots,
            window=self.window,
            max_context=max_context,
            kv_bytes=self._kv_bytes,
            graphs=self._graphs_asked,
            speculate=self._speculate if cache_slots else 0,
        )

    def reserve(self, max_entries: int, max_tokens: int, *, derive: bool = False) -> int:
        """The worker's call budget: the scratch rows of the block table a call of
        ``max_entries`` entries can need (those beyond the cache's rows), made now, so that
        no call within the budget grows the table (and recaptures its graphs); and the parts
        a round runs in (:func:`.graphs.parts`), sized for ``max_tokens``. With ``derive``,
        ``max_tokens`` is a ceiling: the budget is the most tokens whose working set
        (:mod:`.budget`) fits in half the memory free. Returns the token budget.

        Raises: ValueError when a call's working set does not fit in the device's free
        memory."""
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
        """The cache's streams, counts and blocks; ``bytes`` is the pool's, fixed at start
        (also for a drafter without a cache: its scratch rows' blocks are the pool's)."""
        with self._lock:
            info = self.cache.info() if self.cache is not None else CacheInfo(0, 0, 0, 0, 0)
            return dataclasses.replace(info, bytes=self.store.nbytes())

    def draft_batch(self, batch: DraftBatch) -> DraftResult:
        """Drafts for every entry (module docstring), each stream at its true positions;
        sampled, with their distributions, when ``batch.sampled``. An entry with ``n_out``
        0 is encoded into its stream's blocks and takes no draft steps (a call of only such
        entries encodes too); without a cache row to keep them, it is not run at all.
        Raises: ValueError for a width that leaves no room in a stream (``width >=
        columns``), an entry past the position table (the worker drops those:
        :meth:`~remote_dspark.drafter.contract.DraftBatch.beyond`), or a sampled round's
        ``temperature`` or ``seed`` of the wrong shape, or a temperature that is not
        finite and >= 0 (:func:`sampling_rows`)."""
        n, width = len(batch), batch.width
        if n == 0:
            return empty_result(n, width, batch.want_margin)
        if width >= self.columns:
            raise ValueError(f"width {width}: no room in a stream of {self.columns} columns")
        if batch.beyond(self.max_positions).any():
            raise ValueError(f"an entry's context and {width} drafts pass the model's {self.max_positions} positions")
        if batch.sampled and not self.samples:
            raise ValueError(f"a sampled round: the model's vocabulary of {self.vocab_size} is under {TOP} ids")
        ctx_lens = context_lengths(batch)
        with self._lock, torch.inference_mode():
            hits = self.spec.take(batch, ctx_lens) if self.spec is not None else None
            if hits is None:
                return self._round(batch, ctx_lens)
            rest = ~hits.mask
            return hits.merged(self._round(batch.subset(rest), ctx_lens[rest]) if rest.any() else None)

    def _round(self, batch: DraftBatch, ctx_lens: np.ndarray) -> DraftResult:
        """:meth:`draft_batch` past its checks and hits, under the lock: the round run."""
        sampling = sampling_rows(batch, ctx_lens) if batch.sampled else None
        widths = np.where(batch.n_out > 0, batch.width, 0)  # an encode only takes no draft steps
        plan, cached = self._plan(batch, ctx_lens, widths)
        try:
            out, ran = self._draft(batch, plan, batch.width, sampling, widths, cached)
        except BaseException:
            if cached:
                self.cache.forget(plan.rows)
            raise
        if self.spec is not None and cached:
            self.spec.answered(batch, plan.rows, out, ran, self._rounds.kind(sampling))
        return round_result(batch, np.where(ran, ctx_lens, 0), out)

    def predraft(self, max_entries: int, max_tokens: int) -> int:
        """Pre-draft the likeliest outcomes of the streams answered last, in one call of at
        most ``max_entries`` outcomes and ``max_tokens`` tokens (:mod:`.speculate`; the
        contract's ``predraft``). Returns how many (0: none due; always, without
        ``speculate``)."""
        if self.spec is None:
            return 0
        with self._lock, torch.inference_mode():
            return self.spec.predraft(max_entries, max_tokens)

    def spec_info(self) -> SpecInfo | None:
        """The speculation cache's counts (:class:`~remote_dspark.drafter.contract.SpecInfo`);
        None without ``speculate``."""
        if self.spec is None:
            return None
        with self._lock:
            return self.spec.info()

    def _plan(self, batch: DraftBatch, ctx_lens: np.ndarray, widths: np.ndarray) -> tuple[Plan, bool]:
        """The round's plan (:mod:`.cache`) and whether its rows are the cache's."""
        starts, first, held = self._spans(batch, ctx_lens)
        if self.cache is not None and batch.slots is not None:
            sessions, slots, gens, lengths = self._streams(batch)
            return self.cache.plan(sessions, slots, gens, lengths, ctx_lens, first, widths, starts), True
        return uncached_plan(ctx_lens, held, widths, self.columns, starts), False

    def encodes(self, batch: DraftBatch) -> np.ndarray:
        """[n] int64: the tokens :meth:`draft_batch` would encode for each entry now (the
        contract's ``encodes``: the worker charges them in a call's budget): a stream's new
        tokens when its blocks hold the rest, else its re-encode (all the worker holds of
        it); none for an encode only (``n_out`` 0) that has no row to keep it. Nothing
        changes."""
        ctx_lens = context_lengths(batch)
        widths = np.where(batch.n_out > 0, batch.width, 0)
        starts, first, held = self._spans(batch, ctx_lens)
        if self.cache is None or batch.slots is None:
            return np.where(widths > 0, np.minimum(held, self.columns - widths), 0)
        _, slots, gens, lengths = self._streams(batch)
        sessions = batch.session if np.ndim(batch.session) == 0 else batch.sessions()
        with self._lock:
            return self.cache.encodes(sessions, slots, gens, lengths, ctx_lens, first, widths, starts)

    @staticmethod
    def _spans(batch: DraftBatch, ctx_lens: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """Each context's first position (an empty context's: 0, any valid one; None: a
        batch without positions, numbered from each row's start), each stream's first index
        the worker holds, and how many tokens of it it holds."""
        starts = None if batch.positions is None else np.where(ctx_lens > 0, batch.starts(), 0)
        first = kept(batch)
        held = ctx_lens if batch.lengths is None else np.asarray(batch.lengths, np.int64) - first
        return starts, first, held

    @staticmethod
    def _streams(batch: DraftBatch) -> tuple[np.ndarray, ...]:
        """The batch's stream fields as the cache takes them: sessions, slots, gens, lengths."""
        return (
            batch.sessions(),
            np.asarray(batch.slots, np.int64),
            np.asarray(batch.gens, np.int64),
            np.asarray(batch.lengths, np.int64),
        )

    def _draft(self, batch, plan: Plan, width: int, sampling, widths: np.ndarray, cached: bool):
        """The round's answer ([n, columns] float32, :meth:`.graphs.Rounds.run`) and which
        entries drafted ([n] bool): the drafting entries' ``width`` steps, and the others
        encoded with none (when ``cached``: a row keeps them). Each entry's stream is given
        the blocks it needs first; when the pool cannot hold the whole round at once it runs
        in waves, each as many entries as fit (:meth:`_wave`), and an entry let go for room
        (:meth:`_squeeze`) gets no drafts."""
        take = np.maximum(plan.take, 1)  # an empty context: one dummy token, no drafts counted
        tok = stream_window(batch, plan.take, int(take.max()))
        if tok.size and (int(tok.min()) < 0 or int(tok.max()) >= self.vocab_size):
            # An id the model lacks (an engine's larger vocabulary of the same tokenizer, or a
            # peer's garbage) is read as the model's last: never an index past its embeddings.
            tok = np.clip(tok, 0, self.vocab_size - 1)
        rows = plan.rows
        rowless = rows < 0
        if rowless.any():
            rows = rows.copy()
            rows[rowless] = self.store.scratch(int(rowless.sum()))
        need = plan.base + take + widths
        drafting = widths > 0
        pending = drafting | (plan.rows >= 0) if cached else drafting
        whole = bool(drafting.all())  # the common round: every entry drafts
        out = np.zeros((len(take), self._rounds.columns(width, sampling)), np.float32)
        sessions = batch.sessions()
        ran = drafting.copy()
        while pending.any():
            room = functools.partial(self._room, sessions=sessions, keep=rows[pending]) if cached else None
            granted, cells = self.store.grant(rows[pending], need[pending], room)
            if not granted.any():  # another engine's guarded streams and this round's hold the pool
                # scratch rows only: every block is free between waves, and the pool holds one whole stream
                assert cached, "an uncached round's wave found no block"
                dropped = self._squeeze(pending, rows, need, sessions)
                ran &= ~dropped
                pending &= ~dropped
                granted, cells = self.store.grant(rows[pending], need[pending])
            wave = pending.copy()
            wave[pending] = granted
            try:
                if whole and bool(wave.all()):  # the whole round at once: no entry picked out
                    return self._rounds.run(tok, plan.base, take, plan.origin, rows, width, sampling, cells), ran
                every = np.zeros(len(take), np.int64)
                every[pending] = cells
                self._wave(wave, tok, take, plan, rows, width, sampling, widths, every, out)
            finally:
                self.store.release(rows[wave & rowless])
            pending &= ~wave
        return out, ran

    def _room(self, short: int, sessions: np.ndarray, keep: np.ndarray, guard: bool = True) -> None:
        """``short`` more blocks free: every pre-draft's let go first, then streams evicted
        (:meth:`~.cache.SlotCache.make_room`)."""
        if self.spec is not None:
            short -= self.spec.reclaim()
        if short > 0:
            self.cache.make_room(short, sessions, keep, guard)

    def _squeeze(self, pending: np.ndarray, rows: np.ndarray, need: np.ndarray, sessions) -> np.ndarray:
        """Room for at least one of the ``pending`` entries when none fits (the cache's
        module docstring): other streams evicted without the guard, then, if this round's
        own streams still hold the pool, every pending entry but the first let go (its
        KV given back: re-encoded when next drafted). Returns the entries let go ([n]
        bool: no drafts this round)."""
        first = np.flatnonzero(pending)[:1]
        want = -(-need[first] // self.store.block) - self.store.held[rows[first]]
        self._room(int(want[0]) - self.store.n_free, sessions, rows[pending], guard=False)
        dropped = np.zeros(len(pending), bool)
        if self.store.n_free < int(want[0]):
            dropped[pending] = True
            dropped[first] = False
            gone = rows[dropped]
            self.cache.forget(gone[gone < self.cache.capacity])
            self.store.release(gone[gone >= self.cache.capacity])  # scratch rows
            self._room(int(want[0]) - self.store.n_free, sessions, rows[first], guard=False)
        return dropped

    def _wave(self, wave, tok, take, plan: Plan, rows, width, sampling, widths, cells, out) -> None:
        """The ``wave`` entries run: the encodes only, then the drafting entries (their
        answers into ``out``)."""
        for drafting in (False, True):
            which = wave & ((widths > 0) == drafting)
            if not which.any():
                continue
            part = None if sampling is None or not drafting else sampling[:, which]
            q = int(take[which].max())  # tokens are left-aligned: the entries' first q columns
            got = self._rounds.run(
                tok[which, :q],
                plan.base[which],
                take[which],
                plan.origin[which],
                rows[which],
                width if drafting else 0,
                part,
                cells[which],
            )
            if drafting:
                out[which] = got

    def greedy_one(self, context, n: int, start: int = 0) -> tuple[list[int], list[float]]:
        """The reference: ``n`` greedy tokens after ``context`` alone, its first token at
        position ``start`` (no padding, no cache; the whole sequence re-encoded per token)
        and their margins. Equal to
        :meth:`draft_batch` up to float rounding for contexts of at most ``columns -
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

"""The transformers drafter's rounds (:class:`HFDrafter`), with a KV cache per stream;
loading a model and its identity are :mod:`remote_dspark.drafter.lm.hf`.

The cache is the built-in model's (:mod:`remote_dspark.drafter.lm.cache`): one pool
``[cache_slots, layers, 2, kv_heads, max_tokens, head_dim]`` allocated at start, a row
per stream ``(session, slot, generation)``, the same plan (which rows hit, which
columns they keep, which tokens each entry encodes, each row's ``origin``: the true
position of its column 0). Only the model's side differs: transformers' attention layers
take their past through a cache object's ``update(keys, values, layer)``, so a round hands
the model :class:`RoundKV`, a working buffer it writes into and attends over, and an
explicit 4-D attention mask (transformers uses such a mask as given: no causal mask is
built). Nothing in the transformers version is checked; the model's cache interface is
probed once at start (:func:`probe_kv`): a model that does not take its past through
``update`` is refused, naming why.

One round, for its n entries at once (no Python loop over entries; the loops are over
draft steps):

1. the plan (numpy): a hit keeps its row's first ``base`` columns and encodes the tokens
   its slot gained since (its last one again when none), a miss encodes its context (the
   worker's window) from column 0;
2. the working buffer ``[layers, 2, n, kv_heads, P + Q + width - 1, head_dim]``: columns
   ``0..P-1`` the hit rows' kept columns (one gather from the pool; ``P`` the longest
   kept), ``P..P+Q-1`` the encoded tokens, left-aligned to column ``P + Q`` (``Q`` the
   most encoded), then one column per draft step. Every entry writes the same columns
   in a forward, which is all ``update`` has to know; the mask says which columns are an
   entry's (its kept ones, its encoded ones, its drafts) and that a query sees only
   columns up to its own. Each token is at its true position (``position_ids``:
   ``origin + column in its row``), so learned-position (GPT-2) and rotary (Llama,
   Qwen) models alike see what a fresh encode of the row's tokens would. A padding query
   sees only itself (never a whole row masked: no NaN), and no real query sees a padding
   column;
3. one forward over the encoded block, then ``width - 1`` greedy steps (one forward over
   all n entries each), the logits of the last column only where the model offers that
   (``logits_to_keep``);
4. the encoded columns written back to each entry's row (one scatter; draft columns are
   never kept) and one copy of tokens and margins to the host.

On CUDA the model and the pool are bf16, on the CPU float32.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

import numpy as np
import torch

from ..contract import CacheInfo, DraftBatch, DraftResult, empty_result
from .cache import Plan, SlotCache, row_tokens, uncached_plan
from .drafter import MARKOV_NONE, greedy_result, top2


@dataclasses.dataclass(frozen=True)
class KVShape:
    """What the model keeps per token and layer (found by :func:`probe_kv`)."""

    layers: int
    kv_heads: int
    head_dim: int


class RoundKV:
    """A round's working KV buffer, as transformers' attention layers use a cache: each
    layer's ``update`` writes the forward's keys and values at columns ``col..`` (the same
    columns for every entry) and attends over columns ``0..`` up to them.

    Args: ``buf`` [layers, 2, n, kv_heads, columns, head_dim], ``col`` the column the
    next forward writes at (:meth:`advance` moves it past a forward).
    """

    is_compileable = False

    def __init__(self, buf: torch.Tensor, col: int):
        self.buf, self.col = buf, col

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        end = self.col + key_states.shape[2]
        layer = self.buf[layer_idx]
        layer[0, :, :, self.col : end] = key_states
        layer[1, :, :, self.col : end] = value_states
        return layer[0, :, :, :end], layer[1, :, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.col

    def advance(self, tokens: int) -> None:
        self.col += tokens


class _Recorder:
    """A cache that only records what each layer stores (:func:`probe_kv`)."""

    is_compileable = False
    col = 0

    def __init__(self):
        self.seen: dict[int, tuple[int, ...]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.seen[layer_idx] = tuple(key_states.shape)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class Calling:
    """How this model's forward is called (its parameter names, probed)."""

    cache_arg: str  # ``cache`` (transformers 5) or ``past_key_values``
    keep_last: bool  # takes ``logits_to_keep``: logits of the last column only
    cache_position: bool  # takes ``cache_position`` (the columns written, one row for all)

    @classmethod
    def of(cls, model) -> Calling:
        params = inspect.signature(model.forward).parameters
        if "cache" not in params and "past_key_values" not in params:
            raise ValueError(f"{type(model).__name__}.forward takes no KV cache (cache or past_key_values)")
        cache_arg = "cache" if "cache" in params else "past_key_values"
        return cls(cache_arg, "logits_to_keep" in params, "cache_position" in params)

    def kwargs(self, kv: RoundKV | _Recorder, tokens: int, device: torch.device) -> dict:
        out = {self.cache_arg: kv, "use_cache": True}
        if self.keep_last:
            out["logits_to_keep"] = 1
        if self.cache_position:
            out["cache_position"] = torch.arange(kv.col, kv.col + tokens, device=device)
        return out


def probe_kv(model, calling: Calling, device: torch.device) -> KVShape:
    """One token through the model with a recording cache: every layer must store its
    keys through ``update``, all of one shape.

    Raises: ValueError naming what the model does otherwise."""
    rec = _Recorder()
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    mask = torch.zeros((1, 1, 1, 1), dtype=next(model.parameters()).dtype, device=device)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, position_ids=ids, **calling.kwargs(rec, 1, device))
    name = type(model).__name__
    if not rec.seen:
        raise ValueError(f"{name} keeps no keys through its cache's update(): not supported")
    shapes = {shape[1:] for shape in rec.seen.values()}
    if sorted(rec.seen) != list(range(len(rec.seen))) or len(shapes) != 1:
        raise ValueError(f"{name}: its layers keep keys of different shapes {sorted(shapes)}: not supported")
    (kv_heads, _, head_dim) = shapes.pop()
    return KVShape(len(rec.seen), kv_heads, head_dim)


def sliding_window_refusal(config, max_tokens: int) -> str | None:
    """Why a model whose attention slides is not served (None: it may be): the round's
    mask is full causal attention, exact only while a row fits the model's window."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    if window >= max_tokens:
        return None
    return f"its attention slides over {window} tokens, fewer than a cache row's {max_tokens}"


class HFDrafter:
    """Greedy drafting from a transformers causal LM, batched, with a KV cache per stream
    kept across rounds (module docstring).

    Args:
        model: the loaded model, on ``device``, in its working dtype.
        vocab_size, identity: what HELLO compares (:mod:`remote_dspark.drafter.lm.hf`).
        window: the worker's ``--window``.
        max_positions: the model's position table (None: unbounded).
        cache_slots: streams cached at most (the least recently used dropped beyond); 0:
            no cache, every round re-encodes every window through the same code.
        max_tokens: positions of a cache row (:func:`~remote_dspark.drafter.lm.cache.row_tokens`:
            ``2 * window + 16`` by default). ``max_width`` is ``max_tokens - window``.

    Raises: ValueError for rows that cannot hold a window and a draft, a model whose
        attention slides within a row, or one that keeps no cache through ``update``.
    """

    def __init__(
        self,
        model,
        *,
        vocab_size: int,
        identity: bytes,
        device: torch.device,
        window: int,
        max_positions: int | None,
        cache_slots: int = 1024,
        max_tokens: int | None = None,
    ):
        self.model, self.device = model, device
        self.vocab_size = vocab_size
        self.drafter_identity = identity
        self.markov_identity = MARKOV_NONE
        self.max_positions = max_positions  # an entry past them gets no drafts (the worker's rule)
        self.max_tokens = row_tokens(window, max_positions, max_tokens)
        self.max_width = self.max_tokens - window  # the widest round a row holds beside a window
        if cache_slots < 0:
            raise ValueError(f"cache_slots {cache_slots}: must be >= 0")
        why = sliding_window_refusal(model.config, self.max_tokens)
        if why is not None:
            raise ValueError(f"{type(model).__name__}: {why}")
        self.dtype = next(model.parameters()).dtype
        self._calling = Calling.of(model)
        self.kv = probe_kv(model, self._calling, device)
        k = self.kv
        self.cache = (
            SlotCache(cache_slots, k.layers, k.kv_heads, k.head_dim, self.max_tokens, device, self.dtype)
            if cache_slots
            else None
        )
        self._lock = threading.Lock()  # the worker's connection threads share one drafter
        self._window = window

    def sibling(self, cache_slots: int, max_tokens: int | None = None) -> HFDrafter:
        """A drafter of the same model (shared, not copied) with a cache of its own."""
        return HFDrafter(
            self.model,
            vocab_size=self.vocab_size,
            identity=self.drafter_identity,
            device=self.device,
            window=self._window,
            max_positions=self.max_positions,
            cache_slots=cache_slots,
            max_tokens=max_tokens,
        )

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return self.cache.info() if self.cache is not None else CacheInfo(0, 0, 0, 0, 0)

    def draft_batch(self, batch: DraftBatch) -> DraftResult:
        """Drafts for every entry, each context at its true positions.

        Raises: ValueError for a width a row cannot hold (``width >= max_tokens``) or an
        entry past the position table (the worker drops those:
        :meth:`~remote_dspark.drafter.contract.DraftBatch.beyond`)."""
        n, width = len(batch), batch.width
        if n == 0 or width == 0:
            return empty_result(n, width, batch.want_margin)
        if width >= self.max_tokens:
            raise ValueError(f"width {width}: no room in a {self.max_tokens}-token row (max_tokens)")
        if batch.beyond(self.max_positions).any():
            raise ValueError(f"an entry's context and {width} drafts pass the model's {self.max_positions} positions")
        ctx_lens = np.diff(batch.offsets).astype(np.int64)
        starts = None if batch.positions is None else np.where(ctx_lens > 0, batch.starts(), 0)
        cached = self.cache is not None and batch.slots is not None
        with self._lock, torch.inference_mode():
            if cached:
                plan = self.cache.plan(
                    batch.session,
                    np.asarray(batch.slots, np.int64),
                    np.asarray(batch.gens, np.int64),
                    np.asarray(batch.lengths, np.int64),
                    ctx_lens,
                    width,
                    starts,
                )
            else:
                plan = uncached_plan(ctx_lens, width, self.max_tokens, starts)
            try:
                out = self._round(batch, plan, ctx_lens > 0, width)
            except BaseException:
                if cached:
                    self.cache.forget(plan.rows)
                raise
        return greedy_result(batch, ctx_lens, out[:, :width].astype(np.int32), out[:, width:])

    def _round(self, batch: DraftBatch, plan: Plan, has_ctx: np.ndarray, width: int) -> np.ndarray:
        """[n, 2 * width] float32: each entry's drafts, then their margins (module docstring)."""
        n = len(plan.take)
        take = np.maximum(plan.take, 1)  # an empty context: one dummy token, no drafts counted
        hit_e = np.flatnonzero(plan.hit)
        kept = np.where(plan.hit, plan.base, 0)
        p, q = int(kept.max()), int(take.max())
        cols = p + q + width - 1
        # The encoded block, right-aligned at column p + q: entry i's j-th token of ``take``
        # at column p + q - take + j, at position origin + base + j (padding: base's).
        j = np.arange(q) - (q - take)[:, None]
        real = j >= 0
        src = batch.tokens if len(batch.tokens) else np.zeros(1, np.int32)
        tok = np.where(real, src[np.clip(batch.offsets[1:, None] - take[:, None] + j, 0, len(src) - 1)], 0)
        pos = plan.origin[:, None] + plan.base[:, None] + np.maximum(j, 0)
        mine = np.concatenate([np.arange(p) < kept[:, None], real, np.ones((n, width - 1), bool)], 1)
        back_e = np.flatnonzero((plan.rows >= 0) & has_ctx)
        moved = np.repeat(back_e, take[back_e])  # entry of each encoded column kept in a row
        nth = np.arange(len(moved)) - np.repeat(np.cumsum(take[back_e]) - take[back_e], take[back_e])
        parts = [tok, pos, mine, hit_e, plan.rows[hit_e], moved, plan.rows[moved], p + q - take[moved] + nth]
        parts.append(plan.base[moved] + nth)
        ints = torch.from_numpy(np.concatenate([np.ravel(a) for a in parts]).astype(np.int64)).to(self.device)
        tok_d, pos_d, mine_d, hit_d, hit_rows, moved_d, moved_rows, from_col, to_col = torch.split(
            ints, [np.size(a) for a in parts]
        )  # the one copy in
        tok_d, pos_d, mine_d = tok_d.view(n, q), pos_d.view(n, q), mine_d.view(n, cols).bool()
        k = self.kv
        buf = torch.zeros((k.layers, 2, n, k.kv_heads, cols, k.head_dim), device=self.device, dtype=self.dtype)
        pool = self.cache.pool if self.cache is not None else None
        if len(hit_e):  # the kept columns of every hit row: one gather
            buf[:, :, hit_d, :, :p] = pool[hit_rows, :, :, :, :p].permute(1, 2, 0, 3, 4, 5)
        kv = RoundKV(buf, p)
        # query column c sees the entry's columns up to c; a padding query sees itself
        keys = torch.arange(p + q, device=self.device)
        queries = keys[p:, None]
        allowed = (mine_d[:, None, None, : p + q] & (keys <= queries)) | (keys == queries)
        token, margin = self._step(tok_d, pos_d, allowed, kv)
        tokens, margins = [token], [margin]
        last = pos_d[:, -1:]
        for s in range(1, width):  # one batched forward per draft step
            last = last + 1
            token, margin = self._step(token[:, None], last, mine_d[:, None, None, : p + q + s], kv)
            tokens.append(token)
            margins.append(margin)
        if len(moved):  # the encoded columns into their rows: one scatter
            pool[moved_rows, :, :, :, to_col] = buf[:, :, moved_d, :, from_col]
        return torch.cat([torch.stack(tokens, 1).float(), torch.stack(margins, 1)], 1).cpu().numpy()  # one out

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, kv: RoundKV):
        """One forward of ``tokens`` [n, s] at ``positions`` through ``kv`` (written at its
        column), ``allowed`` [n, 1, s, columns] the keys each query sees; the greedy token
        and margin after each entry's last query."""
        mask = torch.zeros(allowed.shape, device=self.device, dtype=self.dtype)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)  # additive: eager and sdpa alike
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            **self._calling.kwargs(kv, tokens.shape[1], self.device),
        )
        kv.advance(tokens.shape[1])
        return top2(out.logits[:, -1, : self.vocab_size])

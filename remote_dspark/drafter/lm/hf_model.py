"""A transformers causal LM as the model drafter drives its built-in model.

:class:`~remote_dspark.drafter.lm.drafter.LMDrafter` needs of its model what
:class:`~remote_dspark.drafter.lm.model.TinyLM` offers: ``forward_kv`` (queries at given
columns of their streams in the KV pool, :class:`~remote_dspark.drafter.lm.attention.Pages`,
each query's keys and values written at its slot ``at`` first, a stream's column c at
absolute position ``origin[i] + c``), ``logits`` over final hidden states, a plain
``forward`` (the reference), ``identity()`` and a ``config`` naming its shape.
:class:`HFModel` gives a transformers model those, so the cache per stream, the round's
plan, its one copy in and out and its CUDA graphs are the built-in model's, one code for
both.

How: transformers' attention layers take their past through a cache object's
``update(keys, values, layer)`` and hand what it returns to the attention function
registered under the model's ``attn_implementation``. :class:`ColumnKV` is that cache
over the pool: ``update`` writes each query's keys and values into its stream's block at
its own column (one indexed write per layer) and returns the layer's view of the whole
pool; :func:`attend`, registered with transformers' ``AttentionInterface`` and made the
model's attention, reads each stream's blocks in place (the drafter's own
:func:`~remote_dspark.drafter.lm.attention.paged_attention`, the built-in model's too).
``position_ids`` are each token's true position. Learned (GPT-2) and rotary (Llama,
Qwen) positions alike then see what a fresh encode of the stream's tokens sees; rotary
keys are kept rotated at their true positions, which stay true. The model is given a 4-D
mask of one column (transformers takes a 4-D mask as given and builds none; the pool's
attention applies the causal rule itself).

Nothing in the transformers version is checked. The base model's ``forward`` parameters
name the cache argument (``cache``, or ``past_key_values`` before transformers 5), and one
token through a recording cache at load (:func:`probe_kv`) gives the store's shape
(layers, KV heads, head size: grouped-query models keep fewer heads than they attend
with) and refuses a model that keeps no keys through ``update``, keys of different
shapes per layer, or a layer that does not attend through the registered function. A
model whose attention slides over fewer tokens than a stream holds is refused (the
pool's attention is full causal attention). The head is the model's output embeddings
applied to the hidden states the drafter picks; a model whose forward scales or caps its
logits after the head (a monotonic change) drafts the same tokens with other margins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading

import torch
from torch import nn

from .attention import Pages, paged_attention

ATTENTION = "remote_dspark_rows"  # the name under which transformers finds :func:`attend`
_round = threading.local()  # the round being encoded on this thread: its rows and columns


def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention function for a drafter's model: within a round
    (:meth:`HFModel.forward_kv`) the queries attend to their streams' blocks in place
    (:func:`~remote_dspark.drafter.lm.attention.paged_attention`); outside one (the
    reference forward) transformers' own SDPA attention.

    Raises: ValueError for what the rows' attention does not do (soft-capped logits, a
    position bias)."""
    rows = getattr(_round, "rows", None)
    if rows is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    for name in ("softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__}: its attention takes a {name}: not supported")
    _round.layers += 1
    return paged_attention(query, key, value, _round.table, rows, _round.positions, scaling).transpose(1, 2), None


def use_rows_attention(model: nn.Module) -> None:
    """Make :func:`attend` ``model``'s attention (registered with transformers once; the
    reference forward's masks are SDPA's).

    Raises: ValueError for a model that does not take its attention from transformers'
    attention interface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, attend)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    if model.config._attn_implementation != ATTENTION:
        raise ValueError(f"{type(model).__name__} does not take its attention from transformers' AttentionInterface")


@contextlib.contextmanager
def _rows(table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor):
    _round.table, _round.rows, _round.positions, _round.layers = table, rows, positions, 0
    try:
        yield _round
    finally:
        _round.table = _round.rows = _round.positions = None


@dataclasses.dataclass(frozen=True)
class KVConfig:
    """A model's shape as the drafter reads it (the names of
    :class:`~remote_dspark.drafter.lm.model.LMConfig`)."""

    vocab_size: int
    max_positions: int | None  # its position table (None: rotary with no bound)
    n_layers: int
    n_heads: int  # heads of keys and values: what a cache row keeps
    head_dim: int


class ColumnKV:
    """The drafter's KV pool (:class:`~remote_dspark.drafter.lm.attention.Pages`) as
    transformers' layers use a cache: entry i's queries' keys and values land in its
    stream's blocks at ``blocks``, ``offsets [n, Q]`` (found on the host in its block table), and
    :func:`attend` reads the blocks in place."""

    is_compileable = False

    def __init__(self, pages: Pages, blocks: torch.Tensor, offsets: torch.Tensor):
        self.pages, self.blocks, self.offsets = pages, blocks, offsets

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.pages.write(layer_idx, self.blocks, self.offsets, key_states, value_states)
        return self.pages.layer(layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # only asked by a model given no position_ids; these always are


class _Recorder:
    """A cache that only records the keys' shape of each layer (:func:`probe_kv`)."""

    is_compileable = False

    def __init__(self):
        self.seen: dict[int, tuple[int, ...]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.seen[layer_idx] = tuple(key_states.shape)
        # a pool of one block of one token for :func:`attend` ([blocks, kv_heads, 1, head_dim])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def cache_arg_of(base: nn.Module) -> str:
    """The name under which ``base.forward`` takes its KV cache.

    Raises: ValueError for a model that takes none."""
    params = inspect.signature(base.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise ValueError(f"{type(base).__name__}.forward takes no KV cache (cache or past_key_values): not supported")


def probe_kv(base: nn.Module, cache_arg: str) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of ``base``, from one token through a recording cache,
    its attention through :func:`attend` (:func:`use_rows_attention`) on a row of its own.

    Raises: ValueError naming what the model does otherwise."""
    rec = _Recorder()
    p = next(base.parameters())
    ids = torch.zeros((1, 1), dtype=torch.long, device=p.device)
    mask = torch.zeros((1, 1, 1, 1), dtype=p.dtype, device=p.device)
    with torch.inference_mode(), _rows(ids, ids[0], ids) as seen:
        base(input_ids=ids, attention_mask=mask, position_ids=ids, use_cache=True, **{cache_arg: rec})
    name = type(base).__name__
    shapes = {shape[1:] for shape in rec.seen.values()}
    if not rec.seen:
        raise ValueError(f"{name} keeps no keys through its cache's update(): not supported")
    if sorted(rec.seen) != list(range(len(rec.seen))) or len(shapes) != 1:
        raise ValueError(f"{name}: its layers keep keys of different shapes {sorted(shapes)}: not supported")
    if seen.layers != len(rec.seen):
        raise ValueError(f"{name}: {seen.layers} of its {len(rec.seen)} layers attend through AttentionInterface")
    kv_heads, _, head_dim = shapes.pop()
    return len(rec.seen), kv_heads, head_dim


def sliding_window_refusal(config, context: int) -> str | None:
    """Why a model whose attention slides cannot draft from streams of ``context`` tokens (None:
    it can): the round's mask is full causal attention, exact only within the window."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False or window >= context:
        return None
    return f"its attention slides over {window} tokens, fewer than a stream's {context} (--max-context)"


HEAD_ROWS = 64  # the head's output rows are padded to a multiple (GEMM kernels want aligned rows)


def aligned_head(head: nn.Module) -> nn.Module:
    """``head``, or for a linear head whose output rows are not a multiple of HEAD_ROWS
    (GPT-2's 50,257) a copy padded with zero rows: a GPU's fast GEMM kernels need the
    output's rows aligned, and a 50,257-wide head runs several times slower than a
    50,304-wide one. The padded logits are past the vocabulary, never read. (A tied
    head's copy is no longer tied; the drafter never trains.)"""
    if not isinstance(head, nn.Linear) or head.out_features % HEAD_ROWS == 0:
        return head
    rows = -(-head.out_features // HEAD_ROWS) * HEAD_ROWS
    padded = nn.Linear(head.in_features, rows, bias=head.bias is not None, device=head.weight.device)
    with torch.no_grad():
        padded.weight.zero_()[: head.out_features] = head.weight
        if head.bias is not None:
            padded.bias.zero_()[: head.out_features] = head.bias
    return padded.to(head.weight.dtype)


class HFModel(nn.Module):
    """A transformers causal LM with the built-in model's interface (module docstring).

    Args: the loaded model, its drafter identity, the vocabulary HELLO compares
    (``config.vocab_size``) and its position table (None: unbounded).
    """

    def __init__(self, model: nn.Module, identity: bytes, vocab_size: int, max_positions: int | None):
        super().__init__()
        self.lm = model
        self.base = model.base_model
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (a language-model head)")
        self.head = aligned_head(head)
        self._identity = identity
        self._cache_arg = cache_arg_of(self.base)
        use_rows_attention(model)
        layers, kv_heads, head_dim = probe_kv(self.base, self._cache_arg)
        self.config = KVConfig(vocab_size, max_positions, layers, kv_heads, head_dim)

    def identity(self) -> bytes:
        return self._identity

    def forward_kv(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pages: Pages,
        rows: torch.Tensor,
        at: tuple[torch.Tensor, torch.Tensor],
        origin: torch.Tensor,
    ) -> torch.Tensor:
        """As :meth:`~remote_dspark.drafter.lm.model.TinyLM.forward_kv`: ``tokens`` [n, Q]
        at columns ``positions`` (absolute ``origin + positions``) of their streams' table
        rows ``rows`` of the pool ``pages``, written at the blocks and offsets ``at`` (the
        trash block for padding). Returns the final hidden states [n, Q, d_model]."""
        # The rows' attention ignores the mask; transformers takes a 4-D one as given and
        # builds none (one column: a whole stream's would be n x Q x columns).
        mask = torch.zeros((tokens.shape[0], 1, tokens.shape[1], 1), device=tokens.device, dtype=pages.kv.dtype)
        with _rows(pages.table, rows, positions):
            out = self.base(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions + origin[:, None],
                use_cache=True,
                **{self._cache_arg: ColumnKV(pages, *at)},
            )
        return out[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head over final hidden states, in the model's dtype, the engine's vocabulary
        only (a view of the padded head's rows, :func:`aligned_head`)."""
        return self.head(h)[..., : self.config.vocab_size]

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """[n, S] tokens at positions start..start+S-1 -> [n, S, vocab] float32 logits (the
        model's own forward, no cache: the reference)."""
        pos = torch.arange(start, start + tokens.shape[1], device=tokens.device).expand_as(tokens)
        return (
            self.lm(input_ids=tokens, position_ids=pos, use_cache=False).logits[..., : self.config.vocab_size].float()
        )

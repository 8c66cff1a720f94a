"""A transformers causal LM as the model drafter drives its built-in model.

:class:`~remote_dspark.drafter.lm.drafter.LMDrafter` needs of its model what
:class:`~remote_dspark.drafter.lm.model.TinyLM` offers: ``forward_kv`` (queries at given
columns against an external KV buffer ``[n, layers, 2, kv_heads, T, head_dim]``, each
query's keys and values written at its ``write_pos`` first, row i's column c at absolute
position ``origin[i] + c``), ``logits`` over final hidden states, a plain ``forward``
(the reference), ``identity()`` and a ``config`` naming its shape. :class:`HFModel` gives
a transformers model those, so the cache per stream, the round's plan, its one copy in
and out and its CUDA graphs are the built-in model's, one code for both.

How: transformers' attention layers take their past through a cache object's
``update(keys, values, layer)`` and attend over what it returns, and they take an
explicit 4-D attention mask as given (no causal mask is built). :class:`ColumnKV` is that
cache over the drafter's buffer: ``update`` writes each query's keys and values at its own
column (one scatter along the columns per layer) and returns the layer's whole buffer; the mask lets a
query see its row's columns up to its own, never the trash column (where padding
writes); ``position_ids`` are each token's true position. Learned (GPT-2) and rotary
(Llama, Qwen) positions alike then see what a fresh encode of the row's tokens sees;
rotary keys are kept rotated at their true positions, which stay true.

Nothing in the transformers version is checked. The base model's ``forward`` parameters
name the cache argument (``cache``, or ``past_key_values`` before transformers 5), and one
token through a recording cache at load (:func:`probe_kv`) gives the pool's shape (layers,
KV heads, head size: grouped-query models keep fewer heads than they attend with) and
refuses a model that keeps no keys through ``update`` or keys of different shapes per
layer. A model whose attention slides over fewer tokens than a cache row holds is
refused (the mask is full causal attention). The head is the model's output embeddings
applied to the hidden states the drafter picks; a model whose forward scales or caps its
logits after the head (a monotonic change) drafts the same tokens with other margins.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from .model import visible_keys


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
    """The drafter's KV buffer ``[n, layers, 2, kv_heads, T, head_dim]`` as transformers'
    layers use a cache: each query's keys and values land at its column ``write_pos``
    ``[n, Q]``, and every layer attends over its whole buffer (the mask says what)."""

    is_compileable = False

    def __init__(self, kv: torch.Tensor, write_pos: torch.Tensor):
        self.kv = kv
        n, _, _, heads, _, head_dim = kv.shape
        # each query's column, for every head and channel: one scatter along the columns
        self.index = write_pos[:, None, :, None].expand(n, heads, write_pos.shape[1], head_dim)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.kv[:, layer_idx, 0], self.kv[:, layer_idx, 1]  # views [n, kv_heads, T, head_dim]
        keys.scatter_(2, self.index, key_states.to(keys.dtype))
        values.scatter_(2, self.index, value_states.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # only asked by a model given no position_ids; these always are


class _Recorder:
    """A cache that only records the keys' shape of each layer (:func:`probe_kv`)."""

    is_compileable = False

    def __init__(self):
        self.seen: dict[int, tuple[int, ...]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.seen[layer_idx] = tuple(key_states.shape)
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
    """(layers, KV heads, head size) of ``base``, from one token through a recording cache.

    Raises: ValueError naming what the model does otherwise."""
    rec = _Recorder()
    p = next(base.parameters())
    ids = torch.zeros((1, 1), dtype=torch.long, device=p.device)
    mask = torch.zeros((1, 1, 1, 1), dtype=p.dtype, device=p.device)
    with torch.inference_mode():
        base(input_ids=ids, attention_mask=mask, position_ids=ids, use_cache=True, **{cache_arg: rec})
    name = type(base).__name__
    shapes = {shape[1:] for shape in rec.seen.values()}
    if not rec.seen:
        raise ValueError(f"{name} keeps no keys through its cache's update(): not supported")
    if sorted(rec.seen) != list(range(len(rec.seen))) or len(shapes) != 1:
        raise ValueError(f"{name}: its layers keep keys of different shapes {sorted(shapes)}: not supported")
    kv_heads, _, head_dim = shapes.pop()
    return len(rec.seen), kv_heads, head_dim


def sliding_window_refusal(config, row_tokens: int) -> str | None:
    """Why a model whose attention slides cannot draft from rows of ``row_tokens`` (None:
    it can): the round's mask is full causal attention, exact only within the window."""
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False or window >= row_tokens:
        return None
    return f"its attention slides over {window} tokens, fewer than a cache row's {row_tokens} (--lm-row-tokens)"


class HFModel(nn.Module):
    """A transformers causal LM with the built-in model's interface (module docstring).

    Args: the loaded model, its drafter identity, the vocabulary HELLO compares
    (``config.vocab_size``) and its position table (None: unbounded).
    """

    def __init__(self, model: nn.Module, identity: bytes, vocab_size: int, max_positions: int | None):
        super().__init__()
        self.lm = model
        self.base = model.base_model
        self.head = model.get_output_embeddings()
        if self.head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (a language-model head)")
        self._identity = identity
        self._cache_arg = cache_arg_of(self.base)
        layers, kv_heads, head_dim = probe_kv(self.base, self._cache_arg)
        self.config = KVConfig(vocab_size, max_positions, layers, kv_heads, head_dim)

    def identity(self) -> bytes:
        return self._identity

    def forward_kv(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        write_pos: torch.Tensor,
        origin: torch.Tensor,
    ) -> torch.Tensor:
        """As :meth:`~remote_dspark.drafter.lm.model.TinyLM.forward_kv`: ``tokens`` [n, Q]
        at columns ``positions`` (absolute ``origin + positions``) against ``kv``, written at
        ``write_pos`` (the last column, the trash, for padding). Returns the final hidden
        states [n, Q, d_model]."""
        allowed = visible_keys(positions, kv.shape[4])
        dtype = kv.dtype
        mask = torch.zeros(allowed.shape, device=tokens.device, dtype=dtype).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )  # additive: eager and sdpa attention alike
        out = self.base(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions + origin[:, None],
            use_cache=True,
            **{self._cache_arg: ColumnKV(kv, write_pos)},
        )
        return out[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head over final hidden states, float32, the engine's vocabulary only."""
        return self.head(h)[..., : self.config.vocab_size].float()

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """[n, S] tokens at positions start..start+S-1 -> [n, S, vocab] float32 logits (the
        model's own forward, no cache: the reference)."""
        pos = torch.arange(start, start + tokens.shape[1], device=tokens.device).expand_as(tokens)
        return (
            self.lm(input_ids=tokens, position_ids=pos, use_cache=False).logits[..., : self.config.vocab_size].float()
        )

"""A tiny decoder-only transformer in plain torch: the worker's built-in model drafter.

Seeded and initialised in code (nothing is downloaded): vocabulary 128 (the demo's
synthetic language, :class:`remote_dspark.drafter.markov.SyntheticLanguage`), learned absolute
positions, pre-norm blocks, the head tied to the embedding. Its weights are random, so
its drafts are a mechanism to measure, not predictions; a trained model of the same
shape drafts through the same code.

Two forwards over the same weights:

* :meth:`TinyLM.forward`: plain causal attention over whole sequences from a given
  absolute position (the reference,
  :meth:`remote_dspark.drafter.lm.drafter.LMDrafter.greedy_one`);
* :meth:`TinyLM.forward_kv`: queries at given columns of their streams in the drafter's
  KV pool (:class:`~remote_dspark.drafter.lm.pool.KVStore`: blocks named by a block
  table). Each query's K and V are written at its slot (``at``: block and offset) first (padding writes go
  to the trash block), then it attends to its stream's keys at columns <= its own, in
  place (:func:`~remote_dspark.drafter.lm.attention.paged_attention`). A stream's column
  c holds the token at absolute position ``origin + c`` (its learned position
  embedding; attention itself is position-free), so a stream keeps its tokens' true
  positions.

The drafter identity is the sha256 of the configuration (JSON, sorted keys) and every
parameter's float32 CPU bytes in name order (:meth:`TinyLM.identity`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .attention import Pages, paged_attention


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    max_positions: int = 512  # learned positions 0..max_positions-1
    seed: int = 0  # the in-code initialisation
    init_std: float = 0.5  # embedding scale: logits spread enough for clear greedy choices

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"LMConfig {name} {getattr(self, name)}: must be >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"LMConfig d_model {self.d_model}: not a multiple of n_heads {self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Block(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.heads, self.head_dim = c.n_heads, c.head_dim
        self.ln1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln2 = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.d_ff)
        self.fc2 = nn.Linear(c.d_ff, c.d_model)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v  # each [n, heads, s, head_dim]

    def _out(self, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        n, _, s, _ = att.shape
        x = x + self.proj(att.transpose(1, 2).reshape(n, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        return self._out(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def forward_kv(self, x: torch.Tensor, pages: Pages, layer: int, rows, positions, blocks, offsets) -> torch.Tensor:
        """This layer over the pool: each query's K and V written at ``blocks``,
        ``offsets`` (found on the host in the block table), then its attention over its row's blocks."""
        q, k, v = self._qkv(x)
        pages.write(layer, blocks, offsets, k, v)
        keys, values = pages.layer(layer)
        return self._out(x, paged_attention(q, keys, values, pages.table, rows, positions))


class TinyLM(nn.Module):
    def __init__(self, config: LMConfig | None = None):
        super().__init__()
        c = self.config = config or LMConfig()
        gen = torch.Generator().manual_seed(c.seed)
        self.emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos = nn.Embedding(c.max_positions, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model)
        with torch.no_grad():  # seeded, whatever torch's global generator holds
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() == 1:  # LayerNorm scales
                    p.fill_(1.0)
                elif name in ("emb.weight", "pos.weight"):
                    p.normal_(0.0, c.init_std if name == "emb.weight" else 0.5, generator=gen)
                else:
                    p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
        self.eval()

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens) + self.pos(positions)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Head over final hidden states (already normalised), in the model's dtype."""
        return h @ self.emb.weight.T

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """[n, S] tokens at positions start..start+S-1 -> [n, S, vocab] float32 logits (no cache)."""
        x = self._embed(tokens, torch.arange(start, start + tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.logits(self.ln_f(x)).float()

    def forward_kv(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pages: Pages,
        rows: torch.Tensor,
        at: tuple[torch.Tensor, torch.Tensor],
        origin: torch.Tensor,
    ) -> torch.Tensor:
        """[n, Q] tokens at columns ``positions`` of their streams' table rows ``rows`` [n]
        of the pool ``pages`` (:class:`~remote_dspark.drafter.lm.attention.Pages`), row
        i's column c at absolute position ``origin[i] + c``; each query's K/V land at its
        block and offset ``at`` ([n, Q] each, its write column in the block table: the
        trash block for padding). Returns the final hidden states [n, Q, d_model]
        (normalised: :meth:`logits`)."""
        x = self._embed(tokens, positions + origin[:, None])
        for layer, block in enumerate(self.blocks):
            x = block.forward_kv(x, pages, layer, rows, positions, *at)
        return self.ln_f(x)

    def identity(self) -> bytes:
        """sha256 of the configuration and the weights (float32 CPU bytes, name order)."""
        h = hashlib.sha256(b"remote-dspark tiny lm v1\0")
        h.update(json.dumps(asdict(self.config), sort_keys=True).encode())
        for name, p in sorted(self.state_dict().items()):
            t = p.detach().to("cpu", torch.float32).contiguous()
            h.update(f"\0{name}:{tuple(t.shape)}\0".encode())
            h.update(t.numpy().tobytes())
        return h.digest()

"""The model drafter's draft steps as CUDA graphs: one replay instead of ~35 kernel launches
per step.

A round's draft steps after the first are the same work whatever the round holds: one
token per entry in, a forward over the working KV buffer, the greedy token and its margin
out. On a GPU their cost is the launches (a tiny model's kernels take microseconds, and
eager PyTorch spends about as long on each launch), so they are captured once per (rows,
width) and replayed. Their shapes must then be fixed: the working buffer is a static one
per row bucket (the round's entry count rounded up to a power of two, at least
``MIN_ROWS``), ``max_tokens + 1`` positions wide (the last one the padding's trash
column); the rows past the round's entries run too, on token 0 at position 0, and their
outputs are never read.

A graph is captured before the round that first needs it touches the buffer (the capture
runs the steps on whatever the buffer holds), so a capture never clobbers live K/V.

On the CPU (``capture`` False: tests) the same static buffers are used and the steps run
eagerly, so the buffer's rules (stale positions are never read) are checked without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MIN_ROWS = 16


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy token and its softmax margin (top1 - top2, float32) per row."""
    top = torch.softmax(logits.float(), -1).topk(2, dim=-1)
    return top.indices[:, 0], top.values[:, 0] - top.values[:, 1]


def draft_steps(model, token: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor, steps: int):
    """``steps`` greedy steps after ``token`` [n] at ``pos`` [n, 1]: each step's K/V written
    into ``kv`` at its position. Returns (tokens [n, steps], margins [n, steps])."""
    if steps < 1:
        return token.new_zeros((len(token), 0)), torch.zeros((len(token), 0), device=token.device)
    toks, margins = [], []
    for _ in range(steps):
        token, margin = top2(model.logits(model.forward_kv(token[:, None], pos, kv, pos)[:, 0]))
        toks.append(token)
        margins.append(margin)
        pos = pos + 1
    return torch.stack(toks, 1), torch.stack(margins, 1)


@dataclass
class Bucket:
    """The static tensors of one row bucket, and its graphs by width."""

    kv: torch.Tensor  # [rows, layers, 2, heads, max_tokens + 1, head_dim]
    token: torch.Tensor  # [rows] the first draft (from the eager prefill)
    pos: torch.Tensor  # [rows, 1] its position
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class DecodeGraphs:
    """Owned by one drafter, used under its lock."""

    def __init__(self, model, kv_shape: tuple[int, ...], positions: int, head_dim: int, device, dtype):
        self.model, self.kv_shape, self.positions, self.head_dim = model, kv_shape, positions, head_dim
        self.device, self.dtype = device, dtype
        self.buckets: dict[int, Bucket] = {}
        self.capture = torch.device(device).type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def nbytes(self) -> int:
        """The static buffers' memory (the graphs' own intermediates not counted)."""
        return sum(t.numel() * t.element_size() for b in self.buckets.values() for t in (b.kv, b.token, b.pos))

    def bucket(self, n: int) -> Bucket:
        rows = max(MIN_ROWS, 1 << (n - 1).bit_length())
        b = self.buckets.get(rows)
        if b is None:
            kv = torch.zeros(
                (rows, *self.kv_shape, self.positions, self.head_dim), device=self.device, dtype=self.dtype
            )
            b = self.buckets[rows] = Bucket(
                kv,
                torch.zeros(rows, dtype=torch.long, device=self.device),
                torch.zeros((rows, 1), dtype=torch.long, device=self.device),
            )
        return b

    def prepare(self, b: Bucket, width: int) -> None:
        """Capture ``b``'s graph of ``width - 1`` steps if it has none: before the round
        writes into ``b.kv``."""
        steps = width - 1
        if not self.capture or steps < 1 or steps in b.graphs:
            return
        b.token.zero_()
        b.pos.zero_()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the capture (lazy inits, autotuning)
            draft_steps(self.model, b.token, b.pos, b.kv, steps)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            toks, margins = draft_steps(self.model, b.token, b.pos, b.kv, steps)
        b.graphs[steps] = (graph, toks, margins)

    def replay(self, b: Bucket, n: int, token: torch.Tensor, pos: torch.Tensor, width: int):
        """The steps after ``token`` [n] at ``pos`` [n, 1] for the round's n entries (rows
        past n: token 0 at position 0). Returns (tokens [n, width - 1], margins)."""
        b.token[:n] = token
        b.token[n:] = 0
        b.pos[:n] = pos
        b.pos[n:] = 0
        if not self.capture:
            toks, margins = draft_steps(self.model, b.token, b.pos, b.kv, width - 1)
            return toks[:n], margins[:n]
        graph, toks, margins = b.graphs[width - 1]
        graph.replay()
        return toks[:n], margins[:n]

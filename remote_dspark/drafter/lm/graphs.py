"""The model drafter's round as a CUDA graph: one replay instead of ~200 kernel launches.

A tiny model's kernels take microseconds, and eager PyTorch spends about as long on each
launch, so on a GPU a round's cost is its launches: the prefill (~35) and ``width - 1``
draft steps (~35 each). The whole round, prefill and steps, is captured once per shape
and replayed. Its shapes must then be fixed:

* rows: the round's entry count rounded up to a power of two (at least ``MIN_ROWS``);
  the rows past the round's entries encode token 0 at position 0 and are never read;
* queries: the most tokens an entry encodes, rounded up to a power of two (at least
  ``MIN_QUERIES``: a steady round encodes the few tokens accepted since the last one);
  padding queries sit at column 0 and write their K/V to the trash column;
* the working KV buffer: one per row bucket, ``max_tokens + 1`` positions wide (the last
  one the trash column). What it holds from earlier rounds past an entry's positions is
  masked and never read, so it is never cleared.

A round's integers (padded tokens, positions, write positions, each row's last query,
and the pool rows to gather and write back) go up in one copy; around the replay only
the pool's gather and write-back and the copy of the answer down run eagerly. Graphs
are captured before the round that first needs them writes the buffer (a capture runs
the round on whatever the buffer holds), and only up to ``MAX_CAPTURED_TOKENS`` rows x
queries (a larger shape, rare, runs the same code eagerly).

On the CPU (no capture) the same buffers and code run eagerly (``LMDrafter(graphs=True)``:
the tests), so the buffer's rules are checked without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

MIN_ROWS = 16
MIN_QUERIES = 4
MAX_CAPTURED_TOKENS = 1 << 16  # rows x queries of the largest graph kept


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy token and its softmax margin (top1 - top2, float32) per row."""
    top = torch.softmax(logits.float(), -1).topk(2, dim=-1)
    return top.indices[:, 0], top.values[:, 0] - top.values[:, 1]


def draft_steps(model, token: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor, steps: int, origin: torch.Tensor):
    """``steps`` greedy steps after ``token`` [n] at column ``pos`` [n, 1] (absolute
    position ``origin + pos``): each step's K/V written into ``kv`` at its column.
    Returns (tokens [n, steps], margins [n, steps])."""
    if steps < 1:
        return token.new_zeros((len(token), 0)), torch.zeros((len(token), 0), device=token.device)
    toks, margins = [], []
    for _ in range(steps):
        token, margin = top2(model.logits(model.forward_kv(token[:, None], pos, kv, pos, origin)[:, 0]))
        toks.append(token)
        margins.append(margin)
        pos = pos + 1
    return torch.stack(toks, 1), torch.stack(margins, 1)


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


@dataclass
class Bucket:
    """A row bucket's working KV buffer and its graphs by (queries, width)."""

    kv: torch.Tensor  # [rows, layers, 2, heads, max_tokens + 1, head_dim]
    graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class RoundGraphs:
    """Owned by one drafter, used under its lock."""

    def __init__(self, model, kv_shape: tuple[int, ...], positions: int, head_dim: int, device, dtype):
        self.model, self.kv_shape, self.positions, self.head_dim = model, kv_shape, positions, head_dim
        self.device, self.dtype = torch.device(device), dtype
        self.capture = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.buckets: dict[int, Bucket] = {}

    def nbytes(self) -> int:
        """The working buffers' memory (the graphs' own intermediates not counted)."""
        return sum(b.kv.numel() * b.kv.element_size() for b in self.buckets.values())

    def run(
        self,
        tok: np.ndarray,
        base: np.ndarray,
        take: np.ndarray,
        origin: np.ndarray,
        width: int,
        pool: torch.Tensor | None,
        hits: tuple[np.ndarray, np.ndarray],
        backs: tuple[np.ndarray, np.ndarray],
    ) -> np.ndarray:
        """One round: entry i encodes ``tok[i, :take[i]]`` at columns ``base[i]...`` (its
        row's column 0 at absolute position ``origin[i]``),
        after its pool row's K/V (``hits``: entries and their rows) are gathered; then
        ``width - 1`` greedy steps; the encoded rows written back (``backs``). Returns
        ``[n, 2 * width]`` float32: the drafts, then their margins."""
        n, q = tok.shape
        rows, queries = _pow2(n, MIN_ROWS), _pow2(q, MIN_QUERIES)
        b = self.buckets.get(rows)
        if b is None:
            b = self.buckets[rows] = Bucket(
                torch.zeros((rows, *self.kv_shape, self.positions, self.head_dim), device=self.device, dtype=self.dtype)
            )
        key = (queries, width)
        if self.capture and key not in b.graphs and rows * queries <= MAX_CAPTURED_TOKENS:
            self._capture(b, queries, width)
        host = self._inputs(rows, queries, tok, base, take, origin)
        hit_e, hit_rows = hits
        back_e, back_rows = backs
        parts = [host, hit_e, hit_rows, back_e, back_rows]
        ints = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(self.device)  # the one copy up
        inp, hit_d, hit_r, back_d, back_r = torch.split(ints, [len(p) for p in parts])
        trash = self.positions - 1
        if len(hit_e):
            # whole rows by index_select/index_copy_: block copies, not an element-wise index kernel
            b.kv[:, :, :, :, :trash].index_copy_(0, hit_d, pool.index_select(0, hit_r))
        if key in b.graphs:
            graph, static_inp, out = b.graphs[key]
            static_inp.copy_(inp)
            graph.replay()
        else:
            out = self._round(b.kv, inp, rows, queries, width)
        if len(back_e):
            pool.index_copy_(0, back_r, b.kv.index_select(0, back_d)[:, :, :, :, :trash])
        return out[:n].cpu().numpy()  # the one copy down

    def _inputs(
        self, rows: int, queries: int, tok: np.ndarray, base: np.ndarray, take: np.ndarray, origin: np.ndarray
    ) -> np.ndarray:
        """The round's padded integers, one array: tokens, columns and write columns
        ``[rows, queries]`` each, then each row's last query and its origin ``[rows]``."""
        n, q = tok.shape
        steps = np.arange(queries)
        valid = steps < take[:, None]
        out = np.zeros((3, rows, queries), np.int64)
        out[0, :n, :q] = tok
        out[1, :n] = np.where(valid, base[:, None] + steps, 0)
        out[2] = self.positions - 1  # padding (and the rows past n) write to the trash column
        out[2, :n] = np.where(valid, out[1, :n], self.positions - 1)
        last = np.zeros((2, rows), np.int64)
        last[0, :n] = take - 1
        last[1, :n] = origin
        return np.concatenate([out.ravel(), last.ravel()])

    def _round(self, kv: torch.Tensor, inp: torch.Tensor, rows: int, queries: int, width: int) -> torch.Tensor:
        """The round on the buffer: ``[rows, 2 * width]`` float32, drafts then margins."""
        grid = rows * queries
        tok, pos, write = (inp[i * grid : (i + 1) * grid].view(rows, queries) for i in range(3))
        last, origin = inp[3 * grid : 3 * grid + rows], inp[3 * grid + rows :]
        every = torch.arange(rows, device=kv.device)
        h = self.model.forward_kv(tok, pos, kv, write, origin)
        token, margin = top2(self.model.logits(h[every, last]))
        toks, margins = draft_steps(self.model, token, pos[every, last][:, None] + 1, kv, width - 1, origin)
        return torch.cat([token[:, None].float(), toks.float(), margin[:, None], margins], 1)

    def _capture(self, b: Bucket, queries: int, width: int) -> None:
        rows = len(b.kv)
        inp = torch.zeros(3 * rows * queries + 2 * rows, dtype=torch.long, device=self.device)
        inp[2 * rows * queries : 3 * rows * queries] = self.positions - 1  # writes to the trash column only
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the capture (lazy inits, kernel choices)
            self._round(b.kv, inp, rows, queries, width)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._round(b.kv, inp, rows, queries, width)
        b.graphs[(queries, width)] = (graph, inp, out)

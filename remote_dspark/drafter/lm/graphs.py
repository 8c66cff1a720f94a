"""The model drafter's round: on static buffers, and on CUDA one graph replay instead of
hundreds of kernel launches.

A round (:meth:`Rounds.run`) encodes each entry's new tokens into its stream's blocks of
the KV pool (:class:`~remote_dspark.drafter.lm.pool.KVStore`), then takes ``width - 1``
steps (greedy, or sampled: below), every query attending to its stream's blocks in place
(:mod:`.attention`). Small models' kernels take microseconds, and eager PyTorch spends
about as long on each launch, so on a GPU the whole round, prefill and steps, is
captured once per shape and replayed. Its shapes must then be fixed:

* rows: the round's entry count rounded up to a power of two (at least ``MIN_ROWS``, but
  from 1 for a prefill: :func:`padded`);
  the entries past the round's encode token 0 at column 0 of table row 0 and draft
  after it, writing only into the trash block, and are never read;
* queries: the most tokens an entry encodes, rounded up to a power of two (at least
  ``MIN_QUERIES``: a steady round encodes the few tokens accepted since the last one);
  padding queries sit at column 0 and write their K/V into the trash block;
* the block table's new cells (the blocks the round's streams took as they grew): at
  most a fixed number per shape (:meth:`Rounds._cells`), the rest writes of 0 into the
  table's padding row. The graph writes them into the device's table before anything
  reads it, so the table is a graph input like the tokens: no copy of its own.

A round's integers (padded tokens, columns, each write's block and offset, found on the
host in its table, each entry's last query, its origin and its table row, the new table
cells) go up in one copy and the answer comes
down in one; nothing else runs around the replay. A graph holds the pool's and the
table's addresses: when the table grows
(:meth:`~remote_dspark.drafter.lm.pool.KVStore.scratch`) the graphs are dropped and
captured again. A capture runs the round on whatever the buffers hold, and writes only
into the trash block and the table's padding row.

A round's working memory is its padded shape's (rows x queries tokens through the
model, and a row of logits per entry), so it is bounded: a round whose padded shape is
over ``limit`` tokens (:attr:`Rounds.limit`, set from the worker's budget) runs in
parts (:func:`parts`), its entries by descending context, those of one power of two
of queries together, each part as many as fit the limit. A call of many short contexts
beside a few long encodes (a steady round with a NEW_GEN) then neither pads the short
ones to a long one's length nor holds a rectangle larger than the budget; a call whose
shape fits, the common case, is one part. Every shape run is therefore at most ``limit`` tokens, and each is captured,
sharing one memory pool (they never run at once) whose size is the largest round's
working set plus each graph's inputs and outputs. A graph also holds host memory for
its kernel nodes (a round of 64 draft steps has thousands), and shapes multiply
(rows x queries x widths x kinds: greedy, sampled, ranked), so at most ``MAX_GRAPHS`` are kept: a
new shape beyond them evicts the least recently replayed graph.

A sampled round (``sampling`` given: :func:`choose`) draws each step's token by the
sampling rule (:mod:`.sampling`, the twin of :mod:`remote_dspark.drafter.sampling`) in
place of the greedy one, on the device and inside the graph (no host sync), and feeds it
back; its three integers per entry (temperature bits, seed, first draft's position) go
up with the round's others and its distributions come down with its drafts. Its shapes
are graphs of their own (a shape's key says its kind); a greedy round runs
exactly the code it ran before. A drafter that pre-drafts (:mod:`.speculate`) runs its greedy
rounds ``RANKED``: the same drafts, and each position's ``RANK`` likeliest ids and their
probabilities beside them (one ``topk`` a step), from which it ranks the outcomes to pre-draft.

On the CPU the rounds run unpadded by default; asked (``LMDrafter(graphs=True)``: the
tests) the same padded shapes and code run eagerly, so their rules are checked without
a GPU.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np
import torch

from .attention import Pages
from .sampling import TOP, pick, top32, uniform_u32

MIN_ROWS = 16
LONG_QUERIES = 64  # a shape of more queries (a prefill) pads its rows from 1, not MIN_ROWS
MIN_QUERIES = 4
DEFAULT_LIMIT = 1 << 16  # padded rows x queries of one part, until the worker's budget sets it
MAX_GRAPHS = 64  # graphs kept (>= 2: an eviction never empties, and so never releases, the shared pool)
RANK = 8  # a ranked greedy round's choices kept per draft position (the speculation cache's outcomes)
GREEDY, SAMPLED, RANKED = 0, 1, 2  # a round's kind: greedy, sampled, or greedy with each position's top RANK


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy token and its softmax margin (top1 - top2, float32) per row of ``logits``
    [n, vocab] (any float dtype; consumed: overwritten when already float32). On CUDA one
    Triton pass over the vocabulary (:mod:`._kernels`); elsewhere three (max, logsumexp,
    the runner-up's max). Not a sort: ``topk`` over 50,000 logits is a radix select,
    several times slower on a GPU."""
    if logits.device.type == "cuda":
        from ._kernels import top2 as top2_kernel

        return top2_kernel(logits)
    logits = logits.float()
    best, token = logits.max(-1)
    lse = torch.logsumexp(logits, -1)
    runner_up = logits.scatter_(-1, token[:, None], float("-inf")).max(-1).values
    return token, (best - lse).exp() - (runner_up - lse).exp()


class DeviceSampling(NamedTuple):
    """A sampled round's inputs on the device, one per entry (a padding entry's are 0:
    greedy), and the round's randomness, hashed once for every draft (one pass of the
    hash's few dozen elementwise kernels, not one per step)."""

    temperature: torch.Tensor  # [n] float32 (0: greedy)
    u32: torch.Tensor  # [n, width] int64: uniform_u32(seed, first + j, j), first the absolute position of draft 0

    @classmethod
    def of(cls, temperature: torch.Tensor, seed: torch.Tensor, first: torch.Tensor, width: int) -> DeviceSampling:
        """The round's sampling from its per-entry ``temperature``, ``seed`` (the uint64's
        bits) and ``first`` (draft 0's absolute position), for ``width`` drafts."""
        j = torch.arange(width, device=seed.device)
        return cls(temperature, uniform_u32(seed[:, None], first[:, None] + j, j))


def choose(
    logits: torch.Tensor, sampling: DeviceSampling | None, j: int, ranked: bool = False
) -> tuple[torch.Tensor, ...]:
    """Draft ``j`` of each entry from its ``logits`` [n, vocab] (consumed).

    Greedy (``sampling`` None): (token [n] int64, margin [n] float32), :func:`top2`;
    ``ranked``, also the ``RANK`` likeliest ids (int32, the first the token but for an
    exact tie) and their softmax probabilities (float32), [n, RANK] each.
    Sampled: (token, margin, ids [n, TOP] int32, weights [n, TOP] int32): ``ids, weights
    = top32(logits, temperature)`` and the token ``pick(ids, weights, uniform_u32(seed,
    first + j, j))`` (rule 1-3 of :mod:`remote_dspark.drafter.sampling`; the uniform is
    ``sampling.u32[:, j]``, hashed for the whole round at once); the margin is
    still softmax's top1 - top2 of the same logits (temperature 1), as in a greedy round.
    No host sync on CUDA."""
    if sampling is None:
        if not ranked:
            return top2(logits)
        best, ids = torch.topk(logits, RANK, dim=1)  # before top2, which may overwrite the logits
        probs = (best.float() - torch.logsumexp(logits.float(), 1, keepdim=True)).exp()
        return (*top2(logits), ids.int(), probs)
    ids, weights = top32(logits, sampling.temperature)
    token = pick(ids, weights, sampling.u32[:, j]).long()
    return token, top2(logits)[1], ids, weights  # top2 last: it overwrites float32 logits


def draft_steps(
    model,
    token: torch.Tensor,
    pos: torch.Tensor,
    pages: Pages,
    rows: torch.Tensor,
    origin,
    at: tuple[torch.Tensor, torch.Tensor],
    sampling: DeviceSampling | None = None,
    ranked: bool = False,
) -> list[tuple[torch.Tensor, ...]]:
    """Drafts 1..steps of the round after ``token`` [n] at column ``pos`` [n, 1] of table
    rows ``rows`` [n] (absolute position ``origin + pos``): step j's K/V written at its
    block and offset ``at[0][:, j - 1]``, ``at[1][:, j - 1]`` ([n, steps] each: its
    stream's column, or the trash block for padding entries, whose rows are others'),
    found for every step at once. Returns each step's :func:`choose` (greedy, or
    ``sampling``'s draws), its token fed to the next step."""
    out = []
    blocks, offsets = at
    for j in range(blocks.shape[1]):
        h = model.forward_kv(token[:, None], pos, pages, rows, (blocks[:, j : j + 1], offsets[:, j : j + 1]), origin)
        out.append(choose(model.logits(h[:, 0]), sampling, j + 1, ranked))
        token = out[-1][0]
        pos = pos + 1
    return out


def columns(width: int, kind: int) -> int:
    """A round's answer's columns per entry: ``width`` drafts and ``width`` margins, then
    for a ``SAMPLED`` round ``width x TOP`` ids and ``width x TOP`` weights, for a
    ``RANKED`` one ``width x RANK`` ids and ``width x RANK`` probabilities (all float32:
    token ids and weights below 2**24 are exact)."""
    return 2 * width * (1 + {GREEDY: 0, SAMPLED: TOP, RANKED: RANK}[kind])


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _sections(flat, layout: tuple[tuple[int, int], ...]) -> list:
    """Views of a flat array (numpy's or torch's), one per ``(rows, columns)`` of ``layout``."""
    out, at = [], 0
    for rows, cols in layout:
        out.append(flat[at : at + rows * cols].reshape(rows, cols))
        at += rows * cols
    return out


def padded(n: int, q: int) -> tuple[int, int]:
    """The padded shape of ``n`` entries of at most ``q`` queries: rows and queries rounded
    up to powers of two, the rows at least ``MIN_ROWS`` (fewer graphs for the common
    rounds), but from 1 for a prefill of more than ``LONG_QUERIES`` queries (padding it
    to ``MIN_ROWS`` rows would run that many times its tokens)."""
    queries = _pow2(q, MIN_QUERIES)
    return _pow2(n, MIN_ROWS if queries <= LONG_QUERIES else 1), queries


def parts(take: np.ndarray, limit: int) -> list[slice | np.ndarray]:
    """The entries of a round (each encoding ``take[i]`` tokens) in parts whose padded
    shape (:func:`padded`) is at most ``limit`` tokens: the whole round when it fits,
    else by descending ``take``, entries of one power of two of queries together, each
    part the most of them that fit. A loop over those powers and parts, not entries.

    Raises: ValueError when one entry alone is over ``limit``."""
    n = len(take)
    rows, queries = padded(n, int(take.max()))
    if rows * queries <= limit:
        return [slice(None)]
    if np.prod(padded(1, int(take.max()))) > limit:
        raise ValueError(f"an entry of {int(take.max())} tokens is over a round's limit of {limit} padded tokens")
    order = np.argsort(-take, kind="stable")
    bucket = np.maximum(MIN_QUERIES, 1 << np.ceil(np.log2(np.maximum(take[order], 1))).astype(np.int64))
    ends = np.flatnonzero(np.diff(bucket)) + 1  # where the power of two of queries changes
    out = []
    for lo, hi in zip(np.r_[0, ends], np.r_[ends, n], strict=True):
        q = int(bucket[lo])
        most = 1 << (limit // q).bit_length() - 1  # a power of two <= limit / q
        out += [order[i : min(i + most, hi)] for i in range(lo, hi, most)]
    return out


class Rounds:
    """The rounds of one drafter over its store, used under the drafter's lock.

    Args: the model, the store, and whether to run the padded shapes (module docstring),
    captured as graphs on CUDA; unpadded, a round runs its own shapes eagerly (what a
    CPU wants: padding there is work, not launches saved)."""

    def __init__(self, model, store, padded: bool, limit: int = DEFAULT_LIMIT, ranked: bool = False):
        self.model, self.store, self.padded, self.limit = model, store, padded, limit
        self.ranked = ranked  # greedy rounds are RANKED (the speculation cache ranks their outcomes)
        self.capture = padded and store.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # One side stream for every capture's warm-up: a new stream each time would get a
        # cuBLAS workspace of its own each time (cuBLAS keeps one per stream it has seen).
        self.side = torch.cuda.Stream(store.device) if self.capture else None
        # (rows, queries, width, kind) -> the graph, its input buffer and its answer
        # the least recently replayed first; MAX_GRAPHS at most
        self.graphs: collections.OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]]
        self.graphs = collections.OrderedDict()
        self._version = store.version

    def run(
        self,
        tok: np.ndarray,
        base: np.ndarray,
        take: np.ndarray,
        origin: np.ndarray,
        rows: np.ndarray,
        width: int,
        sampling: np.ndarray | None = None,
        cells: np.ndarray | None = None,
    ) -> np.ndarray:
        """One round: entry i encodes ``tok[i, :take[i]]`` at columns ``base[i]...`` of
        table row ``rows[i]`` (its column 0 at absolute position ``origin[i]``; columns
        before ``base[i]`` hold what earlier rounds encoded), then ``width - 1`` steps,
        in :func:`parts` of at most :attr:`limit` padded tokens (``width`` 0: the
        tokens encoded, nothing drafted; ``[n, 0]`` back). The rows' table cells from
        ``cells[i]`` on are new (the pool's :meth:`~.pool.KVStore.grant`; None: none):
        the round carries them to the device. Greedy, or sampled (:func:`choose`) with
        ``sampling`` [3, n] int64: each entry's temperature (its float32 bits), seed
        (its uint64 bits) and its draft 0's absolute position. Returns ``[n,
        columns(width, kind)]`` float32 (:func:`columns`, :meth:`kind`): the drafts, their
        margins, then (sampled) their ids ``[width, TOP]`` and weights ``[width, TOP]``, or
        (ranked) each position's top ids ``[width, RANK]`` and probabilities."""
        if cells is None:
            cells = self.store.held[rows]
        split = parts(take, self.limit)
        if len(split) == 1:
            return self._run(tok, base, take, origin, rows, width, sampling, cells)
        out = np.empty((len(take), columns(width, self.kind(sampling))), np.float32)
        for idx in split:
            q = int(take[idx].max())  # tokens are left-aligned: a part's first q columns
            part = None if sampling is None else sampling[:, idx]  # the part's entries' own
            out[idx] = self._run(tok[idx, :q], base[idx], take[idx], origin[idx], rows[idx], width, part, cells[idx])
        return out

    def kind(self, sampling: np.ndarray | None) -> int:
        """The kind of a round with ``sampling`` (None: greedy, ranked when :attr:`ranked`)."""
        return SAMPLED if sampling is not None else RANKED if self.ranked else GREEDY

    def columns(self, width: int, sampling: np.ndarray | None) -> int:
        """The answer's columns of a round of ``width`` with ``sampling`` (:func:`columns`)."""
        return columns(width, self.kind(sampling))

    def _run(self, tok, base, take, origin, rows, width: int, sampling, cells) -> np.ndarray:
        n, q = tok.shape
        kind = self.kind(sampling)
        if self.padded:
            shape = (*padded(n, q), width, kind)
        else:
            shape = (n, q, width, kind)
        if self._version != self.store.version:  # the table moved: its graphs point at the old one
            self.graphs.clear()
            self._version = self.store.version
            if self.capture:  # a pool whose graphs are all gone is released: captures need a new one
                self.pool = torch.cuda.graph_pool_handle()
        if self.capture and shape not in self.graphs:
            while len(self.graphs) >= MAX_GRAPHS:  # the least recently replayed goes (the pool keeps others)
                self.graphs.popitem(last=False)
            self._capture(shape)
        inp = self._inputs(shape, tok, base, take, origin, rows, sampling, cells)
        inp = torch.from_numpy(inp).to(self.store.device)  # one copy up
        if shape in self.graphs:
            self.graphs.move_to_end(shape)
            graph, static_inp, out = self.graphs[shape]
            static_inp.copy_(inp)
            graph.replay()
        else:
            out = self._round(inp, shape)
        return out[:n].cpu().numpy()  # the one copy down

    def _layout(self, shape) -> tuple[tuple[int, int], ...]:
        """The sections of a round's input of ``shape``, in order, each (rows, columns):
        tokens and columns ``[entries, queries]``, each write's block and offset
        ``[entries, queries + steps]``, the per-entry integers ``[3 (6 sampled), entries]``
        and the new table cells ``[2, cells]`` (:meth:`_inputs`)."""
        entries, queries, width, kind = shape
        writes = queries + max(0, width - 1)
        per = (6 if kind == SAMPLED else 3, entries)
        return ((entries, queries),) * 2 + ((entries, writes),) * 2 + (per, (2, self._cells(shape)))

    def _cells(self, shape) -> int:
        """The new table cells a round of ``shape`` carries at most: each entry's encode
        and drafts, in blocks, and one more (a row's last block part-filled)."""
        entries, queries, width, _ = shape
        return entries * (-(-(queries + width) // self.store.block) + 1)

    def _inputs(self, shape, tok, base, take, origin, rows, sampling, cells) -> np.ndarray:
        """The round's padded integers, one array: tokens and columns ``[rows, queries]``,
        then the block and the offset each write goes to ``[rows, queries + steps]`` each
        (the encode's queries, then each draft step's: found here in the host's table, the
        trash block's first offset for padding), then each entry's last query, origin and
        table row, then (sampled) its ``sampling`` rows (the entries past n sample at
        temperature 0), then the new table cells' flat indices and blocks (padded with
        writes of 0 into the table's padding row)."""
        n, q = tok.shape
        _, queries, _, kind = shape
        layout = self._layout(shape)
        out = np.zeros(sum(r * c for r, c in layout), np.int64)
        grid_tok, grid_pos, at_block, at_offset, last, new = _sections(out, layout)
        writes = at_block.shape[1]
        grid_tok[:n, :q] = tok
        steps = np.arange(writes)
        # each write's column: the encode's queries at base..., draft step j at base + take + j;
        # zero where dead (an encode's padding queries; and the entries past n): they write to
        # the trash block's first offset
        live = (steps < take[:, None]) | (steps >= queries)
        col = (base[:, None] + np.where(steps < queries, steps, take[:, None] + steps - queries)) * live
        grid_pos[:n] = col[:, :queries]
        block = self.store.block
        at_block[:n] = self.store.host_table[rows[:, None], col // block] * live
        at_offset[:n] = col % block
        last[0, :n] = take - 1
        last[1, :n] = origin
        last[2, :n] = rows
        if kind == SAMPLED:
            last[3:, :n] = sampling
        where, blocks = self.store.new_cells(rows, cells)
        if len(where) > new.shape[1]:
            raise ValueError(f"a round of shape {shape} takes {len(where)} new blocks, over its {new.shape[1]}")
        new[0] = self.store.padding_cell()
        new[0, : len(where)] = where
        new[1, : len(where)] = blocks
        return out

    def _round(self, inp: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """The round on the pool: ``[rows, columns(width, kind)]`` float32 (:meth:`run`)."""
        entries, queries, width, kind = shape
        sampled, ranked = kind == SAMPLED, kind == RANKED
        tok, pos, blocks, offsets, per, new = _sections(inp, self._layout(shape))
        last, origin, rows = per[0], per[1], per[2]
        # The temperature's float32 bits (non-negative: below 2**31) back to float32.
        sampling = DeviceSampling.of(per[3].int().view(torch.float32), per[4], per[5], width) if sampled else None
        every = torch.arange(entries, device=inp.device)
        pages = Pages(self.store.kv, self.store.table)
        pages.table.view(-1).index_put_((new[0],), new[1])  # the rows' new blocks, before any read
        h = self.model.forward_kv(tok, pos, pages, rows, (blocks[:, :queries], offsets[:, :queries]), origin)
        if not width:  # an encode only: the K/V written, no logits, no steps
            return h.new_zeros((entries, 0), dtype=torch.float32)
        first = choose(self.model.logits(h[every, last]), sampling, 0, ranked)
        step = pos[every, last][:, None] + 1
        at = (blocks[:, queries:], offsets[:, queries:])
        picks = [first, *draft_steps(self.model, first[0], step, pages, rows, origin, at, sampling, ranked)]
        # tokens [n, width], margins [n, width], then (sampled) ids and weights [n, width, TOP]
        # or (ranked) ids and probabilities [n, width, RANK]
        fields = (torch.stack(f, 1).reshape(entries, -1).float() for f in zip(*picks))
        return torch.cat(list(fields), 1)

    def blank(self, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """A round's input of ``shape`` that writes only into the trash block and the
        table's padding row (what a capture runs on)."""
        layout = self._layout(shape)
        inp = torch.zeros(sum(r * c for r, c in layout), dtype=torch.long, device=self.store.device)
        _sections(inp, layout)[-1][0] = self.store.padding_cell()  # table writes to its padding row only
        return inp  # every write to the trash block's first offset

    def _capture(self, shape: tuple[int, int, int, int]) -> None:
        inp = self.blank(shape)
        self.side.wait_stream(torch.cuda.current_stream(self.store.device))
        with torch.cuda.stream(self.side):  # warm-up outside the capture (lazy inits, kernel choices, Triton's compile)
            self._round(inp, shape)
        torch.cuda.current_stream(self.store.device).wait_stream(self.side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._round(inp, shape)
        self.graphs[shape] = (graph, inp, out)

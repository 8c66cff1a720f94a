"""The model drafter's KV: a pool of fixed-size blocks and a block table per stream.

Layout (on the model's device, in its dtype, :class:`KVStore`)::

    kv     [blocks, layers, 2 (K, V), kv_heads, BLOCK, head_dim]   the pool; block 0: trash
    table  [table rows + 1, max_blocks] int64                      a stream's blocks, in order

A stream's row of the table names its blocks: its column c (the token at absolute
position ``origin + c``) lies in block ``table[row, c // BLOCK]`` at offset ``c %
BLOCK``. A round writes each query's keys and values into its stream's block at its
column and attends to the stream's blocks where they lie (:mod:`.attention`); padding
queries write into the trash block. Blocks are taken from a free list as a stream grows
(:meth:`KVStore.grant`) and given back when its KV is evicted or its row is given to
another stream; the host keeps the table (``host_table``, the truth) and each round
carries its new cells to the device with its other integers (:mod:`.graphs`), so the
device table is right for every cell a round reads. The table's last row takes the
padding of those writes. A stream holds at most ``columns`` = ``max_context +
MAX_WIDTH`` columns (rounded up to whole blocks): a whole context and a round's drafts.

The pool's memory is fixed at start (``kv_bytes``: a budget, by default a share of the
device's free memory after the weights, :func:`pool_bytes`), whatever the streams'
lengths: a thousand short streams or a few whole contexts take the same blocks.

Table rows: the cache's rows first (``cache rows``: a stream each), then the branch
rows of pre-drafted outcomes (:mod:`.speculate`), then scratch rows for a round's entries
without one (a drafter without a cache, or a round of more entries than rows): their
blocks are taken for the round and given back after it.

A branch forked from a stream (:meth:`KVStore.fork`, copy on write) reads the stream's
blocks before the fork through its own table row, and owns only the blocks from the fork
on (the block the fork falls in copied, the rest new): the shared ones are read during its
own pre-draft only, under the drafter's lock, and are its stream's whatever happens to
the branch. Taken for its stream, it hands the stream its own blocks
(:meth:`KVStore.adopt`); let go, it gives back only those (``release`` from its fork).
"""

from __future__ import annotations

import os

import numpy as np
import torch

BLOCK = 16  # tokens a block holds (attention reads as fast with 16, 32 or 64: 16 wastes least)
MAX_WIDTH = 64  # columns a stream holds past its whole context: the widest round's drafts
DEFAULT_CONTEXT = 8192  # tokens a stream keeps at most, unless the model's positions are fewer
POOL_SHARE = 2  # by default the pool takes 1 / POOL_SHARE of the memory free after the weights
CPU_POOL = 1 << 28  # and on the host at most this many bytes (tests and small models)


def stream_columns(max_context: int | None, max_positions: int | None) -> tuple[int, int]:
    """``(context, columns)``: the tokens a stream keeps (``max_context``, default
    ``DEFAULT_CONTEXT``, at most the model's positions) and its row's columns (the
    context and ``MAX_WIDTH`` drafts, at most the positions, whole blocks).

    Raises: ValueError for a context under 2 tokens, naming ``--max-context``."""
    context = DEFAULT_CONTEXT if max_context is None else int(max_context)
    if context < 2:
        raise ValueError(f"--max-context {max_context}: must be >= 2")
    if max_positions is not None:
        context = min(context, max_positions)
    columns = context + MAX_WIDTH if max_positions is None else min(context + MAX_WIDTH, max_positions)
    return context, -(-columns // BLOCK) * BLOCK


def memory_free(device: torch.device) -> int:
    """Bytes free for a new allocation on ``device``: the GPU's free memory, or the host's
    available memory (``MemAvailable``; all of it where /proc/meminfo does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pool_bytes(device: torch.device, wanted: int) -> int:
    """The pool's default budget: ``1 / POOL_SHARE`` of the memory free now (after the
    weights), at most ``CPU_POOL`` on the host, at most ``wanted`` (what every cached
    stream's whole context takes: no more is ever used)."""
    share = memory_free(device) // POOL_SHARE
    if device.type != "cuda":
        share = min(share, CPU_POOL)
    return min(share, wanted)


MIN_SCRATCH = 16  # scratch rows at least, once a round needs any


def _runs(count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of ``count[i]`` cells each, flat: each cell's run and its index in its run."""
    owner = np.repeat(np.arange(len(count)), count)
    return owner, np.arange(len(owner)) - np.repeat(np.concatenate(([0], np.cumsum(count)[:-1])), count)


class KVStore:
    """The pool of blocks and the block table (module docstring).

    Args: ``blocks`` of the pool (the trash block counted), ``rows`` cache rows of the
    table, a stream's ``columns`` (whole blocks), the model's shape, device and dtype.

    Raises: ValueError when the pool cannot hold one whole stream, or does not fit in the
    device's free memory, naming the flag that sizes it.
    """

    def __init__(
        self,
        blocks: int,
        rows: int,
        columns: int,
        layers: int,
        heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        branch_rows: int = 0,
    ):
        if rows < 0 or columns < BLOCK or columns % BLOCK:
            raise ValueError(f"table rows {rows}, columns {columns}: must be >= 0, whole blocks of {BLOCK}")
        self.device, self.dtype = torch.device(device), dtype
        self.block, self.columns, self.max_blocks = BLOCK, columns, columns // BLOCK
        self.cache_rows, self.branch_rows = rows, branch_rows
        self._block_shape = (layers, 2, heads, BLOCK, head_dim)
        if blocks < self.max_blocks + 1:
            raise ValueError(
                f"a KV pool of {blocks} blocks ({blocks * self.block_bytes() / 2**20:,.1f} MiB, --lm-kv-mb) cannot "
                f"hold one whole stream of {columns} tokens ({self.max_blocks} blocks of {BLOCK}) and the trash block"
            )
        need, free = blocks * self.block_bytes(), memory_free(self.device)
        if need > free:
            raise ValueError(
                f"a KV pool of {need / 2**20:,.0f} MiB (--lm-kv-mb) needs more than the "
                f"{free / 2**20:,.0f} MiB free on {self.device}"
            )
        table = (rows + branch_rows + 1) * self.max_blocks * 8  # each of the host's and the device's tables
        if 2 * table > memory_free(torch.device("cpu")):
            raise ValueError(
                f"the block tables of {rows} streams (--lm-cache-slots) and {branch_rows} pre-drafts "
                f"(--lm-speculate) of {columns} tokens need {2 * table / 2**20:,.0f} MiB, more than the "
                "host's free memory"
            )
        self.kv = torch.zeros((blocks, *self._block_shape), device=self.device, dtype=dtype)
        self.blocks = blocks
        self.free = np.arange(blocks - 1, 0, -1, dtype=np.int64)  # a stack; block 0 (trash) never in it
        self.n_free = blocks - 1
        self._tables(rows + branch_rows)
        self.version = 0  # bumped when ``table`` is reallocated (what holds its address must let go)

    def _tables(self, rows: int) -> None:
        """Tables of ``rows`` rows and the padding row, the host's kept, the device's a copy."""
        host = np.zeros((rows + 1, self.max_blocks), np.int64)
        held = np.zeros(rows, np.int64)
        if hasattr(self, "host_table"):
            host[: len(self.held)] = self.host_table[: len(self.held)]
            held[: len(self.held)] = self.held
        self.host_table, self.held = host, held  # held: blocks each row holds (table cells 0..held-1)
        self.table = torch.from_numpy(host).to(self.device)

    @property
    def rows(self) -> int:
        """Table rows (cache and scratch), the padding row not counted."""
        return len(self.held)

    def block_bytes(self) -> int:
        return int(np.prod(self._block_shape)) * torch.finfo(self.dtype).bits // 8

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def scratch(self, k: int) -> np.ndarray:
        """Table rows for ``k`` entries without a cache row (int64 [k]), the table grown
        (:attr:`version` bumped) when it has fewer scratch rows."""
        first = self.cache_rows + self.branch_rows
        if k > self.rows - first:
            self._tables(first + max(MIN_SCRATCH, 1 << (k - 1).bit_length()))
            self.version += 1
        return first + np.arange(k, dtype=np.int64)

    def grant(self, rows: np.ndarray, columns: np.ndarray, make_room=None) -> tuple[np.ndarray, np.ndarray]:
        """Blocks so that each of ``rows`` (distinct) holds its first ``columns`` columns.
        When the free blocks fall short, ``make_room(short)`` may give some back first;
        then rows are served by fewest blocks wanted, and those left short get none.
        Returns ``(ok [n] bool, first [n] int64)``: which rows hold their columns, and each
        row's first new table cell (its cells ``first..`` up to its ``held`` are new:
        :meth:`new_cells` tells the device)."""
        first = self.held[rows]  # a copy (fancy indexing)
        extra = np.maximum(-(-columns // self.block) - first, 0)
        total = int(extra.sum())
        if not total:  # every row holds its columns already
            return np.ones(len(rows), bool), first
        if total > self.n_free and make_room is not None:
            make_room(total - self.n_free)
            first = self.held[rows]  # evicted rows of this round hold nothing now
            extra = np.maximum(-(-columns // self.block) - first, 0)
            total = int(extra.sum())
        ok = np.ones(len(rows), bool)
        if total > self.n_free:
            order = np.argsort(extra, kind="stable")
            within = np.cumsum(extra[order]) <= self.n_free
            ok[order[~within]] = False
            extra = np.where(ok, extra, 0)
            total = int(extra.sum())
        taken = self.free[self.n_free - total : self.n_free]
        self.n_free -= total
        run, at = _runs(extra)
        self.host_table[rows[run], first[run] + at] = taken
        self.held[rows] += extra
        return ok, first

    def new_cells(self, rows: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The table cells ``rows`` took since ``first`` (:meth:`grant`): flat indices into the
        table and their blocks, for the device's copy."""
        count = self.held[rows] - first
        if not count.any():
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        run, at = _runs(count)
        owner, cell = rows[run], first[run] + at
        return owner * self.max_blocks + cell, self.host_table[owner, cell]

    def release(self, rows: np.ndarray, start: np.ndarray | int = 0) -> None:
        """Give back the blocks of ``rows`` (distinct) from their cell ``start`` on (a
        branch's own, from its fork), the rows left holding none (``start`` 0) or the
        cells before ``start``."""
        start = np.minimum(np.broadcast_to(np.asarray(start, np.int64), np.shape(rows)), self.held[rows])
        count = self.held[rows] - start
        total = int(count.sum())
        if not total:
            return
        run, at = _runs(count)
        self.free[self.n_free : self.n_free + total] = self.host_table[rows[run], start[run] + at]
        self.n_free += total
        self.held[rows] = start

    def fork(self, rows: np.ndarray, sources: np.ndarray, cells: np.ndarray) -> None:
        """Each of ``rows`` (empty, distinct) reads the first ``cells[i]`` blocks of
        ``sources[i]`` (which holds them; not its own: ``release(rows, cells)`` gives back
        only what it takes after): the host's table (the caller copies the device's rows,
        :meth:`copy_rows`)."""
        assert not self.held[rows].any(), "a fork into a row that holds blocks"
        run, cell = _runs(cells)
        self.host_table[rows[run], cell] = self.host_table[sources[run], cell]
        self.held[rows] = cells

    def adopt(self, rows: np.ndarray, branches: np.ndarray, cells: np.ndarray) -> None:
        """Each of ``rows`` takes the blocks of ``branches[i]`` (forked from it at
        ``cells[i]``: the blocks before are the row's own) from that cell on; its own from
        there go, and the branches are left empty. The device's rows are the caller's
        (:meth:`copy_rows`)."""
        self.release(rows, cells)
        run, at = _runs(self.held[branches] - cells)
        cell = cells[run] + at
        self.host_table[rows[run], cell] = self.host_table[branches[run], cell]
        self.held[rows] = self.held[branches]
        self.held[branches] = 0

    def copy_rows(self, rows: np.ndarray, sources: np.ndarray) -> None:
        """The device's table rows ``rows`` become copies of ``sources``' (one gather and
        scatter on the device, ordered before the next round that reads them)."""
        if len(rows) and self.table.data_ptr() != self.host_table.ctypes.data:  # (on the CPU they are one)
            dev = self.table.device
            self.table[torch.from_numpy(rows).to(dev)] = self.table[torch.from_numpy(sources).to(dev)]

    def padding_cell(self) -> int:
        """The flat table index padding writes go to (the padding row's first cell)."""
        return self.rows * self.max_blocks

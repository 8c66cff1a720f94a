"""A Markov table as arrays (:class:`MarkovArrays`), read straight from its cache file's
records (:func:`arrays_of`): what :meth:`~.markov.MarkovModel.draft_batch` drafts with
(one ``find`` per round, then one gather per draft step), what
:mod:`.markov_sampled` samples from, and what the worker's C drafter reads
(``worker.lane``). numpy is imported on first use, never at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# Small key spaces (the built-in model's 128**2) also get a direct index: key -> row.
DENSE_MAX = 1 << 20


class MarkovArrays:
    """``draft_batch``'s view of the table: sorted keys to find a context's row, and per
    row (plus a sentinel row ``none`` = number of contexts: token 0, margin 0, successor
    itself) the first next token, its margin and the successor row.

    Keys: ``radix`` mode when (max - min + 1) ** order of the context tokens fits in 63
    bits (the key is the context in that mixed radix, int64; with a key space of at most
    ``DENSE_MAX`` a direct key -> row array replaces the search), else ``bytes`` mode
    (the context as fixed-width big-endian bytes, biased so that memcmp order is signed
    order). Invariant: ``ctx`` rows come in the cache file's order, sorted by context as
    signed ints, so both key forms are sorted without a sort.
    """

    def __init__(self, ctx: np.ndarray):
        import numpy as np

        self.np = np
        self.ctx = ctx  # [rows, order] int32, sorted (the C drafter's search: worker.lane)
        self.none = len(ctx)
        self.order = ctx.shape[1]
        self.dense = None
        self.first = self.margin = self.succ = None  # set by arrays_of
        self.sampled = None  # markov_sampled's per-row candidates, built on its first use
        self.dists = None  # markov_sampled's per-temperature distribution tables (Tables)
        if self.none == 0:
            self.mode = "empty"
            return
        self.lo, hi = int(ctx.min()), int(ctx.max())
        self.radix = hi - self.lo + 1
        if self.radix**self.order < 1 << 63:
            self.mode = "radix"
            self.keys = self._radix_keys([ctx[:, j] for j in range(self.order)])[0]
            assert bool(np.all(self.keys[1:] > self.keys[:-1])), "Markov contexts not sorted"
            if self.radix**self.order <= DENSE_MAX:
                # One extra slot, at key radix**order, for contexts with unknown tokens.
                self.dense = np.full(self.radix**self.order + 1, self.none, np.int64)
                self.dense[self.keys] = np.arange(self.none)
        else:
            self.mode = "bytes"
            self.keys = self._byte_keys([ctx[:, j] for j in range(self.order)])

    def _radix_keys(self, cols) -> tuple[np.ndarray, np.ndarray]:
        """(keys, unknown): Horner over the columns; ``unknown`` where a token is outside
        lo..hi (its key is junk)."""
        np = self.np
        key = unknown = None
        for col in cols:
            d = np.subtract(col, self.lo, dtype=np.int64)
            out = d.view(np.uint64) >= self.radix  # below lo wraps to huge
            unknown = out if unknown is None else unknown | out
            key = d if key is None else key * self.radix + d
        return key, unknown

    def _byte_keys(self, cols) -> np.ndarray:
        np = self.np
        biased = np.empty((len(cols[0]), self.order), ">u4")
        for j, col in enumerate(cols):
            biased[:, j] = np.add(col, 1 << 31, dtype=np.int64)
        return biased.view(np.dtype((np.void, 4 * self.order))).ravel()

    def find(self, cols, unseen: np.ndarray | None = None) -> np.ndarray:
        """The row of each context, ``none`` where unseen (or ``unseen`` says so).
        ``cols``: ``order`` arrays of m tokens each, oldest first."""
        np = self.np
        m = len(cols[0])
        if self.mode == "empty":
            return np.full(m, self.none, np.int64)
        if self.mode == "radix":
            key, unknown = self._radix_keys(cols)
            if unseen is not None:
                unknown |= unseen
            if self.dense is not None:
                return self.dense[np.where(unknown, len(self.dense) - 1, key)]
        else:
            key = self._byte_keys(cols)
            unknown = unseen if unseen is not None else np.zeros(m, bool)
        pos = np.searchsorted(self.keys, key)
        np.minimum(pos, self.none - 1, out=pos)
        hit = self.keys[pos] == key
        hit &= ~unknown
        return np.where(hit, pos, self.none)


def arrays_of(records, k: int, top: int) -> MarkovArrays:
    """The arrays of a table of order ``k`` keeping ``top`` next tokens, from its cache
    file's records (the bytes after the header, :mod:`.markov`'s format), read in place."""
    import numpy as np

    # The records as laid out in the cache (k context words, top (token, count)
    # pairs, the total): one row of i32 words each, read in place.
    words = np.frombuffer(records, "<i4").reshape(-1, k + 2 * top + 1)
    ctx = np.ascontiguousarray(words[:, :k])
    first = words[:, k].astype(np.int32)
    c0 = words[:, k + 1].view("<u4").astype(np.float64)
    c1 = words[:, k + 3].view("<u4").astype(np.float64) if top > 1 else np.zeros(len(ctx))
    total = words[:, -1].view("<u4").astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        margin = ((c0 - c1) / total).astype(np.float32)
    arrays = MarkovArrays(ctx)
    succ = arrays.find([ctx[:, j] for j in range(1, k)] + [first])
    none = arrays.none
    arrays.first = np.append(first, np.int32(0))
    arrays.margin = np.append(margin, np.float32(0))
    arrays.succ = np.append(succ, none)
    return arrays

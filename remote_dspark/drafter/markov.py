"""The reference worker's drafter: a Markov model of order k, and its cache file.

Cache file format (little-endian; the sha256 of the whole file is the Markov identity
that engine and worker must agree on)::

    offset size field
         0    4 magic       b"DSMK"
         4    2 version     1
         6    2 order       k, 1..8
         8    2 top         next tokens kept per context, 1..16
        10    2 reserved    0
        12    4 n_contexts
        16      records, sorted by context, each:
                  k x i32            the context (oldest first)
                  top x (i32, u32)   next token and its count, count descending
                                     (unused tails: token -1, count 0)
                  u32                how often the context was seen

Drafting is greedy: from the last k tokens take the most frequent next token, append,
repeat; the top1-top2 margin is the probability gap between the two most frequent next
tokens. An unseen context ends the draft early (fewer than n_out tokens), and so does a
context shorter than k. A sampled round draws each token from the context's next-token
counts instead (:mod:`.markov_sampled`, over the same arrays).

Two ways to draft, equal value for value (the tests hold them to it):

* :meth:`MarkovModel.draft`: one context, a dict lookup per token (the reference).
* :meth:`MarkovModel.draft_batch`: all entries of a round at once with numpy (imported
  on first use, so importing this module never loads it). The table becomes arrays
  read straight from the cache bytes (:mod:`.markov_arrays`): one row per context (in the file's sorted order),
  its most frequent next token, its margin, and its *successor* row, the row of the
  context that drafting moves to after emitting that token (or none). Finding an
  entry's first row is one ``searchsorted`` over sorted keys: a mixed-radix int64 over
  the context tokens when the token range to the power k fits in 63 bits (the built-in
  model: 128**2), else fixed-width big-endian byte keys (exact for any model). After
  that, each draft step is one gather through the successor array for all entries.

With no file the worker uses :func:`builtin_model`: order 2, built from text of the
:class:`SyntheticLanguage` that the demo engine's target speaks, so drafts are right
often but not always, out of the box.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from .markov_arrays import MarkovArrays, arrays_of

if TYPE_CHECKING:  # numpy is imported on first use of draft_batch only
    import numpy as np

    from .contract import DraftBatch, DraftResult

MAGIC = b"DSMK"
VERSION = 1
MAX_ORDER = 8
MAX_TOP = 16
_HEAD = struct.Struct("<4sHHHHI")


@dataclass(frozen=True)
class Next:
    tokens: tuple[int, ...]  # most frequent first
    counts: tuple[int, ...]
    total: int


class MarkovModel:
    """An order-k next-token table with greedy drafting.

    ``identity`` is the sha256 of the model's cache-file bytes (:meth:`to_bytes`).
    """

    def __init__(self, order: int, top: int, table: dict[tuple[int, ...], Next]):
        if not 1 <= order <= MAX_ORDER:
            raise ValueError(f"Markov order {order} not in 1..{MAX_ORDER}")
        if not 1 <= top <= MAX_TOP:
            raise ValueError(f"Markov top {top} not in 1..{MAX_TOP}")
        self.order = order
        self.top = top
        self.table = table
        self._bytes = self._encode()
        self.identity = hashlib.sha256(self._bytes).digest()
        self._arrays: MarkovArrays | None = None  # draft_batch's tables, built on first use
        # The largest token id the model knows (contexts and next tokens) + 1: its
        # vocabulary as far as it can tell (0 for an empty model: unknown).
        self.vocab_size = max((max(ctx + nxt.tokens) for ctx, nxt in table.items()), default=-1) + 1

    # ------------------------------------------------------------------ building

    @classmethod
    def from_tokens(cls, tokens: Iterable[int], order: int = 2, top: int = 4) -> MarkovModel:
        counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        window: list[int] = []
        for t in tokens:
            if len(window) == order:
                counts[tuple(window)][t] += 1
                window.pop(0)
            window.append(t)
        table = {}
        for ctx, c in counts.items():
            best = sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
            table[ctx] = Next(tuple(t for t, _ in best), tuple(n for _, n in best), sum(c.values()))
        return cls(order, top, table)

    # ------------------------------------------------------------------ file

    def to_bytes(self) -> bytes:
        return self._bytes

    def _encode(self) -> bytes:
        rec = _record(self.order, self.top)
        parts = [_HEAD.pack(MAGIC, VERSION, self.order, self.top, 0, len(self.table))]
        for ctx in sorted(self.table):
            nxt = self.table[ctx]
            pad = self.top - len(nxt.tokens)
            pairs: list[int] = []
            for t, n in zip(nxt.tokens + (-1,) * pad, nxt.counts + (0,) * pad):
                pairs += (t, n)
            parts.append(rec.pack(*ctx, *pairs, nxt.total))
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "Markov cache") -> MarkovModel:
        """Raises: ValueError naming ``name`` when the bytes are not a valid cache."""
        if len(data) < _HEAD.size:
            raise ValueError(f"{name}: {len(data)} bytes, too short for a Markov cache")
        magic, version, order, top, _, n = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise ValueError(f"{name}: bad magic {magic!r} (expected {MAGIC!r})")
        if version != VERSION:
            raise ValueError(f"{name}: version {version}, this build reads {VERSION}")
        if not (1 <= order <= MAX_ORDER and 1 <= top <= MAX_TOP):
            raise ValueError(f"{name}: order {order} / top {top} out of range")
        rec = _record(order, top)
        size = rec.size
        if len(data) != _HEAD.size + n * size:
            raise ValueError(f"{name}: {len(data)} bytes, header says {_HEAD.size + n * size}")
        table = {}
        for i in range(n):
            vals = rec.unpack_from(data, _HEAD.size + i * size)
            ctx, pairs, total = vals[:order], vals[order:-1], vals[-1]
            toks = tuple(t for t, c in zip(pairs[0::2], pairs[1::2]) if c > 0)
            cnts = tuple(c for c in pairs[1::2] if c > 0)
            if not cnts or total < sum(cnts):
                raise ValueError(
                    f"{name}: record {i} (context {tuple(ctx)}): counts {cnts} "
                    f"and total {total}: a context needs a next token and total >= counts"
                )
            table[tuple(ctx)] = Next(toks, cnts, total)
        model = cls(order, top, table)
        if model._bytes != bytes(data):
            raise ValueError(f"{name}: records are not in canonical order")
        return model

    @classmethod
    def load(cls, path: str) -> MarkovModel:
        with open(path, "rb") as f:
            return cls.from_bytes(f.read(), path)

    def save(self, path: str) -> None:
        with open(path, "wb") as f:
            f.write(self._bytes)

    # ------------------------------------------------------------------ drafting

    def draft(self, context: Sequence[int], n_out: int) -> tuple[list[int], list[float]]:
        """Up to ``n_out`` greedy tokens after ``context``, with top1-top2 margins."""
        window = list(context[-self.order :])
        tokens: list[int] = []
        margins: list[float] = []
        while len(tokens) < n_out and len(window) == self.order:
            nxt = self.table.get(tuple(window))
            if nxt is None:
                break
            second = nxt.counts[1] if len(nxt.counts) > 1 else 0
            tokens.append(nxt.tokens[0])
            margins.append((nxt.counts[0] - second) / nxt.total)
            window = window[1:] + [nxt.tokens[0]]
        return tokens, margins

    def draft_batch(
        self, tokens: np.ndarray, offsets: np.ndarray, n_out: np.ndarray, width: int, margins: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """:meth:`draft` for n entries at once, with no loop over entries.

        Args:
            tokens: [T] int32, the entries' contexts laid end to end.
            offsets: [n + 1] ints: entry i's context is ``tokens[offsets[i]:offsets[i + 1]]``.
            n_out: [n] ints in 0..width, drafts wanted per entry.
            width: the result's second dimension.
            margins: False: no margins are computed (None in their place).

        Returns:
            (drafts [n, width] int32, counts [n] int32, margins [n, width] float32), row i
            equal to ``draft(context_i, n_out[i])`` (margins as float32), zero past counts[i].
            drafts and margins are transposed views (step-major underneath).
        """
        import numpy as np

        a = self.tables()
        k = self.order
        offsets = np.asarray(offsets, dtype=np.int64)
        n_out = np.asarray(n_out)
        tokens = np.asarray(tokens)
        if len(tokens) < k:  # every context is short; keep the gathers below in bounds
            tokens = np.zeros(k, np.int32)
        ends = offsets[1:]
        short = (ends - offsets[:-1]) < k  # too little context: no draft
        # The last k tokens of each entry, one column each (a short entry's columns are
        # junk from its neighbours, never used: ``short`` marks it unseen).
        row = a.find([tokens[ends - (k - j)] for j in range(k)], short)
        steps = np.empty((width, len(n_out)), np.int64)  # step-major: each step one row
        for s in range(width):  # one pass per draft step, all entries
            steps[s] = row
            row = a.succ[row]
        if len(n_out) and n_out.min() < width:  # (every entry wanting all width steps: nothing to cut)
            steps[np.arange(width)[:, None] >= n_out] = a.none
        # Past an unseen context a row stays ``none`` (its successor is itself, its token
        # and margin 0), so the live steps are a prefix and the count is how many there are.
        counts = np.count_nonzero(steps != a.none, axis=0).astype(np.int32)
        return a.first[steps].T, counts, a.margin[steps].T if margins else None

    def tables(self) -> MarkovArrays:
        """:meth:`draft_batch`'s arrays (``find``, ``none``, ``margin``), built on first use."""
        return self._arrays or self._build_arrays()

    def _build_arrays(self) -> MarkovArrays:
        self._arrays = arrays_of(memoryview(self._bytes)[_HEAD.size :], self.order, self.top)
        return self._arrays


class SyntheticLanguage:
    """A deterministic toy language over ``vocab`` tokens: after (a, b) the next token
    is usually ``first(a, b)``, sometimes ``second(a, b)``, rarely anything. The demo's
    target model speaks it; the built-in Markov model is learned from its text."""

    def __init__(self, vocab: int = 128, p_first: float = 0.8, p_second: float = 0.15, seed: int = 7):
        self.vocab = vocab
        self.p_first = p_first
        self.p_second = p_second
        self.seed = seed

    def _mix(self, a: int, b: int) -> int:
        return splitmix64((a * 1_000_003 + b) ^ (self.seed << 32))

    def choices(self, a: int, b: int) -> tuple[int, int]:
        h = self._mix(a, b)
        first = h % self.vocab
        second = (h >> 20) % self.vocab
        return first, second if second != first else (first + 1) % self.vocab

    def next_token(self, a: int, b: int, u: float, r: int) -> int:
        """The token after (a, b) for a uniform draw ``u`` in [0, 1) and a random int ``r``."""
        first, second = self.choices(a, b)
        if u < self.p_first:
            return first
        if u < self.p_first + self.p_second:
            return second
        return r % self.vocab

    def text(self, n: int, seed: int = 1) -> list[int]:
        state = seed
        out = [0, 1]
        while len(out) < n:
            state = splitmix64(state)
            u = (state >> 11) / float(1 << 53)
            state = splitmix64(state)
            out.append(self.next_token(out[-2], out[-1], u, state))
        return out


def _record(order: int, top: int) -> struct.Struct:
    return struct.Struct("<" + "i" * order + "iI" * top + "I")


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


@lru_cache(maxsize=1)
def builtin_model() -> MarkovModel:
    """The default model: order 2 over 60,000 tokens of the synthetic language."""
    return MarkovModel.from_tokens(SyntheticLanguage().text(60_000), order=2, top=4)


def read_tokens(path: str) -> list[int]:
    """Tokens from a file: whitespace-separated integers (``.txt``), else raw int32 LE.

    Raises: ValueError naming the file and what is wrong.
    """
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".txt"):
        try:
            return [int(t) for t in data.split()]
        except ValueError as e:
            raise ValueError(f"{path}: not whitespace-separated integers ({e})") from e
    if len(data) % 4:
        raise ValueError(
            f"{path}: {len(data)} bytes is not a whole number of int32 tokens (use a .txt file for text tokens)"
        )
    return list(struct.unpack(f"<{len(data) // 4}i", data))


class MarkovDrafter:
    """The default drafter: greedy drafting from a :class:`MarkovModel`, batched
    (:meth:`MarkovModel.draft_batch`) and per entry (``draft``, the reference); a sampled
    round is batched only (:func:`.markov_sampled.draft_sampled`). Its drafts depend on
    each context alone, so a batch may mix sessions."""

    mixed_sessions = True
    samples = True

    def __init__(self, model: MarkovModel, drafter_identity: bytes | None = None):
        self.model = model
        self.markov_identity = model.identity
        self.drafter_identity = drafter_identity or default_drafter_identity(model)
        self.vocab_size = model.vocab_size or None  # its largest token id + 1
        self.context_read = max(1, model.order)  # a context's last ``order`` tokens decide its drafts

    def draft(self, context, n_out, row):
        return self.model.draft(context, n_out)

    def draft_batch(self, batch: DraftBatch) -> DraftResult:
        from .contract import DraftResult

        if batch.sampled:
            from .markov_sampled import draft_sampled

            return draft_sampled(self.model, batch)
        b = batch
        return DraftResult(*self.model.draft_batch(b.tokens, b.offsets, b.n_out, b.width, margins=b.want_margin))


def default_drafter_identity(model: MarkovModel) -> bytes:
    return hashlib.sha256(f"remote-dspark markov drafter v1 order={model.order}".encode()).digest()

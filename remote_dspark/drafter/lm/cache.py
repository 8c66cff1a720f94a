"""The model drafter's KV store and its cache: a row per stream, kept across rounds.

Layout (one tensor on the model's device, in its dtype, :class:`KVStore`)::

    kv  [cache rows + scratch rows, layers, 2 (K, V), heads, max_tokens + 1, head_dim]

A round works in place on it: each entry's queries write their keys and values into
their own row and attend to it where it lies (:mod:`.attention`), so no row is copied
in or out. The last column of every row is the trash column, where padding queries
write. The cache rows' memory is fixed at start: ``cache rows x layers x 2 x heads x
(max_tokens + 1) x head_dim x dtype bytes`` (the built-in model, 1024 rows of 144
tokens: 152 MB in float32, 76 MB in bf16). Scratch rows, after them, hold the entries
of a round that have no cache row (a drafter without a cache, or a round of more
entries than rows); they grow, to a power of two, with the largest such round, and the
worker reserves them for its budget at start (``LMDrafter.reserve``).

:class:`SlotCache` keeps the cache rows' bookkeeping, in arrays indexed by row (no
object per stream)::

    owner_session, owner_slot  the stream's key (session -1: the row is free)
    gen        the slot's generation when cached (-1: matches nothing)
    length     tokens the stream had when cached
    fill       columns of the row in use: the stream's last ``fill`` tokens up to
               ``length``, at columns 0..fill-1
    origin     the absolute position of the row's column 0 (column c holds the token
               at position origin + c: its true position, whatever the row's start)
    used       the round that last used it (least recently used goes first)
    hit_at     the round that last drafted it from cached state (NEVER: not since cached)

A stream is ``(session, slot, gen)`` (:class:`remote_dspark.drafter.DraftBatch`); the
row of ``(session, slot)`` is found through one array per session (slot -> row, -1:
none). An entry's row is a hit iff its gen matches, ``length <= lengths[i]``, the new
tokens ``lengths[i] - length`` are all in the context, and they fit with the round's
drafts (``fill + new + width <= max_tokens``), they hold at least what a re-encode
would (``fill + new >= min(context, max_tokens - width)``: a row kept short by a wider
round is not a hit), and the context ends where the row's new tokens end
(``origin + fill + new``: the same positions). A hit encodes only the new tokens at
columns ``fill...`` (with no new token it re-encodes the last one, whose logits were
not kept); a miss re-encodes the context from column 0, its last ``max_tokens -
width`` tokens at most, at their true positions (``origin`` the first's). A stream that
outgrows its row is thus re-encoded from its current window (at its true positions):
while a stream fits the worker's window the cache equals re-encoding, and past it a row
drafts from up to ``max_tokens`` tokens of history. Draft tokens are
written into the row during a round but never counted in ``fill``. ``width`` is each
entry's own: an entry that asks for no drafts (``n_out`` 0) takes no draft steps, so it
needs no room for them (an encode only: its row keeps its tokens for its next round).
:meth:`SlotCache.encodes` tells, without changing anything, what :meth:`SlotCache.plan`
would encode now (the worker's charge for an entry in a call's budget).

Not thread-safe: the drafter holds its lock around :meth:`SlotCache.plan` and the round.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from ..contract import CacheInfo

_KEEP = np.iinfo(np.int64).max  # a row in use this round: never chosen for a newcomer
NEVER = -(1 << 40)  # hit_at of a row not hit since it was cached
PROTECT_CALLS = 64  # a row hit within this many calls is its session's while the session is within its share


@dataclass(frozen=True)
class Plan:
    """What a round encodes, per entry (entry order)."""

    rows: np.ndarray  # [n] int64: the entry's cache row, -1: none (no cache, or no room)
    base: np.ndarray  # [n] int64: columns kept from the row (0: encode from column 0)
    take: np.ndarray  # [n] int64: tokens to encode, the context's last ``take``
    hit: np.ndarray  # [n] bool: drafted from cached state
    origin: np.ndarray  # [n] int64: the absolute position of the row's column 0


def uncached_plan(ctx_lens: np.ndarray, width, max_tokens: int, starts: np.ndarray | None) -> Plan:
    """Every entry re-encoded from column 0 at its true positions (a batch with no
    stream names; ``width``: the round's or each entry's, as :meth:`SlotCache.plan`;
    ``starts``: each context's first position, None: as :meth:`SlotCache.plan`)."""
    n = len(ctx_lens)
    take = np.minimum(ctx_lens, max_tokens - width).astype(np.int64)
    origin = np.zeros(n, np.int64) if starts is None else starts + ctx_lens - take
    return Plan(np.full(n, -1, np.int64), np.zeros(n, np.int64), take, np.zeros(n, bool), origin)


ROW_SPARE = 16  # a default row's positions past two windows: room for drafts


def row_tokens(window: int, max_positions: int | None, asked: int | None = None) -> int:
    """The tokens of a cache row: ``asked``, else ``2 * window + ROW_SPARE`` (a stream
    re-encoded from its window has ``window`` tokens of room before its next re-encode),
    at most the model's positions.

    Raises: ValueError for rows that cannot hold a window and a draft, or pass the table."""
    table = max_positions if max_positions is not None else 1 << 30
    tokens = asked or min(2 * window + ROW_SPARE, table)
    if not window < tokens <= table:
        raise ValueError(
            f"rows of {tokens} tokens (--lm-row-tokens): must be in {window + 1}..{table} "
            f"(more than the window of {window} (--window), within the model's positions)"
        )
    return tokens


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


MIN_SCRATCH = 16  # scratch rows at least, once a round needs any


class KVStore:
    """The rows of every round (module docstring): ``cache_rows`` for the cache, then
    scratch rows, grown by :meth:`scratch` to what a round needs.

    Raises: ValueError for cache rows that do not fit in the device's free memory,
    naming the flags that size them.
    """

    def __init__(
        self,
        cache_rows: int,
        layers: int,
        heads: int,
        head_dim: int,
        max_tokens: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if cache_rows < 0 or max_tokens < 2:
            raise ValueError(f"cache rows {cache_rows}, max_tokens {max_tokens}: must be >= 0 and >= 2")
        self.cache_rows, self.columns = cache_rows, max_tokens + 1  # the last: the trash column
        self.device, self.dtype = torch.device(device), dtype
        self._row_shape = (layers, 2, heads, self.columns, head_dim)
        what = f"a KV cache of {cache_rows} streams (--lm-cache-slots) x {max_tokens} tokens (--lm-row-tokens)"
        self.kv = self._allocate(cache_rows, what)
        self.version = 0  # bumped when ``kv`` is reallocated (what holds its address must let go)

    def _allocate(self, rows: int, what: str) -> torch.Tensor:
        """``rows`` zeroed rows, refused (naming ``what`` needs them) over the free memory."""
        need, free = rows * self.row_bytes(), memory_free(self.device)
        if need > free:
            raise ValueError(f"{what} needs {need / 2**20:,.0f} MiB; {free / 2**20:,.0f} MiB are free on {self.device}")
        return torch.zeros((rows, *self._row_shape), device=self.device, dtype=self.dtype)

    def row_bytes(self) -> int:
        return int(np.prod(self._row_shape)) * torch.finfo(self.dtype).bits // 8

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def scratch(self, k: int) -> np.ndarray:
        """Rows for ``k`` entries without a cache row (int64 [k]), the store grown (its
        cache rows kept, :attr:`version` bumped) when it has fewer scratch rows.

        Raises: ValueError when the grown store does not fit in the free memory."""
        have = len(self.kv) - self.cache_rows
        if k > have:
            rows = max(MIN_SCRATCH, 1 << (k - 1).bit_length())
            what = f"a round of {k} entries without a cache row (--lm-cache-slots, --lm-row-tokens)"
            grown = self._allocate(self.cache_rows + rows, what)
            grown[: self.cache_rows] = self.kv[: self.cache_rows]
            self.kv = grown
            self.version += 1
        return self.cache_rows + np.arange(k, dtype=np.int64)


class SlotCache:
    """The cache rows' bookkeeping (module docstring): rows ``0..capacity-1`` of the store.

    Invariants: a row is owned by at most one ``(session, slot)`` and that session's map
    names it, and only it; ``0 <= fill <= max_tokens``.
    """

    def __init__(self, capacity: int, max_tokens: int, row_bytes: int = 0):
        if capacity < 1 or max_tokens < 2:
            raise ValueError(f"cache capacity {capacity}, max_tokens {max_tokens}: must be >= 1 and >= 2")
        self.capacity, self.max_tokens, self.row_bytes = capacity, max_tokens, row_bytes
        self.owner_session = np.full(capacity, -1, np.int64)
        self.owner_slot = np.zeros(capacity, np.int64)
        self.gen = np.full(capacity, -1, np.int64)
        self.length = np.zeros(capacity, np.int64)
        self.fill = np.zeros(capacity, np.int64)
        self.origin = np.zeros(capacity, np.int64)
        self.used = np.full(capacity, -1, np.int64)
        self.hit_at = np.full(capacity, NEVER, np.int64)
        self._maps: dict[int, np.ndarray] = {}  # session -> [slots] row of each slot, -1: none
        self._tick = 0
        self.hits = self.misses = 0

    def info(self) -> CacheInfo:
        return CacheInfo(
            int(np.count_nonzero((self.owner_session >= 0) & (self.gen >= 0))),  # rows with usable state
            self.capacity,
            self.capacity * self.row_bytes,
            self.hits,
            self.misses,
        )

    def plan(
        self,
        sessions: np.ndarray,
        slots: np.ndarray,
        gens: np.ndarray,
        lengths: np.ndarray,
        ctx_lens: np.ndarray,
        width: int | np.ndarray,
        starts: np.ndarray | None,
    ) -> Plan:
        """Rows for a round's entries (a row per stream; which rows newcomers take:
        :meth:`_rows_of`) and what each must encode; the rows' bookkeeping is set to the state
        after the round (:meth:`forget` undoes it for a round that failed).

        Args: the batch's stream fields, a session per entry (a batch may mix the rounds
            of several engines), and each context's length (int64 arrays), the drafts
            each entry takes (the round's width, or [n] int64: 0 for an encode only;
            < max_tokens), each context's first position (int64; None:
            a batch without positions, numbered from the row's start: column c at
            position c, and no check that a row's positions continue).
        """
        self._tick += 1
        rows = np.full(len(slots), -1, np.int64)
        for s in np.unique(sessions).tolist():  # the few engines of the round
            mine = sessions == s
            rows[mine] = self._rows_of(s, slots[mine])
        hit, base, take, origin = self._encode(rows, gens, lengths, ctx_lens, width, starts)
        rh = rows[hit]
        have = rows >= 0
        self.gen[rows[have]] = np.where(ctx_lens[have] > 0, gens[have], -1)
        self.length[rows[have]] = lengths[have]
        self.fill[rows[have]] = base[have] + take[have]
        self.origin[rows[have]] = origin[have]
        self.used[rows[have]] = self._tick
        self.hit_at[rh] = self._tick
        n_hit = len(rh)
        self.hits += n_hit
        self.misses += len(rows) - n_hit
        return Plan(rows, base, take, hit, origin)

    def encodes(
        self,
        sessions: np.ndarray,
        slots: np.ndarray,
        gens: np.ndarray,
        lengths: np.ndarray,
        ctx_lens: np.ndarray,
        width: int | np.ndarray,
        starts: np.ndarray | None,
    ) -> np.ndarray:
        """[n] int64: the tokens :meth:`plan` would encode for each entry now (the new
        ones on a hit, the re-encode on a miss), nothing changed. Args: as :meth:`plan`,
        but ``sessions`` may be one int for all (a round of one engine: no grouping)."""
        rows = np.full(len(slots), -1, np.int64)
        one = np.ndim(sessions) == 0
        for s in [int(sessions)] if one else np.unique(sessions).tolist():
            m = self._maps.get(s)
            if m is not None:
                mine = np.arange(len(slots)) if one else np.flatnonzero(sessions == s)
                inside = mine[slots[mine] < len(m)]
                rows[inside] = m[slots[inside]]
        return self._encode(rows, gens, lengths, ctx_lens, width, starts)[2]

    def _encode(self, rows, gens, lengths, ctx_lens, width, starts):
        """Which entries (with their ``rows``, -1: none) are hits (module docstring), and
        each entry's columns kept, tokens to encode and row origin: ``(hit, base, take,
        origin)``, nothing changed."""
        ok = rows >= 0
        r = rows[ok]
        wide = np.broadcast_to(np.asarray(width, np.int64), rows.shape)
        new = lengths[ok] - self.length[r]
        ok_r = (
            (self.gen[r] == gens[ok])
            & (new >= 0)
            & (new <= ctx_lens[ok])
            & (self.fill[r] > 0)
            & (self.fill[r] + np.maximum(new, 1) + wide[ok] <= self.max_tokens)
            # at least what re-encoding would encode (a row kept short by a wider round)
            & (self.fill[r] + new >= np.minimum(ctx_lens[ok], self.max_tokens - wide[ok]))
        )
        if starts is not None:  # the new tokens continue the row's positions
            ok_r &= self.origin[r] + self.fill[r] + new == starts[ok] + ctx_lens[ok]
        hit = np.zeros(len(rows), bool)
        hit[ok] = ok_r
        base = np.zeros(len(rows), np.int64)
        take = np.minimum(ctx_lens, self.max_tokens - wide).astype(np.int64)
        h, rh, nh = np.flatnonzero(hit), r[ok_r], new[ok_r]
        base[h] = self.fill[rh] - (nh == 0)  # no new token: the last one again (its logits)
        take[h] = np.maximum(nh, 1)
        origin = np.zeros(len(rows), np.int64) if starts is None else starts + ctx_lens - take
        origin[h] = self.origin[rh]
        return hit, base, take, origin

    def held(self, session: int, slot: int) -> tuple[int, int] | None:
        """What the row of ``(session, slot)`` holds: the position of its first token and
        how many (None: no row, or none with usable state). Tests compare against it."""
        m = self._maps.get(session)
        row = int(m[slot]) if m is not None and slot < len(m) else -1
        if row < 0 or self.gen[row] < 0:
            return None
        return int(self.origin[row]), int(self.fill[row])

    def forget(self, rows: np.ndarray) -> None:
        """The rows' cached state is not to be used (a round that failed midway)."""
        self.gen[rows[rows >= 0]] = -1

    def _rows_of(self, session: int, slots: np.ndarray) -> np.ndarray:
        """Each slot's row, newcomers given free or least recently used rows (not one
        used by this round: another session's entries may have taken rows already);
        -1 for those left without (more entries than rows, drafted from scratch rows).

        Fair between sessions: a newcomer never takes another session's row that was hit
        within the last ``PROTECT_CALLS`` calls while that session holds no more than its
        share (the rows over the sessions holding rows, this one counted). So a flood of
        streams that never hit (NEW_GEN every round) takes its own rows and cold ones,
        never those of an engine drafting from its cache; within a session, and beyond a
        share, the least recently used row goes first."""
        m = self._maps.get(session)
        top = int(slots.max()) + 1 if len(slots) else 0
        if m is None or len(m) < top:
            grown = np.full(max(top, 2 * len(m) if m is not None else 16), -1, np.int64)
            if m is not None:
                grown[: len(m)] = m
            m = self._maps[session] = grown
        rows = m[slots]
        need = np.flatnonzero(rows < 0)
        if not len(need):
            self.used[rows] = self._tick
            return rows
        key = self.used.copy()
        key[self._guarded(session)] = _KEEP
        key[rows[rows >= 0]] = _KEEP
        key[self.used == self._tick] = _KEEP
        got = np.argsort(key, kind="stable")[: len(need)]
        got = got[key[got] != _KEEP]
        self._evict(got)
        self._maps[session] = m  # again: _evict drops a map it empties, this one included
        need = need[: len(got)]
        self.owner_session[got] = session
        self.owner_slot[got] = slots[need]
        self.gen[got] = -1
        self.hit_at[got] = NEVER
        m[slots[need]] = got
        rows[need] = got
        self.used[rows[rows >= 0]] = self._tick
        return rows

    def _guarded(self, session: int) -> np.ndarray:
        """[capacity] bool: the rows ``session``'s newcomers may not take (:meth:`_rows_of`):
        other sessions' rows hit within ``PROTECT_CALLS`` calls, of sessions within
        their share."""
        owner = self.owner_session
        held = owner >= 0
        owners, counts = np.unique(owner[held], return_counts=True)
        share = self.capacity // (len(owners) + int(session not in owners))
        over = np.isin(owner, owners[counts > share])
        hot = self.hit_at >= self._tick - PROTECT_CALLS
        return held & (owner != session) & hot & ~over

    def _evict(self, got: np.ndarray) -> None:
        """Drop the rows' old owners from their sessions' maps (a loop over the few
        distinct sessions among them), and a map left empty with them."""
        owned = got[self.owner_session[got] >= 0]
        for s in np.unique(self.owner_session[owned]).tolist():
            old = owned[self.owner_session[owned] == s]
            m = self._maps[s]
            m[self.owner_slot[old]] = -1
            if not (m >= 0).any():
                del self._maps[s]
        self.owner_session[got] = -1

"""The model drafter's cache of streams kept across rounds, over the paged KV pool
(:mod:`.pool`: blocks, a block table per stream).

:class:`SlotCache` keeps the cache rows' bookkeeping, in arrays indexed by row (no
object per stream)::

    owner_session, owner_slot  the stream's key (session -1: the row is free)
    gen        the slot's generation when cached (-1: matches nothing; no usable KV)
    length     tokens the stream had when cached
    fill       columns of the row in use: the stream's tokens up to ``length``, its
               last ``fill``, at columns 0..fill-1
    origin     the absolute position of the row's column 0
    used       the round that last used it (least recently used goes first)
    hit_at     the round that last drafted it from cached state (NEVER: not since cached)

A stream is ``(session, slot, gen)`` (:class:`remote_dspark.drafter.DraftBatch`); the
row of ``(session, slot)`` is found through one array per session (slot -> row, -1:
none). An entry's row is a hit iff its gen matches, ``length <= lengths[i]``, the new
tokens ``lengths[i] - length`` are all still readable (the worker holds the stream from
``kept_from``: :mod:`remote_dspark.drafter.streams`), they fit with the entry's drafts
(``fill + new + width <= columns``), the row holds at least what a re-encode would, and
the new tokens continue the row's positions. A hit encodes only the new tokens at
columns ``fill...`` (with no new token it re-encodes the last one, whose logits were not
kept); a miss re-encodes the stream from column 0: all the worker holds of it, its last
``columns - width`` tokens at most, at their true positions. So a stream drafts from its
whole sequence (up to ``max_context``) however long it grows. Draft tokens are written
into the row during a round but never counted in ``fill``. An entry that asks for no
drafts (``n_out`` 0) takes no draft steps and needs no room for them.
:meth:`SlotCache.encodes` tells, without changing anything, what :meth:`SlotCache.plan`
would encode now (the worker's charge for an entry in a call's budget).

When a round needs more blocks than are free, whole streams' KV is evicted, least
recently used first (:meth:`SlotCache.make_room`), never a stream of this round still
to run, and never one of another engine's streams hit within ``PROTECT_CALLS`` calls
while that engine holds no more than its share of the blocks; an evicted stream keeps
its row and is re-encoded from the worker's tokens when next drafted. A round whose
streams alone pass the pool runs in waves, as many entries as fit at a time (the
drafter's): a wave's scratch blocks go back, and a stream drafted in an earlier wave
may be evicted for a later one. The guard is a preference: a wave that could run no
entry goes without it, and if the round's own streams still hold every block, its
first waiting entry runs and the others get no drafts this round (their KV given back,
re-encoded when next drafted): a round never fails for the pool.

Not thread-safe: the drafter holds its lock around a plan and the round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contract import CacheInfo
from .pool import KVStore

_KEEP = np.iinfo(np.int64).max  # a row in use this round: never chosen for a newcomer
NEVER = -(1 << 40)  # hit_at of a row not hit since it was cached
PROTECT_CALLS = 64  # a row hit within this many calls is its session's while the session is within its share


@dataclass(frozen=True)
class Plan:
    """What a round encodes, per entry (entry order)."""

    rows: np.ndarray  # [n] int64: the entry's cache row, -1: none (no cache, or no row left)
    base: np.ndarray  # [n] int64: columns kept from the row (0: encode from column 0)
    take: np.ndarray  # [n] int64: tokens to encode, the stream's last ``take``
    hit: np.ndarray  # [n] bool: drafted from cached state
    origin: np.ndarray  # [n] int64: the absolute position of the row's column 0


def uncached_plan(ctx_lens: np.ndarray, held: np.ndarray, width, columns: int, starts: np.ndarray | None) -> Plan:
    """Every entry re-encoded from column 0 at its true positions: its last ``held``
    tokens (all a stream's tokens the worker holds; its context's length for a batch
    with no streams) up to ``columns - width`` (``width``: the round's or each entry's,
    as :meth:`SlotCache.plan`; ``starts``: each context's first position, None: 0)."""
    n = len(ctx_lens)
    take = np.minimum(held, columns - width).astype(np.int64)
    origin = np.zeros(n, np.int64) if starts is None else starts + ctx_lens - take
    return Plan(np.full(n, -1, np.int64), np.zeros(n, np.int64), take, np.zeros(n, bool), origin)


class SlotCache:
    """The cache rows' bookkeeping (module docstring): rows ``0..capacity-1`` of the
    store's table, their blocks the store's.

    Invariants: a row is owned by at most one ``(session, slot)`` and that session's map
    names it, and only it; ``0 <= fill <= columns``; a row with usable state (``gen >=
    0``) holds the blocks of its ``fill`` columns.
    """

    def __init__(self, store: KVStore):
        capacity = store.cache_rows
        if capacity < 1:
            raise ValueError(f"cache capacity {capacity}: must be >= 1")
        self.store, self.capacity, self.columns = store, capacity, store.columns
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
        self.hits = self.misses = self.evicted = 0

    def info(self) -> CacheInfo:
        s = self.store
        return CacheInfo(
            int(np.count_nonzero((self.owner_session >= 0) & (self.gen >= 0))),  # rows with usable state
            self.capacity,
            s.nbytes(),
            self.hits,
            self.misses,
            blocks_used=s.blocks - 1 - s.n_free,
            blocks_free=s.n_free,
            evicted=self.evicted,
        )

    def plan(self, sessions, slots, gens, lengths, ctx_lens, kept, width, starts) -> Plan:
        """Rows for a round's entries (a row per stream; which rows newcomers take:
        :meth:`_rows_of`) and what each must encode; the rows' bookkeeping is set to the state
        after the round (:meth:`forget` undoes it for entries not run).

        Args: the batch's stream fields, a session per entry (a batch may mix the rounds
            of several engines), each context's length, each stream's first index the
            worker holds (``kept``; int64 arrays), the drafts each entry takes (the round's
            width, or [n] int64: 0 for an encode only; < columns), each context's first
            position (int64; None: a batch without positions, numbered from the row's
            start: column c at position c, and no check that a row's positions continue).
        """
        self._tick += 1
        rows = np.full(len(slots), -1, np.int64)
        for s in np.unique(sessions).tolist():  # the few engines of the round
            mine = sessions == s
            rows[mine] = self._rows_of(s, slots[mine])
        hit, base, take, origin = self._encode(rows, gens, lengths, ctx_lens, kept, width, starts)
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

    def encodes(self, sessions, slots, gens, lengths, ctx_lens, kept, width, starts) -> np.ndarray:
        """[n] int64: the tokens :meth:`plan` would encode for each entry now (the new
        ones on a hit, the re-encode on a miss), nothing changed. Args: as :meth:`plan`,
        but ``sessions`` may be one int for all (a round of one engine: no grouping)."""
        return self._encode(self.rows_of(sessions, slots), gens, lengths, ctx_lens, kept, width, starts)[2]

    def rows_of(self, sessions, slots: np.ndarray) -> np.ndarray:
        """[n] int64: each ``(session, slot)``'s row, -1: none (``sessions`` [n], or one
        int for all), nothing changed."""
        rows = np.full(len(slots), -1, np.int64)
        one = np.ndim(sessions) == 0
        for s in [int(sessions)] if one else np.unique(sessions).tolist():
            m = self._maps.get(s)
            if m is not None:
                mine = np.arange(len(slots)) if one else np.flatnonzero(sessions == s)
                inside = mine[slots[mine] < len(m)]
                rows[inside] = m[slots[inside]]
        return rows

    def moved(self, rows: np.ndarray, lengths: np.ndarray, fill: np.ndarray) -> None:
        """The rows' streams moved on without a round of their own (a pre-drafted outcome
        taken: :mod:`.speculate`): ``lengths`` tokens, ``fill`` columns, hit now."""
        self._tick += 1
        self.length[rows], self.fill[rows] = lengths, fill
        self.used[rows] = self.hit_at[rows] = self._tick
        self.hits += len(rows)

    def _encode(self, rows, gens, lengths, ctx_lens, kept, width, starts):
        """Which entries (with their ``rows``, -1: none) are hits (module docstring), and
        each entry's columns kept, tokens to encode and row origin: ``(hit, base, take,
        origin)``, nothing changed."""
        ok = rows >= 0
        r = rows[ok]
        wide = np.broadcast_to(np.asarray(width, np.int64), rows.shape)
        reencode = np.minimum(lengths - kept, self.columns - wide).astype(np.int64)
        new = lengths[ok] - self.length[r]
        ok_r = (
            (self.gen[r] == gens[ok])
            & (new >= 0)
            & (self.length[r] >= kept[ok])  # the new tokens are all readable
            & (self.fill[r] > 0)
            & (self.fill[r] + np.maximum(new, 1) + wide[ok] <= self.columns)
            & (self.fill[r] + new >= reencode[ok])  # at least what a re-encode would hold
        )
        if starts is not None:  # the new tokens continue the row's positions
            ok_r &= self.origin[r] + self.fill[r] + new == starts[ok] + ctx_lens[ok]
        hit = np.zeros(len(rows), bool)
        hit[ok] = ok_r
        base = np.zeros(len(rows), np.int64)
        take = reencode.copy()
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
        """The rows' cached state is not to be used (entries not run, or a round that
        failed midway), and their blocks go back: the device's table may not have their
        new cells."""
        rows = rows[rows >= 0]
        self.gen[rows] = -1
        self.store.release(rows)

    def make_room(self, short: int, sessions: np.ndarray, keep: np.ndarray, guard: bool = True) -> None:
        """Evict whole streams' KV, least recently used first, until ``short`` more blocks
        are free or none may go: never one of the ``keep`` rows (this round's still to
        run), and with ``guard`` never a hot row of another session within its share of
        the blocks (module docstring; ``sessions``: this round's): the guard is a
        preference, which a round that could run nothing otherwise goes without. An
        evicted row keeps its stream, with no usable state."""
        held = self.store.held[: self.capacity]
        key = self.used.copy()
        key[held == 0] = _KEEP
        key[keep[keep < self.capacity]] = _KEEP
        if guard:
            key[self._guarded(np.unique(sessions), held)] = _KEEP
        order = np.argsort(key, kind="stable")
        order = order[key[order] != _KEEP]
        go = order[: int(np.searchsorted(np.cumsum(held[order]), short)) + 1]
        self.evicted += len(go)
        self.gen[go] = -1
        self.hit_at[go] = NEVER
        self.store.release(go)

    def _rows_of(self, session: int, slots: np.ndarray) -> np.ndarray:
        """Each slot's row, newcomers given free or least recently used rows (not one
        used by this round: another session's entries may have taken rows already);
        -1 for those left without (more entries than rows, drafted in scratch rows).
        A newcomer never takes a row guarded from it (:meth:`_guarded`); a row taken
        gives its blocks back."""
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
        key[self._guarded(np.array([session]), self.store.held[: self.capacity])] = _KEEP
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

    def _guarded(self, sessions: np.ndarray, held: np.ndarray) -> np.ndarray:
        """[capacity] bool: the rows ``sessions``' newcomers may not take: other sessions'
        rows hit within ``PROTECT_CALLS`` calls, of sessions holding no more than their
        share of the blocks in use (``held``: each row's blocks)."""
        owner = self.owner_session
        holding = (owner >= 0) & (held > 0)
        owners, inv = np.unique(owner[holding], return_inverse=True)
        blocks = np.bincount(inv, weights=held[holding], minlength=len(owners))
        share = int(held.sum()) / max(1, len(np.union1d(owners, sessions)))
        over = np.isin(owner, owners[blocks > share])
        hot = self.hit_at >= self._tick - PROTECT_CALLS
        return (owner >= 0) & ~np.isin(owner, sessions) & hot & ~over

    def _evict(self, got: np.ndarray) -> None:
        """Drop the rows' old owners from their sessions' maps (a loop over the few
        distinct sessions among them), and a map left empty with them; their blocks go
        back."""
        owned = got[self.owner_session[got] >= 0]
        for s in np.unique(self.owner_session[owned]).tolist():
            old = owned[self.owner_session[owned] == s]
            m = self._maps[s]
            m[self.owner_slot[old]] = -1
            if not (m >= 0).any():
                del self._maps[s]
        self.owner_session[got] = -1
        self.store.release(got)

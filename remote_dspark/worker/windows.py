"""The worker's per-slot windows (:mod:`remote_dspark.worker` keeps one per session).

A session's windows are one ring array (:class:`Windows`: ``[max_slots, keep + window]``
tokens plus per-slot counters), updated with scatter writes for all entries of a round
at once (a round names each slot at most once, so the writes never collide) and read
back as every entry's context with one gather: no Python loop over the entries. A
session whose drafter keeps whole streams keeps each slot's last ``keep`` tokens, more
than its ``window`` context, for that drafter to read (:meth:`Windows.read`, through the
worker's one reader, :class:`~.history.History`).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .. import wire

_SERIALS = itertools.count(1)  # Windows.serial: never reused in a process's life


@dataclass(frozen=True)
class Advanced:
    """What :meth:`Windows.advance` made of a round: which entries have a window, and the
    windows of those (``m`` of the round's ``n`` entries, in entry order)."""

    ok: np.ndarray  # [n] bool: the entry's slot has a window (else: RESYNC)
    tokens: np.ndarray  # [T] int32: the m contexts, each the slot's window after the round
    offsets: np.ndarray  # [m + 1] int64
    slots: np.ndarray  # [m] int64
    gens: np.ndarray  # [m] int64: the slots' generations (Windows.gen)
    lengths: np.ndarray  # [m] int64: tokens each slot has had since its NEW_GEN
    starts: np.ndarray  # [m] int64: the absolute position of each context's first token


class Windows:
    """One session's windows: a ring of the last ``keep`` tokens per slot (``keep >=
    window``; None: ``window``), of which the last ``window`` are the slot's context.

    Arrays (index: slot)::

        ring      [max_slots, keep + window] int32  token j of the slot (since its NEW_GEN)
                                             at column j % keep, and also at column
                                             keep + j % keep when j % keep < window
        written   [max_slots] int64          tokens written since the slot's NEW_GEN
        gen       [max_slots] int64          NEW_GENs the slot has had (a drafter's cache key)
        next_pos  [max_slots] int64          the position the slot's next token must have
        known     [max_slots] bool           the slot has a window

    The slot's window is its last ``min(written, window)`` tokens, oldest first: the ring's
    first ``window`` columns are written twice so that any window is ``window``
    consecutive cells of the row (read for all entries with one gather, :meth:`advance`);
    the slot holds stream indices ``written - min(written, keep)`` on (:meth:`read`).
    4 bytes a kept token, plus ``window`` of them a slot. A slot that is not
    ``known`` has no window; its other fields are stale and never read.
    ``lock`` serializes :meth:`advance` with :meth:`forget_all` (called from another
    connection's thread when a new session of the engine replaces this one); a round
    served in C (:mod:`.lane`) is serialized with it by ``guard``, a word the C library
    takes around such a round and in ``native_forget`` (set by :mod:`.native_round`).
    """

    def __init__(self, max_slots: int, window: int, keep: int | None = None):
        keep = window if keep is None else keep
        if window < 1 or keep < window:
            raise ValueError(f"window {window}, keep {keep}: must be 1 <= window <= keep")
        self.max_slots, self.window, self.keep = max_slots, window, keep
        self.ring = np.zeros((max_slots, keep + window), np.int32)  # np.zeros: pages come as written
        # Every span of ``window`` consecutive ring cells, as a read-only view: the span
        # at ``slot * (keep + window) + start`` is a window starting at column ``start``.
        flat = self.ring.reshape(-1)
        self._spans = as_strided(
            flat, (flat.size - window + 1, window), (flat.itemsize, flat.itemsize), writeable=False
        )
        self.serial = next(_SERIALS)
        self.written = np.zeros(max_slots, np.int64)
        self.gen = np.zeros(max_slots, np.int64)
        self.next_pos = np.zeros(max_slots, np.int64)
        self.known = np.zeros(max_slots, bool)
        self.lock = threading.Lock()
        # The C library's guard word, held while a round served in C changes these windows,
        # and the C forget that takes it (set by native_round with the windows' view).
        self.guard = np.zeros(1, np.uint32)
        self.native_forget = None

    @staticmethod
    def bytes_of(max_slots: int, window: int, keep: int | None = None) -> int:
        """The bytes a session's windows of these terms hold at most (the ring, 4 bytes a
        cell, and the per-slot counters; the ring's pages come as they are written)."""
        return max_slots * (4 * ((window if keep is None else keep) + window) + 25)

    @property
    def nbytes(self) -> int:
        return self.bytes_of(self.max_slots, self.window, self.keep)

    def forget_all(self) -> None:
        with self.lock:
            if self.native_forget is not None:
                self.native_forget()
            else:
                self.known[:] = False

    def check_slots(self, slots: np.ndarray) -> None:
        """Raises wire.ProtocolError naming the entry: a slot outside the session, or a
        slot named twice in one round (the scatter writes rely on unique slots)."""
        if not len(slots):
            return
        over = slots >= self.max_slots
        if over.any():
            i = int(np.argmax(over))
            raise wire.ProtocolError(
                f"ROUND slots[{i}]: slot {int(slots[i])} outside the session's {self.max_slots} slots"
            )
        seen = np.bincount(slots, minlength=self.max_slots)
        if seen.max() > 1:
            slot = int(np.argmax(seen > 1))
            first, second = np.flatnonzero(slots == slot)[:2]
            raise wire.ProtocolError(f"ROUND slots[{second}]: slot {slot} already named by entry {first} of this round")

    def advance(
        self, slots: np.ndarray, positions: np.ndarray, new_gen: np.ndarray, offsets: np.ndarray, tokens: np.ndarray
    ) -> Advanced:
        """Apply a round's entries to their slots' windows, all at once.

        Per entry: NEW_GEN replaces the slot's window with its tokens; an entry for a known
        slot at the slot's next position appends its tokens; either way the next position
        becomes ``position + len(tokens)``, so each context's first token is at
        ``next_pos - len(context)`` (``starts``). Any other entry (unknown slot, gap) forgets the
        slot and gets no context (the engine must re-announce it).

        Args: the round's arrays (slots unique and in range: :meth:`check_slots`);
            slots, positions, offsets int64, new_gen bool, tokens int32.

        Returns: the ``ok`` entries and their contexts (:class:`Advanced`).
        """
        W, K = self.window, self.keep
        n = len(slots)
        lens = offsets[1:] - offsets[:-1]
        with self.lock:
            any_new = bool(new_gen.any())
            ok = self.known[slots] & (positions == self.next_pos[slots])
            if any_new:
                ok |= new_gen
            # The steady state (every entry continues its window) skips every mask below.
            all_ok = bool(ok.all())
            if not all_ok:
                self.known[slots[~ok]] = False
            if any_new:
                self.known[slots[new_gen]] = True
                self.gen[slots[new_gen]] += 1
            base = np.where(new_gen, 0, self.written[slots]) if any_new else self.written[slots]
            written = base + lens
            # Scatter the ok entries' tokens into the rings: of each entry only its last K
            # tokens (earlier ones would be overwritten: one write per ring cell).
            entry = np.repeat(np.arange(n), lens)  # the entry of each round token
            j = np.arange(len(tokens)) - offsets[entry]  # its index within the entry
            if all_ok and (not n or lens.max() <= K):
                e, jk, kept = entry, j, tokens
            else:
                keep = ok[entry] & (j >= lens[entry] - K)
                e, jk, kept = entry[keep], j[keep], tokens[keep]
            rs, cols = slots[e], (base[e] + jk) % K
            self.ring[rs, cols] = kept
            if K > W:  # the second copy: only the first W columns have one
                twice = cols < W
                rs, cols, kept = rs[twice], cols[twice], kept[twice]
            self.ring[rs, cols + K] = kept
            ok_slots = slots if all_ok else slots[ok]
            if not all_ok:
                written, positions, lens = written[ok], positions[ok], lens[ok]
            self.written[ok_slots] = written
            self.next_pos[ok_slots] = positions + lens
            # The contexts: each ok entry's last min(written, W) tokens, oldest first. The
            # oldest sits at ring column (written - fill) % K; the W columns from there are
            # one span of the row (its first W columns doubled past K: one gather of m
            # spans, no arithmetic per token); the columns past ``fill`` of windows not yet
            # full are then dropped.
            fill = np.minimum(written, W)
            start = (written - fill) % K
            ctx = self._spans[ok_slots * (K + W) + start]
            ctx = ctx.reshape(-1) if bool((fill == W).all()) else ctx[np.arange(W) < fill[:, None]]
            ctx_offsets = np.zeros(len(fill) + 1, np.int64)
            np.cumsum(fill, out=ctx_offsets[1:])
            gens = self.gen[ok_slots]
        # A slot's tokens sit at consecutive positions (appends continue next_pos, a
        # NEW_GEN starts at its own): its window ends where the next token will go.
        return Advanced(ok, ctx, ctx_offsets, ok_slots, gens, written, positions + lens - fill)

    def window_of(self, slot: int) -> list[int] | None:
        """The slot's window, oldest first, or None (slow: tests and tools)."""
        if not self.known[slot]:
            return None
        fill = min(int(self.written[slot]), self.window)
        start = int(self.written[slot]) - fill
        return [int(self.ring[slot, (start + c) % self.keep]) for c in range(fill)]

    def read(self, slots: np.ndarray, first: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stream indices ``first[i]`` to ``stop[i] - 1`` of each slot ``slots[i]`` (int64
        arrays), as one flat int32 array and its ``[m + 1]`` int64 offsets: one gather
        from the ring, no loop over the entries. A slot's stream is what it was given since
        its NEW_GEN; a forgotten slot's tokens stay readable until its next NEW_GEN (a
        batch in flight keeps its meaning).

        Raises: ValueError naming the slot and the span, for a span the slot no longer
        holds (before its last ``keep`` tokens) or never had."""
        slots, first, stop = (np.asarray(a, np.int64) for a in (slots, first, stop))
        written = self.written[slots]
        bad = (first < written - np.minimum(written, self.keep)) | (stop < first) | (stop > written)
        if bad.any():
            i = int(np.argmax(bad))
            low = int(written[i]) - min(int(written[i]), self.keep)
            raise ValueError(
                f"slot {int(slots[i])} of session {self.serial}: stream tokens {int(first[i])}..{int(stop[i])}, "
                f"it holds {low}..{int(written[i])}"
            )
        counts = stop - first
        offsets = np.zeros(len(slots) + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        total = int(offsets[-1])
        entry = np.repeat(np.arange(len(slots)), counts)
        j = np.arange(total) - offsets[entry] + first[entry]  # each token's stream index
        return self.ring[slots[entry], j % self.keep], offsets

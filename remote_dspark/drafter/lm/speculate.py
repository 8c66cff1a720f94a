"""The speculation cache: drafts made, while the engine verifies, for the rounds it is
likely to send next, and a round that sends one of them answered at once.

After a stream's round is answered with drafts ``d1..dk``, its next ROUND appends ``d1..dj,
t`` for some ``j`` in ``0..m`` (``m`` the drafts sent): the drafts the engine accepted,
then the target's token (a correction ``t != d(j+1)`` at ``j < m``, the bonus at ``j =
m``). Those outcomes ``(j, t)`` are ranked ``P(j, t) = P(j) * share(t)``: ``P(j)`` the
share of rounds seen accepting ``j`` drafts (:meth:`Speculation._observe`, every round,
decayed: the drafter's own probabilities are no measure of acceptance, a random model's
flat ones least of all), ``share(t)`` the drafter's probability of ``t`` at position
``j + 1`` among the ids other than its draft (its round keeps each position's ``RANK``
likeliest ids and their probabilities: a greedy round is ``RANKED``, :mod:`.graphs`; a
sampled one has its ``q``); the bonus after all ``k`` (``t`` the drafter's top choice
after ``dk``, found by its pre-draft) scores ``P(k)`` times the share of drafts seen
accepted. The ``fanout`` likeliest of each stream are its outcomes.

Pre-drafting (:meth:`Speculation.predraft`, the worker's idle time: the scheduler calls it
when no round is queued, a call at a time, each of the entries the cost model gives it):
the due outcomes likeliest first, rank by rank across the streams (the most recent
first within a rank), so that a round arriving mid-way finds its stream's likeliest
outcomes made; a padded round takes at least its rows (on a GPU a call of fewer costs
as much), and an outcome under ``MIN_SCORE`` likely only fills those (never a call of
its own: on a CPU each costs about a round). Each outcome is a branch: a table
row of the pool (:mod:`.pool`) forked from its stream's row at the column ``t`` goes to
(the blocks before it shared, the block it falls in copied, the rest new: copy on write).
The round's drafts ``d1..d(k-1)`` left their K/V in the stream's row past its fill, so an
outcome ``(j, t)`` encodes just ``t`` at column ``fill + j`` and drafts ``k`` tokens; the
bonus encodes ``dk`` at ``fill + k - 1`` and drafts ``k + 1``, the first being ``t``. A
sampled outcome draws with its stream's last seed and temperature, draft ``i`` at its
absolute position, as a fresh round would (the bonus is greedy-only: its draws would
be indexed one off).

A hit (:meth:`Speculation.take`): a round's entry whose stream is the one a branch was
forked from, unchanged since (session, slot, generation, length, fill, origin), appending
exactly the branch's tokens at the next positions, asking at most its drafts, with the
same seed and temperature when sampled (greedy: neither). It is answered from the branch,
whose blocks become its stream's (:meth:`~.pool.KVStore.adopt`), and the branch's answer
is the stream's last (its outcomes pre-drafted in turn). Any other round for a stream
leaves its branches stale (they can never hit), let go in idle time. Greedy, a hit's
drafts equal a fresh round's but for near-ties (its K/V computed in another batch's
shape, differing in the last bits, as every cached round's); sampled, each is the pick
of its own ``q`` at the round's seed, position and index. Branches hold blocks only
while the pool has them to spare: pre-drafting never evicts a stream, and a round short
of blocks drops every branch first
(:meth:`Speculation.reclaim`).

Not thread-safe: the drafter's lock is held around every call.
"""

from __future__ import annotations

import time

import numpy as np

from ..contract import DraftBatch, DraftResult, SpecInfo
from ..streams import context_lengths
from .arrays import sampling_rows
from .graphs import MIN_ROWS, RANK
from .pool import BLOCK
from .spec_answers import Acceptance, Answers, Hits

MAX_BRANCHES = 4096  # branches (table rows of pre-drafts) at most
MIN_SCORE = 0.02  # an outcome less likely than this is pre-drafted only to fill a padded round's rows


# A stream's (or a branch's) fields, as arrays indexed by row: the stream it was made for
# and the row's state then, the round's width, drafts sent, and sampling (temperature bits,
# seed bits; both 0 and ``sampled`` False for a greedy round).
FIELDS = ("session", "slot", "gen", "length", "fill", "origin", "width", "sent", "temp", "seed")


class Speculation:
    """A drafter's speculation cache (module docstring), over its store, cache and rounds.

    Args: the drafter's :class:`~.pool.KVStore` (its branch rows: ``fanout`` per cached
    stream, at most ``MAX_BRANCHES``), :class:`~.cache.SlotCache` and
    :class:`~.graphs.Rounds`, the outcomes per stream, the widest round, the stream's
    columns and the model's positions (None: no table).
    """

    def __init__(self, store, cache, rounds, fanout: int, max_width: int, max_positions: int | None):
        self.store, self.cache, self.rounds, self.fanout = store, cache, rounds, fanout
        self.max_positions = max_positions
        rows, branches, w = cache.capacity, store.branch_rows, max_width + 1
        self.last = Answers.empty(rows, w)  # each stream's last answer
        self.meta = {f: np.zeros(rows, np.int64) for f in FIELDS}
        self.sampled = np.zeros(rows, bool)
        self.pending = np.full(
            rows, -1, np.int64
        )  # when its outcomes became due (-1: none; 0: only its stale ones to let go)
        self.branch_of = np.full((rows, fanout), -1, np.int64)  # each stream's branches
        self.done = np.zeros(rows, np.int64)  # ranks of its last answer's outcomes pre-drafted
        self.made = Answers.empty(branches, w)  # each branch's answer
        self.b = {f: np.zeros(branches, np.int64) for f in (*FIELDS, "row", "j", "t", "rank", "cell", "shift", "tick")}
        self.b["row"][:] = -1
        self.b_sampled = np.zeros(branches, bool)
        self.free, self.n_free = np.arange(branches - 1, -1, -1, dtype=np.int64), branches  # a stack
        self._tick = 0
        self.outcomes = self.misses = self.dropped = 0
        self.hits = np.zeros(fanout, np.int64)
        self.seen = Acceptance(w)  # what the engines accepted, counted
        self.seconds = 0.0

    # ------------------------------------------------------------------ answers and hits

    def answered(self, batch: DraftBatch, rows: np.ndarray, out: np.ndarray, drafted: np.ndarray, kind: int) -> None:
        """A round's entries ``drafted`` ([n] bool) answered from ``out`` (their cache
        ``rows``, -1: none): each such stream's last answer, its outcomes due."""
        keep = drafted & (rows >= 0)
        if not keep.any():
            return
        r = rows[keep]
        self.last.put(r, out[keep], batch.width, kind)
        ctx = context_lengths(batch)
        self._stream(r, batch, keep, self.cache.length[r], self.cache.fill[r], self.cache.origin[r], ctx)

    def _stream(self, r, batch: DraftBatch, keep, length, fill, origin, ctx) -> None:
        """Rows ``r``'s fields: the stream of ``batch``'s ``keep`` entries, as they stand."""
        m = self.meta
        m["session"][r] = batch.sessions()[keep]
        m["slot"][r], m["gen"][r] = np.asarray(batch.slots)[keep], np.asarray(batch.gens)[keep]
        m["length"][r], m["fill"][r], m["origin"][r] = length, fill, origin
        m["width"][r] = batch.width
        m["sent"][r] = np.where(ctx[keep] > 0, np.minimum(batch.n_out[keep], batch.width), 0)
        self.sampled[r] = batch.sampled
        if batch.sampled:
            s = sampling_rows(batch, ctx)
            m["temp"][r], m["seed"][r] = s[0][keep], s[1][keep]
        else:
            m["temp"][r] = m["seed"][r] = 0
        self._tick += 1
        self.pending[r], self.done[r] = self._tick, 0

    def _observe(self, batch: DraftBatch, ctx: np.ndarray, rows: np.ndarray) -> None:
        """Count what a round's entries (their streams' cache ``rows``, -1: none) accepted
        of their streams' last answers (``j``: the drafts it appends before its new token),
        for the outcomes' ranking. Entries that append anything else (a NEW_GEN, a gap,
        tokens no outcome) count nothing."""
        if batch.lengths is None:
            return
        e = np.flatnonzero(rows >= 0)
        r, m = rows[e], self.meta
        j = np.asarray(batch.lengths, np.int64)[e] - m["length"][r] - 1
        ok = (m["slot"][r] == np.asarray(batch.slots)[e]) & (m["gen"][r] == np.asarray(batch.gens)[e])
        ok &= m["session"][r] == batch.sessions()[e]  # (a row given to another stream keeps the old one's fields)
        ok &= (j >= 0) & (j <= m["sent"][r]) & (ctx[e] > j) & (m["length"][r] > 0)
        if not ok.any():
            return
        e, r, j = e[ok], r[ok], j[ok]
        accepted = self._accepted(batch, e, r, j)
        self.seen.count(j[accepted], self.meta["sent"][r[accepted]])

    def _accepted(self, batch: DraftBatch, e: np.ndarray, r: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Whether entries ``e`` appended their streams' (rows ``r``) last drafts ``d1..dj``
        before their last token (``0 <= j``, within the answers' width; else False)."""
        w = self.last.drafts.shape[1]
        flat = batch.tokens if len(batch.tokens) else np.zeros(1, np.int32)
        at = batch.offsets[e + 1][:, None] - 1 - j[:, None] + np.arange(w)
        inside = np.arange(w) < np.clip(j, 0, w)[:, None]
        got = np.where(inside, flat[np.clip(at, 0, len(flat) - 1)], 0)
        return (np.where(inside, self.last.drafts[r], 0) == got).all(1) & (j >= 0) & (j < w)

    def take(self, batch: DraftBatch, ctx: np.ndarray) -> Hits | None:
        """The round's hits, answered and adopted (module docstring), once what it accepted
        is counted (:meth:`_observe`). None: no entry hit.
        A stream's other branches are stale from here on (its row moves on: they can never
        hit) and are let go in idle time, when its outcomes are next pre-drafted (its round
        makes them due), or when the pool is short: not on the round's path."""
        if batch.slots is None:
            return None
        rows = self.cache.rows_of(batch.sessions(), np.asarray(batch.slots, np.int64))
        self._observe(batch, ctx, rows)
        if self.n_free == len(self.free):  # no branch at all
            return None
        known = rows >= 0
        r0 = np.where(known, rows, 0)
        cand = self.branch_of[r0]
        c = np.maximum(cand, 0)
        # stale ones: their stream moved on, or its row is another stream's now (given to a
        # newcomer, it keeps the old stream's branches until its own next pre-draft)
        bf, cache = self.b, self.cache
        moved = (bf["length"][c] != cache.length[r0][:, None]) | (bf["session"][c] != cache.owner_session[r0][:, None])
        cand[~known[:, None] | moved | (bf["slot"][c] != cache.owner_slot[r0][:, None])] = -1
        has = (cand >= 0).any(1)
        if not has.any():
            return None
        e = np.flatnonzero(has)
        self.pending[rows[e]] = 0  # (due: their branches let go at the next pre-draft, if not before)
        ok, b = self._match(batch, ctx, e, rows[e], cand[e])
        self.misses += int((~ok).sum())
        hit_e, hit_b = e[ok], b[ok]
        if not len(hit_e):
            return None
        return self._adopt(batch, ctx, hit_e, rows[hit_e], hit_b)

    def _match(self, batch: DraftBatch, ctx, e, r, cand) -> tuple[np.ndarray, np.ndarray]:
        """For entries ``e`` (streams ``r``, branches ``cand`` [e, fanout]): whether one hits,
        and which."""
        lengths = np.asarray(batch.lengths, np.int64)[e]
        j = lengths - self.meta["length"][r] - 1
        flat = batch.tokens if len(batch.tokens) else np.zeros(1, np.int32)
        last = np.where(ctx[e] > 0, flat[np.maximum(batch.offsets[e + 1] - 1, 0)], -1)
        c = np.maximum(cand, 0)
        same = (cand >= 0) & (self.b["j"][c] == j[:, None]) & (self.b["t"][c] == last[:, None])
        b = c[np.arange(len(e)), same.argmax(1)]
        ok = same.any(1) & (batch.n_out[e] > 0) & (batch.n_out[e] <= self.b["width"][b]) & (ctx[e] >= j + 1)
        bf, cache = self.b, self.cache
        # the stream's row (its owner the branch's stream: take's filter) as the branch left it
        ok &= (cache.gen[r] == bf["gen"][b]) & (np.asarray(batch.gens)[e] == bf["gen"][b])
        ok &= (cache.fill[r] == bf["fill"][b]) & (cache.origin[r] == bf["origin"][b])
        if batch.positions is not None:
            ok &= batch.starts()[e] + ctx[e] == bf["origin"][b] + bf["fill"][b] + j + 1
        ok &= self.b_sampled[b] == batch.sampled
        if batch.sampled:
            s = sampling_rows(batch, ctx)
            ok &= (s[0][e] == bf["temp"][b]) & (s[1][e] == bf["seed"][b])
        return ok & self._accepted(batch, e, r, j), b

    def _adopt(self, batch: DraftBatch, ctx, e, r, b) -> Hits:
        """Entries ``e`` hit branches ``b`` of their streams ``r``: the answer, the blocks
        adopted, the streams' rows and last answers moved on."""
        store, cache, bf = self.store, self.cache, self.b
        tb = store.cache_rows + b
        store.adopt(r, tb, bf["cell"][b])
        store.copy_rows(r, tb)
        lengths = np.asarray(batch.lengths, np.int64)[e]
        fill = bf["fill"][b] + lengths - bf["length"][b]
        cache.moved(r, lengths, fill)
        np.add.at(self.hits, bf["rank"][b], 1)
        width = batch.width  # (< the answers' columns: at most the widest round)
        sent = np.minimum(batch.n_out[e], width).astype(np.int32)
        live = np.arange(width) < sent[:, None]
        q_ids = q_weights = None
        if batch.sampled:
            q_ids = np.where(live[..., None], self.made.q_ids[b, :width], 0)
            q_weights = np.where(live[..., None], self.made.q_weights[b, :width], 0).astype(np.uint16)
        margins = np.where(live, self.made.margins[b, :width], 0) if batch.want_margin else None
        result = DraftResult(
            np.where(live, self.made.drafts[b, :width], 0).astype(np.int32), sent, margins, q_ids, q_weights
        )
        self.last.copy(r, self.made, b, int(bf["width"][b].max()))
        keep = np.zeros(len(batch), bool)
        keep[e] = True
        self._stream(r, batch, keep, lengths, fill, cache.origin[r], ctx)
        self.meta["width"][r] = bf["width"][b]  # the drafts the branch made (n_out was at most them)
        self.meta["sent"][r] = sent
        self._release(b)
        return Hits(keep, result)

    # ------------------------------------------------------------------ pre-drafting

    def predraft(self, max_entries: int, max_tokens: int) -> int:
        """One call of the outcomes due, likeliest first (module docstring): each due
        stream's next ranks, rank by rank across the streams (the most recent first within
        a rank), at most ``max_entries`` outcomes (but a padded round's rows: on a GPU a
        call of fewer costs as much) and ``max_tokens`` tokens (each a token encoded and
        its drafts). A stream stays due until all its ``fanout`` are pre-drafted. Returns how
        many were (0: none due, or no room for any)."""
        due = np.flatnonzero(self.pending >= 0)
        if not len(due):
            return 0
        start = time.perf_counter()
        due = due[np.argsort(-self.pending[due], kind="stable")]
        limit = max(max_entries, MIN_ROWS if self.rounds.padded else 1)
        limit = min(limit, max_tokens // (2 + int(self.meta["width"][due].max())), len(self.free))
        fresh = due[self.done[due] == 0]  # answered since their last pre-draft: their old branches go
        self._drop(self.branch_of[fresh].ravel())
        ok = self._unchanged(due)
        self._drop(self.branch_of[due[~ok]].ravel())
        self.pending[due[~ok]] = -1
        due = due[ok]
        r, j, t, rank, shift, score = self._outcomes(due)
        r_all, rank_all, worth_all = r, rank, score >= MIN_SCORE
        by = np.argsort(due)
        recency = by[np.searchsorted(due, r, sorter=by)]  # each outcome's stream's place in ``due``
        counts = np.bincount(recency, minlength=len(due))
        order = np.argsort(recency, kind="stable")
        order = order[np.argsort(rank[order], kind="stable")]  # rank by rank, the most recent first within
        order = order[rank[order] >= self.done[r[order]]]
        # outcomes worth a call of their own; the others only fill a padded round's rows
        # beside them (free on a GPU), never a call of their own (on a CPU each costs a round)
        worth = worth_all[order]
        fill = np.arange(len(order)) < (MIN_ROWS if self.rounds.padded else 0)
        order = order[worth | fill][:limit] if worth.any() else order[:0]
        r, j, t, rank, shift = (x[order] for x in (r, j, t, rank, shift))
        short = len(r) - self.n_free
        if short > 0:  # the oldest branches make way
            live = np.flatnonzero(self.b["row"] >= 0)
            self._drop(live[np.argsort(self.b["tick"][live], kind="stable")[:short]])
        made = self._run(r, j, t, rank, shift) if len(r) else 0
        np.maximum.at(self.done, r, rank + 1)
        left = np.zeros(len(due), bool)  # streams with outcomes worth a call still to pre-draft
        np.logical_or.at(left, recency, (rank_all >= self.done[r_all]) & worth_all)
        self.pending[due[~left | (self.done[due] >= counts)]] = -1
        self.seconds += time.perf_counter() - start
        return made

    def _unchanged(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows)] bool: the streams' rows as their last answers left them (not evicted,
        re-encoded or given to another stream since)."""
        m, c = self.meta, self.cache
        ok = (c.owner_session[rows] == m["session"][rows]) & (c.owner_slot[rows] == m["slot"][rows])
        ok &= (c.gen[rows] == m["gen"][rows]) & (c.gen[rows] >= 0) & (c.length[rows] == m["length"][rows])
        ok &= (c.fill[rows] == m["fill"][rows]) & (c.origin[rows] == m["origin"][rows])
        # the drafts' K/V still there: every column before the last draft's
        return ok & (self.store.held[rows] * BLOCK >= m["fill"][rows] + m["width"][rows] - 1)

    def _outcomes(self, rows: np.ndarray):
        """The ``fanout`` likeliest outcomes of each stream, flat: its row, ``j``, ``t`` (-1
        for the bonus after all ``k``: its pre-draft finds it), rank, shift (1: the
        bonus) and score ``P(j, t)``. Outcomes whose pre-draft passes the stream's columns or the model's
        positions are left out."""
        m, last = self.meta, self.last
        w = last.drafts.shape[1]
        width, sent = m["width"][rows], m["sent"][rows]
        pos = np.arange(w)
        mine = (last.ids[rows] == last.drafts[rows][:, :, None]) * last.probs[rows]
        a = np.where(pos < width[:, None], mine.sum(2), 0.0)  # each draft's own probability
        # P(j): the observed share of rounds that accepted j of their drafts (calibrated: a
        # random model's flat distribution says nothing of how often its drafts are accepted)
        p_j = self.seen.p_j(sent)
        # corrections (j < sent, t not the draft: its share of the others) and bonuses inside
        # the drafts made (j = sent < width: the drafter's own distribution there)
        j = np.broadcast_to(pos[:, None], (w, RANK))
        t = last.ids[rows]
        correction = (j < sent[:, None, None]) & (t != last.drafts[rows][:, :, None])
        valid = correction | ((j == sent[:, None, None]) & (j < width[:, None, None]))
        share = last.probs[rows] / np.where(correction, np.maximum(1.0 - a[:, :, None], 1e-6), 1.0)
        score = np.where(valid, p_j[:, :w, None] * share, -1.0).reshape(len(rows), w * RANK)
        bonus = (sent == width) & ~self.sampled[rows]
        mean = self.seen.rate()  # the bonus: the drafter's top choice, as likely the target's as a draft is
        score = np.concatenate([score, np.where(bonus, p_j[np.arange(len(rows)), width] * mean, -1.0)[:, None]], 1)
        j_all = np.concatenate([np.broadcast_to(j.ravel(), (len(rows), w * RANK)), width[:, None]], 1)
        c0 = m["fill"][rows][:, None] + j_all - (j_all == width[:, None])  # the column the branch encodes at
        drafts = width[:, None] + (j_all == width[:, None])
        room = c0 + 1 + drafts <= self.store.columns
        if self.max_positions is not None:
            room &= m["origin"][rows][:, None] + c0 + 1 + drafts <= self.max_positions
        score = np.where(room, score, -1.0)
        order = np.argsort(-score, 1, kind="stable")[:, : self.fanout]
        best = np.take_along_axis(score, order, 1)
        which, rank = np.nonzero(best >= 0)
        pick = order[which, rank]
        rows_out = rows[which]
        jj = j_all[which, pick]
        is_bonus = pick == w * RANK
        tt = np.where(is_bonus, -1, t.reshape(len(rows), w * RANK)[which, np.minimum(pick, w * RANK - 1)])
        return rows_out, jj, tt, rank, is_bonus.astype(np.int64), best[which, rank]

    def _run(self, r, j, t, rank, shift) -> int:
        """Fork a branch for each outcome, run their pre-drafts (a call per width, kind and
        shift: a few), keep their answers. Returns how many ran."""
        store, m = self.store, self.meta
        b = self.free[self.n_free - len(r) : self.n_free].copy()
        self.n_free -= len(r)
        tb = store.cache_rows + b
        c0 = m["fill"][r] + j - shift
        cell = c0 // BLOCK
        width = m["width"][r] + shift
        store.copy_rows(tb, r)  # the device's rows first (on the CPU they are the host's: the fork's cells go on top)
        store.fork(tb, r, cell)
        ok, _ = store.grant(tb, c0 + 1 + width)
        if not ok.all():  # no room: never a stream evicted for a pre-draft
            store.release(tb[~ok], cell[~ok])
            store.held[tb[~ok]] = 0
            self._push(b[~ok])
            r, j, t, rank, shift, b, tb, c0, cell, width = (
                x[ok] for x in (r, j, t, rank, shift, b, tb, c0, cell, width)
            )
        if not len(r):
            return 0
        self._copy_block(r, tb, c0, cell)
        self.outcomes += len(r)
        for f in FIELDS:
            self.b[f][b] = m[f][r]
        self._tick += 1
        for f, v in (("row", r), ("j", j), ("rank", rank), ("cell", cell), ("shift", shift), ("tick", self._tick)):
            self.b[f][b] = v
        self.b_sampled[b] = self.sampled[r]
        self.branch_of[r, rank] = b
        tok = np.where(shift == 1, self.last.drafts[r, np.maximum(m["width"][r] - 1, 0)], t)
        group = np.stack([width, self.sampled[r], shift], 1)
        for key in np.unique(group, axis=0):
            g = (group == key).all(1)
            rg, sampling = r[g], None
            if key[1]:
                sampling = np.stack([m["temp"][rg], m["seed"][rg], m["origin"][rg] + c0[g] + 1])
            n = int(g.sum())
            out = self.rounds.run(
                tok[g, None], c0[g], np.ones(n, np.int64), m["origin"][rg], tb[g], int(key[0]), sampling, cell[g]
            )
            self.made.put(b[g], out, int(key[0] - key[2]), self.rounds.kind(sampling), int(key[2]))
            self.b["t"][b[g]] = out[:, 0] if key[2] else t[g]  # a bonus's t: its first draft
        return len(r)

    def _copy_block(self, r, tb, c0, cell) -> None:
        """The block each fork falls inside copied into the branch's own (the columns
        before the fork in it), on the device."""
        import torch

        store = self.store
        inside = c0 % BLOCK != 0
        if inside.any():
            src = store.host_table[r[inside], cell[inside]]
            dst = store.host_table[tb[inside], cell[inside]]
            dev = store.kv.device
            store.kv[torch.from_numpy(dst).to(dev)] = store.kv[torch.from_numpy(src).to(dev)]

    # ------------------------------------------------------------------ letting go

    def _release(self, b: np.ndarray) -> None:
        """Branches ``b`` (their blocks adopted or released already) free again."""
        if not len(b):
            return
        self.branch_of[self.b["row"][b], self.b["rank"][b]] = -1
        self.b["row"][b] = -1
        self._push(b)

    def _push(self, b: np.ndarray) -> None:
        self.free[self.n_free : self.n_free + len(b)] = b
        self.n_free += len(b)

    def _drop(self, b: np.ndarray) -> None:
        """Branches ``b`` let go unused: their blocks back."""
        b = b[b >= 0]
        if not len(b):
            return
        tb = self.store.cache_rows + b
        self.store.release(tb, self.b["cell"][b])  # its own blocks (the ones before its fork are its stream's)
        self.store.held[tb] = 0
        self.dropped += len(b)
        self._release(b)

    def reclaim(self) -> int:
        """Every branch dropped (a round short of blocks): the blocks freed."""
        before = self.store.n_free
        self._drop(np.flatnonzero(self.b["row"] >= 0))
        return self.store.n_free - before

    def info(self) -> SpecInfo:
        live = np.flatnonzero(self.b["row"] >= 0)
        blocks = int((self.store.held[self.store.cache_rows + live] - self.b["cell"][live]).sum())
        return SpecInfo(
            self.outcomes, tuple(self.hits.tolist()), self.misses, self.dropped, self.seconds, len(live), blocks
        )

"""Long contexts announced in chunks: what each slot has still to announce, and the
round that announces the next part of it (:class:`Announcer`).

A round carries at most its budget: ``round_tokens`` (``Spec.max_tokens``), or fewer when
the worker takes fewer (``Spec.round_budget``), given to each call. A batch that
carries more (a burst of new requests, every slot re-announced after ``resync_all``)
goes out over the next rounds, each of its entries at its true positions:

- every entry of the batch is in its round (the answer keeps the batch's entries and
  order); what it sends is the next part of its *queue*, the tokens its slot has still
  to announce: those held from earlier rounds, then the batch's own (a NEW_GEN entry's
  queue is its context alone, cut as every NEW_GEN context is);
- the budget goes to the queues oldest request first: slots whose context is whole
  (they are older than any still being announced; their new tokens are few), then
  slots still announcing by the round their context came, then this batch's NEW_GEN
  entries in batch order. A queue sends what fits; the rest is held;
- a slot's first chunk goes NEW_GEN at its context's first position (an empty one when
  nothing fits yet: the worker then knows the slot is new and holds no stale window
  for it), the others as plain entries at the slot's next position, which the worker
  appends to its window;
- an entry's ``n_out`` is 0 until its queue is empty: a slot gets drafts once its
  context is whole (:attr:`~.drafts.Drafts.announcing` names the others);
- a slot holds at most the cut (the worker's window, at most ``context_tokens``): a
  longer queue keeps its last tokens and goes NEW_GEN again from the first kept;
- a NEW_GEN entry drops what its slot held; a plain entry whose position does not
  follow what its slot holds drops it too and goes as given (the worker then answers
  RESYNC for the gap, as for any entry with a gap);
- a slot whose request ended is let go when the engine frees it (:meth:`Announcer.release`,
  ``RemoteDSpark.release``): what it held is dropped, never sent. A slot absent from a
  batch is *not* let go: a request may skip rounds (not scheduled, preempted) and come
  back, and its context goes on from what is held.

A chunk lost with its round (a timeout, a round not sent) leaves a gap at the worker:
the slot's next chunk is answered RESYNC and the engine announces it again, as after
any lost round.

What it counts (``observe.stats.AnnounceStats`` copies it): the entries sent as chunks
(those sent short of their queue, and those sending a held queue's last part), the slots
still being announced, and the slots re-announced after the worker lost them: a slot is
*owed* from an answer that names it (RESYNC) or from ``resync_all`` (every slot), until
its next entry; that entry, when NEW_GEN, counts. (After ``resync_all`` a slot the
engine had no request on is owed too, so a new request's first NEW_GEN there counts: at
most ``max_slots`` a ``resync_all``.) While nothing is owed nothing is read for it.

The state is a few arrays indexed by slot, one owner (the engine's round path, on its
engine thread); a round is a handful of whole-array operations, none per entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import HostMeta

IDLE, FIRST, REST = 0, 1, 2  # a slot's state: nothing held; held, none sent yet; held, continuing


@dataclass(frozen=True)
class Planned:
    """One round's part of its batch: the ROUND's arrays and which slots still announce."""

    meta: HostMeta  # the round's metadata (the batch's entries, their chunks, n_out 0 where not whole)
    announcing: np.ndarray  # [m] int64: the round's slots whose context is not whole yet


class Announcer:
    """What each slot has still to announce (see the module docstring).

    Arrays (index: slot)::

        state  [S] int8          IDLE, FIRST (its next chunk goes NEW_GEN) or REST (its
                                 next chunk continues at ``start``)
        since  [S] int64         when its request's context came: round x S + its entry
                                 (the oldest first; 0: a slot whose context was whole)
        start  [S] int64         the position of its first held token
        count  [S] int64         the tokens it holds
        held   [S, cap] int32    the held tokens, the first ``count`` of its row
        owed   [S] bool          the worker lost it: its next entry should be NEW_GEN

    Invariants: ``(state == IDLE) == (count == 0)``; ``count <= cap``; ``pending`` is the
    number of slots not IDLE; ``owing`` the number of slots owed.
    """

    def __init__(self, max_slots: int, cap: int):
        self.cap = cap
        self.state = np.zeros(max_slots, np.int8)
        self.since = np.zeros(max_slots, np.int64)
        self.start = np.zeros(max_slots, np.int64)
        self.count = np.zeros(max_slots, np.int64)
        self.held = np.zeros((max_slots, cap), np.int32)  # (calloc'd: pages touched as slots hold)
        self.owed = np.zeros(max_slots, bool)
        self.pending = self.owing = 0
        self.rounds = 0  # rounds planned: the clock of ``since``
        # Statistics (plain ints its one writer stores: read from any thread).
        self.chunks = 0  # entries sent as chunks: short of their queue, or a held queue's last part
        self.reannounced = 0  # NEW_GEN entries of owed slots

    def lost(self, slots, every: bool = False) -> None:
        """An answer said the worker lost ``slots`` (RESYNC), or ``every`` slot
        (``resync_all``): each is owed a NEW_GEN from its next entry."""
        if every:
            self.owed[:] = True
        elif len(slots):
            self.owed[np.asarray(slots, np.int64)] = True
        else:
            return
        self.owing = int(np.count_nonzero(self.owed))

    def release(self, slots) -> None:
        """The engine freed ``slots`` (their requests ended): what they hold is dropped,
        never sent; a slot's next request comes NEW_GEN. A slot not held is left as it is."""
        s = np.asarray(slots, np.int64)
        if not self.pending or not len(s):
            return
        s = s[(s >= 0) & (s < len(self.state))]
        self.state[s], self.count[s] = IDLE, 0
        self.pending = int(np.count_nonzero(self.state))

    def sent(self, slots: np.ndarray, new_gen: np.ndarray) -> None:
        """A batch's entries (host arrays) are sent: the owed among them are paid, those
        NEW_GEN counted re-announced. Reads nothing while nothing is owed."""
        if not self.owing:
            return
        owed = self.owed[slots]
        self.reannounced += int(np.count_nonzero(owed & new_gen))
        self.owed[slots] = False
        self.owing = int(np.count_nonzero(self.owed))

    def fits(self, n_tokens: int, budget: int) -> bool:
        """Whether a batch of ``n_tokens`` tokens (before any cut) goes as it is: nothing
        held and within the round's ``budget``. Reads no value of the batch."""
        return not self.pending and n_tokens <= budget

    def plan(self, meta: HostMeta, cut: int, budget: int) -> Planned:
        """The round of at most ``budget`` tokens of a batch's checked metadata ``meta``
        (NEW_GEN contexts cut to ``cut``, at most ``cap``), and the slots' state after it."""
        s, n = meta.slots, meta.n
        lens = np.diff(meta.offsets)
        g = meta.new_gen
        self.sent(s, g)
        st, had = self.state[s], self.count[s]
        follows = ~g & (st != IDLE) & (meta.positions == self.start[s] + had)  # queue = held + own
        carried = np.where(follows, had, 0)
        drop = np.where(follows, np.maximum(carried + lens - cut, 0), 0)  # a queue over the cut
        queue = carried + lens - drop
        first = g | (follows & (st == FIRST)) | (drop > 0)
        qstart = np.where(follows, self.start[s], meta.positions) + drop
        self.rounds += 1
        arrival = self.rounds * len(self.state) + np.arange(n)  # this round's, in batch order
        key = np.where(g, arrival, np.where(follows, self.since[s], 0))
        grant = _grants(queue, key, budget)
        tokens, e, j = self._queues(meta, s, carried, drop, queue)
        rest = queue - grant
        keep = np.minimum(rest, cut)
        skipped = rest - keep  # past the cut: the slot's next chunk goes NEW_GEN again
        held = j >= (queue - keep)[e]
        self.held[s[e[held]], j[held] - (queue - keep)[e[held]]] = tokens[held]
        self.state[s] = np.where(rest > 0, np.where(skipped > 0, FIRST, REST), IDLE)
        self.count[s] = keep
        self.start[s] = qstart + grant + skipped
        self.since[s] = key
        self.pending = int(np.count_nonzero(self.state))
        whole = rest == 0
        self.chunks += int(np.count_nonzero(~whole | (carried > 0)))
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(grant, out=offsets[1:])
        out = HostMeta(
            slots=s,
            positions=qstart,
            n_out=np.where(whole, meta.n_out, 0).astype(np.int64),
            new_gen=first,
            offsets=offsets,
            tokens=tokens[j < grant[e]],
            temperature=meta.temperature,
            seed=meta.seed,
        )
        return Planned(out, s[~whole])

    def _queues(self, meta: HostMeta, s, carried, drop, queue) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every entry's queue laid end to end (int32): its held tokens past ``drop``,
        then its own; with each token's entry ``e`` and index ``j`` in its queue."""
        n = len(queue)
        q_offsets = np.zeros(n + 1, np.int64)
        np.cumsum(queue, out=q_offsets[1:])
        e = np.repeat(np.arange(n), queue)
        j = np.arange(q_offsets[-1]) - q_offsets[e]
        at = j + drop[e]  # the index in held + own
        mine = at >= carried[e]
        out = np.empty(len(e), np.int32)
        out[mine] = meta.tokens[meta.offsets[e[mine]] + at[mine] - carried[e[mine]]]
        theirs = ~mine
        if theirs.any():
            out[theirs] = self.held[s[e[theirs]], at[theirs]]
        return out, e, j


def _grants(queue: np.ndarray, key: np.ndarray, budget: int) -> np.ndarray:
    """Each entry's share of ``budget``: the queues in the order of ``key`` (then entry
    order) take what is left, the first that does not fit a part of it, the rest none."""
    order = np.argsort(key, kind="stable")
    sorted_queue = queue[order]
    before = np.cumsum(sorted_queue) - sorted_queue
    grant = np.empty_like(queue)
    grant[order] = np.clip(budget - before, 0, sorted_queue)
    return grant

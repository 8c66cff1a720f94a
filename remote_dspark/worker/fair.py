"""Who gets how much of a drafting call: the queued rounds of every session and the fair
share of each call between them (:class:`FairShare`, the scheduler's; its lock guards it).

A call's budget is ``max_tokens`` tokens (what each entry encodes or reads, plus drafts:
:class:`~.batching.Charge`)
and ``max_entries`` entries. When a call is taken with ``n`` sessions' rounds queued,
each session's turn is worth a **quantum** of ``max_tokens // n`` tokens and at most
``max_entries // n`` entries (deficit round robin on tokens): it takes pieces of its
rounds, oldest first, consecutive entries, while they fit its credit, the call's room
and its round's deadline. A round that does not fit whole is taken in pieces, one a
turn; turns go round until a whole turn takes nothing more or the call is full.

Credit cannot be hoarded:

- **A turn earns its quantum only when the call has room for the session's next
  entry.** Once the call is full, no session is visited again, so none enters the next
  call with credit it earned for a call it could not use.
- **Credit carried to the next call is less than the session's next entry costs**: it
  is kept only toward an entry that costs more than what the session has (an entry over
  a quantum needs several turns), and dropped when the session's queue empties.
- **Sessions that joined the queue since the last call was taken have the first turns**
  of the next one, in the order they came. Their credit is zero, so each takes at most
  its quantum; a session that leaves and comes back gains nothing by it.

**The guarantee**: a round of a session with nothing else queued, of at most
``max_tokens // n`` tokens and ``max_entries // n`` entries (``n``: the sessions with
rounds queued when the next call is taken, itself included), is drafted whole in the
next call taken after it is queued, whatever the other sessions queued or carry. A
bigger round has at least that much of the next call, and the rest in later calls.

An entry over the whole budget is taken in pieces of its encode when its drafter keeps
its streams' state (:class:`~.batching.Charge`): a piece a call, within the session's
turn like any piece, the entry itself (its last tokens and its drafts) the last; no
credit is carried for it (a piece fits any credit). With any other drafter it is taken
alone when nothing else is (it would never fit otherwise).

**Encode yields to rounds ready to draft** (a drafter that keeps its streams, whose
encode of a stream is a one-off prefill): while a session has a round ready to draft
(its next entry asks for drafts and encodes at most the bound before them), the other
sessions' encode in a call (entries of ``n_out`` 0, the prefill of a NEW_GEN before
its last token and drafts, pieces of an encode) is at most ``max_tokens //
YIELD_SHARE`` tokens in all, a longer one taken in pieces. So the call that takes a
waiting round is its drafting plus a sixteenth of a full call: the round waits for
the call running when it came and a short one. The encode still advances every such
call (the bound is a token at least), and has the whole budget whenever no round is
ready (another engine's prefill is not one: two announcing engines share full calls).

Deadlines: a round whose deadline has passed is never drafted: it is handed back as
late. Nor is a round given more of a call than the drafter could draft
before its deadline at ``pace`` (the fewest seconds a budget token has taken in a call
so far; 0: no bound), but a round none of which is drafted yet gets at least one entry:
the pace is learnt from calls, so a pace that refused every round would never be
corrected (one slow call, a compile or a warm-up, would stop the worker drafting for
good).
"""

from __future__ import annotations

import collections
import math

import numpy as np

from .batching import Charge
from .jobs import Job, Pending, Piece

# While another session has a round ready to draft, a call carries at most this fraction
# of its token budget of the other sessions' encode (the module docstring).
YIELD_SHARE = 16


def _drafts(batch, start: int, stop: int) -> np.ndarray:
    """What entries ``start:stop`` of ``batch`` cost beyond their encode: the last token
    and the drafts of an entry that asks for any; none of one that encodes only."""
    return np.where(batch.n_out[start:stop] > 0, 1 + batch.width, 0)


class FairShare:
    """Every session's queued rounds, their turns and credits. Not thread-safe: its
    owner (the scheduler) calls it under its own lock.

    Invariants: a session is in ``_turns`` exactly when its queue is in ``_queues``
    (non-empty, but for jobs ended meanwhile, dropped when reached); ``_credit`` holds
    only sessions in turn, each less than its next entry's cost; the last ``_joined``
    sessions of ``_turns`` joined since the last :meth:`take`."""

    def __init__(self, charge: Charge):
        self.charge = charge  # what an entry costs in a call (asked when a round is first taken)
        self._queues: dict[int, collections.deque[Job]] = {}  # session -> its rounds, oldest first
        self._turns: collections.deque[int] = collections.deque()  # sessions with rounds, in turn
        self._credit: dict[int, float] = {}  # session -> tokens carried to its next turn
        self._joined = 0

    def __bool__(self) -> bool:
        """Rounds are queued."""
        return bool(self._turns)

    def queued(self) -> int:
        """Rounds queued (done ones not yet dropped included)."""
        return sum(len(q) for q in self._queues.values())

    def add(self, job: Job) -> None:
        queue = self._queues.get(job.session)
        if queue is None:
            queue = self._queues[job.session] = collections.deque()
            self._turns.append(job.session)
            self._joined += 1
        queue.append(job)

    def clear(self) -> list[Job]:
        """Every queued round, the queues emptied (the worker stopping)."""
        jobs = [job for queue in self._queues.values() for job in queue]
        self._queues.clear()
        self._turns.clear()
        self._credit.clear()
        self._joined = 0
        return jobs

    def take(self, now: float, pace: float, max_entries: int, max_tokens: int) -> tuple[list[Piece], list[Job]]:
        """The pieces of one call (the module docstring), and the rounds that cannot be
        drafted before their deadline (``now``: the clock when taken), out of the queue."""
        self._turns.rotate(self._joined)  # those that joined since the last call first, in order
        self._joined = 0
        n = len(self._turns)
        call = _Call(now, pace, max_entries, max_tokens, max(1, max_tokens // n), max(1, max_entries // n))
        if self.charge.pieces:  # (a drafter that keeps no streams re-reads every entry: nothing to yield)
            call.ready = self._ready(call.bound)
        stuck = 0  # sessions visited in a row without taking a piece
        # Until a whole turn takes nothing more or the call is full; never an empty call
        # while rounds wait (an empty call has room for any entry: credits grow each turn
        # until a piece fits).
        while self._turns and not call.full() and (stuck < len(self._turns) or not call.pieces):
            session = self._turns[0]
            queue = self._queues[session]
            took = self._turn(session, queue, call)
            self._turns.rotate(-1)
            if not queue:  # an engine with nothing queued keeps no credit
                self._turns.remove(session)
                del self._queues[session]
                self._credit.pop(session, None)
            elif took:
                stuck = 0
            else:
                stuck += 1
        return call.pieces, call.late

    def _turn(self, session: int, queue: collections.deque[Job], call: _Call) -> bool:
        """``session``'s turn in ``call``: its quantum, if the call has room for its next
        entry, spent on pieces of its rounds, oldest first. True when it took one."""
        credit = self._credit.get(session, 0)
        granted = took = False
        entries = 0  # taken this turn (at most call.entries_share)
        while queue:
            job, state = queue[0], queue[0].state
            if not isinstance(state, Pending):  # a piece failed: answered already
                queue.popleft()
                continue
            costs = self.costs(job)
            first = int(costs[state.taken]) - state.encoded
            in_time = call.in_time(job)  # tokens the drafter can still draft for it before its deadline
            if in_time <= first:  # not even its next entry in time, at the pace
                if job in call.given:
                    break  # what it has in this call is all it can use
                if in_time <= 0 or state.taken or state.encoded:  # its deadline passed, or it had its call
                    call.late.append(queue.popleft())
                    continue
                # The pace is learnt from calls, and only a call can correct it (one slow
                # call, a compile or a warm-up, leaves it high): a round not yet drafted
                # gets one entry, not none.
                in_time = first
            room = call.max_tokens - call.tokens
            split = first > call.max_tokens and self.charge.pieces  # its encode taken in pieces
            yields = call.yields(session)  # encode-only tokens it may still take (inf: no bound)
            drafts = int(_drafts(job.batch, state.taken, state.taken + 1)[0])
            pieced = split or (self.charge.pieces and first - drafts > yields)  # its encode over the bound: a piece
            if not granted:
                if (1 if pieced else first) > room and call.pieces:  # no room for its work: no credit either
                    break
                credit, granted = credit + call.quantum, True
            within = min(room, credit, in_time)  # tokens
            most = min(call.entries_share - entries, call.max_entries - call.entries)
            left = len(job.batch) - state.taken
            if job in call.partial:  # a piece of its encode is in this call: the rest in the next
                break
            if pieced and most > 0:  # a piece of its encode, its share (and the bound) at most
                c = self._encode_piece(job, state, first, min(within, yields), call)
                call.yielded += c if yields < math.inf else 0
                credit, took = credit - c, took or c > 0
                break
            if state.taken == 0 and job.cost <= within and left <= most and yields == math.inf:
                m, cost = left, job.cost  # the whole round (the common case: no prefix sums)
            else:
                m, cost = self._count(job, state, within, most, yields, call)
            if m == 0:
                break
            start, taken = state.taken, state.taken + m
            job.state = Pending(taken, state.parts)
            call.pieces.append(Piece(job, start, job.piece(start, taken), cost, state.encoded))
            call.given[job] = call.given.get(job, 0) + cost
            call.entries, call.tokens, entries = call.entries + m, call.tokens + cost, entries + m
            credit, took = credit - cost, True
            if taken < len(job.batch):
                break  # its share is spent: the rest in a later turn
            queue.popleft()
        head = queue[0] if queue else None
        if head is not None and isinstance(head.state, Pending):  # carried: less than its next entry
            nxt = self._next_cost(head, head.state.taken)
            split = nxt > call.max_tokens and self.charge.pieces  # taken in pieces: nothing to save up for
            self._credit[session] = 0 if split else max(0, min(credit, nxt - 1))
        else:
            self._credit.pop(session, None)
        return took

    def _count(self, job: Job, state: Pending, within: float, most: int, yields: float, call: _Call):
        """How many of ``job``'s next entries fit ``within`` tokens and ``most`` entries,
        their encode within ``yields`` tokens (the bound, when the session yields: the
        module docstring; counted into the call's ``yielded``); and their cost."""
        costs = self.costs(job)[state.taken :]
        cum = np.cumsum(costs) - state.encoded
        m = min(int(np.searchsorted(cum, within, side="right")), most)
        if m == 0 and not call.pieces and cum[0] > call.max_tokens:
            m = 1  # an entry over the whole budget: drafted alone
        if yields < math.inf and m:
            encode = np.cumsum(np.maximum(0, costs[:m] - _drafts(job.batch, state.taken, state.taken + m)))
            encode -= state.encoded  # (of its first entry: what pieces encoded)
            m = min(m, int(np.searchsorted(encode, yields, side="right")))
            call.yielded += int(encode[m - 1]) if m else 0
        return m, int(cum[m - 1]) if m else 0

    def _ready(self, bound: int) -> set[int]:
        """The sessions with a round ready to draft: their next entry asks for drafts and
        encodes at most ``bound`` tokens before them (not a prefill). The others' encode
        yields to them (the module docstring)."""
        ready = set()
        for session, queue in self._queues.items():
            job = next((j for j in queue if isinstance(j.state, Pending)), None)
            if job is not None:
                i = job.state.taken
                if job.batch.n_out[i] > 0 and self._next_cost(job, i) - _drafts(job.batch, i, i + 1)[0] <= bound:
                    ready.add(session)
        return ready

    def costs(self, job: Job) -> np.ndarray:
        """``job``'s entries' costs (:class:`~.batching.Charge`), asked of the drafter the
        first time the round is taken (between calls: what the call will find)."""
        if job.costs is None:
            job.costs = self.charge.costs(job.batch)
        return job.costs

    def _next_cost(self, job: Job, taken: int) -> int:
        """The cost of ``job``'s next entry to draft (less what pieces encoded of it)."""
        return int(self.costs(job)[taken]) - job.state.encoded

    def _encode_piece(self, job: Job, state: Pending, first: int, within: float, call: _Call) -> int:
        """A piece of the encode of ``job``'s next entry (its remaining cost ``first``, over
        a whole call) into ``call``: ``within`` tokens at most, leaving its last piece a
        token and its drafts. Returns the tokens taken (0: none)."""
        i, batch = state.taken, job.batch
        last = max(1, int(_drafts(batch, i, i + 1)[0]))  # its last piece: a token, and its drafts
        c = int(min(within, first - last))
        if c < 1:
            return 0
        cut = first - c - (last - 1)  # the stream's tokens after the piece's end: later pieces'
        job.state = state._replace(encoded=state.encoded + c)
        call.pieces.append(Piece(job, i, batch.entries(i, i + 1), c, state.encoded, partial=True, cut=cut))
        call.partial.add(job)
        call.given[job] = call.given.get(job, 0) + c
        call.entries, call.tokens = call.entries + 1, call.tokens + c
        return c


class _Call:
    """A call being taken: its budget, its shares and what it has taken so far."""

    __slots__ = ("now", "pace", "max_entries", "max_tokens", "quantum", "entries_share")
    __slots__ += ("pieces", "late", "given", "partial", "entries", "tokens", "bound", "ready", "yielded")

    def __init__(self, now, pace, max_entries, max_tokens, quantum, entries_share):
        self.now, self.pace, self.max_entries, self.max_tokens = now, pace, max_entries, max_tokens
        self.quantum, self.entries_share = quantum, entries_share
        self.pieces: list[Piece] = []
        self.late: list[Job] = []
        self.given: dict[Job, int] = {}  # tokens of each round in this call
        self.partial: set[Job] = set()  # rounds with a piece of an entry's encode in this call
        self.entries = self.tokens = 0
        self.bound = max(1, max_tokens // YIELD_SHARE)  # encode tokens beside a ready round
        self.ready: set[int] = set()  # sessions with a round ready to draft (FairShare._ready)
        self.yielded = 0  # encode tokens taken by sessions yielding to them

    def yields(self, session: int) -> float:
        """The encode tokens ``session`` may still take in this call: while another
        session has a round ready to draft, the bound less what yielding sessions took;
        else any (math.inf)."""
        if len(self.ready) - (session in self.ready) == 0:
            return math.inf
        return max(0, self.bound - self.yielded)

    def in_time(self, job: Job) -> float:
        """The tokens the drafter can draft for ``job`` before its deadline, at ``pace``,
        beyond those it has in this call already (no pace yet: any, until the deadline)."""
        ahead = job.deadline - self.now
        if ahead <= 0:
            return 0.0
        return ahead / self.pace - self.given.get(job, 0) if self.pace else math.inf

    def full(self) -> bool:
        return self.entries >= self.max_entries or self.tokens >= self.max_tokens

"""Who gets how much of a drafting call: the queued rounds of every session and the fair
share of each call between them (:class:`FairShare`, the scheduler's; its lock guards it).

Shares are counted in **prices**: an entry's predicted seconds of drafter time
(:class:`~.cost.DrafterCost`, learnt from every call), or, before the first call, its
tokens (what it encodes or reads, plus drafts: :class:`~.batching.Charge`). A call has
``max_tokens`` tokens and ``max_entries`` entries at most (caps), and a **time budget**
(below). When a call is taken with ``n`` sessions' rounds queued, each session's turn is
worth a **quantum** of ``1/n`` of the ceiling's price and at most ``max_entries // n``
entries (deficit round robin on drafter time): it takes pieces of its rounds, oldest
first, consecutive entries, while they fit its credit, the call's room and its round's
deadline. A round that does not fit whole is taken in pieces, one a turn; turns go
round until a whole turn takes nothing more or the call is full.

Credit cannot be hoarded:

- **A turn earns its quantum only when the call has room for the session's next
  entry.** Once the call is full, no session is visited again, so none enters the next
  call with credit it earned for a call it could not use.
- **Credit carried to the next call is less than the session's next entry's price** (by
  a token's): it is kept only toward an entry that costs more than what the session
  has, and dropped when the session's queue empties.
- **Sessions that joined the queue since the last call was taken have the first turns**
  of the next one, in the order they came. Their credit is zero, so each takes at most
  its quantum; a session that leaves and comes back gains nothing by it.

**The time budget** (one rule, here). The **ceiling** is ``share`` (``--call-deadline-share``)
of the tightest deadline of a round queued (its span from receipt to deadline), and at
most the price of a call at both caps (before the first call: the token cap alone). A
session's round is **ready to draft** when it asks for drafts, its next entry encodes
at most ``max_tokens // YIELD_SHARE`` tokens (no prefill) and the rest of the round is
priced within the quantum (no backlog). Then:

- a call taken while rounds are ready is their drafting plus ``1/YIELD_SHARE`` of the
  **target**, the most the other sessions' work (backlog, prefill, pieces of an encode)
  may take of it in all;
- any other call is the target: the most the ready rounds of the last ``RECENT_S``
  seconds took to draft (at least ``FLOOR_S``), or the ceiling when none was ready.

So a ready round waits for the call running when it came (as long as ready rounds take)
and its own call (its drafting and a sixteenth), whatever backlog the others keep
queued; a long round, a prefill, is drafted in calls of that length, in pieces (an
entry over the call is taken in pieces of its encode when its drafter keeps its
streams' state, :class:`~.batching.Charge`; a piece fits any credit, so none is carried
for it; any other drafter's is taken alone when nothing else is). With nobody ready for
a while, calls grow to the ceiling. The budget follows the cost model: a call that
overran makes the next prices higher, so the next call takes less.

**The guarantee**: a ready round of a session with nothing else queued, of at most
``max_entries // n`` entries, is drafted whole in the next call taken after it is
queued, whatever the other sessions queued or carry.

Deadlines: a round whose deadline has passed is never drafted: it is handed back as
late. Nor is a round given more of a call than the drafter could draft before its
deadline (the cost model's seconds; no bound before the first call), but a round none of
which is drafted yet gets at least one entry: the model is learnt from calls, so a model
that refused every round would never be corrected.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from .batching import Charge
from .cost import DrafterCost
from .jobs import Job, Pending, Piece

YIELD_SHARE = 16  # beside ready rounds, the others' work is at most this fraction of the target
RECENT_S = 1.0  # how long the drafting of ready rounds sets the target of a call
FLOOR_S = 0.002  # the shortest target: a call's own cost stays small beside its drafting
_ROUNDING = 1 + 1e-9  # a sum of prices compared with a budget made of the same prices: rounding is no overrun
DEFAULT_CALL_SHARE = 0.25  # --call-deadline-share: a round waits one call and drafts in one, half its deadline


def _drafts(batch, start: int, stop: int) -> np.ndarray:
    """What entries ``start:stop`` of ``batch`` cost beyond their encode: the last token
    and the drafts of an entry that asks for any; none of one that encodes only."""
    return np.where(batch.n_out[start:stop] > 0, 1 + batch.width, 0)


class FairShare:
    """Every session's queued rounds, their turns and credits, and each call's time budget.
    Not thread-safe: its owner (the scheduler) calls it under its own lock.

    Invariants: a session is in ``_turns`` exactly when its queue is in ``_queues``
    (non-empty, but for jobs ended meanwhile, dropped when reached); ``_credit`` holds
    only sessions in turn, each less than its next entry's price; the last ``_joined``
    sessions of ``_turns`` joined since the last :meth:`take`."""

    def __init__(self, charge: Charge, cost: DrafterCost | None = None, share: float = DEFAULT_CALL_SHARE):
        if not 0 < share <= 1:
            raise ValueError(f"call deadline share {share}: must be in (0, 1] (--call-deadline-share)")
        self.charge = charge  # what an entry costs in a call (asked when a round is first taken)
        self.cost = DrafterCost() if cost is None else cost  # what it costs the drafter, in seconds
        self.share = share
        self._queues: dict[int, collections.deque[Job]] = {}  # session -> its rounds, oldest first
        self._turns: collections.deque[int] = collections.deque()  # sessions with rounds, in turn
        self._credit: dict[int, float] = {}  # session -> price carried to its next turn
        self._joined = 0
        self._recent = (0.0, -math.inf)  # the most ready rounds took to draft lately, and when

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

    def alone(self, job: Job, now: float, max_entries: int, max_tokens: int) -> bool:
        """``job``, with nothing else queued, is one call whole within the time budget (and
        its deadline ahead of its predicted seconds); the caller checks the caps."""
        self.costs(job)
        self._queues[job.session] = collections.deque([job])
        try:
            call = _Call(now, max_entries, max_tokens, max_entries, self.cost)
            self._budget(call, 1, remember=False)
        finally:
            del self._queues[job.session]
        price = float(call.price(job).sum())
        whole = price <= call.budget and price < call.in_time(job)
        if whole and call.ready:  # a round ready to draft, drafted alone: the target follows it too
            self._remember(price, now)
        return whole

    def take(self, now: float, max_entries: int, max_tokens: int) -> tuple[list[Piece], list[Job]]:
        """The pieces of one call (the module docstring), and the rounds that cannot be
        drafted before their deadline (``now``: the clock when taken), out of the queue."""
        self._turns.rotate(self._joined)  # those that joined since the last call first, in order
        self._joined = 0
        n = len(self._turns)
        call = _Call(now, max_entries, max_tokens, max(1, max_entries // n), self.cost)
        self._budget(call, n)
        stuck = 0  # sessions visited in a row without taking a piece
        # Until a whole turn takes nothing more or the call is full; never an empty call
        # while rounds wait (an empty call has room for any entry: credits grow each turn
        # until a piece fits, and one over the call is taken alone).
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
            if stuck >= len(self._turns) and not call.pieces:  # the ready rounds went late: nobody to yield to
                call.ready.clear()
        return call.pieces, call.late

    def _budget(self, call: _Call, n: int, remember: bool = True) -> None:
        """``call``'s ceiling, quantum, ready rounds and time budget (the module docstring)."""
        cost = self.cost
        width = max((j.batch.width for q in self._queues.values() for j in q), default=0)
        ceiling = call.price_of_caps(width)
        if cost.known:
            spans = [j.deadline - j.queued for q in self._queues.values() for j in q if j.deadline < math.inf]
            ceiling = min([ceiling, *(self.share * s for s in spans if s > 0)])
        call.quantum = max(call.tick, ceiling / n)
        ready = 0.0
        if cost.known or self.charge.pieces:  # (else, before the first call: token caps only)
            for session, queue in self._queues.items():
                job = next((j for j in queue if isinstance(j.state, Pending)), None)
                if job is None:
                    continue
                i = job.state.taken
                encode = self._next_cost(job, i) - _drafts(job.batch, i, i + 1)[0]
                rest = float(call.price(job)[i:].sum()) - call.tick * job.state.encoded
                asks = job.batch.n_out[i:].any()  # (an entry that encodes only may lead it: a chunk)
                if asks and encode <= call.max_tokens // YIELD_SHARE and rest <= call.quantum:
                    call.ready[session], ready = job, ready + rest
        if remember:
            self._remember(ready, call.now)
        recent, at = self._recent
        target = ceiling
        if cost.known and call.now - at <= RECENT_S:
            target = min(ceiling, max(FLOOR_S, recent))
        if call.ready:
            call.bound = max(target / YIELD_SHARE, call.price_of_tokens(1))  # a token of an encode, at least
            call.budget = ready + call.bound
        else:
            call.budget = target

    def _remember(self, ready: float, now: float) -> None:
        """The drafting of the rounds ready now (a price), kept as the target's when it is
        the most of the last ``RECENT_S``."""
        recent, at = self._recent
        if self.cost.known and ready and (ready >= recent or now - at > RECENT_S):
            self._recent = ready, now

    def _turn(self, session: int, queue: collections.deque[Job], call: _Call) -> bool:
        """``session``'s turn in ``call``: its quantum, if the call has room for its next
        entry, spent on pieces of its rounds, oldest first. True when it took one."""
        credit = self._credit.get(session, 0.0)
        granted = took = False
        entries = 0  # taken this turn (at most call.entries_share)
        while queue:
            job, state = queue[0], queue[0].state
            if not isinstance(state, Pending):  # a piece failed: answered already
                queue.popleft()
                continue
            first = self._next_cost(job, state.taken)  # tokens
            first_p = call.next_price(job)
            in_time = call.in_time(job)  # what the drafter can still draft for it before its deadline
            if in_time <= first_p:  # not even its next entry in time
                if job in call.given:
                    break  # what it has in this call is all it can use
                if in_time <= 0 or state.taken or state.encoded:  # its deadline passed, or it had its call
                    call.late.append(queue.popleft())
                    continue
                # The model is learnt from calls, and only a call can correct it (one slow
                # call, a compile or a warm-up, leaves it high): a round not yet drafted
                # gets one entry, not none.
                in_time = first_p
            room = call.budget - call.spent
            yields = call.yields(session, job)  # what it may still take beside ready rounds (inf: no bound)
            encode = first - max(1, int(_drafts(job.batch, state.taken, state.taken + 1)[0]))  # before its last piece
            over = first > call.max_tokens or first_p > min(call.budget, yields)
            pieced = self.charge.pieces and encode > 0 and over
            if not granted:
                if (call.tick if pieced else first_p) > room and call.pieces:  # no room for its work: no credit either
                    break
                credit, granted = credit + call.quantum, True
            within = min(room, credit, in_time, yields)
            most = min(call.entries_share - entries, call.max_entries - call.entries)
            left = len(job.batch) - state.taken
            if job in call.partial:  # a piece of its encode is in this call: the rest in the next
                break
            if pieced and most > 0:  # a piece of its encode, its share (and the bound) at most
                price = self._encode_piece(job, state, first, within, call)
                credit, took = credit - price, took or price > 0
                break
            whole = float(call.price(job).sum())
            fits = whole <= within * _ROUNDING and job.cost <= call.max_tokens - call.tokens and left <= most
            if state.taken == 0 and fits:
                m, cost, price = left, job.cost, whole  # the whole round (the common case: no prefix sums)
            else:
                m, cost, price = self._count(job, state, within, most, yields, call)
            if m == 0:
                break
            start, taken = state.taken, state.taken + m
            job.state = Pending(taken, state.parts)
            call.pieces.append(Piece(job, start, job.piece(start, taken), cost, state.encoded))
            call.add(job, m, cost, price, yields < math.inf)
            entries += m
            credit, took = credit - price, True
            if taken < len(job.batch):
                break  # its share is spent: the rest in a later turn
            queue.popleft()
        head = queue[0] if queue else None
        if head is not None and isinstance(head.state, Pending):  # carried: less than its next entry
            nxt, nxt_p = self._next_cost(head, head.state.taken), call.next_price(head)
            split = self.charge.pieces and (nxt > call.max_tokens or nxt_p > call.budget)  # pieces fit any credit
            self._credit[session] = 0.0 if split else max(0.0, min(credit, nxt_p - call.tick))
        else:
            self._credit.pop(session, None)
        return took

    def _count(self, job: Job, state: Pending, within: float, most: int, yields: float, call: _Call):
        """How many of ``job``'s next entries fit ``within`` (a price), the call's token room
        and ``most`` entries; their tokens and price. One entry over the whole call is
        taken alone when the call has nothing yet and no ready round to yield to (``yields``
        inf: it would never fit otherwise)."""
        i = state.taken
        cum = np.cumsum(self.costs(job)[i:]) - state.encoded
        cum_p = np.cumsum(call.price(job)[i:]) - call.tick * state.encoded
        m = min(int(np.searchsorted(cum_p, within * _ROUNDING, side="right")), most)
        m = min(m, int(np.searchsorted(cum, call.max_tokens - call.tokens, side="right")))
        over = cum[0] > call.max_tokens or (yields == math.inf and cum_p[0] > call.budget - call.spent)
        if m == 0 and not call.pieces and over:
            m = 1  # an entry over the whole call: drafted alone
        return m, int(cum[m - 1]) if m else 0, float(cum_p[m - 1]) if m else 0.0

    def costs(self, job: Job) -> np.ndarray:
        """``job``'s entries' costs (:class:`~.batching.Charge`), asked of the drafter the
        first time the round is taken (between calls: what the call will find)."""
        if job.costs is None:
            job.costs = self.charge.costs(job.batch)
        return job.costs

    def _next_cost(self, job: Job, taken: int) -> int:
        """The cost of ``job``'s next entry to draft (less what pieces encoded of it)."""
        return int(self.costs(job)[taken]) - job.state.encoded

    def _encode_piece(self, job: Job, state: Pending, first: int, within: float, call: _Call) -> float:
        """A piece of the encode of ``job``'s next entry (its remaining cost ``first``
        tokens, over the call or the bound) into ``call``: ``within`` (a price) at most,
        a token at least in an empty call, leaving its last piece a token and its drafts.
        Returns the piece's price (0: none taken)."""
        i, batch = state.taken, job.batch
        last = max(1, int(_drafts(batch, i, i + 1)[0]))  # its last piece: a token, and its drafts
        c = min(self.cost.tokens_within(within), call.max_tokens - call.tokens, first - last)
        c = max(c, 0 if call.pieces else min(1, first - last))
        if c < 1:
            return 0.0
        cut = first - c - (last - 1)  # the stream's tokens after the piece's end: later pieces'
        job.state = state._replace(encoded=state.encoded + c)
        call.pieces.append(Piece(job, i, batch.entries(i, i + 1), c, state.encoded, partial=True, cut=cut))
        call.partial.add(job)
        price = call.price_of_tokens(c)
        call.add(job, 1, c, price, call.yields(job.session, job) < math.inf)
        return price


class _Call:
    """A call being taken: its budgets, its shares and what it has taken so far."""

    __slots__ = ("now", "max_entries", "max_tokens", "entries_share", "cost", "tick", "quantum", "budget", "bound")
    __slots__ += ("ready", "pieces", "late", "given", "partial", "entries", "tokens", "spent", "yielded", "_prices")

    def __init__(self, now: float, max_entries: int, max_tokens: int, entries_share: int, cost: DrafterCost):
        self.now, self.max_entries, self.max_tokens, self.entries_share = now, max_entries, max_tokens, entries_share
        self.cost, self.tick = cost, cost.tick()
        self.quantum = self.budget = math.inf  # FairShare._budget sets them (prices)
        self.bound = math.inf  # the others' work beside ready rounds (inf: none ready)
        self.ready: dict[int, Job] = {}  # session -> its round ready to draft (FairShare._budget)
        self.pieces: list[Piece] = []
        self.late: list[Job] = []
        self.given: dict[Job, float] = {}  # the price of each round's pieces in this call
        self.partial: set[Job] = set()  # rounds with a piece of an entry's encode in this call
        self.entries = self.tokens = 0
        self.spent = self.yielded = 0.0  # the price taken; of it, by sessions yielding to ready rounds
        self._prices: dict[Job, np.ndarray] = {}

    def price(self, job: Job) -> np.ndarray:
        """``job``'s entries' prices (:meth:`~.cost.DrafterCost.prices`), once a call."""
        got = self._prices.get(job)
        if got is None:
            got = self._prices[job] = self.cost.prices(job.costs, job.batch.n_out, job.batch.width)
        return got

    def next_price(self, job: Job) -> float:
        """The price of ``job``'s next entry, less what pieces encoded of it."""
        return float(self.price(job)[job.state.taken]) - self.tick * job.state.encoded

    def price_of_caps(self, width: int) -> float:
        """The price of a call at both caps, its entries ``width`` drafts wide (before the
        first call: the token cap)."""
        if not self.cost.known:
            return float(self.max_tokens)
        _, b, c, d = self.cost.coef * self.cost.over
        return float(b * self.max_entries + c * self.max_tokens + d * self.max_entries * width)

    def price_of_tokens(self, tokens: int) -> float:
        """The price of one entry of ``tokens`` tokens and no drafts (a piece of an encode)."""
        return float(self.cost.prices(np.array([tokens]), np.zeros(1, np.int32), 0)[0])

    def add(self, job: Job, entries: int, tokens: int, price: float, yielding: bool) -> None:
        self.given[job] = self.given.get(job, 0.0) + price
        self.entries, self.tokens, self.spent = self.entries + entries, self.tokens + tokens, self.spent + price
        self.yielded += price if yielding else 0.0

    def yields(self, session: int, job: Job) -> float:
        """What ``session`` may still take of this call for ``job``: any (math.inf) for a
        round ready to draft, or with none ready; else the bound less what others took."""
        if not self.ready or self.ready.get(session) is job:
            return math.inf
        return max(0.0, self.bound - self.yielded)

    def in_time(self, job: Job) -> float:
        """The price the drafter can draft for ``job`` before its deadline, beyond what it
        has in this call already (before the first call: any, until the deadline)."""
        ahead = job.deadline - self.now
        if ahead <= 0:
            return 0.0
        return ahead - self.given.get(job, 0.0) if self.cost.known else math.inf

    def full(self) -> bool:
        return self.entries >= self.max_entries or self.tokens >= self.max_tokens or self.spent >= self.budget

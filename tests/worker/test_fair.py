"""A call's fair share (remote_dspark.worker.fair) through the scheduler: an honest round
is drafted in the next call under a hostile session that is always busy, whatever credit
that session tried to hoard; a round is never drafted past its deadline, neither once
expired nor beyond what the drafter's cost says it can draft in time. The drafter is fake: each
call costs its tokens at a fixed pace on a clock the test owns, and is held at a gate so
that rounds queue deterministically. Encode yielding to a round ready to draft is a
function of the queue: those tests take calls of a FairShare directly."""

import dataclasses
import math

import numpy as np
import pytest
from helpers import Clock, Gated, stream_batch, submit, until

from remote_dspark.drafter.contract import DraftBatch, DraftResult
from remote_dspark.worker.batching import Charge
from remote_dspark.worker.fair import YIELD_SHARE, FairShare
from remote_dspark.worker.jobs import Job
from remote_dspark.worker.scheduler import Scheduler

PACE = 0.001  # the fake drafter's clock seconds a budget token


class Ones:
    """A drafter that takes mixed sessions and drafts token 1 everywhere."""

    drafter_identity, markov_identity = b"d" * 32, b"m" * 32
    mixed_sessions = True
    context_read = None

    def draft_batch(self, batch):
        return DraftResult(np.ones((len(batch), batch.width), np.int32), batch.n_out.copy())


def Paced(clock) -> Gated:
    """:class:`Ones` behind a gate, costing ``PACE`` clock seconds a budget token
    (contexts plus drafts); every call recorded."""
    return Gated(Ones(), clock, PACE, tokens=lambda batch: int(Charge(Ones()).costs(batch).sum()))


def rounds(session, n, context, width=3) -> DraftBatch:
    """``n`` entries of ``session``, each a context of ``context`` tokens and ``width`` drafts."""
    return stream_batch(session, range(n), [[1] * context] * n, width)


def joined(threads):
    for t, _ in threads:
        t.join(10)
        assert not t.is_alive(), "a round was never answered"


def sessions_of(call: DraftBatch) -> list[int]:
    return np.atleast_1d(call.sessions()).tolist()


def test_an_honest_round_is_drafted_in_the_next_call_under_an_always_busy_session():
    """A hostile session's round of eight budgets keeps it queued in every call. While
    one of its calls is drafted, an honest 4-entry round queues: the next call drafts it
    whole (the share the hostile earned alone, and the turns it was visited with the call
    full, carry nothing into it), and the hostile has the rest of the budget."""
    n, context, width = 64, 30, 20  # 64 entries of 50 tokens
    clock = Clock()
    drafter = Paced(clock)
    s = Scheduler(drafter, max_entries=32, max_tokens=400, clock=clock).start()
    try:
        drafter.hold.set()
        flood = submit(s, 1, rounds(1, n, context, width))
        assert drafter.entered.wait(10)  # the flood's first call, held
        honest = submit(s, 7, rounds(7, 4, 3), deadline=clock.now + 1.0)
        assert until(lambda: s._fair.queued() == 2)
        drafter.hold.clear()
        drafter.release.set()
        joined([flood, honest])
    finally:
        s.stop()
    assert sessions_of(drafter.calls[0]) == [1] * len(drafter.calls[0])
    assert sessions_of(drafter.calls[1]).count(7) == 4  # the whole honest round, in the next call
    assert honest[1]["result"].counts.tolist() == [3] * 4
    assert flood[1]["result"].counts.tolist() == [width] * n  # the flood drafted whole all the same


def test_a_session_s_turn_takes_its_share_of_the_entries_budget():
    """Two sessions' rounds queued together, the hostile one first with twice the
    entries budget in cheap entries (4 tokens each: far within the tokens budget, and
    within its share of a call's time, so both rounds are ready to draft): its turn takes
    half the entries, so the honest round is in the same call."""
    clock = Clock()
    drafter = Paced(clock)
    s = Scheduler(drafter, max_entries=32, max_tokens=1024, clock=clock).start()
    try:
        drafter.hold.set()
        first = submit(s, 99, rounds(99, 1, 2))
        assert drafter.entered.wait(10)
        flood = submit(s, 1, rounds(1, 64, 1))
        assert until(lambda: s._fair.queued() == 1)
        honest = submit(s, 7, rounds(7, 4, 3))
        assert until(lambda: s._fair.queued() == 2)
        drafter.hold.clear()
        drafter.release.set()
        joined([first, flood, honest])
    finally:
        s.stop()
    assert sessions_of(drafter.calls[1]) == [1] * 16 + [7] * 4 + [1] * 12
    assert honest[1]["result"].counts.tolist() == [3] * 4 and flood[1]["result"].counts.tolist() == [3] * 64


def test_a_round_that_expires_while_an_earlier_group_of_its_call_drafts_is_not_drafted():
    """A narrow round and a wide one taken in one call (each within its share of the
    call's time): the narrow group is drafted first and outlasts its prediction (ten
    times) and the wide round's deadline, so the wide round is answered with no drafts
    and never reaches the drafter."""
    clock = Clock()
    drafter = Paced(clock)
    s = Scheduler(drafter, max_entries=64, max_tokens=1024, clock=clock).start()
    tokens = drafter.tokens
    drafter.tokens = lambda batch: tokens(batch) * (10 if batch.width == 3 and len(drafter.calls) > 1 else 1)
    try:
        drafter.hold.set()
        first = submit(s, 99, rounds(99, 1, 2))
        assert drafter.entered.wait(10)
        narrow = submit(s, 3, rounds(3, 4, 7), deadline=10.0)  # 40 tokens: 40 ms predicted, 0.4 s drafted
        wide = submit(s, 4, rounds(4, 1, 2, width=32), deadline=clock.now + 0.4)  # 34 ms: ready to draft beside it
        assert until(lambda: s._fair.queued() == 2)
        drafter.hold.clear()
        drafter.release.set()
        joined([first, narrow, wide])
    finally:
        s.stop()
    assert [sessions_of(c) for c in drafter.calls[1:]] == [[3, 3, 3, 3]]
    assert wide[1] == {"result": None} and narrow[1]["result"].counts.tolist() == [3] * 4


def test_a_round_gets_no_more_of_a_call_than_the_drafter_can_draft_before_its_deadline():
    """Once a call has shown the drafter's pace (1 ms a token), a round gets what that
    pace drafts before its deadline: one with time for two of its entries gets two, one
    without time for even one gets its next entry only (never none while its deadline is
    ahead: a call is how the pace is corrected), one whose deadline passed gets nothing:
    the rest of the call is not spent on drafts its engine has stopped waiting for. (A
    call's ceiling is its whole deadline here: at the default share the ceiling, a
    quarter of the deadline, would bound the round before its deadline does.)"""
    clock = Clock()
    drafter = Paced(clock)
    s = Scheduler(drafter, max_entries=64, max_tokens=1024, clock=clock, call_share=1.0).start()
    try:
        s.draft(99, rounds(99, 1, 7))  # 10 tokens in 10 ms: the pace
        now = clock.now
        hopeless = s.draft(1, rounds(1, 5, 7), deadline=now + 0.009)  # an entry of 10 tokens: 10 ms
        now = clock.now
        short = s.draft(2, rounds(2, 10, 7), deadline=now + 0.025)  # time for two entries
        expired = s.draft(3, rounds(3, 4, 7), deadline=clock.now)
    finally:
        s.stop()
    assert hopeless.counts.tolist() == [3] + [0] * 4 and short.counts.tolist() == [3, 3] + [0] * 8
    assert expired is None
    assert [len(c) for c in drafter.calls] == [1, 1, 2]


def test_one_slow_call_never_stops_the_worker_drafting():
    """The first call is slow (a compile, a warm-up: 2 s for 10 tokens), so the cost it
    leaves says no round of 200 ms can be drafted. The next such round (40 ms: within the
    call's share of its deadline) still gets an entry; its call shows the true pace (1 ms
    a token), so the rest of the round follows in the next call, and the round after it
    is one call."""
    clock = Clock()
    drafter = Paced(clock)
    s = Scheduler(drafter, max_entries=64, max_tokens=1024, clock=clock).start()
    calls, tokens = drafter.calls, drafter.tokens
    drafter.tokens = lambda batch: tokens(batch) * (200 if len(calls) == 1 else 1)  # the first call: 2 s for 10 tokens
    try:
        s.draft(99, rounds(99, 1, 7))
        assert s.cost.seconds(1, 10, 3) == pytest.approx(2.0)
        first = s.draft(1, rounds(1, 4, 7), deadline=clock.now + 0.2)
        second = s.draft(1, rounds(1, 4, 7), deadline=clock.now + 0.2)
    finally:
        s.stop()
    assert first.counts.tolist() == second.counts.tolist() == [3] * 4
    assert [len(c) for c in calls] == [1, 1, 3, 4]  # one entry, then the cost is right
    assert s.cost.seconds(1, 10, 3) == pytest.approx(10 * PACE)


class Keeps:
    """A drafter that keeps its streams (its long encodes are taken in pieces) and encodes
    each entry's whole context (a cache miss)."""

    keeps_streams = True

    def encodes(self, batch):
        return np.diff(batch.offsets)


BUDGET = 1024  # a call's tokens in the yield tests: the bound is BUDGET // YIELD_SHARE
BOUND = BUDGET // YIELD_SHARE


def announced(session, n, context, n_out=0, width=5) -> Job:
    """A round announcing ``n`` contexts of ``context`` tokens: chunks that encode only
    (``n_out`` 0), or whole NEW_GEN contexts asking for drafts."""
    batch = dataclasses.replace(
        stream_batch(session, range(n), [[1] * context] * n, width), n_out=np.full(n, n_out, np.int32)
    )
    return Job(session, batch, math.inf, None, 0.0)


def steady(session=7) -> Job:
    """A steady round: 16 entries of 3 new tokens and 5 drafts (8 tokens each)."""
    return Job(session, stream_batch(session, range(16), [[2] * 3] * 16, 5), math.inf, None, 0.0)


def took(pieces, session) -> tuple[int, int]:
    """The entries (whole ones: not pieces of an encode) and the tokens ``session`` has in a call."""
    mine = [p for p in pieces if p.job.session == session]
    return sum(len(p.batch) for p in mine if not p.partial), sum(p.cost for p in mine)


@pytest.mark.parametrize("n_out", [0, 5], ids=["chunks", "new-gen"])
def test_a_call_beside_a_round_ready_to_draft_carries_it_whole_and_at_most_the_bound_of_encode(n_out):
    """An engine announces long contexts (chunks that encode only, or whole NEW_GENs whose
    encode is a prefill), several rounds of them queued; a steady round waits beside
    them. The call carries the steady round whole and at most the bound of the
    announcement's encode, a piece of it: short, so the steady round waits for one
    call only; and the announcement advances in it all the same."""
    fair = FairShare(Charge(Keeps()))
    for _ in range(4):
        fair.add(announced(1, 8, 300, n_out))
    fair.add(steady())
    pieces, late = fair.take(0.0, 1024, BUDGET)
    assert took(pieces, 7) == (16, 16 * 8) and not late
    assert 0 < took(pieces, 1)[1] <= BOUND


def test_the_announcement_advances_every_call_and_takes_the_whole_budget_when_nobody_waits():
    """Calls taken with a steady round ready each time: the announcing engine has a piece
    of at most the bound in every one, and its encode adds up (nothing lost or taken
    twice). Once nobody else waits, it has the whole budget; another announcing engine
    does not make it yield either (a prefill is not a round ready to draft)."""
    fair = FairShare(Charge(Keeps()))
    fair.add(announced(1, 8, 300))
    encoded = 0
    for _ in range(10):
        fair.add(steady())
        pieces, _ = fair.take(0.0, 1024, BUDGET)
        entries, tokens = took(pieces, 1)
        assert took(pieces, 7)[0] == 16 and 0 < tokens <= BOUND
        encoded += tokens
    assert encoded == 10 * BOUND  # (pieces of 300-token entries: the bound each call)
    pieces, _ = fair.take(0.0, 1024, BUDGET)  # alone
    assert BUDGET - 300 < took(pieces, 1)[1] <= BUDGET
    fair.add(announced(2, 8, 300, n_out=5))
    pieces, _ = fair.take(0.0, 1024, BUDGET)  # two announcing engines: the budget between them
    assert BUDGET - 2 * 300 < took(pieces, 1)[1] + took(pieces, 2)[1] <= BUDGET
    assert took(pieces, 1)[1] > BOUND and took(pieces, 2)[1] > BOUND

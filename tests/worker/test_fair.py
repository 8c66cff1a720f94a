"""A call's fair share (remote_dspark.worker.fair) through the scheduler: an honest round
is drafted in the next call under a hostile session that is always busy, whatever credit
that session tried to hoard; a round is never drafted past its deadline, neither once
expired nor beyond what the drafter's pace can draft in time. The drafter is fake: each
call costs its tokens at a fixed pace on a clock the test owns, and is held at a gate so
that rounds queue deterministically."""

import numpy as np
import pytest
from helpers import Clock, Gated, stream_batch, submit, until

from remote_dspark.drafter.contract import DraftBatch, DraftResult
from remote_dspark.worker.batching import Charge
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
    entries budget in cheap entries (4 tokens each: far within the tokens budget): its
    turn takes half the entries, so the honest round is in the same call."""
    clock = Clock()
    drafter = Paced(clock)
    s = Scheduler(drafter, max_entries=32, max_tokens=400, clock=clock).start()
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
    """A narrow round and a wide one taken in one call: the narrow group is drafted first
    and outlasts the wide round's deadline, so the wide round is answered with no drafts
    and never reaches the drafter."""
    clock = Clock()
    drafter = Paced(clock)
    s = Scheduler(drafter, max_entries=64, max_tokens=1024, clock=clock).start()
    try:
        drafter.hold.set()
        first = submit(s, 99, rounds(99, 1, 2))
        assert drafter.entered.wait(10)
        narrow = submit(s, 3, rounds(3, 4, 97), deadline=10.0)  # 400 tokens: 0.4 s
        wide = submit(s, 4, rounds(4, 1, 2, width=64), deadline=clock.now + 0.2)
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
    the rest of the call is not spent on drafts its engine has stopped waiting for."""
    clock = Clock()
    drafter = Paced(clock)
    s = Scheduler(drafter, max_entries=64, max_tokens=1024, clock=clock).start()
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
    """The first call is slow (a compile, a warm-up: 2 s for 10 tokens), so the pace it
    leaves says no round of 50 ms can be drafted. The next such round still gets an entry;
    its call shows the true pace (1 ms a token), so the rest of the round follows in the
    next call, and the round after it is one call."""
    clock = Clock()
    drafter = Paced(clock)
    s = Scheduler(drafter, max_entries=64, max_tokens=1024, clock=clock).start()
    calls, tokens = drafter.calls, drafter.tokens
    drafter.tokens = lambda batch: tokens(batch) * (200 if len(calls) == 1 else 1)  # the first call: 2 s for 10 tokens
    try:
        s.draft(99, rounds(99, 1, 7))
        assert s._pace == 0.2
        first = s.draft(1, rounds(1, 4, 7), deadline=clock.now + 0.05)
        second = s.draft(1, rounds(1, 4, 7), deadline=clock.now + 0.05)
    finally:
        s.stop()
    assert first.counts.tolist() == second.counts.tolist() == [3] * 4
    assert [len(c) for c in calls] == [1, 1, 3, 4] and s._pace == pytest.approx(
        PACE
    )  # one entry, then the pace is right

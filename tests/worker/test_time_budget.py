"""Calls bounded in time and shared by drafter time (remote_dspark.worker.fair, with the
cost model of remote_dspark.worker.cost) through the scheduler: under a storm an honest
round waits for one short call and is drafted in the next, itself short; a call that
overran its time shrinks the next; two backlogged engines whose entries cost different
seconds a token get equal drafter time. The drafter is fake: each call moves a clock
the test owns by a known cost of its shape, so every call's seconds are exact."""

import numpy as np
import pytest
from helpers import Clock, stream_batch, submit, until

from remote_dspark.drafter.contract import DraftResult
from remote_dspark.worker.batching import Charge
from remote_dspark.worker.scheduler import Scheduler


class Timed:
    """A drafter of mixed sessions that drafts token 1 everywhere; a call costs
    ``per_entry`` seconds an entry and ``per_token`` a budget token (contexts plus drafts),
    times ``slow(n)`` for the n-th call (1-based), on ``clock``. ``during[n]`` runs half-way
    through the n-th call (a round arriving while it drafts). Records each call and its seconds."""

    drafter_identity, markov_identity = b"d" * 32, b"m" * 32
    mixed_sessions = True
    context_read = None

    def __init__(self, clock, per_token, per_entry=0.0, slow=lambda n: 1.0):
        self.clock, self.per_token, self.per_entry, self.slow = clock, per_token, per_entry, slow
        self.calls, self.seconds, self.during = [], [], {}

    def draft_batch(self, batch):
        self.calls.append(batch)
        tokens = int(Charge(self).costs(batch).sum())
        spent = (self.per_entry * len(batch) + self.per_token * tokens) * self.slow(len(self.calls))
        self.clock.now += spent / 2
        if len(self.calls) in self.during:  # half-way through the call
            self.during.pop(len(self.calls))()
        self.clock.now += spent / 2
        self.seconds.append(spent)
        return DraftResult(np.ones((len(batch), batch.width), np.int32), batch.n_out.copy())


def rounds(session, n, context, width=3):
    return stream_batch(session, range(n), [[1] * context] * n, width)


def of(call, session) -> int:
    return int((np.atleast_1d(call.sessions()) == session).sum())


def test_under_a_storm_an_honest_round_waits_for_one_short_call_and_is_drafted_in_the_next():
    """Three engines queue rounds of 1,024 long entries with no deadline; an honest engine's
    16-entry round (about 2 ms of drafting, 100 ms deadline) was drafted a moment before,
    and its next round arrives while a storm call drafts. The call it arrives in is short
    (about the honest round's own drafting), the next call drafts it whole, and that call
    is its drafting and a sixteenth more: the honest round is answered within a quarter of
    its deadline, however much the storm has queued."""
    clock = Clock()
    drafter = Timed(clock, per_token=1e-5)  # 10 us a token: a call of the whole token budget is 0.33 s
    s = Scheduler(drafter, max_entries=1024, max_tokens=1 << 15, clock=clock).start()
    honest_round = rounds(7, 16, 10)  # 16 entries of 13 tokens: 2.08 ms
    threads = []
    try:
        for _ in range(2):  # the first call teaches the model; the second is a round ready to draft
            assert s.draft(7, honest_round, deadline=clock.now + 0.1).counts.tolist() == [3] * 16
        alone = drafter.seconds[-1]

        def honest_arrives():
            honest.append(submit(s, 7, honest_round, deadline=clock.now + 0.1))
            assert until(lambda: s._fair.queued() == 4)  # the three storms, and the honest round

        honest = []
        drafter.during[3] = lambda: until(lambda: s._fair.queued() == 3)  # the storm's first call
        drafter.during[5] = honest_arrives  # during the storm's third call
        for session in (1, 2, 3):
            threads.append(submit(s, session, rounds(session, 1024, 60)))  # 63 tokens an entry: 0.63 ms
        assert until(lambda: len(honest) == 1)
        (honest,) = honest
        threads.append(honest)
        honest[0].join(10)
        assert not honest[0].is_alive()
    finally:
        s.stop()
        for t, _ in threads:
            t.join(10)
    arrived = 4  # the 5th call: the storm's third
    at = next(i for i, c in enumerate(drafter.calls) if i > 1 and of(c, 7))
    assert at == arrived + 1 and of(drafter.calls[at], 7) == 16  # the next call, the round whole
    assert honest[1]["result"].counts.tolist() == [3] * 16
    assert drafter.seconds[arrived] <= 1.1 * alone  # the call it waited for: short
    assert drafter.seconds[at] <= alone * (1 + 1 / 16)  # its own: its drafting and a sixteenth at most


def test_a_call_that_overruns_its_time_shrinks_the_next():
    """A backlogged round (no other engine) is drafted in calls of a quarter of its
    deadline's span (10 s of 40 s at 1 ms a token). The first such call takes twice its
    prediction: the next call takes half as many entries (the model scales its
    predictions by the overrun); the call after it, back on time, is full again."""
    clock = Clock()
    drafter = Timed(clock, per_token=1e-3, slow=lambda n: 2.0 if n == 2 else 1.0)
    s = Scheduler(drafter, max_entries=4096, max_tokens=1 << 15, clock=clock).start()
    try:
        s.draft(99, rounds(99, 1, 7))  # 10 tokens in 10 ms: the drafter's cost
        clock.now += 2.0  # (no round drafted lately: calls are sized by the ceiling alone)
        got = s.draft(1, rounds(1, 2500, 7), deadline=clock.now + 40.0)  # 2,500 entries of 10 ms
    finally:
        s.stop()
    sizes = [len(c) for c in drafter.calls]
    assert sizes[1] == 1000 and drafter.seconds[1] == pytest.approx(20.0)  # 10 s predicted, 20 s taken
    assert sizes[2] == 500  # the overrun halves the next call
    assert sizes[3] > sizes[2]  # that one was on time: the next grows back
    assert got.counts[:1500].tolist() == [3] * 1500


def test_two_backlogged_engines_share_the_drafter_by_its_time_not_by_tokens():
    """Two engines keep the drafter busy: one's entries are long contexts (100 tokens,
    2 ms: tokens are cheap), the other's short ones (4 tokens, 1.04 ms: the entry's own
    cost dominates). Calls are as long as a round ready to draft took a moment before
    (40 ms); once the cost model has learnt the drafter (its first calls), the two have
    about equal drafter time over the calls that follow. Shared by tokens, the short
    entries would take over ten times the long ones' time."""
    clock = Clock()
    drafter = Timed(clock, per_token=1e-5, per_entry=1e-3)
    s = Scheduler(drafter, max_entries=1024, max_tokens=4096, clock=clock).start()
    threads = []
    try:
        for _ in range(2):  # the first call teaches the model; the second is a round ready to draft
            s.draft(9, rounds(9, 20, 97))  # 40 ms
        drafter.during[3] = lambda: until(lambda: s._fair.queued() == 2)
        threads.append(submit(s, 1, rounds(1, 600, 97)))
        threads.append(submit(s, 2, rounds(2, 4000, 1)))
        for t, _ in threads:
            t.join(20)
            assert not t.is_alive()
    finally:
        s.stop()
    calls = drafter.calls[9:17]  # the model fitted (8 calls), within a second of the ready round
    assert all(of(c, 1) or of(c, 2) for c in calls)
    long_s = sum(of(c, 1) for c in calls) * (1e-3 + 100 * 1e-5)
    short_s = sum(of(c, 2) for c in calls) * (1e-3 + 4 * 1e-5)
    assert 0.8 < long_s / short_s < 1.25

"""The worker's drafter thread (remote_dspark.worker.scheduler): rounds of several engines
queued together are drafted in one call, each getting exactly what it gets alone; a
round whose deadline passed in the queue is answered empty and counted; a storm of big
rounds does not push a small one past its deadline (deficit round robin); a drafter that
cannot take mixed sessions is called once per round. The drafter is held at a gate so
that rounds queue deterministically; time is a clock the test moves (or the drafter
moves, by the tokens it drafts)."""

import dataclasses
import threading

import numpy as np
import pytest
from helpers import Clock, Gated, connect, stream_batch, submit, until

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.contract import DraftBatch, DraftResult, context_read_of
from remote_dspark.drafter.markov import MarkovModel
from remote_dspark.worker import Worker
from remote_dspark.worker.batching import Charge
from remote_dspark.worker.limits import Limits, hello_refusal
from remote_dspark.worker.scheduler import DEFAULT_MAX_ENTRIES, Scheduler

COUNTING = MarkovModel.from_tokens([1, 2, 3, 4, 5, 6, 7] * 10, order=1, top=2)


class Recording(MarkovDrafter):
    """The Markov drafter, keeping each call's entry count and the thread that made it."""

    def __init__(self, model):
        super().__init__(model)
        self.calls: list[int] = []
        self.threads: list[threading.Thread] = []

    def draft_batch(self, batch):
        self.calls.append(len(batch))
        self.threads.append(threading.current_thread())
        return super().draft_batch(batch)


def queued(scheduler) -> int:
    return scheduler.queued()


def gate_then(scheduler, gated, jobs):
    """Hold the drafter in a first call, queue ``jobs`` ((session, batch, deadline)...),
    then let it go. Returns the jobs' (thread, box) in order, all joined."""
    gated.hold.set()
    first = submit(scheduler, 99, stream_batch(99, [0], [[1, 2]]))
    assert gated.entered.wait(10)
    started = [submit(scheduler, *job) for job in jobs]
    assert until(lambda: queued(scheduler) == len(jobs))
    gated.hold.clear()
    gated.release.set()
    for t, _ in [first, *started]:
        t.join(10)
        assert not t.is_alive()
    return started


def test_rounds_queued_together_are_one_call_and_each_gets_what_it_gets_alone():
    markov = MarkovDrafter(COUNTING)
    gated = Gated(markov)
    s = Scheduler(gated, max_entries=64, max_tokens=1024).start()
    try:
        a = stream_batch(1, [0, 1], [[1, 2, 3], [5]], width=3, want_margin=True)
        b = stream_batch(2, [0], [[6, 7, 1, 2]], width=3)  # one width: one call (wider: test below)
        (_, box_a), (_, box_b) = gate_then(s, gated, [(1, a, float("inf")), (2, b, float("inf"))])
    finally:
        s.stop()
    merged = gated.calls[1]
    assert len(gated.calls) == 2 and len(merged) == 3 and merged.sessions().tolist() == [1, 1, 2]
    for box, batch in ((box_a, a), (box_b, b)):
        alone = markov.draft_batch(batch)
        got = box["result"]
        assert got.tokens.shape == (len(batch), batch.width) and got.counts.tolist() == alone.counts.tolist()
        assert got.tokens.tolist() == alone.tokens.tolist()
        assert (got.margins is None) == (not batch.want_margin)


class Sampling:
    """A sampled drafter of a fixed rule: every entry drafts ``last + 1 + seed`` (mod 128)
    then on, each draft with the whole weight on it among 32 consecutive ids."""

    drafter_identity, markov_identity = b"s" * 32, b"m" * 32
    mixed_sessions = samples = True

    def draft_batch(self, batch):
        n, k = len(batch), batch.width
        last = batch.tokens[batch.offsets[1:] - 1].astype(np.int64)
        seed = batch.seed.astype(np.int64) if batch.sampled else np.zeros(n, np.int64)
        tokens = (last[:, None] + 1 + seed[:, None] + np.arange(k)) % 128
        if not batch.sampled:
            return DraftResult(tokens.astype(np.int32), batch.n_out.copy())
        ids = (tokens[..., None] + np.arange(32)) % 128
        weights = np.zeros((n, k, 32), np.uint16)
        weights[..., 0] = 65535
        return DraftResult(tokens.astype(np.int32), batch.n_out.copy(), None, ids.astype(np.int32), weights)


def sampled(batch, seed):
    n = len(batch)
    return dataclasses.replace(batch, temperature=np.ones(n, np.float32), seed=np.full(n, seed, np.uint64))


def test_sampled_rounds_share_a_call_never_with_greedy_ones_and_keep_their_distributions():
    gated = Gated(Sampling())
    gated.samples = True
    s = Scheduler(gated, max_entries=64, max_tokens=1024).start()
    try:
        a = sampled(stream_batch(1, [0, 1], [[1, 2, 3], [5]]), 1)
        b = sampled(stream_batch(2, [0], [[6, 7]]), 2)
        jobs = [(1, a, float("inf")), (2, b, float("inf"))]
        (_, box_a), (_, box_b) = gate_then(s, gated, jobs)
        gated.release.clear()
        gated.entered.clear()
        gated.hold.set()
        greedy = stream_batch(3, [0], [[9]])
        first = submit(s, 99, sampled(stream_batch(99, [0], [[1, 2]]), 0))
        assert gated.entered.wait(10)
        held = [submit(s, 4, sampled(stream_batch(4, [0], [[9]]), 0)), submit(s, 3, greedy)]
        assert until(lambda: queued(s) == 2)
        gated.hold.clear()
        gated.release.set()
        for t, _ in [first, *held]:
            t.join(10)
    finally:
        s.stop()
    assert len(gated.calls[1]) == 3 and gated.calls[1].sampled  # a and b in one call
    assert box_a["result"].tokens.tolist() == [[5, 6, 7], [7, 8, 9]] and box_b["result"].tokens.tolist() == [
        [10, 11, 12]
    ]
    assert box_a["result"].q_ids.shape == (2, 3, 32) and box_a["result"].q_ids[1, 0, 0] == 7
    assert box_b["result"].q_weights[0, :, 0].tolist() == [65535] * 3
    assert "error" not in held[1][1] and held[1][1]["result"].q_ids is None  # greedy: no distributions
    assert [c.sampled for c in gated.calls[-2:]] in ([True, False], [False, True])  # not merged


def test_a_round_whose_deadline_passed_in_the_queue_is_answered_empty():
    clock = Clock()
    gated = Gated(MarkovDrafter(COUNTING))
    s = Scheduler(gated, max_entries=64, max_tokens=1024, clock=clock).start()
    try:
        gated.hold.set()
        first = submit(s, 99, stream_batch(99, [0], [[1, 2]]))
        assert gated.entered.wait(10)
        late_t, late = submit(s, 1, stream_batch(1, [0], [[1, 2, 3]]), deadline=5.0)
        ok_t, ok = submit(s, 2, stream_batch(2, [0], [[3, 4]]), deadline=50.0)
        assert until(lambda: queued(s) == 2)
        clock.now = 10.0  # past the first round's deadline, not the second's
        gated.hold.clear()
        gated.release.set()
        for t in (first[0], late_t, ok_t):
            t.join(10)
    finally:
        s.stop()
    assert late == {"result": None} and ok["result"].counts.tolist() == [3]
    assert [c.sessions().tolist() for c in gated.calls] == [[99], [2]]  # the late round never drafted


def test_a_late_round_between_two_does_not_split_their_call():
    clock = Clock()
    gated = Gated(MarkovDrafter(COUNTING))
    s = Scheduler(gated, max_entries=64, max_tokens=1024, clock=clock).start()
    try:
        jobs = [(1, stream_batch(1, [0], [[1, 2]]), 9.0), (2, stream_batch(2, [0], [[3]]), 1.0)]
        jobs.append((3, stream_batch(3, [0], [[4]]), 9.0))
        clock.now = 5.0  # the middle round is late when the drafter reaches the three
        boxes = gate_then(s, gated, jobs)
    finally:
        s.stop()
    assert [c.sessions().tolist() for c in gated.calls[1:]] == [[1, 3]]
    assert [box["result"] is None for _, box in boxes] == [False, True, False]


def test_a_storm_of_big_rounds_leaves_a_small_round_its_share_first():
    """Three engines' rounds of a whole budget each and an honest engine's small round,
    queued together: the honest round is in the first call (its share of the budget),
    drafted at a time its own size costs, while first in, first out would have drafted
    it after the storm."""
    clock = Clock()
    gated = Gated(MarkovDrafter(COUNTING), clock, cost_s=0.001)  # a token costs 1 ms
    s = Scheduler(gated, max_entries=64, max_tokens=400, clock=clock).start()
    try:
        big = [(h, stream_batch(h, [0], [[1] * 397]), float("inf")) for h in (1, 2, 3)]  # 397 + 3 drafts: 400
        honest = (7, stream_batch(7, [0], [[1, 2, 3]]), 0.5)  # 0.5 s: less than one big round (0.4 s) after the gate's
        boxes = gate_then(s, gated, [*big, honest])
    finally:
        s.stop()
    assert boxes[3][1]["result"].counts.tolist() == [3]  # in time
    assert [c.sessions().tolist() for c in gated.calls[1:]] == [[7], [1], [2], [3]]
    assert all("result" in box for _, box in boxes)


def test_a_round_of_many_entries_is_drafted_in_pieces_and_answered_whole():
    """A flood round of 30 entries (three budgets' worth) and an honest round queued
    together: the honest round is in the first call beside the flood's first piece; the
    flood is drafted in pieces of consecutive entries, one a call, and answered, whole,
    what drafting it in one call answers. A piece's deadline passing answers the round
    with the pieces drafted."""
    markov = MarkovDrafter(COUNTING)
    gated = Gated(markov)
    s = Scheduler(gated, max_entries=64, max_tokens=400).start()
    contexts = [[1 + i % 7] * 37 for i in range(30)]  # 37 tokens and 3 drafts: a cost of 40 each
    flood = stream_batch(1, range(30), contexts, want_margin=True)
    try:
        (_, flood_box), (_, honest_box) = gate_then(
            s, gated, [(1, flood, float("inf")), (7, stream_batch(7, [0], [[1, 2, 3]]), float("inf"))]
        )
    finally:
        s.stop()
    calls = [c.sessions().tolist() for c in gated.calls[1:]]
    assert 7 in calls[0] and len(calls) >= 3 and all(len(c) * 40 <= 400 for c in calls)
    assert sum(c.count(1) for c in calls) == 30  # every flood entry drafted once
    alone = markov.draft_batch(flood)
    got = flood_box["result"]
    assert got.tokens.tolist() == alone.tokens.tolist() and got.counts.tolist() == alone.counts.tolist()
    assert np.allclose(got.margins, alone.margins) and honest_box["result"].counts.tolist() == [3]


def test_a_lone_round_in_pieces_is_drafted_by_its_own_thread_with_no_hand_off():
    """A round of three budgets found the drafter free: its connection's thread makes every
    call until its round is answered (no wake-up of the drafter thread per piece), and
    each piece is the round's consecutive entries, as views of the round's arrays."""
    drafter = Recording(COUNTING)
    drafter.context_read = None  # as a model drafter: a call reads whole contexts
    s = Scheduler(drafter, max_entries=64, max_tokens=400).start()
    flood = stream_batch(1, range(30), [[1 + i % 7] * 37 for i in range(30)])
    try:
        got = s.draft(1, flood)
    finally:
        s.stop()
    assert len(drafter.threads) == 3 and set(drafter.threads) == {threading.current_thread()}
    alone = MarkovDrafter(COUNTING).draft_batch(flood)
    assert got.tokens.tolist() == alone.tokens.tolist() and got.counts.tolist() == alone.counts.tolist()


def test_a_round_with_no_entries_is_answered_at_once_with_no_call():
    """Nothing to draft is never queued (a queued empty round would never be taken and
    would hold the lock for good)."""
    drafter = Recording(COUNTING)
    s = Scheduler(drafter, max_entries=64, max_tokens=400).start()
    t, box = submit(s, 1, stream_batch(1, [0], [[1, 2]], width=4, want_margin=True).entries(0, 0))
    t.join(10)
    if t.is_alive():  # (its thread holds the scheduler's lock: stop() would wait for good)
        pytest.fail("an empty round was never answered")
    try:
        got = s.draft(2, stream_batch(2, [0], [[1, 2]]))  # the scheduler still drafts
    finally:
        s.stop()
    assert box["result"].tokens.shape == (0, 4) and box["result"].margins.shape == (0, 4)
    assert drafter.calls == [1] and got.counts.tolist() == [3]


def test_a_lone_round_s_failure_is_its_own_and_leaves_the_drafter_free():
    """A round that found the drafter free is drafted on its own thread; the drafter's
    error is raised there, and the next round (late, then on time) is served."""
    clock = Clock()
    drafter = Recording(COUNTING)
    s = Scheduler(drafter, max_entries=64, max_tokens=400, clock=clock).start()
    boom = ValueError("the drafter failed")
    real = drafter.draft_batch
    drafter.draft_batch = lambda batch: (_ for _ in ()).throw(boom)
    try:
        with pytest.raises(ValueError, match="the drafter failed"):
            s.draft(1, stream_batch(1, [0], [[1, 2]]))
        drafter.draft_batch = real
        clock.now = 10.0
        late = s.draft(1, stream_batch(1, [0], [[1, 2]]), deadline=5.0)
        got = s.draft(1, stream_batch(1, [0, 1], [[1, 2], [3]]), deadline=20.0)
    finally:
        s.stop()
    assert late is None and drafter.calls == [2]  # the late round was never drafted
    assert drafter.threads == [threading.current_thread()] and got.counts.tolist() == [3, 3]


def test_a_failure_in_a_calls_statistics_fails_its_rounds_not_the_drafter_thread():
    """``on_call`` raising in a call the drafter thread makes (two queued rounds) fails
    those rounds on their connections; the thread lives on and drafts the next ones."""
    gated = Gated(MarkovDrafter(COUNTING))
    fail = [True]

    def on_call(*_):
        if fail[0] and len(gated.calls) > 1:  # the queued rounds' call, not the gate's
            raise RuntimeError("statistics broke")

    s = Scheduler(gated, max_entries=64, max_tokens=1024, on_call=on_call).start()
    try:
        jobs = [(1, stream_batch(1, [0], [[1, 2]]), float("inf")), (2, stream_batch(2, [0], [[3]]), float("inf"))]
        boxes = gate_then(s, gated, jobs)
        fail[0] = False
        later = [submit(s, *job) for job in jobs]  # each finds the drafter free or queues: answered either way
        for t, _ in later:
            t.join(10)
            assert not t.is_alive()
    finally:
        s.stop()
    assert [str(box.get("error")) for _, box in boxes] == ["statistics broke"] * 2
    alone = [MarkovDrafter(COUNTING).draft_batch(batch) for _, batch, _ in jobs]
    assert [box["result"].tokens.tolist() for _, box in later] == [a.tokens.tolist() for a in alone]


def test_an_entry_costs_the_context_its_drafter_reads_so_a_markov_round_is_one_call():
    """30 entries of 37-token contexts and 3 drafts: 1,200 tokens for a drafter that reads
    whole contexts, three calls of a 400-token budget; an order-1 Markov drafter reads one
    token of each (4 a entry), so the round is one call, and a HELLO of a window over the
    budget is no reason to refuse it."""
    markov = Recording(COUNTING)
    assert markov.context_read == 1
    flood = stream_batch(1, range(30), [[1 + i % 7] * 37 for i in range(30)])
    whole = Charge(type("Whole", (), {"context_read": None})())
    assert whole.costs(flood).tolist() == [40] * 30 and Charge(markov).costs(flood).sum() == 30 * 4
    stats = []
    s = Scheduler(markov, max_entries=64, max_tokens=400, on_call=lambda *call: stats.append(call)).start()
    try:
        s.draft(1, flood)
    finally:
        s.stop()
    assert markov.calls == [30] and stats[0][3] == 120  # one call, and its tokens counted as the budget counts them
    hello = wire.Hello(markov.drafter_identity, markov.markov_identity, 1, max_slots=4, row_bytes=0, num_spec=8)
    assert hello_refusal(markov, Limits(window=512), hello, 512, call_tokens=9)[0] == wire.ACCEPT
    assert "costs 9 tokens" in hello_refusal(markov, Limits(window=512), hello, 512, call_tokens=8)[1]


def test_a_drafter_without_reserved_memory_takes_a_whole_round_of_entries_in_one_call():
    """Without a given entries' budget: the wire's cap for a drafter that reserves no
    memory for a call, so 4,096 entries of an order-1 Markov drafter are one call; a
    drafter that reserves rows for a call keeps the smaller default."""
    markov = Recording(COUNTING)
    s = Scheduler(markov, max_entries=None, max_tokens=None).start()
    try:
        s.draft(1, stream_batch(1, range(4096), [[1 + i % 7] * 64 for i in range(4096)]))
    finally:
        s.stop()
    assert s.max_entries == wire.MAX_ENTRIES and markov.calls == [4096]

    class Reserving(MarkovDrafter):
        def reserve(self, max_entries, max_tokens, derive=False):
            return max_tokens

    assert Scheduler(Reserving(COUNTING), max_entries=None, max_tokens=None).max_entries == DEFAULT_MAX_ENTRIES


@pytest.mark.parametrize("read", [0, -1, 2.5, True, "2"])
def test_a_drafter_s_context_read_must_be_a_positive_int(read):
    class Odd:
        context_read = read

    with pytest.raises(ValueError, match=r"drafter context_read .*expected a positive int or None"):
        context_read_of(Odd())


@pytest.mark.parametrize("start, stop", [(0, 30), (0, 1), (7, 19), (29, 30), (12, 12)])
def test_a_piece_of_consecutive_entries_is_the_masked_subset_of_them(start, stop):
    batch = dataclasses.replace(
        stream_batch(1, range(30), [[i] * (i % 5) for i in range(30)]),
        session=np.arange(30, dtype=np.int64),
        temperature=np.linspace(0, 2, 30, dtype=np.float32),
        seed=np.arange(30, dtype=np.uint64) << np.uint64(40),
    )
    keep = np.zeros(30, bool)
    keep[start:stop] = True
    piece, masked = batch.entries(start, stop), batch.subset(keep)
    for f in dataclasses.fields(DraftBatch):
        a, b = getattr(piece, f.name), getattr(masked, f.name)
        assert np.array_equal(a, b) and np.asarray(a).dtype == np.asarray(b).dtype, f.name
    assert np.shares_memory(piece.tokens, batch.tokens) or not len(piece.tokens)


def test_a_deadline_passing_between_pieces_answers_the_pieces_drafted():
    clock = Clock()
    gated = Gated(MarkovDrafter(COUNTING), clock, cost_s=0.001)
    s = Scheduler(gated, max_entries=64, max_tokens=400, clock=clock).start()
    flood = stream_batch(1, range(30), [[2] * 37] * 30)
    try:
        ((_, box),) = gate_then(s, gated, [(1, flood, 0.5)])  # 0.4 s a piece: the second one ends past 0.5
    finally:
        s.stop()
    counts = box["result"].counts
    drafted = int((counts > 0).sum())
    assert 0 < drafted < 30 and (counts[:drafted] == 3).all() and (counts[drafted:] == 0).all()


def test_a_narrow_round_is_drafted_before_wide_ones_in_a_call_of_its_own():
    """Rounds of 64 drafts and one of 3 queued together: two calls, the narrow round's
    first (it never waits for 63 draft steps it did not ask for)."""
    gated = Gated(MarkovDrafter(COUNTING))
    s = Scheduler(gated, max_entries=64, max_tokens=1024).start()
    try:
        wide = [(k, stream_batch(k, [0], [[1, 2]], width=64), float("inf")) for k in (1, 2)]
        boxes = gate_then(s, gated, [*wide, (3, stream_batch(3, [0], [[4]], width=3), float("inf"))])
    finally:
        s.stop()
    assert [(c.width, c.sessions().tolist()) for c in gated.calls[1:]] == [(3, [3]), (64, [1, 2])]
    assert boxes[2][1]["result"].tokens.tolist() == [[5, 6, 7]]


def test_a_narrow_round_is_answered_while_the_wide_group_of_its_call_is_still_drafting():
    class WideHeld(Gated):
        def draft_batch(self, batch):
            if batch.width == 64:
                self.wide.set()
                assert self.wide_release.wait(10), "the test never released the wide call"
            return super().draft_batch(batch)

    gated = WideHeld(MarkovDrafter(COUNTING))
    gated.wide, gated.wide_release = threading.Event(), threading.Event()
    s = Scheduler(gated, max_entries=64, max_tokens=1024).start()
    try:
        gated.hold.set()
        first = submit(s, 99, stream_batch(99, [0], [[1, 2]]))
        assert gated.entered.wait(10)
        wide = submit(s, 1, stream_batch(1, [0], [[1, 2]], width=64))
        narrow = submit(s, 3, stream_batch(3, [0], [[4]], width=3))
        assert until(lambda: queued(s) == 2)
        gated.hold.clear()
        gated.release.set()
        assert gated.wide.wait(10)  # the wide group's call has begun, and is held ...
        narrow[0].join(10)
        assert not narrow[0].is_alive() and narrow[1]["result"].tokens.tolist() == [[5, 6, 7]]  # ... yet answered
        assert wide[0].is_alive()
    finally:
        gated.wide_release.set()
        for t, _ in (first, wide, narrow):
            t.join(10)
        s.stop()
    assert wide[1]["result"].counts.tolist() == [64]


def test_stopping_answers_queued_rounds_with_an_error_and_lets_the_call_in_flight_finish():
    gated = Gated(MarkovDrafter(COUNTING))
    s = Scheduler(gated, max_entries=64, max_tokens=1024).start()
    gated.hold.set()
    first_t, first = submit(s, 1, stream_batch(1, [0], [[1, 2]]))
    assert gated.entered.wait(10)
    queued_t, waiting = submit(s, 2, stream_batch(2, [0], [[3]]))
    assert until(lambda: queued(s) == 1)
    stopper = threading.Thread(target=s.stop)
    stopper.start()
    queued_t.join(10)
    assert isinstance(waiting.get("error"), RuntimeError) and "stopping" in str(waiting["error"])
    gated.release.set()
    for t in (first_t, stopper):
        t.join(10)
        assert not t.is_alive()
    assert first["result"].tokens.tolist() == [[3, 4, 5]]
    with pytest.raises(RuntimeError, match="the worker is stopping"):
        s.draft(3, stream_batch(3, [0], [[1]]))


class OneSession:
    """A batched drafter that cannot take mixed sessions (it says nothing)."""

    def __init__(self):
        self.inner = MarkovDrafter(COUNTING)
        self.drafter_identity, self.markov_identity = self.inner.drafter_identity, self.inner.markov_identity

    def draft_batch(self, batch):
        assert np.ndim(batch.session) == 0, "a batch of several sessions"
        return self.inner.draft_batch(batch)


def test_a_drafter_that_cannot_mix_sessions_gets_one_session_a_call():
    gated = Gated(OneSession())
    s = Scheduler(gated, max_entries=64, max_tokens=1024).start()
    try:
        jobs = [(k, stream_batch(k, [0], [[1, 2]]), float("inf")) for k in (1, 2)]
        boxes = gate_then(s, gated, jobs)
    finally:
        s.stop()
    assert all(box["result"].tokens.tolist() == [[3, 4, 5]] for _, box in boxes)
    assert [c.sessions().tolist() for c in gated.calls[1:]] == [[1], [2]]


def test_two_engines_through_a_worker_share_a_call_and_an_expired_round_is_counted():
    """Two loopback engines' rounds queued behind a third's are drafted in one call, each
    answered as a worker serving it alone answers; a round whose 1 ms deadline passed
    while queued is answered OK with no drafts and counted."""
    gated = Gated(MarkovDrafter(COUNTING))
    with Worker(gated, "127.0.0.1", 0, window=8) as w:
        clients = [connect(w, session=e, engine_id=e, num_spec=2, row_bytes=0) for e in (1, 2, 3, 4)]
        try:
            gated.hold.set()
            results = {}

            def send(c, rid, entries, deadline_ms=0):
                frame = wire.encode_round_entries(rid, c.session, deadline_ms, entries, b"", 0)
                results[c.session] = c.round(rid, [frame], 10000)

            entry = [wire.Entry(0, 2, 0, (1, 2, 3), new_gen=True)]
            threads = [threading.Thread(target=send, args=(clients[0], 1, entry))]
            threads[0].start()
            assert gated.entered.wait(10)
            threads += [threading.Thread(target=send, args=(c, 1, entry)) for c in clients[1:3]]
            threads.append(threading.Thread(target=send, args=(clients[3], 1, entry, 1)))
            for t in threads[1:]:
                t.start()
            assert until(lambda: queued(w._scheduler) == 3)
            threading.Event().wait(0.005)  # past the 1 ms deadline of the last round, surely
            gated.hold.clear()
            gated.release.set()
            for t in threads:
                t.join(10)
        finally:
            for c in clients:
                c.close()
        stats = w.statistics()
    assert len(gated.calls[1]) == 2, [c.sessions().tolist() for c in gated.calls]
    assert len(set(gated.calls[1].sessions().tolist())) == 2  # two engines, one call
    for c in clients[:3]:
        assert results[c.session].row(0) == [4, 5]
    assert results[clients[3].session].row(0) == [] and stats.expired == 1
    assert stats.drafter_calls == 2
    assert stats.call_rounds.snapshot().buckets[:3] == (1, 1, 0)  # a call of one round, one of two
    assert stats.call_entries.snapshot().sum == 3 and stats.queue_seconds.snapshot().count == 3
    assert stats.call_tokens.snapshot().sum == 3 * (3 + 2)  # each entry: its context of 3 and 2 drafts

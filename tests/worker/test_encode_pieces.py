"""A call's token budget holds for one entry too: a model drafter's encode over the budget
(a long NEW_GEN) is taken in pieces over several calls, each within the budget, while
another engine's small round is drafted in the next call; the long entry's drafts are
those of a fresh encode of its whole context."""

import numpy as np
from helpers import Gated, stream_batch, submit, until

from remote_dspark import wire
from remote_dspark.drafter.lm.drafter import LMDrafter
from remote_dspark.worker.batching import Charge
from remote_dspark.worker.limits import Limits, hello_refusal
from remote_dspark.worker.scheduler import Scheduler
from remote_dspark.worker.stats import WorkerStats

WIDTH, BUDGET = 3, 64


class Keeping(Gated):
    """:class:`helpers.Gated` around a model drafter, saying what it encodes as it does."""

    keeps_streams = True

    def encodes(self, batch):
        return self.drafter.encodes(batch)


def test_an_entry_over_the_budget_is_encoded_in_pieces_and_another_engines_round_is_not_held():
    lm = LMDrafter(device="cpu", cache_slots=8, window=200)
    drafter = Keeping(lm)
    drafter.hold.set()
    costs, stats = [], WorkerStats()  # the worker's own counting of each call (its on_call)
    s = Scheduler(
        drafter, max_entries=16, max_tokens=BUDGET, on_call=lambda *call: (costs.append(call[3]), stats.add_call(*call))
    ).start()
    context = np.random.default_rng(4).integers(0, 128, 180).tolist()
    long = stream_batch(1, [0], [context], width=WIDTH)  # a NEW_GEN of 180 tokens: 183 of budget
    small = stream_batch(2, [0, 1], [[5, 6, 7], [9, 8]], width=WIDTH)
    threads = []
    try:
        threads.append(submit(s, 1, long))
        assert drafter.entered.wait(10)  # the first piece is in the drafter, held
        threads.append(submit(s, 2, small))
        assert until(lambda: s._fair.queued() == 2)  # the long round's rest, and the small round
        drafter.release.set()
        for t, _ in threads:
            t.join(10)
            assert not t.is_alive()
    finally:
        drafter.release.set()
        s.stop()
    (_, got), (_, other) = threads
    sessions = [np.unique(c.sessions()).tolist() for c in drafter.calls]
    assert sessions[:2] == [[1], [1, 2]]  # the small round in the call after the first piece
    assert len(drafter.calls) >= 4 and max(costs) <= BUDGET and sum(costs) == 183 + (3 + WIDTH) + (2 + WIDTH)
    pieces = [c for c in drafter.calls if 1 in c.sessions() and c.n_out[c.sessions() == 1][0] == 0]
    ends = [int(np.diff(c.offsets)[c.sessions() == 1][0]) for c in pieces]
    assert ends == sorted(ends) and len(ends) == len(drafter.calls) - 1  # consecutive prefixes, one a call
    tokens, margins = LMDrafter(device="cpu", cache_slots=0, window=200).greedy_one(context, WIDTH)
    assert got["result"].counts.tolist() == [WIDTH]
    assert got["result"].tokens[0].tolist()[: len(tokens)] == tokens or min(margins) < 1e-4
    assert other["result"].counts.tolist() == [WIDTH, WIDTH]
    assert lm.cache_info().hits == len(pieces)  # each piece after the first, and the last, from the row
    # counted: every piece of the encode (not its last piece, a token and its drafts)
    assert stats.encode_pieces == len(pieces) and stats.encode_piece_tokens == ends[-1]  # its prefix
    assert stats.drafter_calls == len(drafter.calls)


def test_a_hello_whose_window_is_over_the_budget_is_served_by_a_drafter_that_encodes_in_pieces():
    """Only an entry's last piece (a token and its drafts) must fit a call: a window of 200
    tokens over a 64-token budget is no reason to refuse; a drafter with no rows to keep a
    piece in is still refused."""
    lm = LMDrafter(device="cpu", cache_slots=8, window=200)
    hello = wire.Hello(lm.drafter_identity, lm.markov_identity, 1, max_slots=4, row_bytes=0, num_spec=WIDTH)
    assert hello_refusal(lm, Limits(window=200), hello, 200, call_tokens=BUDGET)[0] == wire.ACCEPT
    assert "last piece" in hello_refusal(lm, Limits(window=200), hello, 200, call_tokens=WIDTH)[1]
    plain = LMDrafter(device="cpu", cache_slots=0, window=200)
    assert "costs 203 tokens" in hello_refusal(plain, Limits(window=200), hello, 200, call_tokens=BUDGET)[1]
    assert Charge(plain).most(200, WIDTH) == 203 and Charge(lm).most(200, WIDTH) == 1 + WIDTH


class Failing(Gated):
    """A drafter whose ``encodes`` raises (for session 2's rounds) or answers the wrong
    shape (session 3's): its own code, run under the scheduler's lock."""

    def encodes(self, batch):
        session = int(np.atleast_1d(batch.sessions())[0])
        if session == 2:
            raise RuntimeError("encodes broke")
        return np.zeros(len(batch) + 1, np.int64) if session == 3 else np.full(len(batch), 1, np.int64)


def test_a_drafter_whose_encodes_fails_costs_its_rounds_an_estimate_never_the_scheduler():
    """What ``encodes`` raises or returns amiss charges that round its whole contexts: the
    round is drafted, and so is every other engine's, before and after."""
    from helpers import COUNTING

    from remote_dspark.drafter.markov import MarkovDrafter

    s = Scheduler(Failing(MarkovDrafter(COUNTING)), max_entries=16, max_tokens=BUDGET).start()
    try:
        for session in (1, 2, 3, 1):
            out = s.draft(session, stream_batch(session, [0], [[1, 2, 3]], width=WIDTH))
            assert out is not None and len(out.counts) == 1, session
        assert not s._busy
    finally:
        s.stop()

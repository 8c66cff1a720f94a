"""An entry with ``n_out`` 0 is an encode: the model drafter keeps its tokens in its
stream's row and drafts nothing for it, and the worker charges a model drafter, in a
call's budget, for the tokens it encodes (not its context). CPU float32."""

import numpy as np
import pytest
from lm_common import agreeing_prefix, batch_of

from remote_dspark.drafter.lm.drafter import LMDrafter
from remote_dspark.worker.batching import Charge
from remote_dspark.worker.scheduler import Scheduler

PLAIN = LMDrafter(device="cpu", cache_slots=0, window=64)  # the reference: greedy_one re-encodes
WIDTH = 3


def stream(contexts, n_out, width, *, slots=None, start=5):
    """One engine's batch: each context the whole stream of its slot, its first token at ``start``."""
    n = len(contexts)
    return batch_of(
        contexts,
        n_out,
        width,
        session=1,
        slots=np.arange(n, dtype=np.int64) if slots is None else np.asarray(slots, np.int64),
        gens=np.ones(n, np.int64),
        lengths=np.array([len(c) for c in contexts], np.int64),
        positions=np.full(n, start, np.int64),
    )


def assert_fresh(result, i, context, start=5):
    """Entry i's drafts are those of a fresh encode of ``context`` at its true positions."""
    tokens, margins = PLAIN.greedy_one(context, WIDTH, start)
    a, b = agreeing_prefix(tokens, margins, result.tokens[i, : result.counts[i]].tolist())
    assert int(result.counts[i]) == WIDTH and a == b


def runs_of(drafter):
    """Record each model run of ``drafter`` as (entries, draft width)."""
    seen, run = [], drafter._rounds.run

    def spy(tok, base, take, origin, rows, width, sampling=None, cells=None):
        seen.append((len(take), width))
        return run(tok, base, take, origin, rows, width, sampling, cells)

    drafter._rounds.run = spy
    return seen


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded"])
def test_a_call_of_only_encodes_keeps_the_tokens_and_the_next_round_encodes_only_its_new_ones(graphs):
    drafter = LMDrafter(device="cpu", cache_slots=4, window=32, graphs=graphs)
    context = np.random.default_rng(1).integers(0, 128, 30).tolist()
    first = drafter.draft_batch(stream([context[:20]], [0], 0))
    assert first.counts.tolist() == [0] and first.tokens.shape == (1, 0)
    assert drafter.cache.held(1, 0) == (5, 20)  # its 20 tokens at their true positions 5..24
    whole = stream([context], [WIDTH], WIDTH)
    assert drafter.encodes(whole).tolist() == [10]  # a hit: only the 10 new tokens
    got = drafter.draft_batch(whole)
    assert_fresh(got, 0, context)
    info = drafter.cache_info()
    assert (info.hits, info.misses) == (1, 1)


def test_an_encode_takes_no_draft_steps_beside_drafting_entries_and_its_stream_drafts_later():
    drafter = LMDrafter(device="cpu", cache_slots=4, window=32)
    rng = np.random.default_rng(2)
    long, other = rng.integers(0, 128, 28).tolist(), rng.integers(0, 128, 9).tolist()
    runs = runs_of(drafter)
    got = drafter.draft_batch(stream([long[:16], other], [0, WIDTH], WIDTH))
    assert sorted(runs) == [(1, 0), (1, WIDTH)]  # the encode in a run of no steps
    assert got.counts.tolist() == [0, WIDTH] and not got.tokens[0].any()
    assert_fresh(got, 1, other)
    later = drafter.draft_batch(stream([long, other + [7]], [WIDTH, WIDTH], WIDTH))
    assert_fresh(later, 0, long)
    assert_fresh(later, 1, other + [7])
    assert drafter.cache_info().hits == 2  # both streams drafted from their rows


def test_a_model_drafter_is_charged_the_tokens_it_encodes_not_its_context():
    drafter = LMDrafter(device="cpu", cache_slots=4, window=48)
    context = np.random.default_rng(3).integers(0, 128, 40).tolist()
    calls = []
    s = Scheduler(drafter, max_entries=16, max_tokens=1000, on_call=lambda *call: calls.append(call[3])).start()
    try:
        s.draft(1, stream([context[:36]], [0], 0))  # an encode: its 36 tokens, no drafts
        whole = stream([context], [WIDTH], WIDTH)
        assert Charge(drafter).costs(whole).tolist() == [4 + WIDTH]  # a hit: 4 new tokens and the drafts
        got = s.draft(1, whole)
        cold = stream([context], [WIDTH], WIDTH, slots=[3])  # a stream the drafter has not seen: re-encoded
        assert Charge(drafter).costs(cold).tolist() == [40 + WIDTH]
    finally:
        s.stop()
    assert calls == [36, 4 + WIDTH]
    assert_fresh(got, 0, context)

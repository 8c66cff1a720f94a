"""The model drafter's working memory is bounded by the worker's call budget: a round runs
in parts of at most the budget's padded tokens (``graphs.parts``), the budget is derived
from the device's free memory when not given, refused over it when given, and an engine
whose one entry could never fit a call is refused at HELLO. The GPU test measures a call
at the budget against the bound (``budget.working_bytes``)."""

import dataclasses

import numpy as np
import pytest
import torch
from lm_common import agreeing_prefix, batch_of

from remote_dspark import wire
from remote_dspark.drafter.lm import budget
from remote_dspark.drafter.lm import drafter as drafter_module
from remote_dspark.drafter.lm import graphs as graphs_module
from remote_dspark.drafter.lm.drafter import LMDrafter
from remote_dspark.drafter.lm.graphs import MIN_QUERIES, MIN_ROWS, Rounds, parts
from remote_dspark.worker.limits import Limits, hello_refusal
from remote_dspark.worker.scheduler import DEFAULT_MAX_TOKENS, Scheduler


def padded(n: int, q: int) -> int:
    """A padded shape's tokens: rows from MIN_ROWS, but from 1 for a prefill past 64 queries."""
    queries = max(MIN_QUERIES, 1 << (q - 1).bit_length())
    return max(MIN_ROWS if queries <= 64 else 1, 1 << (n - 1).bit_length()) * queries


def test_parts_keep_every_padded_shape_within_the_limit_and_cover_each_entry_once():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 300))
        take = rng.integers(1, 129, n) * (rng.random(n) < 0.2) + rng.integers(1, 7, n)
        limit = int(rng.choice([4096, 8192, 1 << 16]))
        split = parts(take, limit)
        covered = np.concatenate([np.arange(n)[s] for s in split])
        assert sorted(covered.tolist()) == list(range(n))
        assert all(padded(len(np.arange(n)[s]), int(take[s].max())) <= limit for s in split)
        if padded(n, int(take.max())) <= limit:
            assert split == [slice(None)]  # a round that fits is one part, in its own order
        else:  # a long entry's part never pads short ones to its length
            pow2 = np.maximum(MIN_QUERIES, 1 << np.ceil(np.log2(take)).astype(np.int64))
            assert all(len(set(pow2[s].tolist())) == 1 for s in split)
    with pytest.raises(ValueError, match="an entry of 5000 tokens is over a round's limit of 2048"):
        parts(np.array([5000, 1]), 2048)
    long_and_short = parts(np.array([2048] + [4] * 255), 4096)
    assert [len(p) for p in long_and_short] == [1, 255]  # 2,048 + 1,020 padded tokens, not 128 x 2,048


def test_a_ragged_round_runs_in_parts_within_the_limit_and_drafts_what_one_run_drafts(monkeypatch):
    """Two whole windows beside 60 steady entries: at a limit of 1024 padded tokens the round
    runs in parts (the windows together, the short ones together), each shape within the
    limit, and every entry gets the drafts of the unsplit round."""
    rng = np.random.default_rng(1)
    contexts = [rng.integers(0, 128, 60).tolist() for _ in range(2)] + [
        rng.integers(0, 128, int(rng.integers(1, 5))).tolist() for _ in range(60)
    ]
    batch = batch_of(contexts, [4] * 62, 4)
    whole = LMDrafter(device="cpu", cache_slots=0, window=64).draft_batch(batch)
    d = LMDrafter(device="cpu", cache_slots=0, window=64)
    d._rounds.limit = 1024
    shapes = []
    run = Rounds._run

    def recorded(self, tok, *args):
        shapes.append(tok.shape)
        return run(self, tok, *args)

    monkeypatch.setattr(Rounds, "_run", recorded)
    got = d.draft_batch(batch)
    assert len(shapes) >= 2 and all(padded(n, q) <= 1024 for n, q in shapes)
    assert max(q for _, q in shapes) == 60 and sum(n for n, _ in shapes) == 62
    for i in range(62):
        ref, mine = agreeing_prefix(whole.tokens[i], whole.margins[i], got.tokens[i])
        assert mine == ref


def test_the_token_budget_is_derived_from_the_free_memory_and_a_given_one_over_it_is_refused(monkeypatch):
    d = LMDrafter(device="cpu", cache_slots=64, window=16)
    need = {t: budget.working_bytes(d.model, d.store, 256, budget.part_limit(t, d.store.columns)) for t in (4096, 8192)}
    free = 2 * need[4096] + (need[8192] - need[4096])  # half of it fits 4096 tokens, not 8192
    monkeypatch.setattr(drafter_module, "memory_free", lambda device: free)
    s = Scheduler(d, max_entries=256, max_tokens=None)
    s.reserve()
    assert s.max_tokens == 4096 and d._rounds.limit == budget.part_limit(4096, d.store.columns)
    monkeypatch.setattr(drafter_module, "memory_free", lambda device: 1 << 40)
    s = Scheduler(LMDrafter(device="cpu", cache_slots=64, window=16), max_entries=256, max_tokens=None)
    s.reserve()
    assert s.max_tokens == DEFAULT_MAX_TOKENS  # plenty of memory: the default, not more
    monkeypatch.setattr(drafter_module, "memory_free", lambda device: need[8192] - 1)
    with pytest.raises(
        ValueError, match=r"^--max-batch-entries 256, --max-batch-tokens 8192: a call of 256 entries and 8192 tokens"
    ):
        Scheduler(LMDrafter(device="cpu", cache_slots=64, window=16), max_entries=256, max_tokens=8192).reserve()
    monkeypatch.setattr(drafter_module, "memory_free", lambda device: 1000)
    with pytest.raises(ValueError, match=r"^--max-batch-entries 256: a call of 256 entries and 1024 tokens needs"):
        Scheduler(LMDrafter(device="cpu", cache_slots=64, window=16), max_entries=256, max_tokens=None).reserve()


def test_a_hello_whose_one_entry_is_over_the_call_budget_is_refused_naming_the_flag():
    d = LMDrafter(device="cpu", cache_slots=0, window=64)
    hello = wire.Hello(d.drafter_identity, d.markov_identity, 1, max_slots=16, row_bytes=0, num_spec=8, vocab_size=128)
    code, reason, why = hello_refusal(d, Limits(window=64), hello, 64, call_tokens=71)
    assert (code, why) == (wire.REFUSE_LIMITS, "limits")
    assert "costs 72 tokens, over the worker's 71 a drafting call (--max-batch-tokens)" in reason
    assert hello_refusal(d, Limits(window=64), hello, 64, call_tokens=72)[0] == wire.ACCEPT


@pytest.mark.gpu
def test_on_cuda_a_call_at_the_budget_stays_within_its_working_bytes(tmp_path):
    """The bound measured: the built-in model and a GPT-2-shaped one, a call at a budget of
    256 entries and 4096 tokens with its worst raggedness (some whole rows, the rest one
    token each), greedy and sampled, each captured then replayed; the peak over the store, the weights and what
    the libraries allocate once (a first small call: cuBLAS's workspaces) is within
    ``working_bytes``."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from remote_dspark.bench.hf_models import random_model
    from remote_dspark.drafter.lm.hf import load_hf

    random_model("gpt2", 4, 256).save_pretrained(tmp_path)
    for d in (
        LMDrafter(device="cuda", cache_slots=256, window=64),
        load_hf(str(tmp_path), "cuda", 64, cache_slots=256),
    ):
        tokens = d.reserve(256, 4096)
        bound = budget.working_bytes(d.model, d.store, 256, budget.part_limit(tokens, d.store.columns))
        rng = np.random.default_rng(2)
        one = np.ones(1, np.int64)
        d.draft_batch(batch_of([[1, 2]], [2], 2, session=2, slots=one, gens=one, lengths=2 * one))  # libraries' own
        long = [rng.integers(0, 100, 64).tolist() for _ in range(40)]
        contexts = long + [[int(t)] for t in rng.integers(0, 100, 216)]
        lengths = np.array([len(c) for c in contexts], np.int64)
        zeros = np.zeros(256, np.int64)  # streams, as the worker's: every entry has a cache row
        greedy = batch_of(contexts, [8] * 256, 8, session=1, slots=np.arange(256), gens=zeros, lengths=lengths)
        sampled = dataclasses.replace(  # other streams (every entry a miss again), sampled
            greedy, session=3, temperature=np.ones(256, np.float32), seed=np.arange(256, dtype=np.uint64)
        )
        for batch in (greedy, greedy, sampled, sampled):  # each kind: the first captures, the second replays
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            d.draft_batch(batch)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            assert peak <= bound, f"peak {peak} bytes over the bound {bound}"


def test_at_most_max_graphs_are_kept_the_least_recently_replayed_evicted(monkeypatch):
    """On the CPU with a stand-in capture (a "graph" that replays the eager round): rounds
    of more shapes than MAX_GRAPHS keep MAX_GRAPHS graphs, a replayed shape stays, and
    every round's drafts are the eager round's."""
    monkeypatch.setattr(graphs_module, "MAX_GRAPHS", 3)
    d = LMDrafter(device="cpu", cache_slots=0, window=16, graphs=True)
    rounds = d._rounds
    rounds.capture = True

    class Replay:
        def __init__(self, inp, shape, out):
            self.inp, self.shape, self.out = inp, shape, out

        def replay(self):
            self.out.copy_(rounds._round(self.inp, self.shape))

    def capture(shape):
        inp = rounds.blank(shape)
        out = rounds._round(inp, shape)
        rounds.graphs[shape] = (Replay(inp, shape, out), inp, out)

    monkeypatch.setattr(rounds, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # a new pool when the store grows
    eager = LMDrafter(device="cpu", cache_slots=0, window=16, graphs=True)
    contexts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    for width in (1, 2, 1, 3, 4, 1):  # widths 1 (replayed), 2, 3, 4: four shapes
        batch = batch_of(contexts, [width] * 3, width)
        assert d.draft_batch(batch).tokens.tolist() == eager.draft_batch(batch).tokens.tolist()
        assert len(rounds.graphs) <= 3
    assert [shape[2] for shape in rounds.graphs] == [3, 4, 1]  # width 2 went: least recently replayed


@pytest.mark.parametrize("max_tokens", [1, 256, 1024])
@pytest.mark.parametrize("columns", [40, 128, 512, 576])
def test_every_entry_of_a_stream_fits_one_part_of_a_call(max_tokens, columns):
    """Whatever the budget, one entry of any length up to a whole stream pads to no more
    than a part's limit: a short budget's limit once missed the entries of 33 to 64 tokens
    (padded to MIN_ROWS rows), and a call with such an encode piece raised."""
    limit = budget.part_limit(max_tokens, columns)
    for q in range(1, columns + 1):
        assert parts(np.array([q]), limit) == [slice(None)], q

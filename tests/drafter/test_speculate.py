"""The speculation cache (remote_dspark.drafter.lm.speculate): a speculating drafter and a
non-speculating twin of the same model, fed the same scripted rounds through engines of
their own, answer alike within the cached rounds' rule (greedy: drafts equal up to the
twin's first near-tie, margins close; sampled: every draft the pick of its own q at the
round's seed, and the twin's wherever rounding cannot flip the draw), and exactly the
rounds that append a pre-drafted outcome hit; a sampled pre-draft never answers another
seed; a round that matches no outcome gives its stream's branch blocks back; pre-drafting
never evicts a stream, and a round short of blocks drops the branches before it evicts.
After every round and pre-draft the pool's counts are checked against its table.
CPU float32; the built-in model (eager and padded shapes) and a tiny GPT-2."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from lm_common import TIE, Engine, WholeStreams, assert_same_drafts
from test_lm_sampled import assert_drafts_follow_the_rule, assert_same_sampled

from remote_dspark.drafter.lm.drafter import LMDrafter
from remote_dspark.drafter.lm.hf import load_hf
from remote_dspark.drafter.lm.model import TinyLM

WINDOW, WIDTH, SLOTS, FANOUT = 16, 4, 4, 3
MARGIN_TOL = 1e-4  # two computations of one margin (another batch's shape) differ by ~1e-6
MODEL = TinyLM()


def assert_pool_consistent(drafter) -> None:
    """Every block has one owner: the free list, a stream's (or scratch) row's held cells,
    or a branch's cells from its fork on (those before are its stream's, read only in its
    own pre-draft); and the speculation cache's branches are where its tables say."""
    store, spec = drafter.store, drafter.spec
    first = np.zeros(store.rows, np.int64)
    live = np.flatnonzero(spec.b["row"] >= 0) if spec is not None else np.zeros(0, np.int64)
    first[store.cache_rows + live] = spec.b["cell"][live] if spec is not None else 0
    owned = [store.host_table[r, first[r] : store.held[r]] for r in range(store.rows)]
    blocks = np.concatenate([store.free[: store.n_free], *owned])
    assert sorted(blocks.tolist()) == list(range(1, store.blocks)), "a block lost, or owned twice"
    if spec is None:
        return
    dead = np.setdiff1d(np.arange(store.branch_rows), live)
    assert not store.held[store.cache_rows + dead].any(), "a free branch holds blocks"
    assert (spec.branch_of[spec.b["row"][live], spec.b["rank"][live]] == live).all()
    assert ((spec.branch_of >= 0).sum() == len(live)) and spec.n_free + len(live) == store.branch_rows
    assert drafter.spec_info().held == len(live)


def sampled(batch, draws):
    """``batch`` made sampled: each entry's (temperature, seed) from ``draws`` by slot."""
    pairs = [draws[int(s)] for s in batch.slots]
    return dataclasses.replace(
        batch,
        temperature=np.array([p[0] for p in pairs], np.float32),
        seed=np.array([p[1] for p in pairs], np.uint64),
    )


def hits(drafter) -> int:
    return sum(drafter.spec_info().hits)


class Pair:
    """A speculating drafter and its twin, each behind a scripted engine of its own (whole
    streams kept), fed the same entries. ``drafts``: each slot's drafts in its last answer;
    ``draws``: each slot's (temperature, seed) when ``sampling``."""

    def __init__(self, spec: LMDrafter, twin: LMDrafter, sampling: bool = False):
        self.spec, self.twin, self.sampling = spec, twin, sampling
        self.engines = [Engine(WINDOW, SLOTS, WholeStreams()) for _ in range(2)]
        self.drafts: dict[int, list[int]] = {}
        self.draws: dict[int, tuple[float, int]] = {}
        self.known: set[int] = set()

    def branches(self, slot: int) -> list[tuple[int, int]]:
        """The ``(j, t)`` outcomes pre-drafted for the slot's stream as it stands (the spec's)."""
        spec = self.spec.spec
        row = int(self.spec.cache.rows_of(self.engines[0].windows.serial, np.array([slot]))[0])
        if row < 0:
            return []
        b = spec.branch_of[row]
        cache = self.spec.cache
        b = b[(b >= 0) & (spec.b["length"][b] == cache.length[row]) & (spec.b["gen"][b] == cache.gen[row])]  # not stale
        return sorted(zip(spec.b["j"][b].tolist(), spec.b["t"][b].tolist(), strict=True))

    def outcome(self, slot: int, j: int, t: int) -> list[int]:
        """The tokens of outcome ``(j, t)`` of the slot's last answer."""
        return self.drafts.get(slot, [])[:j] + [t]

    def predrafted(self, slot: int, tokens: list[int]) -> bool:
        """Whether appending ``tokens`` to the slot is an outcome pre-drafted for it."""
        return any(self.outcome(slot, j, t) == tokens for j, t in self.branches(slot))

    def round(self, entries, expected_hits: int = 0):
        """One round of ``entries`` (:meth:`Engine.batch`'s) to both; checks the answers
        agree, that exactly ``expected_hits`` entries hit, and the pool. Returns the spec's
        answer and batch."""
        (batch, ok), (twins, _) = (e.batch(entries, WIDTH) for e in self.engines)
        batches = [batch, twins]
        for (slot, *_), known in zip(entries, ok.tolist(), strict=True):
            (self.known.add if known else self.known.discard)(slot)  # (a gap: the slot forgotten)
        if not len(batches[0]):  # (the worker never calls a drafter with no entry)
            return None
        if self.sampling:
            batches = [sampled(b, self.draws) for b in batches]
        before, misses = hits(self.spec), self.spec.spec_info().misses
        got, want = self.spec.draft_batch(batches[0]), self.twin.draft_batch(batches[1])
        assert hits(self.spec) - before == expected_hits
        if self.sampling:
            assert_same_sampled(got, want, batches[0])
            assert_drafts_follow_the_rule(got, batches[0])
        else:
            assert_same_drafts(got, want)
            for i, k in enumerate(want.counts.tolist()):
                tie = next((p for p, m in enumerate(want.margins[i, :k]) if m <= TIE), k)
                assert np.abs(got.margins[i, :tie] - want.margins[i, :tie]).max(initial=0) <= MARGIN_TOL
        for i, slot in enumerate(batches[0].slots.tolist()):
            self.drafts[slot] = got.tokens[i, : got.counts[i]].tolist()
        assert_pool_consistent(self.spec)
        self.last_misses = self.spec.spec_info().misses - misses
        return got, batches[0]

    def predraft(self, max_entries: int, max_tokens: int) -> int:
        made = self.spec.predraft(max_entries, max_tokens)
        assert_pool_consistent(self.spec)
        return made


KW = dict(device="cpu", cache_slots=SLOTS, window=WINDOW, max_context=32)
BLOCK_BYTES = LMDrafter(MODEL, **KW, kv_bytes=1 << 20).store.block_bytes()


def pair_of(kv_blocks: int, graphs: bool = False, sampling: bool = False, spec: LMDrafter | None = None) -> Pair:
    """A :class:`Pair` of the built-in model in a pool of ``kv_blocks`` (or of ``spec``'s
    model and pool: a twin is made for it)."""
    if spec is None:
        spec = LMDrafter(MODEL, **KW, kv_bytes=kv_blocks * BLOCK_BYTES, graphs=graphs, speculate=FANOUT)
    twin = LMDrafter(spec.model, identity=spec.drafter_identity, **KW, kv_bytes=spec.store.nbytes(), graphs=graphs)
    return Pair(spec, twin, sampling)


# An op of a slot in a round: its kind, a pick (which outcome; a NEW_GEN's position and
# length), tokens (a NEW_GEN's, repeated; a miss's).
OP = st.tuples(
    st.integers(0, SLOTS - 1),
    st.sampled_from(["outcome", "outcome", "outcome", "outcome", "miss", "swap", "new_gen", "gap", "reseed"]),
    st.integers(0, 1 << 16),
    st.lists(st.integers(0, 127), min_size=1, max_size=8),
)
ROUNDS = st.lists(
    st.tuples(
        st.lists(OP, min_size=1, max_size=SLOTS, unique_by=lambda op: op[0]),
        st.lists(st.tuples(st.integers(1, 12), st.sampled_from([24, 64, 4096])), max_size=2),  # pre-draft calls
    ),
    min_size=1,
    max_size=10,
)
HITTING = [([(s, "new_gen", 2 + 5 * s, [s + 1]) for s in range(3)], [(12, 4096)])] + [
    ([(s, "outcome", r + s, []) for s in range(3)], [(12, 4096)]) for r in range(5)
]


def play(pair: Pair, rounds) -> int:
    """Play scripted ``rounds`` (:data:`ROUNDS`) on ``pair``; returns the rounds' hits."""
    rng, total = np.random.default_rng(0), 0
    for ops, calls in rounds:
        entries, expected = [], 0
        for slot, kind, pick, tokens in ops:
            if slot not in pair.known or kind == "new_gen":
                entries.append((slot, (tokens * 44)[: 1 + pick % 44], True, False, pick % 200))
                pair.draws[slot] = (float(rng.choice([0.0, 0.5, 1.0])), int(rng.integers(1 << 63)))
            elif kind == "gap":
                entries.append((slot, [2], False, True))
            else:
                if kind == "miss":  # tokens that match no outcome (but by chance)
                    toks = (tokens * 2)[: 1 + pick % 3]
                else:  # an outcome: pre-drafted when the stream has any, else a correction not pre-drafted
                    outcomes = pair.branches(slot) or [(pick % (len(pair.drafts.get(slot, [])) + 1), pick % 128)]
                    toks = pair.outcome(slot, *outcomes[pick % len(outcomes)])
                    if kind == "swap":  # its first token another: (j, t) after other accepted tokens
                        toks[0] = (toks[0] + 1) % 128
                drafted = pair.predrafted(slot, toks)
                if kind == "reseed" and pair.sampling:  # the same tokens under another seed: no hit
                    temperature, seed = pair.draws[slot]
                    pair.draws[slot], drafted = (temperature, seed ^ 1), False
                expected += drafted
                entries.append((slot, toks, False, False))
        pair.round(entries, expected)
        total += expected
        for max_entries, max_tokens in calls:
            pair.predraft(max_entries, max_tokens)
    return total


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded"])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
@settings(max_examples=12, deadline=None)
@given(rounds=ROUNDS, kv_blocks=st.integers(7, 20))
@example(rounds=HITTING, kv_blocks=24)
def test_every_answer_is_the_twins_and_exactly_the_predrafted_outcomes_hit(graphs, sampling, rounds, kv_blocks):
    pair = pair_of(kv_blocks, graphs, sampling)
    total = play(pair, rounds)
    if rounds == HITTING:  # the property is not vacuous: scripted outcomes hit
        assert total > 0 and hits(pair.spec) == total


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
    path = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=512, n_embd=64, n_layer=2, n_head=2, initializer_range=0.5
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
@settings(max_examples=5, deadline=None)
@given(rounds=ROUNDS, kv_blocks=st.integers(7, 20))
@example(rounds=HITTING, kv_blocks=20)
def test_a_transformers_model_answers_as_its_twin(gpt2_dir, sampling, rounds, kv_blocks):
    probe = load_hf(str(gpt2_dir), "cpu", WINDOW, cache_slots=SLOTS, max_context=32, kv_bytes=1 << 20)
    kv = kv_blocks * probe.store.block_bytes()
    spec = load_hf(str(gpt2_dir), "cpu", WINDOW, cache_slots=SLOTS, max_context=32, kv_bytes=kv, speculate=FANOUT)
    pair = pair_of(kv_blocks, sampling=sampling, spec=spec)
    total = play(pair, rounds)
    if rounds == HITTING:
        assert total > 0 and hits(pair.spec) == total


def row_of(pair: Pair, slot: int) -> int:
    return int(pair.spec.cache.rows_of(pair.engines[0].windows.serial, np.array([slot]))[0])


def first_outcome(pair: Pair, slot: int) -> list[int]:
    """The tokens of the slot's first pre-drafted outcome (there must be one)."""
    outcomes = pair.branches(slot)
    assert outcomes, "nothing pre-drafted"
    return pair.outcome(slot, *outcomes[0])


@pytest.mark.parametrize("change", ["none", "seed", "temperature"])
def test_a_sampled_predraft_never_answers_another_seed_or_temperature(change):
    pair = pair_of(24, sampling=True)
    pair.draws = {0: (0.8, 1234), 1: (0.8, 99)}
    pair.round([(0, list(range(3, 23)), True, False, 5), (1, [7] * 9, True, False, 0)])
    assert pair.predraft(16, 4096) > 0
    tokens = first_outcome(pair, 0)
    before = pair.spec.spec_info()
    temperature, seed = pair.draws[0]
    pair.draws[0] = {"none": (temperature, seed), "seed": (temperature, seed + 1), "temperature": (0.5, seed)}[change]
    pair.round([(0, tokens, False, False)], expected_hits=int(change == "none"))  # the answer is the twin's
    after = pair.spec.spec_info()
    assert after.misses == before.misses + (change != "none")
    assert pair.branches(0) == [] and pair.branches(1) != []  # the stream's branches let go, the other's kept


def test_a_round_that_matches_no_outcome_lets_its_streams_branches_go_at_the_next_predraft():
    pair = pair_of(24)
    pair.round([(0, list(range(3, 23)), True, False, 5), (1, [7] * 9, True, False, 0)])
    store, row = pair.spec.store, row_of(pair, 0)
    free, held = store.n_free, int(store.held[row])
    assert pair.predraft(16, 4096) > 0
    info, stale = pair.spec.spec_info(), len(pair.branches(0))
    assert info.blocks > 0 and info.held == stale + len(pair.branches(1)) and store.n_free == free - info.blocks
    t = next(t for t in range(128) if not pair.predrafted(0, [t]))  # a correction at the first draft, not pre-drafted
    pair.round([(0, [t], False, False)])  # (its stream keeps its blocks: 21 tokens and 4 drafts in 2)
    assert pair.branches(0) == [] and pair.spec.spec_info().misses == 1
    pair.predraft(16, 4096)  # the stream's outcomes again: its stale branches let go first
    info = pair.spec.spec_info()
    assert info.dropped == stale and int(store.held[row]) == held and store.n_free == free - info.blocks
    pair.spec.spec.reclaim()  # (a round short of blocks)
    info = pair.spec.spec_info()
    assert info.held == info.blocks == 0 and store.n_free == free
    assert_pool_consistent(pair.spec)


def test_predrafting_never_evicts_a_stream_and_a_round_short_of_blocks_drops_the_branches_first():
    pair = pair_of(9)  # 8 blocks: three streams of 2 blocks each, 2 free
    pair.round([(s, list(range(s, s + 20)), True, False, 0) for s in range(3)])
    store, cache = pair.spec.store, pair.spec.cache
    held, evicted = store.held[: cache.capacity].copy(), cache.info().evicted
    assert store.n_free == 2
    made = pair.predraft(16, 4096)  # 9 outcomes wanted, a block each: as many as fit
    assert made == 2 and store.n_free == 0
    assert (store.held[: cache.capacity] == held).all() and cache.info().evicted == evicted
    assert all(cache.held(pair.engines[0].windows.serial, s) is not None for s in range(3))
    pair.round([(3, list(range(40, 60)), True, False, 0)])  # a newcomer of 2 blocks: the branches' blocks
    info = pair.spec.spec_info()
    assert info.held == 0 and info.dropped == made and cache.info().evicted == evicted
    assert pair.predraft(16, 4096) == 0 and cache.info().evicted == evicted  # the pool full: nothing, no stream lost
    pair.round([(0, [1], False, False)])  # answered again: due, and still no room
    assert pair.predraft(16, 4096) == 0 and cache.info().evicted == evicted


def test_a_stream_evicted_since_its_answer_is_not_predrafted():
    """A stream answered, then evicted by a later wave of its own round: pre-drafting
    finds nothing of it to draft from (it would read blocks it no longer holds)."""
    pair = pair_of(7)  # 6 blocks: a stream of 1 and two of 3 do not fit at once
    pair.round([(0, [5], True, False, 0), (1, [6] * 29, True, False, 0), (2, [7] * 29, True, False, 0)])
    serial = pair.engines[0].windows.serial
    gone = [s for s in range(3) if pair.spec.cache.held(serial, s) is None]
    assert gone and pair.spec.cache.info().evicted == len(gone)
    for _ in range(3):  # one stream at a time, most recent first
        pair.predraft(1, 24)
    assert all(pair.branches(s) == [] for s in gone)


def test_a_row_given_to_another_stream_never_serves_the_old_streams_predrafts():
    """One cache row, two slots: the second slot's NEW_GEN takes the row (the first's
    stream evicted) and its next round appends what the first's pre-draft was for, at
    the same length, generation and positions: drafted afresh, never the other's."""
    spec = LMDrafter(MODEL, **{**KW, "cache_slots": 1}, kv_bytes=24 * BLOCK_BYTES, speculate=FANOUT)
    pair = pair_of(24, spec=spec)
    pair.round([(0, list(range(3, 23)), True, False, 0)])
    assert pair.predraft(16, 4096) > 0
    j, t = next((j, t) for j, t in pair.branches(0) if j == 0)
    pair.round([(1, list(range(60, 80)), True, False, 0)])  # the row is slot 1's now
    pair.round([(1, [t], False, False)], expected_hits=0)  # (slot 1's drafts, as its twin's)


def test_predrafting_goes_rank_by_rank_across_the_streams_the_most_recent_first():
    pair = pair_of(24)
    pair.round([(0, list(range(3, 23)), True, False, 5)])
    pair.round([(1, [7] * 9, True, False, 0)])  # answered last
    steps = []
    for _ in range(2 * FANOUT):
        assert pair.predraft(1, 4096) == 1  # (a call the cost model allows one entry)
        steps.append((len(pair.branches(0)), len(pair.branches(1))))
    assert steps == [(r + (s == 0), r + 1) for r in range(FANOUT) for s in (1, 0)]
    assert pair.predraft(1, 4096) == 0  # every outcome pre-drafted: none due


def test_a_padded_round_predrafts_at_least_its_rows():
    pair = pair_of(24, graphs=True)  # (padded: on a GPU a call of fewer rows costs as much)
    pair.round([(0, list(range(3, 23)), True, False, 5), (1, [7] * 9, True, False, 0)])
    assert pair.predraft(1, 4096) == 2 * FANOUT and pair.predraft(1, 4096) == 0


@pytest.mark.parametrize("accepts", ["all", "none"])
def test_the_outcomes_are_ranked_by_what_the_engine_was_seen_to_accept(accepts):
    pair = pair_of(64)
    pair.round([(0, list(range(3, 23)), True, False, 5)])
    for _ in range(12):  # the engine accepts every draft (then its bonus), or none (a correction)
        j = len(pair.drafts[0]) if accepts == "all" else 0
        t = (pair.drafts[0][j] + 1) % 128 if j < len(pair.drafts[0]) else 5  # (not the draft: a correction)
        pair.round([(0, pair.outcome(0, j, t), False, False)])
    row = row_of(pair, 0)
    _, j, _, rank, shift, _ = pair.spec.spec._outcomes(np.array([row]))
    first = int(np.flatnonzero(rank == 0)[0])
    if accepts == "all":
        assert shift[first] == 1 and pair.spec.spec.seen.rate() > 0.8  # the bonus after all k
    else:
        assert j[first] == 0 and shift[first] == 0 and pair.spec.spec.seen.rate() < 0.2  # a first-draft correction


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "padded"])
def test_unlikely_outcomes_only_fill_a_padded_rounds_rows(graphs):
    fanout = 8
    pair = pair_of(0, spec=LMDrafter(MODEL, **KW, kv_bytes=64 * BLOCK_BYTES, graphs=graphs, speculate=fanout))
    pair.round([(0, list(range(3, 23)), True, False, 5)])
    for _ in range(10):  # every draft accepted: the corrections become unlikely
        pair.round([(0, pair.outcome(0, len(pair.drafts[0]), 5), False, False)])
    _, _, _, _, _, score = pair.spec.spec._outcomes(np.array([row_of(pair, 0)]))
    worth = int((score >= 0.02).sum())
    assert 0 < worth < len(score) == fanout
    made = pair.predraft(64, 4096)
    assert made == (fanout if graphs else worth) and pair.predraft(64, 4096) == 0  # then none due


def test_only_a_drafter_that_speculates_is_called_to_predraft():
    from remote_dspark.drafter.contract import predrafts_of

    off = LMDrafter(MODEL, **KW, kv_bytes=16 * BLOCK_BYTES)
    on = LMDrafter(MODEL, **KW, kv_bytes=16 * BLOCK_BYTES, speculate=2)
    assert not predrafts_of(off) and off.predraft(8, 4096) == 0 and off.spec_info() is None
    assert predrafts_of(on) and on.spec_info().outcomes == 0

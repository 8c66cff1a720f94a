"""The Markov drafter's sampled rounds (``remote_dspark.drafter.markov_sampled``):
temperature 0 is the greedy draft; every draft is the rule's pick from the distribution
reported for it, which is ``from_counts`` over the context that the drafts before it
made; draws follow that distribution (chi-square, fixed seeds: a false failure has
probability below 1e-4 per check, and the seeds fix the outcome); unseen contexts stop."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import P_VALUE_MIN, chi2_p

from remote_dspark.drafter.answer import check_result
from remote_dspark.drafter.contract import DraftBatch, samples_of
from remote_dspark.drafter.markov import MarkovDrafter, MarkovModel, Next, SyntheticLanguage, builtin_model
from remote_dspark.drafter.sampling import TOP, TOTAL, from_counts, pick, uniform_u32

# A hand-built order-1 model: after 5 come 7, 3, 11, 9 (counts 6, 3, 2, 1 of 14 seen);
# 7 leads back to 5 or on to 3; 3 has no entry (a dead end); 20 has two tied next tokens.
HAND = MarkovModel(
    1,
    4,
    {
        (5,): Next((7, 3, 11, 9), (6, 3, 2, 1), 14),
        (7,): Next((3, 5), (4, 4), 9),  # tied: stored smaller id first, as from_tokens does
        (11,): Next((5,), (2,), 2),
        (9,): Next((20,), (1,), 1),
        (20,): Next((9, 21), (5, 5), 10),
    },
)
HAND_COUNTS = {7: 6, 3: 3, 11: 2, 9: 1}  # after 5


def batch_of(contexts, width, temperature=None, seed=None, n_out=None, positions=None, want_margin=True):
    tokens = np.array([t for c in contexts for t in c], np.int32)
    offsets = np.cumsum([0] + [len(c) for c in contexts]).astype(np.int64)
    n = len(contexts)
    return DraftBatch(
        tokens=tokens,
        offsets=offsets,
        n_out=np.full(n, width, np.int32) if n_out is None else np.asarray(n_out, np.int32),
        rows=np.zeros((n, 0), np.uint8),
        want_margin=want_margin,
        width=width,
        positions=positions,
        temperature=None if temperature is None else np.broadcast_to(np.float32(temperature), (n,)).copy(),
        seed=None if seed is None else np.asarray(seed, np.uint64),
    )


def text_contexts(n, length=5, seed=3):
    """n contexts cut from the synthetic language (the built-in model's), some unseen."""
    text = SyntheticLanguage().text(n + length + 1, seed=seed)
    return [text[i : i + length] for i in range(n)]


def reference_q(model, window, temperature):
    """from_counts over the stored next tokens of ``window``'s last ``order`` tokens
    (one row: ids [1, TOP], weights [1, TOP])."""
    nxt = model.table[tuple(window[-model.order :])]
    vocab = max(model.vocab_size, TOP)
    return from_counts([nxt.tokens], [nxt.counts], [temperature], vocab)


def test_the_markov_drafter_says_it_samples():
    assert samples_of(MarkovDrafter(HAND))


@pytest.mark.parametrize(
    "model",
    [
        builtin_model(),
        HAND,
        MarkovModel.from_tokens(list(np.random.default_rng(1).integers(0, 3000, 600)), order=2, top=3),  # radix
        MarkovModel.from_tokens([0, 2**31 - 1, 7, 0, 7, 2**31 - 1, 0, 7, 0, 2**31 - 1] * 3, order=3, top=2),  # bytes
    ],
    ids=["builtin", "hand", "radix", "bytes"],
)
def test_temperature_zero_is_the_greedy_draft_with_one_hot_weights(model):
    contexts = [list(c) for c in model.table][:300] + [[], [123_456], [5, 7, 5], [20, 20, 20]] + text_contexts(200)
    n_out = np.arange(len(contexts)) % 7
    greedy = MarkovDrafter(model).draft_batch(batch_of(contexts, 6, n_out=n_out))
    sampled = MarkovDrafter(model).draft_batch(batch_of(contexts, 6, 0.0, np.arange(len(contexts)), n_out))
    assert greedy.counts.sum() > 0
    np.testing.assert_array_equal(sampled.tokens, greedy.tokens)
    np.testing.assert_array_equal(sampled.counts, greedy.counts)
    np.testing.assert_array_equal(sampled.margins, greedy.margins)
    live = np.arange(6) < sampled.counts[:, None]
    assert (sampled.q_weights[..., 0][live] == TOTAL).all() and (sampled.q_weights[..., 1:][live] == 0).all()
    np.testing.assert_array_equal(sampled.q_ids[..., 0][live], sampled.tokens[live])


def test_each_draft_is_the_pick_from_the_distribution_of_the_context_before_it():
    model = builtin_model()
    contexts = text_contexts(400) + [[], [1], [9999, 9999]]
    n = len(contexts)
    rng = np.random.default_rng(5)
    temperature = rng.choice(np.float32([0.0, 0.3, 1.0, 2.5]), n)
    seed = rng.integers(0, 2**64, n, dtype=np.uint64)
    positions = rng.integers(0, 10_000, n)
    batch = batch_of(contexts, 5, temperature, seed, n_out=rng.integers(0, 6, n), positions=positions)
    result = MarkovDrafter(model).draft_batch(batch)
    checked = check_result(result, batch)
    for name in ("tokens", "counts", "margins", "q_ids", "q_weights"):
        np.testing.assert_array_equal(getattr(checked, name), getattr(result, name), err_msg=name)
    assert result.counts.sum() > 0.8 * batch.n_out.sum()
    for i in range(n):  # the reference: one entry, one step at a time
        context = [int(t) for t in contexts[i]]
        for j in range(result.counts[i]):
            ids, weights = reference_q(model, context, temperature[i])
            np.testing.assert_array_equal(result.q_ids[i, j], ids[0])
            np.testing.assert_array_equal(result.q_weights[i, j], weights[0])
            u = uniform_u32(seed[i], positions[i] + len(contexts[i]) + j, j)
            assert result.tokens[i, j] == pick(ids, weights, u[None])[0]
            assert result.margins[i, j] == np.float32(model.draft(context, 1)[1][0])
            context.append(int(result.tokens[i, j]))
        if result.counts[i] < batch.n_out[i]:  # stopped early: the context it reached is unseen
            assert len(context) < model.order or tuple(context[-model.order :]) not in model.table
    past = np.arange(5) >= result.counts[:, None]
    assert not result.tokens[past].any() and not result.q_ids[past].any() and not result.q_weights[past].any()


def test_same_seed_same_drafts_and_other_seeds_differ():
    contexts = text_contexts(300)
    drafter = MarkovDrafter(builtin_model())
    a = drafter.draft_batch(batch_of(contexts, 6, 1.0, np.arange(300)))
    b = drafter.draft_batch(batch_of(contexts, 6, 1.0, np.arange(300)))
    c = drafter.draft_batch(batch_of(contexts, 6, 1.0, np.arange(300) + 1000))
    for name in ("tokens", "counts", "q_ids", "q_weights"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert (a.tokens != c.tokens).any(axis=1).mean() > 0.3  # ~55% of entries: first drafts agree ~2/3


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_first_drafts_follow_the_reported_distribution(temperature):
    n = 20_000
    result = MarkovDrafter(HAND).draft_batch(batch_of([[5]] * n, 1, temperature, np.arange(n) * 7919 + 11))
    assert (result.counts == 1).all()
    assert (result.q_ids[:, 0] == result.q_ids[0, 0]).all() and (result.q_weights[:, 0] == result.q_weights[0, 0]).all()
    ids, weights = result.q_ids[0, 0], result.q_weights[0, 0].astype(np.float64)
    observed = (result.tokens[:, 0][:, None] == ids[None, :]).sum(axis=0)
    assert observed.sum() == n  # every draft is one of the reported ids
    assert chi2_p(observed, n * weights / TOTAL) > P_VALUE_MIN


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 2.0, 4.0])
def test_weights_are_count_to_the_one_over_t(temperature):
    result = MarkovDrafter(HAND).draft_batch(batch_of([[5]], 1, temperature, [1]))
    tokens = np.array(list(HAND_COUNTS))
    p = np.array([HAND_COUNTS[t] for t in tokens], np.float64) ** (1 / temperature)
    w = np.floor(p / p.sum() * TOTAL).astype(np.int64)
    w[0] += TOTAL - w.sum()  # the deficit to the largest count (7's)
    np.testing.assert_array_equal(result.q_ids[0, 0, :4], tokens)
    np.testing.assert_array_equal(result.q_weights[0, 0, :4], w)
    assert not result.q_weights[0, 0, 4:].any()
    # Pads: the smallest ids that are not candidates, in the drafter's vocabulary (32 here).
    np.testing.assert_array_equal(result.q_ids[0, 0, 4:], [i for i in range(TOP + 4) if i not in HAND_COUNTS][:28])
    assert HAND.vocab_size < TOP and result.q_ids.max() < TOP


def test_an_entry_with_no_successor_gets_no_more_drafts():
    # 5 -> 7 (greedy) -> 5 or 3 (tied: 3, the smaller id) -> 3 has no entry: two drafts.
    contexts = [[5], [3], [], [42], [9, 5]]
    result = MarkovDrafter(HAND).draft_batch(batch_of(contexts, 4, 0.0, np.arange(5)))
    np.testing.assert_array_equal(result.counts, [2, 0, 0, 0, 2])
    np.testing.assert_array_equal(result.tokens[0], [7, 3, 0, 0])
    assert not result.q_weights[:, 2:].any() and not result.q_weights[1:4].any()
    # Sampled: whatever the draws, an entry stops exactly when it drafts a dead end (3 or 21).
    n = 2000
    result = MarkovDrafter(HAND).draft_batch(batch_of([[5]] * n, 6, 1.0, np.arange(n)))
    dead_end = np.isin(result.tokens, [3, 21])
    before_last = np.arange(6) < result.counts[:, None] - 1
    stopped = result.counts < 6
    assert stopped.any() and (~stopped).any() and (result.counts > 0).all()
    assert dead_end[np.arange(n), result.counts - 1][stopped].all() and not dead_end[before_last].any()


def test_an_empty_model_drafts_nothing_in_a_sampled_round():
    empty = MarkovModel.from_tokens([1, 2], order=2, top=2)
    batch = batch_of([[1, 2], [], [3, 4, 5]], 3, 1.0, [1, 2, 3])
    result = check_result(MarkovDrafter(empty).draft_batch(batch), batch)
    assert not result.counts.any() and result.q_ids.shape == (3, 3, TOP)


def test_a_mixed_batch_samples_where_asked_and_is_greedy_elsewhere():
    contexts = text_contexts(600)
    n = len(contexts)
    temperature = np.where(np.arange(n) % 2 == 0, 0.0, 1.0).astype(np.float32)
    seed = np.arange(n) + 77
    drafter = MarkovDrafter(builtin_model())
    batch = batch_of(contexts, 5, temperature, seed)
    mixed = check_result(drafter.draft_batch(batch), batch)
    greedy = drafter.draft_batch(batch_of(contexts, 5))
    even, odd = np.arange(n) % 2 == 0, np.arange(n) % 2 == 1
    np.testing.assert_array_equal(mixed.tokens[even], greedy.tokens[even])
    # The sampled entries are what a batch of them alone drafts (entries are independent).
    alone = drafter.draft_batch(batch.subset(odd))
    np.testing.assert_array_equal(mixed.tokens[odd], alone.tokens)
    np.testing.assert_array_equal(mixed.q_weights[odd], alone.q_weights)
    assert (mixed.tokens[odd] != greedy.tokens[odd]).any(axis=1).mean() > 0.2


def test_without_margins_and_zero_width():
    batch = batch_of([[5], [7]], 3, 1.0, [1, 2], want_margin=False)
    result = check_result(MarkovDrafter(HAND).draft_batch(batch), batch)
    assert result.margins is None and result.counts[0] >= 1
    result = MarkovDrafter(HAND).draft_batch(batch_of([[5], [7]], 0, 1.0, [1, 2]))
    assert result.tokens.shape == (2, 0) and result.q_ids.shape == (2, 0, TOP) and not result.counts.any()


@pytest.mark.parametrize(
    "change, culprit",
    [
        ({"seed": None}, "seed"),
        ({"temperature": np.float32([1.0, -0.5])}, "temperature -0.5"),
        ({"temperature": np.float32([1.0, np.inf])}, "temperature inf"),
        ({"temperature": np.float32([1.0])}, "temperature: shape"),
        ({"seed": np.uint64([1])}, "seed: shape"),
    ],
)
def test_bad_sampled_batches_are_refused_naming_the_culprit(change, culprit):
    import dataclasses

    batch = dataclasses.replace(batch_of([[5], [7]], 2, 1.0, [1, 2]), **change)
    with pytest.raises(ValueError, match=culprit):
        MarkovDrafter(HAND).draft_batch(batch)


def test_distribution_tables_give_what_computing_each_step_gives_and_keep_few_temperatures(monkeypatch):
    """A round drafted through the per-temperature tables (filled as rows are met, over
    several calls) equals the same round computed step by step (tables off); more
    temperatures than TABLES keep only the most recently used."""
    from remote_dspark.drafter import markov_sampled

    contexts = text_contexts(300, seed=8)
    temps = np.array([0.0, 0.5, 1.0, 2.0], np.float32)[np.arange(300) % 4]
    batch = batch_of(contexts, 5, temps, np.arange(300) + 99)
    tabled = MarkovDrafter(MarkovModel.from_bytes(builtin_model().to_bytes()))  # its own tables
    halves = [tabled.draft_batch(batch_of(contexts[i::2], 5, temps[i::2], np.arange(300)[i::2] + 99)) for i in (0, 1)]
    got = tabled.draft_batch(batch)  # partly from rows the halves filled
    monkeypatch.setattr(markov_sampled, "TABLE_BYTES", 0)
    want = MarkovDrafter(builtin_model()).draft_batch(batch)
    for name in ("tokens", "counts", "margins", "q_ids", "q_weights"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
        assert np.array_equal(getattr(halves[0], name), getattr(want, name)[0::2]), name
    monkeypatch.undo()
    tables = tabled.model.tables().dists
    assert sorted(tables.by_temperature) == [0.0, 0.5, 1.0, 2.0]
    for t in np.linspace(0.1, 3.0, markov_sampled.TABLES):
        tabled.draft_batch(batch_of(contexts[:4], 3, t, np.arange(4)))
    assert len(tables.by_temperature) == markov_sampled.TABLES and 0.0 not in tables.by_temperature

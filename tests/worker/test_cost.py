"""The drafter's cost model (remote_dspark.worker.cost): it learns a call's seconds by its
shape, forgets one slow call (a compile) after one short call, and an overrun scales the
next prediction at once."""

import numpy as np
import pytest

from remote_dspark.worker.cost import MIN_FIT, DrafterCost

TRUE = np.array([0.002, 1e-5, 2e-6, 4e-6])  # a, b, c, d: a call, an entry, a token, a draft step


def seconds(entries, tokens, width):
    return float(TRUE @ [1, entries, tokens, entries * width])


def shapes(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(int(e), int(e * rng.integers(4, 300)), int(rng.integers(1, 65))) for e in rng.integers(1, 1024, n)]


def test_before_any_call_a_price_is_the_entry_s_tokens():
    cost = DrafterCost()
    assert not cost.known and cost.prices(np.array([5, 7]), np.array([3, 0]), 3).tolist() == [5.0, 7.0]
    assert cost.tick() == 1.0 and cost.tokens_within(12.5) == 12


def test_the_fit_finds_the_drafter_s_coefficients_and_ignores_one_slow_call():
    cost = DrafterCost()
    calls = shapes(20)
    for i, (e, t, w) in enumerate(calls):
        cost.observe(e, t, w, seconds(e, t, w) * (50 if i == MIN_FIT + 2 else 1))  # one compile among them
    assert cost.over == 1.0 and np.allclose(cost.coef, TRUE, rtol=1e-3, atol=1e-9)
    assert cost.seconds(64, 640, 5) == pytest.approx(seconds(64, 640, 5), rel=1e-3)


def test_an_overrun_scales_the_next_prediction_and_one_call_on_time_undoes_it():
    cost = DrafterCost()
    for e, t, w in shapes(12):
        cost.observe(e, t, w, seconds(e, t, w))
    before, allowance = cost.seconds(64, 640, 5), cost.prices(np.array([640]), np.array([0]), 0)[0]
    assert cost.tokens_within(allowance) == pytest.approx(640, abs=1)
    cost.observe(100, 10_000, 5, 4 * seconds(100, 10_000, 5))  # a call four times its prediction
    assert cost.seconds(64, 640, 5) == pytest.approx(4 * before, rel=0.05)
    assert cost.tokens_within(allowance) < 640 / 3  # the same time takes fewer tokens in the next call
    cost.observe(64, 640, 5, seconds(64, 640, 5))
    assert cost.seconds(64, 640, 5) == pytest.approx(before, rel=0.05)


def test_the_fit_is_redone_every_refit_calls_or_at_once_when_a_call_drifts():
    """Between fits the coefficients stand (a fit costs the drafter thread): a call within
    DRIFT of its prediction leaves them until REFIT calls have passed; one past it refits
    at once."""
    from remote_dspark.worker.cost import DRIFT, REFIT

    cost = DrafterCost()
    for e, t, w in shapes(MIN_FIT + REFIT):  # fitted at MIN_FIT calls and REFIT calls later
        cost.observe(e, t, w, seconds(e, t, w))
    fitted = cost.coef.copy()
    for e, t, w in shapes(REFIT - 1, seed=1):  # a drafter 1.5x slower: within DRIFT, no refit yet
        cost.observe(e, t, w, 1.5 * seconds(e, t, w))
        assert (cost.coef == fitted).all()
    e, t, w = shapes(1, seed=2)[0]
    cost.observe(e, t, w, 1.5 * seconds(e, t, w))  # the REFIT-th: refitted, toward the slower drafter
    assert (cost.coef > fitted * 1.05).any()
    refitted = cost.coef.copy()
    cost.observe(e, t, w, 0.5 / DRIFT * seconds(e, t, w))  # far below its prediction: refitted at once
    assert not (cost.coef == refitted).all()


def test_a_pre_drafting_call_is_sized_to_the_recent_calls_usual_length():
    cost = DrafterCost()
    assert cost.typical() == (0.0, 0) and cost.entries_within(1.0, 5) == 0  # nothing known yet
    calls = shapes(20, seed=3)
    for e, t, w in calls:
        cost.observe(e, t, w, seconds(e, t, w))
    usual, width = cost.typical()
    assert usual == pytest.approx(np.median([seconds(*c) for c in calls])) and width == calls[-1][2]
    n = cost.entries_within(usual, width)  # entries of a token and `width` drafts each
    assert seconds(n, n * (1 + width), width) <= usual * (1 + 1e-3)  # (the fit: to its rounding)
    assert seconds(n + 1, (n + 1) * (1 + width), width) > usual * (1 - 1e-3)

"""What the drafter costs: seconds of a call by its shape, learnt from every call.

The scheduler sizes calls in time and shares them fairly by drafter time
(:mod:`.fair`); both need a piece's seconds before it is drafted. :class:`DrafterCost`
is the one owner of that estimate: it is told every call's shape and duration
(:meth:`DrafterCost.observe`) and predicts a call's, or each entry's share of one
(:meth:`DrafterCost.prices`), as

    seconds = a + b * entries + c * tokens + d * entries * width

(``tokens``: the call's budget tokens, contexts it encodes and drafts,
:class:`~.batching.Charge`; ``width``: its draft steps). Why this estimator:

- **Linear in the shape, fitted over the last** ``WINDOW`` **calls** (least squares on
  relative error, so a short call counts as much as a long one; no coefficient
  negative, a column that would be is dropped and the rest refitted): a model drafter's
  call is a fixed launch cost, per-row work, per-token attention and per-draft-step
  work; the Markov table is all per-entry. Fewer than ``MIN_FIT`` calls: one
  coefficient, the fewest seconds a token has taken (``c``), the old pace.
- **One slow call does not stay**: a call over ``OUTLIER`` times the fit of the others
  (a compile, a warm-up) is left out of the fit while such calls are a minority, so it
  costs one short call (below), not a window of them; calls that keep being slow are
  the majority soon enough and are the fit.
- **An overrun shrinks the next call at once**: the last call's seconds over the fit's
  prediction for it (when over 1) scale every prediction until the next call; a
  drafter that keeps overrunning keeps being scaled, one that was slow once is not.
- **Refitted every** ``REFIT`` **calls**, or at once when a call is off its prediction
  by more than ``DRIFT`` either way: a least-squares fit is about half a millisecond of
  the drafter thread's time on a slow host, more than the rest of a small call's
  Python; between fits the overrun's scale follows the drafter.

Before the first call it knows nothing (:attr:`DrafterCost.known` False): a price is
then the entry's tokens, so the scheduler's shares and budgets are in tokens, as with
token caps alone. Not thread-safe: the scheduler calls it under its lock, or from the
thread making a call (the only writer).
"""

from __future__ import annotations

import collections

import numpy as np

WINDOW = 32  # the calls a fit is made over (the most recent)
MIN_FIT = 8  # calls before the four coefficients are fitted (fewer: the per-token rate only)
OUTLIER = 3.0  # a call this many times its prediction by the others is left out of the fit
REFIT = 8  # calls between two fits, once fitted
DRIFT = 2.0  # a call off its prediction by more than this factor, either way, refits at once


class DrafterCost:
    """The drafter's seconds by a call's shape (the module docstring)."""

    def __init__(self):
        self._calls: collections.deque[tuple[int, int, int, float]] = collections.deque(maxlen=WINDOW)
        self.coef = np.zeros(4)  # a, b, c, d: seconds of a call, an entry, a token, an entry's draft step
        self.over = 1.0  # the last call's seconds over its prediction (>= 1): scales every prediction
        self._since = 0  # calls observed since the last fit

    @property
    def known(self) -> bool:
        """A call has been seen: predictions are seconds (else a price is tokens)."""
        return bool(self._calls)

    def seconds(self, entries: int, tokens: int, width: int) -> float:
        """The predicted seconds of a call of this shape (0 before the first call)."""
        a, b, c, d = self.coef
        return float(a + b * entries + c * tokens + d * entries * width) * self.over

    def prices(self, costs: np.ndarray, n_out: np.ndarray, width: int) -> np.ndarray:
        """[n] float64: each entry's share of a call's seconds (its ``costs`` in tokens, its
        drafts: ``n_out`` > 0 with ``width`` steps); the call's own ``a`` is no entry's.
        Before the first call: the tokens themselves."""
        if not self.known:
            return costs.astype(np.float64)
        _, b, c, d = self.coef
        return (b + c * costs + np.where(n_out > 0, d * width, 0.0)) * self.over

    def tick(self) -> float:
        """The price of one token (1 before the first call): a credit is kept a token less
        than an entry's price, and an encode piece is a token at least."""
        return float(self.coef[2] * self.over) if self.known else 1.0

    def tokens_within(self, price: float) -> int:
        """The most tokens of one entry's encode (no drafts) within ``price``."""
        if not self.known:
            return int(price)
        _, b, c, _ = self.coef * self.over
        # (1e-9: rounding; the price of n tokens is n tokens, not n - 1)
        return int((price - b) / c + 1e-9) if c > 0 else (1 << 62 if price >= b else 0)

    def entries_within(self, seconds: float, width: int) -> int:
        """The most entries of a token and ``width`` drafts each (a pre-draft's) that a
        call of ``seconds`` drafts (1 << 62 when none costs anything; 0 before the first call)."""
        if not self.known:
            return 0
        a, b, c, d = self.coef * self.over
        each = b + c * (1 + width) + d * width
        return int((seconds - a) / each) if each > 0 else 1 << 62

    def typical(self) -> tuple[float, int]:
        """The recent calls' median seconds and the last one's width (a call's usual
        length: what a pre-drafting call may take). ``(0.0, 0)`` before the first call."""
        if not self._calls:
            return 0.0, 0
        return float(np.median([c[3] for c in self._calls])), int(self._calls[-1][2])

    def observe(self, entries: int, tokens: int, width: int, seconds: float) -> None:
        """A call's shape and its seconds: the fit follows, and an overrun of the
        prediction scales the next ones (the module docstring)."""
        if seconds <= 0 or tokens <= 0:
            return
        predicted = self.seconds(entries, tokens, width) / self.over if self.known else 0.0
        self.over = max(1.0, seconds / predicted) if predicted > 0 else 1.0
        self._calls.append((entries, tokens, width, seconds))
        self._since += 1
        off = predicted <= 0 or not 1 / DRIFT <= seconds / predicted <= DRIFT
        if len(self._calls) <= MIN_FIT or self._since >= REFIT or off:
            self.coef, self._since = self._fit(), 0

    def _fit(self) -> np.ndarray:
        calls = np.array(self._calls, np.float64)
        e, t, w, s = calls.T
        if len(calls) < MIN_FIT:
            return np.array([0.0, 0.0, float(np.min(s / t)), 0.0])
        x = np.stack([np.ones_like(e), e, t, e * w], 1) / s[:, None]  # relative error: rows over seconds
        coef = _nonnegative(x, np.ones_like(s))
        ratio = s / np.maximum(x * s[:, None] @ coef, 1e-12)
        slow = ratio > OUTLIER
        if 0 < slow.sum() < len(s) / 4:  # a few slow calls (a compile, a warm-up): not the drafter's pace
            coef = _nonnegative(x[~slow], np.ones(int((~slow).sum())))
        return coef if coef[2] > 0 or coef[1] > 0 else np.array([0.0, 0.0, float(np.min(s / t)), 0.0])


def _nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of ``x @ coef ~ y`` with no coefficient negative: a column whose
    coefficient comes out negative is dropped and the rest refitted (at most 4 rounds)."""
    cols = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while cols:
        got = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
        if (got >= 0).all():
            coef[cols] = got
            return coef
        cols = [c for c, g in zip(cols, got, strict=True) if g > 0]
    return coef

"""The Markov drafter's sampled rounds: each draft drawn from its context's next-token
counts by :mod:`remote_dspark.drafter.sampling`'s rule (SAMPLED_TOP32).

For draft step j of entry i (its context's row ``r`` in :meth:`~.markov.MarkovModel.tables`):

* **Candidates** are the row's stored next tokens (up to ``top``, at most 16) with their
  counts from the cache file (the counts of the ``top`` most frequent next tokens as
  seen in training; the rest of the context's ``total`` is not a candidate: the model
  does not know those tokens).
* **The distribution** is ``from_counts(candidates, counts, temperature[i], vocab)``:
  ``p`` proportional to ``count ** (1 / T)``, floored to weights summing to 65535, and
  ``T == 0`` the largest count (the smaller id on a tie), all weight on it. That is the
  greedy draft of :meth:`MarkovModel.draft_batch` whenever the row's tokens are stored
  count descending with ties by id ascending, as :meth:`MarkovModel.from_tokens` writes
  them (a hand-made file with tied counts in another order drafts the smaller id).
* **The draft** is ``pick(ids, weights, uniform_u32(seed[i], p, j))`` with ``p`` its
  absolute position (``batch.starts()[i]`` + the context's length + j); the drafted
  token extends the context for step j + 1 (the row it moves to is precomputed per
  candidate slot, as the greedy path's successor is for the first).
* **The vocabulary** that ``from_counts`` pads from is the drafter's: the model's
  ``vocab_size`` (its largest token id + 1), at least ``TOP`` (32), so a small or empty
  model still has 32 distinct ids. Pads are the smallest ids that are not candidates.
* **Margins** (when asked) are the greedy path's for the step's context: the gap
  between the two largest stored counts over the context's total, whatever the
  temperature and whichever token was drawn.

An entry whose context is unseen (or shorter than the order) stops there, as in the
greedy path: its count is the drafts made so far, and the result is zero past it.
Loops run over draft steps (and, once per model, over the ``top`` candidate slots; per
step, over the round's distinct temperatures), never over entries.

**Distributions are tables.** A row's distribution at a temperature never changes, so
each temperature met keeps a table of them over the model's rows, filled as rows are
met (:class:`Tables`); a step gathers its rows' distributions, computing only rows met
for the first time. At most ``TABLES`` temperatures are kept (the least recently used
dropped), and only for a model whose tables fit ``TABLE_BYTES`` all together; a model
too large, or a step with more distinct temperatures than that, computes each step's
distributions as they come. Gathered or computed, they are the same arrays.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .contract import DraftBatch, DraftResult, sampling_inputs
from .sampling import TOP, from_counts, pick, uniform_u32

TABLES = 8  # temperatures whose distribution tables a model keeps
TABLE_BYTES = 64 << 20  # the most all of a model's tables may take: rows x TABLES x ROW_BYTES
ROW_BYTES = TOP * 6 + 1  # a row's ids (i32), weights (u16) and filled flag


class Tables:
    """Per temperature, every model row's distribution once met (module docstring):
    ``get(rows, temperature, compute)`` -> (ids [m, TOP], weights [m, TOP])."""

    def __init__(self, rows: int):
        self.rows = rows
        self.by_temperature: OrderedDict[float, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

    def get(self, rows: np.ndarray, temperature: float, compute) -> tuple[np.ndarray, np.ndarray]:
        table = self.by_temperature.get(temperature)
        if table is None:
            if len(self.by_temperature) >= TABLES:
                self.by_temperature.popitem(last=False)
            shape = (self.rows, TOP)
            table = (np.zeros(self.rows, bool), np.zeros(shape, np.int32), np.zeros(shape, np.uint16))
            self.by_temperature[temperature] = table
        self.by_temperature.move_to_end(temperature)
        filled, ids, weights = table
        met = np.zeros(self.rows, bool)  # (not np.unique: its first call imports for 50 ms)
        met[rows] = True
        new = np.flatnonzero(met & ~filled)
        if new.size:
            ids[new], weights[new] = compute(new)
            filled[new] = True  # after the rows it vouches for
        return ids[rows], weights[rows]


def draft_sampled(model, batch: DraftBatch) -> DraftResult:
    """A sampled round's drafts from ``model`` (a :class:`~.markov.MarkovModel`, not
    imported here: :mod:`.markov` imports this module) by the module docstring's rule.

    Returns: a :class:`DraftResult` with ``tokens`` [n, width] int32, ``counts`` [n]
    int32, ``margins`` [n, width] float32 (None unless ``batch.want_margin``), ``q_ids``
    [n, width, 32] int32 and ``q_weights`` [n, width, 32] uint16, zeros past counts.

    Raises:
        ValueError: naming ``temperature`` or ``seed`` (missing, wrong shape, or a
            temperature that is negative or not finite).
    """
    n, width = len(batch), batch.width
    temperature, seed = sampling_inputs(batch)
    a = model.tables()
    cand, cnt, succ = a.sampled or _candidates(model, a)
    vocab = max(model.vocab_size, TOP)
    row = _context_rows(model, a, batch)
    n_out = np.asarray(batch.n_out)
    position = batch.starts() + np.diff(np.asarray(batch.offsets, np.int64))
    u32 = uniform_u32(seed[:, None], position[:, None] + np.arange(width), np.arange(width)).T  # [width, n]
    tokens = np.zeros((width, n), np.int32)  # step-major while drafting
    q_ids = np.zeros((width, n, TOP), np.int32)
    q_weights = np.zeros((width, n, TOP), np.uint16)
    margins = np.zeros((width, n), np.float32)
    counts = np.zeros(n, np.int32)
    for j in range(width):  # one pass per draft step, all live entries
        live = np.flatnonzero((row != a.none) & (j < n_out))
        if live.size == 0:
            break
        r = row[live]
        ids, weights = _distributions(a, cand, cnt, r, temperature[live], vocab)
        drawn = pick(ids, weights, u32[j, live])
        # The drawn token's candidate slot: it is a live candidate (weight > 0 only there).
        # Rows are gathered for live entries only (row != none), so no sentinel row.
        slot = np.argmax((cand[r] == drawn[:, None]) & (cnt[r] > 0), axis=1)
        tokens[j, live], q_ids[j, live], q_weights[j, live] = drawn, ids, weights
        margins[j, live] = a.margin[r]
        counts[live] += 1
        row = np.full(n, a.none, np.int64)
        row[live] = succ[r, slot]
    return DraftResult(
        tokens.T,
        counts,
        margins.T if batch.want_margin else None,
        q_ids.transpose(1, 0, 2),
        q_weights.transpose(1, 0, 2),
    )


def _distributions(a, cand, cnt, r, temperature, vocab) -> tuple[np.ndarray, np.ndarray]:
    """``from_counts`` of rows ``r`` at ``temperature`` [m]: from the model's tables
    (:class:`Tables`, kept on ``a``) when it has them and the step's distinct
    temperatures fit, else computed."""
    kinds = np.sort(temperature)
    kinds = kinds[np.append(True, kinds[1:] != kinds[:-1])]  # the distinct temperatures
    if a.none * TABLES * ROW_BYTES > TABLE_BYTES or len(kinds) > TABLES:
        return from_counts(cand[r], cnt[r], temperature, vocab)
    if a.dists is None:
        a.dists = Tables(a.none)
    ids, weights = np.empty((len(r), TOP), np.int32), np.empty((len(r), TOP), np.uint16)
    for t in kinds:  # the round's distinct temperatures (one, usually)
        at = np.flatnonzero(temperature == t)
        ids[at], weights[at] = a.dists.get(
            r[at], float(t), lambda new, t=t: from_counts(cand[new], cnt[new], np.full(len(new), t, np.float32), vocab)
        )
    return ids, weights


def _context_rows(model, a, batch: DraftBatch) -> np.ndarray:
    """[n] int64: each entry's context row (its last ``order`` tokens), ``a.none`` when
    unseen or shorter than the order (as in :meth:`MarkovModel.draft_batch`)."""
    k = model.order
    offsets = np.asarray(batch.offsets, np.int64)
    tokens = np.asarray(batch.tokens)
    if len(tokens) < k:  # every context is short; keep the gathers in bounds
        tokens = np.zeros(k, np.int32)
    ends = offsets[1:]
    short = (ends - offsets[:-1]) < k  # a short entry's columns are junk, marked unseen
    return a.find([tokens[ends - (k - j)] for j in range(k)], short)


def _candidates(model, a) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``a``: the stored next tokens ([rows, top] int32, a view of the cache
    bytes: the records are the file's tail), their counts ([rows, top] uint32, a view, 0
    in unused slots) and the row each leads to ([rows, top], int32 when the rows allow,
    ``a.none`` when unseen or unused: the one table built, kept on ``a``)."""
    k, top = model.order, model.top
    data = model.to_bytes()
    rec_words = k + 2 * top + 1  # context, (token, count) pairs, total
    words = np.frombuffer(data, "<i4", offset=len(data) - 4 * rec_words * a.none).reshape(-1, rec_words)
    cand = words[:, k : k + 2 * top : 2]
    cnt = words[:, k + 1 : k + 2 * top : 2].view("<u4")
    succ = np.empty((a.none, top), np.int32 if a.none < 2**31 else np.int64)
    shifted = [words[:, j] for j in range(1, k)]  # each context without its oldest token
    for s in range(top):  # once per model, over the candidate slots
        succ[:, s] = a.find(shifted + [cand[:, s]])
    succ[cnt == 0] = a.none
    a.sampled = (cand, cnt, succ)
    return a.sampled

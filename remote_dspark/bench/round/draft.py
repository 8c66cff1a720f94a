"""``bench round``'s ``draft`` row: the worker's drafting call alone, on the contexts a
steady round's drafter sees."""

from __future__ import annotations

import time

from .feeder import synthetic_text
from .options import CONTEXT_TOKENS, DRAFT_BATCHES, SAMPLED_TEMPERATURE, RoundOptions
from .report import RoundRow


def draft_row(opts: RoundOptions, slots: int, sampled: bool = False) -> RoundRow:
    """``MarkovDrafter(builtin_model()).draft_batch`` (or the built-in model drafter's,
    ``--drafter lm``: no cache, every context encoded) on ``slots`` contexts of 64 tokens,
    rotating through DRAFT_BATCHES batches of different contexts (``sampled``: at
    temperature 1, a seed per entry)."""
    import numpy as np

    from ...drafter.contract import DraftBatch
    from ...drafter.markov import MarkovDrafter, builtin_model

    if opts.drafter == "lm":
        from ...drafter.lm import builtin_drafter

        drafter = builtin_drafter()
    else:
        drafter = MarkovDrafter(builtin_model())
    text = np.asarray(synthetic_text(2), dtype=np.int32)
    rng = np.random.default_rng(2)
    k, n = opts.num_spec, slots
    offsets = np.arange(0, (n + 1) * CONTEXT_TOKENS, CONTEXT_TOKENS, dtype=np.int64)
    rows = np.zeros((n, opts.row_bytes), dtype=np.uint8)
    n_out = np.full(n, k, dtype=np.int32)
    sampling = {}
    if sampled:
        sampling = {"temperature": np.full(n, SAMPLED_TEMPERATURE, np.float32), "seed": np.arange(n, dtype=np.uint64)}
    batches = []
    for _ in range(DRAFT_BATCHES):
        start = rng.integers(0, len(text), n, dtype=np.int64)
        at = (start[:, None] + np.arange(CONTEXT_TOKENS, dtype=np.int64)[None, :]).ravel() % len(text)
        batches.append(
            DraftBatch(
                tokens=np.ascontiguousarray(text[at]),
                offsets=offsets,
                n_out=n_out,
                rows=rows,
                want_margin=False,
                width=k,
                **sampling,
            )
        )
    rounds = opts.rounds_for(slots)
    lat = []
    for i in range(opts.warmup + rounds):
        b = batches[i % DRAFT_BATCHES]
        t0 = time.perf_counter_ns()
        drafter.draft_batch(b)
        t1 = time.perf_counter_ns()
        if i >= opts.warmup:
            lat.append(t1 - t0)
    return RoundRow("draft", slots, rounds, lat, sampled=sampled)

"""A drafter's answer held to the contract before it goes on the wire
(:func:`check_result`): shapes, counts, zeros past them, and a sampled round's
distributions held to the sampling rule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .contract import DraftBatch, DraftResult

if TYPE_CHECKING:
    import numpy as np


def check_result(result: DraftResult, batch: DraftBatch) -> DraftResult:
    """The drafter's answer, held to the contract: shapes checked; counts clamped to
    0..n_out; tokens and margins zeroed past counts (so a sloppy drafter cannot put
    junk on the wire). Margins are None unless the batch asked for them, and present
    when it did (zeros from a drafter that has none to give: the engine refuses a reply
    whose margins section is not what it asked for).

    Raises:
        ValueError: naming the field whose shape is wrong.
    """
    import numpy as np

    n, width = len(batch), batch.width
    tokens, counts, margins = np.asarray(result.tokens), np.asarray(result.counts), result.margins
    if tokens.shape != (n, width):
        raise ValueError(f"drafter result tokens: shape {tokens.shape}, expected {(n, width)}")
    if counts.shape != (n,):
        raise ValueError(f"drafter result counts: shape {counts.shape}, expected {(n,)}")
    counts = np.minimum(np.maximum(counts, 0), batch.n_out).astype(np.int32, copy=False)  # (np.clip: slower)
    # Every entry drafted whole (common): nothing to zero. Either way a copy, never the
    # drafter's own memory, which its next call may reuse before the reply is written.
    live = None if n == 0 or counts.min() == width else np.arange(width, dtype=np.int32) < counts[:, None]

    def kept(a, dtype):
        return np.array(a, dtype) if live is None else np.where(live, a, 0).astype(dtype, copy=False)

    tokens = kept(tokens, np.int32)
    if batch.want_margin and margins is not None:
        margins = np.asarray(margins)
        if margins.shape != (n, width):
            raise ValueError(f"drafter result margins: shape {margins.shape}, expected {(n, width)}")
        margins = kept(margins, np.float32)
    elif batch.want_margin:
        margins = np.zeros((n, width), np.float32)
    else:
        margins = None
    if not batch.sampled:
        return DraftResult(tokens, counts, margins)
    return DraftResult(tokens, counts, margins, *_checked_distributions(result, batch, tokens, live))


def _checked_distributions(result: DraftResult, batch: DraftBatch, tokens, live) -> tuple[np.ndarray, np.ndarray]:
    """A sampled round's ``q_ids``, ``q_weights`` (``live``: [n, width] the drafted
    positions; None: all): shapes checked, zeroed past counts, and
    held to :func:`remote_dspark.drafter.sampling.check_sampled` at drafted positions,
    any id >= 0 (a drafter that breaks it fails its round: the engine would refuse the
    reply; the engine also holds the ids to its vocabulary). Not the pick: the engine
    checks it, and redoing rule 1's hash here would cost the worker as much again per
    round (0.4 ms at 256 x 5 on a 2-core machine); the drafters' tests hold it."""
    import numpy as np

    from .sampling import TOP, check_sampled

    n, width = len(batch), batch.width
    for name in ("q_ids", "q_weights"):
        got = getattr(result, name)
        if got is None or np.shape(got) != (n, width, TOP):
            want = (n, width, TOP)
            raise ValueError(f"drafter result {name}: shape {np.shape(got)}, expected {want} (a sampled round)")
    if live is None or live.all():  # every position drafted (the common round): nothing to zero or to mask
        ids = np.array(result.q_ids, np.int32)  # copies, as check_result's: never the drafter's memory
        weights = np.array(result.q_weights, np.uint16)
        drafted = (ids.reshape(-1, TOP), weights.reshape(-1, TOP), np.asarray(tokens).reshape(-1))
    else:
        ids = np.where(live[..., None], result.q_ids, 0).astype(np.int32, copy=False)
        weights = np.where(live[..., None], result.q_weights, 0).astype(np.uint16, copy=False)
        drafted = (ids[live], weights[live], tokens[live])
    why = check_sampled(*drafted, np.iinfo(np.int32).max)  # the engine holds them to its vocabulary
    if why is not None:
        raise ValueError(f"drafter result distributions: {why}")
    return ids, weights

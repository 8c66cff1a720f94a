"""The engine's answer to a round, ``Drafts`` (``round()``'s) and ``Launched``
(``launch()``'s, on the stream), and the one copy per array that makes drafts from an
answer's arrays (views of a drafts slot or of a DRAFTS payload).

No function here loops over entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ... import wire
from ...outcome import Outcome


@dataclass
class Drafts:
    """A round's drafts as the engine gets them. With sampled drafts
    (``VLLM_DSPARK_SAMPLED_TOP32=1``) each drafted position also carries the distribution
    its draft was drawn from: ``q(q_ids[i, j, m]) = q_weights[i, j, m] / 65535``, the
    weights of a drafted position summing to exactly 65535; what
    :func:`remote_dspark.engine.sampler.rejection_sample` takes as they are."""

    tokens: torch.Tensor  # [n, num_spec] int32, zero past counts
    counts: torch.Tensor  # [n] int32
    margins: torch.Tensor | None  # [n, num_spec] float32, when asked for
    source: str  # "remote", "local" or "none" (target-only)
    outcome: Outcome  # the remote round's outcome
    resync: tuple[int, ...] = ()  # slots the drafter lost: send them with NEW_GEN
    resync_all: bool = False  # a new proxy/connection: re-announce every slot
    q_ids: torch.Tensor | None = None  # [n, num_spec, 32] int32, zero past counts: sampled drafts'
    q_weights: torch.Tensor | None = None  # [n, num_spec, 32] uint16, zero past counts: sampled drafts'
    # (entries with drafts, their tokens) where the path summed them already (the host
    # round's C answer); None: the engine counts them from ``counts``.
    sums: tuple[int, int] | None = None
    # The round's slots whose context is still being announced in chunks (a long NEW_GEN
    # context over a round's tokens, :mod:`.announce`): their counts are 0 until it is whole.
    announcing: tuple[int, ...] = ()


class Launched:
    """A round enqueued on the stream (see ``RemoteDSpark.launch``)."""

    __slots__ = (
        "round", "tokens", "counts", "resync", "resync_all", "q_ids", "q_weights", "outcome", "resync_mask",
        "announcing", "announcing_mask",
    )  # fmt: skip

    def __init__(
        self,
        round_id: int | None,
        tokens: torch.Tensor,
        counts: torch.Tensor,
        resync: tuple[int, ...] | None,
        resync_all: bool | None,
        q_ids: torch.Tensor | None = None,
        q_weights: torch.Tensor | None = None,
        outcome: torch.Tensor | None = None,
        resync_mask: torch.Tensor | None = None,
        announcing: tuple[int, ...] | None = (),
        announcing_mask: torch.Tensor | None = None,
    ):
        self.round = round_id  # 0: not sent (no proxy serving): zero drafts
        self.tokens = tokens  # [n, num_spec] int32 on the device; zero past counts
        self.counts = counts  # [n] int32 on the device
        self.resync = resync  # slots lost by the worker in earlier rounds
        self.resync_all = resync_all  # a new proxy: every slot must be re-announced
        self.q_ids = q_ids  # a sampled engine's: [n, num_spec, 32] int32 on the device; zero past counts
        self.q_weights = q_weights  # a sampled engine's: [n, num_spec, 32] uint16 on the device; zero past counts
        # With a tp_group (engine.tp.launch), on every rank, in stream order: the round's
        # Outcome value (int32 [1]), resync as a mask (bool [max_slots]; all set with
        # resync_all) and the slots still being announced as a mask (bool [max_slots]).
        # A rank other than 0 has only these: its round, resync, resync_all and announcing are None.
        self.outcome = outcome
        self.resync_mask = resync_mask
        # The slots still being announced, bool [max_slots] in stream order: always given
        # for a launch of device metadata (then ``announcing`` is None), and with a tp_group.
        self.announcing_mask = announcing_mask
        # As Drafts.announcing, for host metadata (None: not read on the host; the mask says it)
        self.announcing = announcing


def round_tensors(n: int, k: int, sampled: bool, device) -> tuple[torch.Tensor, ...]:
    """A launched round's answer tensors for ``n`` entries, uninitialised, on ``device``:
    ``tokens`` [n, k] and ``counts`` [n] int32, and a sampled engine's ``q_ids`` (int32)
    and ``q_weights`` (uint16) [n, k, 32]."""
    out = (torch.empty(n, k, dtype=torch.int32, device=device), torch.empty(n, dtype=torch.int32, device=device))
    if not sampled:
        return out
    q = (n, k, wire.SAMPLED_TOP)
    return out + (torch.empty(q, dtype=torch.int32, device=device), torch.empty(q, dtype=torch.uint16, device=device))


def empty_drafts(n: int, k: int, outcome: Outcome, margins: bool, sampled: bool = False) -> Drafts:
    q = (lambda dtype: torch.zeros(n, k, wire.SAMPLED_TOP, dtype=dtype)) if sampled else (lambda dtype: None)
    return Drafts(
        torch.zeros(n, k, dtype=torch.int32),
        torch.zeros(n, dtype=torch.int32),
        torch.zeros(n, k, dtype=torch.float32) if margins else None,
        "none",
        outcome,
        q_ids=q(torch.int32),
        q_weights=q(torch.uint16),
    )


def one_hot_q(tokens: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distributions of deterministic drafts (a local drafter's, in a sampled
    engine): all of each drafted position's weight on its draft, listed first, the other
    ids the smallest not equal to it with weight 0 (the rule's padding), zeros past
    counts. Exact for the sampler: a draft that was certain has q = 1 at it."""
    n, k = tokens.shape
    top = wire.SAMPLED_TOP
    t = tokens.to(torch.int32).unsqueeze(-1)
    pad = torch.arange(top - 1, dtype=torch.int32, device=tokens.device).expand(n, k, top - 1)
    ids = torch.cat((t, pad + (pad >= t).to(torch.int32)), dim=-1)  # 0.. skipping the draft
    weights = torch.zeros(n, k, top, dtype=torch.int32, device=tokens.device)
    weights[..., 0] = wire.SAMPLED_TOTAL
    live = (torch.arange(k, device=tokens.device) < counts.to(torch.int64).unsqueeze(1)).unsqueeze(-1)
    return ids * live, (weights * live).to(torch.uint16)


def to_drafts(
    k: int,
    slots: np.ndarray,
    counts: np.ndarray,
    statuses: np.ndarray,
    tokens: np.ndarray,
    margins: np.ndarray | None,
    outcome: Outcome,
    want_margin: bool,
    *,
    clean: bool = False,
    q: tuple[np.ndarray, np.ndarray] | None = None,
) -> Drafts:
    """``Drafts`` from an answer's arrays (views of a drafts slot or of a DRAFTS payload):
    ``counts``/``statuses`` [n], ``tokens``/``margins`` [n, width <= k], and a sampled
    answer's ``q`` (ids, weights) [n, width, 32]. One copy per array; everything past
    each count is zeroed whatever the source held there, unless ``clean`` says the
    source already holds zeros there (a drafts slot the proxy filled: ``hf_unpack``
    zeroes each row past its count); RESYNC slots come from the status mask, computed
    only when there is one."""
    n, width = tokens.shape
    full = clean or not n or counts.min() == width  # nothing past a count to clear
    live = None if full else np.arange(width) < counts[:, None]

    def widened(src: np.ndarray | None, dtype, tail: tuple[int, ...] = ()) -> np.ndarray:
        if src is not None and full and width == k:
            return np.array(src, dtype=dtype)  # the common case: one copy
        out = np.zeros((n, k) + tail, dtype=dtype)
        if src is not None:
            where = True if full else live.reshape(live.shape + (1,) * len(tail))
            np.copyto(out[:, :width], src, where=where)
        return out

    tok = widened(tokens, np.int32)
    mar = widened(margins, np.float32) if want_margin else None
    top = (wire.SAMPLED_TOP,)
    q_ids, q_weights = (None, None) if q is None else (widened(q[0], np.int32, top), widened(q[1], np.uint16, top))
    lost = slots[statuses == wire.STATUS_RESYNC].tolist() if statuses.any() else ()
    return Drafts(
        torch.from_numpy(tok),
        torch.from_numpy(counts.astype(np.int32)),
        None if mar is None else torch.from_numpy(mar),
        "remote",
        outcome,
        tuple(lost),
        q_ids=None if q_ids is None else torch.from_numpy(q_ids),
        q_weights=None if q_weights is None else torch.from_numpy(q_weights),
    )

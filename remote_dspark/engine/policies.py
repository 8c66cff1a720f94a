"""The three policies' answer to a round: which drafts the engine gets (``POLICY``), and
the shadow policy's comparison of the remote drafts with the local ones."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config.api import RemoteConfig
from ..outcome import Outcome
from .lifecycle import RemoteRoundFailed
from .observe.stats import EngineCounts
from .values.drafts import Drafts, one_hot_q

Local = tuple[torch.Tensor, torch.Tensor]  # the local drafter's (tokens [n, k], counts [n])


def choose(
    cfg: RemoteConfig,
    counts: EngineCounts,
    num_spec: int,
    remote: Drafts,
    local: Local | None,
    draft_locally: Callable[[], Local],
) -> Drafts:
    """The drafts the engine gets for a round whose remote answer is ``remote``:

    * shadow: the local drafts (``local``, drafted before the round), compared with the
      remote ones when those came; the remote ones instead with ``SHADOW_USE=remote``;
    * resilience: the remote drafts, or the local drafter's when the round failed;
    * capacity: the remote drafts (target-only when it failed), or RemoteRoundFailed
      with ``ON_FAIL=raise``.
    """
    ok = remote.outcome is Outcome.OK
    if cfg.policy == "shadow":
        if ok:
            compare(counts, num_spec, local, remote)
        return remote if ok and cfg.shadow_use == "remote" else local_drafts(local, remote)
    if cfg.policy == "resilience":
        return remote if ok else local_drafts(draft_locally(), remote)
    if not ok and cfg.on_fail == "raise":
        raise RemoteRoundFailed(f"remote round failed: {remote.outcome.label}")
    return remote


def local_drafts(local: Local, remote: Drafts) -> Drafts:
    """The local drafter's drafts, with the round's remote facts. In a sampled engine
    (the remote answer has distributions, if only empty ones) they carry one-hot q: a
    local drafter's drafts are deterministic, so q is 1 at each draft, which keeps the
    engine's sampler exact."""
    tokens, counts = local
    tokens, counts = tokens.to(torch.int32), counts.to(torch.int32)
    q_ids, q_weights = one_hot_q(tokens, counts) if remote.q_ids is not None else (None, None)
    return Drafts(
        tokens,
        counts,
        None,
        "local",
        remote.outcome,
        remote.resync,
        remote.resync_all,
        q_ids=q_ids,
        announcing=remote.announcing,
        q_weights=q_weights,
    )


def compare(counts: EngineCounts, num_spec: int, local: Local, remote: Drafts) -> None:
    """Shadow statistics: per position, does the remote draft equal the local one (where
    both drafted that far); and the remote's margins. With sampled drafts the remote
    draft compared is the one drawn (at its entry's temperature; the argmax at 0), so
    agreement there measures how often the local drafter names the drawn token."""
    ltok, lcnt = local
    both = torch.minimum(lcnt.to(torch.int32), remote.counts)
    same = ltok.to(torch.int32) == remote.tokens
    live = torch.arange(num_spec).unsqueeze(0) < both.unsqueeze(1)
    counts.add_at(counts.shadow_compared_at, live.sum(0).numpy())
    counts.add_at(counts.shadow_agree_at, (same & live).sum(0).numpy())
    if remote.margins is not None:
        drafted = torch.arange(num_spec).unsqueeze(0) < remote.counts.unsqueeze(1)
        counts.margins(remote.margins[drafted].numpy())

"""The three policies' answer to a round: which drafts the engine gets (``POLICY``), and
the shadow policy's comparison of the remote drafts with the local ones."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config.api import RemoteConfig
from ..outcome import Outcome
from .batch import Drafts
from .lifecycle import RemoteRoundFailed
from .stats import EngineCounts

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
    tokens, counts = local
    return Drafts(
        tokens.to(torch.int32),
        counts.to(torch.int32),
        None,
        "local",
        remote.outcome,
        remote.resync,
        remote.resync_all,
    )


def compare(counts: EngineCounts, num_spec: int, local: Local, remote: Drafts) -> None:
    """Shadow statistics: per position, does the remote draft equal the local one (where
    both drafted that far); and the remote's margins."""
    ltok, lcnt = local
    both = torch.minimum(lcnt.to(torch.int32), remote.counts)
    same = ltok.to(torch.int32) == remote.tokens
    live = torch.arange(num_spec).unsqueeze(0) < both.unsqueeze(1)
    counts.add_at(counts.shadow_compared_at, live.sum(0).numpy())
    counts.add_at(counts.shadow_agree_at, (same & live).sum(0).numpy())
    if remote.margins is not None:
        drafted = torch.arange(num_spec).unsqueeze(0) < remote.counts.unsqueeze(1)
        counts.margins(remote.margins[drafted].numpy())

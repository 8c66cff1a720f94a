"""What a drafter reports of its state, for the worker's metrics (the contract's optional
``cache_info()`` and ``spec_info()``: :mod:`remote_dspark.drafter.contract`), and how the
worker reads them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheInfo:
    """A drafter's per-slot state, for the worker's metrics (optional ``cache_info()``)."""

    slots: int  # streams with cached state now
    capacity: int  # the most streams it keeps (the least recently used is dropped beyond)
    bytes: int  # memory the cache holds
    hits: int  # entries drafted from cached state (monotonic)
    misses: int  # entries that encoded their whole context (monotonic)
    blocks_used: int = 0  # a paged KV's blocks holding streams now
    blocks_free: int = 0  # and free
    evicted: int = 0  # streams whose KV was evicted for room (monotonic)


@dataclass(frozen=True)
class SpecInfo:
    """A pre-drafting drafter's speculation cache, for the worker's metrics (optional
    ``spec_info()``: :mod:`remote_dspark.drafter.lm.speculate`). Counts are monotonic
    unless said otherwise."""

    outcomes: int  # outcomes pre-drafted
    hits: tuple[int, ...]  # stream entries answered from a pre-draft, by its outcome's rank (0: the likeliest)
    misses: int  # stream entries with pre-drafts that matched none of them
    dropped: int  # pre-drafted outcomes let go unused (a miss, a reclaim, a stream gone)
    seconds: float  # drafter seconds spent pre-drafting
    held: int  # pre-drafted outcomes waiting now
    blocks: int  # KV blocks the waiting pre-drafts hold now


def cache_info_of(drafter) -> CacheInfo | None:
    """``drafter.cache_info()`` when it keeps per-slot state, else None."""
    info = getattr(drafter, "cache_info", None)
    return info() if callable(info) else None


def spec_info_of(drafter) -> SpecInfo | None:
    """``drafter.spec_info()`` when it pre-drafts (its speculation cache), else None."""
    info = getattr(drafter, "spec_info", None)
    return info() if callable(info) else None


def predrafts_of(drafter) -> bool:
    """Whether ``drafter`` pre-drafts in the worker's idle time: it says so (``speculates``,
    an optional bool) and has ``predraft(max_entries, max_tokens) -> int`` (the outcomes it
    pre-drafted in one call, 0 when it had none to). A model drafter without
    ``--lm-speculate`` has the method but says no: its worker's drafter thread is not woken
    after every call for nothing."""
    return bool(getattr(drafter, "speculates", False)) and callable(getattr(drafter, "predraft", None))

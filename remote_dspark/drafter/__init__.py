"""Drafters as the worker calls them: the contract (:mod:`.contract`: one batched call
per round, arrays in and out; a stream's tokens beyond its context, :mod:`.streams`)
and the check of an answer against it (:mod:`.answer`), what a drafter reports of its
state (:mod:`.reports`),
the Markov drafter (:mod:`.markov`, its table's arrays :mod:`.markov_arrays`, its
sampled rounds :mod:`.markov_sampled`), the one
sampling rule every drafter follows (:mod:`.sampling`) and the torch model drafters
(:mod:`.lm`, imported only when one is asked for)."""

from .answer import check_result
from .contract import (
    BatchedDrafter,
    CacheInfo,
    DraftBatch,
    DraftResult,
    PerEntryDrafter,
    as_batched,
    cache_info_of,
    empty_result,
    vocab_size_of,
)
from .markov import MarkovDrafter, MarkovModel

__all__ = [
    "BatchedDrafter",
    "CacheInfo",
    "DraftBatch",
    "DraftResult",
    "MarkovDrafter",
    "MarkovModel",
    "PerEntryDrafter",
    "as_batched",
    "cache_info_of",
    "check_result",
    "empty_result",
    "vocab_size_of",
]

"""A round in the scheduler (:mod:`.scheduler`): the :class:`Job` a connection's round
becomes while it waits for the drafter, its lifecycle as one value (:data:`JobState`),
and the :class:`Piece` of it one call drafts.

A job is :class:`Pending` from its queueing (``taken`` grows as its pieces go into calls,
their drafts gathered in ``parts``) until it ends :class:`Answered` (its drafts, or None
when its deadline passed first) or :class:`Failed` (what its call raised, or the worker
stopping), and never changes again. The scheduler makes every change under its lock;
the job's ``done`` event is set with its end and wakes the connection waiting for it,
or, for a round no thread waits for (the hub's, :mod:`.hub`), its ``deliver`` is called
with it once the scheduler's lock is released.
(A round that finds the drafter free and is a call whole never enters the queue: no
other thread sees it, and the call's return is its end.)
The states are immutable tuples (each made in a fraction of a microsecond: a round's
path makes two), told apart by their type, never by comparing them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..drafter.contract import DraftBatch, DraftResult
from .batching import encode_piece


class Pending(NamedTuple):
    """Not answered yet: ``taken`` of its entries drafted or in the call being made (0:
    none yet; a round more than a call's share is taken in pieces), their drafts gathered
    in ``parts`` (None until the first piece is drafted), and ``encoded`` tokens of entry
    ``taken``'s encode done or in the call being made (an entry over a whole call is
    encoded in pieces: :class:`~.batching.Charge`)."""

    taken: int = 0
    parts: DraftResult | None = None
    encoded: int = 0


class Answered(NamedTuple):
    """Done: its drafts (None: its deadline passed before a piece was drafted)."""

    result: DraftResult | None


class Failed(NamedTuple):
    """Done: the call it was in raised ``error`` (or the worker stopped first)."""

    error: BaseException


# A job's lifecycle: Pending (taken grows, parts gathered) -> Answered | Failed, never back.
JobState = Pending | Answered | Failed


@dataclasses.dataclass(eq=False)
class Job:
    """One round waiting for the drafter. ``state`` is changed only under the scheduler's
    lock, and only while it is :class:`Pending`; ``done`` is set with the state that ends
    it (the waiting connection's wake-up)."""

    session: int
    batch: DraftBatch
    deadline: float  # the clock's seconds; math.inf: none
    # [n] int64: each entry's cost in a call's budget (Charge.costs), None until the
    # round is first taken (a model drafter is asked then, between calls)
    costs: np.ndarray | None
    queued: float  # the clock's seconds when it was queued
    state: JobState = Pending()
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    # None: a thread waits on ``done``; else called with the job once it ended (Answered
    # or Failed), outside the scheduler's lock, on the thread that ended it
    deliver: Callable[[Job], None] | None = None

    @property
    def cost(self) -> int:
        """The whole round's cost (its ``costs`` summed, once known)."""
        return int(self.costs.sum())

    def end(self, state: Answered | Failed) -> bool:
        """Under the scheduler's lock: done with ``state`` and its waiter woken (a job
        with a ``deliver`` has none: the caller calls it), unless it is done already (its
        first end stands). True when this call ended it."""
        if not isinstance(self.state, Pending):
            return False
        self.state = state
        if self.deliver is None:
            self.done.set()
        return True

    def piece(self, start: int, stop: int) -> DraftBatch:
        if start == 0 and stop == len(self.batch):
            return self.batch
        return self.batch.entries(start, stop)

    def outcome(self) -> DraftResult | None:
        """Once done: its drafts, or what its call raised."""
        state = self.state
        if isinstance(state, Failed):
            raise state.error
        assert isinstance(state, Answered), f"a job read while {state}"
        return state.result


class Piece(NamedTuple):
    """A round's entries in one call: ``batch`` is ``job``'s entries from ``start``;
    ``cost`` what they spend of the call's budget (their ``Job.costs``, less what earlier
    pieces encoded of entry ``start``: ``after``). ``partial``: a piece of entry
    ``start``'s encode only, no drafts to gather: ``batch`` is that entry, cut by
    ``cut`` tokens when drafted (:func:`~.batching.encode_piece`, which reads the worker's
    tokens: in the call, where what it raises fails that call only, never the queue)."""

    job: Job
    start: int
    batch: DraftBatch
    cost: int
    after: int = 0
    partial: bool = False
    cut: int = 0

    def drafted(self) -> DraftBatch:
        """The batch the drafter gets for this piece."""
        return encode_piece(self.batch, 0, self.cut) if self.partial else self.batch

"""The round path: the one interface ``RemoteDSpark`` holds its way to the remote drafter
by, whatever the mode. Its kinds:

    SyncPath      (sync_path)   ASYNC=0: the engine thread's own network round
    AsyncPath     (async_path)  ASYNC=1: the region's hand-off and the proxy host serving it
    FollowerPath  (ranks)       a tensor-parallel rank other than 0: rank 0's answers
    NothingOpen   (here)        before start(), or after a start that opened nothing
    RedrawPath    (redraw)      SAMPLED_REDRAW=1: wraps rank 0's path, its drafts redrawn
    AnnouncingPath (announcing) wraps the sending path: long contexts in chunks

Both wrappers extend :class:`Wrapping` (here), which passes every call on to the path it
wraps; each overrides only what it changes.

The facade picks the kind once (at start, by the mode) and from then on only calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ...supervisor.restarts import Supervisor
from ..lifecycle import Users, stop_in_caller
from ..observe.stats import LinkStats, PathStats
from ..values.batch import Batch
from ..values.drafts import Drafts, Launched


class Path(Protocol):
    users: Users  # the door and the count of threads inside; the last out frees the path

    @property
    def supervisor(self) -> Supervisor | None:
        """Process mode: the proxy's supervisor; else None."""

    @property
    def wait_cpu_s(self) -> float:
        """The engine thread's CPU seconds inside its waits for a round's release."""

    @property
    def acked_context(self) -> int:
        """The context tokens per slot the worker's HELLO_ACK named, for the connection
        the next round goes out on; 0 while none has (``Spec.context_cut``)."""

    @property
    def acked_round_tokens(self) -> int:
        """The most tokens a round may carry that the worker's HELLO_ACK named, for the
        connection the next round goes out on; 0 while none has (``Spec.round_budget``)."""

    def start(self) -> None:
        """Open what the path needs (a connection, the proxy); once, before any round."""

    def round(self, batch: Batch) -> Drafts:
        """The remote drafter's answer to ``batch`` (blocking)."""

    def launch(self, batch: Batch, answer: Callable[[Batch], Drafts], out=(), status=None) -> Launched:
        """``batch``'s round enqueued on the current stream (CUDA). A path that can only
        block runs ``answer`` (the facade's whole round, policy included) now and gives
        its drafts back completed, as a launch would. ``out`` and ``status``: where the
        answer and the outcome go (``Handoff.launch``), new tensors and nowhere when not given."""

    def stop(self, limit_s: float) -> None:
        """Closing: shut the door, stop what serves the path, answer every round in
        flight, and wait at most ``limit_s`` for the users to leave. The owner's leave,
        which frees the path once the last user is out, is the caller's."""

    def stats(self) -> PathStats:
        """The path's part of ``stats()``; the caller holds the path open."""


class NothingOpen:
    """A path that opens nothing of its own: the engine's before ``start()`` and after a
    start that failed before opening one. It takes no round: the facade lets rounds in
    only once started."""

    supervisor: Supervisor | None = None
    wait_cpu_s = 0.0
    acked_context = acked_round_tokens = 0  # no HELLO_ACK here

    def __init__(self) -> None:
        self.users = Users(lambda: None)

    def start(self) -> None:
        """Nothing to open."""

    def round(self, batch: Batch) -> Drafts:
        raise RuntimeError("no path to the remote drafter is open")

    def launch(self, batch: Batch, answer: Callable[[Batch], Drafts], out=(), status=None) -> Launched:
        raise RuntimeError("no path to the remote drafter is open")

    def stop(self, limit_s: float) -> None:
        stop_in_caller(self.users, lambda: None, limit_s)

    def stats(self) -> PathStats:
        return PathStats(LinkStats.none())


class Wrapping:
    """A path around ``inner``: every call goes to it as it is (a wrapper overrides what
    it changes); the users are ``inner``'s, so the facade's accounting is the same."""

    def __init__(self, inner: Path):
        self.inner = inner
        self.users = inner.users

    wait_cpu_s = property(lambda self: self.inner.wait_cpu_s)
    acked_context = property(lambda self: self.inner.acked_context)
    acked_round_tokens = property(lambda self: self.inner.acked_round_tokens)

    @property
    def supervisor(self) -> Supervisor | None:
        return self.inner.supervisor

    def start(self) -> None:
        self.inner.start()

    def round(self, batch: Batch) -> Drafts:
        return self.inner.round(batch)

    def launch(self, batch: Batch, answer: Callable[[Batch], Drafts], out=(), status=None) -> Launched:
        return self.inner.launch(batch, answer, out, status)

    def stop(self, limit_s: float) -> None:
        self.inner.stop(limit_s)

    def stats(self) -> PathStats:
        return self.inner.stats()

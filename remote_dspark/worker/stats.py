"""The worker's counters and its health, as :class:`~remote_dspark.worker.Worker` keeps them.

:class:`WorkerStats` is the one owner of every number the worker counts: its stop line,
``remote-dspark worker --metrics-port`` (:mod:`~remote_dspark.worker.metrics`, read at
scrape time) and the tests all read these fields, and nothing counts them twice. The
round path adds to it under the worker's one lock: a few integer additions and, per
round, one fixed-bucket observation into each histogram (no per-entry work).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..histogram import HistogramCounter

# Why a HELLO was refused, each refusal counted once under one (low cardinality: the
# metrics' ``reason`` label): the drafter or Markov identity differs, the drafter's
# vocabulary is over the engine's, the HELLO is beyond this worker's limits, another
# protocol version, busy (no served connection or no engine place free), or auth (the
# worker has a key and the engine did not prove it holds it).
REFUSAL_REASONS = ("drafter", "markov", "vocab", "limits", "version", "busy", "auth")


COUNT_BOUNDS = tuple(float(1 << i) for i in range(13))  # 1, 2, 4 ... 4096: rounds or entries a drafter call
TOKEN_BOUNDS = tuple(float(1 << i) for i in range(4, 17))  # 16 ... 65536: tokens a drafter call


@dataclass
class WorkerStats:
    """The worker's counters: their one owner (``stop``'s line, :mod:`.metrics` and the
    tests read them). Written under ``Worker._lock``; read a consistent copy with
    :meth:`Worker.statistics`."""

    connections: int = 0  # connections served (a whole HELLO given a thread)
    refusals: dict = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))  # HELLOs refused, by reason
    evicted: int = 0  # sessions evicted for a newcomer, from a place or a connection (idle >= recent_s)
    bad_frames: int = 0  # connections dropped for a frame that breaks the contract
    stalled: int = 0  # connections dropped for a frame not whole within frame_timeout_s
    round_failures: int = 0  # connections dropped because drafting (or answering) a round raised
    hello_timeouts: int = 0  # connections dropped for no HELLO within hello_timeout_s
    displaced: int = 0  # pre-HELLO connections dropped to make room for a newer one
    rounds: int = 0
    pings: int = 0  # PINGs answered on the connections' own threads (Worker.statistics adds the hub's)
    entries: int = 0
    resyncs: int = 0
    beyond_positions: int = 0  # entries given no drafts: their context and width pass the model's positions
    expired: int = 0  # rounds answered with no drafts: the drafter could not draft them before their deadline
    drafter_calls: int = 0  # draft_batch calls (a call may draft several engines' rounds)
    encode_pieces: int = 0  # pieces of an over-budget entry's encode (one a call, per entry)
    encode_piece_tokens: int = 0  # their tokens (each piece's share of its call's budget)
    draft_tokens: int = 0
    drafter_cpu_seconds: float = 0.0  # CPU of the drafter's calls on the thread that made each (its host work)
    # the worker's time from a ROUND in to its DRAFTS sent (not a served round's wait for its rows)
    round_seconds: HistogramCounter = field(default_factory=HistogramCounter)
    drafting_seconds: HistogramCounter = field(default_factory=HistogramCounter)  # inside draft_batch, per call
    queue_seconds: HistogramCounter = field(default_factory=HistogramCounter)  # a round's wait for the drafter
    call_rounds: HistogramCounter = field(default_factory=lambda: HistogramCounter(COUNT_BOUNDS))  # rounds a call
    call_entries: HistogramCounter = field(default_factory=lambda: HistogramCounter(COUNT_BOUNDS))  # entries a call
    call_tokens: HistogramCounter = field(default_factory=lambda: HistogramCounter(TOKEN_BOUNDS))  # tokens a call

    @property
    def refused(self) -> int:
        """HELLOs refused for anything but busy: identities, vocabulary, limits, version, auth."""
        return sum(n for reason, n in self.refusals.items() if reason != "busy")

    @property
    def busy(self) -> int:
        """HELLOs refused busy."""
        return self.refusals["busy"]

    def add_round(self, told) -> None:
        """What one answered round adds (:class:`~remote_dspark.worker.round.Told`, or
        anything with its fields)."""
        self.add_rounds(1, told.entries, told.resyncs, told.beyond_positions, told.draft_tokens, told.expired)

    def add_rounds(
        self, rounds: int, entries: int, resyncs: int, beyond_positions: int, draft_tokens: int, expired: int = 0
    ) -> None:
        """What ``rounds`` answered rounds add, their facts summed (a call of whole rounds)."""
        self.rounds += rounds
        self.entries += entries
        self.resyncs += resyncs
        self.beyond_positions += beyond_positions
        self.draft_tokens += draft_tokens
        self.expired += expired

    def add_served(self, s, sent: bool = True) -> None:
        """What one round served in C adds (``hf_serve``'s facts, :mod:`.lane`): the round,
        its drafting as a call of one round that never queued, and, when its reply was
        ``sent``, its time (the Python loop's rule)."""
        self.add_round(s)
        if sent:
            self.round_seconds.observe(s.round_ns / 1e9)
        if s.drafted:
            # drafted in C on the connection's own thread, CPU-bound: its time is its CPU
            self.add_call(s.drafting_ns / 1e9, 1, s.drafted, s.call_tokens, [0.0], cpu_seconds=s.drafting_ns / 1e9)

    def add_call(
        self,
        seconds: float,
        rounds: int,
        entries: int,
        tokens: int,
        waits: list[float],
        pieces: int = 0,
        piece_tokens: int = 0,
        cpu_seconds: float = 0.0,
    ) -> None:
        """What one drafter call adds: it drafted ``rounds`` rounds (or pieces; ``entries``
        entries, ``tokens`` tokens, of them ``pieces`` pieces of an over-budget entry's
        encode of ``piece_tokens`` tokens) in ``seconds``, ``cpu_seconds`` of them the CPU
        of the thread that made it, the rounds it began after ``waits`` seconds in the
        scheduler's queue."""
        self.drafter_calls += 1
        self.drafter_cpu_seconds += cpu_seconds
        self.encode_pieces += pieces
        self.encode_piece_tokens += piece_tokens
        self.drafting_seconds.observe(seconds)
        self.call_rounds.observe(rounds)
        self.call_entries.observe(entries)
        self.call_tokens.observe(tokens)
        for wait in waits:
            self.queue_seconds.observe(wait)

    def copy(self) -> WorkerStats:
        """A copy that shares nothing mutable (the histograms as counters of their own)."""

        def hist(h: HistogramCounter) -> HistogramCounter:
            c = HistogramCounter(h.bounds)
            c.buckets[:], c.sum = h.buckets, h.sum
            return c

        return replace(
            self,
            refusals=dict(self.refusals),
            round_seconds=hist(self.round_seconds),
            drafting_seconds=hist(self.drafting_seconds),
            queue_seconds=hist(self.queue_seconds),
            call_rounds=hist(self.call_rounds),
            call_entries=hist(self.call_entries),
            call_tokens=hist(self.call_tokens),
        )


@dataclass(frozen=True)
class Health:
    """What ``/healthz`` and ``/readyz`` answer (:mod:`.metrics`), each key named for what
    it counts: ``_total`` since the worker started (as the counters of ``/metrics``),
    ``_now`` at this moment."""

    state: str  # serving, or stopping (from the moment stop() begins)
    uptime_s: float
    connections_total: int  # connections served since start (dspark_worker_served_connections_total)
    connections_now: int  # connections served at this moment (dspark_worker_connections{state="served"})
    rounds_total: int  # rounds answered since start
    ready: bool  # serving with a served connection free (a HELLO now would not be busy)

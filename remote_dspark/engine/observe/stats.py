"""The engine's statistics: what the engine thread counts, and :class:`Stats`, the one
frozen record that ``RemoteDSpark.stats()`` returns and that the metrics, the JSON
file, the log line, the demo and the chaos checks all read, field by field.

Mode-dependent parts are typed, never guessed from keys: ``handoff`` exists in the
asynchronous modes, ``supervisor`` in process mode, ``connected`` in sync mode.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ...histogram import Histogram
from ...outcome import Outcome
from ...shm import memfd
from ...supervisor.restarts import SupervisorStats
from ...transport.conn import Failover

LATENCY_BOUNDS_S = tuple(b / 1e9 for b in memfd.LATENCY_BOUNDS_NS)
FAILOVER_CAUSES = tuple(c.value for c in Failover)  # transport.link.Failover, the metric's label
MARGIN_BOUNDS = tuple(i / 10 for i in range(1, 11))


@dataclass(frozen=True)
class BreakerStats:
    state: int  # breaker.State: 0 closed, 1 open, 2 probing
    trips: int
    probes: int


@dataclass(frozen=True)
class LinkStats:
    """The connection to the worker: the sync path's own, or the proxy's (from the region)."""

    attempts: int  # rounds sent (the breaker and a missing connection send none)
    late: int  # replies that came after their round was answered without them
    reconnects: int  # connections made active after the first (failovers included)
    breaker: BreakerStats
    failovers: Mapping[str, int] = field(default_factory=lambda: dict.fromkeys(FAILOVER_CAUSES, 0))
    fenced: int = 0  # replies read from a connection left after a stall, dropped
    worker: str = ""  # the active worker's address ("": none)
    incarnation: int = 0  # the active worker's incarnation (0: none)
    spare: bool = False  # a spare connection is ready

    @classmethod
    def none(cls) -> LinkStats:
        """No link of this engine's own: no path open (before start, a start that failed
        early), or a tensor-parallel rank other than 0."""
        return cls(0, 0, 0, BreakerStats(0, 0, 0))

    @classmethod
    def of_proxy(cls, counters: Mapping[str, int], breaker, link) -> LinkStats:
        """The proxy's link: its counters block's words, the header's breaker words
        (``shm.words.BreakerState``) and its link words (``shm.words.LinkWords``)."""
        b = BreakerStats(breaker.state, breaker.trips, breaker.probes)
        failovers = {c: counters[f"failovers_{c}"] for c in FAILOVER_CAUSES}
        return cls(
            counters["attempts"],
            counters["rounds_late"],
            counters["reconnects"],
            b,
            failovers,
            counters["fenced_replies"],
            link.address,
            link.incarnation,
            link.spare,
        )


@dataclass(frozen=True)
class HandoffStats:
    """The asynchronous modes' region: the proxy's and the engine's counters."""

    proxy_counters: Mapping[str, int]
    engine_counters: Mapping[str, int]
    handoff_latency: Histogram  # the engine's store of gathered to the proxy seeing the round
    proxy_round_latency: Histogram
    session: int  # the current proxy's session (0: none yet)
    max_wait_s: float  # the engine thread's longest wait for a release (CPU)
    gathered: int
    released: int
    proxy_thread_alive: bool | None  # thread mode: is the proxy thread alive; else None

    @classmethod
    def of_region(cls, proxy, engine, session: int, max_wait_s: float, gathered: int, released: int, alive):
        """From the region's counters blocks as read (``proxy``, ``engine``:
        ``shm.words.Snapshot``), its ring words and the engine thread's longest wait."""
        hists = proxy.histograms
        latency = Histogram.from_region(hists["handoff_latency"]), Histogram.from_region(hists["round_latency"])
        return cls(
            dict(proxy.counters), dict(engine.counters), *latency, session, max_wait_s, gathered, released, alive
        )


@dataclass(frozen=True)
class AnnounceStats:
    """Long contexts announced in chunks (``values.announce.Announcer``'s counts)."""

    chunks: int = 0  # entries sent as chunks: short of their queue, or a held queue's last part
    announcing: int = 0  # slots whose context is still being announced, now
    reannounced: int = 0  # NEW_GEN entries for slots the worker had lost (RESYNC, resync_all)


@dataclass(frozen=True)
class PathStats:
    """What the round path adds to a :class:`Stats`: its link, and the parts only its
    mode has (``connected`` sync, ``handoff`` thread and process, ``supervisor`` process)."""

    link: LinkStats
    connected: bool | None = None
    handoff: HandoffStats | None = None
    supervisor: SupervisorStats | None = None
    announce: AnnounceStats = AnnounceStats()  # the announcing path's (zeros on a rank other than 0)


@dataclass(frozen=True)
class Stats:
    """Everything ``RemoteDSpark`` counts, at one moment."""

    mode: str  # sync, thread or process (the mode actually running)
    policy: str
    rounds: Mapping[Outcome, int]  # every outcome, zeros included
    sources: Mapping[str, int]  # remote / local / none: whose drafts the engine got
    round_latency: Histogram
    drafts: int  # entries answered with at least one token
    draft_tokens: int
    resyncs: int  # slots the worker asked to have re-announced
    accepted_at: tuple[int, ...]  # per draft position
    offered_at: tuple[int, ...]
    shadow_agree_at: tuple[int, ...]
    shadow_compared_at: tuple[int, ...]
    margin: Histogram
    link: LinkStats
    connected: bool | None = None  # sync mode
    handoff: HandoffStats | None = None  # thread and process modes
    supervisor: SupervisorStats | None = None  # process mode
    n_out_table: tuple[int, ...] | None = None  # each round's n_out by request count (None: num_spec)
    n_out_reason: str = ""  # why (config.n_out_table)
    announce: AnnounceStats = AnnounceStats()  # long contexts announced in chunks, slots re-announced

    @property
    def total_rounds(self) -> int:
        return sum(self.rounds.values())

    def to_json(self) -> dict:
        """The stats file's document: outcomes by label (with their total), everything
        else as its fields."""
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        doc["rounds"] = {o.label: n for o, n in self.rounds.items()} | {"total": self.total_rounds}
        for name in ("round_latency", "margin", "link", "handoff", "supervisor", "announce"):
            value = getattr(self, name)
            doc[name] = None if value is None else dataclasses.asdict(value)
        return doc


@dataclass
class EngineCounts:
    """What the engine thread counts itself (its one writer); :meth:`RemoteDSpark.stats`
    copies it into a :class:`Stats`."""

    num_spec: int
    rounds: dict = field(default_factory=lambda: dict.fromkeys(Outcome, 0))
    sources: dict = field(default_factory=dict)
    latency_buckets: list = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_S) + 1))
    latency_sum_s: float = 0.0
    margin_buckets: list = field(default_factory=lambda: [0] * (len(MARGIN_BOUNDS) + 1))
    margin_sum: float = 0.0
    drafts: int = 0
    draft_tokens: int = 0
    resyncs: int = 0

    def __post_init__(self):
        k = self.num_spec
        # Per draft position: what the engine accepted of what it verified, and (shadow)
        # where the remote draft equals the local one of the positions both drafted.
        self.accepted_at, self.offered_at = np.zeros(k, np.int64), np.zeros(k, np.int64)
        self.shadow_agree_at, self.shadow_compared_at = np.zeros(k, np.int64), np.zeros(k, np.int64)

    @staticmethod
    def add_at(counter: np.ndarray, values) -> None:
        """Add ``values`` (one per position, at most num_spec) to a per-position counter."""
        values = np.asarray(values, dtype=np.int64)
        counter[: len(values)] += values

    def observe_latency(self, seconds: float) -> None:
        self.latency_buckets[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
        self.latency_sum_s += seconds

    def record(self, outcome: Outcome, counts, resyncs: int, sums: tuple[int, int] | None = None) -> None:
        """One remote round's outcome and, when it is ok, the drafts it brought: its
        entries' ``counts`` (an array or a CPU tensor), or ``sums`` (entries with drafts,
        their tokens) where the path summed them already (``Drafts.sums``)."""
        if sums is None:
            counts = np.asarray(counts)
            sums = int(np.count_nonzero(counts)), int(counts.sum())
        self.record_totals(outcome, *sums, resyncs)

    def record_totals(self, outcome: Outcome, drafted: int, tokens: int, resyncs: int) -> None:
        """:meth:`record` by its totals: the entries with drafts and their tokens."""
        self.rounds[outcome] += 1
        self.resyncs += resyncs
        if outcome is Outcome.OK:
            self.drafts += drafted
            self.draft_tokens += tokens

    def source(self, name: str) -> None:
        self.sources[name] = self.sources.get(name, 0) + 1

    def margins(self, values: np.ndarray) -> None:
        """Shadow: the remote's margins of the positions it drafted."""
        idx = np.searchsorted(np.asarray(MARGIN_BOUNDS), values, side="left")
        for i, n in zip(*np.unique(idx, return_counts=True)):
            self.margin_buckets[int(i)] += int(n)
        self.margin_sum += float(values.sum())

    def snapshot(
        self,
        *,
        mode: str,
        policy: str,
        path: PathStats,
        n_out_table: tuple[int, ...] | None = None,
        n_out_reason: str = "",
    ) -> Stats:
        return Stats(
            mode,
            policy,
            dict(self.rounds),
            dict(self.sources),
            Histogram(LATENCY_BOUNDS_S, tuple(self.latency_buckets), self.latency_sum_s),
            self.drafts,
            self.draft_tokens,
            self.resyncs,
            tuple(self.accepted_at.tolist()),
            tuple(self.offered_at.tolist()),
            tuple(self.shadow_agree_at.tolist()),
            tuple(self.shadow_compared_at.tolist()),
            Histogram(MARGIN_BOUNDS, tuple(self.margin_buckets), self.margin_sum),
            path.link,
            path.connected,
            path.handoff,
            path.supervisor,
            n_out_table,
            n_out_reason,
            path.announce,
        )

"""A watchable worker: ``/metrics``, ``/healthz`` and ``/readyz`` (``remote-dspark worker
--metrics-port PORT``).

One small HTTP server (:class:`~remote_dspark.metrics.serve.ScrapeServer`: one selector
thread reads requests under a deadline on the whole request and caps on the head, and
only a whole request gets a thread, a few at once) that
:class:`~remote_dspark.worker.Worker` starts in ``start()`` when it has a metrics port and
closes at the end of ``stop()``. It listens on loopback unless told otherwise
(``--metrics-host``): like the worker's own port, nothing here is authenticated, so no
client may hold it (slow or oversized requests are dropped, never waited for).

- ``/metrics``: Prometheus text exposition from :class:`WorkerCollector`, a custom
  collector read at scrape time: it walks :data:`TABLE`, one row per family
  (:mod:`remote_dspark.metrics.families`), over one :class:`WorkerScrape`. Every number has one
  owner and is only read here: the worker's :class:`~remote_dspark.worker.stats.WorkerStats`
  (a consistent copy taken under its lock), the admission loop's pool size, the drafter's
  ``cache_info()`` and ``spec_info()``. The round path never does anything for the
  metrics beyond what the stats already cost.
- ``/healthz``: 200 and a small JSON body (:class:`~remote_dspark.worker.stats.Health`:
  ``state``, ``uptime_s``, ``connections_total`` served since start, ``connections_now``
  served at this moment, ``rounds_total``, ``ready``) while the worker serves; 503 from
  the moment ``stop()`` begins until the server closes at its end (then connections are
  refused).
- ``/readyz``: as ``/healthz``, and 503 too while every served connection is in use (a
  HELLO now would be refused busy): for a load balancer in front of several workers.
- anything else: 404.

Names as the engine's (:mod:`remote_dspark.engine.observe.metrics`), with their own prefix
``dspark_worker_``: base units, ``_total`` on counters, labels of low cardinality
(``state``, ``reason``; ``rank``, at most :data:`MAX_RANK_LABELS` values).
prometheus_client is the ``worker`` extra's and is imported only with this module, which
the worker imports only when a metrics port is given.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..drafter.contract import CacheInfo, SpecInfo, cache_info_of, spec_info_of, vocab_size_of
from ..metrics.families import Table, TableCollector, counter, gauge, histogram, info
from ..metrics.serve import Answer, ScrapeServer
from .admission import AdmissionStats
from .stats import REFUSAL_REASONS, WorkerStats

log = logging.getLogger("remote_dspark.worker")

PREFIX = "dspark_worker_"
# The most ``rank`` labels of the speculation cache's hits: ranks 0 to 62 each, and "63+"
# for every rank past them (a fan-out bounds the ranks; this bounds the series).
MAX_RANK_LABELS = 64


@dataclass(frozen=True)
class WorkerScrape:
    """What one scrape reads, each number from its one owner: the worker's stats (a
    consistent copy), the admission loop's pool (None before it runs), the drafter's
    identity and cache (None: it keeps no per-slot state, or its ``cache_info()`` failed)
    and speculation cache (None: it does not pre-draft, or its ``spec_info()`` failed)."""

    stats: WorkerStats
    admission: AdmissionStats | None
    served_now: int
    max_pending: int
    max_connections: int
    start_time: float
    drafter: str  # the drafter's class name
    drafter_identity: bytes
    markov_identity: bytes
    vocab_size: int  # 0: the drafter does not say (or says something that is no size)
    cache: CacheInfo | None
    spec: SpecInfo | None
    budget: tuple[int, int]  # a drafting call's entries and tokens at most
    spares: int = 0  # spare sessions held now (Sessions.counts)
    incarnation: int = 0  # the worker's random id, as its HELLO_ACKs tell it


def read(worker, start_time: float) -> WorkerScrape:
    """The record of one scrape of ``worker`` (duck-typed: ``statistics()``,
    ``admission()``, ``served_now()``, ``sessions_now()``, ``drafter``, ``options``,
    ``budget``, ``incarnation``)."""
    drafter = worker.drafter
    try:
        vocab = vocab_size_of(drafter)
    except ValueError:
        vocab = 0
    try:
        cache = cache_info_of(drafter)
    except Exception:  # a plug-in's bug must not cost the other metrics
        log.exception("drafter.cache_info() failed; cache metrics left out of this scrape")
        cache = None
    try:
        spec = spec_info_of(drafter)
    except Exception:  # as cache_info(): the other metrics go on
        log.exception("drafter.spec_info() failed; speculation metrics left out of this scrape")
        spec = None
    return WorkerScrape(
        stats=worker.statistics(),
        admission=worker.admission(),
        served_now=worker.served_now(),
        max_pending=worker.options.max_pending,
        max_connections=worker.options.max_connections,
        start_time=start_time,
        drafter=type(drafter).__name__,
        drafter_identity=drafter.drafter_identity,
        markov_identity=drafter.markov_identity,
        vocab_size=vocab,
        cache=cache,
        spec=spec,
        budget=worker.budget,
        spares=worker.sessions_now()[1],
        incarnation=worker.incarnation,
    )


def _cached(r: WorkerScrape) -> bool:  # absent (not zero) for a drafter without per-slot state
    return r.cache is not None


def _speculates(r: WorkerScrape) -> bool:  # absent (not zero) for a drafter that does not pre-draft
    return r.spec is not None


def hits_by_rank(hits: tuple[int, ...]) -> dict[str, int]:
    """The speculation cache's hits as ``rank`` label values: ``"0"`` to ``"62"`` each,
    then ``"63+"`` summing every rank past them (:data:`MAX_RANK_LABELS` labels at most)."""
    last = MAX_RANK_LABELS - 1
    by_rank = {str(rank): n for rank, n in enumerate(hits[:last])}
    if len(hits) > last:
        by_rank[f"{last}+"] = sum(hits[last:])
    return by_rank


TABLE: Table[WorkerScrape] = Table(
    PREFIX,
    (
        info(
            "info",
            "The worker's drafter: its class, identities and vocabulary size (0: it does not say); "
            "and the worker's incarnation, the random id its HELLO_ACKs tell, new at every start.",
            ("drafter", "drafter_identity", "markov_identity", "vocab_size", "incarnation"),
            lambda r: (
                r.drafter,
                r.drafter_identity.hex(),
                r.markov_identity.hex(),
                str(r.vocab_size),
                f"{r.incarnation:016x}",
            ),
        ),
        gauge("start_time_seconds", "When the worker started, seconds since the Unix epoch.", lambda r: r.start_time),
        gauge(
            "connections",
            "Connections now, by state: pending (accepted, no HELLO yet: the pre-HELLO "
            "pool) and served (a HELLO accepted, a thread each).",
            lambda r: {"pending": r.admission.pending if r.admission else 0, "served": r.served_now},
            labels=("state",),
        ),
        gauge(
            "connections_limit",
            "The most connections of each state (--max-pending, --max-connections).",
            lambda r: {"pending": r.max_pending, "served": r.max_connections},
            labels=("state",),
        ),
        gauge(
            "spare_sessions",
            "Spare sessions held now: engines' standby connections, idle until their first ROUND "
            "(the first to go for a newcomer once no idle served session can).",
            lambda r: r.spares,
        ),
        counter(
            "pings",
            "PINGs answered (engines' liveness checks of idle connections, their spares' above all).",
            lambda r: r.stats.pings,
        ),
        counter(
            "accepted_connections",
            "TCP connections accepted (before HELLO).",
            lambda r: r.admission.accepted if r.admission else 0,
        ),
        counter(
            "served_connections",
            "Connections given a thread: a whole HELLO not refused busy at the door "
            "(its identities, vocabulary and limits are checked there: refusals included).",
            lambda r: r.stats.connections,
        ),
        counter(
            "hello_refusals",
            "HELLOs refused, by reason: drafter or markov (identity mismatch), "
            "vocab (the drafter's vocabulary is over the engine's), limits (beyond this worker's "
            "limits), version (another protocol version), busy (no served connection or no "
            "engine place free), auth (the engine did not prove it holds this worker's key).",
            lambda r: {reason: r.stats.refusals[reason] for reason in REFUSAL_REASONS},
            labels=("reason",),
        ),
        counter(
            "bad_frames", "Connections dropped for a frame that breaks the contract.", lambda r: r.stats.bad_frames
        ),
        counter(
            "round_failures",
            "Connections dropped because drafting or answering a round raised (the drafter's bug; logged).",
            lambda r: r.stats.round_failures,
        ),
        counter(
            "stalled_connections",
            "Connections dropped for a frame not whole within --frame-timeout-ms.",
            lambda r: r.stats.stalled,
        ),
        counter(
            "hello_timeouts",
            "Connections dropped for no HELLO within --hello-timeout-ms.",
            lambda r: r.stats.hello_timeouts,
        ),
        counter(
            "displaced_connections",
            "Pre-HELLO connections dropped to make room for a newer one.",
            lambda r: r.stats.displaced,
        ),
        counter(
            "evicted_sessions",
            "Sessions evicted for a newcomer, from an engine place or a connection (idle a minute or more).",
            lambda r: r.stats.evicted,
        ),
        counter("rounds", "ROUND frames answered.", lambda r: r.stats.rounds),
        counter("entries", "Entries of the rounds answered.", lambda r: r.stats.entries),
        counter(
            "resyncs",
            "Entries answered RESYNC (no window for the slot, or a gap in its positions).",
            lambda r: r.stats.resyncs,
        ),
        counter(
            "entries_beyond_positions",
            "Entries answered with no drafts because their context (at its absolute position) "
            "and the round's width pass the drafter model's position table.",
            lambda r: r.stats.beyond_positions,
        ),
        counter("draft_tokens", "Draft tokens sent.", lambda r: r.stats.draft_tokens),
        counter(
            "rounds_expired",
            "Rounds answered with no drafts because the drafter could not draft them before their deadline.",
            lambda r: r.stats.expired,
        ),
        counter(
            "drafter_calls",
            "draft_batch calls; one call may draft several engines' rounds (rounds_total over this: rounds a call).",
            lambda r: r.stats.drafter_calls,
        ),
        counter(
            "drafter_cpu_seconds",
            "CPU seconds the drafter's calls (draft_batch, and encodes to price a round) took on the thread "
            "that made each: its own host work (a round drafted in C: its drafting time). The worker's CPU "
            "less this is its serving.",
            lambda r: r.stats.drafter_cpu_seconds,
        ),
        counter(
            "encode_pieces",
            "Pieces of an entry's encode over a call's token budget (a long NEW_GEN encoded over several "
            "calls, one piece a call); the entry's last piece, with its drafts, is not one.",
            lambda r: r.stats.encode_pieces,
        ),
        counter(
            "encode_piece_tokens",
            "Tokens of those pieces: what encoding long contexts took of the calls' budgets "
            "(call_tokens' sum over this: the rest is drafting and short encodes).",
            lambda r: r.stats.encode_piece_tokens,
        ),
        histogram(
            "round_duration_seconds",
            "The worker's time on a ROUND, from received to its DRAFTS sent; a round served in C is drafted "
            "while its rows arrive, and that wait is not counted.",
            lambda r: r.stats.round_seconds.snapshot(),
        ),
        histogram(
            "drafting_duration_seconds",
            "Time inside the drafter's draft_batch, per call (a call may draft several engines' rounds). "
            "Its rate of sum is the drafter's busy fraction.",
            lambda r: r.stats.drafting_seconds.snapshot(),
        ),
        histogram(
            "queue_wait_seconds",
            "A round's wait for the drafter, from queued to its first piece taken into a call.",
            lambda r: r.stats.queue_seconds.snapshot(),
        ),
        histogram(
            "call_rounds",
            "Rounds (or pieces of rounds) drafted in one drafter call: engines batched together.",
            lambda r: r.stats.call_rounds.snapshot(),
        ),
        histogram("call_entries", "Entries drafted in one drafter call.", lambda r: r.stats.call_entries.snapshot()),
        histogram(
            "call_tokens",
            "Tokens drafted in one drafter call: the entries' contexts and drafts (the budget's cost).",
            lambda r: r.stats.call_tokens.snapshot(),
        ),
        gauge(
            "call_budget_entries",
            "A drafter call's budget of entries (--max-batch-entries).",
            lambda r: r.budget[0],
        ),
        gauge(
            "call_budget_tokens",
            "A drafter call's budget of tokens (--max-batch-tokens, or derived from the device's memory).",
            lambda r: r.budget[1],
        ),
        gauge("cache_slots", "Streams with cached drafter state now.", lambda r: r.cache.slots, when=_cached),
        gauge(
            "cache_capacity_slots",
            "The most streams the drafter's cache keeps.",
            lambda r: r.cache.capacity,
            when=_cached,
        ),
        gauge("cache_bytes", "Memory the drafter's cache holds.", lambda r: r.cache.bytes, when=_cached),
        counter("cache_hits", "Entries drafted from cached state.", lambda r: r.cache.hits, when=_cached),
        counter(
            "cache_misses",
            "Entries that encoded their whole stream (a new one, or its KV gone).",
            lambda r: r.cache.misses,
            when=_cached,
        ),
        gauge(
            "cache_blocks_used",
            "The KV pool's blocks holding streams now.",
            lambda r: r.cache.blocks_used,
            when=_cached,
        ),
        gauge("cache_blocks_free", "The KV pool's free blocks.", lambda r: r.cache.blocks_free, when=_cached),
        counter(
            "cache_evicted_streams",
            "Streams whose KV was evicted for room (re-encoded from the worker's tokens when next drafted).",
            lambda r: r.cache.evicted,
            when=_cached,
        ),
        counter(
            "spec_hits",
            "Entries answered from an outcome pre-drafted in the worker's idle time, by the outcome's rank "
            '(0: the likeliest; "63+": every rank past 62).',
            lambda r: hits_by_rank(r.spec.hits),
            labels=("rank",),
            when=_speculates,
        ),
        counter(
            "spec_misses",
            "Entries whose stream had pre-drafted outcomes and whose round matched none of them (drafted afresh).",
            lambda r: r.spec.misses,
            when=_speculates,
        ),
        counter(
            "spec_outcomes",
            "Outcomes pre-drafted in the worker's idle time (the rounds the drafter expects next).",
            lambda r: r.spec.outcomes,
            when=_speculates,
        ),
        counter(
            "spec_dropped",
            "Pre-drafted outcomes let go unused: their stream's round matched another, their blocks were "
            "reclaimed, or their stream ended.",
            lambda r: r.spec.dropped,
            when=_speculates,
        ),
        counter(
            "spec_seconds",
            "Drafter seconds spent pre-drafting, between rounds. drafting_duration_seconds counts only the calls "
            "of rounds: this rate over 1 less that one's rate of sum is pre-drafting's share of the idle time.",
            lambda r: r.spec.seconds,
            when=_speculates,
        ),
        gauge(
            "spec_held", "Pre-drafted outcomes waiting for their round now.", lambda r: r.spec.held, when=_speculates
        ),
        gauge(
            "spec_blocks",
            "KV blocks the waiting pre-drafts hold now (the first blocks the pool reclaims).",
            lambda r: r.spec.blocks,
            when=_speculates,
        ),
    ),
)


class WorkerCollector(TableCollector):
    """Reads a worker's numbers at every scrape (:func:`read`) and walks :data:`TABLE`
    over them."""

    def __init__(self, worker, start_time: float | None = None):
        start_time = time.time() if start_time is None else start_time
        super().__init__(TABLE, lambda: read(worker, start_time))


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` of ``worker`` on ``host:port`` (0: any
    free port; :attr:`port` is the bound one), served by a
    :class:`~remote_dspark.metrics.serve.ScrapeServer` (no client can hold it: a deadline on
    the whole request, caps on the head, no thread until a request is whole) until
    :meth:`close` (idempotent, bounded).

    Raises:
        ValueError: the address cannot be bound, naming ``--metrics-port`` and the host.
    """

    def __init__(self, worker, host: str = "127.0.0.1", port: int = 0):
        if not 0 <= port <= 65535:
            raise ValueError(f"--metrics-port {port}: expected 0..65535")
        self.registry = CollectorRegistry(auto_describe=False)  # its own: never the global default registry
        self.registry.register(WorkerCollector(worker))
        self._worker = worker
        paths = {
            "/metrics": self._metrics,
            "/healthz": lambda: self._health(False),
            "/readyz": lambda: self._health(True),
        }
        try:
            self._server = ScrapeServer(paths, host, port, name="worker-metrics")
        except OSError as e:
            raise ValueError(f"--metrics-port {port} on {host}: {e.strerror}") from e
        self.host, self.port = host, self._server.port

    def _metrics(self) -> Answer:
        return Answer(200, CONTENT_TYPE_LATEST, generate_latest(self.registry))

    def _health(self, ready: bool) -> Answer:
        h = self._worker.health()
        ok = h.state == "serving" and (h.ready or not ready)
        return Answer(200 if ok else 503, "application/json", (json.dumps(dataclasses.asdict(h)) + "\n").encode())

    def close(self, timeout_s: float = 5.0) -> None:
        self._server.close(timeout_s)

"""Prometheus metrics: the engine's table of families, its collector read at scrape
time, and a loopback exporter.

Why a custom collector and not prometheus_client's multiprocess mode: multiprocess
mode keeps a file per pid for ever, and a proxy that respawns all day would pile them
up; and the proxy must not import prometheus_client at all. Here the proxy only adds to
counters in the shared region (C atomics); the engine's collector reads them, with the
engine's own counters and the supervisor's state, when Prometheus scrapes. The region
outlives every proxy, so its counters are monotonic across respawns; the one per-process
fact that is not (CPU time) is carried by the supervisor from each dead proxy's rusage.

Every number comes from :meth:`RemoteDSpark.stats`, the same record the JSON stats file
and the ``LOG_EVERY`` line show, so the three never disagree. The families are
:data:`TABLE`, one row each (:mod:`remote_dspark.metrics.families`): its kind, name, help,
labels, how its value comes from an :class:`EngineScrape` (that record and the configuration)
and when it is there; the collector walks it over one :class:`EngineScrape` per scrape.

Names: prefix ``dspark_remote_``, base units (seconds, bytes), ``_total`` on counters,
labels of low cardinality (outcome, cause, state, position < num_spec).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ...config.api import RemoteConfig
from ...metrics.families import Table, TableCollector, counter, gauge, histogram, info, one_hot
from ...metrics.serve import Answer, ScrapeServer
from .stats import Stats

PREFIX = "dspark_remote_"
BREAKER_STATES = ("closed", "open", "probing")
CAUSES = ("exit", "signal", "stall")
STANDBY_STATES = ("off", "none", "starting", "ready")


@dataclass(frozen=True)
class EngineScrape:
    """What one scrape reads: the engine's one stats record and its configuration."""

    stats: Stats
    cfg: RemoteConfig


def _handoff(r: EngineScrape) -> bool:  # the asynchronous modes: the region's families
    return r.stats.handoff is not None


def _supervised(r: EngineScrape) -> bool:  # process mode: the supervisor's families
    return r.stats.supervisor is not None


def _proxy_up(r: EngineScrape) -> float:
    sup, handoff = r.stats.supervisor, r.stats.handoff
    return 1.0 if (sup.state == "up" if sup else bool(handoff.proxy_thread_alive)) else 0.0


def _by_position(counts: tuple[int, ...]) -> dict[str, int]:
    return {str(i): n for i, n in enumerate(counts)}


TABLE: Table[EngineScrape] = Table(
    PREFIX,
    (
        info(
            "info",
            "Remote drafter configuration: policy, mode, endpoint and identities.",
            ("policy", "mode", "endpoint", "drafter_identity", "markov_identity"),
            lambda r: (
                r.cfg.policy,
                r.stats.mode,
                str(r.cfg.endpoint),
                r.cfg.drafter_identity.hex(),
                r.cfg.markov_identity.hex(),
            ),
        ),
        counter(
            "rounds",
            "Drafting rounds by outcome. late counts replies that came after their "
            "round had been answered without them (its deadline passed, or the watchdog "
            "answered it); that round is also counted under its own outcome.",
            lambda r: {o.label: n for o, n in r.stats.rounds.items()} | {"late": r.stats.link.late},
            labels=("outcome",),
        ),
        counter(
            "attempts",
            "Rounds sent to the remote drafter (the breaker and back-off send none).",
            lambda r: r.stats.link.attempts,
        ),
        # The proxy's own counter (no proxy, no such rounds: 0), beside the outcomes it
        # refines: each of these rounds is also counted under outcome="error".
        counter(
            "rounds_bad_desc",
            "Rounds whose descriptor (the engine's metadata, perhaps written by "
            "a GPU stream) broke the layout or the wire's rules: answered target-only, never sent; "
            'also counted under rounds_total{outcome="error"}.',
            lambda r: r.stats.handoff.proxy_counters["rounds_bad_desc"] if r.stats.handoff else 0,
        ),
        histogram(
            "round_latency_seconds",
            "Engine-side time of a round, hand-off and network included.",
            lambda r: r.stats.round_latency,
        ),
        histogram(
            "handoff_latency_seconds",
            "From the engine's store of gathered to the proxy seeing the round.",
            lambda r: r.stats.handoff.handoff_latency,
            when=_handoff,
        ),
        counter("drafts", "Entries the remote drafter answered with at least one token.", lambda r: r.stats.drafts),
        counter("draft_tokens", "Draft tokens returned by the remote drafter.", lambda r: r.stats.draft_tokens),
        counter("resyncs", "Slots the worker asked to have re-announced (NEW_GEN).", lambda r: r.stats.resyncs),
        counter(
            "announce_chunks",
            "Entries sent as chunks of a context longer than a round's tokens (round_tokens): "
            "each sent short of its context, and each sending its context's last part.",
            lambda r: r.stats.announce.chunks,
        ),
        gauge(
            "announcing_slots",
            "Slots whose context is still being announced in chunks (no drafts until it is whole).",
            lambda r: r.stats.announce.announcing,
        ),
        counter(
            "reannounced_slots",
            "NEW_GEN entries for slots the worker had lost (named RESYNC, or every slot after resync_all).",
            lambda r: r.stats.announce.reannounced,
        ),
        counter("accepted_tokens", "Draft tokens the engine accepted.", lambda r: sum(r.stats.accepted_at)),
        counter(
            "accepted_tokens_by_position",
            "Draft tokens the engine accepted, by draft position.",
            lambda r: _by_position(r.stats.accepted_at),
            labels=("position",),
        ),
        counter(
            "offered_tokens_by_position",
            "Draft tokens the engine verified, by draft position.",
            lambda r: _by_position(r.stats.offered_at),
            labels=("position",),
        ),
        counter(
            "shadow_agree",
            "Shadow: positions where the remote draft equals the local one.",
            lambda r: _by_position(r.stats.shadow_agree_at),
            labels=("position",),
        ),
        counter(
            "shadow_compared",
            "Shadow: positions where both drafters drafted.",
            lambda r: _by_position(r.stats.shadow_compared_at),
            labels=("position",),
        ),
        histogram(
            "margin_ratio",
            "Top1-top2 probability margin of the remote drafts (shadow).",
            lambda r: r.stats.margin,
            when=lambda r: r.cfg.want_margin,  # margins are asked for (WANT_MARGIN): else absent, not zero
        ),
        gauge(
            "breaker_state",
            "1 for the breaker's current state, 0 for the others.",
            lambda r: one_hot(BREAKER_STATES, BREAKER_STATES[r.stats.link.breaker.state]),
            labels=("state",),
        ),
        counter("breaker_trips", "Times the breaker opened.", lambda r: r.stats.link.breaker.trips),
        counter("breaker_probes", "Probe rounds sent after a cooldown.", lambda r: r.stats.link.breaker.probes),
        counter("reconnects", "Connections to the worker made after the first.", lambda r: r.stats.link.reconnects),
        counter(
            "failovers",
            "Active worker connections left, by cause: lost (broken, closed, the worker said BYE), "
            "stall (two round deadlines in a row, a spare ready), protocol (a frame that broke the contract).",
            lambda r: dict(r.stats.link.failovers),
            labels=("cause",),
        ),
        counter(
            "fenced_replies",
            "Replies read from a connection left after a stall, dropped: never delivered.",
            lambda r: r.stats.link.fenced,
        ),
        info(
            "worker_info",
            "The active worker connection: its address and the worker's incarnation (empty: none).",
            ("address", "incarnation"),
            lambda r: (r.stats.link.worker, f"{r.stats.link.incarnation:016x}" if r.stats.link.incarnation else ""),
        ),
        gauge(
            "spare_ready",
            "1 while a spare connection to another worker of the fleet is ready.",
            lambda r: float(r.stats.link.spare),
        ),
        gauge(
            "session_id",
            "Low 32 bits of the current proxy session (changes on every new proxy).",
            lambda r: r.stats.handoff.session & 0xFFFFFFFF,
            when=_handoff,
        ),
        gauge("proxy_up", "1 while a proxy (process or thread) is serving rounds.", _proxy_up, when=_handoff),
        counter(
            "proxy_restarts",
            "Proxies lost, by cause: exit, signal, stall (killed by the supervisor).",
            lambda r: {cause: r.stats.supervisor.restarts[cause] for cause in CAUSES},
            labels=("cause",),
            when=_supervised,
        ),
        gauge(
            "respawn_budget_left",
            "New proxies the supervisor may still start.",
            lambda r: r.stats.supervisor.budget_left,
            when=_supervised,
        ),
        counter(
            "respawn_budget_restores",
            "Times a proxy served RESPAWN_RESET_S and the full budget came back.",
            lambda r: r.stats.supervisor.budget_restored,
            when=_supervised,
        ),
        gauge(
            "proxy_resident_memory_bytes",
            "Resident memory of the live proxy process.",
            lambda r: r.stats.supervisor.proxy_rss_bytes,
            when=_supervised,
        ),
        counter(
            "proxy_cpu_seconds",
            "CPU time of all proxy processes so far.",
            lambda r: r.stats.supervisor.proxy_cpu_seconds,
            when=_supervised,
        ),
        gauge(
            "standby_state",
            "1 for the warm standby proxy's current state (off: none is kept, "
            "by ASYNC_STANDBY=0 or after repeated failures), 0 for the others.",
            lambda r: one_hot(STANDBY_STATES, r.stats.supervisor.standby),
            labels=("state",),
            when=_supervised,
        ),
        counter(
            "standby_failures",
            "Standby proxies that died before their promotion, or were killed for not answering it "
            "(never from the respawn budget).",
            lambda r: r.stats.supervisor.standby_failures,
            when=_supervised,
        ),
    ),
)


def read(rd) -> EngineScrape:
    """The record of one scrape of ``rd`` (a :class:`~remote_dspark.engine.RemoteDSpark`)."""
    return EngineScrape(rd.stats(), rd.cfg)


class RemoteDSparkCollector(TableCollector):
    """Reads ``rd.stats()`` at every scrape and walks :data:`TABLE` over it. Register it
    in the engine's registry."""

    def __init__(self, rd):
        super().__init__(TABLE, lambda: read(rd))


class Exporter:
    """``/metrics`` for an engine that serves none: a registry of its own, served by a
    :class:`~remote_dspark.metrics.serve.ScrapeServer` (no client can hold it: a deadline on
    the whole request, caps on the head, no thread until a request is whole), on
    loopback unless told otherwise. ``close()`` stops it (idempotent)."""

    def __init__(self, rd, port: int, addr: str = "127.0.0.1"):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RemoteDSparkCollector(rd))
        try:
            self._server = ScrapeServer({"/metrics": self._metrics}, addr, port, name="engine-metrics")
        except OSError as e:
            raise ValueError(f"VLLM_DSPARK_REMOTE_METRICS_PORT={port} on {addr}: {e.strerror}") from e
        self.port = self._server.port
        self.addr = addr

    def _metrics(self) -> Answer:
        return Answer(200, CONTENT_TYPE_LATEST, generate_latest(self.registry))

    def close(self) -> None:
        self._server.close()

"""Prometheus metrics: a collector read at scrape time, and a loopback exporter.

Why a custom collector and not prometheus_client's multiprocess mode: multiprocess
mode keeps a file per pid for ever, and a proxy that respawns all day would pile them
up; and the proxy must not import prometheus_client at all. Here the proxy only adds to
counters in the shared region (C atomics); the engine's collector reads them, with the
engine's own counters and the supervisor's state, when Prometheus scrapes. The region
outlives every proxy, so its counters are monotonic across respawns; the one per-process
fact that is not (CPU time) is carried by the supervisor from each dead proxy's rusage.

Every number comes from :meth:`RemoteDSpark.stats`, the same record the JSON stats file
and the ``LOG_EVERY`` line show, so the three never disagree.

Names: prefix ``dspark_remote_``, base units (seconds, bytes), ``_total`` on counters,
labels of low cardinality (outcome, cause, state, position < num_spec).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import InfoMetricFamily
from prometheus_client.registry import Collector

from ..prom.families import Families

PREFIX = "dspark_remote_"
BREAKER_STATES = ("closed", "open", "probing")
CAUSES = ("exit", "signal", "stall")
STANDBY_STATES = ("off", "none", "starting", "ready")


_f = Families(PREFIX)
_counter, _gauge, _histogram = _f.counter, _f.gauge, _f.histogram


class RemoteDSparkCollector(Collector):
    """Reads ``rd.stats()`` at every scrape. Register it in the engine's registry."""

    def __init__(self, rd):
        self.rd = rd

    def describe(self):
        return []  # families are known only from a live engine; skip the register-time collect

    def collect(self) -> Iterator:
        rd = self.rd
        s = rd.stats()
        cfg = rd.cfg
        info = InfoMetricFamily(PREFIX[:-1], "Remote drafter configuration: policy, mode, endpoint and identities.")
        info.add_metric(
            [],
            {
                "policy": cfg.policy,
                "mode": s.mode,
                "endpoint": str(cfg.endpoint),
                "drafter_identity": cfg.drafter_identity.hex(),
                "markov_identity": cfg.markov_identity.hex(),
            },
        )
        yield info

        link, handoff, sup = s.link, s.handoff, s.supervisor
        rounds = _counter(
            "rounds",
            "Drafting rounds by outcome. late counts replies that came after their "
            "round had been answered without them (its deadline passed, or the watchdog "
            "answered it); that round is also counted under its own outcome.",
            labels=("outcome",),
        )
        for outcome, n in s.rounds.items():
            rounds.add_metric([outcome.label], n)
        rounds.add_metric(["late"], link.late)
        yield rounds
        yield _counter(
            "attempts", "Rounds sent to the remote drafter (the breaker and back-off send none).", link.attempts
        )
        # The proxy's own counter (no proxy, no such rounds: 0), beside the outcomes it
        # refines: each of these rounds is also counted under outcome="error".
        yield _counter(
            "rounds_bad_desc",
            "Rounds whose descriptor (the engine's metadata, perhaps written by "
            "a GPU stream) broke the layout or the wire's rules: answered target-only, never sent; "
            'also counted under rounds_total{outcome="error"}.',
            handoff.proxy_counters["rounds_bad_desc"] if handoff else 0,
        )
        yield _histogram(
            "round_latency_seconds", "Engine-side time of a round, hand-off and network included.", s.round_latency
        )
        if handoff:
            yield _histogram(
                "handoff_latency_seconds",
                "From the engine's store of gathered to the proxy seeing the round.",
                handoff.handoff_latency,
            )
        yield _counter("drafts", "Entries the remote drafter answered with at least one token.", s.drafts)
        yield _counter("draft_tokens", "Draft tokens returned by the remote drafter.", s.draft_tokens)
        yield _counter("resyncs", "Slots the worker asked to have re-announced (NEW_GEN).", s.resyncs)

        accepted = _counter(
            "accepted_tokens_by_position", "Draft tokens the engine accepted, by draft position.", labels=("position",)
        )
        offered = _counter(
            "offered_tokens_by_position", "Draft tokens the engine verified, by draft position.", labels=("position",)
        )
        agree = _counter(
            "shadow_agree", "Shadow: positions where the remote draft equals the local one.", labels=("position",)
        )
        compared = _counter("shadow_compared", "Shadow: positions where both drafters drafted.", labels=("position",))
        for i in range(len(s.accepted_at)):
            accepted.add_metric([str(i)], s.accepted_at[i])
            offered.add_metric([str(i)], s.offered_at[i])
            agree.add_metric([str(i)], s.shadow_agree_at[i])
            compared.add_metric([str(i)], s.shadow_compared_at[i])
        yield _counter("accepted_tokens", "Draft tokens the engine accepted.", sum(s.accepted_at))
        yield from (accepted, offered, agree, compared)
        if rd.cfg.want_margin:  # margins are asked for (WANT_MARGIN): else absent, not zero
            yield _histogram("margin_ratio", "Top1-top2 probability margin of the remote drafts (shadow).", s.margin)

        state = _gauge("breaker_state", "1 for the breaker's current state, 0 for the others.", labels=("state",))
        for i, name in enumerate(BREAKER_STATES):
            state.add_metric([name], 1.0 if link.breaker.state == i else 0.0)
        yield state
        yield _counter("breaker_trips", "Times the breaker opened.", link.breaker.trips)
        yield _counter("breaker_probes", "Probe rounds sent after a cooldown.", link.breaker.probes)
        yield _counter("reconnects", "Connections to the worker made after the first.", link.reconnects)

        if handoff:
            yield _gauge(
                "session_id",
                "Low 32 bits of the current proxy session (changes on every new proxy).",
                handoff.session & 0xFFFFFFFF,
            )
            up = sup.state == "up" if sup else bool(handoff.proxy_thread_alive)
            yield _gauge("proxy_up", "1 while a proxy (process or thread) is serving rounds.", 1.0 if up else 0.0)
        if sup:
            restarts = _counter(
                "proxy_restarts",
                "Proxies lost, by cause: exit, signal, stall (killed by the supervisor).",
                labels=("cause",),
            )
            for cause in CAUSES:
                restarts.add_metric([cause], sup.restarts[cause])
            yield restarts
            yield _gauge("respawn_budget_left", "New proxies the supervisor may still start.", sup.budget_left)
            yield _counter(
                "respawn_budget_restores",
                "Times a proxy served RESPAWN_RESET_S and the full budget came back.",
                sup.budget_restored,
            )
            yield _gauge(
                "proxy_resident_memory_bytes", "Resident memory of the live proxy process.", sup.proxy_rss_bytes
            )
            yield _counter("proxy_cpu_seconds", "CPU time of all proxy processes so far.", sup.proxy_cpu_seconds)
            standby = _gauge(
                "standby_state",
                "1 for the warm standby proxy's current state (off: none is kept, "
                "by ASYNC_STANDBY=0 or after repeated failures), 0 for the others.",
                labels=("state",),
            )
            for name in STANDBY_STATES:
                standby.add_metric([name], 1.0 if sup.standby == name else 0.0)
            yield standby
            yield _counter(
                "standby_failures",
                "Standby proxies that died before their promotion (never from the respawn budget).",
                sup.standby_failures,
            )


class Exporter:
    """``/metrics`` for an engine that serves none: a registry of its own, on loopback
    unless told otherwise. ``close()`` stops it (idempotent)."""

    def __init__(self, rd, port: int, addr: str = "127.0.0.1"):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(RemoteDSparkCollector(rd))
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise ValueError(f"VLLM_DSPARK_REMOTE_METRICS_PORT={port} on {addr}: {e.strerror}") from e
        self.port = self._server.server_port
        self.addr = addr
        self._closed = threading.Event()

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5.0)

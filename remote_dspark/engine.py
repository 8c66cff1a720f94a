"""``RemoteDSpark``: the engine-facing facade.

    rd = RemoteDSpark(cfg, num_spec=5, max_slots=256, row_bytes=..., local_drafter=...)
    rd.start()              # region, native library, watchdog, proxy, HELLO
    out = rd.round(batch)   # Drafts(tokens [n, k] int32, counts [n], margins?)
    rd.stats()              # what the JSON file, the log line and /metrics show
    rd.close()

Three policies (``POLICY``): *shadow* (the local drafter drives; the remote one is asked
too and compared position by position), *resilience* (the remote drives; the local one
answers when it fails) and *capacity* (the remote only; a failure is a target-only round,
or raises with ``ON_FAIL=raise``).

Three ways to run a round: synchronous (``ASYNC=0``: the engine thread does the network
round within ``TIMEOUT_MS``), and, for capacity, asynchronous through the shared region
with the proxy as a thread of the engine (``ASYNC_PROXY=thread``) or as a supervised
child process (``process``). On the CPU the engine thread hands a round over and waits for
its release inside the native library (GIL released); the watchdog bounds that wait.

torch is imported here (the engine side); nothing the proxy imports imports this module.
"""

from __future__ import annotations

import bisect
import enum
import json
import logging
import os
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from . import native, ring, shm, streamsync, transport, wire
from .batch import (CONTEXT_TOKENS, Batch, Drafts, HostMeta, as_bytes, check_meta_shapes, empty_drafts,
                    gather_rows_host, host_meta, to_drafts, write_meta, write_meta_in_stream)
from .breaker import Breaker
from .client import DraftClient
from .config import RemoteConfig
from .link import Outcome as LinkOutcome, RemoteLink
from .ring import Outcome
from .supervisor import Down, Lifecycle, Spent, Supervisor, Up, proxy_environment, spawn_proxy

log = logging.getLogger("remote_dspark.engine")

STALL_ROUNDS = 3             # watchdog releases in a row that mark a live proxy stalled
DEPTH = 4                    # rounds the engine may enqueue ahead of the proxy
PROXY_START_S = 5.0          # a new proxy's start, past its first connect attempt (CONNECT_TIMEOUT_MS)
HOLD_GIL_US = 50             # process mode: spin this long holding the GIL before releasing it
STALL_SLACK_MS = 100         # heartbeat silence past max(WATCHDOG_MS, TIMEOUT_MS) + this: stalled

# The engine's round outcomes, in export order.
OUTCOMES = ("ok", "timeout", "error", "breaker_skip", "no_proxy", "watchdog", "orphan")
_FROM_RING = {Outcome.OK: "ok", Outcome.TIMEOUT: "timeout", Outcome.ERROR: "error",
              Outcome.BREAKER_SKIP: "breaker_skip", Outcome.WATCHDOG: "watchdog",
              Outcome.NO_PROXY: "no_proxy", Outcome.ORPHAN: "orphan"}
_FROM_LINK = {LinkOutcome.OK: "ok", LinkOutcome.TIMEOUT: "timeout", LinkOutcome.ERROR: "error",
              LinkOutcome.BREAKER_SKIP: "breaker_skip", LinkOutcome.BACKOFF: "error"}


class EngineState(enum.Enum):
    """``RemoteDSpark``'s lifecycle: new -> started -> closed (a failed start closes)."""

    NEW = "new"
    STARTED = "started"
    CLOSED = "closed"


class RemoteClosed(RuntimeError):
    """A round asked of a ``RemoteDSpark`` that is closed."""


class RemoteRoundFailed(RuntimeError):
    """A capacity round failed with ``ON_FAIL=raise`` (synchronous rounds only)."""


@dataclass
class Launched:
    """A round enqueued on the stream (see ``RemoteDSpark.launch``)."""

    round: int                           # 0: not sent (no proxy up): zero drafts
    tokens: torch.Tensor                 # [n, num_spec] int32 on the device; zero past counts
    counts: torch.Tensor                 # [n] int32 on the device
    resync: tuple[int, ...] = ()         # slots lost by the worker in earlier rounds
    resync_all: bool = False


LocalDrafter = Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]   # -> (tokens [n, k], counts [n])


# --------------------------------------------------------------------------- statistics

LATENCY_BOUNDS_S = tuple(b / 1e9 for b in shm.LATENCY_BOUNDS_NS)
MARGIN_BOUNDS = tuple(i / 10 for i in range(1, 11))


@dataclass
class EngineStats:
    """What the engine thread counts itself (one writer: the engine thread)."""

    rounds: Counter = field(default_factory=Counter)         # by outcome
    sources: Counter = field(default_factory=Counter)        # remote / local / none
    latency_buckets: list = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_S) + 1))
    latency_sum_s: float = 0.0
    accepted_at: list = field(default_factory=list)          # accepted drafts per position
    offered_at: list = field(default_factory=list)
    shadow_agree_at: list = field(default_factory=list)      # shadow: remote == local per position
    shadow_compared_at: list = field(default_factory=list)
    margin_buckets: list = field(default_factory=lambda: [0] * (len(MARGIN_BOUNDS) + 1))
    margin_sum: float = 0.0
    drafts: int = 0                                          # entries answered with >= 1 token
    draft_tokens: int = 0
    resyncs: int = 0

    def observe_latency(self, seconds: float) -> None:
        self.latency_buckets[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
        self.latency_sum_s += seconds

    def record(self, outcome: str, counts: np.ndarray, resyncs: int) -> None:
        """One remote round's outcome and, when it is ok, the drafts it brought."""
        self.rounds[outcome] += 1
        self.resyncs += resyncs
        if outcome == "ok":
            self.drafts += int(np.count_nonzero(counts))
            self.draft_tokens += int(counts.sum())


# --------------------------------------------------------------------------- the facade


class RemoteDSpark:
    """See the module docstring. One engine thread calls ``round``; ``stats`` may be
    called from any thread (a scrape)."""

    def __init__(self, cfg: RemoteConfig, *, num_spec: int, max_slots: int, row_bytes: int,
                 device: str = "cpu", local_drafter: LocalDrafter | None = None,
                 n_out_table: Sequence[int] | None = None, environ: Mapping[str, str] | None = None,
                 engine_id: int | None = None, depth: int = DEPTH):
        if cfg.keeps_local_drafter and local_drafter is None:
            raise ValueError(f"VLLM_DSPARK_REMOTE_POLICY={cfg.policy} needs a local drafter")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda'")
        for name, value, hi in (("num_spec", num_spec, wire.MAX_N_OUT), ("max_slots", max_slots, wire.MAX_ENTRIES),
                                ("row_bytes", row_bytes, wire.MAX_ROW_BYTES)):
            if not 1 <= value <= hi:
                raise ValueError(f"{name}={value}: must be in 1..{hi} (the wire contract's cap)")
        self.cfg = cfg
        self.num_spec = num_spec
        self.max_slots = max_slots
        self.row_bytes = row_bytes
        self.local_drafter = local_drafter
        self.n_out_table = n_out_table
        self.environ = dict(os.environ if environ is None else environ)
        self.engine_id = engine_id if engine_id is not None else int.from_bytes(os.urandom(8), "little")
        self.depth = depth
        self.max_tokens = max_slots * (CONTEXT_TOKENS + num_spec + 1)
        self.device = device
        self.mode = ("process" if cfg.async_proxy == "process" else "thread") if cfg.async_mode else "sync"
        self.stats_ = EngineStats(accepted_at=[0] * num_spec, offered_at=[0] * num_spec,
                                  shadow_agree_at=[0] * num_spec, shadow_compared_at=[0] * num_spec)
        self._round_id = 0
        self.state = EngineState.NEW
        self._path: _SyncPath | _AsyncPath | None = None
        self._final_path_stats: dict | None = None
        self._lock = threading.Lock()   # the path's stats and its close
        self.exporter = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "RemoteDSpark":
        """Open the path to the remote drafter.

        Raises:
            RuntimeError: ``start()`` again, or after ``close()`` (it runs once).
            ValueError, native.NativeError: a configuration or build problem.
            TransportError, Refused: only with ``STRICT_START=1``, when the first
                connect + HELLO fails.
        """
        if self.state is not EngineState.NEW:
            raise RuntimeError(f"start() on a {self.state.value} RemoteDSpark: it runs once")
        cfg = self.cfg
        try:
            transport.check_ready(cfg.endpoint, self.environ)   # an ofl endpoint needs its library now
            if cfg.metrics_port:
                from .metrics import Exporter
                self.exporter = Exporter(self, cfg.metrics_port, cfg.metrics_addr)
            if cfg.strict_start and self.mode != "sync":
                self._probe_connection()
            if self.mode == "sync":
                self._path = _SyncPath(self)
            else:
                try:
                    self._path = _AsyncPath(self)
                except (OSError, native.NativeError, RuntimeError) as e:
                    log.warning("remote DSpark: the async hand-off failed its self-test (%s); "
                                "falling back to synchronous rounds", e)
                    self.mode = "sync"
                    self._path = _SyncPath(self)
            self._path.start()
        except BaseException:
            self.close()   # nothing started stays running: exporter, proxy, watchdog, region
            raise
        self.state = EngineState.STARTED
        return self

    def _check_started(self, what: str) -> None:
        if self.state is EngineState.STARTED:
            return
        if self.state is EngineState.CLOSED:
            raise RemoteClosed(f"RemoteDSpark.{what}() after close()")
        raise RuntimeError(f"RemoteDSpark.{what}() before start()")

    def _probe_connection(self) -> None:
        """STRICT_START in async mode: connect + HELLO once from here, so a bad endpoint
        or identity fails the engine's start, not later in a proxy.

        Raises: TransportError, Refused, wire.ProtocolError.
        """
        cfg = self.cfg
        hello = wire.Hello(cfg.drafter_identity, cfg.markov_identity, self.engine_id, self.max_slots,
                           self.row_bytes, self.num_spec, want_margin=cfg.want_margin)
        DraftClient.connect(cfg.endpoint, hello, int.from_bytes(os.urandom(8), "little") or 1,
                            cfg.connect_timeout_ms / 1000.0, self.environ).close()

    def register_metrics(self, registry) -> None:
        """Add this engine's metrics to ``registry`` (an engine that serves /metrics)."""
        from .metrics import RemoteDSparkCollector
        registry.register(RemoteDSparkCollector(self))

    def close(self) -> None:
        """Stop the proxy and the watchdog, write the final stats file. Idempotent."""
        if self.state is EngineState.CLOSED:
            return
        self.state = EngineState.CLOSED
        if self.exporter is not None:
            self.exporter.close()
        if self._path is not None:
            with self._lock:   # a scrape in flight must not read the region as it goes
                self._final_path_stats = self._path.stats()
                self._path.close()
        self._write_stats_file()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ rounds

    def meta(self, batch: Batch) -> HostMeta:
        """``batch``'s metadata checked and cut on the host (see ``batch.host_meta``).

        Raises:
            ValueError: naming the field that is wrong.
        """
        return host_meta(batch, max_slots=self.max_slots, num_spec=self.num_spec,
                         max_tokens=self.max_tokens, n_out_default=self._n_out_for(len(batch)))

    def _n_out_for(self, n: int) -> int:
        t = self.n_out_table
        if t is None:
            return self.num_spec
        return t[min(n, len(t) - 1)]

    @property
    def wait_cpu_s(self) -> float:
        """The engine thread's CPU seconds spent inside its waits for a round's release
        (async modes on the CPU: that wait spins by design); 0 in sync mode."""
        return getattr(self._path, "wait_cpu_s", 0.0)

    def round(self, batch: Batch) -> Drafts:
        """Draft for ``batch`` under the policy.

        Raises:
            RemoteRoundFailed: capacity with ON_FAIL=raise and a failed remote round.
            RemoteClosed: after ``close()``; RuntimeError: before ``start()``.
        """
        self._check_started("round")
        policy = self.cfg.policy
        local = self.local_drafter(batch) if policy == "shadow" else None
        self._round_id = (self._round_id + 1) & 0xFFFFFFFF
        t0 = time.monotonic()
        remote = self._path.round(self._round_id, batch)
        st = self.stats_
        st.observe_latency(time.monotonic() - t0)
        st.record(remote.outcome, remote.counts.numpy(), len(remote.resync))
        ok = remote.outcome == "ok"
        if policy == "shadow":
            if ok:
                self._compare(local, remote)
            use_remote = ok and self.cfg.shadow_use == "remote"
            out = remote if use_remote else self._local_drafts(local, remote)
        elif policy == "resilience":
            out = remote if ok else self._local_drafts(self.local_drafter(batch), remote)
        else:
            if not ok and self.cfg.on_fail == "raise":
                raise RemoteRoundFailed(f"remote round {self._round_id} failed: {remote.outcome}")
            out = remote
        st.sources[out.source] += 1
        self._maybe_log()
        return out

    def launch(self, batch: Batch) -> "Launched":
        """Capacity, asynchronous, on CUDA: enqueue the round on the current stream and
        return at once. ``tokens`` / ``counts`` are device tensors valid in stream order
        (after the stream's wait for the round's release); the CPU never waits for the
        network. The round's outcome is counted once it is released, at a later launch
        or ``stats()``; slots the worker lost come back in a later ``Launched.resync``.
        """
        self._check_started("launch")
        if self.mode == "sync" or self.device != "cuda":
            raise RuntimeError("launch() is for asynchronous rounds on CUDA; use round()")
        return self._path.launch(batch)

    def _local_drafts(self, local, remote: Drafts) -> Drafts:
        tokens, counts = local
        return Drafts(tokens.to(torch.int32), counts.to(torch.int32), None, "local", remote.outcome,
                      remote.resync, remote.resync_all)

    def _compare(self, local, remote: Drafts) -> None:
        """Shadow statistics: per position, does the remote draft equal the local one
        (where both drafted that far); and the remote's margins."""
        ltok, lcnt = local
        st = self.stats_
        both = torch.minimum(lcnt.to(torch.int32), remote.counts)
        same = ltok.to(torch.int32) == remote.tokens
        for pos in range(self.num_spec):
            live = both > pos
            st.shadow_compared_at[pos] += int(live.sum())
            st.shadow_agree_at[pos] += int((same[:, pos] & live).sum())
        if remote.margins is not None:
            live = torch.arange(self.num_spec).unsqueeze(0) < remote.counts.unsqueeze(1)
            margins = remote.margins[live]
            for m in margins.tolist():
                st.margin_buckets[bisect.bisect_left(MARGIN_BOUNDS, m)] += 1
            st.margin_sum += float(margins.sum())

    def record_accepted(self, accepted: Sequence[int], offered: Sequence[int]) -> None:
        """The engine reports how many drafts it accepted (and was offered) per position."""
        for i in range(min(self.num_spec, len(accepted))):
            self.stats_.accepted_at[i] += int(accepted[i])
            self.stats_.offered_at[i] += int(offered[i])

    # ------------------------------------------------------------------ statistics

    def stats(self) -> dict:
        """Every number the JSON file, the log line and the metrics show."""
        st = self.stats_
        out = {
            "mode": self.mode, "policy": self.cfg.policy,
            "rounds": {k: st.rounds[k] for k in OUTCOMES} | {"total": sum(st.rounds.values())},
            "sources": dict(st.sources),
            "round_latency": {"bounds": list(LATENCY_BOUNDS_S), "buckets": list(st.latency_buckets),
                              "sum": st.latency_sum_s},
            "drafts": st.drafts, "draft_tokens": st.draft_tokens,
            "accepted_at": list(st.accepted_at), "offered_at": list(st.offered_at),
            "shadow_agree_at": list(st.shadow_agree_at), "shadow_compared_at": list(st.shadow_compared_at),
            "margin": {"bounds": list(MARGIN_BOUNDS), "buckets": list(st.margin_buckets), "sum": st.margin_sum},
            "resyncs": st.resyncs,
        }
        with self._lock:
            if self._final_path_stats is not None:
                out.update(self._final_path_stats)
            elif self._path is not None:
                out.update(self._path.stats())
        return out

    def _maybe_log(self) -> None:
        every = self.cfg.log_every
        total = sum(self.stats_.rounds.values())
        if every and total % every == 0:
            s = self.stats()
            r = s["rounds"]
            log.info("remote DSpark: %d rounds (%s); late %s; budget %s",
                     total, " ".join(f"{k}={r[k]}" for k in OUTCOMES if r[k]),
                     s.get("late", 0), s.get("supervisor", {}).get("budget_left", "-"))
            self._write_stats_file()

    def _write_stats_file(self) -> None:
        path = self.cfg.stats_file
        if not path:
            return
        try:
            d = os.path.dirname(os.path.abspath(path))
            fd, tmp = tempfile.mkstemp(prefix=".remote-dspark-stats.", dir=d)
            with os.fdopen(fd, "w") as f:
                json.dump(self.stats(), f, indent=1, default=str)
            os.replace(tmp, path)   # readers see the old file or the new one, whole
        except OSError as e:
            log.warning("remote DSpark: cannot write %s: %s", path, e)


# --------------------------------------------------------------------------- paths


def _to_host(batch: Batch) -> Batch:
    """``batch`` with its metadata copied to the host (a blocking round: the sync path)."""
    cpu = {f: (getattr(batch, f).cpu() if isinstance(getattr(batch, f), torch.Tensor) else getattr(batch, f))
           for f in ("slots", "tokens", "token_offsets", "positions", "new_gen", "n_out")}
    return Batch(rows=batch.rows, row_index=batch.row_index, **cpu)



class _SyncPath:
    """``ASYNC=0``: the engine thread does the network round itself."""

    def __init__(self, rd: RemoteDSpark):
        self.rd = rd
        cfg = rd.cfg
        hello = wire.Hello(cfg.drafter_identity, cfg.markov_identity, rd.engine_id, rd.max_slots,
                           rd.row_bytes, rd.num_spec, want_margin=cfg.want_margin)
        self.link = RemoteLink(cfg.endpoint, hello, int.from_bytes(os.urandom(8), "little") or 1,
                               connect_timeout_ms=cfg.connect_timeout_ms, backoff_ms=cfg.backoff_ms,
                               backoff_max_ms=cfg.backoff_max_ms, breaker=Breaker(cfg.trip, cfg.cooldown),
                               environ=rd.environ)
        self._epoch = 0
        # One send buffer for every round: header, fixed part, entry arrays, tokens; the
        # rows are gathered into their own buffer (the frame's second part).
        self._send = np.zeros(wire.HEADER.size + wire.round_meta_bytes(rd.max_slots) + 4 * rd.max_tokens,
                              dtype=np.uint8)
        self._rows = np.zeros((rd.max_slots, rd.row_bytes), dtype=np.uint8)

    def start(self) -> None:
        try:
            self.link.connect()
        except Exception as e:
            if self.rd.cfg.strict_start:
                raise
            log.warning("remote DSpark: first connection to %s failed (%s); rounds are target-only "
                        "until a reconnect succeeds", self.rd.cfg.endpoint, e)
            self.link.start_reconnecting()
        self._epoch = self.link.epoch

    def round(self, round_id: int, batch: Batch) -> Drafts:
        """One network round: the ROUND written into the send buffer (arrays copied into
        place, rows by one ``np.take``), sent as two buffers, DRAFTS read as views."""
        rd = self.rd
        meta = rd.meta(batch if not batch.meta_on_device else _to_host(batch))
        n, k = meta.n, rd.num_spec
        rows = self._rows[:n]
        if batch.rows.device.type == "cpu":
            gather_rows_host(batch, self._rows, rd.row_bytes)
        else:   # a blocking round anyway: gather on the device, one copy to the host
            rows[:] = as_bytes(batch.rows, rd.row_bytes).index_select(
                0, torch.as_tensor(batch.row_index, device=batch.rows.device)).cpu().numpy()
        size = write_meta(self._send[wire.HEADER.size:], meta, deadline_ms=rd.cfg.timeout_ms,
                          row_bytes=rd.row_bytes)
        wire.pack_header_into(self._send, wire.ROUND, size + n * rd.row_bytes, self.link.session, round_id)
        parts = (memoryview(self._send)[:wire.HEADER.size + size], memoryview(rows).cast("B"))
        result = self.link.round(round_id, parts, rd.cfg.timeout_ms)
        outcome = _FROM_LINK[result.outcome]
        d = result.drafts
        if d is not None:
            out = self._drafts(round_id, meta, d, outcome)
        else:
            out = empty_drafts(n, k, outcome, rd.cfg.want_margin)
        if self.link.epoch != self._epoch:
            self._epoch = self.link.epoch
            out.resync_all = self._epoch > 1
        return out

    def _drafts(self, round_id: int, meta: HostMeta, d: wire.Drafts, outcome: str) -> Drafts:
        """The worker's DRAFTS as ``Drafts``, or an empty ERROR answer when they do not
        fit the round (other entries, other slots, wider than num_spec)."""
        rd, n = self.rd, meta.n
        slots = np.frombuffer(d.slots, dtype=np.uint32)
        if len(slots) != n or not np.array_equal(slots, meta.slots) or d.width > rd.num_spec:
            log.error("remote DSpark: round %d: the worker answered %d entries x %d for slots that are "
                      "not the round's (%d entries, num_spec %d); dropped", round_id, len(slots), d.width,
                      n, rd.num_spec)
            return empty_drafts(n, rd.num_spec, "error", rd.cfg.want_margin)
        counts = np.frombuffer(d.counts, dtype=np.uint16)
        tokens = np.frombuffer(d.tokens, dtype=np.int32).reshape(n, d.width)
        margins = None if d.margins is None else np.frombuffer(d.margins, dtype=np.float32).reshape(n, d.width)
        return to_drafts(rd.num_spec, meta.slots, counts, np.frombuffer(d.statuses, dtype=np.uint16), tokens,
                         margins, outcome, rd.cfg.want_margin)

    def stats(self) -> dict:
        b = self.link.breaker.store
        return {"late": self.link.late, "attempts": self.link.attempts, "reconnects": self.link.reconnects,
                "breaker": {"state": int(b.state), "trips": b.trips, "probes": b.probes},
                "connected": self.link.connected}

    def close(self) -> None:
        self.link.close()


class _AsyncPath:
    """``ASYNC=1``: rounds through the shared region, answered by a proxy thread or a
    supervised proxy process. Building it is the self-test: the native library loads,
    the region maps, the watchdog starts, and on CUDA the region registers and the
    stream's hand-off answers a probe.

    While no proxy is up (process mode) a round does not touch the ring: the engine
    thread answers it at once with zero drafts. Rounds already handed over when a proxy
    is lost are answered by the supervisor's thread (``_on_change``).
    """

    def __init__(self, rd: RemoteDSpark):
        self.rd = rd
        cfg = rd.cfg
        self.lib = native.load(rd.environ)
        self.region = shm.Region.create(shm.Layout(rd.depth, rd.max_slots, rd.row_bytes, rd.num_spec,
                                                   rd.max_tokens))
        lay = self.region.layout
        try:
            self.end = ring.EngineEnd(self.region, self.lib)
            self.watchdog = self.end.start_watchdog(cfg.watchdog_ms)
            # Process mode on the CPU: the proxy answers within microseconds, so the
            # engine thread keeps its GIL for the first 50 us of the wait and, in the
            # common case, never hands it to another engine thread mid-round
            # (docs/handoff.md). Thread mode must release it at once: its proxy needs it.
            self.sync = streamsync.HostFlagSync(
                self.region, self.lib, backend=rd.device, spin_us=cfg.async_spin_us, nap_us=cfg.async_nap_us,
                hold_gil_us=HOLD_GIL_US if rd.mode == "process" and rd.device == "cpu" else 0)
            self._host = [_HostViews(self.region, i) for i in range(rd.depth)]
            if rd.device == "cuda":
                view = self.sync.backend.device_view
                self._staging = [view(lay.staging(i), (rd.max_slots, rd.row_bytes), torch.uint8)
                                 for i in range(rd.depth)]
                self._desc = [view(lay.desc(i) + shm.DESC_FIXED, ((lay.desc_stride - shm.DESC_FIXED) // 4,),
                                   torch.int32) for i in range(rd.depth)]
                self._tokens = [view(lay.drafts(i) + lay.d_tokens, (rd.max_slots, rd.num_spec), torch.int32)
                                for i in range(rd.depth)]
                self._counts = [view(lay.drafts(i) + shm.D_COUNTS, (rd.max_slots,), torch.int32)
                                for i in range(rd.depth)]
            from .gather import choose
            self._gather = choose(cfg.fused_gather, rd.device)
        except BaseException:
            self._drop_views()
            self.region.close()
            raise
        self.supervisor: Supervisor | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._switch_interval: float | None = None
        self._resync_all = False
        self._resync: set[int] = set()    # CUDA: slots lost in rounds collected since the last launch
        self._pending: list[int] = []     # CUDA: rounds launched, not yet collected
        # When the engine thread saw each of the last STALL_ROUNDS rounds in a row that the
        # watchdog answered (empty after any other outcome). Its one writer is the engine
        # thread; the supervisor's stall verdict only reads it (one tuple: one atomic read).
        self._watchdog_seen: tuple[float, ...] = ()
        self._last_session = 0
        self._thread_started_ns = 0
        self._thread_lost = False
        self.max_wait_s = 0.0             # longest hand-off wait of the engine thread (CPU)
        self.wait_cpu_s = 0.0             # the engine thread's CPU inside those waits (they spin)

    _host: list = []
    _staging: list = []
    _desc: list = []
    _tokens: list = []
    _counts: list = []

    def _drop_views(self) -> None:
        """Forget every view of the region (numpy and device), so it can be unmapped."""
        self._host = self._staging = self._desc = self._tokens = self._counts = []

    # ------------------------------------------------------------------ proxies

    def start(self) -> None:
        if self.rd.mode == "thread":
            self._start_thread()
        else:
            env = proxy_environment(self.rd.environ, self.lib.path)
            cfg = self.rd.cfg
            self.supervisor = Supervisor(
                lambda session: self._spawn(session, env), respawns=cfg.async_respawns,
                reset_s=cfg.async_respawn_reset_s, stalled=self._stalled, on_change=self._on_change)
            self.supervisor.start()
        limit_s = self._start_limit_s()
        if not self.wait_serving(limit_s):
            log.warning("remote DSpark: no proxy serving %.1f s after start; rounds are target-only "
                        "until one does", limit_s)

    def _start_thread(self) -> None:
        from .proxy_proc import ProxyLoop
        us = self.rd.cfg.switch_interval_us
        if us:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(us / 1e6)
        self.end.header.set_session(int.from_bytes(os.urandom(8), "little") or 1)
        loop = ProxyLoop(self.region, self.lib, self.rd.cfg, engine_id=self.rd.engine_id, environ=self.rd.environ)
        self._thread = threading.Thread(target=loop.run, args=(self._stop.is_set,), name="remote-dspark-proxy",
                                        daemon=True)
        self._thread_started_ns = time.monotonic_ns()
        self._thread.start()

    def _spawn(self, session: int, env: Mapping[str, str]):
        self.end.header.set_session(session)
        return spawn_proxy(self.region.fd, cfg=self.rd.cfg, engine_id=self.rd.engine_id, env=env)

    def _on_change(self, state: Lifecycle) -> None:
        """From the supervisor's thread. A lost proxy's rounds are answered at once."""
        if isinstance(state, (Down, Spent)):
            self.end.release_orphans()
            self._drain(time.monotonic() + self.rd.cfg.watchdog_ms / 1000.0)
        elif isinstance(state, Up):
            self._resync_all = self._last_session != 0
            self._last_session = state.session

    def _drain(self, deadline: float) -> None:
        """Answer (no proxy) every round handed over so far, each once its stream has
        gathered it, until ``deadline``. Rounds not gathered by then are the watchdog's.
        Only gathered rounds are answered: the stream has finished with the drafts slot
        such a round reuses."""
        last = self.end.last
        r = ring.seq_add(self.end.released(), 1)
        while ring.seq_geq(last, r):
            left = deadline - time.monotonic()
            rc = self.lib.wait_geq(self.region.addr(self.region.layout.gathered), r, 100, 100,
                                   native.deadline_ns(max(left, 0.0)))
            if rc != native.Status.OK:
                return
            self.end.release_no_proxy(r)
            r = ring.seq_add(r, 1)

    def _count_watchdog(self, outcome: str) -> None:
        """Engine thread: one more round in a row the watchdog answered, or the end of a run."""
        seen = self._watchdog_seen
        self._watchdog_seen = (seen + (time.monotonic(),))[-STALL_ROUNDS:] if outcome == "watchdog" else ()

    def _start_limit_s(self) -> float:
        """How long a new proxy may take to beat first: its interpreter's start plus its
        first connect attempt."""
        return self.rd.cfg.connect_timeout_ms / 1000.0 + PROXY_START_S

    def _stalled(self, up: Up) -> bool:
        """From the supervisor's thread: is the live proxy ``up`` no longer serving?"""
        now = time.monotonic_ns()
        beat = self.end.header.heartbeat_ns
        if beat < up.since * 1e9:   # no beat from this proxy yet: it is still starting
            # It beats first after its first connect attempt, which may take the whole
            # CONNECT_TIMEOUT_MS (a worker that accepts and never answers): still connecting
            # is not stalled.
            return now - up.since * 1e9 > self._start_limit_s() * 1e9
        seen = self._watchdog_seen
        if len(seen) >= STALL_ROUNDS and seen[0] >= up.since:   # all of them during this proxy's life
            return True
        # A live proxy beats at least every idle tick and after every round, and a round
        # keeps it off the heartbeat for at most TIMEOUT_MS (its network wait).
        cfg = self.rd.cfg
        silent_ms = max(cfg.watchdog_ms, cfg.timeout_ms) + STALL_SLACK_MS
        pending = self.end.gathered() != self.end.released()
        return pending and now - beat > silent_ms * 1_000_000

    # ------------------------------------------------------------------ rounds

    def _serving(self) -> bool:
        """A proxy is up and has beaten since it started (it beats first after its
        first connection attempt): until then rounds are answered here, at once."""
        if self.supervisor is not None:
            up = self.supervisor.up
            return up is not None and self.end.header.heartbeat_ns >= up.since * 1e9
        if not self._thread.is_alive():
            if not self._thread_lost:
                self._thread_lost = True
                log.error("remote DSpark: the proxy thread died; every round is target-only from now on")
            return False
        return self.end.header.heartbeat_ns >= self._thread_started_ns

    def _no_proxy(self) -> bool:
        if self._serving():
            return False
        self.end.counters.add("no_proxy_rounds")
        return True

    def wait_serving(self, timeout_s: float) -> bool:
        """Wait (bounded) for the first proxy to serve, so the first rounds reach it."""
        deadline = time.monotonic() + timeout_s
        while not self._serving():
            if time.monotonic() > deadline or (self.supervisor is not None and self.supervisor.stats().state == "spent"):
                return False
            time.sleep(0.005)
        return True

    def _hand_over(self, batch: Batch, stream: int | None = None) -> tuple[int, HostMeta | None]:
        """Reserve a round, write its descriptor and rows, signal ``gathered`` and have
        the stream (or, on the CPU, this thread) wait for ``released``: the round id and
        the host metadata (None when it stayed on the device)."""
        rd, cfg = self.rd, self.rd.cfg
        on_device = batch.meta_on_device
        if on_device and rd.device != "cuda":
            raise ValueError("batch metadata on a device, but RemoteDSpark runs on the CPU")
        meta = None if on_device else rd.meta(batch)
        r = self.end.reserve(cfg.watchdog_ms / 1000.0 * (rd.depth + 1))
        i = r & (rd.depth - 1)
        try:
            self._collect()
            self._host[i].round_word[0] = r
            if meta is None:
                self._write_device_meta(batch, i, cfg.timeout_ms)
            else:
                write_meta(self._host[i].desc, meta, deadline_ms=cfg.timeout_ms, row_bytes=rd.row_bytes)
            if rd.device == "cpu":
                gather_rows_host(batch, self._host[i].staging, rd.row_bytes, self.lib,
                                 self.region.addr(self.region.layout.staging(i)))
            else:
                as_bytes(batch.rows, rd.row_bytes)   # checks the row size
                index = batch.row_index
                if not isinstance(index, torch.Tensor) or index.device != batch.rows.device:
                    index = torch.as_tensor(index, device=batch.rows.device)
                self._gather(batch.rows, index, self._staging[i])
        except BaseException as e:
            self.end.unreserve(r)   # never gathered: no hole in the round sequence
            # The callees' frames hold views of the region; a caller keeping this traceback
            # must not keep the region from being unmapped at close().
            traceback.clear_frames(e.__traceback__)
            raise
        self.sync.signal(r, stream)
        return r, meta

    def _write_device_meta(self, batch: Batch, i: int, deadline_ms: int) -> None:
        """Write metadata that lives on the device into descriptor ``i`` in stream order
        (``batch.write_meta_in_stream``), with no host sync; the fixed part is the host's.

        Raises:
            ValueError: shapes that disagree, or more entries or tokens than a round holds.
        """
        rd = self.rd
        n = check_meta_shapes(batch, rd.max_slots)
        self._host[i].desc[:16].view(np.uint32)[:] = (deadline_ms, n, rd.row_bytes, 0)
        write_meta_in_stream(batch, self._desc[i], max_slots=rd.max_slots, num_spec=rd.num_spec,
                             max_tokens=rd.max_tokens, n_out_default=rd._n_out_for(n))

    def round(self, round_id_unused: int, batch: Batch) -> Drafts:
        """The CPU stand-in: this thread waits for the release (the watchdog bounds it)."""
        rd, cfg = self.rd, self.rd.cfg
        n = len(batch)
        if self._no_proxy():
            return empty_drafts(n, rd.num_spec, "no_proxy", cfg.want_margin)
        t0 = time.monotonic()
        r, meta = self._hand_over(batch)
        if rd.device == "cuda":
            self.sync.wait(r, 0)
            torch.cuda.current_stream().synchronize()
        else:
            limit_s = 2 * cfg.watchdog_ms / 1000.0 + 1.0   # far past the watchdog: a broken ring
            c0 = time.thread_time()
            released = self.sync.wait(r, limit_s)
            self.wait_cpu_s += time.thread_time() - c0
            if not released:
                raise RuntimeError(f"round {r} was not released within {limit_s:.3f} s "
                                   f"(watchdog {cfg.watchdog_ms} ms)")
        self.max_wait_s = max(self.max_wait_s, time.monotonic() - t0)
        outcome, out = self._answer(r, n)
        self._count_watchdog(outcome)
        if self._resync_all:
            self._resync_all = False
            out.resync_all = True
        return out

    def _head(self, r: int) -> tuple[str, int, int]:
        """Released round ``r``'s outcome, entry count and flags, from its drafts slot.
        (No view is bound here: a caller keeping the exception must not keep the region.)

        Raises:
            RuntimeError: the slot holds another round (read after it was reused).
        """
        rnd, status, got, flags = self._host[r & (self.rd.depth - 1)].head.tolist()
        if rnd != r:
            raise RuntimeError(f"drafts slot {r & (self.rd.depth - 1)} holds round {rnd}, expected {r}: "
                               "read after the slot was reused")
        return _FROM_RING[Outcome(status)], got, flags

    def _answer(self, r: int, n: int) -> tuple[str, Drafts]:
        """Released round ``r``'s answer as ``Drafts``: views of its drafts slot, one
        copy per array. Raises as ``_head``."""
        rd = self.rd
        outcome, got, flags = self._head(r)
        if not got:   # an empty answer (timeout, error, watchdog, ...)
            return outcome, empty_drafts(n, rd.num_spec, outcome, rd.cfg.want_margin)
        v = self._host[r & (rd.depth - 1)]
        return outcome, to_drafts(rd.num_spec, v.slots(got), v.counts[:got], v.statuses[:got], v.tokens[:got],
                                  v.margins[:got] if flags & shm.DRAFTS_MARGINS else None, outcome,
                                  rd.cfg.want_margin, clean=True)

    def launch(self, batch: Batch) -> Launched:
        rd = self.rd
        n, k = len(batch), rd.num_spec
        resync, self._resync = tuple(sorted(self._resync)), set()
        resync_all, self._resync_all = self._resync_all, False
        if self._no_proxy():
            rd.stats_.record("no_proxy", np.zeros(0, dtype=np.int32), 0)
            zeros = torch.zeros(n, k, dtype=torch.int32, device="cuda")
            return Launched(0, zeros, zeros[:, 0].clone(), resync, resync_all)
        stream = torch.cuda.current_stream().cuda_stream   # once: each lookup costs microseconds
        r, _ = self._hand_over(batch, stream)
        self.sync.wait(r, 0, stream)
        i = r & (rd.depth - 1)
        # Copies in stream order (the slot is reused DEPTH rounds later). Every answer
        # leaves the tokens block zero past each count (ring.geometry, hf_unpack): no mask.
        counts = self._counts[i][:n].clone()
        tokens = self._tokens[i][:n].clone()
        self._pending.append(r)
        return Launched(r, tokens, counts, resync, resync_all)

    def _collect(self) -> None:
        """Count the outcome of every launched round released by now (engine thread);
        the slots the worker lost are read from the round's own descriptor. No tensor
        is built: a few numpy reads of the drafts slot per round."""
        released = self.end.released()
        while self._pending and ring.seq_geq(released, self._pending[0]):
            r = self._pending.pop(0)
            outcome, got, _ = self._head(r)
            v = self._host[r & (self.rd.depth - 1)]
            lost = v.slots(got)[v.statuses[:got] == wire.STATUS_RESYNC].tolist()
            self._resync.update(lost)
            self.rd.stats_.record(outcome, v.counts[:got], len(lost))
            self._count_watchdog(outcome)

    def stats(self) -> dict:
        proxy = self.region.proxy_counters(self.lib).snapshot()
        engine = self.region.engine_counters(self.lib).snapshot()
        b = self.end.header.breaker()
        out = {"late": proxy.counters["rounds_late"], "attempts": proxy.counters["attempts"],
               "reconnects": proxy.counters["reconnects"],
               "proxy_counters": dict(proxy.counters), "engine_counters": dict(engine.counters),
               "handoff_latency": _hist(proxy.histograms["handoff_latency"]),
               "proxy_round_latency": _hist(proxy.histograms["round_latency"]),
               "breaker": {"state": b.state, "trips": b.trips, "probes": b.probes},
               "session": self.end.header.session, "max_wait_s": self.max_wait_s,
               "ring": {"gathered": self.end.gathered(), "released": self.end.released()}}
        if self.supervisor is not None:
            s = self.supervisor.stats()
            out["supervisor"] = {"state": s.state, "pid": s.pid, "spawns": s.spawns, "restarts": s.restarts,
                                 "budget_left": s.budget_left, "budget_restored": s.budget_restored,
                                 "proxy_rss_bytes": s.proxy_rss_bytes, "proxy_cpu_seconds": s.proxy_cpu_seconds}
        if self._thread is not None:
            out["proxy_thread_alive"] = self._thread.is_alive()
        return out

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.close()
        if self._thread is not None:
            self._stop.set()
            # The loop checks its stop flag every idle tick; a round or a connect keeps it
            # away for at most TIMEOUT_MS or CONNECT_TIMEOUT_MS.
            cfg = self.rd.cfg
            self._thread.join((cfg.timeout_ms + cfg.connect_timeout_ms) / 1000.0 + 1.0)
            if self._switch_interval is not None:
                sys.setswitchinterval(self._switch_interval)
            if self._thread.is_alive():   # never unmap under a live proxy thread
                log.error("remote DSpark: the proxy thread did not stop; leaving the region mapped")
                return
        if self.rd.device == "cuda":
            # Never leave the stream parked: answer what it still waits for, let it
            # finish, then unregister (the region's close hook) and unmap.
            self._drain(time.monotonic() + self.rd.cfg.watchdog_ms / 1000.0 + 1.0)
            torch.cuda.current_stream().synchronize()
            self._collect()
        self._drop_views()
        self.region.close()


class _HostViews:
    """numpy views of one depth slot of the region: the descriptor's payload area, the
    staging rows and the drafts slot's arrays. Dropped before the region is unmapped."""

    def __init__(self, region: shm.Region, i: int):
        lay = region.layout
        S, K = lay.max_slots, lay.num_spec

        def arr(offset: int, count: int, dtype) -> np.ndarray:
            return np.frombuffer(region.view(offset, count * np.dtype(dtype).itemsize), dtype=dtype)

        self.round_word = arr(lay.desc(i) + shm.DESC_ROUND, 1, np.uint32)
        self.desc = arr(lay.desc(i) + shm.DESC_FIXED, lay.desc_stride - shm.DESC_FIXED, np.uint8)
        self.staging = arr(lay.staging(i), S * lay.row_bytes, np.uint8).reshape(S, lay.row_bytes)
        d = lay.drafts(i)
        self.head = arr(d, 4, np.uint32)   # round, status, n_entries, flags (shm.DRAFTS_HEAD)
        self.counts = arr(d + shm.D_COUNTS, S, np.int32)
        self.statuses = arr(d + lay.d_entry_status, S, np.int32)
        self.tokens = arr(d + lay.d_tokens, S * K, np.int32).reshape(S, K)
        self.margins = arr(d + lay.d_margins, S * K, np.float32).reshape(S, K)

    def slots(self, n: int) -> np.ndarray:
        """The round's slots, as its descriptor holds them (the wire's slots section)."""
        return self.desc[wire.ROUND_FIXED.size:wire.ROUND_FIXED.size + 4 * n].view(np.uint32)


def _hist(h: shm.Histogram) -> dict:
    """A region histogram in seconds: bounds, per-bucket counts (last: +Inf), sum."""
    return {"bounds": [b / 1e9 for b in h.bounds_ns], "buckets": list(h.buckets), "sum": h.sum_ns / 1e9}

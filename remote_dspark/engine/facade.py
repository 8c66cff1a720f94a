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
its release inside the native library (GIL released); the watchdog bounds that wait. The
mode (``config.mode.Mode``) is decided once from the configuration, and ``start()`` opens
the one round path of that mode (``engine.paths.base``); the facade only calls it.

With ``tp_group`` (a torch.distributed group) every tensor-parallel rank builds one:
rank 0 of the group opens the path, the others open nothing and take rank 0's answer
(``engine.tp.ranks``); ``launch()`` is not offered there.

torch is imported here (the engine side); nothing the proxy imports imports this module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from .. import native, transport, wire
from ..config.api import RemoteConfig, n_out_table
from ..config.mode import Mode
from ..supervisor.restarts import Supervisor
from ..transport.client import DraftClient
from . import policies
from .lifecycle import EngineState, Lifecycle, RemoteClosed
from .observe import report
from .observe.stats import EngineCounts, Stats
from .paths.announcing import AnnouncingPath
from .paths.asynchronous import AsyncPath
from .paths.base import NothingOpen, Path
from .paths.redraw import RedrawPath
from .paths.sync import SyncPath
from .spec import Spec, check_arguments, default_round_tokens
from .tp.ranks import Ranks, shares_failure
from .values.batch import CONTEXT_TOKENS, Batch, HostMeta
from .values.drafts import Drafts, Launched

log = logging.getLogger("remote_dspark.engine")

DEPTH = 4  # rounds the engine may enqueue ahead of the proxy
CLOSE_S = 1.5  # close: how long rounds in flight have to leave (close returns within 2 s)

LocalDrafter = Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]  # -> (tokens [n, k], counts [n])


class RemoteDSpark:
    """See the module docstring. One engine thread calls ``round`` / ``launch``;
    ``stats`` and ``close`` may be called from any thread."""

    def __init__(
        self,
        cfg: RemoteConfig,
        *,
        num_spec: int,
        max_slots: int,
        row_bytes: int,
        device: str = "cpu",
        local_drafter: LocalDrafter | None = None,
        depth_mode: str | None = None,
        depth_file: str | None = None,
        dense_cap: Sequence[int] | None = None,
        environ: Mapping[str, str] | None = None,
        engine_id: int | None = None,
        depth: int = DEPTH,
        vocab_size: int | None = None,
        tp_group=None,
        context_tokens: int = CONTEXT_TOKENS,
        round_tokens: int | None = None,
    ):
        """``vocab_size``: the target model's vocabulary (token ids 0..vocab_size-1), or
        None when unknown. It goes to the worker in HELLO (0 there when unknown; a worker
        whose drafter's vocabulary is larger refuses) and bounds every token id: a batch's
        (``ValueError`` naming ``tokens``) and a reply's (the round is an ERROR).
        ``depth_mode``, ``depth_file``, ``dense_cap``: the engine's depth-policy facts
        (as ``config.n_out_table`` takes them), which set each round's n_out.
        ``tp_group``: a tensor-parallel process group; only its rank 0 talks to the remote
        drafter, and every rank gets the same drafts (``engine.tp.ranks``).
        ``context_tokens``: the engine's cap on a NEW_GEN context (its last tokens sent,
        the position moved to the first of them); a batch carries at most ``max_slots x
        (context_tokens + num_spec + 1)`` tokens. A context is cut to the smaller of the
        cap and the window the worker's HELLO_ACK names, and before any HELLO_ACK to the
        smaller of the cap and a default worker's 64 (``Spec.context_cut``).
        ``round_tokens``: the most tokens one round carries (the region's token section);
        a batch of more goes over the next rounds, its long contexts in chunks
        (``engine.values.announce``). None: ``spec.default_round_tokens``, a round of
        ``max_slots`` whole contexts of the default cap (64), at least one whole context.

        Raises:
            ValueError: an argument out of range, naming it.
        """
        check_arguments(
            cfg, local_drafter, device, num_spec, max_slots, row_bytes, vocab_size, context_tokens, round_tokens
        )
        if round_tokens is None:
            round_tokens = default_round_tokens(max_slots, num_spec, context_tokens)
        # n_out by schedule: each round's default n_out from its number of requests, when
        # the depth policy masks the positions past its cap (config.n_out_table's rules;
        # shadow and N_OUT=0 always send every position). A batch's own n_out wins.
        table, self.n_out_reason = n_out_table(
            cfg, num_spec, depth_mode or "", depth_file, list(dense_cap) if dense_cap is not None else None
        )
        self.spec = Spec(
            cfg=cfg,
            num_spec=num_spec,
            max_slots=max_slots,
            row_bytes=row_bytes,
            max_tokens=int(round_tokens),
            depth=depth,
            device=device,
            mode=Mode.of(cfg),
            engine_id=engine_id if engine_id is not None else wire.random_id(),
            environ=dict(os.environ if environ is None else environ),
            n_out_table=table,
            vocab_size=int(vocab_size or 0),
            context_tokens=int(context_tokens),
        )
        self.local_drafter = local_drafter
        self.counts = EngineCounts(num_spec)
        self._life = Lifecycle()  # the state, changed under _lock; FORKED in a forked child
        self._path: Path = NothingOpen()  # the one way to the remote drafter, picked at start
        self._announcing: AnnouncingPath | None = None  # within _path, where this rank plans rounds
        self._final: Stats | None = None
        self._lock = threading.Lock()  # state changes, and stats() against close()
        self._start_lock = threading.Lock()  # start() and close() one at a time
        self.exporter = None
        # Tensor parallel (engine.tp.ranks): rank 0 of tp_group opens the path, the others follow it.
        self._ranks = Ranks(tp_group) if tp_group is not None else None
        # Tensor parallel: rank 0 writes the stats file (who that is, start() learns).
        self._report = report.Report(cfg.log_every, cfg.stats_file, lambda: self._ranks is None or self._ranks.leader)

    # The facts callers read.
    cfg = property(lambda self: self.spec.cfg)
    num_spec = property(lambda self: self.spec.num_spec)
    max_slots = property(lambda self: self.spec.max_slots)
    row_bytes = property(lambda self: self.spec.row_bytes)
    device = property(lambda self: self.spec.device)
    engine_id = property(lambda self: self.spec.engine_id)
    vocab_size = property(lambda self: self.spec.vocab_size or None)
    context_tokens = property(lambda self: self.spec.context_tokens)
    round_tokens = property(lambda self: self.spec.max_tokens)

    state = property(lambda self: self._life.state, doc="The engine's ``lifecycle.EngineState``.")

    @property
    def mode(self) -> Mode:
        """The mode running: sync, thread or process (sync after a failed self-test; on a
        tensor-parallel rank other than 0, rank 0's)."""
        return self.spec.mode

    @property
    def supervisor(self) -> Supervisor | None:
        """Process mode: the proxy's supervisor (for tools that watch or fault it)."""
        return self._path.supervisor

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> RemoteDSpark:
        """Open the path to the remote drafter.

        Raises:
            RuntimeError: ``start()`` again, or after ``close()`` (it runs once).
            RemoteForked: in a child forked after the parent's start.
            ValueError, native.NativeError: a configuration or build problem.
            TransportError, Refused: only with ``STRICT_START=1``, when the first
                connect + HELLO fails.
            With a ``tp_group``: ValueError when the configuration differs across its
                ranks, and whatever rank 0 raised, on every rank.
        """
        self._life.refuse_forked("start")
        with self._start_lock:
            with self._lock:
                if self.state is not EngineState.NEW:
                    raise RuntimeError(f"start() on a {self.state.value} RemoteDSpark: it runs once")
                self._life.to(EngineState.STARTING)
            cfg = self.cfg
            cfg.log_warnings(self.spec.environ)
            log.info(
                "remote DSpark: n_out %s (%s)",
                "by request count" if self.spec.n_out_table else f"= num_spec ({self.num_spec})",
                self.n_out_reason,
            )
            try:
                if self._ranks is None:
                    self._open()
                else:  # tensor parallel: every rank compares its config, rank 0 opens, the others follow
                    follower = self._ranks.start(self.spec, lambda: self._open(), lambda: self.mode, self.counts)
                    if follower is not None:
                        self.spec, self._path = follower.spec, follower
            except BaseException:
                self._close()  # nothing started stays running: exporter, proxy, watchdog, region
                raise
            with self._lock:
                self._life.to(EngineState.STARTED)
        return self

    def _open(self) -> None:
        cfg = self.cfg
        transport.check_ready(cfg.endpoint, self.spec.environ)  # an ofl endpoint needs its library now
        if cfg.metrics_port:
            from .observe.metrics import Exporter

            self.exporter = Exporter(self, cfg.metrics_port, cfg.metrics_addr)
        if cfg.strict_start and self.mode.handoff:
            self._probe_connection()
        path = AnnouncingPath(self._build_path(), self.spec)  # rounds of at most round_tokens
        self._announcing = path  # release() goes to it (rank 0's: a follower rank plans nothing)
        # SAMPLED_REDRAW: rank 0's path (this one) redraws, so every rank gets the same drafts.
        self._path = RedrawPath(path) if cfg.sampled_redraw else path
        self._path.start()  # a failure here closes the path with the engine

    def _build_path(self) -> Path:
        """The path of the mode: the async one when its self-test passes, else sync (and
        the engine runs sync from now on)."""
        if self.mode.handoff:
            try:
                return AsyncPath(self.spec, self.counts)
            except (OSError, native.NativeError, RuntimeError) as e:
                log.warning(
                    "remote DSpark: the async hand-off failed its self-test (%s); falling back to synchronous rounds", e
                )
                self.spec = dataclasses.replace(self.spec, mode=Mode.SYNC)
        return SyncPath(self.spec)

    def _probe_connection(self) -> None:
        """STRICT_START in async mode: connect + HELLO once from here, so a bad endpoint
        or identity fails the engine's start, not later in a proxy.

        Raises: TransportError, Refused, wire.ProtocolError.
        """
        cfg = self.cfg
        DraftClient.connect(
            cfg.endpoint,
            self.spec.hello(),
            wire.random_id(),
            cfg.connect_timeout_ms / 1000.0,
            self.spec.environ,
            key=cfg.key,
        ).close()

    def register_metrics(self, registry) -> None:
        """Add this engine's metrics to ``registry`` (an engine that serves /metrics)."""
        from .observe.metrics import RemoteDSparkCollector

        registry.register(RemoteDSparkCollector(self))

    def close(self) -> None:
        """Stop the proxy, answer every round in flight (target-only), write the final
        stats file; within 2 s whatever the proxy or the worker is doing. Idempotent;
        any thread.

        Rounds in flight are not waited for: each is released here, through the claim
        the watchdog uses, and its thread leaves the region before anything is unmapped
        (``lifecycle.Users``: the last user out frees it). Views of the region still
        alive (a round's exception's traceback) keep only its mapping (``Region.close``).
        In a forked child (``FORKED``) it returns at once: all of it is the parent's."""
        if self._life.forked:  # before any lock: one may have been held by a thread fork did not copy
            return
        with self._start_lock:  # a start in progress ends first (within its own deadlines)
            self._close()

    def _close(self) -> None:
        with self._lock:
            if self.state in (EngineState.CLOSING, EngineState.CLOSED):
                return
            self._life.to(EngineState.CLOSING)
        try:
            if self.exporter is not None:
                self.exporter.close()
            self._path.stop(CLOSE_S)
        finally:
            with self._lock:
                self._final = final = self._snapshot()
                self._life.to(EngineState.CLOSED)
            try:
                self._report.write(final)
            finally:
                self._path.users.leave()  # the owner: frees now, or when the last round leaves

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ rounds

    def meta(self, batch: Batch) -> HostMeta:
        """``batch``'s metadata checked and cut on the host (see ``meta.host_meta``), its
        NEW_GEN contexts as the next round's would be (``Spec.context_cut``).

        Raises:
            ValueError: naming the field that is wrong.
        """
        return self.spec.meta(batch, self._path.acked_context, max_tokens=self.spec.batch_tokens)

    @property
    def wait_cpu_s(self) -> float:
        """The engine thread's CPU seconds spent inside its waits for a round's release
        (async modes on the CPU: that wait spins ASYNC_SPIN_US, then sleeps); 0 in sync mode."""
        return self._path.wait_cpu_s

    def _enter(self, what: str) -> None:
        """A round's way in: it may touch the path until its ``users.leave()``."""
        if self.state is EngineState.STARTED and self._path.users.enter():
            return
        self._life.refuse_forked(what)
        if self.state in (EngineState.NEW, EngineState.STARTING):
            raise RuntimeError(f"RemoteDSpark.{what}() before start() returned")
        raise RemoteClosed(f"RemoteDSpark.{what}() after close()")

    def round(self, batch: Batch) -> Drafts:
        """Draft for ``batch`` under the policy.

        Raises:
            RemoteRoundFailed: capacity with ON_FAIL=raise and a failed remote round.
            RemoteClosed: after (or during) ``close()``; RuntimeError: before ``start()``.
            RemoteForked: in a child forked after the parent's start (before any collective).
            With a ``tp_group``, whatever rank 0 raised before its answer went out, on every rank.
        """
        self._life.refuse_forked("round")
        return self._round_shared(batch)

    @shares_failure
    def _round_shared(self, batch: Batch) -> Drafts:
        self._enter("round")
        try:
            out = self._round(batch)
            self._report.round_done(self.stats)
            return out
        finally:
            self._path.users.leave()

    def _round(self, batch: Batch, share: bool = True) -> Drafts:
        """The policy's round: the remote answer (rank 0's under tensor parallelism, shared
        as a round() record unless a launch() record will carry it), the local drafter where
        the policy asks for it, counted."""
        policy = self.cfg.policy
        local = self.local_drafter(batch) if policy == "shadow" else None
        t0 = time.monotonic()
        remote = self._ranks.share(self._path, batch) if share and self._ranks is not None else self._path.round(batch)
        st = self.counts
        st.observe_latency(time.monotonic() - t0)
        st.record(remote.outcome, remote.counts, len(remote.resync), remote.sums)
        out = policies.choose(self.cfg, st, self.num_spec, remote, local, lambda: self.local_drafter(batch))
        st.source(out.source)
        return out

    def launch(self, batch: Batch) -> Launched:
        """Capacity, asynchronous, on CUDA: enqueue the round on the current stream and
        return at once. ``tokens`` / ``counts`` are device tensors valid in stream order
        (after the stream's wait for the round's release); the CPU never waits for the
        network. The round's outcome is counted once it is released, at a later launch;
        slots the worker lost come back in a later ``Launched.resync``. In sync mode
        (``ASYNC=0``, or after a failed self-test) the round runs now, blocking, and comes
        back completed with the same shapes, on the rows' device (the current CUDA device
        for a batch without rows). The slots still announced (no drafts yet): host metadata's
        in ``announcing``; device metadata's always in ``announcing_mask`` (a tensor).

        With a ``tp_group``, on every rank, rank 0's drafts, ``outcome`` and ``resync_mask``
        in stream order (``engine.tp.launch``: no rank's host waits); another rank's
        ``round``, ``resync``, ``resync_all`` and ``announcing`` are None (``announcing_mask``
        says it in stream order on every rank).

        Raises:
            RemoteClosed: after (or during) ``close()``; RuntimeError: before ``start()``,
                or on the CPU (with a ``tp_group``, on every rank alike, before any collective).
            RemoteForked: in a child forked after the parent's start.
            ValueError: a batch of more than ``max_slots`` entries (on every rank); on a
                rank other than 0, an earlier round of rank 0's of another size.
        """
        self._life.refuse_forked("launch")
        if self._ranks is None or self.device != "cuda":
            return self._launch(batch)
        return self._ranks.launch(self.spec, batch, self._launch)

    def _launch(self, batch: Batch, out=(), status=None) -> Launched:
        self._enter("launch")
        try:
            if self.device != "cuda":
                raise RuntimeError("launch() is for rounds on CUDA (device='cuda'); use round()")
            launched = self._path.launch(batch, lambda b: self._round(b, share=False), out, status)
            self._report.round_done(self.stats)
            return launched
        finally:
            self._path.users.leave()

    def release(self, slots: Sequence[int]) -> None:
        """The engine freed ``slots`` (their requests ended): a context still being
        announced there is let go, never sent (``engine.values.announce``); the slot's next
        request comes NEW_GEN. Call it on the engine thread (the one calling ``round`` and
        ``launch``), before the slot's next request. A slot that holds nothing costs
        nothing; under tensor parallelism rank 0's call is the one that counts."""
        self._enter("release")
        try:
            if self._announcing is not None:
                self._announcing.release(slots)
        finally:
            self._path.users.leave()

    def record_accepted(self, accepted: Sequence[int], offered: Sequence[int]) -> None:
        """The engine reports how many drafts it accepted (and was offered) per position."""
        k = min(self.num_spec, len(accepted))
        self.counts.add_at(self.counts.accepted_at, np.asarray(accepted[:k]))
        self.counts.add_at(self.counts.offered_at, np.asarray(offered[:k]))

    # ------------------------------------------------------------------ statistics

    def stats(self) -> Stats:
        """Every number the JSON file, the log line and the metrics show (one record;
        after ``close()`` the final one).

        Raises:
            RemoteForked: in a child forked after the parent's start (its counters are the parent's).
        """
        self._life.refuse_forked("stats")
        with self._lock:
            return self._final if self._final is not None else self._snapshot()

    def _snapshot(self) -> Stats:
        """Under ``_lock``: the path is open (close sets ``_final`` before it leaves)."""
        table = self.spec.n_out_table
        return self.counts.snapshot(
            mode=self.mode.value,
            policy=self.cfg.policy,
            path=self._path.stats(),
            n_out_reason=self.n_out_reason,
            n_out_table=tuple(table) if table is not None else None,
        )

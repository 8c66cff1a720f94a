"""The proxy hosts: run the proxy for a :class:`~.handoff.Handoff`, as a thread of the
engine (:class:`ThreadHost`, ``ASYNC_PROXY=thread``) or as a supervised child process
(:class:`ProcessHost`, ``process``), and say which proxy serves. :func:`host_for` picks
one by the mode; both answer the one interface of :class:`ProxyHost`.

A proxy serves once it has beaten since it started: it beats first after its first
connection attempt, which may take the whole CONNECT_TIMEOUT_MS. Until then rounds are
answered by the engine at once, target-only. In process mode that one rule is the
supervisor's ``serving`` predicate (Starting -> Up), and the stall verdict, owned by the
supervisor's thread, reads only what the engine thread wrote (``watchdog_seen``) and the
region's heartbeat.
"""

from __future__ import annotations

import abc
import logging
import sys
import threading
import time

from ... import native, wire
from ...config.mode import Mode
from ...proxy.loop import IDLE_TICK_S, ProxyLoop
from ...proxy.spawn import proxy_environment, spawn_proxy
from ...supervisor.restarts import Down, Lifecycle, Spent, Starting, Supervisor, SupervisorStats, Up
from ...supervisor.standby import StandbyHooks
from ..spec import Spec
from .handoff import STALL_ROUNDS, Handoff

log = logging.getLogger("remote_dspark.engine")

PROXY_START_S = 5.0  # a new proxy's start, past its first connect attempt (CONNECT_TIMEOUT_MS)
STALL_SLACK_MS = 100  # heartbeat silence past max(TIMEOUT_MS, the idle tick) + this, a round pending: stalled
START_WAIT_SLACK_S = 1.0  # start() waits for the first proxy at most CONNECT_TIMEOUT_MS + this
STOP_S = 0.5  # close: how long a proxy process has to exit on SIGTERM before SIGKILL


class ProxyHost(abc.ABC):
    """What the async path asks of whoever runs its proxy: start it (and wait, bounded,
    for it to serve), say every round which proxy serves, stop it at close."""

    supervisor: Supervisor | None = None  # the process host's (for tools that watch or fault it)

    def __init__(self, spec: Spec, path: Handoff):
        self.spec = spec
        self.path = path
        path.served_by(self.serving_session)  # the path asks this host before every round

    @property
    def start_limit_s(self) -> float:
        """How long a new proxy may take to serve: its interpreter's start plus its first
        connect attempt."""
        return self.spec.cfg.connect_timeout_ms / 1000.0 + PROXY_START_S

    def start(self) -> None:
        """Start the proxy and wait for it to serve, CONNECT_TIMEOUT_MS + 1 s at most from
        now: the engine's own set-up before (the hand-off's self-test, a Triton compile on
        a cold cache) is not the proxy's time."""
        spawned_at = time.monotonic()
        self._launch()
        # A new proxy serves after its first connect attempt: a hung worker holds start()
        # for CONNECT_TIMEOUT_MS, and 1 s more is the proxy's own start.
        limit_s = self.spec.cfg.connect_timeout_ms / 1000.0 + START_WAIT_SLACK_S
        if not self._wait_serving(spawned_at + limit_s - time.monotonic()):
            log.warning(
                "remote DSpark: no proxy serving %.1f s after its start; rounds are target-only until one does", limit_s
            )

    def _wait_serving(self, timeout_s: float) -> bool:
        """Wait (bounded) for the first proxy to serve, so the first rounds reach it."""
        deadline = time.monotonic() + timeout_s
        while not self._first_serving():
            if time.monotonic() > deadline or self._hopeless():
                return False
            time.sleep(0.005)
        return True

    @abc.abstractmethod
    def _launch(self) -> None:
        """Start the proxy (without waiting for it)."""

    @abc.abstractmethod
    def _first_serving(self) -> bool:
        """``start()``'s wait is over: the first proxy serves."""

    def _hopeless(self) -> bool:
        """``start()``'s wait is over: no proxy will serve."""
        return False

    @abc.abstractmethod
    def serving_session(self) -> int:
        """Engine thread, every round: the session of the proxy that serves, 0 if none."""

    @abc.abstractmethod
    def stop(self) -> bool:
        """Closing: stop the proxy, within about ``STOP_S``; True when it is known gone
        (its claimed rounds may then be released as orphans)."""

    def supervisor_stats(self) -> SupervisorStats | None:
        """The supervisor's record (process mode), for ``stats()``."""
        return None

    @property
    def thread_alive(self) -> bool | None:
        """Whether the proxy thread lives (thread mode, once started), for ``stats()``."""
        return None


class ThreadHost(ProxyHost):
    """The proxy as a thread of the engine: its own loop over the region, in this
    interpreter. It serves once it has beaten since the thread started."""

    def __init__(self, spec: Spec, path: Handoff):
        super().__init__(spec, path)
        self._thread: threading.Thread | None = None  # started by start()
        self._loop: ProxyLoop | None = None  # the thread's loop while it runs
        self._stop = threading.Event()
        self._thread_started_ns = 0
        self._thread_lost = False
        self._switch_interval: float | None = None  # the interpreter's, to restore at stop

    def _launch(self) -> None:
        us = self.spec.cfg.switch_interval_us
        if us:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(us / 1e6)
        path = self.path
        path.end.header.set_session(wire.random_id())
        self._loop = ProxyLoop(
            path.region,
            path.lib,
            self.spec.cfg,
            engine_id=self.spec.engine_id,
            vocab_size=self.spec.vocab_size,
            environ=self.spec.environ,
        )
        self._thread = threading.Thread(target=self._run_thread, name="remote-dspark-proxy", daemon=True)
        self._thread_started_ns = time.monotonic_ns()
        self._thread.start()

    def _run_thread(self) -> None:
        """The proxy thread: a user of the region until its loop ends (it may outlive
        ``close``, inside a connect: then it is the one that unmaps)."""
        users = self.path.users
        if not users.enter():
            return
        try:
            self._loop.run(self._stop.is_set)
        finally:
            self._loop = None
            users.leave()

    def _first_serving(self) -> bool:
        return bool(self.serving_session())

    def serving_session(self) -> int:
        if not self._thread.is_alive():
            if not self._thread_lost:
                self._thread_lost = True
                log.error("remote DSpark: the proxy thread died; every round is target-only from now on")
            return 0
        header = self.path.end.header
        return header.session if header.heartbeat_ns >= self._thread_started_ns else 0

    def stop(self) -> bool:
        """A proxy thread inside a connect may outlive this: it leaves the region when
        its loop ends."""
        if self._thread is None:  # never started
            return True
        self._stop.set()
        loop = self._loop
        if loop is not None:
            loop.link.interrupt()  # a round waiting on the network ends now
        self._thread.join(STOP_S)
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
        return not self._thread.is_alive()

    @property
    def thread_alive(self) -> bool | None:
        return self._thread.is_alive() if self._thread is not None else None


class ProcessHost(ProxyHost):
    """The proxy as a child process under a :class:`Supervisor` (respawns, the stall
    verdict, the warm standby). Whether a proxy serves is the supervisor's ``serving``
    predicate (Starting -> Up)."""

    def _launch(self) -> None:
        env = proxy_environment(self.spec.environ, self.path.lib.path)
        cfg = self.spec.cfg
        standby = (
            StandbyHooks(lambda: self._spawn(None, env), self._promote, self._standby_ready)
            if cfg.async_standby
            else None
        )
        self.supervisor = Supervisor(
            lambda session: self._spawn(session, env),
            respawns=cfg.async_respawns,
            reset_s=cfg.async_respawn_reset_s,
            serving=self._beaten,
            start_limit_s=self.start_limit_s,
            stalled=self._stalled,
            on_change=self._on_change,
            standby=standby,
        )
        self.supervisor.start()

    def _spawn(self, session: int | None, env):
        """A proxy for ``session``, or (None) a standby, which gets its session when it is
        promoted."""
        if session is not None:
            self.path.end.header.set_session(session)
        else:  # a standby: no promotion word, no ready word of an earlier one (a reused pid)
            region, lib = self.path.region, self.path.lib
            lib.store32(region.addr(region.layout.standby_go), 0)
            lib.store32(region.addr(region.layout.standby_pid), 0)
        return spawn_proxy(
            self.path.region.fd,
            cfg=self.spec.cfg,
            engine_id=self.spec.engine_id,
            env=env,
            vocab_size=self.spec.vocab_size,
            standby=session is None,
        )

    def _promote(self, pid: int, session: int, within_s: float) -> bool:
        """From the supervisor's thread: offer the standby ``pid`` the role of the proxy of
        ``session``; whether it accepted within ``within_s`` (the offer is withdrawn if
        not, and it never takes the role)."""
        region, lib = self.path.region, self.path.lib
        self.path.end.header.set_session(session)
        rc = lib.standby_offer(region.addr(region.layout.standby_go), pid, native.deadline_ns(within_s))
        return native.check(rc, f"promote the standby proxy pid {pid}") is native.Status.OK

    def _standby_ready(self, pid: int) -> bool:
        region = self.path.region
        return self.path.lib.load32(region.addr(region.layout.standby_pid)) == pid

    # ------------------------------------------------------------------ which proxy serves

    def _beaten(self, live: Starting | Up) -> bool:
        """The rule for "serving": the proxy has beaten since its spawn."""
        return self.path.end.header.heartbeat_ns >= live.since * 1e9

    def serving_session(self) -> int:
        live = self.supervisor.state
        if isinstance(live, Up) or (isinstance(live, Starting) and self._beaten(live)):
            return live.session
        return 0

    def _first_serving(self) -> bool:
        """Until the supervisor says Up: its state agrees from the start."""
        return self.supervisor.up is not None

    def _hopeless(self) -> bool:
        return isinstance(self.supervisor.state, Spent)

    def _stalled(self, up: Up) -> bool:
        """From the supervisor's thread: has the serving proxy ``up`` stopped serving?"""
        path = self.path
        seen = path.watchdog_seen
        if len(seen) >= STALL_ROUNDS and seen[0] >= up.since:  # all of them during this proxy's life
            return True
        # A serving proxy beats at least every idle tick, when it sees a round and after
        # it: one network wait (TIMEOUT_MS) is the longest it is silent with a round pending.
        cfg = self.spec.cfg
        silent_ms = max(cfg.timeout_ms, IDLE_TICK_S * 1000) + STALL_SLACK_MS
        pending = path.end.gathered() != path.end.released()
        return pending and time.monotonic_ns() - path.end.header.heartbeat_ns > silent_ms * 1_000_000

    def _on_change(self, state: Lifecycle) -> None:
        """From the supervisor's thread, under its lock: a lost proxy's rounds are
        answered at once: those it held (orphans) as soon as it is down or the
        supervisor is spent (either way no proxy process is left), so its successor can
        release later rounds; those handed over and not taken (no proxy) once the
        successor is on its way (a promoted standby is woken first) or none will come."""
        if not isinstance(state, (Down, Starting, Spent)):
            return
        users = self.path.users
        if not users.enter():  # closing: close() answers them
            return
        try:
            if isinstance(state, (Down, Spent)):  # no proxy process left: what it held is orphaned
                self.path.end.release_orphans()
                # A proxy killed asleep leaves ``sleeping`` set: every round would pay a wake.
                self.path.lib.store32(self.path.region.addr(self.path.region.layout.wake) + 4, 0)
            self.path.end.drain(time.monotonic() + self.spec.cfg.watchdog_ms / 1000.0)
        finally:
            users.leave()

    # ------------------------------------------------------------------ closing

    def stop(self) -> bool:
        if self.supervisor is None:  # never started
            return True
        self.supervisor.close(STOP_S)
        return True

    def supervisor_stats(self) -> SupervisorStats | None:
        return self.supervisor.stats() if self.supervisor is not None else None


def host_for(spec: Spec, path: Handoff) -> ProxyHost:
    """The host of ``spec``'s mode (thread or process) for ``path``.

    Raises:
        ValueError: a mode that runs no proxy (sync).
    """
    if spec.mode is Mode.THREAD:
        return ThreadHost(spec, path)
    if spec.mode is Mode.PROCESS:
        return ProcessHost(spec, path)
    raise ValueError(f"{spec.mode} mode runs no proxy")

"""The supervisor: spawn the proxy process, see it die or stall, respawn it under a budget.

How a proxy process is started (an isolated interpreter, its environment, the
configuration hand-over) and how it is signalled and reaped is
:mod:`remote_dspark.proxy.spawn`'s; this module only decides when.

Why a pidfd, not polling: the kernel makes the pidfd readable the instant the child
exits, so a watcher thread sleeping in ``select`` sees death at once, and can also wake
every ``tick`` to check for stalls and the budget's reset window.

The lifecycle is one typed value (:data:`Lifecycle`), changed only under the
supervisor's lock by :meth:`Supervisor._set`, which also tells ``on_change``; the
restart decision is made in one place (:meth:`Supervisor._lost`):

    Starting --serving--> Up
    Starting --no beat within the start limit--> Killing(stall)
    Up --stall--> Killing(stall)
    Starting, Up --exit/signal---+
    Killing --its exit-----------+--> Down (the cause) --budget left?
         --yes--> Starting (new proxy, new session: a promoted standby, or a fresh start)
         --no---> Spent (target-only from now on)
    Down --the respawn failed--> Spent
    any --the watcher failed--> Spent
    any --close()--> Closed

Spent means what it says: no proxy process is left. Every way into it goes through
:meth:`Supervisor._spend`, which first ends the proxy the state holds and the standby
(whatever their ending raises: through the pid when the pidfd fails) and reaps them; the
transition's listener then releases what a lost proxy held (orphan rounds) and the
rounds handed over. A child is owned from its spawn: one that cannot be watched (no
pidfd) is killed and reaped before the failure is raised.

The process itself (its Popen and pidfd, a :class:`Child`) is held by the state that has
a proxy (Starting, Up, Killing) and by nothing else: the transition out of those states
hands it to whoever reaps it.

A proxy the supervisor kills is ``Killing`` from its SIGKILL to its exit: the state
carries the proxy and the cause, so its exit is a loss of that cause, not of the signal
the supervisor sent; it is not judged again and serves no round meanwhile.

A proxy is Starting from its spawn until it serves (the host's ``serving`` predicate:
it has beaten, i.e. made its first connection attempt, which may take the whole
CONNECT_TIMEOUT_MS); only an Up proxy can be judged stalled. A worker that is down or
hung is the proxy's business (back-off, breaker), never a proxy loss. While no proxy is
serving every round is target-only and released by the engine side at once.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .. import wire
from ..proxy.spawn import end, kill_by_pid, reap, signal_child
from .standby import Standby, StandbyHooks
from .states import Cause, Child, Closed, Down, Killing, Lifecycle, Spent, Starting, Up

log = logging.getLogger("remote_dspark.supervisor")

END_S = 1.0  # how long a proxy or standby ended on the way to Spent has to exit on SIGTERM


class RestartBudget:
    """``respawns`` new proxies after losses; a proxy that stayed up ``reset_s`` seconds
    restores the full budget (0 = never)."""

    def __init__(self, respawns: int, reset_s: float):
        self.full = respawns
        self.left = respawns
        self.reset_s = reset_s
        self.restored = 0  # times the reset window gave the budget back

    def observe(self, up: Up, now: float) -> None:
        if self.reset_s and self.left < self.full and now - up.since >= self.reset_s:
            self.left = self.full
            self.restored += 1

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


@dataclass(frozen=True)
class SupervisorStats:
    state: str
    pid: int | None
    session: int | None
    spawns: int
    restarts: dict[str, int]  # by cause
    budget_left: int
    budget_restored: int
    proxy_rss_bytes: int  # the live proxy's resident memory (0 when none)
    proxy_cpu_seconds: float  # CPU time of every proxy so far, the live one included
    standby: str = "off"  # the warm standby: off, none, starting or ready
    standby_spawns: int = 0
    standby_failures: int = 0  # standbys that died before their promotion, or were killed silent when offered it


class Supervisor:
    """Owns the proxy process. ``spawn(session)`` starts one and returns its Popen;
    ``serving(starting)`` says whether a new proxy serves yet; ``stalled(up)`` whether a
    serving one has stopped; ``on_change(state)`` hears every lifecycle change (from the
    thread that made it, under the lock, in order). A proxy that does not serve within
    ``start_limit_s`` of its spawn is killed (a stall).

    With ``standby`` hooks it keeps a warm standby (:mod:`.standby`) while a proxy is up
    and the budget allows a respawn, and a loss promotes it instead of starting a
    process: a promotion is a respawn (it takes from the budget), a standby's own death
    is not. A loss takes one unit of the budget whatever replaces the proxy: a standby
    that does not prove it is alive is killed and a fresh proxy starts on the same unit.

    Invariants: at most one proxy process serves; every process spawned (standbys too)
    is reaped (no zombie) by the watcher or by :meth:`close`; ``state`` changes only in
    ``_set``, under ``_lock``.
    """

    def __init__(
        self,
        spawn: Callable[[int], subprocess.Popen],
        *,
        respawns: int,
        reset_s: float,
        serving: Callable[[Starting], bool] | None = None,
        start_limit_s: float = 10.0,
        stalled: Callable[[Up], bool] | None = None,
        on_change: Callable[[Lifecycle], None] | None = None,
        tick_s: float = 0.02,
        new_session: Callable[[], int] | None = None,
        standby: StandbyHooks | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._spawn_fn = spawn
        self.standby = Standby(standby, clock) if standby is not None else None
        self.budget = RestartBudget(respawns, reset_s)
        self._serving = serving or (lambda starting: True)
        self.start_limit_s = start_limit_s
        self._stalled = stalled or (lambda up: False)
        self._on_change = on_change or (lambda state: None)
        self.tick_s = tick_s
        self._new_session = new_session or wire.random_id
        self._clock = clock
        self.state: Lifecycle = Down(Cause.EXIT, clock())
        self.restarts: Counter[Cause] = Counter()
        self.spawns = 0
        self.dead_cpu_s = 0.0  # CPU seconds of the proxies that have exited
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._watcher: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 10.0) -> None:
        """Start watching; the watcher thread spawns the first proxy. Every proxy is
        spawned from that one long-lived thread because the kernel ties a child's
        parent-death signal to the thread that forked it, not to the process.

        Raises:
            OSError: the first proxy could not be spawned.
        """
        started = threading.Event()
        failure: list[BaseException] = []

        def first() -> None:
            with self._lock:
                if isinstance(self.state, Closed):  # closed while this thread was starting
                    started.set()
                    return
                try:
                    self._spawn()
                except BaseException as e:
                    failure.append(e)
                    self._spend()
                finally:
                    started.set()
            if not failure:
                self._watch()

        self._watcher = threading.Thread(target=first, name="proxy-supervisor", daemon=True)
        self._watcher.start()
        if not started.wait(timeout_s):
            raise OSError(f"the first proxy was not spawned within {timeout_s} s")
        if failure:
            raise failure[0]

    def close(self, timeout_s: float = 2.0) -> None:
        """Ask the proxy to exit (SIGTERM), wait, then SIGKILL; reap it. Idempotent."""
        with self._lock:
            if isinstance(self.state, Closed):
                return
            child = self._child()
            self._set(Closed())
        os.write(self._wake_w, b"x")
        if self._watcher is not None:
            self._watcher.join(timeout_s + 1.0)
        if child is not None:
            cpu_s = end(child.proc, child.pidfd, timeout_s)
            with self._lock:
                self.dead_cpu_s += cpu_s
        if self.standby is not None:
            with self._lock:
                self.standby.close(timeout_s)
        os.close(self._wake_r)
        os.close(self._wake_w)

    @property
    def up(self) -> Up | None:
        """The serving proxy, if any."""
        state = self.state
        return state if isinstance(state, Up) else None

    @property
    def live(self) -> Starting | Up | None:
        """The live proxy, serving or still starting, if any."""
        state = self.state
        return state if isinstance(state, (Starting, Up)) else None

    def stats(self) -> SupervisorStats:
        # Under the lock: the live proxy's CPU time and the dead ones' sum must not both
        # count a proxy that is being reaped (the exported counter would step back).
        with self._lock:
            state = self.state
            rss, cpu = _process_facts(getattr(state, "pid", None))
            sb = self.standby
            return SupervisorStats(
                type(state).__name__.lower(),
                getattr(state, "pid", None),
                getattr(state, "session", None),
                self.spawns,
                {c.value: self.restarts[c] for c in Cause},
                self.budget.left,
                self.budget.restored,
                rss,
                self.dead_cpu_s + cpu + (sb.dead_cpu_s if sb else 0.0),
                sb.state.phase.value if sb else "off",
                sb.spawns if sb else 0,
                sb.failures if sb else 0,
            )

    # ------------------------------------------------------------------ internals

    def _set(self, state: Lifecycle) -> None:
        """The one transition: under ``_lock`` (asserted), then ``on_change``."""
        assert self._lock.locked(), "a supervisor transition outside its lock"
        self.state = state
        self._on_change(state)

    def _spawn(self) -> None:
        """A new proxy, Starting from now; a failure after the process exists leaves it
        ended (before Starting holds it) or held by the state (after)."""
        session = self._new_session()
        proc = self._spawn_fn(session)
        try:
            pidfd = os.pidfd_open(proc.pid)
        except BaseException:  # no fd left: a process nobody could watch is ended now
            kill_by_pid(proc, END_S)
            raise
        self.spawns += 1
        self._set(Starting(Child(proc, pidfd), session, self._clock()))

    def _child(self) -> Child | None:
        """The proxy process the state holds (starting, up or being killed), if any."""
        state = self.state
        return state.child if isinstance(state, (Starting, Up, Killing)) else None

    def _watch(self) -> None:
        sb = self.standby
        while not isinstance(self.state, Closed):
            child = self._child()
            fds = [fd for fd in (self._wake_r, child.pidfd if child else -1, sb.pidfd if sb else -1) if fd >= 0]
            ready, _, _ = select.select(fds, [], [], self.tick_s)
            with self._lock:
                if isinstance(self.state, Closed):
                    return
                try:
                    # A standby dead at the same time as the proxy is reaped first: never promoted.
                    if sb is not None and sb.pidfd >= 0 and sb.pidfd in ready:
                        sb.died()
                    if child is not None and child.pidfd in ready:
                        self._reap_and_decide(child)
                    elif isinstance(self.state, (Starting, Up)):
                        self._check_live(self.state)
                    if sb is not None:
                        # A standby is kept while a proxy serves (or is being killed
                        # from serving: the standby is its replacement) and a loss could
                        # be replaced (the budget has one more respawn), never before
                        # the first proxy serves (they would share the start's CPU).
                        state = self.state
                        serving = state.proxy if isinstance(state, Killing) else state
                        sb.keep(isinstance(serving, Up) and self.budget.left > 0)
                except Exception:
                    # Supervision must not end silently with a proxy marked up: give up
                    # on proxies (target-only rounds), loudly, and keep nothing running.
                    log.exception("the proxy supervisor failed; every round is target-only from now on")
                    self._spend()
                    return

    def _spend(self) -> None:
        """The one way into Spent (the budget spent, a respawn or the first spawn failed,
        the watcher failed): end the proxy the state still holds and the standby, each
        whatever its ending raises, so that Spent says what it means, no proxy process
        left; then the transition, whose listener releases the rounds the lost proxy held
        (orphans) and those handed over. The listener's own failure is logged: the state
        is Spent all the same, and the watcher carries on."""
        child = self._child()
        if child is not None:
            self.dead_cpu_s += end(child.proc, child.pidfd, END_S)
        if self.standby is not None:
            self.standby.close(END_S)
        try:
            self._set(Spent(self._clock()))
        except Exception:
            log.exception("answering the lost proxy's rounds on the way to Spent")

    def _check_live(self, live: Starting | Up) -> None:
        now = self._clock()
        if isinstance(live, Starting):
            if self._serving(live):
                self._set(Up(live.child, live.session, live.since))
            elif now - live.since > self.start_limit_s:
                self._kill(live, f"did not serve within {self.start_limit_s:.1f} s of its start")
            return
        self.budget.observe(live, now)
        if self._stalled(live):
            self._kill(live, "stalled")

    def _kill(self, live: Starting | Up, why: str) -> None:
        log.warning("proxy pid %d %s; killing it", live.pid, why)
        self._set(Killing(live, Cause.STALL))
        signal_child(live.child.pidfd, signal.SIGKILL)

    def _reap_and_decide(self, child: Child) -> None:
        # The pidfd is readable: reaping does not block. Its final CPU time is kept, so
        # the exported counter never drops. The state leaves the child right after, in
        # _lost (Down).
        self.dead_cpu_s += reap(child.proc, child.pidfd)
        proc, state = child.proc, self.state
        if isinstance(state, Killing):  # the supervisor's own kill: the cause it killed for
            self._lost(state.proxy, state.cause, proc.returncode)
        elif proc.returncode < 0:  # a signal it did not ask for
            self._lost(state, Cause.SIGNAL, proc.returncode)
        else:
            self._lost(state, Cause.EXIT, proc.returncode)

    def _lost(self, proxy: Starting | Up, cause: Cause, returncode: int) -> None:
        """The one place that decides whether a lost proxy is replaced."""
        now = self._clock()
        if isinstance(proxy, Up):
            self.budget.observe(proxy, now)
        self.restarts[cause] += 1
        self._set(Down(cause, now))
        if not self.budget.take():
            self._spend()
            log.error(
                "proxy lost (%s, status %s) and the respawn budget (%d) is spent: every round is "
                "target-only from now on",
                cause.value,
                returncode,
                self.budget.full,
            )
            return
        promoted = self._promote()
        log.warning(
            "proxy lost (%s, status %s); %s (%d respawns left)",
            cause.value,
            returncode,
            "the standby takes over" if promoted else "respawning",
            self.budget.left,
        )
        if promoted:
            return
        try:
            self._spawn()
        except OSError as e:
            log.error("could not respawn the proxy: %s", e)
            self._spend()

    def _promote(self) -> bool:
        """Make the standby the proxy, with a new session; False when none is promoted
        (none is ready, or the one ready did not prove it is alive: :meth:`Standby.take`)."""
        session = self._new_session()
        taken = self.standby.take(session) if self.standby is not None else None
        if taken is None:
            return False
        self.spawns += 1
        self._set(Starting(Child(*taken), session, self._clock()))
        return True


def _process_facts(pid: int | None) -> tuple[int, float]:
    """(resident bytes, CPU seconds) of a live proxy; (0, 0.0) when there is none."""
    if pid is None:
        return 0, 0.0
    import psutil  # engine side only; the proxy never imports the supervisor

    try:
        p = psutil.Process(pid)
        with p.oneshot():
            t = p.cpu_times()
            return p.memory_info().rss, t.user + t.system
    except psutil.Error:
        return 0, 0.0

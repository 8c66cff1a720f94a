"""The supervisor with stand-in children: death seen at once, stalls, the budget and its
reset window, and a clean close."""

import logging
import os
import signal
import subprocess
import sys

import pytest
from helpers import CHILD_TIMEOUT_S, readline_within, until

from remote_dspark.supervisor.restarts import Cause, Closed, Down, Killing, Spent, Starting, Supervisor, Up

CHILD = "import sys, time\ncode = int(sys.argv[1])\nif code >= 0: sys.exit(code)\ntime.sleep(120)\n"


class Spawner:
    """Starts stand-in proxies; ``codes`` says how each one ends (-1: runs until killed)."""

    def __init__(self, codes=()):
        self.codes = list(codes)
        self.procs = []
        self.sessions = []

    def __call__(self, session):
        code = self.codes.pop(0) if self.codes else -1
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(code)])
        self.procs.append(proc)
        self.sessions.append(session)
        return proc

    def cleanup(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def spawner():
    s = Spawner()
    yield s
    s.cleanup()


def open_fds():
    return set(os.listdir("/proc/self/fd"))


def test_sigkill_is_seen_and_a_new_proxy_with_a_new_session_starts(spawner):
    changes = []
    sup = Supervisor(spawner, respawns=2, reset_s=0, on_change=changes.append)
    sup.start()
    try:
        assert until(lambda: sup.up is not None)
        first = sup.up
        os.kill(first.pid, signal.SIGKILL)
        assert until(lambda: sup.up is not None and sup.up.pid != first.pid)
        assert sup.up.session != first.session and sup.restarts[Cause.SIGNAL] == 1
        assert sup.budget.left == 1 and spawner.procs[0].returncode == -signal.SIGKILL  # reaped
        assert [type(c).__name__ for c in changes] == ["Starting", "Up", "Down", "Starting", "Up"]
    finally:
        sup.close()


def test_exit_by_itself_counts_as_exit(spawner):
    spawner.codes = [3]
    sup = Supervisor(spawner, respawns=1, reset_s=0)
    sup.start()
    try:
        assert until(lambda: sup.restarts[Cause.EXIT] == 1 and sup.up is not None)
        assert sup.spawns == 2
    finally:
        sup.close()


def test_stalled_proxy_is_killed_and_counted_as_stall(spawner):
    stall_pid = []
    sup = Supervisor(spawner, respawns=1, reset_s=0, stalled=lambda up: up.pid in stall_pid)
    sup.start()
    try:
        first = sup.live
        stall_pid.append(first.pid)
        assert until(lambda: sup.restarts[Cause.STALL] == 1 and sup.up is not None)
        assert spawner.procs[0].returncode == -signal.SIGKILL and sup.up.pid != first.pid
        assert sup.restarts[Cause.SIGNAL] == 0
    finally:
        sup.close()


def test_spent_budget_logs_one_error_and_stays_spent(spawner, caplog):
    spawner.codes = [1, 1, 1]
    sup = Supervisor(spawner, respawns=2, reset_s=0)
    with caplog.at_level(logging.WARNING, logger="remote_dspark.supervisor"):
        sup.start()
        try:
            assert until(lambda: isinstance(sup.state, Spent))
            assert sup.spawns == 3 and sup.budget.left == 0 and sup.restarts[Cause.EXIT] == 3
        finally:
            sup.close()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "budget (2) is spent" in errors[0].getMessage()


def test_zero_respawns_means_target_only_after_the_first_loss(spawner):
    spawner.codes = [0]
    sup = Supervisor(spawner, respawns=0, reset_s=0)
    sup.start()
    try:
        assert until(lambda: isinstance(sup.state, Spent)) and sup.spawns == 1
    finally:
        sup.close()


def test_reset_window_restores_the_full_budget(spawner):
    now = [0.0]
    sup = Supervisor(spawner, respawns=2, reset_s=100, clock=lambda: now[0])
    sup.start()
    try:
        os.kill(sup.live.pid, signal.SIGKILL)
        assert until(lambda: sup.spawns == 2 and sup.up is not None)
        assert sup.budget.left == 1
        now[0] = 99.0
        assert not until(lambda: sup.budget.left == 2, timeout=0.1)  # not yet served 100 s
        now[0] = 100.0
        assert until(lambda: sup.budget.left == 2) and sup.budget.restored == 1
    finally:
        sup.close()


def test_close_leaves_no_zombie_and_no_fd(spawner):
    before = open_fds()
    sup = Supervisor(spawner, respawns=1, reset_s=0)
    sup.start()
    proc = spawner.procs[0]
    sup.close()
    assert isinstance(sup.state, Closed) and proc.returncode is not None
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)
    assert open_fds() == before
    sup.close()  # idempotent


def test_close_kills_a_child_that_ignores_sigterm(spawner):
    def spawn(session):
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                "print('ready', flush=True)\ntime.sleep(120)\n",
            ],
            stdout=subprocess.PIPE,
        )
        spawner.procs.append(proc)
        return proc

    sup = Supervisor(spawn, respawns=0, reset_s=0)
    sup.start()
    proc = spawner.procs[0]
    assert readline_within(proc.stdout, CHILD_TIMEOUT_S, "the child's 'ready'") == b"ready\n"
    sup.close(timeout_s=0.2)
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


def test_a_failing_callback_ends_supervision_loudly_not_silently(spawner, caplog):
    def broken(up):
        raise RuntimeError("stall check bug")

    sup = Supervisor(spawner, respawns=3, reset_s=0, stalled=broken)
    with caplog.at_level(logging.ERROR, logger="remote_dspark.supervisor"):
        sup.start()
        try:
            assert until(lambda: isinstance(sup.state, Spent))
            assert spawner.procs[0].poll() is not None  # no proxy left running
        finally:
            sup.close()
    assert any("supervisor failed" in r.getMessage() for r in caplog.records)


def test_supervision_that_fails_while_ending_its_proxy_still_ends_spent(spawner, caplog, monkeypatch):
    """The failure path's own ending raises (the proxy's pidfd gone bad): the proxy is
    killed through its pid and reaped all the same, and the supervisor says Spent, never Up."""
    from remote_dspark.proxy import spawn

    def broken_stall(up):
        raise RuntimeError("stall check bug")

    def broken_terminate(proc, pidfd, timeout_s):
        raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(spawn, "terminate", broken_terminate)
    sup = Supervisor(spawner, respawns=3, reset_s=0, stalled=broken_stall)
    with caplog.at_level(logging.ERROR, logger="remote_dspark.supervisor"):
        sup.start()
        try:
            assert until(lambda: isinstance(sup.state, Spent))
            assert spawner.procs[0].returncode == -signal.SIGKILL  # killed and reaped, not left running
        finally:
            sup.close()
    assert any("through its pidfd failed" in r.getMessage() for r in caplog.records)


def gone(pid: int) -> bool:
    """The process is reaped (no /proc entry; a zombie still has one)."""
    return not os.path.exists(f"/proc/{pid}")


class Failure(OSError):
    """The failure a test injects."""


@pytest.mark.parametrize("when", ["first spawn", "respawn"])
@pytest.mark.parametrize("what", ["pidfd_open", "listener"])
def test_a_spawn_that_fails_leaves_no_child_and_spent_is_told_with_none_left(spawner, monkeypatch, what, when):
    """A failure once the process exists: no pidfd for it (``pidfd_open`` raises), or the
    listener of its Starting raises (the host's answers to a lost proxy's rounds). Either
    way the supervisor ends Spent, the new child is killed and reaped, and Spent is told
    (the host then releases the lost proxy's rounds as orphans) only once no process of
    the supervisor's is left."""
    from remote_dspark.supervisor import restarts as module

    armed, left_at_spent = [when == "first spawn"], []
    real_pidfd_open = os.pidfd_open

    def pidfd_open(pid):
        if armed[0] and what == "pidfd_open":
            raise Failure(24, "Too many open files")
        return real_pidfd_open(pid)

    def on_change(state):
        if isinstance(state, Spent):
            left_at_spent.append([p.pid for p in spawner.procs if not gone(p.pid)])
        elif isinstance(state, Starting) and armed[0] and what == "listener":
            raise Failure("the listener failed")

    monkeypatch.setattr(module.os, "pidfd_open", pidfd_open)
    sup = Supervisor(spawner, respawns=2, reset_s=0, on_change=on_change)
    try:
        if when == "first spawn":
            with pytest.raises(Failure):
                sup.start()
        else:
            sup.start()
            assert until(lambda: sup.up is not None)
            armed[0] = True
            os.kill(sup.up.pid, signal.SIGKILL)
            assert until(lambda: isinstance(sup.state, Spent), timeout=CHILD_TIMEOUT_S)
        assert isinstance(sup.state, Spent) and left_at_spent == [[]]
        assert all(p.returncode is not None and gone(p.pid) for p in spawner.procs)  # each ended and reaped
    finally:
        sup.close()


def test_proxies_are_spawned_by_the_watcher_thread(spawner):
    """The parent-death signal follows the forking thread: it must be the long-lived one."""
    import threading

    forked_by = []

    def spawn(session):
        forked_by.append(threading.current_thread().name)
        return spawner(session)

    sup = Supervisor(spawn, respawns=1, reset_s=0)
    sup.start()
    try:
        os.kill(sup.live.pid, signal.SIGKILL)
        assert until(lambda: sup.spawns == 2)
        assert forked_by == ["proxy-supervisor"] * 2
    finally:
        sup.close()


def test_a_starting_proxy_is_up_only_once_it_serves_and_is_never_judged_stalled(spawner):
    """Until ``serving`` says so the proxy is Starting (e.g. still connecting to a silent
    worker): the stall check is not asked, no budget is spent; then it is Up."""
    serving, judged, changes = [], [], []
    sup = Supervisor(
        spawner,
        respawns=1,
        reset_s=0,
        serving=lambda st: bool(serving),
        stalled=lambda up: judged.append(up) or False,
        start_limit_s=60,
        on_change=changes.append,
    )
    sup.start()
    try:
        assert isinstance(sup.state, Starting) and sup.up is None
        assert until(lambda: len(changes) == 1, timeout=0.3) and not judged  # a few ticks as Starting
        serving.append(True)
        assert until(lambda: sup.up is not None and judged)
        assert [type(c) for c in changes] == [Starting, Up] and changes[1].pid == changes[0].pid
        assert (sup.spawns, sum(sup.restarts.values()), sup.budget.left) == (1, 0, 1)
    finally:
        sup.close()


def test_a_proxy_that_never_serves_is_killed_at_the_start_limit(spawner):
    sup = Supervisor(
        spawner, respawns=1, reset_s=0, serving=lambda st: st.pid != spawner.procs[0].pid, start_limit_s=0.2
    )
    sup.start()
    try:
        assert until(lambda: sup.up is not None)
        assert spawner.procs[0].returncode == -signal.SIGKILL and sup.restarts[Cause.STALL] == 1
    finally:
        sup.close()


@pytest.mark.parametrize("served", [True, False], ids=["stalled", "never-served"])
def test_a_proxy_the_supervisor_kills_is_killing_with_its_pid_and_cause_until_it_exits(spawner, served):
    """A stalled proxy (Up), or one that never served (Starting): Killing carries it and
    the cause from the SIGKILL (it is still alive then) to its exit, which is a loss of
    that cause, not of the signal."""
    changes, alive_when_killing = [], []

    def on_change(state):
        changes.append(state)
        if isinstance(state, Killing):
            alive_when_killing.append(not exited(state.pid))

    def first(pid):
        return pid == spawner.procs[0].pid

    sup = Supervisor(
        spawner,
        respawns=1,
        reset_s=0,
        serving=lambda st: served or not first(st.pid),
        start_limit_s=0.2,
        stalled=lambda up: first(up.pid),
        on_change=on_change,
    )
    sup.start()
    try:
        assert until(lambda: sup.up is not None and not first(sup.up.pid))
    finally:
        sup.close()
    killing = next(c for c in changes if isinstance(c, Killing))
    victim = Up if served else Starting
    assert [type(c) for c in changes] == [Starting, *([Up] if served else []), Killing, Down, Starting, Up, Closed]
    assert isinstance(killing.proxy, victim) and killing.proxy == changes[changes.index(killing) - 1]
    assert (killing.pid, killing.session, killing.cause) == (spawner.procs[0].pid, spawner.sessions[0], Cause.STALL)
    assert alive_when_killing == [True] and spawner.procs[0].returncode == -signal.SIGKILL
    assert changes[changes.index(killing) + 1].cause is Cause.STALL and sup.restarts == {Cause.STALL: 1}


def test_the_cpu_counter_keeps_the_proxy_reaped_at_close():
    """The live proxy's CPU time is counted while it runs and, once close() has reaped
    it, from its rusage: the counter never steps back."""
    burner = "import time\nend = time.process_time() + 0.2\nwhile time.process_time() < end: pass\ntime.sleep(60)\n"
    procs = []

    def spawn(session):
        procs.append(subprocess.Popen([sys.executable, "-c", burner]))
        return procs[-1]

    sup = Supervisor(spawn, respawns=0, reset_s=0)
    sup.start()
    try:
        assert until(lambda: sup.stats().proxy_cpu_seconds >= 0.2)
        before = sup.stats().proxy_cpu_seconds
    finally:
        sup.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert sup.stats().proxy_cpu_seconds >= before


def test_a_first_spawn_failure_is_a_transition_too(spawner):
    changes = []

    def spawn(session):
        raise OSError("no proxy today")

    sup = Supervisor(spawn, respawns=1, reset_s=0, on_change=changes.append)
    with pytest.raises(OSError, match="no proxy today"):
        sup.start()
    assert isinstance(sup.state, Spent) and [type(c) for c in changes] == [Spent]
    sup.close()


# --------------------------------------------------------------------------- the warm standby


def exited(pid: int) -> bool:
    """The process has exited: a zombie not yet reaped, or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def answers(pid: int) -> bool:
    """Whether a stand-in standby could answer its promotion now: it runs (not stopped,
    not exited) and no SIGKILL is pending for it (a process never runs again once one is).
    The real standby answers from its wait loop (tests/shm/test_promotion.py)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        with open(f"/proc/{pid}/status") as f:
            pending = {k: int(v, 16) for k, v in (line.split(":") for line in f) if k in ("SigPnd", "ShdPnd")}
    except FileNotFoundError:
        return False
    sigkill = 1 << (signal.SIGKILL - 1)
    return state not in ("T", "t", "Z", "X") and not any(mask & sigkill for mask in pending.values())


class Standbys:
    """Stand-in standbys (the same child script) and what the supervisor asked of them;
    each says it is ready at once, or (``ready`` False) never, and accepts its promotion
    when it could answer it (:func:`answers`)."""

    def __init__(self, spawner: Spawner, ready: bool = True):
        self.spawner = spawner
        self.ready = ready
        self.pids: list[int] = []
        self.offered: list[int] = []  # pids offered the proxy role
        self.promoted: list[tuple[int, int]] = []  # (pid, session) of those that accepted it

    def hooks(self):
        from remote_dspark.supervisor.standby import StandbyHooks

        def spawn():
            proc = self.spawner(None)
            self.pids.append(proc.pid)
            return proc

        def promote(pid, session, within_s):
            self.offered.append(pid)
            accepted = answers(pid)
            if accepted:
                self.promoted.append((pid, session))
            return accepted

        return StandbyHooks(spawn, promote, lambda pid: self.ready)


def test_a_lost_proxy_is_replaced_by_the_standby_and_a_new_standby_starts(spawner):
    sb = Standbys(spawner)
    sup = Supervisor(spawner, respawns=2, reset_s=0, standby=sb.hooks())
    sup.start()
    try:
        assert until(lambda: sup.up is not None and sup.stats().standby == "ready")
        first, standby = sup.up.pid, sb.pids[0]
        os.kill(first, signal.SIGKILL)
        assert until(lambda: sup.up is not None and sup.up.pid == standby)
        assert sb.promoted == [(standby, sup.up.session)] and sup.up.session != spawner.sessions[0]
        assert until(lambda: len(sb.pids) == 2 and sup.stats().standby == "ready")  # the next one
        st = sup.stats()
        assert (st.budget_left, st.restarts["signal"], st.spawns, st.standby_spawns) == (1, 1, 2, 2)
    finally:
        sup.close()
    assert all(p.poll() is not None for p in spawner.procs)  # proxies and standbys all ended


def test_a_standby_that_dies_is_replaced_without_spending_the_budget_and_given_up_after_three(spawner, caplog):
    # They never say they are ready: one seen ready would end the run of deaths, and
    # whether the watcher sees it before the kill lands would be a race.
    sb = Standbys(spawner, ready=False)
    sup = Supervisor(spawner, respawns=2, reset_s=0, standby=sb.hooks())
    sup.start()
    with caplog.at_level(logging.ERROR, logger="remote_dspark.supervisor"):
        try:
            for n in range(1, 4):
                assert until(lambda n=n: len(sb.pids) == n, timeout=15)  # the back-off doubles: 0.5, 1 s
                os.kill(sb.pids[-1], signal.SIGKILL)
                assert until(lambda n=n: sup.stats().standby_failures == n)
            assert until(lambda: sup.stats().standby == "off")
            st = sup.stats()
            assert (st.budget_left, sum(st.restarts.values()), st.state) == (2, 0, "up")
        finally:
            sup.close()
    assert len(sb.pids) == 3 and sum("no standby from now on" in r.getMessage() for r in caplog.records) == 1


def test_no_standby_is_kept_once_a_loss_could_not_be_replaced(spawner):
    sb = Standbys(spawner)
    sup = Supervisor(spawner, respawns=1, reset_s=0, standby=sb.hooks())
    sup.start()
    try:
        assert until(lambda: sup.stats().standby == "ready")
        os.kill(sup.up.pid, signal.SIGKILL)  # the one respawn: the standby takes over
        assert until(lambda: sup.up is not None and sup.up.pid == sb.pids[0])
        assert until(lambda: sup.stats().budget_left == 0)
        assert sup.stats().standby == "none" and len(sb.pids) == 1  # none kept: nothing could use it
    finally:
        sup.close()


def test_a_standby_dead_with_the_proxy_is_never_promoted(spawner):
    """A correlated kill (the standby, then the proxy at once): the standby, exited or its
    SIGKILL still pending, is not taken for the proxy (seen dead, or silent when offered
    the role); the loss costs one respawn and a fresh proxy (or a later, live standby)
    serves. Whichever the watcher sees first, every wait is on a condition."""
    sb = Standbys(spawner)
    sup = Supervisor(spawner, respawns=3, reset_s=0, standby=sb.hooks())
    sup.start()
    try:
        assert until(lambda: sup.stats().standby == "ready", timeout=CHILD_TIMEOUT_S)
        proxy, standby = sup.up.pid, sb.pids[0]
        os.kill(standby, signal.SIGKILL)
        os.kill(proxy, signal.SIGKILL)
        assert until(lambda: sup.up is not None and sup.up.pid not in (proxy, standby), timeout=CHILD_TIMEOUT_S)
        st = sup.stats()
        assert standby not in [pid for pid, _ in sb.promoted]
        assert (st.budget_left, st.restarts["signal"], st.standby_failures) == (2, 1, 1)
    finally:
        sup.close()
    assert all(p.poll() is not None for p in spawner.procs)


def test_a_frozen_standby_is_never_promoted_and_the_loss_costs_one_respawn(spawner):
    """The standby SIGSTOPped, then the proxy SIGKILLed: the standby is offered the role,
    cannot answer, is killed and reaped (a death of a standby); a fresh proxy serves on the
    loss's one respawn, with no wait for a start limit."""
    sb = Standbys(spawner)
    sup = Supervisor(spawner, respawns=3, reset_s=0, standby=sb.hooks(), start_limit_s=3600)
    sup.start()
    try:
        assert until(lambda: sup.stats().standby == "ready", timeout=CHILD_TIMEOUT_S)
        proxy, frozen = sup.up.pid, sb.pids[0]
        os.kill(frozen, signal.SIGSTOP)
        assert until(lambda: not answers(frozen))  # stopped
        os.kill(proxy, signal.SIGKILL)
        assert until(lambda: sup.up is not None and sup.up.pid not in (proxy, frozen), timeout=CHILD_TIMEOUT_S)
        st = sup.stats()
        assert sb.offered == [frozen] and sb.promoted == []
        assert (st.budget_left, st.restarts, st.standby_failures) == (2, {"exit": 0, "signal": 1, "stall": 0}, 1)
        assert next(p for p in spawner.procs if p.pid == frozen).returncode == -signal.SIGKILL  # killed, reaped
    finally:
        sup.close()
    assert all(p.poll() is not None for p in spawner.procs)


def test_a_stalled_proxy_is_replaced_by_the_standby(spawner):
    """The standby is kept while the proxy it replaces is being killed: the kill's exit
    promotes it, as a SIGKILL from outside does."""
    sb = Standbys(spawner)
    stall = []
    sup = Supervisor(spawner, respawns=2, reset_s=0, stalled=lambda up: up.pid in stall, standby=sb.hooks())
    sup.start()
    try:
        assert until(lambda: sup.up is not None and sup.stats().standby == "ready")
        first, standby = sup.up.pid, sb.pids[0]
        stall.append(first)
        assert until(lambda: sup.up is not None and sup.up.pid == standby)
        assert sb.promoted == [(standby, sup.up.session)] and sup.restarts == {Cause.STALL: 1}
    finally:
        sup.close()

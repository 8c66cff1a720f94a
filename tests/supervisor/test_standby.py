"""The warm standby's lifecycle on its own, with stand-in processes and a hand-driven
clock: Idle, Warming, Ready, the back-off after a death, GivenUp after three in a row,
a promotion only for a ready standby that answers it, and every process reaped."""

import logging
import os
import select
import signal
import subprocess
import sys

import pytest

from remote_dspark.supervisor import standby
from remote_dspark.supervisor.standby import GivenUp, Idle, Ready, Standby, StandbyHooks, StandbyPhase, Warming

SLEEPER = "import time\ntime.sleep(60)\n"


class Children:
    """Stand-in standby processes (each sleeps until killed), which pids say they are
    ready, the promotions offered (pid, session, within_s) and whether the standby
    accepts them (``answers``). Every one is ended by ``cleanup``."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.ready: set[int] = set()
        self.offered: list[tuple[int, int, float]] = []
        self.answers = True
        self.spawn_error: OSError | None = None

    def spawn(self) -> subprocess.Popen:
        if self.spawn_error is not None:
            raise self.spawn_error
        proc = subprocess.Popen([sys.executable, "-c", SLEEPER])
        self.procs.append(proc)
        return proc

    def promote(self, pid: int, session: int, within_s: float) -> bool:
        self.offered.append((pid, session, within_s))
        return self.answers

    def hooks(self) -> StandbyHooks:
        return StandbyHooks(self.spawn, self.promote, self.ready.__contains__)

    def cleanup(self):
        for p in self.procs:
            if p.returncode is None:
                p.kill()
                p.wait()


@pytest.fixture
def children():
    c = Children()
    yield c
    c.cleanup()


@pytest.fixture
def now():
    return [100.0]


@pytest.fixture
def sb(children, now):
    s = Standby(children.hooks(), clock=lambda: now[0])
    yield s
    s.close(1.0)


def kill_and_see_it_die(sb: Standby) -> subprocess.Popen:
    """SIGKILL the standby, wait (bounded) for its pidfd to say so, and tell ``sb``."""
    proc = sb.proc
    os.kill(proc.pid, signal.SIGKILL)
    assert select.select([sb.pidfd], [], [], 10.0)[0]
    sb.died()
    return proc


def assert_reaped(proc: subprocess.Popen) -> None:
    assert proc.returncode is not None
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)


def test_a_standby_starts_is_seen_ready_and_is_taken(sb, children):
    assert sb.state == Idle() and sb.state.phase is StandbyPhase.NONE and sb.proc is None and sb.pidfd == -1
    sb.keep(True)
    st = sb.state
    assert isinstance(st, Warming) and st.proc is children.procs[0] and st.pidfd >= 0 and st.in_a_row == 0
    assert (sb.proc, sb.pidfd, sb.spawns) == (st.proc, st.pidfd, 1)
    sb.keep(True)  # not ready yet: no change
    assert sb.state is st
    children.ready.add(st.proc.pid)
    sb.keep(True)
    assert sb.state == Ready(st.proc, st.pidfd) and sb.state.phase is StandbyPhase.READY
    proc, pidfd = sb.take(7)
    try:
        assert (proc, pidfd) == (st.proc, st.pidfd) and children.offered == [(proc.pid, 7, standby.ANSWER_S)]
        assert sb.state == Idle() and sb.proc is None and sb.pidfd == -1  # the caller's now
        sb.keep(True)  # the next one, at once
        assert isinstance(sb.state, Warming) and sb.proc is children.procs[1] and sb.spawns == 2
    finally:
        os.close(pidfd)


def test_deaths_before_ready_back_off_and_three_in_a_row_give_up(sb, children, now, caplog):
    with caplog.at_level(logging.WARNING, logger="remote_dspark.supervisor"):
        sb.keep(True)
        dead = kill_and_see_it_die(sb)
        assert_reaped(dead)
        assert sb.state == Idle(1, 100.0 + standby.BACKOFF_S) and sb.failures == 1
        now[0] += standby.BACKOFF_S - 0.01
        sb.keep(True)  # within the back-off: none started
        assert isinstance(sb.state, Idle) and len(children.procs) == 1
        now[0] += 0.01
        sb.keep(True)
        assert isinstance(sb.state, Warming) and sb.state.in_a_row == 1  # it continues the run
        kill_and_see_it_die(sb)
        assert sb.state == Idle(2, now[0] + 2 * standby.BACKOFF_S)  # the back-off doubles
        now[0] += 2 * standby.BACKOFF_S
        sb.keep(True)
        kill_and_see_it_die(sb)
        assert sb.state == GivenUp(f"exited with status {-signal.SIGKILL}") and sb.state.phase is StandbyPhase.OFF
        now[0] += 1000.0
        sb.keep(True)  # given up: none again
        assert isinstance(sb.state, GivenUp) and (sb.spawns, sb.failures) == (3, 3)
    assert all(p.returncode == -signal.SIGKILL for p in children.procs)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "3 in a row failed" in errors[0]


def test_a_ready_standby_ends_the_run_of_deaths(sb, children, now):
    sb.keep(True)
    kill_and_see_it_die(sb)
    now[0] += standby.BACKOFF_S
    sb.keep(True)
    children.ready.add(sb.proc.pid)
    sb.keep(True)
    assert isinstance(sb.state, Ready)
    kill_and_see_it_die(sb)
    assert sb.state == Idle(1, now[0] + standby.BACKOFF_S)  # one in a row again, not two


def test_a_failed_spawn_counts_as_a_death(sb, children, now):
    children.spawn_error = OSError("no standby today")
    sb.keep(True)
    assert sb.state == Idle(1, now[0] + standby.BACKOFF_S) and (sb.spawns, sb.failures) == (0, 1)


def test_a_standby_that_cannot_be_watched_is_ended_and_counts_as_a_death(sb, children, monkeypatch):
    """No pidfd for a new standby (no fd left): the process is killed and reaped at once,
    never left running unwatched, and the failure counts like a death."""

    def no_fd(pid):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(standby.os, "pidfd_open", no_fd)
    sb.keep(True)
    assert isinstance(sb.state, Idle) and sb.state.in_a_row == 1 and sb.failures == 1
    assert_reaped(children.procs[0])


def test_a_standby_not_wanted_is_stopped_and_reaped(sb, children):
    before = set(os.listdir("/proc/self/fd"))
    sb.keep(True)
    proc = sb.proc
    sb.keep(False)
    assert sb.state == Idle() and sb.proc is None
    assert_reaped(proc)
    assert set(os.listdir("/proc/self/fd")) == before  # its pidfd closed


def make_ready(sb: Standby, children: Children) -> subprocess.Popen:
    sb.keep(True)
    children.ready.add(sb.proc.pid)
    sb.keep(True)
    assert isinstance(sb.state, Ready)
    return sb.proc


def test_a_dead_standby_is_never_taken(sb, children):
    proc = make_ready(sb, children)
    os.kill(proc.pid, signal.SIGKILL)
    assert select.select([sb.pidfd], [], [], 10.0)[0]  # dead, its death not yet told
    assert sb.take(3) is None and children.offered == []
    assert isinstance(sb.state, Idle) and sb.state.in_a_row == 1 and sb.failures == 1
    assert_reaped(proc)


def test_a_standby_that_does_not_answer_its_promotion_is_killed_not_taken(sb, children, now, caplog):
    """Alive to its pidfd but silent when offered the role (stopped, hung, its SIGKILL
    pending): it is never the proxy; it is killed (SIGKILL: a stopped process handles no
    SIGTERM), reaped and counted as a death, with its back-off."""
    proc = make_ready(sb, children)
    os.kill(proc.pid, signal.SIGSTOP)  # it could not answer; the stand-in's hook says so
    children.answers = False
    with caplog.at_level(logging.WARNING, logger="remote_dspark.supervisor"):
        assert sb.take(5) is None
    assert children.offered == [(proc.pid, 5, standby.ANSWER_S)]
    assert sb.state == Idle(1, now[0] + standby.BACKOFF_S) and sb.failures == 1 and sb.proc is None
    assert proc.returncode == -signal.SIGKILL
    assert_reaped(proc)
    assert any("did not answer its promotion" in r.getMessage() for r in caplog.records)


def test_a_standby_still_starting_is_not_offered_the_role(sb, children):
    """It could not answer yet: the supervisor starts a fresh proxy, and the standby is
    stopped by keep(False) like any standby while no proxy serves."""
    sb.keep(True)
    st = sb.state
    assert isinstance(st, Warming)
    assert sb.take(5) is None and children.offered == [] and sb.state is st
    sb.keep(False)
    assert sb.state == Idle() and sb.failures == 0
    assert_reaped(st.proc)

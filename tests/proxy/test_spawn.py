"""How a proxy process ends (``proxy.spawn``): signalled through its pidfd and reaped
within a deadline, SIGKILL past it, with no zombie and no fd left."""

import os
import select
import signal
import time

import pytest
from helpers import child

from remote_dspark.proxy.spawn import reap, signal_child, terminate

IGNORES_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(30)
"""
SLEEPS = "print('ready', flush=True)\nimport time\ntime.sleep(30)\n"
BURNS_CPU = """
import sys, time
end = time.process_time() + 0.2
while time.process_time() < end:
    pass
sys.exit(3)
"""


def open_fds():
    return set(os.listdir("/proc/self/fd"))


def assert_reaped(pid: int) -> None:
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_a_child_that_ignores_sigterm_is_killed_at_its_deadline_and_reaped():
    before = open_fds()
    with child(IGNORES_SIGTERM) as proc:
        pidfd = os.pidfd_open(proc.pid)
        assert proc.stdout.readline() == "ready\n"  # its SIGTERM handler is set
        t0 = time.monotonic()
        terminate(proc, pidfd, 0.2)
        took = time.monotonic() - t0
        assert proc.returncode == -signal.SIGKILL
        assert 0.2 <= took < 5.0, took  # the deadline, then the SIGKILL's exit
        assert_reaped(proc.pid)
    assert open_fds() == before  # its pidfd closed (and the pipes, by child())


def test_a_child_that_exits_on_sigterm_is_not_killed():
    with child(SLEEPS) as proc:
        pidfd = os.pidfd_open(proc.pid)
        assert proc.stdout.readline() == "ready\n"
        terminate(proc, pidfd, 10.0)
        assert proc.returncode == -signal.SIGTERM
        assert_reaped(proc.pid)


def test_reaping_an_exited_child_gives_its_status_and_cpu_time():
    with child(BURNS_CPU) as proc:
        pidfd = os.pidfd_open(proc.pid)
        assert select.select([pidfd], [], [], 10.0)[0]  # it has exited
        cpu_s = reap(proc, pidfd)
        assert proc.returncode == 3 and cpu_s >= 0.2
        assert_reaped(proc.pid)


def test_a_live_child_reaped_without_a_deadline_is_killed_at_once():
    with child(SLEEPS) as proc:
        pidfd = os.pidfd_open(proc.pid)
        assert proc.stdout.readline() == "ready\n"
        reap(proc, pidfd)
        assert proc.returncode == -signal.SIGKILL
        assert_reaped(proc.pid)


def test_a_child_reaped_elsewhere_keeps_its_status_and_its_pidfd_is_closed():
    before = open_fds()
    with child("import sys; sys.exit(5)") as proc:
        pidfd = os.pidfd_open(proc.pid)
        assert proc.wait(10.0) == 5  # reaped by Popen, not by reap()
        signal_child(pidfd, signal.SIGKILL)  # gone: no error
        assert reap(proc, pidfd) == 0.0 and proc.returncode == 5
    assert open_fds() == before

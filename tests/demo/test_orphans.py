"""Every child a command starts ends with it, whatever signal ends the command: SIGTERM
is a clean stop (exit 143, its worker stopped, its engine closed), and after SIGKILL
the worker notices its parent is gone (``--parent``) and the proxies get their
parent-death signal. Checked over the process tree captured before the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
from helpers import until

from remote_dspark.cli.main import main

WORKER, PROXY, PEER = "worker", "remote_dspark.proxy_proc", "remote_dspark.bench.handoff.peer"

# command -> the children it runs once under way (each named by a word of its command line)
COMMANDS = {
    "demo": (("demo", "--rounds", "1000000", "--slots", "16"), (WORKER, PROXY)),
    "chaos": (("chaos", "--seconds", "600", "--slots", "16"), (WORKER, PROXY)),
    "bench failover": (("bench", "failover", "--kills", "50", "--idle-s", "600"), (WORKER, PROXY)),
    "bench handoff": (("bench", "handoff", "--rounds", "100000000"), (PEER,)),
}


def _runs(p: psutil.Process, word: str) -> bool:
    try:
        return any(word in part for part in p.cmdline())
    except psutil.Error:
        return False


def _running(name: str, log) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """The command started, once it runs the children it should; its descendants then."""
    command, children = COMMANDS[name]
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote_dspark", *command],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))},
    )
    me = psutil.Process(proc.pid)

    def tree() -> list[psutil.Process]:
        try:
            return me.children(recursive=True)
        except psutil.Error:
            return []

    ok = until(lambda: all(any(_runs(p, word) for p in tree()) for word in children), timeout=90.0, step=0.05)
    if not ok:
        proc.kill()
        proc.wait(10)
        for p in tree():
            p.kill()
        log.seek(0)
        pytest.fail(f"{name} did not start {children}: {log.read()[-2000:]!r}")
    return proc, tree()


def _end(proc: subprocess.Popen, tree: list[psutil.Process]) -> list[psutil.Process]:
    """What of ``tree`` is still there 15 s after the command ended (then killed)."""
    try:
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    _, alive = psutil.wait_procs(tree, timeout=15)
    for p in alive:
        p.kill()
    return alive


@pytest.mark.parametrize("name", list(COMMANDS))
def test_sigterm_stops_a_command_cleanly_and_leaves_no_process(name, tmp_path):
    with open(tmp_path / "log", "w+") as log:
        proc, tree = _running(name, log)
        proc.send_signal(signal.SIGTERM)
        alive = _end(proc, tree)
        log.seek(0)
        assert proc.returncode == 128 + signal.SIGTERM, log.read()[-2000:]
    assert alive == []


@pytest.mark.parametrize("name", ["demo", "bench handoff"])
def test_a_killed_command_leaves_no_process(name, tmp_path):
    """SIGKILL runs no cleanup: the worker's --parent watch and the proxies' and the
    handoff peers' parent-death signal end them."""
    with open(tmp_path / "log", "w+") as log:
        proc, tree = _running(name, log)
        proc.kill()
        alive = _end(proc, tree)
    assert alive == []


def test_a_worker_refuses_a_parent_that_is_not_its_own(capsys):
    not_mine = os.getppid() + 1 if os.getppid() != 1 else 2
    assert main(["worker", "--listen", "127.0.0.1:0", "--parent", str(not_mine)]) == 2
    err = capsys.readouterr().err
    assert f"--parent {not_mine}: not this worker's parent" in err

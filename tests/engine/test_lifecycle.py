"""``RemoteDSpark``'s lifecycle under concurrency, in each mode (sync, thread, process):
close() while another thread runs rounds, stats() scraped while close() runs, and what a
closed engine answers.

Each scenario runs in a child process (tests/engine/lifecycle_child.py) with its own loopback
worker, so a crash there (SIGSEGV: a wait reading a region close() unmapped) fails the
test with the child's stacks instead of ending the test run. The child checks each cycle
and prints a ``SUMMARY {json}`` line; the test asserts on its exit status and summary.

Nothing here needs a round to be in flight when close() comes (that is timing): the
child counts how often one was (``in_flight_at_close``) and the summary shows it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import REPO, TESTS

from remote_dspark.engine.lifecycle import Users
from remote_dspark.outcome import Outcome

CHILD = Path(__file__).resolve().with_name("lifecycle_child.py")
MODES = ("sync", "thread", "process")
CYCLES = 25  # the bug report's number: one SIGSEGV in two runs of 25 (thread mode)
CLOSE_DEADLINE_S = 2.0  # the API's: close() returns within 2 s
CHILD_LIMIT_S = 90.0  # the whole child (a cycle alone is cut at 20 s, with its stacks)


def run_child(tmp_path: Path, scenario: str, mode: str, cycles: int) -> dict:
    """Run one scenario in a child process (its own session: whatever it leaves running,
    a proxy included, is killed with it); its summary. Fails the test on a non-zero exit
    or a signal, with the child's stderr."""
    seed = random.randrange(2**32)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]))
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), scenario, mode, str(cycles), str(seed), str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=CHILD_LIMIT_S)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{scenario}/{mode} (seed {seed}): the child did not end within {CHILD_LIMIT_S} s\n{_tail(err)}")
    finally:
        _kill_session(proc.pid)
    summaries = [line[len("SUMMARY ") :] for line in out.splitlines() if line.startswith("SUMMARY ")]
    summary = json.loads(summaries[-1]) if summaries else None
    rc = proc.returncode
    how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
    assert rc == 0, (
        f"{scenario}/{mode} (seed {seed}): the child ended with {how}\nsummary: {summary}\nstderr:\n{_tail(err)}"
    )
    assert summary is not None, f"{scenario}/{mode}: no SUMMARY line\nstdout:\n{_tail(out)}"
    print(f"{scenario}/{mode}: {summary}")  # in_flight_at_close and close times, for the record
    return summary


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the child's session: it and anything it left
    except ProcessLookupError:
        pass


def _tail(text: str, n: int = 6000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


def _check_closes(s: dict) -> None:
    assert s["close_max_s"] < CLOSE_DEADLINE_S, f"close() took {s['close_max_s']:.3f} s: {s['close_s']}"


# --------------------------------------------------------------------------- close() against round()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_close_while_another_thread_runs_rounds(tmp_path, mode):
    """CYCLES times: start; a thread calls round() in a loop; after a short random delay
    this thread calls close(). The round thread ends (bounded) having seen only Drafts
    and then RemoteClosed; close() returns within 2 s; round() after close raises
    RemoteClosed. The child does not crash."""
    s = run_child(tmp_path, "close_round", mode, CYCLES)
    assert s["cycles"] == CYCLES and s["failed_cycles"] == 0, s["failures"]
    _check_closes(s)
    assert set(s["outcomes"]) <= {*(o.label for o in Outcome), "RemoteClosed"}, s["outcomes"]
    assert s["outcomes"]["RemoteClosed"] == CYCLES  # every round thread ended by it


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_stats_scraped_while_close_runs(tmp_path, mode):
    """CYCLES times: rounds in one thread, stats() in a loop in another, close() from
    this one. No exception anywhere; the rounds total read after close() returns never
    changes again and is >= every total read before; stats() after close is the final
    stats file close() wrote."""
    s = run_child(tmp_path, "stats_close", mode, CYCLES)
    assert s["cycles"] == CYCLES and s["failed_cycles"] == 0, s["failures"]
    _check_closes(s)
    assert s["scrapes"] > 0


# --------------------------------------------------------------------------- a closed engine


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_closed_engine(tmp_path, mode):
    """close() twice is fine; round() and launch() after close raise RemoteClosed; start()
    after close raises RuntimeError naming the state: for a started engine and for one
    closed before its start."""
    s = run_child(tmp_path, "closed", mode, 1)
    assert s["cycles"] == 1 and s["failed_cycles"] == 0, s["failures"]
    _check_closes(s)


def test_the_last_user_to_leave_wakes_a_close_waiting_alone_and_frees_once():
    """Users: a close waiting for the round inside is woken by its leave (not by its
    deadline, far off), and the resources are freed once, by whoever leaves last."""
    freed = []
    users = Users(lambda: freed.append(1))
    assert users.enter()  # a round
    users.shut()
    assert not users.enter()  # shut: no new round
    got = []
    waiter = threading.Thread(target=lambda: got.append(users.wait_alone(time.monotonic() + 60)))
    waiter.start()
    deadline = time.monotonic() + 10
    while users._waiting == 0 and time.monotonic() < deadline:  # until the close waits
        time.sleep(0.001)
    users.leave()  # the round leaves
    waiter.join(timeout=10)
    assert not waiter.is_alive() and got == [True], "the round's leave did not wake the waiting close"
    assert freed == []  # the owner is still in
    users.leave()  # the owner
    assert freed == [1] and users.inside == -1

"""The engine's CPU wait in the asynchronous modes sleeps: against a slow worker a round
costs the engine thread its spin (``ASYNC_SPIN_US``), not a core for the whole round;
and the releasers that end a round without the proxy (the supervisor's answers for a
killed proxy, ``close``) wake an engine asleep on it. The CPU per wall-second figure is
the benchmark's (``bench round --worker-late-ms``); these only assert that it sleeps.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from engines import async_env, batch, make
from helpers import until

from remote_dspark.outcome import Outcome

SLOW_S = 0.1  # the worker answers every round this late
WOKEN_S = 15.0  # generous: a woken engine is back long before this (its own limit is minutes)


def engine_env(worker, tmp_path, mode: str, **kw) -> dict:
    """Defaults of the contract for the wait (ASYNC_NAP_US 0, ASYNC_SPIN_US 1000), and a
    round deadline far past the worker's delay."""
    return async_env(
        worker.port,
        tmp_path,
        mode,
        VLLM_DSPARK_REMOTE_ASYNC_NAP_US="0",
        VLLM_DSPARK_REMOTE_TIMEOUT_MS=kw.pop("timeout_ms", "2000"),
        **kw,
    )


def waiters(rd) -> int:
    path = rd._path.inner.handoff
    return path.lib.load32(path.region.addr(path.region.layout.waiters))


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_engines_wait_sleeps_through_a_slow_round(worker, tmp_path, mode):
    with make(engine_env(worker, tmp_path, mode)) as rd:
        assert rd.round(batch()).outcome is Outcome.OK
        worker.faults.set_delay(SLOW_S)
        step = batch(new=False, tokens=((2,), (4,)), positions=(1, 1))
        wall = cpu = 0.0
        for _ in range(3):
            c0, t0 = time.thread_time(), time.monotonic()
            out = rd.round(step)
            wall, cpu = wall + time.monotonic() - t0, cpu + time.thread_time() - c0
            assert out.outcome is Outcome.OK
    # The rounds were slow, so a spinning wait would cost the thread most of their time
    # (a spinning thread gets less than all of it only on a loaded machine); a sleeping
    # one costs its spin, a few milliseconds in all.
    assert wall >= 3 * SLOW_S / 2
    assert cpu < wall / 4, f"the engine thread used {cpu:.3f} s of CPU over {wall:.3f} s of rounds"


def round_in_a_thread(rd) -> tuple[threading.Thread, list]:
    """A round on another thread (the engine's), its result or exception in the list."""
    done: list = []

    def go():
        try:
            done.append(rd.round(batch()))
        except Exception as e:  # noqa: BLE001 (the test reads it)
            done.append(e)

    t = threading.Thread(target=go)
    t.start()
    return t, done


def test_a_killed_proxys_round_wakes_the_sleeping_engine(worker, drafter, tmp_path):
    """The supervisor answers a lost proxy's rounds (orphans, then no-proxy): the engine
    asleep on one is woken at once, not at its watchdog (4 x TIMEOUT_MS = 2 minutes)."""
    with make(engine_env(worker, tmp_path, "process", timeout_ms="30000")) as rd:
        assert rd.round(batch()).outcome is Outcome.OK
        drafter.gate.clear()  # the worker holds its drafts back: the round stays in flight
        t, done = round_in_a_thread(rd)
        try:
            assert until(lambda: waiters(rd) == 1), "the engine's wait never went to sleep"
            os.kill(rd.supervisor.live.pid, signal.SIGKILL)
            t.join(WOKEN_S)
            assert not t.is_alive(), "the supervisor's answer did not wake the sleeping engine"
            assert done[0].outcome is not Outcome.OK
        finally:
            drafter.gate.set()
            t.join(WOKEN_S)


def test_close_wakes_an_engine_asleep_on_its_round(worker, drafter, tmp_path):
    """``close`` from another thread answers the round in flight (its fence): the engine
    asleep on it is woken and returns, and close is not held up by it."""
    rd = make(engine_env(worker, tmp_path, "process", timeout_ms="30000"))
    rd.start()
    t = None
    try:
        assert rd.round(batch()).outcome is Outcome.OK
        drafter.gate.clear()
        t, done = round_in_a_thread(rd)
        assert until(lambda: waiters(rd) == 1), "the engine's wait never went to sleep"
        rd.close()
        t.join(WOKEN_S)
        assert not t.is_alive(), "close did not wake the sleeping engine"
        assert done and (isinstance(done[0], Exception) or done[0].outcome is not Outcome.OK)
    finally:
        drafter.gate.set()
        rd.close()
        if t is not None:
            t.join(WOKEN_S)

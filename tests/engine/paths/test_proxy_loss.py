"""Losing the proxy in the two ways a supervisor must not make worse, with real proxy
processes over a real region: a loss while the warm standby is frozen (it must not be
promoted, and the loss costs one respawn), and the supervisor's own failure (the rounds
its proxy held are released, and no process is left)."""

from __future__ import annotations

import os
import signal

import torch
from helpers import CHILD_TIMEOUT_S, env_for, until, value
from prometheus_client import CollectorRegistry, generate_latest

from remote_dspark.config.api import RemoteConfig
from remote_dspark.engine import Batch, Mode, RemoteDSpark
from remote_dspark.engine.observe.metrics import RemoteDSparkCollector
from remote_dspark.engine.paths.handoff import Handoff
from remote_dspark.engine.paths.proxy_host import ProcessHost, host_for
from remote_dspark.outcome import Outcome


def state_of(pid: int) -> str:
    """The process's state letter (``T``: stopped); ``gone`` once it is reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "gone"


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def exposition(rd: RemoteDSpark) -> str:
    registry = CollectorRegistry()
    registry.register(RemoteDSparkCollector(rd))
    return generate_latest(registry).decode()


STEP = Batch.from_lists([0, 1], [[2], [4]], [1, 1], [False, False], torch.zeros(2, 2), torch.arange(2))


def test_a_frozen_standby_is_not_promoted_a_fresh_proxy_serves_and_the_loss_costs_one_respawn(worker, tmp_path):
    """The standby SIGSTOPped, then the serving proxy SIGKILLed: the standby is offered
    the role, does not answer, and is killed and reaped; a fresh proxy serves on the
    loss's one respawn, with no wait for a start limit and no stall on the record. The
    budget and the standby's death are what the stats and the metrics say."""
    env = env_for(worker.port, tmp_path, Mode.PROCESS, VLLM_DSPARK_REMOTE_ASYNC_RESPAWNS="3")
    rd = RemoteDSpark(RemoteConfig.from_env(env), num_spec=3, max_slots=4, row_bytes=8, environ=env).start()
    try:
        sup = rd.supervisor
        assert until(lambda: rd.round(STEP).outcome is Outcome.OK, timeout=CHILD_TIMEOUT_S)
        assert until(lambda: sup.stats().standby == "ready", timeout=CHILD_TIMEOUT_S)
        before = sup.stats()
        proxy, frozen = sup.up.pid, sup.standby.proc.pid
        os.kill(frozen, signal.SIGSTOP)
        try:
            assert until(lambda: state_of(frozen) == "T")
            os.kill(proxy, signal.SIGKILL)
            assert until(lambda: rd.round(STEP).outcome is Outcome.OK, timeout=CHILD_TIMEOUT_S)
            assert sup.live.pid not in (proxy, frozen) and state_of(frozen) == "gone"  # killed and reaped
        finally:
            resume(frozen)
        st = sup.stats()
        assert (before.budget_left - st.budget_left, st.restarts) == (1, {"exit": 0, "signal": 1, "stall": 0})
        assert st.standby_failures == before.standby_failures + 1
        text = exposition(rd)
        assert value(text, "dspark_remote_respawn_budget_left") == before.budget_left - 1 == 2
        assert value(text, "dspark_remote_proxy_restarts_total", cause="stall") == 0
        assert value(text, "dspark_remote_standby_failures_total") == 1
        pids = [sup.live.pid, *([sup.standby.proc.pid] if sup.standby.proc else [])]
    finally:
        rd.close()
    assert all(state_of(pid) == "gone" for pid in pids)


def test_the_supervisors_failure_releases_the_rounds_its_proxy_held_and_leaves_no_process(
    worker, tmp_path, monkeypatch
):
    """The watcher fails while its proxy holds a claimed round (the test claims it for
    the stopped proxy, as a proxy killed between its claim and its release leaves it):
    the proxy and the standby are ended and reaped, the supervisor is Spent, and the
    round is released (orphan) instead of holding the engine for good."""
    failing = []

    def stalled(host, up):  # the stall check, failing once the test says so
        if failing:
            raise RuntimeError("the stall check failed")
        return False

    monkeypatch.setattr(ProcessHost, "_stalled", stalled)
    env = env_for(worker.port, tmp_path, Mode.PROCESS)
    rd = RemoteDSpark(RemoteConfig.from_env(env), num_spec=3, max_slots=4, row_bytes=8, environ=env)
    path = Handoff(rd.spec, rd.counts)
    host = host_for(rd.spec, path)
    stopped = []
    try:
        host.start()
        sup = host.supervisor
        assert until(lambda: sup.up is not None and sup.stats().standby == "ready", timeout=CHILD_TIMEOUT_S)
        proxy, standby = sup.up.pid, sup.standby.proc.pid
        os.kill(proxy, signal.SIGSTOP)
        stopped.append(proxy)
        assert until(lambda: state_of(proxy) == "T")
        end, lib = path.end, path.lib
        r = end.reserve(1)
        end.write_entries(r, [])
        path.sync.signal(r)
        assert lib.claim(path.region.addr(path.region.layout.claim), r) == 0  # held, never released
        failing.append(True)
        assert until(lambda: sup.stats().state == "spent", timeout=CHILD_TIMEOUT_S)
        assert until(lambda: end.released() == r, timeout=CHILD_TIMEOUT_S)
        assert end.drafts(r).outcome is Outcome.ORPHAN and end.counters.snapshot().counters["orphan_releases"] == 1
        assert state_of(proxy) == state_of(standby) == "gone"  # ended and reaped
    finally:
        for pid in stopped:
            resume(pid)
        host.stop()
        path.users.shut()
        path.users.leave()

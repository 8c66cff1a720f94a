"""bench failover's worker rows on a tiny budget: a fleet of two workers on 127.0.0.x."""

from __future__ import annotations

import pytest

from remote_dspark.bench import failover_workers as fw
from remote_dspark.demo.fleet import WorkerFleet
from remote_dspark.demo.harness import worker_limits


@pytest.mark.slow
def test_worker_rows_measure_each_failover_and_the_spread():
    fleet = WorkerFleet(2, extra=worker_limits(8, 64), chaos=False)  # as the bench runs it
    try:
        kill = fw.measure_worker_faults(fleet, 8, "kill", 1, 100.0)
        stall = fw.measure_worker_faults(fleet, 8, "stall", 1, 100.0)
        spread = fw.measure_spread(fleet, 8, engines=3)
        assert fleet.running() == [w.proc.pid for w in fleet.workers]  # the killed worker was started again
    finally:
        fleet.stop()
    assert fleet.running() == []
    for row in (kill, stall):
        assert len(row["samples_ms"]) == len(row["target_only"]) == len(row["drafted_ms"]) == 1
        assert 0 < row["p50_ms"] <= row["drafted_p50_ms"] < fw.ROUND_LIMIT_S * 1e3
    assert kill["max_target_only"] <= 1
    assert stall["max_ms"] >= stall["timeout_ms"]  # a stall waits out a deadline at least
    assert sum(spread["per_worker"]) == 3 and spread["served_by_killed"]
    assert spread["only_its_engines_moved"], spread
    names = [g[0] for g in fw.goals([kill, stall, spread])]
    assert len(names) == 5 and "worker SIGSTOP -> ok max ms" in names

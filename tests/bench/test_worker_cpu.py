"""``bench worker-engines``' worker CPU per round and share of the drafter
(remote_dspark.bench.worker_cpu): the arithmetic from two samples, the process CPU read
from /proc, the drafter measured once per entry count for the steady rows only, and the
keys, columns and goals the report gives them. No worker, no bench run."""

from __future__ import annotations

import argparse
import os
import time

import pytest

from remote_dspark.bench import worker_cpu, worker_engines
from remote_dspark.bench.worker_cpu import Sample

TICK = os.sysconf("SC_CLK_TCK")


def test_cpu_per_round_is_the_workers_cpu_less_its_drafters_over_the_rounds():
    before = Sample(cpu_s=1.0, drafter_cpu_s=0.2, rounds=100, calls=10, call_entries=640)
    after = Sample(cpu_s=1.5, drafter_cpu_s=0.45, rounds=300, calls=20, call_entries=1920)
    assert worker_cpu.per_round(before, after) == {
        "worker_cpu_us_per_round": 1250.0,  # (0.5 - 0.25) s over 200 rounds
        "drafter_cpu_us_per_round": 1250.0,  # 0.25 s over 200 rounds
        "worker_cpu_resolution_us": round(1e6 / TICK / 200, 1),  # a tick over the rounds
        "entries_per_call": 128.0,  # 1,280 entries over 10 calls
    }


def test_no_round_or_no_proc_gives_none_not_a_figure():
    same = Sample(cpu_s=1.0, drafter_cpu_s=0.2, rounds=100, calls=10, call_entries=640)
    assert set(worker_cpu.per_round(same, same).values()) == {None}
    unknown = Sample(cpu_s=None, drafter_cpu_s=0.3, rounds=110, calls=11, call_entries=650)
    got = worker_cpu.per_round(same, unknown)
    assert got["worker_cpu_us_per_round"] is None and got["worker_cpu_resolution_us"] is None
    assert got["drafter_cpu_us_per_round"] == 10_000.0 and got["entries_per_call"] == 10.0


def test_process_cpu_reads_this_process_as_the_kernel_counts_it():
    start = time.process_time()
    while time.process_time() - start < 0.05:  # this process's CPU advances while it runs
        pass
    got, now = worker_cpu.process_cpu(os.getpid()), time.process_time()
    assert got is not None and abs(got - now) <= 2 / TICK + 0.01  # clock ticks against the precise clock
    assert worker_cpu.process_cpu(2**22 + 1) is None  # past any pid: no /proc entry


def test_share_is_the_rows_entries_per_second_over_the_drafters():
    assert worker_cpu.share(50_000.0, 200_000.0) == 0.25
    assert worker_cpu.share(50_000.0, None) is None


def test_the_drafter_is_measured_once_per_entry_count_for_the_steady_rows(monkeypatch):
    asked = []

    def alone(args, entries):
        asked.append(entries)
        return 1000.0 * entries

    monkeypatch.setattr(worker_cpu, "drafter_entries_per_s", alone)
    rows = [
        {"mode": "alone", "entries_per_s": 8_000.0, "entries_per_call": 16.0},
        {"mode": "batched", "entries_per_s": 16_000.0, "entries_per_call": 31.6},
        {"mode": "serialized", "entries_per_s": 4_000.0, "entries_per_call": 16.0},
        {"mode": "storm", "entries_per_s": 1_000.0, "entries_per_call": 900.0},  # the storm's calls
        {"mode": "batched", "entries_per_s": 1.0, "entries_per_call": None},  # no call measured
    ]
    worker_cpu.add_shares(argparse.Namespace(), rows)
    assert asked == [16, 32]
    assert [r["drafter_entries_per_s"] for r in rows] == [16_000.0, 32_000.0, 16_000.0, None, None]
    assert [r["share_of_drafter"] for r in rows] == [0.5, 0.5, 0.25, None, None]


def report_of(cpu: float | None, share: float | None) -> dict:
    args = argparse.Namespace(engines=2, slots=64, rounds=10, warmup=1, num_spec=5, drafter="lm", hf_random=None)
    args.__dict__.update(device="cpu", storm=0, long_slots=0, long_tokens=8192)
    args.__dict__.update(max_batch_tokens=None, max_round_tokens=None, verify_ms=0, speculate=0)
    row = dict(engines=2, slots=64, p50_ms=2.0, p99_ms=3.0, entries_per_s=64_000.0, rss_growth_mb=1.0, rss_bound_mb=9.0)
    row.update(worker_cpu_us_per_round=cpu, share_of_drafter=share)
    rows = [dict(row, mode="alone", engines=1), dict(row, mode="batched"), dict(row, mode="serialized")]
    return worker_engines.make_report(args, rows)


@pytest.mark.parametrize("cpu,share,met", [(42.0, 0.8, True), (600.0, 0.22, False)])
def test_the_report_gives_both_goals_and_the_table_both_columns(cpu, share, met):
    report = report_of(cpu, share)
    goals = {g["goal"]: g for g in report["goals"]}
    goal = goals["batched worker CPU per round at 64 slots apart from the drafter's own host work <= 50 us"]
    assert (goal["value"], goal["met"]) == (cpu, met)
    goal = goals["batched entries/s >= 70% of the drafter's own at its entries per call"]
    assert (goal["value"], goal["met"]) == (share, met)
    table = worker_engines.format_table(report)
    assert "cpu us/rd" in table and "of drafter" in table
    assert f"{cpu:,.0f}" in table.splitlines()[4] and f"{share:.0%}" in table.splitlines()[4]  # the batched row
    assert f"<= 50 us: {cpu} us, {'met' if met else 'NOT met'}" in table


def test_without_the_figures_no_goal_and_a_dash():
    report = report_of(None, None)
    assert not [g for g in report["goals"] if "CPU" in g["goal"] or "drafter's own" in g["goal"]]
    assert worker_engines.format_table(report).splitlines()[4].split()[-2:] == ["-", "-"]

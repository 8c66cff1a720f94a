"""``remote-dspark bench handoff``: a tiny run of the real machinery (every peer kind,
with and without the GIL hog) that checks every row is reported. No timed assertions."""

from __future__ import annotations

import argparse
import json

import pytest

from remote_dspark.bench import add_parsers
from remote_dspark.bench.handoff import peers as handoff_peers
from remote_dspark.bench.handoff import run as handoff

ROWS = {(m, hog) for m in handoff.MODES for hog in (False, True)}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="remote-dspark bench")
    add_parsers(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(argv)


def test_handoff_is_registered_with_its_options():
    args = parse(["handoff", "--rounds", "7", "--json", "--no-pin"])
    assert args.func is handoff.run
    assert (args.rounds, args.json, args.pin, args.nap_us) == (7, True, False, 0)


def test_idle_gap_is_reported_and_a_negative_one_refused(lib, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_DSPARK_REMOTE_HOSTFLAG_LIB", lib.path)
    monkeypatch.setattr(handoff, "MODES", ("c_peer",))  # one row is enough here
    assert handoff.run(parse(["handoff", "--rounds", "3", "--warmup", "0", "--idle-us", "200"])) == 0
    out = capsys.readouterr().out
    assert "200 us idle before each round" in out.splitlines()[0]
    with pytest.raises(ValueError, match="--idle-us=-1"):
        handoff.run(parse(["handoff", "--idle-us", "-1"]))


def test_tiny_run_reports_every_row(lib, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_DSPARK_REMOTE_HOSTFLAG_LIB", lib.path)  # no build in ~/.cache
    assert handoff.run(parse(["handoff", "--rounds", "4", "--warmup", "1", "--json"])) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert {(r["mode"], r["hog"]) for r in report["rows"]} == ROWS
    assert len(report["rows"]) == len(ROWS)
    for r in report["rows"]:
        assert r["median_us"] <= r["p99_us"] <= r["max_us"]
        assert (r["gil_wait"] is None) == (r["timed_in"] == "Python")
        assert set(r["x_floor"]) == {"median_us", "p99_us", "max_us"}
    assert set(report["targets"]) == {
        "process_p99_us",
        "process_p99_met",
        "hog_worst_ratio_thread_over_process",
        "hog_worst_ratio_met",
    }
    assert err.count("handoff rows: ") == len(ROWS) + 1  # progress on stderr, a line per row

    table = handoff.format_table(report).splitlines()
    mode_of = {d: m for m, d in handoff.DESCRIBE.items()}
    body = [line for line in table if line[:26].strip() in mode_of]
    assert sorted((mode_of[line[:26].strip()], line[26:31].strip() == "yes") for line in body) == sorted(ROWS)
    assert any(line.startswith("target process p99") for line in table)


def test_cuda_table_shows_after_idle_figures_and_the_target():
    """The CUDA report's table, from a report as make_report writes it (no GPU needed)."""
    from remote_dspark.bench.handoff import cuda as handoff_cuda

    def row(mode, hog, med, p99, idle, slow=3):
        return {
            "mode": mode,
            "hog": hog,
            "timed_in": "CUDA events",
            "median_us": med,
            "p99_us": p99,
            "max_us": p99 * 2,
            "after_idle": idle,
            "rounds": 10,
            "over_target": slow,
            "x_floor": {"median_us": round(med / 5, 2), "p99_us": round(p99 / 6, 2), "max_us": 1},
        }

    report = {
        "device": "GPU X",
        "rounds": 10,
        "warmup": 2,
        "spin_us": 1000,
        "nap_us": 0,
        "pinning": "not pinned",
        "rows": [
            row("c_peer", False, 5.0, 6.0, {"median_us": 5.5, "p99_us": 6.5}),
            row("process", False, 6.0, 7.0, {"median_us": 7.25, "p99_us": 15.5}),
            row("e2e", False, 900.0, 1000.0, None),
        ],
        "targets": {"process_median_ratio_max": 1.2, "process_p99_us_max": 7.0, "met": True, "floor_p99_us_max": 6.0},
    }
    report["rows"][1]["over_target"] = 1
    lines = handoff_cuda.format_table(report).splitlines()
    by_mode = {line[:28].strip(): line for line in lines}
    assert by_mode["proxy loop, own process"].split()[-2:] == ["7.25/15.50", "1/10"]
    assert by_mode["round to loopback worker"].split()[-2:] == ["-", "3/10"]
    assert lines[-2].endswith("1.2x, 7.00 us, met")
    assert lines[-1] == "(the floor's own p99, worst of the two: 6.00 us)"


INTERRUPTS = """\
           CPU0       CPU1       CPU2       CPU3
  0:         40          0          0          0   IO-APIC    2-edge      timer
 24:          0          0          0       4560   PCI-MSIX-0000:00:01.0 1-edge virtio0-req
 25:          7          0          0          0   PCI-MSIX-0000:00:02.0 0-edge eth0-rx-0
LOC:      10644      20000      30000      90000   Local timer interrupts
CAL:        336        100        900       5000   Function call interrupts
"""


def test_device_interrupts_counts_numbered_lines_only(tmp_path):
    path = tmp_path / "interrupts"
    path.write_text(INTERRUPTS)
    assert handoff_peers.device_interrupts(str(path)) == {0: 47, 1: 0, 2: 0, 3: 4560}
    assert handoff_peers.device_interrupts(str(tmp_path / "missing")) == {}


def test_the_peer_goes_to_the_last_cpu_without_device_interrupts(tmp_path, monkeypatch):
    """CPU 3 serves a device's interrupts (as on the Firecracker VM of the H200, where
    they made the stream miss its poll): the peer takes CPU 2, the engine the rest."""
    path = tmp_path / "interrupts"
    path.write_text(INTERRUPTS)
    monkeypatch.setattr(handoff_peers.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(handoff_peers, "_siblings", lambda cpu: {cpu})
    pins = handoff_peers.Pinning.plan(True, str(path))
    assert (pins.peer, pins.engine) == ({2}, {0, 1, 3})
    quiet = handoff_peers.Pinning.plan(True, str(tmp_path / "missing"))  # nothing known: the last
    assert (quiet.peer, quiet.engine) == ({3}, {0, 1, 2})
    assert handoff_peers.Pinning.plan(False, str(path)) == handoff_peers.Pinning(None, None)


def test_region_rows_report_the_rounds_after_an_idle_gap_apart():
    """Every IDLE_EVERY-th round of a region row follows an idle gap (the peer sleeps):
    its wake-up is reported on its own, never mixed into the back-to-back figures."""
    from remote_dspark.bench.handoff import run as handoff
    from remote_dspark.bench.handoff.peers import Pinning
    from remote_dspark.bench.handoff.types import HandoffOptions

    opts = HandoffOptions(rounds=2 * handoff.IDLE_EVERY, warmup=2, spin_us=50, nap_us=0, pin=False)
    pins = Pinning(None, None)
    rows = handoff.run_all(opts, pins, modes=("process",))
    assert [r.after_idle is not None for r in rows] == [True, True]
    report = handoff.make_report(opts, pins, rows)
    assert all(r["after_idle"]["median_us"] > 0 for r in report["rows"])
    assert "after idle p50/p99" in handoff.format_table(report)

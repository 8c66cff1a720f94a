"""``remote-dspark bench round``: its arguments, its JSON, the feeder's batches, and that
every child it starts is ended. Tiny runs of the real machinery; no timed assertions."""

from __future__ import annotations

import argparse
import json
import subprocess
from types import SimpleNamespace

import pytest
import torch

from remote_dspark import wire
from remote_dspark.bench import add_parsers
from remote_dspark.bench.round import feeder as round_feeder
from remote_dspark.bench.round import floor as round_floor
from remote_dspark.bench.round import options as round_options
from remote_dspark.bench.round import report as round_report
from remote_dspark.bench.round import run as rb
from remote_dspark.cli import main as cli

ROW_KEYS = {"mode", "slots", "p50_ms", "p99_ms", "x_floor", "engine_cpu_ms"}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="remote-dspark bench")
    add_parsers(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(argv)


def bench(argv: list[str], capture) -> tuple[int, str, str]:
    """Run the CLI; ``capture`` is capsys, or capfd where children could write to fd 1."""
    rc = cli.main(["bench", "round", *argv])
    out, err = capture.readouterr()
    return rc, out, err


@pytest.fixture
def children(monkeypatch) -> list[subprocess.Popen]:
    """Every subprocess.Popen started during the test (floor peer, worker, proxy)."""
    procs: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            procs.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    return procs


# --------------------------------------------------------------------------- arguments


def test_round_is_registered_with_its_defaults():
    args = parse(["round"])
    assert args.func is rb.run
    opts = round_options.options(args)
    assert opts.slots == round_options.SWEEP == (64, 256, 1024, 4096)  # no --slots: the sweep
    assert (opts.num_spec, opts.row_bytes, opts.rounds, opts.modes) == (5, 1024, 500, round_options.MODES)
    assert round_options.options(parse(["round", "--no-sweep"])).slots == (256,)
    assert round_options.options(parse(["round", "--slots", "8,64"])).slots == (8, 64)
    picked = round_options.options(parse(["round", "--slots", "8", "--modes", "process,floor"]))
    assert picked.modes == ("floor", "process")  # table order


def test_big_rounds_measure_fewer_rounds():
    opts = round_options.options(parse(["round"]))
    assert [opts.rounds_for(s) for s in round_options.SWEEP] == [500, 500, 125, 50]
    assert round_options.options(parse(["round", "--rounds", "5"])).rounds_for(4096) == 5


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--slots", "0"], "--slots 0: must be in 1..4096"),
        (["--slots", "5000"], "--slots 5000: must be in 1..4096"),
        (["--slots", "abc"], "--slots 'abc': expected an integer"),
        (["--slots", "8,8"], "appears twice"),
        (["--slots", "8", "--sweep"], "--slots 8 with --sweep"),
        (["--modes", "nonsense"], "--modes 'nonsense': unknown mode 'nonsense'"),
        (["--modes", "floor,launch"], "--modes launch: only with --device cuda"),
        (["--modes", ","], "no mode named"),
        (["--num-spec", "0"], "--num-spec 0"),
        (["--num-spec", str(wire.MAX_N_OUT + 1)], f"--num-spec {wire.MAX_N_OUT + 1}"),
        (["--row-bytes", "0"], "--row-bytes 0"),
        (["--row-bytes", "65536"], "over the wire's"),  # 4096 x 64 KiB rows > MAX_PAYLOAD
        (["--rounds", "0"], "--rounds 0: must be >= 1"),
        (["--warmup", "0"], "--warmup 0: must be >= 1"),
        (["--timeout-ms", "0"], "--timeout-ms 0"),
        (["--device-metadata"], "--device-metadata: only with --device cuda"),
        (["--worker-late-ms", "-1"], "--worker-late-ms -1: must be in 0..999"),
        (["--worker-late-ms", "50", "--timeout-ms", "50"], "--worker-late-ms 50: must be in 0..49, below --timeout-ms"),
        (["--sampled", "--num-spec", "17"], "--num-spec 17 with --sampled: a sampled session drafts at most 16"),
        (["--sampled", "--slots", "8,2048"], "--slots 2048 with --sampled: a sampled session has at most 1024"),
        (["--tp", "0"], "--tp 0: must be in 1..8"),
        (["--tp", "2"], "--tp 2: it runs the launch rows"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(argv, says, capsys, monkeypatch):
    started = []
    monkeypatch.setattr(rb, "run_all", lambda opts: started.append(opts) or [])
    rc, out, err = bench(argv, capsys)
    assert rc == 2
    assert says in err and err.startswith("remote-dspark bench: ")
    assert out == "" and started == []  # refused before anything started


# --------------------------------------------------------------------------- runs


def test_tiny_floor_run_prints_only_json_on_stdout(capfd, children):
    rc, out, err = bench(["--slots", "8,16", "--rounds", "5", "--warmup", "2", "--modes", "floor", "--json"], capfd)
    assert rc == 0
    report = json.loads(out)  # the whole of stdout is the JSON object
    assert set(report) == {"config", "rows", "targets"}
    assert [(r["mode"], r["slots"]) for r in report["rows"]] == [("floor", 8), ("floor", 16)]
    for r in report["rows"]:
        assert ROW_KEYS <= set(r)
        assert 0 < r["p50_ms"] <= r["p99_ms"]
        assert r["x_floor"] == 1.0 and r["engine_cpu_ms"] is None and r["not_ok"] is None
        assert r["round_bytes"] == wire.HEADER.size + wire.round_sections(r["slots"], 3 * r["slots"], 1024).size
        assert r["drafts_bytes"] == wire.HEADER.size + wire.drafts_sections(r["slots"], 5, margins=False).size
    c = report["config"]
    assert (c["slots"], c["rounds"], c["warmup"], c["tokens_per_entry"]) == ([8, 16], 5, 2, 3)
    assert {"torch_num_threads", "omp_num_threads", "cpu_count"} <= set(c)
    assert report["targets"] == {}  # nothing at 256 slots: no goal can be judged
    assert "round rows: " in err  # progress on stderr
    assert len(children) == 2 and [p.returncode for p in children] == [0, 0]  # a peer per row, ended


def test_tiny_full_run_reports_every_cpu_row(lib, capfd, children, monkeypatch):
    """Every CPU row against the reference worker (needs the engine and worker rewrites)."""
    monkeypatch.setenv("VLLM_DSPARK_REMOTE_HOSTFLAG_LIB", lib.path)  # no build in ~/.cache
    try:
        rc, out, err = bench(["--slots", "8", "--rounds", "5", "--json"], capfd)
    finally:  # whatever happened, every child (worker, proxies, floor peer) is gone
        assert children and all(p.poll() is not None for p in children), [p.args for p in children if p.poll() is None]
    assert rc == 0, err
    report = json.loads(out)  # nothing else on stdout: not the worker's, not the proxy's
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == list(round_options.MODES) and all(r["slots"] == 8 for r in rows.values())
    for mode, r in rows.items():
        assert ROW_KEYS <= set(r), mode
        assert 0 < r["p50_ms"] <= r["p99_ms"], mode
        assert r["x_floor"] is not None, mode
    for mode in round_options.ENGINE_MODES:
        assert rows[mode]["not_ok"] == 0, (mode, rows[mode]["outcomes"])
        assert rows[mode]["engine_cpu_ms"] is not None and rows[mode]["engine_cpu_ms"] >= 0
        assert rows[mode]["engine_cpu_per_wall"] >= 0
    for mode in round_options.ENGINE_MODES:  # the worker's own time, from its /metrics, within the round's
        inside = rows[mode]
        assert 0 < inside["worker_drafting_ms"] <= inside["worker_ms"], (mode, inside)
    assert "worker_ms" not in rows["floor"] and "worker_ms" not in rows["draft"]
    assert rows["sync"]["x_sync"] is None
    assert rows["thread"]["x_sync"] is not None and rows["process"]["x_sync"] is not None
    assert rows["floor"]["engine_cpu_ms"] is None and rows["draft"]["engine_cpu_ms"] is None


def within_rounding(ratio: float, mine_ms: float, theirs_ms: float) -> bool:
    """``ratio`` (printed to 2 places) is ``mine / theirs`` of two times printed to 4
    places (0.05 us each: a floor row of some 10 us moves its ratio by about 1%)."""
    half = 0.00005
    lo, hi = (mine_ms - half) / (theirs_ms + half), (mine_ms + half) / max(theirs_ms - half, 1e-9)
    return lo - 0.005 - 1e-9 <= ratio <= hi + 0.005 + 1e-9


def test_sampled_twins_of_every_cpu_row_within_the_sampled_cap(lib, capfd, children, monkeypatch):
    """--sampled: each row has a sampled twin (the engine rows' rounds all ok, the floor's
    bytes a sampled ROUND's and DRAFTS'), each twin's x_greedy its p50 over its greedy
    row's; the default sweep's 4096-slot rows, over the sampled cap, have none."""
    monkeypatch.setenv("VLLM_DSPARK_REMOTE_HOSTFLAG_LIB", lib.path)
    try:
        rc, out, err = bench(["--slots", "8", "--rounds", "5", "--sampled", "--json"], capfd)
    finally:
        assert children and all(p.poll() is not None for p in children), [p.args for p in children if p.poll() is None]
    assert rc == 0, err
    report = json.loads(out)
    rows = {(r["mode"], r["sampled"]): r for r in report["rows"]}
    assert set(rows) == {(m, s) for m in round_options.MODES for s in (False, True)}
    for mode in round_options.MODES:
        greedy, twin = rows[(mode, False)], rows[(mode, True)]
        assert greedy["x_greedy"] is None, mode
        assert within_rounding(twin["x_greedy"], twin["p50_ms"], greedy["p50_ms"]), (mode, twin, greedy)
    for mode in round_options.ENGINE_MODES:
        assert rows[(mode, True)]["not_ok"] == 0, (mode, rows[(mode, True)]["outcomes"])
    floor = rows[("floor", True)]
    assert floor["round_bytes"] == wire.HEADER.size + wire.round_sections(8, 24, 1024, sampled=True).size
    assert floor["drafts_bytes"] == wire.HEADER.size + wire.drafts_sections(8, 5, False, sampled=True).size
    assert report["config"]["sampled"] is True
    assert round_options.options(parse(["round", "--sampled"])).kinds(4096) == (False,)
    assert round_options.options(parse(["round", "--sampled"])).kinds(1024) == (False, True)


def test_the_floor_peer_is_ended_when_the_run_fails(children, monkeypatch):
    procs = children
    opts = round_options.options(parse(["round", "--slots", "8", "--rounds", "50", "--warmup", "1"]))

    row = round_floor.floor_row(opts, 8)  # a whole row: the peer answers every round and exits 0
    assert len(row.lat_ns) == 50 and [p.returncode for p in procs] == [0]

    real, calls = round_floor._recv_exactly, []

    def failing(conn, view):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        real(conn, view)

    monkeypatch.setattr(round_floor, "_recv_exactly", failing)
    with pytest.raises(RuntimeError, match="boom"):
        round_floor.floor_row(opts, 8)
    assert len(procs) == 2 and procs[1].returncode is not None  # ended (waited for) in the finally


# --------------------------------------------------------------------------- the feeder


def test_feeder_announces_then_continues_and_reannounces_lost_slots():
    f = round_feeder.Feeder(4, 8)
    b = f.next_batch()
    assert b.token_offsets.tolist() == [0, 16, 32, 48, 64] and len(b.tokens) == 64
    assert b.new_gen.tolist() == [True] * 4 and b.positions.tolist() == [0] * 4
    assert b.rows.shape == (4, 8) and b.row_index.tolist() == [0, 1, 2, 3] and b.slots.tolist() == [0, 1, 2, 3]
    prompt0 = b.tokens[:16].tolist()
    f.after(SimpleNamespace(resync=(), resync_all=False))

    b = f.next_batch()
    assert b.token_offsets.tolist() == [0, 3, 6, 9, 12] and b.positions.tolist() == [16] * 4
    assert b.new_gen.tolist() == [False] * 4
    text, start = f.text.tolist(), int(f.offset[0])  # slot 0's stretch of the text (it wraps)
    assert [text[(start + i) % len(text)] for i in range(16)] == prompt0
    assert [text[(start + i) % len(text)] for i in range(16, 19)] == b.tokens[:3].tolist()
    f.after(SimpleNamespace(resync=(2,), resync_all=False))

    b = f.next_batch()
    assert b.new_gen.tolist() == [False, False, True, False]
    assert b.positions.tolist() == [19, 19, 0, 19]
    assert b.token_offsets.tolist() == [0, 3, 6, 22, 25]
    f.after(SimpleNamespace(resync=(), resync_all=True))
    assert f.next_batch().new_gen.tolist() == [True] * 4
    # a tensor-parallel rank other than 0 knows the lost slots by rank 0's mask (of max_slots)
    mask = torch.zeros(6, dtype=torch.bool)
    mask[[1, 5]] = True
    f.after(SimpleNamespace(resync=None, resync_all=None, resync_mask=mask))
    assert f.next_batch().new_gen.tolist() == [False, True, False, False]


def test_tp_needs_a_gpu_per_nccl_rank_and_says_what_runs_on_one():
    from remote_dspark.bench.round import tp

    tp.check(2, "nccl", 2)
    tp.check(2, "gloo", 1)
    with pytest.raises(ValueError, match="--tp 2 with --tp-backend nccl: NCCL takes one GPU per rank, torch sees 1"):
        tp.check(2, "nccl", 1)


def test_a_row_per_tp_rank_in_the_report_and_its_table():
    opts = round_options.RoundOptions(
        (8,), 5, 16, 10, 1, ("floor", "launch"), 1000, "cuda", False, tp=2, tp_backend="gloo"
    )
    extra = {"launch_wall_p50_ms": 0.1, "launch_wall_p99_ms": 0.2, "launch_cpu_p99_ms": 0.3}
    floor = round_report.RoundRow("floor", 8, 3, [100_000] * 3, extra={"round_bytes": 10, "drafts_bytes": 20})
    plain = round_report.RoundRow("launch", 8, 3, [300_000] * 3, [25_000] * 3, 0, {"ok": 4}, dict(extra))
    tp = {"tp": 2, "tp_backend": "gloo"}
    rows = [floor, plain] + [
        round_report.RoundRow("launch", 8, 3, [p] * 3, [c] * 3, 0, {"ok": 4}, extra | tp | {"tp_rank": r})
        for r, p, c in ((0, 400_000, 50_000), (1, 600_000, 20_000))
    ]
    report = round_report.make_report(opts, rows)
    launch = [r for r in report["rows"] if r["mode"] == "launch"]
    assert [(r.get("tp_rank"), r["p50_ms"], r["x_floor"], r.get("cpu_x_plain")) for r in launch] == [
        (None, 0.3, 3.0, None),
        (0, 0.4, 4.0, 2.0),
        (1, 0.6, 6.0, 0.8),
    ]
    assert report["config"]["tp"] == 2 and report["config"]["tp_backend"] == "gloo"
    table = round_report.format_table(report)
    assert "launch(), CUDA, process, rank 1/2" in table
    assert (
        "launch at 8 slots on tp rank 0 of 2 (gloo, 2.00x the single-rank engine's): CPU inside launch() p50 0.050"
        in table
    )


# --------------------------------------------------------------------------- report


def _row(mode, slots, p50, **kw):
    return {
        "mode": mode,
        "slots": slots,
        "rounds": 10,
        "p50_ms": p50,
        "p99_ms": p50 * 2,
        "x_floor": kw.get("x_floor"),
        "x_sync": kw.get("x_sync"),
        "engine_cpu_ms": kw.get("cpu"),
        "not_ok": kw.get("not_ok"),
        **({"outcomes": kw["outcomes"]} if "outcomes" in kw else {}),
    }


def test_goals_and_the_table_from_a_report():
    rows = [
        _row("floor", 256, 0.4, x_floor=1.0) | {"round_bytes": 270380, "drafts_bytes": 7200},
        _row("sync", 256, 1.0, x_floor=2.5, cpu=0.9, not_ok=0, outcomes={"ok": 10}),
        _row("process", 256, 1.1, x_floor=2.75, x_sync=1.1, cpu=0.5, not_ok=2, outcomes={"ok": 8, "timeout": 2}),
        _row("draft", 256, 0.05, x_floor=0.12),
        _row("process", 4096, 30.0, x_floor=3.0, x_sync=1.0, cpu=1.0, not_ok=0, outcomes={"ok": 10}),
        _row("draft", 4096, 0.4, x_floor=0.1),
    ]
    t = round_report.targets(rows)
    assert {k: v["met"] for k, v in t.items()} == {
        "process_x_floor": True,
        "process_x_sync": True,
        "process_engine_cpu_ms": False,
        "draft_ms": True,
        "process_linear": True,
        "draft_linear": True,
    }
    assert t["process_linear"]["value"] == round((30.0 / 4096) / (1.1 / 256), 2)
    # A sampled process twin at 256 slots: its ratio to the greedy round is a goal too.
    twin = _row("process", 256, 1.5, x_floor=1.2, x_sync=1.0, cpu=0.5, not_ok=0) | {"sampled": True, "x_greedy": 1.36}
    sampled = round_report.targets(rows + [twin])
    assert sampled["sampled_process_x_greedy"]["met"] and sampled["process_x_floor"] == t["process_x_floor"]
    assert not round_report.targets(rows + [twin | {"x_greedy": 1.6}])["sampled_process_x_greedy"]["met"]
    # With the model drafter the one goal is the whole round's time.
    lm = round_report.targets(rows, "lm")
    assert list(lm) == ["lm_process_ms"] and lm["lm_process_ms"]["value"] == 1.1 and lm["lm_process_ms"]["met"]
    report = {
        "config": {
            "num_spec": 5,
            "row_bytes": 1024,
            "rounds": 10,
            "warmup": 1,
            "tokens_per_entry": 3,
            "prompt_tokens": 16,
            "timeout_ms": 1000,
            "torch_num_threads": 2,
            "omp_num_threads": None,
            "cpu_count": 2,
            "affinity_cpus": 2,
            "device": "cpu",
            "device_metadata": False,
            "drafter": "markov",
        },
        "rows": rows,
        "targets": t,
    }
    lines = round_report.format_table(report).splitlines()
    assert "OMP_NUM_THREADS=unset" in lines[1] and "torch threads 2" in lines[1] and "drafter markov" in lines[1]
    assert "256 slots ROUND 270,380 + DRAFTS 7,200" in round_report.format_table(report)
    proc = [line for line in lines if "proxy process" in line and line.lstrip().startswith("256")]
    assert proc and proc[0].endswith("2 NOT OK: timeout 2")
    assert any(line.startswith("goal process engine CPU") and line.endswith("NOT met") for line in lines)
    assert any(line.startswith("goal process p50 / floor p50") and line.endswith(", met") for line in lines)


def test_the_worker_s_time_per_round_is_the_difference_of_its_totals_over_the_rounds_between():
    from remote_dspark.bench.round import worker_time

    before, after = worker_time.Totals(1.0, 10, 0.5), worker_time.Totals(1.3, 110, 0.6)
    assert worker_time.per_round(before, after) == {"worker_ms": 3.0, "worker_drafting_ms": 1.0}
    assert worker_time.per_round(after, after) == {"worker_ms": None, "worker_drafting_ms": None}
    with pytest.raises(RuntimeError, match="the worker's metrics at http://127.0.0.1:9/metrics"):
        worker_time.read("http://127.0.0.1:9/metrics")  # nothing listens on the discard port


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["loopback", "gloo"])
def test_a_tp_run_has_the_single_rank_launch_row_and_one_per_rank(capfd, backend):
    argv = ["--device", "cuda", "--slots", "8", "--rounds", "5", "--warmup", "2", "--modes", "launch", "--json"]
    rc, out, err = bench([*argv, "--tp", "2", "--tp-backend", backend], capfd)
    assert rc == 0, err
    rows = json.loads(out)["rows"]
    assert [(r["mode"], r.get("tp_rank"), r.get("tp_backend")) for r in rows] == [
        ("launch", None, None),
        ("launch", 0, backend),
        ("launch", 1, backend),
    ]
    for r in rows:
        assert r["rounds"] == 5 and r["not_ok"] == 0 and r["outcomes"]["ok"] >= 5 and 0 < r["p50_ms"]
    assert all(r["cpu_x_plain"] > 0 for r in rows[1:])
    assert rows[1]["worker_ms"] is not None  # the worker's time goes with rank 0's row


def test_the_mac_row_is_opt_in_and_reports_its_share_of_the_process_round(capsys):
    """``mac`` is never in the default rows; named, it tags and checks a DRAFTS frame of
    the round's exact size, and ``x_process`` is its p50 over the process row's."""
    assert "mac" not in round_options.options(parse(["round"])).modes
    rc, out, err = bench(["--slots", "8", "--rounds", "5", "--modes", "mac,floor", "--sampled", "--json"], capsys)
    assert rc == 0, err
    rows = {(r["mode"], r["sampled"]): r for r in json.loads(out)["rows"]}
    assert [m for m, _ in rows] == ["floor", "floor", "mac", "mac"]  # table order, whatever --modes said
    for sampled in (False, True):
        mac = rows[("mac", sampled)]
        assert mac["drafts_bytes"] == rows[("floor", sampled)]["drafts_bytes"]
        assert 0 < mac["p50_ms"] <= mac["p99_ms"] and mac["x_process"] is None  # no process row to compare with
    rows = [
        _row("process", 256, 0.2) | {"sampled": False},
        _row("mac", 256, 0.008) | {"sampled": False, "x_process": 0.04},
        _row("mac", 256, 0.3) | {"sampled": True, "x_process": 0.2},
    ]
    goals = round_report.targets(rows)
    assert goals["mac_x_process_greedy"]["met"] and not goals["mac_x_process_sampled"]["met"]


def test_a_mac_rows_share_is_over_the_process_row_of_its_own_kind():
    opts = round_options.options(parse(["round", "--slots", "256", "--modes", "process,mac", "--sampled"]))
    ms = 1_000_000
    rows = [
        round_report.RoundRow("process", 256, 1, [ms]),
        round_report.RoundRow("process", 256, 1, [4 * ms], sampled=True),
        round_report.RoundRow("mac", 256, 1, [ms // 100], extra={"drafts_bytes": 7200}),
        round_report.RoundRow("mac", 256, 1, [ms // 5], extra={"drafts_bytes": 252960}, sampled=True),
    ]
    report = round_report.make_report(opts, rows)
    share = {r["sampled"]: r["x_process"] for r in report["rows"] if r["mode"] == "mac"}
    assert share == {False: 0.01, True: 0.05}
    assert "252,960 bytes of DRAFTS tagged and checked in 0.2000 ms p50, 5.0% of the process round" in (
        round_report.format_table(report)
    )

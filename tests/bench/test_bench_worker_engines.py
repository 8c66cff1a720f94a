"""``remote-dspark bench worker-engines``: its arguments, and a tiny real run (Markov
drafter, two engine processes against one worker child process): every row is measured,
every entry drafted, the goals computed from the rows. No timed assertions."""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers import CHILD_TIMEOUT_S, child, readline_within

from remote_dspark.bench.worker_long import chunk_rounds
from remote_dspark.cli import main as cli


def test_bad_arguments_name_the_flag(capsys):
    for argv, culprit in (
        (["--engines", "0"], "--engines 0: must be in 1..64"),
        (["--slots", "5000"], "--slots 5000: must be in 1..1024"),
        (["--rounds", "0"], "--rounds 0"),
        (["--warmup", "-1"], "--warmup -1: must be in 0..100000"),
        (["--storm", "17"], "--storm 17: must be in 0..16"),
    ):
        assert cli.main(["bench", "worker-engines", *argv]) == 2
        assert culprit in capsys.readouterr().err


@pytest.mark.slow
def test_every_mode_drafts_every_entry_and_the_goals_come_from_the_rows(capsys):
    argv = ["--engines", "2", "--slots", "4", "--rounds", "3", "--warmup", "2", "--drafter", "markov", "--storm", "1"]
    argv.append("--json")
    assert cli.main(["bench", "worker-engines", *argv]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["alone", "batched", "serialized", "storm"]
    assert [rows[m]["engines"] for m in rows] == [1, 2, 2, 2]  # the storm: one honest engine and one storm
    assert all(r["p99_ms"] >= r["p50_ms"] > 0 and r["entries_per_s"] > 0 for r in rows.values())
    assert rows["batched"]["draft_tokens"] == rows["serialized"]["draft_tokens"] > 0  # the same drafts either way
    assert report["config"]["warmup"] == 2 and rows["alone"]["draft_tokens"] <= 3 * 4 * 5  # timed rounds only
    ratio = rows["batched"]["entries_per_s"] / rows["serialized"]["entries_per_s"]
    assert report["goals"][0]["value"] == round(ratio, 2)
    storm = rows["storm"]
    assert storm["draft_tokens"] > 0
    goals = {g["goal"]: g for g in report["goals"]}
    assert goals["honest p50 in the storm <= 2x alone"]["value"] == round(storm["p50_ms"] / rows["alone"]["p50_ms"], 2)
    # The worker's memory: measured from /proc (Linux), beside the memory table's bound.
    assert all(r["rss_growth_mb"] is not None and r["rss_bound_mb"] > 0 for r in rows.values())
    within = all(r["rss_growth_mb"] <= r["rss_bound_mb"] for r in rows.values())
    assert goals["the worker's memory growth within its bound, every row"]["met"] == within
    assert storm["rss_bound_mb"] > rows["alone"]["rss_bound_mb"]  # three 1024-slot storm connections
    # The worker's CPU per round beside its drafter's (/proc and its /metrics); no share:
    # bench drafter measures model drafters only.
    assert all(r["worker_cpu_us_per_round"] is not None and r["entries_per_call"] > 0 for r in rows.values())
    assert all(r["drafter_cpu_us_per_round"] > 0 and r["share_of_drafter"] is None for r in rows.values())


def test_a_storm_engine_stops_on_a_stop_sent_with_its_go(worker):
    """Under load a storm engine may read its "go" only after the honest engine is done
    and "stop" was sent: both lines in the pipe at once. It stops all the same (a
    buffered readline of "go" once took "stop" along, out of its select's sight, and the
    storm ran on until the test's timeout)."""
    cfg = dict(
        port=worker.port, identities=[worker.drafter.drafter_identity.hex(), worker.drafter.markov_identity.hex()]
    )
    cfg.update(engine_id=7, slots=2, rounds=1, k=3, warmup=0, storm=True)
    code = "from remote_dspark.bench.worker_engines import engine_main; engine_main()"
    with child(code, stdin=subprocess.PIPE) as proc:
        proc.stdin.write(json.dumps(cfg) + "\n")
        proc.stdin.flush()
        assert readline_within(proc.stdout, CHILD_TIMEOUT_S, "ready") == "ready\n"
        proc.stdin.write("go\nstop\n")  # one write: the engine finds both lines at once
        proc.stdin.flush()
        latencies, entries, drafted, span = json.loads(readline_within(proc.stdout, CHILD_TIMEOUT_S, "the result"))
        assert latencies == [] and span == [] and drafted >= 0 and entries >= 0
        assert proc.wait(CHILD_TIMEOUT_S) == 0


@pytest.mark.parametrize(
    "slots,tokens,budget", [(1, 1, 1), (3, 400, 512), (4, 10, 7), (256, 8192, 131072), (2, 5, 100)]
)
def test_the_long_engine_announces_every_context_whole_in_order_within_the_round_cap(slots, tokens, budget):
    """What a chunking engine sends: each round within the worker's round cap; each slot's
    tokens in order, its first chunk (NEW_GEN) at position 0 and the rest at its next
    position; drafts asked only by the chunk that makes its context whole, once a slot."""
    next_at, wholes = {}, []
    for chunks in chunk_rounds(slots, tokens, budget):
        assert 0 < sum(n for _, _, n, _ in chunks) <= budget
        for slot, first, count, whole in chunks:
            assert first == next_at.get(slot, 0) and count > 0  # NEW_GEN at 0 first, then the next position
            next_at[slot] = first + count
            assert whole == (first + count == tokens)
            wholes += [slot] if whole else []
    assert wholes == list(range(slots)) and next_at == dict.fromkeys(range(slots), tokens)  # oldest first, all whole
    with pytest.raises(ValueError, match="budget 0: each must be >= 1"):
        list(chunk_rounds(1, 1, 0))


@pytest.mark.slow
def test_the_long_row_measures_the_steady_engine_while_another_announces_long_contexts(capsys):
    """A steady engine of 4 slots beside one announcing 3 slots of 400 tokens (the built-in
    model on the CPU) within rounds of 512 tokens and calls of 256: the announcement is
    chunked (3 rounds), encoded in pieces, and every long slot drafted once whole; the
    worker's calls come from its /metrics and the goal from the rows."""
    argv = ["--modes", "alone", "--slots", "4", "--rounds", "5", "--warmup", "1", "--drafter", "lm", "--device", "cpu"]
    argv += ["--long-slots", "3", "--long-tokens", "400", "--max-round-tokens", "512", "--max-batch-tokens", "256"]
    assert cli.main(["bench", "worker-engines", *argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["alone", "long"]
    long = rows["long"]
    assert (long["long_slots"], long["long_tokens"], long["long_rounds"]) == (3, 400, 3)  # 1,200 tokens, 512 a round
    assert long["long_draft_tokens"] == 3 * 5 and long["draft_tokens"] > 0  # drafts once whole; the steady engine's
    assert long["encode_pieces"] > 0 and long["calls"] > 0 and long["call_mean_ms"] > 0
    assert long["rss_bound_mb"] > rows["alone"]["rss_bound_mb"] and long["rss_growth_mb"] is not None
    (goal,) = [g for g in report["goals"] if g["goal"].startswith("steady p99 delay")]
    assert goal["value"] == round((long["p99_ms"] - rows["alone"]["p99_ms"]) / long["call_mean_ms"], 2)


def test_long_row_arguments_name_the_flag(capsys):
    for argv, culprit in (
        (["--long-slots", "2000"], "--long-slots 2000: must be in 0..1024"),
        (["--long-slots", "2", "--modes", "batched"], "the long row is measured against alone"),
        (["--modes", "alone,fast"], "--modes 'alone,fast': choose from alone, batched, serialized"),
        (["--hf-random", "gpt2:2x64", "--drafter", "markov"], "--hf-random 'gpt2:2x64': a model drafter's"),
    ):
        assert cli.main(["bench", "worker-engines", *argv]) == 2
        assert culprit in capsys.readouterr().err

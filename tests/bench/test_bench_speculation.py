"""The speculation cache's benchmark rows (:mod:`remote_dspark.bench.speculation`): the
simulated target's outcome rule, its slots across rounds, the verify step between an
engine's rounds (counted on a fake clock, never timed), the worker's hit counters and
the goals computed from the rows, and the flags. No timed assertions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from remote_dspark import wire
from remote_dspark.bench.engine_procs import timed_rounds, verify_pause
from remote_dspark.bench.speculation import SampledTarget, SpecCounters, engine_goals, figures, generate_goals, outcomes
from remote_dspark.bench.worker_engines import engine
from remote_dspark.cli import main as cli
from remote_dspark.drafter.markov import MarkovDrafter, builtin_model
from remote_dspark.worker import Worker

TOP = wire.SAMPLED_TOP


def q_of(ids: list[int], weights: list[int]) -> tuple[list[int], list[int]]:
    """One drafted position's q: ``ids`` padded to TOP distinct ids, weights to TOP with 0."""
    pad = [i for i in range(1000, 1000 + TOP) if i not in ids][: TOP - len(ids)]
    return ids + pad, weights + [0] * (TOP - len(weights))


def test_the_target_appends_the_accepted_drafts_then_qs_likeliest_other_than_the_draft():
    # entry 0: the draft is q's top -> t is the second; entry 1: the draft is not the top
    # -> t is the top; entry 2: j = 0, a tie after the draft -> the first of equals in q's order.
    q = [
        [q_of([7, 8, 9], [40000, 20000, 5535]), q_of([3, 4], [60000, 5535])],
        [q_of([5, 6], [50000, 15535]), q_of([1, 2, 3], [30000, 30000, 5535])],
        [q_of([9, 4, 2], [35535, 15000, 15000]), q_of([1], [65535])],
    ]
    ids = np.array([[p[0] for p in row] for row in q])
    weights = np.array([[p[1] for p in row] for row in q])
    drafts = np.array([[11, 3], [12, 2], [9, 1]])
    got = outcomes(drafts, [2, 2, 2], ids, weights, [1, 1, 0])
    assert got == [(11, 4), (12, 1), (4,)]
    # the first of equal weights other than the draft, in q's order
    assert outcomes(drafts[1:2], [2], ids[1:2], weights[1:2], [1]) == [(12, 1)]
    assert outcomes([[2, 0]], [1], ids[1:2], weights[1:2], [0]) == [(5,)]  # the draft not in q at all
    with pytest.raises(ValueError, match="entry 1: j=2 outside 0..1"):
        outcomes(drafts, [2, 2, 2], ids, weights, [0, 2, 0])
    with pytest.raises(ValueError, match="entry 0: j=0 outside 0..-1"):
        outcomes(drafts[:1], [0], ids[:1], weights[:1], [0])  # no drafts: no outcome


def reply(slots: int, k: int, counts: list[int], seed: int = 0) -> wire.DraftsFrame:
    """A sampled DRAFTS of ``counts`` drafts per slot: q's top is always id 50, its second
    id 60 + the position; the drafts 100 + position."""
    tokens, q_ids, q_weights = [], [], []
    for s in range(slots):
        for p in range(k):
            on = p < counts[s]
            tokens.append(100 + p if on else 0)
            ids, weights = q_of([50, 60 + p, 100 + p], [40000, 20000, 5535])
            q_ids += ids if on else [0] * TOP
            q_weights += weights if on else [0] * TOP
    zeros = [0] * slots
    return wire.DraftsFrame(1, list(range(slots)), counts, zeros, k, tokens, None, q_ids, q_weights)


def test_the_sampled_target_keeps_each_slots_seed_and_appends_an_outcome_of_its_reply():
    target = SampledTarget(engine_id=3, prompts=[[1, 2, 3], [4, 5, 6]], k=4, wrap=12)
    first = target.entries()
    assert [(e.new_gen, e.position, tuple(e.tokens)) for e in first] == [(True, 0, (1, 2, 3)), (True, 0, (4, 5, 6))]
    seeds = [e.seed for e in first]
    assert len(set(seeds)) == 2 and all(e.temperature == 1.0 for e in first)
    assert target.took(reply(2, 4, [4, 0])) == 4
    (e0, e1) = target.entries()
    assert not e0.new_gen and e0.position == 3 and [e0.seed, e1.seed] == seeds
    j = len(e0.tokens) - 1
    assert tuple(e0.tokens) == (*range(100, 100 + j), 50)  # accepted drafts, then q's top (the draft is not)
    assert e1.new_gen and tuple(e1.tokens) == (4, 5, 6)  # no drafts: announced again
    for _ in range(12):  # streams stay within wrap: a slot past it is announced again
        target.took(reply(2, 4, [4, 4]))
        for e in target.entries():
            assert e.position + len(e.tokens) <= 12 and (e.position == 0) == e.new_gen


def test_the_verify_step_comes_between_a_reply_and_the_next_round_outside_the_timing():
    events, now = [], [0.0]

    def clock():
        return now[0]

    def send(rid):
        events.append(("send", rid))
        now[0] += 1.0  # a round takes 1 s on the fake clock
        return rid

    def pause():
        events.append("pause")
        now[0] += 100.0  # the target's verify step: never in a round's time

    latencies, drafted = timed_rounds(send, lambda r: 2, 3, None, pause, 10, clock)
    assert latencies == [1.0, 1.0, 1.0] and drafted == 6
    assert events == [("send", 11), "pause", ("send", 12), "pause", ("send", 13)]
    assert timed_rounds(send, lambda r: 0, 2, None, None, 0, clock)[0] == [1.0, 1.0]  # no pause: none
    slept = []
    verify_pause(12.5, slept.append)()
    assert slept == [0.0125] and verify_pause(0) is None


@pytest.fixture
def synthetic_worker():
    """A loopback worker of the built-in Markov model (the engines' synthetic language)."""
    w = Worker(MarkovDrafter(builtin_model()), "127.0.0.1", 0).start()
    yield w
    w.stop()


def test_a_sampled_engine_pauses_before_every_round_but_its_first(synthetic_worker):
    """A real worker (Markov, sampling) and a sampled simulated engine: its rounds are
    answered with drafts, and the verify step ran once between each reply and the next
    round (warm-up and timed rounds: 2 + 3 - 1)."""
    w = synthetic_worker
    paused = []
    ids = (w.drafter.drafter_identity, w.drafter.markov_identity)
    got = engine(
        w.port, ids, 5, 3, 3, 4, lambda: None, lambda: None, warmup=2, pause=lambda: paused.append(1), sampled=True
    )
    latencies, entries, drafted, _ = got
    assert len(latencies) == 3 and entries == 9 and drafted > 0
    assert len(paused) == 2 + 3 - 1


METRICS = """# TYPE dspark_worker_spec_hits counter
dspark_worker_spec_hits_total{rank="0"} 30.0
dspark_worker_spec_hits_total{rank="1"} 12.0
# TYPE dspark_worker_spec_misses counter
dspark_worker_spec_misses_total 8.0
# TYPE dspark_worker_round_duration_seconds histogram
dspark_worker_round_duration_seconds_bucket{le="+Inf"} 50.0
dspark_worker_round_duration_seconds_count 50.0
dspark_worker_round_duration_seconds_sum 0.5
# TYPE dspark_worker_drafting_duration_seconds histogram
dspark_worker_drafting_duration_seconds_bucket{le="+Inf"} 10.0
dspark_worker_drafting_duration_seconds_count 10.0
dspark_worker_drafting_duration_seconds_sum 0.02
"""


def test_the_hits_are_summed_over_their_rank_and_a_worker_without_a_cache_has_none():
    before = SpecCounters(2.0, 1.0, 10.0, 0.1, 5.0, 0.01)
    after = SpecCounters.parse(METRICS)
    assert (after.hits, after.misses, after.rounds) == (42.0, 8.0, 50.0)
    got = figures(before, after, 80)
    assert got == {"spec_hits": 40, "spec_misses": 7, "hit_share": 0.5, "worker_round_ms": 10.0, "call_ms": 2.0}
    off = SpecCounters.parse(METRICS.split("# TYPE dspark_worker_round")[1].join(["# TYPE dspark_worker_round", ""]))
    assert off.hits is None and figures(off, off, 80)["hit_share"] is None
    with pytest.raises(RuntimeError, match="the worker's metrics at u lack dspark_worker_round_duration_seconds"):
        SpecCounters.parse("", "u")


def test_the_goals_come_from_the_rows():
    spec = {"p50_ms": 0.15, "p99_ms": 3.0, "hit_share": 0.9}
    (p50, p99) = engine_goals({"batched-spec": spec, "batched": {"p99_ms": 2.0, "call_ms": 2.0}})
    assert (p50["value"], p50["met"], p99["value"], p99["met"]) == (0.15, True, 0.5, True)
    assert engine_goals({"batched": {}}) == []
    rows = {"process": {"round_ms": 3.0}, "process-spec": {"round_ms": 1.0, "hit_share": 0.5}}
    rows["process-spec"]["same_tokens_as_process"] = True
    share, x, same = generate_goals(rows)
    assert (share["value"], share["met"], x["value"], x["met"], same["met"]) == (0.5, False, 3.0, True, True)


def test_bad_arguments_name_the_flag(capsys):
    for argv, culprit in (
        (["--verify-ms", "-1"], "--verify-ms -1.0: must be in 0..10000"),
        (["--verify-ms", "nan"], "--verify-ms nan: must be in 0..10000"),
        (["--speculate", "-2"], "--speculate -2: must be in 0..64"),
        (
            ["--speculate", "4", "--drafter", "markov"],
            "--speculate 4: a model drafter's (--drafter lm), beside batched",
        ),
        (["--speculate", "4", "--modes", "alone"], "--speculate 4: a model drafter's (--drafter lm), beside batched"),
        (["--speculate", "4", "--num-spec", "17"], "--num-spec 17: sampled drafts (--speculate) take at most 16"),
    ):
        assert cli.main(["bench", "worker-engines", *argv]) == 2
        assert culprit in capsys.readouterr().err
    assert cli.main(["bench", "generate", "--device", "cpu", "--speculate", "0"]) == 2
    assert "--speculate 0: must be in 1..64" in capsys.readouterr().err


@pytest.mark.slow
def test_worker_engines_runs_batched_with_the_cache_off_and_on_in_one_run(capsys):
    """``--speculate``: ``batched`` and ``batched-spec`` (the built-in model on the CPU,
    sampled simulated targets, a verify step), each with the worker's figures; the goals
    from the rows."""
    argv = ["--modes", "batched", "--engines", "2", "--slots", "2", "--rounds", "4", "--warmup", "1"]
    argv += ["--drafter", "lm", "--device", "cpu", "--speculate", "4", "--verify-ms", "2", "--json"]
    assert cli.main(["bench", "worker-engines", *argv]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["batched", "batched-spec"] and report["config"]["speculate"] == 4
    assert all(r["draft_tokens"] > 0 and r["worker_round_ms"] > 0 and r["call_ms"] > 0 for r in rows.values())
    assert rows["batched"]["hit_share"] is None  # no cache, no hits
    share = rows["batched-spec"]["hit_share"]  # None until the worker exports its hits
    assert share is None or 0 <= share <= 1
    goals = {g["goal"].split(" (")[0]: g for g in report["goals"]}
    assert goals["batched-spec p50 round"]["value"] == rows["batched-spec"]["p50_ms"]
    calls = (rows["batched-spec"]["p99_ms"] - rows["batched"]["p99_ms"]) / rows["batched"]["call_ms"]
    assert goals["batched-spec p99 over batched's <= one drafter call"]["value"] == round(calls, 2)

"""chaos with a fleet: the signed drafts, the watch's checks, and a short run."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from remote_dspark.demo.fleet import FleetWatch, WorkerFault
from remote_dspark.demo.tagged import TaggedDrafter, tag_of, tags_of
from remote_dspark.drafter.contract import DraftBatch
from remote_dspark.outcome import Outcome


def _fleet(n: int = 3):
    workers = [SimpleNamespace(host=f"127.0.0.{i + 1}", port=5000 + i) for i in range(n)]
    names = [f"{w.host}:{w.port}" for w in workers]
    return SimpleNamespace(workers=workers, index=lambda a: names.index(a) if a in names else None)


@dataclass
class _Link:
    worker: str
    incarnation: int = 7
    reconnects: int = 0
    spare: bool = True
    failovers: dict = None

    def __post_init__(self):
        self.failovers = self.failovers or {"lost": 0, "stall": 0, "protocol": 0}


def _drafts(tags: list[int], outcome=Outcome.OK):
    tokens = torch.zeros(len(tags), 5, dtype=torch.int32)
    counts = torch.tensor([3 if t is not None else 0 for t in tags], dtype=torch.int32)
    for i, t in enumerate(tags):
        if t is not None:
            tokens[i, 2] = t
    return SimpleNamespace(outcome=outcome, tokens=tokens, counts=counts)


def test_tagged_drafter_signs_each_drafted_entrys_last_draft():
    d = TaggedDrafter(2)
    ctx = np.arange(1, 65, dtype=np.int32) % 50  # 32 entries of 2 tokens: some the model drafts for
    n_out = np.array([4, 0] * 16, dtype=np.int32)
    batch = DraftBatch(ctx, np.arange(0, 65, 2), n_out, np.zeros((32, 0), np.uint8), False, 4)
    out = d.draft_batch(batch)
    assert (out.counts[1::2] == 0).all() and (out.counts > 0).sum() >= 1
    assert set(tags_of(out.tokens, out.counts).tolist()) == {tag_of(2)}


def test_a_foreign_workers_drafts_fail_the_fenced_check_and_a_switch_allows_both_ends():
    watch = FleetWatch(_fleet())
    a, b = "127.0.0.1:5000", "127.0.0.2:5001"
    watch.observe(_drafts([tag_of(0), None]), _Link(a))
    watch.observe(_drafts([tag_of(0)]), _Link(b, reconnects=1))  # a switch inside the round: either end
    watch.observe(_drafts([tag_of(1)]), _Link(b, reconnects=1))
    assert watch.wrong == [] and watch.checked == 3
    watch.observe(_drafts([tag_of(1), tag_of(0)]), _Link(b, reconnects=1))  # worker 0 was left: fenced
    watch.observe(_drafts([tag_of(0)], Outcome.TIMEOUT), _Link(b, reconnects=1))  # not ok: not delivered
    assert len(watch.wrong) == 1 and "tags [0]" in watch.wrong[0]


def test_failovers_must_be_counted_and_target_only_rounds_bounded():
    watch = FleetWatch(_fleet())
    link = _Link("127.0.0.1:5000")
    watch.observe(_drafts([tag_of(0)]), link)
    watch.faults.append(WorkerFault("kill", 1, True, 0))
    for _ in range(2):  # two target-only rounds, and no failover counted
        watch.observe(_drafts([], Outcome.ERROR), link)
    watch.observe(_drafts([tag_of(0)]), link)
    stats = SimpleNamespace(link=SimpleNamespace(failovers=link.failovers, fenced=0, late=0))
    checks = {name: (ok, detail) for name, ok, detail in watch.checks(stats, ran=[4242])}
    assert not checks["every worker failover counted"][0]
    bound = checks["target-only rounds per worker failover within the bound"]
    assert not bound[0] and "worst 2" in bound[1]
    assert checks["every worker process ended"] == (False, "running [4242]")


@pytest.mark.slow
def test_chaos_with_three_workers_passes_every_check():
    out = subprocess.run(
        [sys.executable, "-m", "remote_dspark", "chaos", "--workers", "3", "--seconds", "8", "--seed", "5"]
        + ["--slots", "16", "--reset-s", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads(out.stdout[out.stdout.index("{") :])
    names = [c["name"] for c in report["checks"]]
    assert report["ok"] and len(names) == 11 and "no drafts from a fenced session" in names
    assert report["faults"]["kill_worker"] >= 1 and report["faults"]["stall_worker"] >= 1, report["faults"]

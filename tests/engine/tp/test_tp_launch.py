"""``launch()`` across a tp_group (``engine.tp.launch``): the record's layout, and the
record between two gloo ranks on the CPU (rank 0's launch stood in for by a function
that answers as a path does). The same code with a real engine, on CUDA, is in
``test_tp_launch_gpu``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tp_ranks import run_ranks

from remote_dspark.engine.observe.stats import EngineCounts
from remote_dspark.engine.tp.launch import FAILED, FLAGS, HEAD, RecordLayout
from remote_dspark.engine.values.drafts import Launched
from remote_dspark.outcome import Outcome

M, K = 6, 3


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 70), st.integers(1, 8), st.booleans(), st.data())
def test_a_records_parts_tile_it_without_overlap(max_slots, k, sampled, data):
    """Every part of a round of n entries lies inside the record, none overlaps another
    or the head, and with n = max_slots they and the head fill it (the mask's padding
    to a word aside)."""
    lay = RecordLayout(max_slots, k, sampled)
    n = data.draw(st.integers(0, max_slots))
    record = torch.zeros(lay.words, dtype=torch.int32)
    base, end = record.data_ptr(), record.data_ptr() + 4 * lay.words
    v = lay.views(record, n)
    parts = [v.outcome, v.mask, v.announcing, *v.answer]
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in parts if t.numel()]
    spans = sorted(spans + [(base + 4, base + 4 * HEAD)])  # with the head's host words
    assert all(base <= a <= b <= end for a, b in spans)
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:])), spans
    for mask in (v.mask, v.announcing):
        assert mask.shape == (max_slots,) and mask.dtype == torch.bool
    assert [tuple(t.shape) for t in v.answer[:2]] == [(n, k), (n,)]
    assert all(t.is_contiguous() for t in v.answer)  # the native launch copies into them by address
    if sampled:
        assert [(tuple(t.shape), t.dtype) for t in v.answer[2:]] == [
            ((n, k, 32), torch.int32),
            ((n, k, 32), torch.uint16),
        ]
    if n == max_slots:
        covered = sum(b - a for a, b in spans)
        assert 4 * lay.words - covered == 2 * ((-max_slots) % 4)  # the masks' padding, nothing else


# --------------------------------------------------------------------------- two gloo ranks

# The rounds both ranks launch, in order: (n on rank 0, n on rank 1, rank 0's answer).
# An answer is (round, outcome, tokens, counts, resync, resync_all[, announcing]), or the
# exception rank 0's launch raises.
ROUNDS = [
    (2, 2, (7, Outcome.OK, [[1, 2, 3], [4, 0, 0]], [3, 1], (4,), False, (5, 0))),
    (3, 3, (8, Outcome.TIMEOUT, [[0] * K] * 3, [0, 0, 0], (), True)),
    (2, 2, RuntimeError("a driver call failed")),
    (M + 1, M + 1, None),  # more than max_slots: refused on every rank
    (1, 2, (9, Outcome.OK, [[5, 6, 0]], [2], (), False)),  # rank 1 passes another batch size
    (1, 1, (10, Outcome.OK, [[3, 3, 3]], [3], (0, 5), False)),  # still in step
]


def q_of(tokens) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.tensor(tokens, dtype=torch.int32)
    ids = t[..., None] * 100 + torch.arange(32, dtype=torch.int32)
    return ids, (ids % 65536).to(torch.int32).to(torch.uint16)


def answering(answer, sampled):
    """Rank 0's launch, as a path answers it: the answer written into the record's views."""

    def launch(out, status):
        if isinstance(answer, BaseException):
            raise answer
        if answer is None:
            raise AssertionError("a batch over max_slots reached the path")
        round_id, outcome, tokens, counts, resync, resync_all, *announcing = answer
        arrays = [torch.tensor(tokens, dtype=torch.int32), torch.tensor(counts, dtype=torch.int32)]
        for t, a in zip(out, arrays + (list(q_of(tokens)) if sampled else [])):
            t.copy_(a)
        status.fill_(int(outcome))
        launched = Launched(round_id, *out[:2], resync, resync_all)
        launched.announcing = announcing[0] if announcing else ()  # as the announcing path sets it
        return launched

    return launch


def launched_doc(got: Launched) -> dict:
    q = None if got.q_ids is None else [got.q_ids.tolist(), got.q_weights.to(torch.int32).tolist()]
    return {
        "tokens": got.tokens.tolist(),
        "counts": got.counts.tolist(),
        "outcome": int(got.outcome),
        "mask": got.resync_mask.nonzero().flatten().tolist(),
        "announcing": got.announcing_mask.nonzero().flatten().tolist(),
        "q": q,
        "host": [
            got.round,
            None if got.resync is None else list(got.resync),
            got.resync_all,
            None if got.announcing is None else list(got.announcing),
        ],
    }


def records_between_ranks(rank, group, env, tmp_path) -> dict:
    from remote_dspark.engine.tp.launch import Follower, Leader
    from remote_dspark.engine.tp.ranks import Ranks

    sampled = env["sampled"]
    ranks, lay, counts = Ranks(group), RecordLayout(M, K, sampled), EngineCounts(K)
    cpu = torch.device("cpu")
    side = Leader(ranks, lay, cpu) if rank == 0 else Follower(ranks, lay, cpu, counts, batch=env["batch"])
    out = []
    for n0, n1, answer in ROUNDS:
        try:
            got = side.launch(n0, answering(answer, sampled)) if rank == 0 else side.launch(n1)
            out.append(launched_doc(got))
        except Exception as e:
            out.append({"error": f"{type(e).__name__}: {e}", "notes": getattr(e, "__notes__", [])})
    if rank:
        try:
            side.finish(1.0)
        except ValueError as e:
            out.append({"error": f"{type(e).__name__}: {e}", "at": "finish"})
    return {
        "rounds": out,
        "counted": {o.label: c for o, c in counts.rounds.items() if c},
        "tokens": counts.draft_tokens,
    }


@pytest.mark.parametrize("sampled", [False, True])
def test_every_rank_gets_rank0s_record_and_the_ranks_stay_in_step(tmp_path, sampled):
    env = {"sampled": sampled, "batch": 1}  # rank 1 reads each record's head at once
    r0, r1 = (r["rounds"] for r in run_ranks(tmp_path, records_between_ranks, [env] * 2))
    # an answer: the same drafts, outcome, resync and q on both; the host facts on rank 0 only
    assert r0[0]["host"] == [7, [4], False, [5, 0]] and r1[0]["host"] == [None, None, None, None]
    for a, b in zip(r0[:2], r1[:2]):
        assert {k: v for k, v in a.items() if k != "host"} == {k: v for k, v in b.items() if k != "host"}
    assert r1[0]["tokens"] == [[1, 2, 3], [4, 0, 0]] and r1[0]["counts"] == [3, 1]
    assert r1[0]["outcome"] == Outcome.OK and r1[0]["mask"] == [4]
    assert r0[0]["announcing"] == r1[0]["announcing"] == [0, 5] and r1[1]["announcing"] == []  # each round's own
    assert (r1[0]["q"] is not None) == sampled
    if sampled:
        ids, weights = q_of([[1, 2, 3], [4, 0, 0]])
        assert r1[0]["q"] == [ids.tolist(), weights.to(torch.int32).tolist()]
    # resync_all reaches the others as a full mask
    assert r1[1]["outcome"] == Outcome.TIMEOUT and r1[1]["mask"] == list(range(M))
    # rank 0's launch raised: it raises; the others draft target-only, outcome ERROR
    assert r0[2]["error"] == "RuntimeError: a driver call failed"
    assert r1[2]["tokens"] == [[0] * K] * 2 and r1[2]["counts"] == [0, 0] and r1[2]["outcome"] == Outcome.ERROR
    # more than max_slots: every rank raises, naming it
    for r, rank in ((r0, 0), (r1, 1)):
        assert r[3]["error"] == f"ValueError: tp_group rank {rank}: a batch of {M + 1} entries, more than max_slots={M}"
    # another size than rank 0's: rank 1 raises, naming both; the next round is in step
    assert r1[4]["error"] == (
        "ValueError: tp_group rank 1: a launch() of 2 entries, but rank 0's round had 1: "
        "every rank must pass the same batch"
    )
    assert r0[5]["tokens"] == r1[5]["tokens"] == [[3, 3, 3]] and r1[5]["mask"] == [0, 5]


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_another_rank_counts_rank0s_rounds_from_its_records(tmp_path, batch):
    """Read a record at a time, or a batch at a time (the last ones at close)."""
    _, r1 = run_ranks(tmp_path, records_between_ranks, [{"sampled": False, "batch": batch}] * 2)
    # OK rounds 1, 5 (counted, then refused for its size) and 6; TIMEOUT 2; rank 0's raise: ERROR
    assert r1["counted"] == {"ok": 3, "timeout": 1, "error": 1}
    assert r1["tokens"] == 4 + 2 + 3
    mismatch = [i for i, r in enumerate(r1["rounds"]) if "a launch() of 2 entries" in r.get("error", "")]
    assert mismatch == ([4] if batch <= 4 else [len(ROUNDS)])  # by the launch that read its record, or at close


def test_a_failed_record_is_flagged_and_target_only():
    from remote_dspark.engine.tp.launch import Leader

    sent = []

    class Ranks:
        rank = 0

        def broadcast_record(self, record):
            sent.append(record.clone())

    lay = RecordLayout(M, K, False)
    with pytest.raises(RuntimeError, match="boom"):
        Leader(Ranks(), lay, torch.device("cpu")).launch(2, answering(RuntimeError("boom"), False))
    (record,) = sent
    assert record[:HEAD].tolist() == [int(Outcome.ERROR), FAILED, 2, 0, 0, 0, 0, 0] and FLAGS == 1
    assert not record[HEAD:].any()

"""The vLLM proposer (``remote_dspark.integrations.vllm``) against a reproduction of
vLLM's model runner: its persistent batch (``token_ids_cpu``, ``num_tokens_no_spec``),
requests added into the smallest hole or appended, finished ones leaving holes, the
batch condensed (the last live row moved into the smallest hole) and rows swapped, the
drafts verified by a deterministic target and ``propose`` called as vLLM calls it.

The language: each request continues with a constant stride (the target's next token is
``2 * t[-1] - t[-2]`` mod V), and the loopback worker's order-2 Markov drafter knows it,
so a draft for the right stream is always accepted and one for another stream (a row
mapped to the wrong slot) is not (``vllm_runner``).
"""

from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import DraftedWindows, drafter_env
from tp_ranks import run_ranks
from vllm_runner import MAX_LEN, MAX_REQS, STRIDES, K, Runner, markov_drafter, prompt, vllm_config

from remote_dspark.engine import Mode
from remote_dspark.integrations.vllm import RemoteProposer
from remote_dspark.worker import Worker


@pytest.fixture
def drafter():
    return markov_drafter()


@pytest.fixture
def worker(drafter):
    w = Worker(drafter, "127.0.0.1", 0).start()
    yield w
    w.stop()


@pytest.fixture
def proposer(worker, drafter):
    p = RemoteProposer(vllm_config(), environ=drafter_env(drafter, worker.port, Mode.SYNC))
    p.load_model(object())  # vLLM's hook: nothing to load
    yield p
    p.close()


def test_slots_follow_requests_through_holes_condense_and_swaps(proposer):
    run = Runner(proposer)
    run.step(add=[(f"r{i}", prompt(i, STRIDES[i % 4], 3 + i)) for i in range(5)])
    news = {req: 1 for req in run.rows}
    assert all(run.batches[0].new_gen) and len(set(run.batches[0].slots.tolist())) == 5
    plan = {
        3: dict(finish=["r1"]),  # r4 (row 4) condensed into row 1
        4: dict(add=[("r5", prompt(9, 3))]),  # appended at row 4
        6: dict(finish=["r0", "r2"], add=[("r6", prompt(5, 7))]),  # r6 into row 0, r5 into row 2
        7: dict(swap=(0, 3)),
        9: dict(finish=["r3"], swap=(1, 2)),
        11: dict(add=[("r7", prompt(2, 5)), ("r8", prompt(4, 1))]),
        14: dict(finish=["r4", "r5", "r6"]),
    }
    for step in range(1, 18):
        live_before = set(run.rows)
        run.step(**plan.get(step, {}))
        batch = run.batches[-1]
        for req in run.rows:
            if bool(batch.new_gen[batch.slots.tolist().index(run.slots[req][-1])]):
                news[req] = news.get(req, 0) + 1
        assert set(batch.slots.tolist()) == set(np.flatnonzero(proposer.slot_map.live).tolist())
        for req in live_before - set(run.rows):  # finished: its slot is free, unless a newcomer took it
            assert run.slots[req][-1] not in {run.slots[r][-1] for r in run.rows if r in live_before}
    assert {req: len(set(slots)) for req, slots in run.slots.items()} == dict.fromkeys(run.slots, 1)
    assert news == dict.fromkeys(run.slots, 1), "each request announced once (NEW_GEN), never after moving"
    # The drafts were each row's own continuation, through every move: all of them accepted.
    assert run.offered_at.tolist() == run.accepted_at.tolist() and run.offered_at[K - 1] > 50
    st = proposer.rd.stats()
    assert list(st.offered_at) == run.offered_at.tolist() and list(st.accepted_at) == run.accepted_at.tolist()
    assert max(s for slots in run.slots.values() for s in slots) < MAX_REQS


def test_identical_streams_that_both_move_are_announced_again(proposer):
    run = Runner(proposer)
    twin = prompt(3, 5)
    run.step(add=[("a", prompt(1, 1)), ("b", prompt(2, 3)), ("t1", twin), ("t2", twin)])
    run.step()  # the twins stay at their rows: they keep their slots, though alike
    assert [s[-1] for s in (run.slots["t1"], run.slots["t2"])] == [s[0] for s in (run.slots["t1"], run.slots["t2"])]
    assert not run.batches[-1].new_gen.any()
    run.step(finish=["a", "b"])  # t2 (row 3) into row 0, t1 (row 2) into row 1: which is which?
    batch = run.batches[-1]
    assert run.rows == ["t2", "t1"] and batch.new_gen.tolist() == [True, True]
    assert batch.positions.tolist() == [0, 0] and len(set(batch.slots.tolist())) == 2
    run.step()
    assert not run.batches[-1].new_gen.any()
    # Every draft accepted: 4 rows, then the twins twice.
    assert run.offered_at.tolist() == run.accepted_at.tolist() and run.offered_at[0] == 8


def test_a_request_that_leaves_and_comes_back_is_a_new_stream(proposer):
    run = Runner(proposer)
    run.step(add=[("a", prompt(1, 1)), ("b", prompt(2, 3))])
    run.step()
    tokens = run.token_ids[run.row("b"), : run.num_tokens[run.row("b")]].tolist()
    run.step(finish=["b"])  # preempted: gone this step
    assert proposer.slot_map.live.sum() == 1
    run.step(add=[("b", tokens)])  # resumed with what it had: its prefill samples one token
    batch = run.batches[-1]
    assert batch.new_gen.tolist() == [False, True]
    assert batch.tokens.tolist()[batch.token_offsets[1] :] == run.token_ids[1, : run.num_tokens[1]].tolist()


def test_rows_that_sampled_nothing_get_no_drafts_and_no_slot(proposer):
    run = Runner(proposer)
    out = run.step(add=[("a", prompt(1, 1)), ("c", prompt(0, 7, 30))], chunked=["c"])  # c: a partial prefill
    assert out[1] == [] and len(out[0]) == K and run.batches[-1].slots.tolist() == run.slots["a"]
    run.step()  # c's last chunk: announced whole (the engine cuts it to the worker's window)
    batch = run.batches[-1]
    assert batch.new_gen.tolist() == [False, True]
    assert batch.tokens[batch.token_offsets[1] :].tolist() == run.token_ids[1, : run.num_tokens[1]].tolist()
    assert run.step(chunked=["a", "c"]) == [[], []]  # nothing to draft: no round at all
    assert len(run.batches) == 2 and not proposer.slot_map.live.any()


def test_slots_the_worker_lost_are_announced_again(proposer):
    run = Runner(proposer)
    real_round = proposer.rd.round
    lost: dict = {}
    proposer.rd.round = lambda batch: dataclasses.replace(real_round(batch), **lost)
    run.step(add=[("a", prompt(1, 1)), ("b", prompt(2, 3)), ("c", prompt(3, 5))])
    lost.update(resync=(run.slots["b"][-1],))
    run.step()
    lost.clear()
    run.step()
    assert run.batches[-1].new_gen.tolist() == [False, True, False]
    lost.update(resync_all=True)
    run.step()
    lost.clear()
    run.step()
    assert run.batches[-1].new_gen.tolist() == [True, True, True]
    run.step()
    assert not run.batches[-1].new_gen.any()
    assert {req: len(set(s)) for req, s in run.slots.items()} == {"a": 1, "b": 1, "c": 1}
    assert run.offered_at.tolist() == run.accepted_at.tolist()


def test_a_request_ended_mid_announcement_is_let_go_and_its_slot_starts_whole(drafter):
    """A worker taking 24 tokens a round: a 60-token prompt goes in chunks. Its request
    ends before the context is whole: the proposer releases the slot (nothing held, no
    slot still announcing; a slot a new request takes in the same step is released
    too), and the new request on that slot is announced NEW_GEN, first drafted from its
    whole context, every draft accepted."""
    rec = DraftedWindows(drafter.model)
    w = Worker(rec, "127.0.0.1", 0, max_round_tokens=24).start()
    p = RemoteProposer(vllm_config(), environ=drafter_env(rec, w.port, Mode.SYNC))
    try:
        run, released = Runner(p), []
        real_release = p.rd.release
        p.rd.release = lambda slots: released.append(list(slots)) or real_release(slots)
        run.step(add=[("a", prompt(1, 1)), ("long", prompt(2, 3, 60))])
        slot = run.slots["long"][-1]
        assert p.rd.stats().announce.announcing == 1 and run.drafts["long"] == ([], True)  # part of its context sent
        run.step(finish=["long"])
        assert released == [[slot]] and p.rd.stats().announce.announcing == 0  # let go, never sent
        rec.drafted.clear()
        run.step(add=[("new", prompt(4, 5, 12))])
        assert run.slots["new"] == [slot] and bool(run.batches[-1].new_gen[run.batches[-1].slots.tolist().index(slot)])
        whole = run.token_ids[run.row("new"), : run.num_tokens[run.row("new")]].tolist()  # its prefill's token too
        assert [c for s, c in rec.drafted if s == slot][0] == whole and whole[:12] == prompt(4, 5, 12)
        run.step(add=[("long2", prompt(3, 7, 60))])
        slot2 = run.slots["long2"][-1]
        run.step(finish=["long2"], add=[("new2", prompt(5, 1, 8))])  # new2 takes long2's slot at once
        assert run.slots["new2"] == [slot2] and released[-1] == [slot2]
        assert p.rd.stats().announce.announcing == 0
        for _ in range(3):
            run.step()
        assert run.offered_at.tolist() == run.accepted_at.tolist() and run.offered_at[0] > 0
    finally:
        p.close()
        w.stop()


def test_bad_inputs_are_refused_naming_them(proposer):
    ids = np.zeros((MAX_REQS, MAX_LEN), np.int32)
    with pytest.raises(ValueError, match="sampled_token_ids: 7 rows"):
        proposer.propose([[1]] * 7, np.ones(MAX_REQS, np.int32), ids)
    with pytest.raises(ValueError, match=r"num_tokens_no_spec\[1\]=201"):
        proposer.propose([[1], [1]], np.array([3, MAX_LEN + 1] + [0] * 4, np.int32), ids)
    with pytest.raises(ValueError, match="token_ids_cpu"):
        proposer.propose([[1]], np.ones(MAX_REQS, np.int32), ids[0])


def test_token_ids_or_counts_of_a_float_dtype_are_refused_never_truncated(proposer):
    """A float id would reach the wire truncated (3.7 as 3) and draft for another
    context: refused by name before any slot is assigned or round sent."""
    run = Runner(proposer)
    ids = np.zeros((MAX_REQS, MAX_LEN), np.float64)
    ids[0, :3] = [1, 2, 3.7]
    lengths = np.array([3] + [0] * (MAX_REQS - 1), np.int32)
    with pytest.raises(ValueError, match=r"^token_ids_cpu: dtype float64, expected an integer dtype"):
        proposer.propose([[3.7]], lengths, ids)
    with pytest.raises(ValueError, match=r"^num_tokens_no_spec: dtype float32, expected an integer dtype"):
        proposer.propose([[3]], lengths.astype(np.float32), ids.astype(np.int64))
    assert run.batches == [] and not proposer.slot_map.live.any()


@pytest.mark.parametrize(
    "config, environ, why",
    [
        (dict(k=0), {}, r"vllm_config.speculative_config.num_speculative_tokens=0"),
        (dict(k=99), {}, r"vllm_config.speculative_config.num_speculative_tokens: num_spec=99"),
        (dict(max_num_seqs=10**6), {}, r"vllm_config.scheduler_config.max_num_seqs: max_slots="),
        (dict(drop=("scheduler_config",)), {}, r"vllm_config.scheduler_config: missing"),
        (dict(tp=2), {}, r"tensor_parallel_size=2: needs vLLM's tensor-parallel group"),
        ({}, {"VLLM_DSPARK_REMOTE_TIMEOUT_MS": "soon"}, "VLLM_DSPARK_REMOTE_TIMEOUT_MS"),
        ({}, {"VLLM_DSPARK_REMOTE_POLICY": "shadow"}, "VLLM_DSPARK_REMOTE_POLICY=shadow needs a local drafter"),
    ],
)
def test_a_bad_configuration_is_refused_naming_it(drafter, config, environ, why):
    env = drafter_env(drafter, 9, Mode.SYNC, **environ)  # nothing listens: nothing may start
    with pytest.raises(ValueError, match=why):
        RemoteProposer(vllm_config(**config), environ=env)


def test_close_is_idempotent_and_a_closed_proposer_drafts_no_more(proposer):
    proposer.close()
    proposer.close()
    with pytest.raises(Exception, match="after close"):
        proposer.propose([[1]], np.array([3] + [0] * 5, np.int32), np.ones((MAX_REQS, MAX_LEN), np.int32))


def test_tensor_parallel_ranks_take_vllms_cpu_group_and_draft_alike(worker, drafter, tmp_path):
    """Two gloo ranks (``tp_ranks.run_ranks``), each with a proposer for
    ``tensor_parallel_size=2`` and vLLM's group from a stand-in
    ``vllm.distributed.parallel_state``: both map rows alike and return the same drafts
    (rank 0's), every one accepted; the NCCL ``device_group`` is never touched."""
    env = drafter_env(drafter, worker.port, Mode.SYNC)
    results = run_ranks(tmp_path, _tp_rank, [env, env])
    assert results[0] == results[1]
    assert results[0]["offered"] == results[0]["accepted"] and sum(results[0]["offered"]) > 20
    assert worker.statistics().connections == 1, "rank 0 alone talks to the worker"


def _tp_rank(rank: int, group, env: dict, tmp_path) -> dict:
    parallel_state = SimpleNamespace(get_tp_group=lambda: SimpleNamespace(cpu_group=group, device_group=object()))
    sys.modules["vllm.distributed.parallel_state"] = parallel_state  # this forked rank's own stand-in
    proposer = RemoteProposer(vllm_config(tp=2), environ=env)
    try:
        run = Runner(proposer)
        drafts = [run.step(add=[("a", prompt(1, 1)), ("b", prompt(2, 3)), ("c", prompt(3, 5))])]
        drafts += [run.step(**kw) for kw in ({}, dict(finish=["a"]), {}, dict(swap=(0, 1)), {}, {})]
        result = dict(drafts=drafts, slots=run.slots, offered=run.offered_at.tolist())
        result["accepted"] = run.accepted_at.tolist()
    finally:
        proposer.close()
    return result

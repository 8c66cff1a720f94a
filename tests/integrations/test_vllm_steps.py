"""The vLLM proposer against how vLLM 0.33.0 calls it, beyond the persistent batch's
moves (``test_vllm.py``): the scheduler's cut of the drafts at max_model_len, the steps
vLLM runs without ``propose``, ``torch.inference_mode()`` with a dict of KV slot
mappings, and ``max_num_seqs`` over a worker's slots or the wire's cap (``vllm_runner``)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import drafter_env
from vllm_runner import MAX_LEN, STRIDES, K, Runner, markov_drafter, prompt, vllm_config

from remote_dspark.engine import Mode
from remote_dspark.integrations.vllm import RemoteProposer
from remote_dspark.worker import Worker


@pytest.fixture
def drafter():
    return markov_drafter()


@pytest.fixture
def proposer(drafter):
    w = Worker(drafter, "127.0.0.1", 0).start()
    p = RemoteProposer(vllm_config(), environ=drafter_env(drafter, w.port, Mode.SYNC))
    yield p
    p.close()
    w.stop()


def test_drafts_stop_where_vllms_scheduler_cuts_them_and_acceptance_counts_what_it_verified(proposer):
    """A row's tokens, its drafts and the token sampled after them fit max_model_len:
    the proposer asks for no more drafts than vLLM's scheduler keeps, so what it counts
    as offered is what vLLM verified."""
    run = Runner(proposer)
    run.step(add=[("a", prompt(1, 1, MAX_LEN - 10))])  # 191 tokens after its prefill
    run.step()  # 196: room for 3 drafts and the bonus token
    assert [b.n_out.tolist() for b in run.batches] == [[K], [MAX_LEN - 196 - 1]]
    assert run.step() is None and run.skipped == 1  # 199 + K over the length: vLLM skips propose
    st = proposer.rd.stats()
    assert list(st.offered_at) == run.offered_at.tolist() == [1, 1, 1, 1]
    assert list(st.accepted_at) == run.accepted_at.tolist()


def test_a_step_without_propose_continues_the_rows_that_stayed(proposer):
    """vLLM skips ``propose`` for a whole step while a row is within K tokens of
    max_model_len, and verifies K zeros as every row's drafts. The next step's rows that
    stayed continue their slots, sending every token since the worker's last (never the
    whole context again); a row condensed meanwhile is announced whole; the drafts vLLM
    verified in the skipped steps are counted by neither side."""
    run = Runner(proposer)
    run.step(add=[("a", prompt(1, 1)), ("b", prompt(2, 3)), ("long", prompt(3, 5, MAX_LEN - 10)), ("d", prompt(4, 7))])
    run.step()
    seen = dict(zip(run.rows, run.num_tokens.tolist()))
    assert run.step() is None and run.step() is None and run.skipped == 2
    run.step(finish=["long"])  # d (row 3) condensed into row 2 during the skip
    batch = run.batches[-1]
    assert run.rows == ["a", "b", "d"] and batch.new_gen.tolist() == [False, False, True]
    assert batch.positions.tolist() == [seen["a"], seen["b"], 0]
    for i in range(len(run.rows)):
        sent = batch.tokens[batch.token_offsets[i] : batch.token_offsets[i + 1]].tolist()
        assert sent == run.token_ids[i, batch.positions[i] : run.num_tokens[i]].tolist()
    assert [s[-1] for s in (run.slots["a"], run.slots["b"])] == [s[0] for s in (run.slots["a"], run.slots["b"])]
    for _ in range(3):
        run.step()
    assert not run.batches[-1].new_gen.any()
    st = proposer.rd.stats()
    assert list(st.offered_at) == run.offered_at.tolist() == run.accepted_at.tolist()
    assert list(st.accepted_at) == run.accepted_at.tolist() and run.offered_at[K - 1] >= 3 * 4


def test_propose_inside_inference_mode_with_a_dict_of_slot_mappings(proposer):
    """As vLLM calls it (every ``Runner.step``): inside ``torch.inference_mode()``, its
    KV ``slot_mappings`` a dict of tensors. The proposer keeps drafting, and the engine
    it holds still works outside inference mode (its stats, a call from outside)."""
    run = Runner(proposer)
    run.step(add=[("a", prompt(1, 1)), ("b", prompt(2, 3))])
    for _ in range(3):
        run.step()
    sampled = [run.verify(i, req, np.zeros((2, K), np.int64), []) for i, req in enumerate(run.rows)]
    out = proposer.propose(sampled, run.num_tokens, run.token_ids, slot_mappings=None)  # outside it
    assert [len(d) for d in out] == [K, K] and not run.batches[-1].new_gen.any()
    st = proposer.rd.stats()
    assert st.offered_at[0] == 8 and list(st.accepted_at) == list(st.offered_at)


def test_max_num_seqs_sizes_the_slots_and_a_worker_with_fewer_refuses(drafter, caplog):
    """One slot per row of vLLM's batch: 1100 rows (over vLLM's default max_num_seqs on an
    H100, 1024, and a default worker's 1024 slots) draft in one round against a worker
    started with as many slots; a default worker refuses the session, naming its
    ``--max-slots``, and vLLM runs without drafts."""
    rows = 1100
    for max_slots in (rows, None):
        w = Worker(drafter, "127.0.0.1", 0, **({"max_slots": max_slots} if max_slots else {})).start()
        p = RemoteProposer(vllm_config(max_num_seqs=rows), environ=drafter_env(drafter, w.port, Mode.SYNC))
        try:
            run = Runner(p, max_reqs=rows)
            run.step(add=[(f"r{i}", prompt(i, STRIDES[i % 4])) for i in range(rows)])
            run.step()
            assert sorted(run.batches[-1].slots.tolist()) == list(range(rows))
            assert run.offered_at.tolist() == run.accepted_at.tolist() == ([rows] * K if max_slots else [0] * K)
        finally:
            p.close()
            w.stop()
    assert f"max_slots {rows} over this worker's 1024 (--max-slots)" in caplog.text


@pytest.mark.parametrize("rows, environ, cap", [(4097, {}, 4096), (2048, {"VLLM_DSPARK_SAMPLED_TOP32": "1"}, 1024)])
def test_max_num_seqs_over_the_cap_is_refused_saying_what_to_lower(drafter, rows, environ, cap):
    env = drafter_env(drafter, 9, Mode.SYNC, **environ)  # nothing listens: nothing may start
    why = rf"^vllm_config.scheduler_config.max_num_seqs: max_slots={rows}: .*{cap}.*lower --max-num-seqs$"
    with pytest.raises(ValueError, match=why):
        RemoteProposer(vllm_config(max_num_seqs=rows), environ=env)

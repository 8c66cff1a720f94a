"""Tensor-parallel ranks: ``RemoteDSpark(..., tp_group=...)`` on two
gloo ranks, each a process of its own (``tp_ranks.run_ranks``), around one loopback
worker in the test process."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from helpers import COUNTING, env_for
from tp_ranks import BACKENDS, in_step, run_ranks

from remote_dspark.config.api import RemoteConfig
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.engine import Batch, Mode, RemoteDSpark, RemoteRoundFailed
from remote_dspark.engine.observe import report
from remote_dspark.engine.observe.stats import LinkStats
from remote_dspark.engine.values.drafts import Drafts
from remote_dspark.outcome import Outcome
from remote_dspark.worker import Worker

MODEL = COUNTING
K = 3
ROWS = torch.arange(8, dtype=torch.float32).reshape(4, 2)


def dead_port() -> int:
    w = Worker(MarkovDrafter(MODEL), "127.0.0.1", 0).start()
    port = w.port
    w.stop()
    return port


def batch(new=True, slots=(0, 1), tokens=((1,), (3,)), positions=(0, 0)) -> Batch:
    return Batch.from_lists(
        list(slots), [list(t) for t in tokens], list(positions), [new] * len(slots), ROWS, torch.arange(len(slots))
    )


def make(env, group, **kw) -> RemoteDSpark:
    kw.setdefault("num_spec", K)
    kw.setdefault("max_slots", 4)
    kw.setdefault("row_bytes", 8)
    return RemoteDSpark(RemoteConfig.from_env(env), environ=env, tp_group=group, **kw)


def failure(e: BaseException) -> dict:
    return {
        "type": f"{type(e).__module__}.{type(e).__qualname__}",
        "message": str(e),
        "notes": getattr(e, "__notes__", []),
    }


def own_resources() -> dict:
    """What this process holds: child processes (a proxy, a standby) and memfd regions."""
    children = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            children += f.read().split()
    memfds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            memfds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return {"children": len(children), "memfds": memfds}


# --------------------------------------------------------------------------- scenarios (run in a rank)


def drafts_and_roles(rank, group, env, tmp_path) -> dict:
    writes = []
    write = report.write_json_atomic
    report.write_json_atomic = lambda path, doc: (writes.append(path), write(path, doc))
    rd = make(env, group).start()
    try:
        outs = [rd.round(batch()), rd.round(batch(new=False, tokens=((2,), (4,)), positions=(1, 1)))]
        held = own_resources()
        try:
            rd.launch(batch())
            launch = None
        except Exception as e:
            launch = failure(e)
        st = rd.stats()
    finally:
        rd.close()
    return {
        "drafts": [[o.tokens.tolist(), o.counts.tolist(), o.outcome.label, o.source] for o in outs],
        "held": held,
        "supervisor": rd.supervisor is not None,
        "mode": st.mode,
        "launch": launch,
        "rounds_ok": st.rounds[Outcome.OK],
        "handoff": st.handoff is not None,
        "stats_supervisor": st.supervisor is not None,
        "link_empty": st.link == LinkStats.none(),
        "writes": len(writes),
    }


def round_failures(rank, group, env, tmp_path) -> dict:
    out = {}
    with make(env, group) as rd:
        for name, b in (("bad_slot", batch(slots=(0, 9))), ("dead_worker", batch())):
            try:
                rd.round(b)
                out[name] = None
            except Exception as e:
                out[name] = failure(e)
                out[name]["is_round_failed"] = isinstance(e, RemoteRoundFailed)
        out["rounds"] = {o.label: n for o, n in rd.stats().rounds.items() if n}
    return out


def start_failure(rank, group, env, tmp_path) -> dict:
    rd = make(env, group)
    try:
        rd.start()
        return {"started": True}
    except Exception as e:
        return {"started": False, "error": failure(e), "state": rd.state.value, "held": own_resources()}
    finally:
        rd.close()


def bad_batch_then_in_step(rank, group, env, tmp_path) -> dict:
    with make(env, group) as rd:
        try:
            rd.round(batch(slots=(0, 9)))
            error = None
        except Exception as e:
            error = failure(e)
        good = rd.round(batch())
        return {"error": error, "good": [good.tokens.tolist(), good.outcome.label]}


def a_closed_rank_still_takes_rank0s_record(rank, group, env, tmp_path) -> dict:
    """Rank ``env["closing"]`` closes, then both ranks run a round: the closed one raises,
    the other answers, and the probe finds them in step."""
    rd = make(env, group).start()
    if rank == int(env["closing"]):
        rd.close()
    try:
        out = {"round": rd.round(batch()).tokens.tolist()}
    except Exception as e:
        out = {"round": failure(e)["type"]}
    rd.close()
    return out | {"probe": in_step(rank, group)}


def local_drafter_on_every_rank(rank, group, env, tmp_path) -> dict:
    calls = []

    def local(b):
        calls.append(len(b))
        n = len(b)
        return torch.full((n, K), 7 + rank, dtype=torch.int32), torch.full((n,), K, dtype=torch.int32)

    with make(env, group, local_drafter=local) as rd:
        out = rd.round(batch())
    return {"calls": calls, "source": out.source, "tokens": out.tokens.tolist(), "outcome": out.outcome.label}


def shadow_on_every_rank(rank, group, env, tmp_path) -> dict:
    calls = []

    def local(b):
        calls.append(len(b))
        return torch.tensor([[2, 0, 0], [4, 0, 0]], dtype=torch.int32), torch.tensor([3, 3], dtype=torch.int32)

    with make(env, group, local_drafter=local) as rd:
        out = rd.round(batch())
        st = rd.stats()
    return {
        "calls": calls,
        "source": out.source,
        "tokens": out.tokens.tolist(),
        "margins": out.margins.tolist(),
        "agree": st.shadow_agree_at,
        "compared": st.shadow_compared_at,
        "margin_count": st.margin.count,
    }


def announcing_on_every_rank(rank, group, env, tmp_path) -> dict:
    """A NEW_GEN context over a round's tokens: rank 0 announces it in chunks; every
    rank's answer names the slot still being announced, round by round."""
    long = batch(tokens=(range(30), range(30)))
    with make(env, group, round_tokens=40) as rd:
        outs = [rd.round(long), rd.round(batch(new=False, tokens=((7,), (7,)), positions=(30, 30)))]
    return {"announcing": [list(o.announcing) for o in outs], "counts": [o.counts.tolist() for o in outs]}


# --------------------------------------------------------------------------- tests

# Rounds these tests need answered OK get a 2 s deadline, not the 50 ms default, which a
# loaded machine (the suite's parallel run) can miss.
OK_WITHIN = {"VLLM_DSPARK_REMOTE_TIMEOUT_MS": "2000"}


@pytest.mark.parametrize("mode", ["sync", "process"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_rank_gets_rank0s_drafts_and_only_rank0_opens_anything(worker, tmp_path, backend, mode):
    env = env_for(worker.port, tmp_path, Mode(mode), **OK_WITHIN)
    r0, r1 = run_ranks(tmp_path, drafts_and_roles, [env, env], backend=backend)
    assert r0["drafts"] == r1["drafts"]
    assert r0["drafts"][0] == [[[2, 3, 4], [4, 1, 2]], [3, 3], "ok", "remote"]
    assert r0["drafts"][1][0] == [[3, 4, 1], [1, 2, 3]]
    assert worker.stats.connections == 1  # rank 0's connection (sync) or its proxy's, only
    assert r0["mode"] == r1["mode"] == mode  # rank 1 reports the mode rank 0 runs
    if mode == "process":
        assert r0["supervisor"] and r0["held"]["memfds"] >= 1 and r0["held"]["children"] >= 1
    assert r1["held"] == {"children": 0, "memfds": 0} and not r1["supervisor"]
    # rank 1's statistics: its own engine-side counts, nothing of a path
    assert r1["rounds_ok"] == r0["rounds_ok"] == 2
    assert not r1["handoff"] and not r1["stats_supervisor"] and r1["link_empty"]
    assert r0["writes"] >= 1 and r1["writes"] == 0
    written = json.loads((tmp_path / "stats.json").read_text())
    assert written["mode"] == mode and (written["supervisor"] is not None) == (mode == "process")
    for r in (r0, r1):
        assert (
            r["launch"]["type"] == "builtins.RuntimeError"
            and "launch() is for rounds on CUDA" in r["launch"]["message"]
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_rank_knows_the_slots_still_being_announced(worker, tmp_path, backend):
    env = env_for(worker.port, tmp_path, **OK_WITHIN)
    r0, r1 = run_ranks(tmp_path, announcing_on_every_rank, [env, env], backend=backend)
    assert r0 == r1
    assert r0["announcing"] == [[1], []] and r0["counts"][0][1] == 0  # slot 1: 10 of 30, then whole


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_round_on_rank0_raises_on_every_rank(tmp_path, backend):
    env = env_for(dead_port(), tmp_path, VLLM_DSPARK_REMOTE_ON_FAIL="raise")
    r0, r1 = run_ranks(tmp_path, round_failures, [env, env], backend=backend)
    for name in ("bad_slot", "dead_worker"):
        assert r0[name] is not None and r1[name] is not None, name
        assert (r1[name]["type"], r1[name]["message"]) == (r0[name]["type"], r0[name]["message"])
    assert r0["bad_slot"]["type"] == "builtins.ValueError" and "slots: 9" in r0["bad_slot"]["message"]
    assert any("rank 0" in note for note in r1["bad_slot"]["notes"])
    assert r0["dead_worker"]["is_round_failed"] and r1["dead_worker"]["is_round_failed"]
    assert r1["rounds"] == r0["rounds"] == {"error": 1}


def test_a_strict_start_failure_on_rank0_raises_on_every_rank(tmp_path):
    env = env_for(dead_port(), tmp_path, Mode.PROCESS, VLLM_DSPARK_REMOTE_STRICT_START="1")
    r0, r1 = run_ranks(tmp_path, start_failure, [env, env])
    assert not r0["started"] and not r1["started"]
    assert r0["error"]["type"] == r1["error"]["type"] == "remote_dspark.transport.errors.TransportError"
    assert r0["error"]["message"] == r1["error"]["message"]
    assert r0["state"] == r1["state"] == "closed"
    assert r0["held"] == r1["held"] == {"children": 0, "memfds": 0}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_batch_raises_on_every_rank_and_the_ranks_stay_in_step(worker, tmp_path, backend):
    env = env_for(worker.port, tmp_path, **OK_WITHIN)
    r0, r1 = run_ranks(tmp_path, bad_batch_then_in_step, [env, env], backend=backend)
    assert r0["error"]["type"] == r1["error"]["type"] == "builtins.ValueError"
    assert r0["error"]["message"] == r1["error"]["message"] == "slots: 9 out of 0..3"
    assert r0["good"] == r1["good"] == [[[2, 3, 4], [4, 1, 2]], "ok"]


@pytest.mark.parametrize("closing", [0, 1])
def test_a_rank_that_closed_first_still_takes_rank0s_record(worker, tmp_path, closing):
    env = env_for(worker.port, tmp_path) | {"closing": str(closing)}
    r0, r1 = run_ranks(tmp_path, a_closed_rank_still_takes_rank0s_record, [env, env])
    closed, open_ = (r0, r1) if closing == 0 else (r1, r0)
    assert closed["round"] == "remote_dspark.engine.lifecycle.RemoteClosed"
    if closing == 1:  # rank 0 answered; rank 1 took the record and dropped it
        assert open_["round"] == [[2, 3, 4], [4, 1, 2]]
    else:  # rank 0's failure reached rank 1
        assert open_["round"] == "remote_dspark.engine.lifecycle.RemoteClosed"
    assert r0["probe"] == r1["probe"] == 42


def test_configs_that_differ_across_ranks_raise_on_every_rank(worker, tmp_path):
    envs = [env_for(worker.port, tmp_path), env_for(worker.port, tmp_path, VLLM_DSPARK_REMOTE_TIMEOUT_MS="80")]
    r0, r1 = run_ranks(tmp_path, start_failure, envs)
    for r in (r0, r1):
        assert not r["started"] and r["error"]["type"] == "builtins.ValueError"
        assert "rank 1: VLLM_DSPARK_REMOTE_TIMEOUT_MS" in r["error"]["message"]
    assert r0["error"]["message"] == r1["error"]["message"]
    assert worker.stats.connections == 0  # rank 0 compared before it opened anything


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_policy_runs_on_every_rank_over_rank0s_answer(tmp_path, backend):
    """Resilience with the worker down: every rank runs its own local drafter in the same
    round (a tensor-parallel drafter's collectives stay in step)."""
    env = env_for(dead_port(), tmp_path, VLLM_DSPARK_REMOTE_POLICY="resilience")
    r0, r1 = run_ranks(tmp_path, local_drafter_on_every_rank, [env, env], backend=backend)
    for rank, r in enumerate((r0, r1)):
        assert r["calls"] == [2] and r["source"] == "local" and r["outcome"] == "error"
        assert r["tokens"] == [[7 + rank] * K] * 2


def test_shadow_margins_reach_every_rank_and_each_rank_compares(worker, tmp_path):
    env = env_for(worker.port, tmp_path, VLLM_DSPARK_REMOTE_POLICY="shadow", VLLM_DSPARK_REMOTE_SHADOW_USE="remote")
    r0, r1 = run_ranks(tmp_path, shadow_on_every_rank, [env, env])
    assert r0 == r1
    assert r0["calls"] == [2] and r0["source"] == "remote" and r0["tokens"] == [[2, 3, 4], [4, 1, 2]]
    assert r0["agree"] == [2, 0, 0] and r0["compared"] == [2, 2, 2] and r0["margin_count"] == 6
    assert len(r0["margins"]) == 2 and all(m > 0 for m in r0["margins"][0])


# --------------------------------------------------------------------------- the ERROR record (in process)


def test_an_error_record_rebuilds_the_class_its_arguments_and_attributes():
    from remote_dspark.engine.tp.records import error_from_record, error_record
    from remote_dspark.transport.client import Refused

    e = error_from_record(error_record(Refused(3, "identity mismatch")), rank=1)
    assert type(e) is Refused and str(e) == "identity mismatch" and (e.code, e.reason) == (3, "identity mismatch")
    assert e.__notes__ == ["raised on rank 0 of the tp_group; broadcast to rank 1"]
    e = error_from_record(error_record(RemoteRoundFailed("remote round failed: error")), rank=1)
    assert type(e) is RemoteRoundFailed and str(e) == "remote round failed: error"


def test_an_error_record_of_a_class_not_loaded_here_is_a_runtime_error():
    from remote_dspark.engine.tp.records import error_from_record

    raw = json.dumps({"type": "not_loaded_here:Boom", "args": ["x"], "attrs": {}, "message": "x"}).encode()
    e = error_from_record(raw, rank=1)
    assert type(e) is RuntimeError and str(e) == "not_loaded_here.Boom: x"


# --------------------------------------------------------------------------- sampled drafts across the ranks


def sampled_batch(new=True, tokens=((1,), (3,)), positions=(0, 0)) -> Batch:
    return Batch.from_lists(
        [0, 1],
        [list(t) for t in tokens],
        list(positions),
        [new, new],
        ROWS,
        torch.arange(2),
        temperature=[0.9, 0.0],
        seed=[2**64 - 5, 11],
    )


def sampled_rounds(rank, group, env, tmp_path) -> dict:
    with make(env, group) as rd:
        outs = [rd.round(sampled_batch()), rd.round(sampled_batch(False, ((2,), (4,)), (1, 1)))]
    return {
        "drafts": [
            [o.tokens.tolist(), o.counts.tolist(), o.outcome.label, o.source, o.q_ids.tolist(), o.q_weights.tolist()]
            for o in outs
        ],
        "q_dtypes": [str(outs[0].q_ids.dtype), str(outs[0].q_weights.dtype)],
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sampled_rounds_drafts_and_q_reach_every_rank(sampling_worker, tmp_path, backend):
    from remote_dspark.sampled import TOTAL, violation

    env = env_for(sampling_worker.port, tmp_path, Mode.SYNC, VLLM_DSPARK_SAMPLED_TOP32="1", **OK_WITHIN)
    r0, r1 = run_ranks(tmp_path, sampled_rounds, [env, env], backend=backend)
    assert r0 == r1
    assert r0["q_dtypes"] == ["torch.int32", "torch.uint16"]
    for tokens, counts, outcome, source, q_ids, q_weights in r0["drafts"]:
        assert outcome == "ok" and source == "remote" and counts == [K, K]
        ids, weights = torch.tensor(q_ids).reshape(-1, 32), torch.tensor(q_weights).reshape(-1, 32)
        assert violation(ids, weights, torch.tensor(tokens).reshape(-1), vocab=2**31 - 1) is None
        assert (weights.sum(1) == TOTAL).all()


def test_ranks_that_differ_only_in_sampled_top32_raise_naming_it(worker, tmp_path):
    envs = [env_for(worker.port, tmp_path, Mode.SYNC), env_for(worker.port, tmp_path, Mode.SYNC)]
    envs[1]["VLLM_DSPARK_SAMPLED_TOP32"] = "1"
    r0, r1 = run_ranks(tmp_path, start_failure, envs)
    for r in (r0, r1):
        assert not r["started"] and r["error"]["type"] == "builtins.ValueError"
        assert "(rank 1: VLLM_DSPARK_SAMPLED_TOP32 differ" in r["error"]["message"]
    assert worker.stats.connections == 0


# --------------------------------------------------------------------------- records (in process)


def sample_drafts(n=3, k=4, margins=True, sampled=True, resync=(2,), announcing=(7, 1)) -> Drafts:
    g = torch.Generator().manual_seed(5)
    counts = torch.tensor([k, 1, 0][:n], dtype=torch.int32)
    live = torch.arange(k) < counts[:, None]
    tokens = torch.randint(0, 1000, (n, k), generator=g, dtype=torch.int32) * live
    q_ids = torch.randint(-(2**31), 2**31 - 1, (n, k, 32), generator=g, dtype=torch.int64).to(torch.int32)
    q_weights = torch.randint(0, 65536, (n, k, 32), generator=g, dtype=torch.int32).to(torch.uint16)
    return Drafts(
        tokens,
        counts,
        torch.rand(n, k, generator=g) if margins else None,
        "remote",
        Outcome.OK,
        resync,
        True,
        q_ids if sampled else None,
        q_weights if sampled else None,
        announcing=announcing,
    )


@pytest.mark.parametrize("margins", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_a_drafts_record_carries_q_and_has_the_size_its_header_says(margins, sampled):
    from remote_dspark.engine.tp.records import DRAFTS, drafts_from_record, drafts_record

    n, k = 3, 4
    d = sample_drafts(n, k, margins, sampled)
    header, body = drafts_record(d)
    flags = margins + 2 * sampled
    assert header == [DRAFTS, n, k, int(Outcome.OK), 0, 1, 1, flags, 2]  # 9 int64 words, whatever it carries
    assert body.dtype == torch.int32 and body.numel() == n * k * (1 + margins + 48 * sampled) + n + 1 + 2
    got = drafts_from_record(header, body.clone())
    for name in ("tokens", "counts", "margins", "q_ids", "q_weights"):
        want, have = getattr(d, name), getattr(got, name)
        assert (want is None) == (have is None), name
        if want is not None:
            assert have.dtype == want.dtype and torch.equal(have, want), name
    assert (got.source, got.outcome, got.resync, got.resync_all) == ("remote", Outcome.OK, (2,), True)
    assert got.announcing == (7, 1)  # the slots still being announced, as rank 0's
    assert got.q_weights is None or int(got.q_weights.to(torch.int32).max()) > 32767  # unsigned survives
    with pytest.raises(ValueError, match="a DRAFTS record of"):
        drafts_from_record(header, body[:-1])


def test_an_empty_sampled_record_is_the_header_alone():
    from remote_dspark.engine.tp.records import drafts_from_record, drafts_record

    header, body = drafts_record(sample_drafts(0, 4, resync=(), announcing=()))
    assert body.numel() == 0
    got = drafts_from_record(header, None)
    assert got.q_ids.shape == (0, 4, 32) and got.q_weights.dtype == torch.uint16


class LoopbackDist:
    """torch.distributed for two Ranks in one process: rank 0's broadcasts are kept, and
    rank 1's take them in order (each into the tensor it offers)."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []
        self.read = 0

    def install(self, monkeypatch, rank: int) -> None:
        monkeypatch.setattr(dist, "get_rank", lambda group: rank)
        monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
        monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
        monkeypatch.setattr(dist, "get_backend", lambda group: "gloo")
        monkeypatch.setattr(dist, "broadcast", self.broadcast_as(rank))

    def broadcast_as(self, rank: int):
        def broadcast(t, src, group):
            if rank == 0:
                self.sent.append(t.clone())
            else:
                t.copy_(self.sent[self.read])
                self.read += 1

        return broadcast


class Answers:
    def __init__(self, d: Drafts):
        self.d = d

    def round(self, batch):
        return self.d


def test_the_records_between_two_ranks_in_process(monkeypatch):
    """Rank 0's sampled answer reaches rank 1 whole (q as rank 0's, uint16 included);
    an ERROR record is a header [ERROR, its length, 0 ...] and the error as JSON."""
    from remote_dspark.engine.tp.ranks import Ranks
    from remote_dspark.engine.tp.records import ERROR, HEADER_WORDS

    loop = LoopbackDist()
    loop.install(monkeypatch, 0)
    leader = Ranks(object())
    leader.sampled = True
    d = sample_drafts(2, K, margins=False)
    assert leader.share(Answers(d), batch()) is d
    with pytest.raises(KeyError):
        leader.lead(lambda: {}["boom"])
    header, _, error_header, error_body = loop.sent
    assert header.shape == error_header.shape == (HEADER_WORDS,) and header.dtype == torch.int64
    assert error_header.tolist() == [ERROR, error_body.numel(), 0, 0, 0, 0, 0, 0, 0]
    assert json.loads(error_body.numpy().tobytes())["type"] == "builtins:KeyError"
    loop.install(monkeypatch, 1)
    follower = Ranks(object())
    follower.sampled = True
    got = follower.receive_drafts(2)
    assert torch.equal(got.q_ids, d.q_ids) and torch.equal(got.q_weights, d.q_weights)
    assert torch.equal(got.tokens, d.tokens) and got.margins is None and got.announcing == d.announcing == (7, 1)
    with pytest.raises(KeyError, match="boom") as e:
        follower.receive_drafts(2)
    assert e.value.__notes__ == ["raised on rank 0 of the tp_group; broadcast to rank 1"]

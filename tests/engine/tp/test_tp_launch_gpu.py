"""``RemoteDSpark.launch()`` with a tp_group on CUDA: two ranks, each a spawned process,
on NCCL (a GPU each, on a host with two) and on gloo, which runs both on one GPU and
carries the records as CUDA tensors through the host (NCCL refuses two ranks on one GPU;
gloo's broadcast of a CUDA tensor waits on the host, NCCL's does not, and the record and
every stream operation around it are the same). The worker is a loopback worker in the
test process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import COUNTING, env_for
from tp_ranks import BACKENDS, in_step, run_ranks

from remote_dspark.config.api import RemoteConfig
from remote_dspark.config.mode import Mode
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.engine import Batch, RemoteDSpark
from remote_dspark.outcome import Outcome
from remote_dspark.worker import Worker

pytestmark = pytest.mark.gpu

K = 3


def batch(new=True, tokens=((1,), (3,)), positions=(0, 0), sampled=False) -> Batch:
    n = len(tokens)
    extra = dict(temperature=[0.9, 0.0][:n], seed=[2**64 - 5, 11][:n]) if sampled else {}
    rows = torch.arange(8, dtype=torch.float32, device="cuda").reshape(4, 2)
    return Batch.from_lists(
        list(range(n)),
        [list(t) for t in tokens],
        list(positions),
        [new] * n,
        rows,
        torch.arange(n, device="cuda"),
        **extra,
    )


def doc(launched) -> dict:
    torch.cuda.current_stream().synchronize()  # the test reads them now; the engine would not
    q = None if launched.q_ids is None else [launched.q_ids.tolist(), launched.q_weights.to(torch.int32).tolist()]
    return {
        "tokens": launched.tokens.tolist(),
        "counts": launched.counts.tolist(),
        "outcome": int(launched.outcome),
        "mask": launched.resync_mask.nonzero().flatten().tolist(),
        "q": q,
        "own_device": launched.tokens.device == torch.device("cuda", torch.cuda.current_device()),
    }


def launches(rank, group, env, tmp_path) -> dict:
    """Launched rounds, a round() between them (the two kinds of record stay in step),
    then a launch with one rank's engine closed (rank ``env["closing"]``, default 0),
    and a probe that the ranks are still in step."""
    if dist.get_backend(group) == "gloo":
        torch.cuda.set_device(0)  # both ranks on one GPU (NCCL's each have their own)
    sampled = env.get("VLLM_DSPARK_SAMPLED_TOP32") == "1"
    rd = RemoteDSpark(
        RemoteConfig.from_env(env), environ=env, tp_group=group, num_spec=K, max_slots=4, row_bytes=8, device="cuda"
    ).start()
    out = []
    try:
        out.append(doc(rd.launch(batch(sampled=sampled))))
        r = rd.round(batch(False, ((2,), (4,)), (1, 1), sampled))
        out.append({"round": [r.tokens.tolist(), r.outcome.label]})
        out.append(doc(rd.launch(batch(False, ((3,), (1,)), (2, 2), sampled))))
        out.append(doc(rd.launch(batch(False, ((4,),), (3,), sampled))))
        if rank == int(env.get("closing", "0")):
            rd.close()
        try:
            out.append(doc(rd.launch(batch(False, ((1,),), (4,), sampled))))
        except Exception as e:
            out.append({"error": type(e).__name__})
    finally:
        rd.close()
    st = rd.stats()
    counted = {o.label: n for o, n in st.rounds.items() if n}
    return {"rounds": out, "counted": counted, "mode": st.mode, "probe": in_step(rank, group)}


@pytest.mark.parametrize("mode", [Mode.PROCESS, Mode.SYNC])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_rank_gets_rank0s_launched_drafts_in_stream_order(worker, tmp_path, mode, backend):
    env = env_for(worker.port, tmp_path, mode)
    r0, r1 = run_ranks(tmp_path, launches, [env, env], start="spawn", backend=backend)
    assert r0["mode"] == r1["mode"] == mode.value
    first, second, third = r0["rounds"][0], r0["rounds"][2], r0["rounds"][3]
    assert first["tokens"] == [[2, 3, 4], [4, 1, 2]] and first["counts"] == [K, K]
    assert first["outcome"] == Outcome.OK and first["own_device"] and first["q"] is None
    assert r0["rounds"][1] == r1["rounds"][1] == {"round": [[[3, 4, 1], [1, 2, 3]], "ok"]}
    assert second["tokens"] == [[4, 1, 2], [2, 3, 4]] and third["tokens"] == [[1, 2, 3]]
    for a, b in zip(r0["rounds"][:4], r1["rounds"][:4]):
        assert a == b
    # rank 0 closed: it raises, rank 1 drafts target-only (ERROR), never waits
    assert r0["rounds"][4] == {"error": "RemoteClosed"}
    assert r1["rounds"][4]["tokens"] == [[0] * K] and r1["rounds"][4]["outcome"] == Outcome.ERROR
    # rank 1 counted rank 0's launched rounds from their records (and the round() as rank 0 did)
    assert r1["counted"] == {"ok": 4, "error": 1}
    assert r0["counted"] == {"ok": 4}
    assert r0["probe"] == r1["probe"] == 42


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_that_closed_first_still_takes_rank0s_launch_record(worker, tmp_path, backend):
    env = env_for(worker.port, tmp_path, Mode.PROCESS) | {"closing": "1"}
    r0, r1 = run_ranks(tmp_path, launches, [env, env], start="spawn", backend=backend)
    assert r1["rounds"][4] == {"error": "RemoteClosed"}
    assert r0["rounds"][4]["tokens"] == [[2, 3, 4]] and r0["rounds"][4]["outcome"] == Outcome.OK
    assert r0["probe"] == r1["probe"] == 42


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dead_worker_reaches_every_rank_as_target_only_drafts(tmp_path, backend):
    w = Worker(MarkovDrafter(COUNTING), "127.0.0.1", 0).start()
    port = w.port
    w.stop()
    env = env_for(port, tmp_path, Mode.PROCESS)
    r0, r1 = run_ranks(tmp_path, launches, [env, env], start="spawn", backend=backend)
    for a, b in zip(r0["rounds"][:4], r1["rounds"][:4]):
        assert a == b
    for launched in (r1["rounds"][i] for i in (0, 2, 3)):
        assert not any(launched["counts"]) and launched["outcome"] != Outcome.OK
    assert r1["counted"].get("ok", 0) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sampled_engines_q_reaches_every_rank(sampling_worker, tmp_path, backend):
    env = env_for(sampling_worker.port, tmp_path, Mode.PROCESS, VLLM_DSPARK_SAMPLED_TOP32="1")
    r0, r1 = run_ranks(tmp_path, launches, [env, env], start="spawn", backend=backend)
    for a, b in zip(r0["rounds"][:4], r1["rounds"][:4]):
        assert a == b
    first = r1["rounds"][0]
    assert first["q"] is not None and first["counts"] == [K, K]
    ids, weights = torch.tensor(first["q"][0]).reshape(-1, 32), torch.tensor(first["q"][1]).reshape(-1, 32)
    assert (weights.sum(1) == 65535).all()
    assert (ids == torch.tensor(first["tokens"]).reshape(-1, 1)).any(1).all()  # each draft among its q's ids


# --------------------------------------------------------------------------- two ranks in this process


class LoopbackGroup:
    """One rank's end of a two-rank group inside this process. Rank 0's broadcasts are
    kept (the tensors themselves); rank 1's take them in order by a copy on the current
    stream, so a device record reaches rank 1 in stream order with no host wait, as
    NCCL's broadcast would."""

    def __init__(self, rank: int, sent: list):
        self.rank, self.sent = rank, sent

    def broadcast(self, t: torch.Tensor) -> None:
        if self.rank == 0:
            self.sent.append(t)
        else:
            t.copy_(self.sent.pop(0))


@pytest.fixture
def loopback(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_rank", lambda group: group.rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    monkeypatch.setattr(dist, "broadcast", lambda t, src, group: group.broadcast(t))
    monkeypatch.setattr(dist, "all_gather", lambda out, t, group: [o.copy_(t) for o in out])
    sent: list = []
    return LoopbackGroup(0, sent), LoopbackGroup(1, sent)


def test_no_rank_waits_on_the_host_for_a_launched_round(worker, drafter, tmp_path, loopback):
    """With the worker holding its drafts, rank 0's launch() and rank 1's both return
    and the stream is still waiting: neither rank's launch waited for the round. Once
    the worker answers, both ranks' tensors hold its drafts."""
    env = env_for(worker.port, tmp_path, Mode.PROCESS)
    engines = [
        RemoteDSpark(
            RemoteConfig.from_env(env), environ=env, tp_group=g, num_spec=K, max_slots=4, row_bytes=8, device="cuda"
        )
        for g in loopback
    ]
    try:
        for rd in engines:
            rd.start()
        first = [rd.launch(batch()) for rd in engines]
        torch.cuda.synchronize()
        assert [f.tokens.tolist() for f in first] == [[[2, 3, 4], [4, 1, 2]]] * 2
        drafter.gate.clear()  # the worker holds the next round's drafts
        held = [rd.launch(batch(False, ((2,), (4,)), (1, 1))) for rd in engines]
        done = torch.cuda.Event()
        done.record()
        assert not done.query(), "a launch() waited for its round on the host"
        drafter.gate.set()
        torch.cuda.synchronize()
        for h in held:
            assert h.tokens.tolist() == [[3, 4, 1], [1, 2, 3]] and int(h.outcome) == Outcome.OK
        assert held[0].round == 2 and held[1].round is None and held[1].resync is None
    finally:
        drafter.gate.set()
        for rd in reversed(engines):
            rd.close()


def proxy_killed_mid_round(rank, group, env, tmp_path) -> dict:
    """Rank 0's proxy is killed while the worker holds the round it sent: every rank's
    stream gets the same target-only answer, and the ranks stay in step."""
    import os
    import signal

    if dist.get_backend(group) == "gloo":
        torch.cuda.set_device(0)
    rd = RemoteDSpark(
        RemoteConfig.from_env(env), environ=env, tp_group=group, num_spec=K, max_slots=4, row_bytes=8, device="cuda"
    ).start()
    try:
        launched = rd.launch(batch())
        if rank == 0:
            os.kill(rd.supervisor.live.pid, signal.SIGKILL)
        out = doc(launched)
    finally:
        rd.close()
    return {"round": out, "probe": in_step(rank, group)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank0s_proxy_killed_mid_round_reaches_every_rank_as_target_only_drafts(worker, drafter, tmp_path, backend):
    env = env_for(worker.port, tmp_path, Mode.PROCESS)
    drafter.gate.clear()  # the worker holds every round's drafts
    try:
        r0, r1 = run_ranks(tmp_path, proxy_killed_mid_round, [env, env], start="spawn", backend=backend)
    finally:
        drafter.gate.set()
    assert r0["round"] == r1["round"]
    assert r1["round"]["counts"] == [0, 0] and r1["round"]["outcome"] != Outcome.OK
    assert r0["probe"] == r1["probe"] == 42

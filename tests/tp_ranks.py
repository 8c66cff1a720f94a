"""Two tensor-parallel ranks for a test: ``run_ranks`` runs a scenario on ranks 0 and 1
of a torch.distributed group, each a process of its own, and gives back their results.

The backend is gloo (every host) or NCCL (a GPU per rank: ``BACKENDS`` marks it for
hosts with two). The CPU tests fork the ranks from the test process (torch is imported
there already, and a fresh interpreter would spend seconds importing it again); the GPU
tests and NCCL spawn them (a forked child cannot use CUDA once its parent has). Each rank makes itself a session
leader, so whatever it starts (a proxy, a standby) ends with it: the test kills each
rank's session at the end whatever happened. Every wait is bounded: a rank has
``limit_s`` (then it dumps its stacks and exits), a collective GROUP_TIMEOUT_S.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import signal
import time
import traceback
from datetime import timedelta

import pytest

RANK_LIMIT_S = 15.0  # one forked rank, start to exit
SPAWNED_LIMIT_S = 60.0  # one spawned rank: it imports torch and starts CUDA first
GROUP_TIMEOUT_S = 10  # a collective that waits longer raises


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


# The backends a test of the ranks runs on: gloo, and NCCL on a host with a GPU per rank.
BACKENDS = [
    "gloo",
    pytest.param(
        "nccl",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(_gpus() < 2, reason="NCCL takes a GPU per rank: two, on one host"),
        ],
    ),
]


def run_ranks(
    tmp_path, scenario, envs: list[dict], start: str = "fork", limit_s: float | None = None, backend: str = "gloo"
) -> list[dict]:
    """``scenario(rank, group, env, tmp_path)`` on ranks 0 and 1 of a ``backend`` group
    (``start``: how the rank processes begin, fork or spawn; NCCL's always spawn, each
    on GPU ``rank``); each rank's result (a dict; ``crash`` holds a traceback that
    escaped the scenario)."""
    start = "spawn" if backend == "nccl" else start
    limit_s = limit_s or (RANK_LIMIT_S if start == "fork" else SPAWNED_LIMIT_S)
    ctx = multiprocessing.get_context(start)
    procs = [
        ctx.Process(target=_rank_main, args=(rank, scenario, envs[rank], tmp_path, limit_s, backend), daemon=True)
        for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + limit_s + 2
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            _end_session(p)
    assert not hung, f"ranks {hung} did not end within {limit_s} s (stacks on stderr)"
    results = []
    for rank in (0, 1):
        out = tmp_path / f"rank{rank}.json"
        assert out.exists(), f"rank {rank} wrote no result (exit code {procs[rank].exitcode})"
        results.append(json.loads(out.read_text()))
        assert "crash" not in results[-1], f"rank {rank}:\n{results[-1]['crash']}"
    return results


def _end_session(p) -> None:
    """The rank and everything it started (its session), then reap it."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.join(5.0)
    if p.is_alive():  # not yet its own session leader when killed
        p.kill()
        p.join(5.0)


def _rank_main(rank: int, scenario, env: dict, tmp_path, limit_s: float, backend: str) -> None:
    import torch
    import torch.distributed as dist

    os.setsid()
    faulthandler.dump_traceback_later(limit_s, exit=True)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(str(tmp_path / "store"), 2)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=2, timeout=timedelta(seconds=GROUP_TIMEOUT_S)
        )
        group = dist.new_group([0, 1], backend=backend)  # not the default group: the engine takes any
        result = scenario(rank, group, env, tmp_path)
    except BaseException:
        result = {"crash": traceback.format_exc()}
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(result))
    faulthandler.cancel_dump_traceback_later()


def in_step(rank: int, group) -> int:
    """A probe collective after a scenario's steps: rank 0's 42 on every rank, or whatever
    rank 0 sent in a step that the other rank left without taking its part in."""
    import torch
    import torch.distributed as dist

    on = torch.cuda.current_device() if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([42 if rank == 0 else 0], dtype=torch.int64, device=on)
    dist.broadcast(t, src=0, group=group)
    return int(t.item())

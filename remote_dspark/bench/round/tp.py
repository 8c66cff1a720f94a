"""``bench round --tp N``: the ``launch`` rows on N tensor-parallel ranks, each a
spawned process on its own GPU (``rank % device_count``), in one torch.distributed group
(``--tp-backend``: NCCL, as a deployment runs, one GPU per rank; or gloo, which runs
the ranks on one GPU but carries a CUDA record through the host: its broadcast waits
there, so its figures are gloo's, not the engine's).

Every rank builds the same batches (the same feeder, seeded alike) and launches them
into one ``RemoteDSpark`` with the group as its ``tp_group``; rank 0's engine is the
one that talks to the worker. Per rank and round: the CPU inside ``launch()`` and the
time until that rank's stream holds the drafts (CUDA events around it), the stream
synchronized after every round outside the figures. A rank that does not end within
its limit is killed with everything it started (its own session)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from datetime import timedelta

from .feeder import Feeder
from .options import RoundOptions
from .report import RoundRow, ns_to_ms, pct

START_S = 120.0  # a spawned rank: torch imported, CUDA and the group started, the engine up
GROUP_TIMEOUT_S = 60  # a collective that waits longer raises (NCCL's watchdog, gloo's timeout)


def check(tp: int, backend: str, device_count: int) -> None:
    """Whether this host can run ``tp`` ranks on ``backend``.

    Raises: ValueError naming what is missing."""
    if backend == "nccl" and device_count < tp:
        raise ValueError(
            f"--tp {tp} with --tp-backend nccl: NCCL takes one GPU per rank, torch sees {device_count}; "
            "--tp-backend gloo or loopback runs the ranks on one GPU"
        )


def launch_rows(worker, opts: RoundOptions, slots: int, env: dict, tmp: str, sampled: bool) -> list[RoundRow]:
    """One ``launch`` row per rank at ``slots`` (see the module docstring)."""
    ctx = multiprocessing.get_context("spawn")
    store = os.path.join(tmp, f"tp-store-{slots}-{int(sampled)}")
    outs = [os.path.join(tmp, f"tp-rank{r}-{slots}-{int(sampled)}.json") for r in range(opts.tp)]
    procs = [
        ctx.Process(target=rank_main, args=(r, opts, slots, env, store, outs[r], sampled), daemon=True)
        for r in range(opts.tp)
    ]
    limit_s = START_S + (opts.warmup + opts.rounds_for(slots)) * 2 * opts.timeout_ms / 1000.0
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + limit_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            _end(p)
    docs = []
    for path in outs:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError):
            docs.append(None)  # the rank wrote nothing (it hung, or died)
    errors = "; ".join(f"rank {r}: {d['error']}" for r, d in enumerate(docs) if d and "error" in d)
    if hung:
        raise RuntimeError(
            f"--tp {opts.tp}: ranks {hung} did not end within {limit_s:.0f} s" + (f" ({errors})" if errors else "")
        )
    if errors or None in docs:
        missing = [r for r, d in enumerate(docs) if d is None]
        raise RuntimeError(f"--tp {opts.tp}: {errors or f'ranks {missing} wrote no figures'}")
    return [_row(opts, slots, r, doc, sampled) for r, doc in enumerate(docs)]


def _row(opts: RoundOptions, slots: int, rank: int, doc: dict, sampled: bool) -> RoundRow:
    outcomes = doc["outcomes"]
    return RoundRow(
        "launch",
        slots,
        len(doc["lat"]),
        doc["lat"],
        doc["cpu"],
        sum(outcomes.values()) - outcomes.get("ok", 0),
        outcomes,
        extra={
            "tp": opts.tp,
            "tp_rank": rank,
            "tp_backend": opts.tp_backend,
            "launch_wall_p50_ms": ns_to_ms(pct(doc["wall"], 0.5)),
            "launch_wall_p99_ms": ns_to_ms(pct(doc["wall"], 0.99)),
            "launch_cpu_p99_ms": ns_to_ms(pct(doc["cpu"], 0.99)),
            "outcomes_over": "every launched round, warm-up included",
        },
        sampled=sampled,
    )


def _end(p) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the rank and whatever it started (a proxy)
    except (ProcessLookupError, PermissionError):
        pass
    p.join(5.0)
    if p.is_alive():
        p.kill()
        p.join(5.0)


def rank_main(rank: int, opts: RoundOptions, slots: int, env: dict, store: str, out: str, sampled: bool) -> None:
    """One rank: the group, the engine, the rounds; its figures (or its error) to ``out``."""
    os.setsid()
    try:
        doc = _rank(rank, opts, slots, env, store, sampled)
    except BaseException as e:
        doc = {"error": f"{type(e).__name__}: {e}"}
    with open(out, "w") as f:
        json.dump(doc, f)


def _rank(rank: int, opts: RoundOptions, slots: int, env: dict, store: str, sampled: bool) -> dict:
    import torch
    import torch.distributed as dist

    from .engines import check_mode, launch_loop, new_engine

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        opts.tp_backend,
        store=dist.FileStore(store, opts.tp),
        rank=rank,
        world_size=opts.tp,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    try:
        meta_device = "cuda" if opts.device_metadata else "cpu"
        feeder = Feeder(slots, opts.row_bytes, device="cuda", metadata_device=meta_device, sampled=sampled)
        with new_engine(opts, slots, env, tp_group=dist.group.WORLD) as rd:
            check_mode(rd, "process")
            lat, cpu, wall = launch_loop(rd, feeder, opts.warmup, opts.rounds_for(slots))
        counted = rd.stats().rounds
        return {"lat": lat, "cpu": cpu, "wall": wall, "outcomes": {o.label: n for o, n in counted.items() if n}}
    finally:
        dist.destroy_process_group()

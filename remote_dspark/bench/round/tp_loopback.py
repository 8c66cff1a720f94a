"""``bench round --tp N --tp-backend loopback``: the N ranks' engines in this process, on
one GPU and one stream, in a group whose ``broadcast`` gives rank 0's record to every
other rank by a copy on the stream: in stream order and with no host wait, as NCCL's
would, but at a copy's cost. What it measures is what a tensor-parallel ``launch()``
costs each rank's CPU without the collective's own cost, on a host with one GPU (NCCL
takes one per rank). Every round launches rank 0, then rank 1, ...; the time until a
rank's stream holds its drafts is counted from before rank 0's launch (the ranks share
the stream)."""

from __future__ import annotations

import contextlib
import time

from .engines import check_mode, new_engine
from .feeder import Feeder
from .options import RoundOptions
from .report import RoundRow, ns_to_ms, pct

_ROUTED = ("get_rank", "get_world_size", "get_process_group_ranks", "get_backend", "broadcast", "all_gather")


class LoopbackGroup:
    """One rank's end of an in-process group: rank 0's broadcasts are kept (the tensors
    themselves) until every other rank has taken them, each by a copy on its current
    stream."""

    def __init__(self, rank: int, size: int, sent: list):
        self.rank, self.size, self.sent = rank, size, sent
        self.read = 0  # the next of rank 0's broadcasts this rank takes

    def broadcast(self, t) -> None:
        if self.rank == 0:
            self.sent.append(t)
            return
        t.copy_(self.sent[self.read])
        self.read += 1


@contextlib.contextmanager
def loopback_dist():
    """torch.distributed's functions the engine calls, answering for LoopbackGroup
    objects while inside (restored on exit; this process uses no other group then)."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in _ROUTED}
    dist.get_rank = lambda group: group.rank
    dist.get_world_size = lambda group: group.size
    dist.get_process_group_ranks = lambda group: list(range(group.size))
    dist.get_backend = lambda group: "nccl"  # its start() records on the device, as NCCL's
    dist.broadcast = lambda t, src, group: group.broadcast(t)
    dist.all_gather = lambda out, t, group: [o.copy_(t) for o in out]
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(dist, name, f)


def launch_rows(worker, opts: RoundOptions, slots: int, env: dict, sampled: bool) -> list[RoundRow]:
    """One ``launch`` row per rank at ``slots`` (see the module docstring)."""
    import torch

    sent: list = []
    groups = [LoopbackGroup(r, opts.tp, sent) for r in range(opts.tp)]
    meta_device = "cuda" if opts.device_metadata else "cpu"
    feeder = Feeder(slots, opts.row_bytes, device="cuda", metadata_device=meta_device, sampled=sampled)
    stream = torch.cuda.current_stream()
    cpu, wall = [[] for _ in groups], [[] for _ in groups]
    events = []
    with loopback_dist(), contextlib.ExitStack() as stack:
        engines = []
        for g in groups:  # rank 0 first: the others take its start record
            engines.append(stack.enter_context(new_engine(opts, slots, env, tp_group=g)))
        check_mode(engines[0], "process")
        for i in range(opts.warmup + opts.rounds_for(slots)):
            batch = feeder.next_batch()
            stream.synchronize()
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(engines) + 1)]
            marks[0].record(stream)
            for r, rd in enumerate(engines):
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                launched = rd.launch(batch)
                c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
                marks[r + 1].record(stream)
                if r == 0:
                    first = launched
                if i >= opts.warmup:
                    cpu[r].append(c1 - c0)
                    wall[r].append(t1 - t0)
            stream.synchronize()
            del sent[:]  # every rank took this round's record
            for g in groups[1:]:
                g.read = 0
            feeder.after(first)
            if i >= opts.warmup:
                events.append(marks)
    counted = [rd.stats().rounds for rd in engines]  # closed: every round counted
    rows = []
    for r in range(opts.tp):
        lat = [int(m[0].elapsed_time(m[r + 1]) * 1e6) for m in events]
        outcomes = {o.label: n for o, n in counted[r].items() if n}
        extra = {
            "tp": opts.tp,
            "tp_rank": r,
            "tp_backend": "loopback",
            "launch_wall_p50_ms": ns_to_ms(pct(wall[r], 0.5)),
            "launch_wall_p99_ms": ns_to_ms(pct(wall[r], 0.99)),
            "launch_cpu_p99_ms": ns_to_ms(pct(cpu[r], 0.99)),
            "outcomes_over": "every launched round, warm-up included",
        }
        not_ok = sum(outcomes.values()) - outcomes.get("ok", 0)
        rows.append(RoundRow("launch", slots, len(lat), lat, cpu[r], not_ok, outcomes, extra, sampled))
    return rows

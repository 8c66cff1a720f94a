"""``bench round``'s engines: the environment and the started ``RemoteDSpark`` of a row,
and the loop of a launch row (:func:`launch_loop`, also each ``--tp`` rank's)."""

from __future__ import annotations

import contextlib
import os
import time

from .feeder import Feeder
from .options import RoundOptions


def engine_env(worker, opts: RoundOptions, mode: str, stats_dir: str, sampled: bool) -> dict[str, str]:
    """The environment of a row's engine against ``worker``."""
    from ...engine import Mode

    return worker.env(
        Mode(mode),
        stats_file=os.path.join(stats_dir, f"stats-{mode}.json"),
        VLLM_DSPARK_REMOTE_TIMEOUT_MS=str(opts.timeout_ms),
        VLLM_DSPARK_SAMPLED_TOP32="1" if sampled else "0",
    )


@contextlib.contextmanager
def engine(
    worker, opts: RoundOptions, mode: str, slots: int, stats_dir: str, device: str = "cpu", sampled: bool = False
):
    """A started ``RemoteDSpark`` for one row (``mode``: sync, thread or process;
    ``sampled``: asking for sampled drafts) against ``worker`` (a WorkerProcess), closed
    on exit."""
    rd = new_engine(opts, slots, engine_env(worker, opts, mode, stats_dir, sampled), device)
    try:
        rd.start()
        check_mode(rd, mode)
        yield rd
    finally:
        rd.close()


def new_engine(opts: RoundOptions, slots: int, env: dict[str, str], device: str = "cuda", tp_group=None):
    """A row's ``RemoteDSpark`` (not started) of ``slots`` slots in ``env``."""
    from ...config.api import RemoteConfig
    from ...engine import RemoteDSpark

    return RemoteDSpark(
        RemoteConfig.from_env(env),
        num_spec=opts.num_spec,
        max_slots=slots,
        row_bytes=opts.row_bytes,
        device=device,
        environ=env,
        tp_group=tp_group,
    )


def check_mode(rd, mode: str) -> None:
    """Raises RuntimeError unless the started engine runs ``mode``."""
    if rd.mode != mode:
        raise RuntimeError(
            f"{mode}: the engine runs {rd.mode} rounds (its async hand-off failed its self-test; see the log)"
        )


def launch_loop(rd, feeder: Feeder, warmup: int, rounds: int, measure=lambda: None) -> tuple[list, list, list]:
    """``warmup + rounds`` launches of the feeder's batches (``measure()`` once the warm-up
    is over); of the measured ones, ns: the time until the stream held the drafts, the
    CPU and the wall time inside ``launch()``."""
    import torch

    stream = torch.cuda.current_stream()
    pairs, cpu, wall = [], [], []
    for i in range(warmup + rounds):
        if i == warmup:
            measure()
        batch = feeder.next_batch()
        stream.synchronize()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record(stream)  # the events outside the CPU figures: a record is microseconds of CPU
        t0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        launched = rd.launch(batch)
        c1 = time.thread_time_ns()
        t1 = time.perf_counter_ns()
        ev1.record(stream)
        stream.synchronize()
        feeder.after(launched)
        if i >= warmup:
            pairs.append((ev0, ev1))
            cpu.append(c1 - c0)
            wall.append(t1 - t0)
    return [int(a.elapsed_time(b) * 1e6) for a, b in pairs], cpu, wall

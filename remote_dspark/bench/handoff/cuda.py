"""``remote-dspark bench handoff --device cuda``: the GPU-side hand-off, from CUDA events.

Each round the engine's stream records an event, writes ``gathered`` and waits for
``released`` (stream memory operations on the registered region), then records a second
event; the time between the two events is what the stream spent handing the round
over and getting it back. Rows, each without and with a GIL-hogging engine thread:

``c_peer``   a C loop in another process answering the words: the floor;
``process``  the project's proxy loop in its own interpreter (process mode);
``thread``   the same loop as a Python thread of the engine (thread mode);
``e2e``      a whole round through ``RemoteDSpark.launch`` (process mode) to a loopback
             worker: the gather, the hand-off, the network round and the drafts copied
             to the device, by CUDA events around the launch (at most 300 rounds).

The hand-off rows queue their rounds, 32 at a time, behind a gate word before the
stream runs them, so they measure the stream and the peer, not the CPU's enqueueing; the e2e row
is one round at a time, as an engine step is. The first round of each batch comes after
the peer waited through the CPU's enqueueing of the batch (hundreds of us, milliseconds
under the hog), as every round of a real engine comes after an engine step: its own
figures are the ``after idle`` column (the median and p99 of those rounds).

A native watchdog runs in every row, so no stream stays parked if a peer dies.
"""

from __future__ import annotations

import os
from functools import partial

from ... import native
from .peers import Peer, PeerThread, Pinning, run_rows
from .types import ROUND_TIMEOUT_S, HandoffOptions, HandoffRow, LatencySummary

CUDA_MODES = ("c_peer", "process", "thread", "e2e")
DESCRIBE = {
    "c_peer": "C peer process (floor)",
    "process": "proxy loop, own process",
    "thread": "proxy loop, engine thread",
    "e2e": "round to loopback worker",
}
E2E_ROUNDS = 300
CHUNK = 32  # hand-off rounds queued behind one gate
TARGET_RATIO = 1.3
TARGET_P99_US = 10.0


def run_all(opts: HandoffOptions, pins: Pinning) -> list[HandoffRow]:
    return run_rows(opts, pins, CUDA_MODES, RUNNERS, "handoff rows (cuda)")


class _Events:
    """``total`` pairs of timing events through the driver, whose calls keep the GIL:
    torch's ``Event.record`` releases it, and under the hog each release costs the
    enqueueing thread a switch interval (a 2000-round row took tens of seconds)."""

    def __init__(self, total: int):
        from ...shm.cuda_driver import Driver

        self.drv = Driver()
        self.pairs = [(self.drv.event_create(), self.drv.event_create()) for _ in range(total)]

    def elapsed_ns(self, skip: int) -> list[int]:
        return [self.drv.event_elapsed_ns(a, b) for a, b in self.pairs[skip:]]

    def __enter__(self) -> _Events:
        return self

    def __exit__(self, *exc) -> None:
        for pair in self.pairs:
            for ev in pair:
                self.drv.event_destroy(ev)


def _region_row(mode: str, lib, opts: HandoffOptions, pins: Pinning, hog: bool) -> HandoffRow:
    """The stream's hand-off alone: rounds are queued behind a gate word before the
    stream runs them, so the CPU's enqueueing (and its waits for the GIL) is not measured."""
    import torch

    from ...proxy import ring_end
    from ...shm import layout, memfd, ring, streamsync
    from .peer import serve_loop

    total = opts.warmup + opts.rounds
    lay = layout.Layout(depth=4, max_slots=1, row_bytes=64, num_spec=5, max_tokens=16)
    with memfd.Region.create(lay) as region:
        engine = ring.EngineEnd(region, lib)
        engine.start_watchdog(1000)  # no stream stays parked if a peer dies
        sync = streamsync.HostFlagSync(region, lib, backend="cuda")
        gate = lay.words_at + layout.W_PROBE_ACK
        token = (lib.load32(region.addr(gate)) + 1) & 0xFFFFFFFF
        stream = torch.cuda.current_stream()
        handle = stream.cuda_stream
        if mode == "thread":
            end = ring_end.ProxyEnd(region, lib, spin_us=opts.spin_us, nap_us=opts.nap_us)
            peer = PeerThread(lambda: serve_loop(end, total, ROUND_TIMEOUT_S), pins)
        else:
            peer = Peer(mode, region.fd, total, opts, pins, lib)
        with _Events(total) as events, peer:
            drv = events.drv
            if mode == "thread":
                _wait_in_native_wait(region, lib)
            # Chunks of CHUNK rounds, each queued behind its own gate value and let go once
            # queued: a stream can hold only so many queued operations (a blocked stream
            # with a full queue would block the enqueueing thread, and so the gate).
            opened = token - 1
            try:
                for first in range(0, total, CHUNK):
                    sync.backend.wait_word(gate, token + first // CHUNK)
                    for r in range(first + 1, min(first + CHUNK, total) + 1):
                        start, stop = events.pairs[r - 1]
                        drv.event_record(start, handle)
                        sync.signal(r, handle)
                        sync.wait(r, 0, handle)
                        drv.event_record(stop, handle)
                    opened = token + first // CHUNK
                    lib.store32(region.addr(gate), opened & 0xFFFFFFFF)
            finally:
                lib.store32(region.addr(gate), (opened + total) & 0xFFFFFFFF)  # whatever happened
            stream.synchronize()
            lat = events.elapsed_ns(opts.warmup)
    idle = [ns for i, ns in enumerate(lat) if (opts.warmup + i) % CHUNK == 0]
    return HandoffRow(
        mode, hog, "CUDA events", LatencySummary.of(lat), None, LatencySummary.of(idle) if idle else None, _slow(lat)
    )


def _wait_in_native_wait(region, lib, timeout_s: float = 10.0) -> None:
    """Wait (GIL released) until the thread peer has beaten the heartbeat, that is until
    it is inside its one native call that answers every round of the row. The enqueueing
    below keeps the GIL through driver calls that block while the stream's queue is full;
    a peer that still needed the GIL to start would then leave the queue full for good,
    and only the watchdog would move it."""
    import time

    from ...shm import layout

    beat = region.addr(layout.OFF_HEARTBEAT)
    end = time.monotonic() + timeout_s
    while lib.load64(beat) == 0:
        if time.monotonic() > end:
            raise RuntimeError(f"the thread peer did not start within {timeout_s}s")
        time.sleep(0.001)


def _slow(lat_ns: list[int]) -> int:
    """How many rounds took longer than the p99 target: a p99 under it allows 1 %."""
    return sum(ns > TARGET_P99_US * 1000 for ns in lat_ns)


def _e2e_row(lib, opts: HandoffOptions, pins: Pinning, hog: bool) -> HandoffRow:
    import torch

    from ...config import Mode
    from ...config.api import RemoteConfig
    from ...demo.harness import WorkerProcess
    from ...engine import Batch, RemoteDSpark

    slots, num_spec, row_bytes = 64, 5, 256
    # A whole round is milliseconds (and tens of them under the GIL hog): fewer rounds.
    total = opts.warmup + min(opts.rounds, E2E_ROUNDS)
    with WorkerProcess() as worker:
        env = worker.env(Mode.PROCESS, **{native.ENV_LIB: lib.path})
        rows = torch.randn(slots, row_bytes // 4, device="cuda")
        index = torch.arange(slots, device="cuda")
        stream = torch.cuda.current_stream()
        handle = stream.cuda_stream
        with (
            _Events(total) as events,
            RemoteDSpark(
                RemoteConfig.from_env(env),
                num_spec=num_spec,
                max_slots=slots,
                row_bytes=row_bytes,
                device="cuda",
                environ=env,
            ) as rd,
        ):
            drv = events.drv
            first = Batch.from_lists(list(range(slots)), [[1, 2]] * slots, [0] * slots, [True] * slots, rows, index)
            rd.launch(first)
            stream.synchronize()
            for i, (start, stop) in enumerate(events.pairs):
                batch = Batch.from_lists(
                    list(range(slots)), [[3]] * slots, [2 + i] * slots, [False] * slots, rows, index
                )
                drv.event_record(start, handle)
                rd.launch(batch)
                drv.event_record(stop, handle)
                drv.event_synchronize(stop)  # one round at a time, as an engine step would
            lat = events.elapsed_ns(opts.warmup)
    return HandoffRow("e2e", hog, "CUDA events", LatencySummary.of(lat), None, slow=_slow(lat))


RUNNERS = {
    "c_peer": partial(_region_row, "c_peer"),
    "process": partial(_region_row, "process"),
    "thread": partial(_region_row, "thread"),
    "e2e": _e2e_row,
}


def make_report(opts: HandoffOptions, pins: Pinning, rows: list[HandoffRow]) -> dict:
    import torch

    floor = {r.hog: r.latency for r in rows if r.mode == "c_peer"}
    out = []
    for r in rows:
        f = floor[r.hog]
        out.append(
            {
                "mode": r.mode,
                "hog": r.hog,
                "timed_in": r.timed_in,
                "median_us": r.latency.median_us,
                "p99_us": r.latency.p99_us,
                "max_us": r.latency.max_us,
                "rounds": min(opts.rounds, E2E_ROUNDS) if r.mode == "e2e" else opts.rounds,
                "over_target": r.slow,
                "after_idle": None
                if r.after_idle is None
                else {"median_us": r.after_idle.median_us, "p99_us": r.after_idle.p99_us},
                "x_floor": {
                    k: round(getattr(r.latency, k) / max(getattr(f, k), 1e-3), 2)
                    for k in ("median_us", "p99_us", "max_us")
                },
            }
        )
    proc = [r for r in out if r["mode"] == "process"]
    targets = {
        "process_median_ratio_max": max(r["x_floor"]["median_us"] for r in proc),
        "process_p99_us_max": max(r["p99_us"] for r in proc),
    }
    targets["met"] = (
        targets["process_median_ratio_max"] <= TARGET_RATIO and targets["process_p99_us_max"] < TARGET_P99_US
    )
    targets["floor_p99_us_max"] = max(f.p99_us for f in floor.values())  # the same test, for the floor
    return {
        "bench": "handoff",
        "device": torch.cuda.get_device_name(),
        "rounds": opts.rounds,
        "warmup": opts.warmup,
        "spin_us": opts.spin_us,
        "nap_us": opts.nap_us,
        "cpus": os.cpu_count(),
        "pinning": pins.describe(),
        "rows": out,
        "targets": targets,
    }


def format_table(report: dict) -> str:
    over = f"> {TARGET_P99_US:g} us"
    head = (
        f"{'mode':<28}{'hog':<5}{'median':>9}{'p99':>10}{'max':>11}{'x floor p50/p99/max':>24}"
        f"{'after idle p50/p99':>21}{over:>12}"
    )
    lines = [
        f"GPU-side hand-off on {report['device']}, {report['rounds']} rounds per row "
        f"(+{report['warmup']} warm-up), us from CUDA events; spin {report['spin_us']} us, "
        f"nap {report['nap_us']} us; {report['pinning']}",
        head,
        "-" * len(head),
    ]
    for r in report["rows"]:
        x = r["x_floor"]
        xs = f"{x['median_us']:g}/{x['p99_us']:g}/{x['max_us']:g}"
        idle = r["after_idle"]
        ids = "-" if idle is None else f"{idle['median_us']:.2f}/{idle['p99_us']:.2f}"
        slow = "-" if r.get("over_target") is None else f"{r['over_target']}/{r['rounds']}"
        lines.append(
            f"{DESCRIBE[r['mode']]:<28}{'yes' if r['hog'] else 'no':<5}{r['median_us']:>9.2f}"
            f"{r['p99_us']:>10.2f}{r['max_us']:>11.1f}{xs:>24}{ids:>21}{slow:>12}"
        )
    t = report["targets"]
    lines.append(
        f"target process median <= {TARGET_RATIO:g}x floor and p99 < {TARGET_P99_US:g} us (with and "
        f"without hog): {t['process_median_ratio_max']:g}x, {t['process_p99_us_max']:.2f} us, "
        f"{'met' if t['met'] else 'NOT met'}"
    )
    if "floor_p99_us_max" in t:
        lines.append(f"(the floor's own p99, worst of the two: {t['floor_p99_us_max']:.2f} us)")
    return "\n".join(lines)


def main_check() -> None:
    """Raises a clear error when there is no GPU to run on."""
    try:
        import torch
    except ImportError as e:
        raise ValueError("--device cuda needs torch with CUDA") from e
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")

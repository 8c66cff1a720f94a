"""``remote-dspark bench handoff``: round-trip latency of the hand-off, side by side.

Rows, each without and with a GIL-hogging Python thread in the engine process:

``process``  the native hand-off (``streamsync.HostFlagSync``, CPU backend) answered by
             the project's proxy loop (``ring_end.ProxyEnd``) in its own interpreter;
``thread``   the same loop as a Python thread of the engine (thread mode);
``c_peer``   a C loop in another process answering the same words: the floor;
``pipe``     a ``multiprocessing.Pipe`` ping-pong with another interpreter;
``pyflag``   a pure-Python shared-memory flag polled with ``os.sched_yield()``.

The native rows are timed inside the C library, from the store of ``gathered`` to the
first look that saw ``released``; the engine thread's wait for its GIL after the call
returns is the ``gil wait`` column. ``pipe`` and ``pyflag`` are timed in Python, so
their figures include that wait. Ratios are to the floor (``c_peer``) of the same hog
setting. Medians, p99 and max in microseconds; ``--json`` for machines.

By default the peer runs on a CPU of its own and the engine's threads on the others
(``--no-pin`` lets them share), and where the peer is another process the engine's wait
keeps its GIL for its first ``--hold-gil-us`` (the thread row cannot: its peer needs the
GIL). docs/benchmarks.md shows what each changes on a 2-core machine.

The peers, their pinning and the GIL hog are in :mod:`remote_dspark.bench.handoff.peers`: every peer answers
exactly warm-up + N rounds, and every process a row starts is ended before it returns.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from functools import partial

from .peers import Peer, PeerThread, Pinning, run_rows
from .types import HOLD_GIL_US, ROUND_TIMEOUT_S, HandoffOptions, HandoffRow, LatencySummary

MODES = ("process", "thread", "c_peer", "pipe", "pyflag")
DESCRIBE = {
    "process": "proxy loop, own process",
    "thread": "proxy loop, engine thread",
    "c_peer": "C peer process (floor)",
    "pipe": "multiprocessing.Pipe",
    "pyflag": "py shm flag+sched_yield",
}
TARGET_P99_US = 10.0
TARGET_WORST_RATIO = 100.0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "handoff",
        help="hand-off round trip: process vs thread vs C floor vs Pipe",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--rounds", type=int, default=1000, help="measured rounds per row (default 1000)")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured rounds first (default 20)")
    p.add_argument(
        "--spin-us",
        type=int,
        default=1000,
        help="spin before napping, as VLLM_DSPARK_REMOTE_ASYNC_SPIN_US (default 1000)",
    )
    p.add_argument(
        "--nap-us",
        type=int,
        default=0,
        help="nap between looks after the spin, as VLLM_DSPARK_REMOTE_ASYNC_NAP_US (default 0: spin)",
    )
    p.add_argument(
        "--hold-gil-us",
        type=int,
        default=HOLD_GIL_US,
        help="rows whose peer is another process: the engine spins this long "
        f"keeping its GIL before releasing it (default {HOLD_GIL_US}; 0: "
        "release at once). The thread row never holds: its peer needs the GIL",
    )
    p.add_argument(
        "--idle-us",
        type=int,
        default=0,
        help="sleep this long before each round, as an engine step does (default 0: "
        "back to back); shows what a peer that waited through an idle gap adds",
    )
    p.add_argument(
        "--switch-interval-us",
        type=int,
        default=0,
        help="set the engine's GIL switch interval (default 0: the interpreter's)",
    )
    p.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not give the peer a CPU of its own (default: the peer process or "
        "thread runs on the CPU that has served the fewest device interrupts, "
        "the engine's threads on the others)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: the CPU stand-in, timed in C (default); cuda: the engine stream's "
        "hand-off on the registered region, timed by CUDA events, plus a whole round "
        "to a loopback worker",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.rounds < 1 or args.warmup < 0 or args.hold_gil_us < 0 or args.idle_us < 0:
        raise ValueError(
            f"--rounds={args.rounds} --warmup={args.warmup} --hold-gil-us="
            f"{args.hold_gil_us} --idle-us={args.idle_us}: need rounds >= 1, "
            "warmup >= 0, hold >= 0, idle >= 0"
        )
    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    opts = HandoffOptions(args.rounds, args.warmup, args.spin_us, args.nap_us, args.hold_gil_us, args.pin, args.idle_us)
    pins = Pinning.plan(opts.pin)  # once: the table says where the rows ran
    if args.device == "cuda":
        from . import cuda as impl

        impl.main_check()
        report = impl.make_report(opts, pins, impl.run_all(opts, pins))
    else:
        impl = sys.modules[__name__]
        report = make_report(opts, pins, run_all(opts, pins))
    print(json.dumps(report, indent=2) if args.json else impl.format_table(report))
    return 0


IDLE_EVERY = 50  # every 50th measured round of a region row comes after an idle gap
IDLE_GAP_S = 0.005  # longer than the default spin (1 ms): the peer sleeps through it


def run_all(
    opts: HandoffOptions, pins: Pinning, modes=None, runners=None, label: str = "handoff rows"
) -> list[HandoffRow]:
    """Every row of ``modes`` (default: this module's), each without and then with the
    hog, with the engine's threads kept off the peer's CPU (the hog must never share it)."""
    return run_rows(opts, pins, modes or MODES, runners or RUNNERS, label)


# --------------------------------------------------------------------------- rows


def _region_row(mode: str, lib, opts: HandoffOptions, pins: Pinning, hog: bool) -> HandoffRow:
    """A row over the region: HostFlagSync's hand-off, timed in C, to ``mode``'s peer."""
    from ...shm import layout, memfd, ring, streamsync

    total = opts.warmup + opts.rounds
    lay = layout.Layout(depth=4, max_slots=1, row_bytes=64, num_spec=5, max_tokens=16)
    with memfd.Region.create(lay) as region:
        engine = ring.EngineEnd(region, lib)
        sync = streamsync.HostFlagSync(
            region,
            lib,
            spin_us=opts.spin_us,
            nap_us=opts.nap_us,
            hold_gil_us=0 if mode == "thread" else opts.hold_gil_us,
        )
        lat, gil, idle = [], [], []
        with _region_peer(mode, region, total + total // IDLE_EVERY, opts, pins, lib):
            for i in range(total + total // IDLE_EVERY):
                # Every IDLE_EVERY-th measured round comes after an idle gap long enough
                # for the peer to fall asleep (past its spin): the wake-up, counted apart.
                after_idle = i >= opts.warmup and (i - opts.warmup) % IDLE_EVERY == IDLE_EVERY - 1
                if after_idle:
                    time.sleep(IDLE_GAP_S)
                else:
                    opts.pause()
                r = engine.try_reserve()  # never full: one round in flight at a time
                h = sync.handoff(r, ROUND_TIMEOUT_S)
                back = time.monotonic_ns()
                if not h.ok:
                    raise RuntimeError(f"{mode}: round {r} not released in {ROUND_TIMEOUT_S}s")
                if after_idle:
                    idle.append(h.latency_ns)
                elif i >= opts.warmup:
                    lat.append(h.latency_ns)
                    gil.append(back - h.released_ns)
    return HandoffRow(
        mode, hog, "C", LatencySummary.of(lat), LatencySummary.of(gil), LatencySummary.of(idle) if idle else None
    )


def _region_peer(mode: str, region, total: int, opts: HandoffOptions, pins: Pinning, lib):
    """The peer of a region row: the proxy loop as a thread (thread mode), else a process."""
    if mode != "thread":
        return Peer(mode, region.fd, total, opts, pins, lib)
    from ...proxy import ring_end
    from .peer import serve_loop

    end = ring_end.ProxyEnd(region, lib, spin_us=opts.spin_us, nap_us=opts.nap_us)
    return PeerThread(lambda: serve_loop(end, total, ROUND_TIMEOUT_S), pins)


def _pipe_row(lib, opts: HandoffOptions, pins: Pinning, hog: bool) -> HandoffRow:
    import multiprocessing

    ours, theirs = multiprocessing.Pipe()
    total, lat, msg = opts.warmup + opts.rounds, [], b"r"
    try:
        with Peer("pipe", theirs.fileno(), total, opts, pins, lib):
            theirs.close()
            for i in range(total):
                opts.pause()
                t0 = time.monotonic_ns()
                ours.send_bytes(msg)
                if not ours.poll(ROUND_TIMEOUT_S):
                    raise RuntimeError(f"pipe: no echo in {ROUND_TIMEOUT_S}s")
                ours.recv_bytes()
                if i >= opts.warmup:
                    lat.append(time.monotonic_ns() - t0)
    finally:
        ours.close()
        theirs.close()
    return HandoffRow("pipe", hog, "Python", LatencySummary.of(lat), None)


def _pyflag_row(lib, opts: HandoffOptions, pins: Pinning, hog: bool) -> HandoffRow:
    import mmap

    from .peer import FLAG, FLAG_BYTES, PING, PONG, pyflag_wait

    total, lat = opts.warmup + opts.rounds, []
    fd = os.memfd_create("remote-dspark-pyflag")
    try:
        os.ftruncate(fd, FLAG_BYTES)
        mm = mmap.mmap(fd, FLAG_BYTES)
        try:
            with Peer("pyflag", fd, total, opts, pins, lib):
                for r in range(1, total + 1):
                    opts.pause()
                    t0 = time.monotonic_ns()
                    FLAG.pack_into(mm, PING, r)
                    pyflag_wait(mm, PONG, r, time.monotonic() + ROUND_TIMEOUT_S)
                    if r > opts.warmup:
                        lat.append(time.monotonic_ns() - t0)
        finally:
            mm.close()
    finally:
        os.close(fd)
    return HandoffRow("pyflag", hog, "Python", LatencySummary.of(lat), None)


RUNNERS = {
    "process": partial(_region_row, "process"),
    "thread": partial(_region_row, "thread"),
    "c_peer": partial(_region_row, "c_peer"),
    "pipe": _pipe_row,
    "pyflag": _pyflag_row,
}


# --------------------------------------------------------------------------- report


def make_report(opts: HandoffOptions, pins: Pinning, rows: list[HandoffRow]) -> dict:
    floor = {r.hog: r.latency for r in rows if r.mode == "c_peer"}
    out_rows = []
    for r in rows:
        f = floor.get(r.hog)
        d = {
            "mode": r.mode,
            "hog": r.hog,
            "timed_in": r.timed_in,
            **asdict(r.latency),
            "x_floor": None
            if f is None
            else {
                k: round(getattr(r.latency, k) / max(getattr(f, k), 1e-3), 1) for k in ("median_us", "p99_us", "max_us")
            },
            "gil_wait": None if r.gil_wait is None else asdict(r.gil_wait),
            "after_idle": None if r.after_idle is None else asdict(r.after_idle),
        }
        out_rows.append(d)
    return {
        "bench": "handoff",
        "rounds": opts.rounds,
        "warmup": opts.warmup,
        "spin_us": opts.spin_us,
        "nap_us": opts.nap_us,
        "hold_gil_us": opts.hold_gil_us,
        "idle_us": opts.idle_us,
        "cpus": os.cpu_count(),
        "pinning": pins.describe(),
        "switch_interval_us": round(sys.getswitchinterval() * 1e6),
        "rows": out_rows,
        "targets": targets(rows),
    }


def targets(rows: list[HandoffRow]) -> dict:
    by = {(r.mode, r.hog): r.latency for r in rows}
    out: dict = {}
    proc = [by[("process", h)] for h in (False, True) if ("process", h) in by]
    if proc:
        worst = max(s.p99_us for s in proc)
        out["process_p99_us"] = worst
        out["process_p99_met"] = worst <= TARGET_P99_US
    if ("process", True) in by and ("thread", True) in by:
        ratio = by[("thread", True)].max_us / max(by[("process", True)].max_us, 1e-3)
        out["hog_worst_ratio_thread_over_process"] = round(ratio, 1)
        out["hog_worst_ratio_met"] = ratio >= TARGET_WORST_RATIO
    return out


def _gap(report: dict) -> str:
    idle = report.get("idle_us", 0)
    return f"{idle} us idle before each round, " if idle else ""


def format_table(report: dict) -> str:
    head = (
        f"{'mode':<26}{'hog':<5}{'median':>9}{'p99':>10}{'max':>11}"
        f"{'x floor p50/p99/max':>24}{'after idle p50/p99':>21}   gil wait p50/p99/max"
    )
    lines = [
        f"hand-off round trip, {report['rounds']} rounds per row (+{report['warmup']} warm-up), "
        f"us; {_gap(report)}spin {report['spin_us']} us, nap {report['nap_us']} us, GIL hold "
        f"{report['hold_gil_us']} us (process peers), {report['cpus']} CPUs, "
        f"switch interval {report['switch_interval_us']} us; {report['pinning']}",
        head,
        "-" * len(head),
    ]
    for r in report["rows"]:
        x = r["x_floor"]
        xs = "-" if x is None else f"{x['median_us']:g}/{x['p99_us']:g}/{x['max_us']:g}"
        g = r["gil_wait"]
        gs = (
            "(in the figures: timed in Python)"
            if g is None
            else f"{g['median_us']:.1f}/{g['p99_us']:.1f}/{g['max_us']:.1f}"
        )
        a = r["after_idle"]
        ids = "-" if a is None else f"{a['median_us']:.1f}/{a['p99_us']:.1f}"
        lines.append(
            f"{DESCRIBE[r['mode']]:<26}{'yes' if r['hog'] else 'no':<5}"
            f"{r['median_us']:>9.2f}{r['p99_us']:>10.2f}{r['max_us']:>11.1f}"
            f"{xs:>24}{ids:>21}   {gs}"
        )
    lines.append(
        f"after idle: every {IDLE_EVERY}th round comes {IDLE_GAP_S * 1e3:g} ms after the one before "
        "(the peer has spun its ASYNC_SPIN_US and sleeps): its wake-up, not in the other columns"
    )
    t = report["targets"]
    if "process_p99_us" in t:
        lines.append(
            f"target process p99 <= {TARGET_P99_US:g} us (with and without hog): "
            f"{t['process_p99_us']:.2f} us, {'met' if t['process_p99_met'] else 'NOT met'}"
        )
    if "hog_worst_ratio_thread_over_process" in t:
        lines.append(
            f"target worst case under hog, thread / process >= {TARGET_WORST_RATIO:g}x: "
            f"{t['hog_worst_ratio_thread_over_process']:g}x, "
            f"{'met' if t['hog_worst_ratio_met'] else 'NOT met'}"
        )
    return "\n".join(lines)

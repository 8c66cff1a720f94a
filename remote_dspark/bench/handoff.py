"""``remote-dspark bench handoff``: round-trip latency of the hand-off, side by side.

Rows, each without and with a GIL-hogging Python thread in the engine process:

``process``  the native hand-off (``streamsync.HostFlagSync``, CPU backend) answered by
             the project's proxy loop (``ring.ProxyEnd``) in its own interpreter;
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
GIL). docs/handoff.md shows what each changes on a 2-core machine.

Every peer answers exactly warm-up + N rounds and exits; every process this starts is
ended before the row returns.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable

MODES = ("process", "thread", "c_peer", "pipe", "pyflag")
DESCRIBE = {
    "process": "proxy loop, own process",
    "thread": "proxy loop, engine thread",
    "c_peer": "C peer process (floor)",
    "pipe": "multiprocessing.Pipe",
    "pyflag": "py shm flag+sched_yield",
}
ROUND_TIMEOUT_S = 30.0   # generous: a hog row waits up to a switch interval per call
HOLD_GIL_US = 50
TARGET_P99_US = 10.0
TARGET_WORST_RATIO = 100.0
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def add_parser(sub) -> None:
    p = sub.add_parser("handoff", help="hand-off round trip: process vs thread vs C floor vs Pipe",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1000, help="measured rounds per row (default 1000)")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured rounds first (default 20)")
    p.add_argument("--spin-us", type=int, default=1000,
                   help="spin before napping, as VLLM_DSPARK_REMOTE_ASYNC_SPIN_US (default 1000)")
    p.add_argument("--nap-us", type=int, default=0,
                   help="nap between looks after the spin, as VLLM_DSPARK_REMOTE_ASYNC_NAP_US "
                        "(default 0: spin)")
    p.add_argument("--hold-gil-us", type=int, default=HOLD_GIL_US,
                   help="rows whose peer is another process: the engine spins this long "
                        f"keeping its GIL before releasing it (default {HOLD_GIL_US}; 0: "
                        "release at once). The thread row never holds: its peer needs the GIL")
    p.add_argument("--idle-us", type=int, default=0,
                   help="sleep this long before each round, as an engine step does (default 0: "
                        "back to back); shows what a peer that waited through an idle gap adds")
    p.add_argument("--switch-interval-us", type=int, default=0,
                   help="set the engine's GIL switch interval (default 0: the interpreter's)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not give the peer a CPU of its own (default: the peer process or "
                        "thread runs on the CPU that has served the fewest device interrupts, "
                        "the engine's threads on the others)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the CPU stand-in, timed in C (default); cuda: the engine stream's "
                        "hand-off on the registered region, timed by CUDA events, plus a whole round "
                        "to a loopback worker")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class Stats:
    median_us: float
    p99_us: float
    max_us: float

    @classmethod
    def of(cls, ns: list[int]) -> "Stats":
        s = sorted(ns)
        return cls(s[len(s) // 2] / 1e3, s[max(0, math.ceil(0.99 * len(s)) - 1)] / 1e3, s[-1] / 1e3)


@dataclass(frozen=True)
class Row:
    mode: str
    hog: bool
    timed_in: str            # "C" or "Python"
    latency: Stats
    gil_wait: Stats | None   # only for rows timed in C
    after_idle: Stats | None = None   # CUDA rows: each batch's first round (see handoff_cuda)
    slow: int | None = None           # CUDA rows: rounds over the p99 target


@dataclass(frozen=True)
class Options:
    rounds: int
    warmup: int
    spin_us: int
    nap_us: int
    hold_gil_us: int = HOLD_GIL_US
    pin: bool = True
    idle_us: int = 0

    def pause(self) -> None:
        """The gap before a round (``--idle-us``)."""
        if self.idle_us:
            time.sleep(self.idle_us / 1e6)


@dataclass(frozen=True)
class Pinning:
    """Which CPUs the peer and the engine run on. The peer spins (ASYNC_NAP_US=0), so it
    is given a core of its own, as a deployment gives the proxy one; without that, on a
    small machine the spinning peer, the engine thread and a GIL hog share fewer cores
    than they need and the scheduler's time slices (milliseconds) show up as latency."""

    peer: frozenset[int] | None      # None: not pinned
    engine: frozenset[int] | None

    @classmethod
    def plan(cls, pin: bool, interrupts: str = "/proc/interrupts") -> "Pinning":
        """For the peer, the CPU that has served the fewest device interrupts (the last
        of those): an interrupt in the middle of a hand-off makes the stream miss its
        poll of ``released`` (see handoff.md). The others for the engine, less the peer's
        hyper-thread siblings where enough CPUs remain (a busy sibling slows the peer)."""
        cpus = sorted(os.sched_getaffinity(0))
        if not pin or len(cpus) < 2:
            return cls(None, None)
        irqs = device_interrupts(interrupts)
        peer = min(reversed(cpus), key=lambda c: irqs.get(c, 0))
        others = [c for c in cpus if c != peer]
        engine = [c for c in others if c not in _siblings(peer)] or others
        return cls(frozenset([peer]), frozenset(engine))

    @contextlib.contextmanager
    def engine_threads(self):
        """Keep this thread, and the threads it starts meanwhile (the hog, the thread
        peer, the CUDA driver's), on the engine's CPUs; restored on exit."""
        before = os.sched_getaffinity(0)
        try:
            if self.engine is not None:
                os.sched_setaffinity(0, self.engine)
            yield
        finally:
            os.sched_setaffinity(0, before)

    def describe(self) -> str:
        if self.peer is None:
            return "not pinned"
        return f"peer on CPU {sorted(self.peer)}, engine on CPU {sorted(self.engine)}"


def device_interrupts(path: str = "/proc/interrupts") -> dict[int, int]:
    """Per CPU, the device interrupts it has served since boot: the numbered lines of
    ``path`` (a NIC's queues, a block device), not the CPU's own (timer, IPIs). Empty
    when the file cannot be read."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    if not lines:
        return {}
    cpus = [int(c[3:]) for c in lines[0].split() if c.startswith("CPU") and c[3:].isdigit()]
    out = dict.fromkeys(cpus, 0)
    for line in lines[1:]:
        name, _, rest = line.partition(":")
        if not name.strip().isdigit():
            continue
        for cpu, count in zip(cpus, rest.split()):
            if not count.isdigit():
                break
            out[cpu] += int(count)
    return out


def _siblings(cpu: int) -> set[int]:
    """The CPUs sharing ``cpu``'s core (from sysfs; empty when unknown)."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return set()
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def run(args) -> int:
    if args.rounds < 1 or args.warmup < 0 or args.hold_gil_us < 0 or args.idle_us < 0:
        raise ValueError(f"--rounds={args.rounds} --warmup={args.warmup} --hold-gil-us="
                         f"{args.hold_gil_us} --idle-us={args.idle_us}: need rounds >= 1, "
                         "warmup >= 0, hold >= 0, idle >= 0")
    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    opts = Options(args.rounds, args.warmup, args.spin_us, args.nap_us, args.hold_gil_us, args.pin,
                   args.idle_us)
    pins = Pinning.plan(opts.pin)   # once: the table says where the rows ran
    if args.device == "cuda":
        from . import handoff_cuda as impl
        impl.main_check()
        report = impl.make_report(opts, pins, impl.run_all(opts, pins))
    else:
        impl = sys.modules[__name__]
        report = make_report(opts, pins, run_all(opts, pins))
    print(json.dumps(report, indent=2) if args.json else impl.format_table(report))
    return 0


def run_all(opts: Options, pins: Pinning, modes=None, runners=None,
            label: str = "handoff rows") -> list[Row]:
    """Every row of ``modes`` (default: this module's), each without and then with the
    hog, with the engine's threads kept off the peer's CPU (the hog must never share it)."""
    from .. import native
    from ..progress import Progress
    modes, runners = modes or MODES, runners or RUNNERS
    lib = native.load()
    plan = [(m, hog) for hog in (False, True) for m in modes]
    rows = []
    with pins.engine_threads():
        bar = Progress(len(plan), label)
        for i, (mode, hog) in enumerate(plan):
            bar.update(i, f"{mode}{' +hog' if hog else ''}")
            with GilHog(hog):
                rows.append(runners[mode](lib, opts, pins, hog))
        bar.update(len(plan))
    return rows


# --------------------------------------------------------------------------- rows


def _region_row(mode: str, lib, opts: Options, pins: Pinning, hog: bool) -> Row:
    """A row over the region: HostFlagSync's hand-off, timed in C, to ``mode``'s peer."""
    from .. import ring, shm, shm_layout, streamsync
    total = opts.warmup + opts.rounds
    layout = shm_layout.Layout(depth=4, max_slots=1, row_bytes=64, num_spec=5, max_tokens=16)
    with shm.Region.create(layout) as region:
        engine = ring.EngineEnd(region, lib)
        sync = streamsync.HostFlagSync(region, lib, spin_us=opts.spin_us, nap_us=opts.nap_us,
                                       hold_gil_us=0 if mode == "thread" else opts.hold_gil_us)
        lat, gil = [], []
        with _region_peer(mode, region, total, opts, pins, lib):
            for i in range(total):
                opts.pause()
                r = engine.try_reserve()  # never full: one round in flight at a time
                h = sync.handoff(r, ROUND_TIMEOUT_S)
                back = time.monotonic_ns()
                if not h.ok:
                    raise RuntimeError(f"{mode}: round {r} not released in {ROUND_TIMEOUT_S}s")
                if i >= opts.warmup:
                    lat.append(h.latency_ns)
                    gil.append(back - h.released_ns)
    return Row(mode, hog, "C", Stats.of(lat), Stats.of(gil))


def _region_peer(mode: str, region, total: int, opts: Options, pins: Pinning, lib):
    """The peer of a region row: the proxy loop as a thread (thread mode), else a process."""
    if mode != "thread":
        return Peer(mode, region.fd, total, opts, pins, lib)
    from .. import ring
    from .handoff_peer import serve_loop
    end = ring.ProxyEnd(region, lib, spin_us=opts.spin_us, nap_us=opts.nap_us)
    return PeerThread(lambda: serve_loop(end, total, ROUND_TIMEOUT_S), pins)


def _pipe_row(lib, opts: Options, pins: Pinning, hog: bool) -> Row:
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
    return Row("pipe", hog, "Python", Stats.of(lat), None)


def _pyflag_row(lib, opts: Options, pins: Pinning, hog: bool) -> Row:
    import mmap
    from .handoff_peer import FLAG, FLAG_BYTES, PING, PONG, pyflag_wait
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
    return Row("pyflag", hog, "Python", Stats.of(lat), None)


RUNNERS = {"process": partial(_region_row, "process"), "thread": partial(_region_row, "thread"),
           "c_peer": partial(_region_row, "c_peer"), "pipe": _pipe_row, "pyflag": _pyflag_row}
PEER_MODE = {"process": "loop", "c_peer": "c", "pipe": "pipe", "pyflag": "pyflag"}


class Peer:
    """The answering interpreter of one row, given ``fd`` and nothing else. Ended on exit:
    waited for (it answers exactly ``total`` rounds), killed if it outstays that."""

    _proc: subprocess.Popen | None = None

    def __init__(self, mode: str, fd: int, total: int, opts: Options, pins: Pinning, lib):
        self._cpus = pins.peer
        env = dict(os.environ)
        env["VLLM_DSPARK_REMOTE_HOSTFLAG_LIB"] = lib.path  # the engine's build, no rebuild
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
        self._cmd = [sys.executable, "-m", "remote_dspark.bench.handoff_peer", PEER_MODE[mode],
                     "--fd", str(fd), "--rounds", str(total), "--spin-us", str(opts.spin_us),
                     "--nap-us", str(opts.nap_us), "--timeout-s", str(ROUND_TIMEOUT_S)]
        self._fd, self._env = fd, env

    def __enter__(self) -> "Peer":
        self._proc = subprocess.Popen(self._cmd, pass_fds=(self._fd,), env=self._env,
                                      stderr=subprocess.PIPE, text=True)
        if self._cpus is not None:
            os.sched_setaffinity(self._proc.pid, self._cpus)
        return self

    def __exit__(self, exc_type, *_) -> None:
        rc, err = reap(self._proc, ROUND_TIMEOUT_S if exc_type is None else 0.5)
        if exc_type is None and rc != 0:
            raise RuntimeError(f"peer {self._cmd[3]} exited {rc}: {err.strip()}")


def reap(proc: subprocess.Popen, wait_s: float) -> tuple[int | None, str]:
    """Wait up to ``wait_s`` for a peer process, kill it if it is still there (it is
    always gone after this); its exit status (None when it had to be killed) and its
    stderr (a text pipe)."""
    try:
        rc = proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        err = proc.stderr.read()
        proc.stderr.close()
    return rc, err


class PeerThread:
    """Thread mode: the peer loop as a Python thread of this process."""

    def __init__(self, target: Callable[[], None], pins: Pinning):
        self._target = target
        self._cpus = pins.peer
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="handoff-peer", daemon=True)

    def _run(self) -> None:
        try:
            if self._cpus is not None:
                os.sched_setaffinity(0, self._cpus)  # this thread only
            self._target()
        except BaseException as e:  # reported by __exit__
            self._error = e

    def __enter__(self) -> "PeerThread":
        self._thread.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        # Past the peer's own longest wait (ROUND_TIMEOUT_S): after a failure of the body
        # the thread is still waiting for rounds that never come, and the region it reads
        # must not be unmapped under it.
        self._thread.join(2 * ROUND_TIMEOUT_S)
        if exc_type is None and (self._error or self._thread.is_alive()):
            raise RuntimeError(f"thread peer failed: {self._error or 'still running'}")


class GilHog:
    """A Python thread that only computes, holding the GIL whenever it can."""

    def __init__(self, on: bool):
        self._on = on
        self._running = False
        self._thread: threading.Thread | None = None

    def _spin(self) -> None:
        n = 0
        while self._running:
            n += 1

    def __enter__(self) -> "GilHog":
        if self._on:
            self._running = True
            self._thread = threading.Thread(target=self._spin, name="gil-hog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join()


# --------------------------------------------------------------------------- report


def make_report(opts: Options, pins: Pinning, rows: list[Row]) -> dict:
    floor = {r.hog: r.latency for r in rows if r.mode == "c_peer"}
    out_rows = []
    for r in rows:
        f = floor.get(r.hog)
        d = {"mode": r.mode, "hog": r.hog, "timed_in": r.timed_in, **asdict(r.latency),
             "x_floor": None if f is None else {
                 k: round(getattr(r.latency, k) / max(getattr(f, k), 1e-3), 1)
                 for k in ("median_us", "p99_us", "max_us")},
             "gil_wait": None if r.gil_wait is None else asdict(r.gil_wait)}
        out_rows.append(d)
    return {"bench": "handoff", "rounds": opts.rounds, "warmup": opts.warmup,
            "spin_us": opts.spin_us, "nap_us": opts.nap_us, "hold_gil_us": opts.hold_gil_us,
            "idle_us": opts.idle_us,
            "cpus": os.cpu_count(),
            "pinning": pins.describe(),
            "switch_interval_us": round(sys.getswitchinterval() * 1e6),
            "rows": out_rows, "targets": targets(rows)}


def targets(rows: list[Row]) -> dict:
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
    head = (f"{'mode':<26}{'hog':<5}{'median':>9}{'p99':>10}{'max':>11}"
            f"{'x floor p50/p99/max':>24}   gil wait p50/p99/max")
    lines = [f"hand-off round trip, {report['rounds']} rounds per row (+{report['warmup']} warm-up), "
             f"us; {_gap(report)}spin {report['spin_us']} us, nap {report['nap_us']} us, GIL hold "
             f"{report['hold_gil_us']} us (process peers), {report['cpus']} CPUs, "
             f"switch interval {report['switch_interval_us']} us; {report['pinning']}", head, "-" * len(head)]
    for r in report["rows"]:
        x = r["x_floor"]
        xs = "-" if x is None else f"{x['median_us']:g}/{x['p99_us']:g}/{x['max_us']:g}"
        g = r["gil_wait"]
        gs = ("(in the figures: timed in Python)" if g is None else
              f"{g['median_us']:.1f}/{g['p99_us']:.1f}/{g['max_us']:.1f}")
        lines.append(f"{DESCRIBE[r['mode']]:<26}{'yes' if r['hog'] else 'no':<5}"
                     f"{r['median_us']:>9.2f}{r['p99_us']:>10.2f}{r['max_us']:>11.1f}"
                     f"{xs:>24}   {gs}")
    t = report["targets"]
    if "process_p99_us" in t:
        lines.append(f"target process p99 <= {TARGET_P99_US:g} us (with and without hog): "
                     f"{t['process_p99_us']:.2f} us, {'met' if t['process_p99_met'] else 'NOT met'}")
    if "hog_worst_ratio_thread_over_process" in t:
        lines.append(f"target worst case under hog, thread / process >= {TARGET_WORST_RATIO:g}x: "
                     f"{t['hog_worst_ratio_thread_over_process']:g}x, "
                     f"{'met' if t['hog_worst_ratio_met'] else 'NOT met'}")
    return "\n".join(lines)

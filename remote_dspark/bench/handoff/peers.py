"""What a hand-off row runs against, for the CPU rows (:mod:`.run`) and the CUDA rows
(:mod:`.cuda`) alike: the peer that answers it (another interpreter,
:class:`Peer`, always reaped by :func:`reap`; or a thread of this one,
:class:`PeerThread`), the CPUs each side runs on (:class:`Pinning`), the GIL hog, and
the loop that runs a set of rows under them (:func:`run_rows`).

Every peer answers exactly warm-up + N rounds and exits; every process this starts is
ended before the row returns.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ... import native
from .types import ROUND_TIMEOUT_S, HandoffOptions, HandoffRow

PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
PEER_MODE = {"process": "loop", "c_peer": "c", "pipe": "pipe", "pyflag": "pyflag"}


@dataclass(frozen=True)
class Pinning:
    """Which CPUs the peer and the engine run on. The peer spins (ASYNC_NAP_US=0), so it
    is given a core of its own, as a deployment gives the proxy one; without that, on a
    small machine the spinning peer, the engine thread and a GIL hog share fewer cores
    than they need and the scheduler's time slices (milliseconds) show up as latency."""

    peer: frozenset[int] | None  # None: not pinned
    engine: frozenset[int] | None

    @classmethod
    def plan(cls, pin: bool, interrupts: str = "/proc/interrupts") -> Pinning:
        """For the peer, the CPU that has served the fewest device interrupts (the last
        of those): an interrupt in the middle of a hand-off makes the stream miss its
        poll of ``released`` (docs/benchmarks.md, "The tail on the H200"). The others for the engine, less the peer's
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


def run_rows(opts: HandoffOptions, pins: Pinning, modes, runners, label: str) -> list[HandoffRow]:
    """Every row of ``modes`` (run by ``runners[mode]``), each without and then with the
    hog, with the engine's threads kept off the peer's CPU (the hog must never share it)."""
    from ...progress import Progress

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


class Peer:
    """The answering interpreter of one row, given ``fd`` and nothing else. Ended on exit:
    waited for (it answers exactly ``total`` rounds), killed if it outstays that."""

    _proc: subprocess.Popen | None = None

    def __init__(self, mode: str, fd: int, total: int, opts: HandoffOptions, pins: Pinning, lib):
        self._cpus = pins.peer
        env = dict(os.environ)
        env[native.ENV_LIB] = lib.path  # the engine's build, no rebuild
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
        self._cmd = [
            sys.executable,
            "-m",
            "remote_dspark.bench.handoff.peer",
            PEER_MODE[mode],
            "--fd",
            str(fd),
            "--rounds",
            str(total),
            "--spin-us",
            str(opts.spin_us),
            "--nap-us",
            str(opts.nap_us),
            "--timeout-s",
            str(ROUND_TIMEOUT_S),
            "--parent",
            str(os.getpid()),
        ]
        self._fd, self._env = fd, env

    def __enter__(self) -> Peer:
        self._proc = subprocess.Popen(self._cmd, pass_fds=(self._fd,), env=self._env, stderr=subprocess.PIPE, text=True)
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

    def __enter__(self) -> PeerThread:
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

    def __enter__(self) -> GilHog:
        if self._on:
            self._running = True
            self._thread = threading.Thread(target=self._spin, name="gil-hog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join()

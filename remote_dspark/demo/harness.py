"""A simulated engine on torch CPU over :class:`RemoteDSpark`, and the reference worker
as a child process: what the demo, the chaos command and the benchmarks drive.

:class:`DemoEngine` turns :class:`~remote_dspark.sim.SimEngine`'s slots into batches
(rows are a real engine tensor), runs ``RemoteDSpark.round``, verifies the drafts
against the target, reports accepted tokens per position and re-announces the slots the
drafter lost. :class:`WorkerProcess` runs ``remote-dspark worker`` on loopback so it can
be killed, restarted, slowed down and made to send garbage. :func:`engine_env` is the
environment of an engine against such a loopback worker, for the demo, the benchmarks and
the tests alike.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

import torch

from ..engine import Batch, Drafts, Mode, RemoteDSpark
from ..outcome import Outcome
from .sim import SimEngine


@dataclass
class StepRecord:
    seconds: float
    outcome: Outcome
    accepted: int


@dataclass
class DemoEngine:
    rd: RemoteDSpark
    sim: SimEngine
    steps: list[StepRecord] = field(default_factory=list)

    def __post_init__(self):
        n = self.sim.n_slots
        elems = max(1, self.rd.row_bytes // 4)
        # The engine tensor whose rows are gathered each round (hidden states, say).
        self.hidden = torch.randn(n, elems, dtype=torch.float32)
        self.row_index = torch.arange(n, dtype=torch.int64)

    def batch(self) -> Batch:
        """This round's batch as an engine builds it: tensors over the slots' arrays."""
        a = self.sim.arrays()
        return Batch(
            slots=torch.from_numpy(a.slots),
            tokens=torch.from_numpy(a.tokens),
            token_offsets=torch.from_numpy(a.offsets),
            positions=torch.from_numpy(a.positions),
            new_gen=torch.from_numpy(a.new_gen),
            rows=self.hidden,
            row_index=self.row_index,
        )

    def step(self) -> Drafts:
        batch = self.batch()
        t0 = time.monotonic()
        out = self.rd.round(batch)
        seconds = time.monotonic() - t0
        # Sent whatever the outcome: a slot the drafter did not see comes back RESYNC.
        self.sim.mark_sent()
        if out.resync_all:
            self.sim.reannounce()
        elif out.resync:
            self.sim.reannounce(out.resync)
        before_acc, before_off = self.sim.accepted_at.copy(), self.sim.offered_at.copy()
        accepted = self.sim.verify(out.tokens.numpy(), out.counts.numpy())
        self.rd.record_accepted(
            (self.sim.accepted_at - before_acc).tolist(), (self.sim.offered_at - before_off).tolist()
        )
        self.steps.append(StepRecord(seconds, out.outcome, accepted))
        return out


START_TIMEOUT_S = 30.0


def engine_env(
    port: int,
    identity: str,
    markov_identity: str,
    mode: Mode | None = None,
    *,
    stats_file: str = "",
    **variables: str,
) -> dict[str, str]:
    """The environment of an engine against a worker on 127.0.0.1:``port`` whose drafter
    has ``identity`` and ``markov_identity`` (hex): this process's environment, then the
    capacity policy, no periodic log line, the stats file ``stats_file`` (blank: the
    contract's default path), ``mode``'s switches (None: whatever the environment says),
    and last ``variables`` (full names), which win over all of it."""
    env = dict(os.environ)
    env.update(
        VLLM_DSPARK_REMOTE=f"tcp://127.0.0.1:{port}",
        VLLM_DSPARK_REMOTE_IDENTITY=identity,
        VLLM_DSPARK_REMOTE_MARKOV_IDENTITY=markov_identity,
        VLLM_DSPARK_REMOTE_POLICY="capacity",
        VLLM_DSPARK_REMOTE_LOG_EVERY="0",
        VLLM_DSPARK_REMOTE_STATS_FILE=stats_file,
    )
    if mode is not None:
        env.update(mode.variables())
    env.update(variables)
    return env


def worker_limits(max_slots: int, row_bytes: int) -> tuple[str, ...]:
    """``remote-dspark worker`` arguments that let an engine of ``max_slots`` slots and
    ``row_bytes`` rows in (the worker's own limits, at least their defaults)."""
    from ..worker.limits import DEFAULT_MAX_ROW_BYTES, DEFAULT_MAX_SLOTS

    return (
        "--max-slots",
        str(max(max_slots, DEFAULT_MAX_SLOTS)),
        "--max-row-bytes",
        str(max(row_bytes, DEFAULT_MAX_ROW_BYTES)),
    )


class WorkerProcess:
    """``remote-dspark worker --chaos`` on ``host`` (a loopback address, 127.0.0.1 unless
    told; ``chaos=False``: the worker its ``extra`` arguments make), as a child process
    that ends with this one: :meth:`stop` (or the context's exit) ends it, and should
    this process end without it (SIGKILL), the worker's ``--parent`` watch stops it
    within a quarter of a second.

    Raises (at start): RuntimeError with the worker's stderr when it does not come up.
    """

    def __init__(
        self,
        port: int = 0,
        *,
        late_ms: int = 200,
        extra: tuple[str, ...] = (),
        chaos: bool = True,
        host: str = "127.0.0.1",
    ):
        self.host = host
        self.port = port
        self.late_ms = late_ms
        self.chaos = chaos
        self.extra = extra
        self.proc: subprocess.Popen | None = None
        self.identity = ""
        self.markov_identity = ""
        self.metrics_url = ""  # its /metrics, when ``extra`` asks for them (--metrics-port)
        self._lock = threading.RLock()  # a signal never reaches a worker that is starting
        # The stats files of the engines pointed at this worker: never the contract's
        # shared default path. Removed when this object goes (its finalizer), not at
        # stop(): an engine may still close, and write its last stats, after the worker.
        self._files = tempfile.TemporaryDirectory(prefix="remote-dspark-worker-")
        self.start()

    def start(self) -> None:
        # The worker's log goes to a file, never a pipe nobody reads (a full pipe would
        # block it); its tail explains a failed start.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "remote_dspark",
                "worker",
                "--listen",
                f"{self.host}:{self.port}",
                *(("--chaos", "--late-ms", str(self.late_ms)) if self.chaos else ()),
                "--parent",  # it stops when this process is gone, however it ended
                str(os.getpid()),
                *self.extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self.log,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        first = self._line()
        if not first.startswith("remote-dspark worker listening on tcp://"):
            self.log.seek(0)
            why = self.log.read()[-2000:]
            self.stop()
            raise RuntimeError(f"the worker did not start: {why}")
        self.port = int(first.rsplit(":", 1)[1])
        # The identities follow the first line at once (printed together).
        self.identity = self.proc.stdout.readline().strip().split("=", 1)[1]
        self.markov_identity = self.proc.stdout.readline().strip().split("=", 1)[1]
        if "--metrics-port" in self.extra:  # its metrics address follows at once
            self.metrics_url = self.proc.stdout.readline().split("metrics on ", 1)[1].split()[0]
        # stdout stays open until the worker is gone: a line it prints later (its metrics
        # address) then waits in the pipe instead of failing the worker with EPIPE.

    def _line(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """The worker's first line of stdout, or "" if none comes in time."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline() if ready else ""

    def env(self, mode: Mode | None = None, *, stats_file: str | None = None, **variables: str) -> dict[str, str]:
        """An engine environment pointing at this worker (see :func:`engine_env`); the
        stats file is ``stats_file``, else one in a directory of this object's own."""
        stats_file = os.path.join(self._files.name, "stats.json") if stats_file is None else stats_file
        return engine_env(self.port, self.identity, self.markov_identity, mode, stats_file=stats_file, **variables)

    def signal(self, sig: int) -> None:
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(sig)

    def answer_late(self) -> None:
        """Toggle answering every round ``late_ms`` late."""
        self.signal(signal.SIGUSR1)

    def garble_next(self) -> None:
        self.signal(signal.SIGUSR2)

    def restart(self) -> None:
        """Kill it (SIGKILL, no BYE) and start a new one on the same port."""
        with self._lock:
            self.kill()
            self.start()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self._closed()

    def _closed(self) -> None:
        """Its pipe and log closed, once it is gone."""
        self.proc.stdout.close()
        self.log.close()

    def stop(self) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._closed()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

"""``remote-dspark bench round``: one drafting round, end to end, next to its floors.

For a round of S entries (``--slots``), k drafts each (``--num-spec``) and ``--row-bytes``
bytes of engine row per entry, each row times N rounds (``--rounds``, after ``--warmup``
unmeasured ones) in one run, so the figures sit side by side:

``floor``    the raw transport floor: the byte counts of a steady-state ROUND and of its
             DRAFTS ping-ponged over ONE loopback TCP connection (127.0.0.1,
             TCP_NODELAY both ends) between this process and a stdlib-only child that
             reads exactly the ROUND's bytes and writes back the DRAFTS' bytes.
             ROUND = ``wire.HEADER.size + wire.round_sections(S, 3 S, row_bytes).size``
             (a steady round carries 3 tokens per entry: 2 accepted drafts + the
             target's own token), DRAFTS = ``wire.HEADER.size + wire.drafts_sections(S,
             k, margins=False).size``. Timed from the first byte sent to the last byte
             received. Nothing is encoded, decoded or drafted: what no round can beat.
``sync``     ``RemoteDSpark.round(batch)``, policy capacity, ``ASYNC=0``: the engine
             thread does the network round itself.
``thread``   the same with ``ASYNC=1, ASYNC_PROXY=thread``: the proxy is a thread of
             the engine process, the hand-off goes through the shared region.
``process``  the same with ``ASYNC=1, ASYNC_PROXY=process``: the supervised torch-free
             proxy process (the production path).
``draft``    the worker's drafting alone: ``MarkovDrafter(builtin_model()).draft_batch``
             on S contexts of 64 tokens of the synthetic language (what the worker's
             drafter sees in steady state), k drafts each, no margins.
``launch``   (``--device cuda`` only) ``RemoteDSpark.launch(batch)`` in process mode with
             the rows on the GPU: p50/p99 are the time from the launch's start until the
             stream holds the drafts (CUDA events recorded around ``launch()`` on an idle
             stream), ``engine_cpu_ms`` the engine thread's CPU inside ``launch()``.

The three engine rows drive the reference worker (``remote-dspark worker``, built-in
Markov drafter) on loopback, one worker for the whole run, and a new ``RemoteDSpark`` per
row (``start()`` ... ``close()``), with ``TIMEOUT_MS`` = ``--timeout-ms`` (default 1000,
so a 4096-entry round is never a timeout). A round whose ``Drafts.outcome`` is not "ok"
is counted in the row's ``not_ok`` (its time is still in the figures); the table flags it.

Batches are built the way an engine builds them, by :class:`Feeder`, outside the timed
region: per-slot state in a few arrays (position, NEW_GEN mask), the round's tokens as
one flat array with offsets. The first round announces every slot (NEW_GEN, a 16-token
prompt of synthetic-language text); every later round carries 3 tokens per slot from
where the slot stands; a slot named in ``Drafts.resync`` (every slot on ``resync_all``)
starts over with NEW_GEN on the next round. The first round is always a warm-up round
(``--warmup`` >= 1), so the figures are steady-state rounds.

``engine_cpu_ms`` is the median, over the measured rounds, of the engine thread's CPU
per round (``time.thread_time()`` around ``round()``). For thread and process the wait
for the round's release spins by design, so its own CPU (``rd.wait_cpu_s``, cumulative,
kept by the engine) is taken out: what remains is the CPU the round costs the engine.
For sync it is reported as is (its wait is a blocking receive).

Every row has p50 and p99 in ms, ``x_floor`` (p50 over the floor's p50 at the same slot
count) and, for thread / process / launch, ``x_sync``. Without ``--slots`` the run
sweeps 64, 256, 1024 and 4096 slots so the growth shows; above 256 slots a row measures
fewer rounds (N x 256 / S, at least 50: the ``rounds`` column) to stay near a minute on 2
cores. The goals (met / NOT met; never asserted): at 256 slots process p50 <= 3x floor
and <= 1.2x sync, process engine CPU <= 0.3 ms, draft <= 0.1 ms, and the per-slot cost
of process and draft at 4096 slots within 2x of theirs at 256.

Progress goes to stderr; ``--json`` prints one JSON object, and nothing else, on stdout.
Every child process this starts (floor peer, worker, proxy) is ended before the run
returns, whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from .handoff_peers import reap

MODES = ("floor", "sync", "thread", "process", "draft")
CUDA_MODES = MODES + ("launch",)
ENGINE_MODES = ("sync", "thread", "process")
DESCRIBE = {
    "floor": "TCP ping-pong (floor)",
    "sync": "round(), ASYNC=0",
    "thread": "round(), proxy thread",
    "process": "round(), proxy process",
    "draft": "draft_batch() alone",
    "launch": "launch(), CUDA, process",
}
SWEEP = (64, 256, 1024, 4096)
DEFAULT_SLOTS = 256            # with --no-sweep
PROMPT_TOKENS = 16             # a NEW_GEN entry's context
STEP_TOKENS = 3                # a steady entry: 2 accepted drafts + the target's token
CONTEXT_TOKENS = 64            # the draft row's context per entry
TEXT_TOKENS = 1 << 14          # synthetic-language text the feeder reads from (wraps)
MIN_ROUNDS = 50                # the fewest measured rounds of a row above 256 slots
DRAFT_BATCHES = 8              # the draft row rotates through this many different batches
ROUND_TIMEOUT_S = 30.0         # the floor: no round takes this long unless a side is gone
START_TIMEOUT_S = 10.0         # the floor peer connects within this
TIMEOUT_MS = 1000

# The goals, checked at GOAL_SLOTS (and LINEAR_AT against GOAL_SLOTS).
GOAL_SLOTS = 256
LINEAR_AT = 4096
GOAL_X_FLOOR = 3.0
GOAL_X_SYNC = 1.2
GOAL_ENGINE_CPU_MS = 0.3
GOAL_DRAFT_MS = 0.1
GOAL_LINEAR = 2.0


def add_parser(sub) -> None:
    p = sub.add_parser("round", help="one drafting round end to end (sync / thread / process) "
                                     "next to the TCP floor and the drafter alone",
                       description=__doc__.split("\n\n")[0] + " Rows: floor, sync, thread, process, "
                       "draft (and launch with --device cuda); see the module docstring.")
    p.add_argument("--slots", default=None, metavar="S[,S...]",
                   help="entries per round, 1..4096 (the wire's cap), or a comma-separated list. "
                        f"Default: a sweep over {', '.join(map(str, SWEEP))} (see --sweep)")
    p.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=None,
                   help="--sweep: the rows at 64, 256, 1024 and 4096 slots (the default when "
                        f"--slots is not given); --no-sweep: {DEFAULT_SLOTS} slots only")
    p.add_argument("--num-spec", type=int, default=5, help="k: drafts per entry (default 5)")
    p.add_argument("--row-bytes", type=int, default=1024,
                   help="bytes of engine row per entry, sent with the round (default 1024)")
    p.add_argument("--rounds", type=int, default=500,
                   help="measured rounds per row (default 500); above 256 slots a row measures "
                        f"N x 256 / slots of them, at least {MIN_ROUNDS}")
    p.add_argument("--warmup", type=int, default=10,
                   help="unmeasured rounds first, >= 1: the first round announces every slot "
                        "(default 10)")
    p.add_argument("--modes", default=None, metavar="MODE[,MODE...]",
                   help=f"rows to run, comma-separated, from {', '.join(CUDA_MODES)} (default: "
                        f"{','.join(MODES)}, plus launch with --device cuda)")
    p.add_argument("--timeout-ms", type=int, default=TIMEOUT_MS,
                   help=f"the engine rows' VLLM_DSPARK_REMOTE_TIMEOUT_MS (default {TIMEOUT_MS}: "
                        "generous, so large rounds are not timeouts)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default); cuda: also the launch row, rows on the GPU")
    p.add_argument("--device-metadata", action="store_true",
                   help="with --device cuda: the batch's metadata tensors (slots, tokens, offsets, "
                        "positions, new_gen) on the GPU too (default: on the host; row_index is always where the rows are)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (and nothing else) on stdout; progress stays on stderr")
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Options:
    slots: tuple[int, ...]
    num_spec: int
    row_bytes: int
    rounds: int
    warmup: int
    modes: tuple[str, ...]
    timeout_ms: int
    device: str
    device_metadata: bool

    def rounds_for(self, slots: int) -> int:
        """Measured rounds of a row at ``slots``: all of them up to GOAL_SLOTS, fewer above."""
        if slots <= GOAL_SLOTS:
            return self.rounds
        return min(self.rounds, max(MIN_ROUNDS, self.rounds * GOAL_SLOTS // slots))


def _ints(raw: str, name: str) -> list[int]:
    try:
        return [int(x) for x in raw.split(",")]
    except ValueError:
        raise ValueError(f"{name} {raw!r}: expected an integer or comma-separated integers") from None


def options(args) -> Options:
    """The run's options from the parsed arguments.

    Raises: ValueError naming the bad argument and the rule it breaks.
    """
    from .. import wire
    if args.slots is not None and args.sweep:
        raise ValueError(f"--slots {args.slots} with --sweep: give one or the other")
    if args.slots is not None:
        slots = _ints(args.slots, "--slots")
    else:
        slots = list(SWEEP) if args.sweep in (None, True) else [DEFAULT_SLOTS]
    for s in slots:
        if not 1 <= s <= wire.MAX_ENTRIES:
            raise ValueError(f"--slots {s}: must be in 1..{wire.MAX_ENTRIES} (the wire's cap on "
                             "entries per round)")
    if len(set(slots)) != len(slots):
        raise ValueError(f"--slots {args.slots}: a slot count appears twice")
    if not 1 <= args.num_spec <= wire.MAX_N_OUT:
        raise ValueError(f"--num-spec {args.num_spec}: must be in 1..{wire.MAX_N_OUT} (the wire's cap)")
    if not 1 <= args.row_bytes <= wire.MAX_ROW_BYTES:
        raise ValueError(f"--row-bytes {args.row_bytes}: must be in 1..{wire.MAX_ROW_BYTES} (the wire's cap)")
    for s in slots:
        size = wire.round_sections(s, s * PROMPT_TOKENS, args.row_bytes).size
        if size > wire.MAX_PAYLOAD:
            raise ValueError(f"--row-bytes {args.row_bytes} at {s} slots: a ROUND of {size} bytes is over "
                             f"the wire's {wire.MAX_PAYLOAD}-byte cap")
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: must be >= 1")
    if args.warmup < 1:
        raise ValueError(f"--warmup {args.warmup}: must be >= 1 (the first round announces every "
                         "slot: never a steady-state figure)")
    if args.timeout_ms < 1:
        raise ValueError(f"--timeout-ms {args.timeout_ms}: must be >= 1")
    if args.device_metadata and args.device != "cuda":
        raise ValueError("--device-metadata: only with --device cuda")
    allowed = CUDA_MODES if args.device == "cuda" else MODES
    if args.modes is None:
        modes = list(allowed)
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        for m in modes:
            if m == "launch" and args.device != "cuda":
                raise ValueError("--modes launch: only with --device cuda")
            if m not in allowed:
                raise ValueError(f"--modes {args.modes!r}: unknown mode {m!r}; choose from "
                                 f"{', '.join(allowed)}")
        if not modes:
            raise ValueError(f"--modes {args.modes!r}: no mode named")
    modes = [m for m in CUDA_MODES if m in modes]   # table order, each once
    return Options(tuple(slots), args.num_spec, args.row_bytes, args.rounds, args.warmup, tuple(modes),
                   args.timeout_ms, args.device, args.device_metadata)


# --------------------------------------------------------------------------- figures


@dataclass
class Row:
    mode: str
    slots: int
    rounds: int
    lat_ns: list[int]
    cpu_ns: list[int] | None = None     # engine thread CPU per round (engine rows, launch)
    not_ok: int | None = None           # engine rows: measured rounds whose outcome is not "ok"
    outcomes: dict | None = None        # engine rows: measured rounds by outcome
    extra: dict | None = None           # floor: byte counts; launch: CPU inside launch()


def pct(values: list[int], q: float) -> float:
    """The q-quantile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def _ms(ns: float) -> float:
    return round(ns / 1e6, 4)


def round_bytes(slots: int, row_bytes: int) -> int:
    """A steady-state ROUND frame's bytes: header, sections, STEP_TOKENS tokens per entry."""
    from .. import wire
    return wire.HEADER.size + wire.round_sections(slots, STEP_TOKENS * slots, row_bytes).size


def drafts_bytes(slots: int, num_spec: int) -> int:
    """A DRAFTS frame's bytes for ``slots`` entries of ``num_spec`` drafts, no margins."""
    from .. import wire
    return wire.HEADER.size + wire.drafts_sections(slots, num_spec, margins=False).size


# --------------------------------------------------------------------------- the floor

# The floor's peer: stdlib only, started as ``python -c FLOOR_PEER PORT IN OUT COUNT``.
# It connects to the bench, then COUNT times reads exactly IN bytes and writes OUT bytes.
FLOOR_PEER = r"""
import socket, sys
port, n_in, n_out, count, timeout_s = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = memoryview(bytearray(n_in))
out = bytes(n_out)
for r in range(count):
    got = 0
    while got < n_in:
        k = s.recv_into(buf[got:], n_in - got)
        if not k:
            sys.exit(f"floor peer: the bench closed the connection at round {r} of {count}")
        got += k
    s.sendall(out)
s.close()
"""


class FloorPeer:
    """The floor's answering process and its one connection (``conn``), ended on exit:
    waited for (it answers exactly ``count`` rounds), killed if it outstays that."""

    def __init__(self, n_in: int, n_out: int, count: int):
        self.args = (n_in, n_out, count)
        self.proc: subprocess.Popen | None = None
        self.conn: socket.socket | None = None

    def __enter__(self) -> "FloorPeer":
        n_in, n_out, count = self.args
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lsock.bind(("127.0.0.1", 0))
            lsock.listen(1)
            lsock.settimeout(START_TIMEOUT_S)
            self.proc = subprocess.Popen(
                [sys.executable, "-c", FLOOR_PEER, str(lsock.getsockname()[1]), str(n_in), str(n_out),
                 str(count), str(ROUND_TIMEOUT_S)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                conn, _ = lsock.accept()
            except socket.timeout:
                raise RuntimeError(f"the floor peer did not connect within {START_TIMEOUT_S:g} s: "
                                   f"{self._end(0.0)}") from None
            conn.settimeout(ROUND_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conn = conn
        except BaseException:
            self._end(0.0)
            raise
        finally:
            lsock.close()
        return self

    def _end(self, wait_s: float) -> str:
        """Close the connection, wait for the peer up to ``wait_s``, kill it if still
        there; its stderr (why it stopped, when it failed)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        proc, self.proc = self.proc, None
        if proc is None:
            return ""
        _, err = reap(proc, wait_s)
        return f"exit {proc.returncode}: {err.strip()}" if proc.returncode else ""

    def __exit__(self, exc_type, *_) -> None:
        why = self._end(ROUND_TIMEOUT_S if exc_type is None else 0.5)
        if exc_type is None and why:
            raise RuntimeError(f"floor peer {why}")


def _recv_exactly(conn: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            raise RuntimeError(f"floor: the peer closed the connection ({got} of {n} bytes)")
        got += k


def floor_row(opts: Options, slots: int) -> Row:
    n_in, n_out = round_bytes(slots, opts.row_bytes), drafts_bytes(slots, opts.num_spec)
    rounds = opts.rounds_for(slots)
    out = bytes(n_in)
    back = memoryview(bytearray(n_out))
    lat = []
    with FloorPeer(n_in, n_out, opts.warmup + rounds) as peer:
        conn = peer.conn
        for i in range(opts.warmup + rounds):
            t0 = time.perf_counter_ns()
            conn.sendall(out)
            _recv_exactly(conn, back)
            t1 = time.perf_counter_ns()
            if i >= opts.warmup:
                lat.append(t1 - t0)
    return Row("floor", slots, rounds, lat, extra={"round_bytes": n_in, "drafts_bytes": n_out})


# --------------------------------------------------------------------------- batches


class Feeder:
    """Builds each round's ``Batch`` the way an engine does, from per-slot arrays.

    State per slot: ``position`` (tokens the drafter has of the slot's context),
    ``offset`` (where the slot reads the synthetic text: every slot its own stretch) and
    the ``new_gen`` mask. :meth:`next_batch` builds the round from them, vectorized;
    :meth:`after` takes the round's ``Drafts`` (or ``Launched``): every slot advances by
    what it sent, and the slots the drafter lost are NEW_GEN next round (a fresh
    16-token prompt at a new stretch of text: the context is synthetic anyway).
    """

    def __init__(self, slots: int, row_bytes: int, *, device: str = "cpu", metadata_device: str = "cpu",
                 seed: int = 1):
        import numpy as np
        import torch

        from ..markov import splitmix64
        self.n = slots
        self.text = np.asarray(_text(seed), dtype=np.int32)
        self.rng = np.random.default_rng(splitmix64(seed) & 0xFFFFFFFF)
        self.offset = self.rng.integers(0, len(self.text), slots, dtype=np.int64)
        self.position = np.zeros(slots, dtype=np.int64)
        self.new_gen = np.ones(slots, dtype=bool)
        self._sent = np.zeros(slots, dtype=np.int64)
        self.meta_device = metadata_device
        # The engine tensor whose rows go with the round (hidden states, say): uint8 rows
        # of row_bytes, one per slot, on the engine's device.
        gen = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, 256, (slots, row_bytes), dtype=torch.uint8, generator=gen).to(device)
        self.slot_ids = torch.arange(slots, dtype=torch.int32).to(metadata_device)
        # Where the rows are, as an engine's gather index is (from its query_start_loc).
        self.row_index = torch.arange(slots, dtype=torch.int64).to(device)

    def next_batch(self):
        """This round's batch: NEW_GEN slots with their prompt from position 0, the others
        with STEP_TOKENS tokens from their position."""
        import numpy as np
        import torch

        from ..engine import Batch
        ng = self.new_gen
        start = np.where(ng, 0, self.position)
        count = np.where(ng, PROMPT_TOKENS, STEP_TOKENS)
        offsets = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(count, out=offsets[1:])
        within = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], count)
        at = np.repeat(self.offset + start, count) + within
        tokens = self.text[at % len(self.text)]
        self._sent = start + count
        dev, t = self.meta_device, torch.from_numpy
        return Batch(slots=self.slot_ids, tokens=t(tokens).to(dev), token_offsets=t(offsets).to(dev),
                     positions=t(start.astype(np.int32)).to(dev), new_gen=t(ng.copy()).to(dev),
                     rows=self.rows, row_index=self.row_index, n_out=None)

    def after(self, out) -> None:
        """The round was sent (whatever its outcome): advance; re-announce lost slots."""
        import numpy as np
        self.position = self._sent
        self.new_gen = np.zeros(self.n, dtype=bool)
        lost = np.asarray(out.resync, dtype=np.int64)
        if out.resync_all:
            lost = np.arange(self.n)
        if len(lost):
            self.new_gen[lost] = True
            self.offset[lost] = self.rng.integers(0, len(self.text), len(lost))


def _text(seed: int) -> list[int]:
    from ..markov import SyntheticLanguage
    return SyntheticLanguage().text(TEXT_TOKENS, seed=seed)


# --------------------------------------------------------------------------- engine rows


def engine_env(worker, mode: str, timeout_ms: int, stats_dir: str) -> dict[str, str]:
    """The engine environment of an engine row against ``worker`` (a WorkerProcess)."""
    env = {"VLLM_DSPARK_REMOTE_POLICY": "capacity", "VLLM_DSPARK_REMOTE_TIMEOUT_MS": str(timeout_ms),
           "VLLM_DSPARK_REMOTE_LOG_EVERY": "0",
           "VLLM_DSPARK_REMOTE_STATS_FILE": os.path.join(stats_dir, f"stats-{mode}.json"),
           "VLLM_DSPARK_REMOTE_ASYNC": "0" if mode == "sync" else "1"}
    if mode != "sync":
        env["VLLM_DSPARK_REMOTE_ASYNC_PROXY"] = mode
    return worker.env(**env)


@contextlib.contextmanager
def engine(worker, opts: Options, mode: str, slots: int, stats_dir: str, device: str = "cpu"):
    """A started ``RemoteDSpark`` for one row (``mode``: sync, thread or process), closed on exit."""
    from ..config import RemoteConfig
    from ..engine import RemoteDSpark
    env = engine_env(worker, mode, opts.timeout_ms, stats_dir)
    rd = RemoteDSpark(RemoteConfig.from_env(env), num_spec=opts.num_spec, max_slots=slots,
                      row_bytes=opts.row_bytes, device=device, environ=env)
    try:
        rd.start()
        if rd.mode != mode:
            raise RuntimeError(f"{mode}: the engine runs {rd.mode} rounds (its async hand-off failed "
                               "its self-test; see the log)")
        yield rd
    finally:
        rd.close()


def engine_row(worker, opts: Options, mode: str, slots: int, stats_dir: str) -> Row:
    """``rd.round(batch)`` rounds: wall time, the engine thread's CPU outside the wait."""
    from collections import Counter
    rounds = opts.rounds_for(slots)
    feeder = Feeder(slots, opts.row_bytes)
    lat, cpu, outcomes = [], [], Counter()
    spins = mode != "sync"   # async rounds wait spinning: their wait's CPU is taken out
    with engine(worker, opts, mode, slots, stats_dir) as rd:
        for i in range(opts.warmup + rounds):
            batch = feeder.next_batch()
            w0 = rd.wait_cpu_s if spins else 0.0
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            out = rd.round(batch)
            t1 = time.perf_counter_ns()
            c1 = time.thread_time_ns()
            w1 = rd.wait_cpu_s if spins else 0.0
            feeder.after(out)
            if i >= opts.warmup:
                lat.append(t1 - t0)
                cpu.append(max(0, (c1 - c0) - round((w1 - w0) * 1e9)))
                outcomes[out.outcome] += 1
    not_ok = rounds - outcomes["ok"]
    return Row(mode, slots, rounds, lat, cpu, not_ok, dict(outcomes))


def launch_row(worker, opts: Options, slots: int, stats_dir: str) -> Row:
    """``rd.launch(batch)`` on CUDA, process mode: the time until the stream holds the
    drafts (CUDA events around ``launch()``, recorded on an idle stream) and the CPU inside
    ``launch()``. The stream is synchronized after every round, outside the figures."""
    import torch
    rounds = opts.rounds_for(slots)
    feeder = Feeder(slots, opts.row_bytes, device="cuda",
                    metadata_device="cuda" if opts.device_metadata else "cpu")
    stream = torch.cuda.current_stream()
    pairs, cpu, wall = [], [], []
    with engine(worker, opts, "process", slots, stats_dir, device="cuda") as rd:
        for i in range(opts.warmup + rounds):
            batch = feeder.next_batch()
            stream.synchronize()
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter_ns()
            c0 = time.thread_time_ns()
            ev0.record(stream)
            launched = rd.launch(batch)
            ev1.record(stream)
            c1 = time.thread_time_ns()
            t1 = time.perf_counter_ns()
            stream.synchronize()
            feeder.after(launched)
            if i >= opts.warmup:
                pairs.append((ev0, ev1))
                cpu.append(c1 - c0)
                wall.append(t1 - t0)
        outcomes = dict(rd.stats()["rounds"])   # launched rounds are counted once collected
    lat = [int(a.elapsed_time(b) * 1e6) for a, b in pairs]
    total = outcomes.pop("total", 0)
    not_ok = total - outcomes.get("ok", 0)
    return Row("launch", slots, rounds, lat, cpu, not_ok, {k: v for k, v in outcomes.items() if v},
               extra={"launch_wall_p50_ms": _ms(pct(wall, 0.5)), "launch_wall_p99_ms": _ms(pct(wall, 0.99)),
                      "launch_cpu_p99_ms": _ms(pct(cpu, 0.99)),
                      "outcomes_over": "every launched round, warm-up included"})


# --------------------------------------------------------------------------- the drafter


def draft_row(opts: Options, slots: int) -> Row:
    """``MarkovDrafter(builtin_model()).draft_batch`` on ``slots`` contexts of 64 tokens,
    rotating through DRAFT_BATCHES batches of different contexts."""
    import numpy as np

    from ..drafter import DraftBatch, MarkovDrafter
    from ..markov import builtin_model
    drafter = MarkovDrafter(builtin_model())
    text = np.asarray(_text(2), dtype=np.int32)
    rng = np.random.default_rng(2)
    k, n = opts.num_spec, slots
    offsets = np.arange(0, (n + 1) * CONTEXT_TOKENS, CONTEXT_TOKENS, dtype=np.int64)
    rows = np.zeros((n, opts.row_bytes), dtype=np.uint8)
    n_out = np.full(n, k, dtype=np.int32)
    batches = []
    for _ in range(DRAFT_BATCHES):
        start = rng.integers(0, len(text), n, dtype=np.int64)
        at = (start[:, None] + np.arange(CONTEXT_TOKENS, dtype=np.int64)[None, :]).ravel() % len(text)
        batches.append(DraftBatch(tokens=np.ascontiguousarray(text[at]), offsets=offsets, n_out=n_out,
                                  rows=rows, want_margin=False, width=k))
    rounds = opts.rounds_for(slots)
    lat = []
    for i in range(opts.warmup + rounds):
        b = batches[i % DRAFT_BATCHES]
        t0 = time.perf_counter_ns()
        drafter.draft_batch(b)
        t1 = time.perf_counter_ns()
        if i >= opts.warmup:
            lat.append(t1 - t0)
    return Row("draft", slots, rounds, lat)


# --------------------------------------------------------------------------- the run


def run(args) -> int:
    opts = options(args)   # every argument checked before anything starts
    if opts.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here")
    rows = run_all(opts)
    report = make_report(opts, rows)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


def run_all(opts: Options) -> list[Row]:
    """Every row of ``opts.modes`` at every slot count; every child ended before returning."""
    from ..progress import Progress
    plan = [(s, m) for s in opts.slots for m in opts.modes]
    rows: list[Row] = []
    bar = Progress(len(plan), "round rows")
    with contextlib.ExitStack() as stack:
        worker = None
        stats_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="remote-dspark-bench-round."))
        if any(m in ENGINE_MODES or m == "launch" for m in opts.modes):
            from ..harness import WorkerProcess
            worker = stack.enter_context(WorkerProcess())
        for i, (slots, mode) in enumerate(plan):
            bar.update(i, f"{mode} {slots} slots")
            if mode == "floor":
                rows.append(floor_row(opts, slots))
            elif mode == "draft":
                rows.append(draft_row(opts, slots))
            elif mode == "launch":
                rows.append(launch_row(worker, opts, slots, stats_dir))
            else:
                rows.append(engine_row(worker, opts, mode, slots, stats_dir))
        bar.update(len(plan))
    return rows


# --------------------------------------------------------------------------- report


def _threads() -> dict:
    import torch
    return {"torch_num_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "cpu_count": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0))}


def make_report(opts: Options, rows: list[Row]) -> dict:
    p50 = {(r.mode, r.slots): pct(r.lat_ns, 0.5) for r in rows}
    out_rows = []
    for r in rows:
        f, s = p50.get(("floor", r.slots)), p50.get(("sync", r.slots))
        mine = p50[(r.mode, r.slots)]
        d = {"mode": r.mode, "slots": r.slots, "rounds": r.rounds,
             "p50_ms": _ms(mine), "p99_ms": _ms(pct(r.lat_ns, 0.99)),
             "x_floor": None if f is None else round(mine / max(f, 1), 2),
             "x_sync": (round(mine / max(s, 1), 2) if s is not None and r.mode in ("thread", "process", "launch")
                        else None),
             "engine_cpu_ms": None if r.cpu_ns is None else _ms(pct(r.cpu_ns, 0.5)),
             "not_ok": r.not_ok}
        if r.cpu_ns is not None:
            d["engine_cpu_mean_ms"] = _ms(sum(r.cpu_ns) / len(r.cpu_ns))
        if r.outcomes is not None:
            d["outcomes"] = r.outcomes
        if r.extra:
            d.update(r.extra)
        out_rows.append(d)
    config = {"bench": "round", "slots": list(opts.slots), "num_spec": opts.num_spec, "row_bytes": opts.row_bytes,
              "rounds": opts.rounds, "rounds_by_slots": {str(s): opts.rounds_for(s) for s in opts.slots},
              "warmup": opts.warmup, "modes": list(opts.modes), "timeout_ms": opts.timeout_ms,
              "device": opts.device, "device_metadata": opts.device_metadata,
              "tokens_per_entry": STEP_TOKENS, "prompt_tokens": PROMPT_TOKENS, "draft_context_tokens": CONTEXT_TOKENS,
              **_threads()}
    return {"config": config, "rows": out_rows, "targets": targets(out_rows)}


def _goal(value: float | None, limit: float, what: str) -> dict:
    return {"what": what, "value": value, "limit": limit, "met": value is not None and value <= limit}


def targets(rows: list[dict]) -> dict:
    """The goals that this run's rows can say something about (the others are absent)."""
    by = {(r["mode"], r["slots"]): r for r in rows}
    g, out = GOAL_SLOTS, {}
    proc = by.get(("process", g))
    if proc is not None and proc["x_floor"] is not None:
        out["process_x_floor"] = _goal(proc["x_floor"], GOAL_X_FLOOR, f"process p50 / floor p50 at {g} slots")
    if proc is not None and proc["x_sync"] is not None:
        out["process_x_sync"] = _goal(proc["x_sync"], GOAL_X_SYNC, f"process p50 / sync p50 at {g} slots")
    if proc is not None:
        out["process_engine_cpu_ms"] = _goal(proc["engine_cpu_ms"], GOAL_ENGINE_CPU_MS,
                                             f"process engine CPU per round at {g} slots, ms")
    draft = by.get(("draft", g))
    if draft is not None:
        out["draft_ms"] = _goal(draft["p50_ms"], GOAL_DRAFT_MS, f"draft p50 at {g} slots, ms")
    for mode in ("process", "draft"):
        lo, hi = by.get((mode, g)), by.get((mode, LINEAR_AT))
        if lo is not None and hi is not None:
            ratio = (hi["p50_ms"] / LINEAR_AT) / max(lo["p50_ms"] / g, 1e-9)
            out[f"{mode}_linear"] = _goal(round(ratio, 2), GOAL_LINEAR,
                                          f"{mode} per-slot p50 at {LINEAR_AT} slots / at {g} slots")
    return out


def _f(v, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}{fmt}}"


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [
        f"drafting round, k={c['num_spec']}, row_bytes={c['row_bytes']}: {c['rounds']} rounds per row "
        f"(+{c['warmup']} warm-up; above {GOAL_SLOTS} slots fewer, the rounds column), ms; a steady round "
        f"carries {c['tokens_per_entry']} tokens per entry (2 accepted + 1 target), the first announces every "
        f"slot with a {c['prompt_tokens']}-token prompt (warm-up); TIMEOUT_MS={c['timeout_ms']}",
        f"engine: torch threads {c['torch_num_threads']}, OMP_NUM_THREADS={c['omp_num_threads'] or 'unset'}, "
        f"{c['cpu_count']} CPUs ({c['affinity_cpus']} usable); device {c['device']}"
        + (f", metadata on {'the GPU' if c['device_metadata'] else 'the host'}" if c["device"] == "cuda" else ""),
    ]
    head = (f"{'slots':>6}  {'mode':<25}{'rounds':>7}{'p50':>10}{'p99':>10}{'x floor':>9}{'x sync':>8}"
            f"{'engine cpu':>12}  not ok")
    lines += [head, "-" * len(head)]
    for r in report["rows"]:
        flag = "-" if r["not_ok"] is None else (
            "0" if not r["not_ok"] else
            f"{r['not_ok']} NOT OK: " + ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()) if k != "ok"))
        lines.append(f"{r['slots']:>6}  {DESCRIBE[r['mode']]:<25}{r['rounds']:>7}{r['p50_ms']:>10.3f}"
                     f"{r['p99_ms']:>10.3f}{_f(r['x_floor'], '.2f', 9)}{_f(r['x_sync'], '.2f', 8)}"
                     f"{_f(r['engine_cpu_ms'], '.3f', 12)}  {flag}")
    floors = [r for r in report["rows"] if r["mode"] == "floor"]
    if floors:
        lines.append("floor bytes: " + "; ".join(
            f"{r['slots']} slots ROUND {r['round_bytes']:,} + DRAFTS {r['drafts_bytes']:,}" for r in floors))
    for r in report["rows"]:
        if r["mode"] == "launch":
            lines.append(f"launch at {r['slots']} slots: CPU inside launch() p50 {r['engine_cpu_ms']:.3f} / p99 "
                         f"{r['launch_cpu_p99_ms']:.3f} ms, wall inside launch() p50 {r['launch_wall_p50_ms']:.3f} ms")
    for t in report["targets"].values():
        v = "not measured" if t["value"] is None else f"{t['value']:g}"
        lines.append(f"goal {t['what']} <= {t['limit']:g}: {v}, {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)

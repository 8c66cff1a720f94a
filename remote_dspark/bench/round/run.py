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
``mac``      (opt-in: only when ``--modes`` names it) a MAC on the round's DRAFTS, both
             ends: HMAC-SHA256 of a frame of the DRAFTS' size, tagged and checked
             (:mod:`.mac`); ``x_process`` is its share of the process round.
``launch``   (``--device cuda`` only) ``RemoteDSpark.launch(batch)`` in process mode with
             the rows on the GPU: p50/p99 are the time from the launch's start until the
             stream holds the drafts (CUDA events recorded around ``launch()`` on an idle
             stream), ``engine_cpu_ms`` the engine thread's CPU inside ``launch()``.

The three engine rows drive the reference worker (``remote-dspark worker``, built-in
Markov drafter) on loopback, one worker for the whole run, and a new ``RemoteDSpark`` per
row (``start()`` ... ``close()``), with ``TIMEOUT_MS`` = ``--timeout-ms`` (default 1000,
so a 4096-entry round is never a timeout). A round whose ``Drafts.outcome`` is not "ok"
is counted in the row's ``not_ok`` (its time is still in the figures); the table flags it.

Batches are built the way an engine builds them, outside the timed region, by
:class:`~remote_dspark.bench.round.feeder.Feeder` (its module says how); the first
round announces every slot and is always a warm-up round.

``engine_cpu_ms`` is the median, over the measured rounds, of the engine thread's CPU
per round (``time.thread_time()`` around ``round()``). For thread and process the wait
for the round's release spins (``ASYNC_SPIN_US``, then it sleeps), so its own CPU
(``rd.wait_cpu_s``, cumulative, kept by the engine) is taken out: what remains is the
CPU the round costs the engine.
For sync it is reported as is (its wait is a blocking receive).

``worker`` (engine and launch rows) is the worker's own time per measured round, from
its ``/metrics`` read before and after them (:mod:`.worker_time`): the mean time from a
ROUND in to its DRAFTS sent (the built-in Markov drafter's rounds are drafted while
their rows arrive, and that wait is not counted), of which ``worker_drafting_ms`` (JSON)
was the drafter's calls. What the round's end-to-end p50 adds to it is the engine, the
proxy and the transport.

``engine_cpu_per_wall`` (engine rows) is the engine process's CPU seconds (every
thread: in thread mode the proxy's too) per wall-second over the measured rounds, batch
building included. Against a worker that answers at once every row is busy all along;
with ``--worker-late-ms 15`` (the worker answers each round that late, as a remote
drafter on a GPU might) it is what waiting costs: a wait that spins burns a core, one
that sleeps after its ``ASYNC_SPIN_US`` almost nothing.

Every row has p50 and p99 in ms, ``x_floor`` (p50 over the floor's p50 at the same slot
count) and, for thread / process / launch, ``x_sync``. Without ``--slots`` the run
sweeps 64, 256, 1024 and 4096 slots so the growth shows; above 256 slots a row measures
fewer rounds (N x 256 / S, at least 50: the ``rounds`` column) to stay near a minute on 2
cores. The goals (met / NOT met; never asserted): at 256 slots process p50 <= 3x floor
and <= 1.2x sync, process engine CPU <= 0.3 ms, draft <= 0.1 ms, and the per-slot cost
of process and draft at 4096 slots within 2x of theirs at 256.

With ``--sampled`` every row has a sampled twin at the slot counts within the sampled
cap (1024): the engine rows with ``VLLM_DSPARK_SAMPLED_TOP32=1`` (every entry at
temperature 1 with its own seed; each drafted position comes back with its top-32
distribution, held to the rule by the proxy's C check or the sync path's), the floor
with a sampled ROUND's and DRAFTS' byte counts, the draft row drafting sampled. Each
sampled row's ``x_greedy`` is its p50 over its greedy twin's; the goal: at 256 slots a
sampled process round within 1.5x of the greedy one.

With ``--tp N`` the launch rows run on N tensor-parallel ranks, a row per rank
(:mod:`.tp`): each rank's CPU inside ``launch()`` and the time until its own stream holds
rank 0's drafts. NCCL (``--tp-backend nccl``, the default) needs a GPU per rank; gloo runs
the ranks on one GPU, its broadcast of the record waiting on the host; loopback runs
every rank's engine in this process on one stream (:mod:`.tp_loopback`).

With ``--drafter lm`` the worker serves the built-in model drafter (``remote_dspark.drafter.lm``,
on the GPU when it sees one, its per-slot KV cache on) and the ``draft`` row times that
drafter on whole contexts (no cache); the one goal is then the whole process round:
p50 <= 2 ms at 256 slots.

Progress goes to stderr; ``--json`` prints one JSON object, and nothing else, on stdout.
Every child process this starts (floor peer, worker, proxy) is ended before the run
returns, whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time

from . import worker_time
from .draft import draft_row
from .engines import engine, engine_env, launch_loop
from .feeder import Feeder
from .floor import floor_row
from .mac import mac_row
from .options import (
    DEFAULT_SLOTS,
    ENGINE_MODES,
    MIN_ROUNDS,
    MODES,
    ORDER,
    SWEEP,
    TIMEOUT_MS,
    RoundOptions,
    options,
)
from .report import RoundRow, format_table, make_report, ns_to_ms, pct


def add_parser(sub) -> None:
    p = sub.add_parser(
        "round",
        help="one drafting round end to end (sync / thread / process) next to the TCP floor and the drafter alone",
        description=__doc__.split("\n\n")[0] + " Rows: floor, sync, thread, process, "
        "draft (and launch with --device cuda); docs/benchmarks.md says what each measures.",
    )
    p.add_argument(
        "--slots",
        default=None,
        metavar="S[,S...]",
        help="entries per round, 1..4096 (the wire's cap), or a comma-separated list. "
        f"Default: a sweep over {', '.join(map(str, SWEEP))} (see --sweep)",
    )
    p.add_argument(
        "--sweep",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--sweep: the rows at 64, 256, 1024 and 4096 slots (the default when "
        f"--slots is not given); --no-sweep: {DEFAULT_SLOTS} slots only",
    )
    p.add_argument("--num-spec", type=int, default=5, help="k: drafts per entry (default 5)")
    p.add_argument(
        "--row-bytes", type=int, default=1024, help="bytes of engine row per entry, sent with the round (default 1024)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=500,
        help="measured rounds per row (default 500); above 256 slots a row measures "
        f"N x 256 / slots of them, at least {MIN_ROUNDS}",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="unmeasured rounds first, >= 1: the first round announces every slot (default 10)",
    )
    p.add_argument(
        "--modes",
        default=None,
        metavar="MODE[,MODE...]",
        help=f"rows to run, comma-separated, from {', '.join(ORDER)} (default: "
        f"{','.join(MODES)}, plus launch with --device cuda; mac only when named)",
    )
    p.add_argument(
        "--timeout-ms",
        type=int,
        default=TIMEOUT_MS,
        help=f"the engine rows' VLLM_DSPARK_REMOTE_TIMEOUT_MS (default {TIMEOUT_MS}: "
        "generous, so large rounds are not timeouts)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default); cuda: also the launch row, rows on the GPU",
    )
    p.add_argument(
        "--device-metadata",
        action="store_true",
        help="with --device cuda: the batch's metadata tensors (slots, tokens, offsets, "
        "positions, new_gen) on the GPU too (default: on the host; row_index is always "
        "where the rows are)",
    )
    p.add_argument(
        "--drafter",
        choices=("markov", "lm"),
        default="markov",
        help="the worker's drafter: the built-in Markov model (default) or the built-in tiny causal "
        "LM (CUDA when present; the draft row then times it, and the goal is the whole round's "
        "time)",
    )
    p.add_argument(
        "--worker-late-ms",
        type=int,
        default=0,
        metavar="MS",
        help="the worker answers every round MS late (its --chaos delay; default 0: at once), "
        "for the engine's CPU per wall-second while it waits (engine_cpu_per_wall)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (and nothing else) on stdout; progress stays on stderr",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="with --device cuda: the launch rows on N tensor-parallel ranks (a process each, one "
        "RemoteDSpark per rank in one tp_group; rank 0 talks to the worker), a row per rank (default 1)",
    )
    p.add_argument(
        "--tp-backend",
        choices=("nccl", "gloo", "loopback"),
        default="nccl",
        help="the ranks' group with --tp: nccl (default; a process and a GPU per rank), gloo (a process "
        "per rank, all on one GPU; its broadcast of a CUDA record waits on the host, so its figures are "
        "gloo's) or loopback (every rank's engine in this process on one GPU and one stream, the record "
        "passed by a copy on the stream: each rank's own cost without a collective's)",
    )
    p.add_argument(
        "--sampled",
        action="store_true",
        help="also a sampled twin of every row (VLLM_DSPARK_SAMPLED_TOP32=1: temperature 1, a seed per "
        "entry, each draft's top-32 distribution back), with its ratio to the greedy row (x greedy); "
        "at slot counts up to 1024 (the sampled cap) and --num-spec up to 16",
    )
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- engine rows


def engine_row(worker, opts: RoundOptions, mode: str, slots: int, stats_dir: str, sampled: bool = False) -> RoundRow:
    """``rd.round(batch)`` rounds: wall time, the engine thread's CPU outside the wait,
    and the engine process's CPU per wall-second over the measured rounds."""
    from collections import Counter

    rounds = opts.rounds_for(slots)
    feeder = Feeder(slots, opts.row_bytes, sampled=sampled)
    lat, cpu, outcomes = [], [], Counter()
    spins = mode != "sync"  # async rounds' waits spin first: their wait's CPU is taken out
    with engine(worker, opts, mode, slots, stats_dir, sampled=sampled) as rd:
        for i in range(opts.warmup + rounds):
            if i == opts.warmup:
                before = worker_time.read(worker.metrics_url)
                p0, s0 = time.process_time(), time.perf_counter()
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
                outcomes[out.outcome.label] += 1
        per_wall = (time.process_time() - p0) / (time.perf_counter() - s0)
        inside = worker_time.per_round(before, worker_time.read(worker.metrics_url))
    not_ok = rounds - outcomes["ok"]
    extra = {"engine_cpu_per_wall": round(per_wall, 3), **inside}
    return RoundRow(mode, slots, rounds, lat, cpu, not_ok, dict(outcomes), extra, sampled)


def launch_rows(worker, opts: RoundOptions, slots: int, stats_dir: str, sampled: bool = False) -> list[RoundRow]:
    """The launch row, and with ``--tp`` N > 1 a row per rank after it (:mod:`.tp`)."""
    rows = [launch_row(worker, opts, slots, stats_dir, sampled)]
    if opts.tp == 1:
        return rows
    from . import tp

    env = engine_env(worker, opts, "process", stats_dir, sampled)
    before = worker_time.read(worker.metrics_url)
    if opts.tp_backend == "loopback":
        from . import tp_loopback

        ranks = tp_loopback.launch_rows(worker, opts, slots, env, sampled)
    else:
        ranks = tp.launch_rows(worker, opts, slots, env, stats_dir, sampled)
    inside = worker_time.per_round(before, worker_time.read(worker.metrics_url))
    ranks[0].extra.update(inside, worker_over="every round, warm-up included (the ranks run apart)")
    return rows + ranks


def launch_row(worker, opts: RoundOptions, slots: int, stats_dir: str, sampled: bool = False) -> RoundRow:
    """``rd.launch(batch)`` on CUDA, process mode: the time until the stream holds the
    drafts (CUDA events around ``launch()``, recorded on an idle stream) and the CPU inside
    ``launch()``. The stream is synchronized after every round, outside the figures."""
    meta_device = "cuda" if opts.device_metadata else "cpu"
    feeder = Feeder(slots, opts.row_bytes, device="cuda", metadata_device=meta_device, sampled=sampled)
    with engine(worker, opts, "process", slots, stats_dir, device="cuda", sampled=sampled) as rd:
        before = []  # the worker's totals once the warm-up is over
        scrape = lambda: before.append(worker_time.read(worker.metrics_url))  # noqa: E731
        lat, cpu, wall = launch_loop(rd, feeder, opts.warmup, opts.rounds_for(slots), scrape)
        counted = rd.stats().rounds  # launched rounds are counted once collected
        inside = worker_time.per_round(before[0], worker_time.read(worker.metrics_url))
    outcomes = {o.label: n for o, n in counted.items() if n}
    not_ok = sum(counted.values()) - outcomes.get("ok", 0)
    extra = {
        "launch_wall_p50_ms": ns_to_ms(pct(wall, 0.5)),
        "launch_wall_p99_ms": ns_to_ms(pct(wall, 0.99)),
        "launch_cpu_p99_ms": ns_to_ms(pct(cpu, 0.99)),
        "outcomes_over": "every launched round, warm-up included",
        **inside,
    }
    return RoundRow("launch", slots, len(lat), lat, cpu, not_ok, outcomes, extra=extra, sampled=sampled)


# --------------------------------------------------------------------------- the run


def run(args) -> int:
    opts = options(args)  # every argument checked before anything starts
    if opts.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here")
        if opts.tp > 1:
            from .tp import check

            check(opts.tp, opts.tp_backend, torch.cuda.device_count())
    rows = run_all(opts)
    report = make_report(opts, rows)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


def run_all(opts: RoundOptions) -> list[RoundRow]:
    """Every row of ``opts.modes`` at every slot count; every child ended before returning."""
    from ...progress import Progress

    plan = [(s, m, sampled) for s in opts.slots for m in opts.modes for sampled in opts.kinds(s)]
    rows: list[RoundRow] = []
    bar = Progress(len(plan), "round rows")
    with contextlib.ExitStack() as stack:
        worker = None
        stats_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="remote-dspark-bench-round."))
        if any(m in ENGINE_MODES or m == "launch" for m in opts.modes):
            from ...demo.harness import WorkerProcess, worker_limits

            drafter = ("--drafter", "lm") if opts.drafter == "lm" else ()
            limits = worker_limits(max(opts.slots), opts.row_bytes)
            metrics = ("--metrics-port", "0")  # its own time per round (worker_time)
            # The worker as deployed; with its chaos handlers only when it is to answer late
            # (an injected fault acts on the reply in Python, so it serves no round in C).
            late = opts.worker_late_ms
            worker = stack.enter_context(
                WorkerProcess(late_ms=late, extra=(*limits, *drafter, *metrics), chaos=bool(late))
            )
            if opts.worker_late_ms:
                worker.answer_late()  # its handler is set before its first line: never lost
        for i, (slots, mode, sampled) in enumerate(plan):
            bar.update(i, f"{mode}{' sampled' if sampled else ''} {slots} slots")
            if mode == "floor":
                rows.append(floor_row(opts, slots, sampled))
            elif mode == "draft":
                rows.append(draft_row(opts, slots, sampled))
            elif mode == "mac":
                rows.append(mac_row(opts, slots, sampled))
            elif mode == "launch":
                rows.extend(launch_rows(worker, opts, slots, stats_dir, sampled))
            else:
                rows.append(engine_row(worker, opts, mode, slots, stats_dir, sampled))
        bar.update(len(plan))
    return rows

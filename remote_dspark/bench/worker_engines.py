"""``remote-dspark bench worker-engines``: many engines against one worker, their rounds
drafted together or one at a time.

Starts ``remote-dspark worker`` (``--drafter``, ``--device``) on 127.0.0.1 as a child
process, then ``--engines`` engine processes of ``--slots`` slots each. An engine says
HELLO, announces every slot with a 16-token prompt of the synthetic language (NEW_GEN,
unmeasured) and sends ``--warmup`` rounds, all engines at once (a model drafter on CUDA
captures a graph the first time it meets a shape, as a server does once, and the
warm-up meets the shapes of the calls the engines make together). Then, together (a
barrier), each sends ``--rounds`` rounds as fast as their replies come, each appending 3
tokens to every slot, k = ``--num-spec`` drafts each, and times each from its send to its
reply; entries per second count those rounds over their own span. Rows:

``alone``        one engine, the worker to itself (the latency each engine is held to);
``batched``      all the engines, the worker's scheduler drafting what is queued in one
                 call (continuous batching);
``serialized``   all the engines, one round per drafter call (``--no-batching``);
``storm``        with ``--storm N``: one engine of ``--slots`` slots (its figures) beside N
                 storm engines at the worker's limits (1024 slots, k = 64, every round
                 NEW_GEN of whole windows) until it is done;
``long``         with ``--long-slots N``: one engine of ``--slots`` slots (its figures)
                 while another announces N slots of ``--long-tokens`` in chunks
                 (:mod:`.worker_long`), against ``alone``.

A row gives the median and p99 of the engines' rounds and the entries drafted per
second across all engines, and the worker's memory: its peak resident set over the row
(``VmHWM``) less its resident set at the barrier (once the engines announced and warmed
up: the model, its store, the libraries' and the graphs' one-time memory are in),
beside the bound the design's memory table gives for the connections the row opens
(each its frame cap, its largest reply, one round's arrays and its windows; a thread's
1 MiB on the Markov lane, a call's arrays on the hub; with 2 MiB of the interpreter's
own) and, for a model drafter on the CPU, a call's
working set at the budget (:mod:`remote_dspark.drafter.lm.budget`; on CUDA that is the
GPU's memory, not the worker's). And what the worker costs beside its drafter
(:mod:`.worker_cpu`): its CPU per round apart from its drafter's own host work (the
process's CPU over the row, less the CPU its drafter's calls took on their threads, over
the rounds it answered: ``cpu us/rd``), and, for a model drafter, the row's entries per
second as a share of the drafter's own (``of drafter``: ``bench drafter``'s cached
rounds at the entries the row's calls averaged, same drafter and device, measured in
this run once the rows are done). The goals (never asserted): batched >= 4x serialized's
entries per second, >= 70% of the drafter's own, the batched p99 <= 2x alone's and its
worker CPU <= 50 us a round at 64 slots (on an H200 host; on 2 cores, batched >= 2x
serialized, p99 <= 1.5x); in the storm the honest engine's p50 <= 2x its p50 alone; in
the long row its p99 delay at most one worker call.

Progress goes to stderr; ``--json`` prints one JSON object, and nothing else, on stdout.
Every engine process and the worker end before the run returns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import time

from . import worker_cpu
from .engine_procs import STORM_SLOTS, WINDOW, acked_keep, memory_bound, steady_row, worker_flags

MODES = ("alone", "batched", "serialized")
PROMPT, STEP = 16, 3
WRAP = 400  # a steady slot goes NEW_GEN again before its stream passes this (any model's positions)
STORM_K = 64  # a storm engine: the worker's own limits, NEW_GEN every round
GOAL_X, GOAL_P99_X = 4.0, 2.0
GOAL_CPU_US, GOAL_SHARE = 50.0, 0.7  # batched: the worker's CPU a round apart from its drafter; of its entries/s


def add_parser(sub) -> None:
    p = sub.add_parser(
        "worker-engines",
        help="many engines against one worker: their rounds drafted together (batched) or one at a time",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engines", type=int, default=4, help="engine processes (default 4)")
    p.add_argument("--slots", type=int, default=64, help="slots per engine (default 64)")
    p.add_argument("--rounds", type=int, default=50, help="measured rounds per engine (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="unmeasured rounds per engine first (default 10)")
    p.add_argument("--num-spec", type=int, default=5, help="k: drafts per entry (default 5)")
    p.add_argument(
        "--storm",
        type=int,
        default=0,
        help="also a storm row: this many engines of 1024 slots, k=64, NEW_GEN of whole windows every round, "
        "beside one honest engine (default 0: none)",
    )
    p.add_argument(
        "--long-slots",
        type=int,
        default=0,
        help="also a long row: one engine announcing this many slots of --long-tokens at once, in chunks, "
        "beside an engine of --slots steady rounds (default 0: none)",
    )
    p.add_argument("--long-tokens", type=int, default=8192, help="a long slot's context (default 8192)")
    p.add_argument(
        "--modes", default=",".join(MODES), help=f"the rows besides storm and long (default {','.join(MODES)})"
    )
    p.add_argument("--drafter", default="lm", choices=("lm", "markov"), help="the worker's drafter (default lm)")
    p.add_argument(
        "--hf-random",
        metavar="KIND:LxW",
        help="the model drafter a random transformers model of this shape (hf_models: gpt2:12x768, llama:2x128), "
        "of 2048 positions or --long-tokens + 64 (default: the built-in model, 512 positions)",
    )
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="a model drafter's device")
    for flag in ("--max-batch-tokens", "--max-round-tokens"):
        p.add_argument(flag, type=int, default=None, help=f"the worker's {flag} (default: the worker's)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    p.set_defaults(func=run)


def options(args) -> None:
    """Raises: ValueError naming the bad argument."""
    limits = (
        ("engines", 1, 64),
        ("slots", 1, 1024),
        ("rounds", 1, 100_000),
        ("warmup", 0, 100_000),
        ("num_spec", 1, 32),
        ("storm", 0, 16),
        ("long_slots", 0, 1024),
        ("long_tokens", 1, 65536),
    )
    for name, low, high in limits:
        if not low <= getattr(args, name) <= high:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be in {low}..{high}")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if any(m not in MODES for m in modes):
        raise ValueError(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    if args.long_slots and "alone" not in modes:
        raise ValueError(f"--modes {args.modes!r}: the long row is measured against alone; include it")
    if args.hf_random is not None and args.drafter != "lm":
        raise ValueError(f"--hf-random {args.hf_random!r}: a model drafter's (--drafter lm)")
    args.modes = modes


def engine(
    port: int,
    identities,
    engine_id: int,
    slots: int,
    rounds: int,
    k: int,
    ready,
    go,
    storm=None,
    warmup: int = 0,
    until=None,
) -> tuple[list, int, int, list]:
    """One engine: HELLO, announce (then ``ready()``, ``go()`` waits for the others),
    ``warmup`` rounds, ``rounds`` timed rounds (with ``until``, a callable: as many as
    come while it is True, one at least). Returns (latencies in seconds, entries and
    draft tokens of the timed rounds, their span: [first send, last reply] on the host's
    monotonic clock, which every process shares). A slot whose stream would pass
    ``WRAP`` tokens goes NEW_GEN again (a long run stays within any model's positions).
    A storm engine (``storm``: a callable, True while it should go on) sends NEW_GEN
    rounds of whole windows instead, until told to stop."""
    import numpy as np

    from .. import wire
    from ..drafter.markov import SyntheticLanguage
    from ..transport import parse_endpoint
    from ..transport.client import DraftClient

    text = SyntheticLanguage().text(1 << 14, seed=engine_id)
    hello = wire.Hello(*identities, engine_id, slots, 0, k)
    c = DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{port}"), hello, engine_id, 10.0)
    try:
        at = np.random.default_rng(engine_id).integers(0, len(text) - 10_000, slots)
        had = np.zeros(slots, np.int64)

        def round_(rid: int, new_gen: bool) -> int:
            step = WINDOW if storm is not None else PROMPT if new_gen else STEP
            new = np.full(slots, new_gen) | (had + step > WRAP)
            had[new] = 0
            entries = []
            for s in range(slots):
                n = WINDOW if storm is not None else PROMPT if new[s] else STEP
                entries.append(
                    wire.Entry(s, k, int(had[s]), tuple(text[at[s] + had[s] : at[s] + had[s] + n]), bool(new[s]))
                )
                had[s] += n
            d = c.round(rid, [wire.encode_round_entries(rid, engine_id, 10_000, entries, b"", 0)], 30_000)
            return int(sum(d.counts))

        round_(1, True)
        for rid in range(2, warmup + 2):  # a storm engine warms up with its own rounds
            round_(rid, storm is not None)
        ready()
        go()
        if storm is not None:
            return _storm(c, engine_id, storm, k, [text[a : a + WINDOW] for a in at], warmup)
        latencies, drafted, rid = [], 0, warmup + 1
        start = time.monotonic()
        while len(latencies) < rounds if until is None else not latencies or until():
            rid += 1
            t0 = time.perf_counter()
            drafted += round_(rid, False)
            latencies.append(time.perf_counter() - t0)
        return latencies, len(latencies) * slots, drafted, [start, time.monotonic()]
    finally:
        c.close()


def _storm(c, engine_id: int, storm, k: int, windows: list, warmup: int) -> tuple[list, int, int, list]:
    """A storm engine's rounds: NEW_GEN of each slot's whole window at its first
    position, one frame sent again and again as fast as it is answered, while ``storm()``."""
    from .. import wire

    entries = [wire.Entry(s, k, 0, tuple(w), new_gen=True) for s, w in enumerate(windows)]
    payload = memoryview(wire.encode_round_entries(0, engine_id, 10_000, entries, b"", 0))[24:]
    rid, drafted = warmup + 1, 0
    while storm():
        rid += 1
        header = wire.encode_header(wire.ROUND, len(payload), engine_id, rid)
        drafted += int(sum(c.round(rid, [header, payload], 30_000).counts))
    return [], (rid - warmup - 1) * len(windows), drafted, []


def engine_main() -> None:
    """An engine process (``python -c``): its arguments as a JSON line on stdin, "ready"
    on stdout after announcing, "go" awaited on stdin, its result a JSON line on stdout."""
    cfg = json.loads(_stdin_line())
    identities = tuple(bytes.fromhex(h) for h in cfg.pop("identities"))
    for name in ("storm", "until"):
        if cfg.pop(name, False):
            cfg[name] = lambda: not select.select([0], [], [], 0)[0]  # until a "stop" line
    main = engine
    if cfg.pop("long", False):
        from .worker_long import long_engine as main

    def ready():
        print("ready", flush=True)

    def go():
        if _stdin_line().strip() != "go":
            raise SystemExit("no go")

    print(json.dumps(main(identities=identities, ready=ready, go=go, **cfg)), flush=True)


def _stdin_line() -> str:
    """One line of stdin, read a byte at a time from its descriptor: what follows stays in
    the pipe, where the storm's select sees it (a buffered readline of "go" could take a
    "stop" already sent along into its buffer, and the storm would never end)."""
    got = bytearray()
    while not got.endswith(b"\n") and (byte := os.read(0, 1)):
        got += byte
    return got.decode()


def measure(args, mode: str, bar) -> dict:
    """One row: a worker of its own for ``mode``, its engine processes, their rounds (for
    ``storm``, the honest engine's, beside ``--storm`` storm engines)."""
    from ..demo.harness import WorkerProcess
    from .engine_procs import barrier_rss, end_engines, growth, proc_kib, read_line, start_engines, tell

    engines = {"alone": 1, "storm": args.storm + 1}.get(mode, args.engines)
    cfgs = [dict(slots=args.slots, rounds=args.rounds, k=args.num_spec, warmup=args.warmup) for _ in range(engines)]
    for cfg in cfgs[1:] if mode == "storm" else ():  # engine 0 is the honest one
        cfg.update(slots=STORM_SLOTS, k=STORM_K, storm=True)
    extra = worker_flags(args, mode, max(args.engines, 1) * args.slots) + ("--metrics-port", "0")
    with WorkerProcess(chaos=False, extra=extra) as worker:
        keep = acked_keep(worker, args.slots, args.num_spec)
        procs = start_engines(worker, cfgs)
        try:
            started = barrier_rss(worker.proc.pid)
            before = worker_cpu.at_start(worker.proc.pid, worker.metrics_url)
            for p in procs:
                tell(p, "go")
            got = []
            for i, p in enumerate(procs):
                if i and mode == "storm":  # the honest engine is done: the storm stops
                    tell(p, "stop")
                got.append(json.loads(read_line(p, 600, "result")))
                bar(f"{mode}: engine {i + 1}/{engines}")
            peak = proc_kib(worker.proc.pid, "VmHWM") if started is not None else None
            cpu = worker_cpu.per_round(before, worker_cpu.at_end(worker.proc.pid, worker.metrics_url))
        finally:
            end_engines(procs)
    got = got[:1] if mode == "storm" else got  # the honest engine's figures
    wall = max(g[3][1] for g in got) - min(g[3][0] for g in got)  # the timed rounds' span
    row = steady_row(mode, engines, args.slots, got, wall)
    row.update(
        growth(started, peak),
        rss_bound_mb=round(memory_bound(args, [(c["slots"], c["k"]) for c in cfgs], keep) / 2**20, 2),
        **cpu,
    )
    return row


def make_report(args, rows: list[dict]) -> dict:
    from .worker_long import long_goal

    by = {r["mode"]: r for r in rows}
    goals = []
    if "batched" in by and "serialized" in by:
        x = by["batched"]["entries_per_s"] / by["serialized"]["entries_per_s"]
        goals.append({"goal": f"batched entries/s >= {GOAL_X}x serialized", "value": round(x, 2), "met": x >= GOAL_X})
    if "batched" in by and "alone" in by:
        x = by["batched"]["p99_ms"] / by["alone"]["p99_ms"]
        goals.append({"goal": f"batched p99 <= {GOAL_P99_X}x alone", "value": round(x, 2), "met": x <= GOAL_P99_X})
    batched = by.get("batched", {})
    if batched.get("worker_cpu_us_per_round") is not None:
        us = batched["worker_cpu_us_per_round"]
        goal = f"batched worker CPU per round at {batched['slots']} slots apart from the drafter's own host work"
        goals.append({"goal": f"{goal} <= {GOAL_CPU_US:g} us", "value": us, "unit": " us", "met": us <= GOAL_CPU_US})
    if batched.get("share_of_drafter") is not None:
        x = batched["share_of_drafter"]
        goal = f"batched entries/s >= {GOAL_SHARE:.0%} of the drafter's own at its entries per call"
        goals.append({"goal": goal, "value": x, "met": x >= GOAL_SHARE})
    within = all(r["rss_growth_mb"] is None or r["rss_growth_mb"] <= r["rss_bound_mb"] for r in rows)
    goals.append({"goal": "the worker's memory growth within its bound, every row", "value": None, "met": within})
    if "storm" in by and "alone" in by:
        x = by["storm"]["p50_ms"] / by["alone"]["p50_ms"]
        goals.append({"goal": "honest p50 in the storm <= 2x alone", "value": round(x, 2), "met": x <= 2.0})
    goals += [g for g in (long_goal(by),) if g is not None]
    names = ("engines", "slots", "rounds", "warmup", "num_spec", "drafter", "hf_random", "device", "storm")
    names += ("long_slots", "long_tokens", "max_batch_tokens", "max_round_tokens")
    config = {k: getattr(args, k) for k in names}
    return {"bench": "worker-engines", "config": config, "rows": rows, "goals": goals}


def format_table(report: dict) -> str:
    from .worker_long import long_line

    c = report["config"]
    lines = [
        f"worker-engines: {c['engines']} engines x {c['slots']} slots, {c['rounds']} rounds each after "
        f"{c['warmup']}, k={c['num_spec']}, drafter {c['hf_random'] or c['drafter']} ({c['device']})",
        f"{'mode':<11} {'engines':>7} {'slots':>5} {'p50 ms':>9} {'p99 ms':>9} {'entries/s':>11} "
        f"{'rss+ MB':>8} {'bound MB':>8} {'cpu us/rd':>9} {'of drafter':>10}",
        "-" * 97,
    ]
    for r in report["rows"]:
        cpu, share = r.get("worker_cpu_us_per_round"), r.get("share_of_drafter")
        lines.append(
            f"{r['mode']:<11} {r['engines']:>7} {r['slots']:>5} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f} "
            f"{r['entries_per_s']:>11,.0f} {'-' if r['rss_growth_mb'] is None else r['rss_growth_mb']:>8} "
            f"{r['rss_bound_mb']:>8} {'-' if cpu is None else f'{cpu:,.0f}':>9} "
            f"{'-' if share is None else f'{share:.0%}':>10}"
        )
    lines += [long_line(r) for r in report["rows"] if r["mode"] == "long"]
    for g in report["goals"]:
        value = "" if g["value"] is None else f"{g['value']}{g.get('unit', 'x')}, "
        lines.append(f"goal {g['goal']}: {value}{'met' if g['met'] else 'NOT met'}")
    return "\n".join(lines)


def run(args) -> int:
    from ..progress import Progress
    from .hf_models import POSITIONS, model_dir
    from .worker_long import measure_long

    options(args)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    modes = args.modes + (("storm",) if args.storm else ())
    steps = sum({"alone": 1, "storm": args.storm + 1}.get(m, args.engines) for m in modes) + bool(args.long_slots)
    progress = Progress(steps, "worker-engines")
    done = iter(range(1, progress.total + 1))

    def bar(note: str) -> None:
        progress.update(next(done), note)

    model = model_dir(None, args.hf_random, max(POSITIONS, args.long_tokens + 64)) if args.hf_random else None
    with model if model is not None else contextlib.nullcontext((None, None)) as (args.hf_model_dir, _):
        rows = [measure(args, mode, bar) for mode in modes]
        rows += [measure_long(args, bar)] if args.long_slots else []
        worker_cpu.add_shares(args, rows)  # the drafter alone, once the workers are gone
    report = make_report(args, rows)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0

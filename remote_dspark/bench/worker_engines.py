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
reply; entries per second count those rounds over their own span. ``--verify-ms MS``: a
steady engine waits MS between a reply and its next round (a target's verify step, the
worker's idle time), outside the round's time. Rows:

``alone``        one engine, the worker to itself (the latency each engine is held to);
``batched``      all the engines, the worker's scheduler drafting what is queued in one
                 call (continuous batching);
``serialized``   all the engines, one round per drafter call (``--no-batching``);
``batched-spec`` with ``--speculate N``: ``batched`` against a worker that pre-drafts
                 (``--lm-speculate N``), every steady engine of every row then a sampled
                 simulated target whose rounds can hit (:mod:`.speculation`); under the
                 table each row's entries that hit and the worker's mean round and call;
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
the long row its p99 delay at most one worker call; ``batched-spec``'s p50 <= 0.2 ms and
its p99 at most one drafter call over ``batched``'s.

Progress goes to stderr; ``--json`` prints one JSON object, and nothing else, on stdout.
Every engine process and the worker end before the run returns.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import select
import time

from . import worker_cpu
from .engine_procs import (
    STORM_SLOTS,
    WINDOW,
    acked_keep,
    memory_bound,
    stdin_line,
    steady_row,
    storm_rounds,
    timed_rounds,
    verify_pause,
    worker_flags,
)

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
    p.add_argument(
        "--verify-ms",
        type=float,
        default=0.0,
        help="the simulated target's verify step: each steady engine waits this long between a reply and its "
        "next round, outside the timing (default 0)",
    )
    p.add_argument(
        "--speculate",
        type=int,
        default=0,
        help="also a batched-spec row: the worker with --lm-speculate N, beside batched without it; the steady "
        "engines sampled simulated targets whose rounds can hit (default 0: none)",
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
    from ..worker.drafters import MAX_SPECULATE

    limits = (
        ("engines", 1, 64),
        ("slots", 1, 1024),
        ("rounds", 1, 100_000),
        ("warmup", 0, 100_000),
        ("num_spec", 1, 32),
        ("storm", 0, 16),
        ("long_slots", 0, 1024),
        ("long_tokens", 1, 65536),
        ("verify_ms", 0, 10_000),
        ("speculate", 0, MAX_SPECULATE),
    )
    for name, low, high in limits:
        if not low <= getattr(args, name) <= high:  # NaN fails too
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be in {low}..{high}")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if any(m not in MODES for m in modes):
        raise ValueError(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    if args.long_slots and "alone" not in modes:
        raise ValueError(f"--modes {args.modes!r}: the long row is measured against alone; include it")
    if args.hf_random is not None and args.drafter != "lm":
        raise ValueError(f"--hf-random {args.hf_random!r}: a model drafter's (--drafter lm)")
    if args.speculate:
        from ..wire import MAX_SAMPLED_N_OUT

        if args.drafter != "lm" or "batched" not in modes:
            raise ValueError(f"--speculate {args.speculate}: a model drafter's (--drafter lm), beside batched")
        if args.num_spec > MAX_SAMPLED_N_OUT:
            raise ValueError(f"--num-spec {args.num_spec}: sampled drafts (--speculate) take at most 16 a round")
        modes = tuple(x for m in modes for x in ((m, "batched-spec") if m == "batched" else (m,)))
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
    pause=None,
    sampled: bool = False,
) -> tuple[list, int, int, list]:
    """One engine: HELLO, announce (then ``ready()``, ``go()`` waits for the others),
    ``warmup`` rounds, ``rounds`` timed rounds (with ``until``, a callable: as many as
    come while it is True, one at least). Returns (latencies in seconds, entries and
    draft tokens of the timed rounds, their span: [first send, last reply] on the host's
    monotonic clock, which every process shares). A slot whose stream would pass
    ``WRAP`` tokens goes NEW_GEN again (a long run stays within any model's positions).
    ``pause()`` (the target's verify step) runs between a reply and the next round;
    ``sampled``: a sampled session whose rounds append what the simulated target
    accepts (:class:`~.speculation.SampledTarget`) instead of the synthetic text.
    A storm engine (``storm``: a callable, True while it should go on) sends NEW_GEN
    rounds of whole windows instead, until told to stop."""
    import numpy as np

    from .. import wire
    from ..drafter.markov import SyntheticLanguage
    from ..transport import parse_endpoint
    from ..transport.client import DraftClient
    from .speculation import SampledTarget

    text = SyntheticLanguage().text(1 << 14, seed=engine_id)
    hello = wire.Hello(*identities, engine_id, slots, 0, k, want_sampled=sampled)
    c = DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{port}"), hello, engine_id, 10.0)
    try:
        at = np.random.default_rng(engine_id).integers(0, len(text) - 10_000, slots)
        had = np.zeros(slots, np.int64)
        target = SampledTarget(engine_id, [text[a : a + PROMPT] for a in at], k, WRAP) if sampled else None

        def entries(new_gen: bool) -> list:
            if target is not None:
                return target.entries(new_gen)
            step = WINDOW if storm is not None else PROMPT if new_gen else STEP
            new = np.full(slots, new_gen) | (had + step > WRAP)
            had[new] = 0
            out = []
            for s in range(slots):
                n = WINDOW if storm is not None else PROMPT if new[s] else STEP
                out.append(
                    wire.Entry(s, k, int(had[s]), tuple(text[at[s] + had[s] : at[s] + had[s] + n]), bool(new[s]))
                )
                had[s] += n
            return out

        def send(rid: int, new_gen: bool = False):
            payload = wire.encode_round_entries(rid, engine_id, 10_000, entries(new_gen), b"", 0, sampled)
            return c.round(rid, [payload], 30_000)

        def took(d) -> int:
            return target.took(d) if target is not None else int(sum(d.counts))

        took(send(1, True))
        for rid in range(2, warmup + 2):  # a storm engine warms up with its own rounds
            if storm is None and pause is not None:
                pause()
            took(send(rid, storm is not None))
        ready()
        go()
        if storm is not None:
            return storm_rounds(c, engine_id, storm, k, [text[a : a + WINDOW] for a in at], warmup)
        start = time.monotonic()
        latencies, drafted = timed_rounds(send, took, rounds, until, pause, warmup + 1)
        return latencies, len(latencies) * slots, drafted, [start, time.monotonic()]
    finally:
        c.close()


def engine_main() -> None:
    """An engine process (``python -c``): its arguments as a JSON line on stdin, "ready"
    on stdout after announcing, "go" awaited on stdin, its result a JSON line on stdout."""
    cfg = json.loads(stdin_line())
    identities = tuple(bytes.fromhex(h) for h in cfg.pop("identities"))
    for name in ("storm", "until"):
        if cfg.pop(name, False):
            cfg[name] = lambda: not select.select([0], [], [], 0)[0]  # until a "stop" line
    if (pause := verify_pause(cfg.pop("verify_ms", 0.0))) is not None:
        cfg["pause"] = pause
    main = engine
    if cfg.pop("long", False):
        from .worker_long import long_engine as main

    def ready():
        print("ready", flush=True)

    def go():
        if stdin_line().strip() != "go":
            raise SystemExit("no go")

    print(json.dumps(main(identities=identities, ready=ready, go=go, **cfg)), flush=True)


def measure(args, mode: str, bar) -> dict:
    """One row: a worker of its own for ``mode``, its engine processes, their rounds (for
    ``storm``, the honest engine's, beside ``--storm`` storm engines)."""
    from ..demo.harness import WorkerProcess
    from .engine_procs import barrier_rss, end_engines, growth, proc_kib, read_line, start_engines, tell
    from .speculation import SpecCounters, figures

    engines = {"alone": 1, "storm": args.storm + 1}.get(mode, args.engines)
    steady = dict(slots=args.slots, rounds=args.rounds, k=args.num_spec, warmup=args.warmup)
    steady.update(verify_ms=args.verify_ms, sampled=args.speculate > 0)
    storm = dict(steady, slots=STORM_SLOTS, k=STORM_K, storm=True, verify_ms=0, sampled=False)
    cfgs = [dict(steady)] + [dict(storm if mode == "storm" else steady) for _ in range(engines - 1)]  # 0: honest
    extra = worker_flags(args, mode, max(args.engines, 1) * args.slots) + ("--metrics-port", "0")
    with WorkerProcess(chaos=False, extra=extra) as worker:
        keep = acked_keep(worker, args.slots, args.num_spec)
        procs = start_engines(worker, cfgs)
        try:
            started = barrier_rss(worker.proc.pid)
            counted = SpecCounters.read(worker.metrics_url)  # before the CPU sample: its scrape is not the row's
            before = worker_cpu.at_start(worker.proc.pid, worker.metrics_url)
            for p in procs:
                tell(p, "go")
            got, skip = [], (engines - 1 if mode == "storm" else 0)  # the storm's entries are not the row's
            for i, p in enumerate(procs):
                if i and mode == "storm":  # the honest engine is done: the storm stops
                    tell(p, "stop")
                got.append(json.loads(read_line(p, 600, "result")))
                bar(f"{mode}: engine {i + 1}/{engines}")
            peak = proc_kib(worker.proc.pid, "VmHWM") if started is not None else None
            cpu = worker_cpu.per_round(before, worker_cpu.at_end(worker.proc.pid, worker.metrics_url))
            counted = figures(counted, SpecCounters.read(worker.metrics_url), sum(g[1] for g in got[: len(got) - skip]))
        finally:
            end_engines(procs)
    got = got[:1] if mode == "storm" else got  # the honest engine's figures
    wall = max(g[3][1] for g in got) - min(g[3][0] for g in got)  # the timed rounds' span
    row = steady_row(mode, engines, args.slots, got, wall)
    row.update(
        growth(started, peak),
        rss_bound_mb=round(memory_bound(args, [(c["slots"], c["k"], c["sampled"]) for c in cfgs], keep) / 2**20, 2),
        **cpu,
        **counted,
    )
    return row


def make_report(args, rows: list[dict]) -> dict:
    from .speculation import engine_goals
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
    goals += [g for g in (long_goal(by),) if g is not None] + engine_goals(by)
    names = ("engines", "slots", "rounds", "warmup", "num_spec", "drafter", "hf_random", "device", "storm")
    names += ("long_slots", "long_tokens", "max_batch_tokens", "max_round_tokens", "verify_ms", "speculate")
    config = {k: getattr(args, k) for k in names}
    return {"bench": "worker-engines", "config": config, "rows": rows, "goals": goals}


def format_table(report: dict) -> str:
    from .speculation import spec_line
    from .worker_long import long_line

    c = report["config"]
    lines = [
        f"worker-engines: {c['engines']} engines x {c['slots']} slots, {c['rounds']} rounds each after "
        f"{c['warmup']}, k={c['num_spec']}, drafter {c['hf_random'] or c['drafter']} ({c['device']}), "
        f"verify {c['verify_ms']:g} ms"
        + (f", sampled targets, --lm-speculate {c['speculate']}" if c["speculate"] else ""),
        f"{'mode':<12} {'engines':>7} {'slots':>5} {'p50 ms':>9} {'p99 ms':>9} {'entries/s':>11} "
        f"{'rss+ MB':>8} {'bound MB':>8} {'cpu us/rd':>9} {'of drafter':>10}",
        "-" * 98,
    ]
    for r in report["rows"]:
        cpu, share = r.get("worker_cpu_us_per_round"), r.get("share_of_drafter")
        lines.append(
            f"{r['mode']:<12} {r['engines']:>7} {r['slots']:>5} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f} "
            f"{r['entries_per_s']:>11,.0f} {'-' if r['rss_growth_mb'] is None else r['rss_growth_mb']:>8} "
            f"{r['rss_bound_mb']:>8} {'-' if cpu is None else f'{cpu:,.0f}':>9} "
            f"{'-' if share is None else f'{share:.0%}':>10}"
        )
    lines += [long_line(r) for r in report["rows"] if r["mode"] == "long"]
    lines += [spec_line(r) for r in report["rows"] if c["speculate"] and r["mode"].startswith("batched")]
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

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
                 NEW_GEN of whole windows) until it is done.

A row gives the median and p99 of the engines' rounds and the entries drafted per
second across all engines, and the worker's memory: its peak resident set over the row
(``VmHWM``) less its resident set at the barrier (once the engines announced and warmed
up: the model, its store, the libraries' and the graphs' one-time memory are in),
beside the bound the design's memory table gives for the connections the row opens
(each 3 x its frame cap, its windows and its thread's 1 MiB, with 2 MiB of the
interpreter's own) and, for a model drafter on the CPU, a call's
working set at the budget (:mod:`remote_dspark.drafter.lm.budget`; on CUDA that is the
GPU's memory, not the worker's). The goals (never asserted): batched >= 4x serialized's
entries per second, and the batched p99 <= 2x alone's (the issue's H200 goal; on 2
cores, batched >= 2x serialized, p99 <= 1.5x); in the storm the honest engine's p50 <= 2x
its p50 alone.

Progress goes to stderr; ``--json`` prints one JSON object, and nothing else, on stdout.
Every engine process and the worker end before the run returns.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

MODES = ("alone", "batched", "serialized")
PROMPT, STEP, WINDOW = 16, 3, 64
STORM_SLOTS, STORM_K = 1024, 64  # a storm engine: the worker's own limits, NEW_GEN every round
GOAL_X, GOAL_P99_X = 4.0, 2.0
# The interpreter's own growth beside the memory table's numbers: a connection thread's
# stack as touched, its malloc arena and a round's Python objects (measured: 2.2 MiB for
# one connection, 6.8 MiB for eight, on the H200 host), and the worker's once.
THREAD_BYTES, INTERPRETER_BYTES = 1 << 20, 2 << 20


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
    p.add_argument("--drafter", default="lm", choices=("lm", "markov"), help="the worker's drafter (default lm)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="a model drafter's device")
    p.add_argument(
        "--max-batch-tokens", type=int, default=None, help="the worker's --max-batch-tokens (default: the worker's)"
    )
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
    )
    for name, low, high in limits:
        if not low <= getattr(args, name) <= high:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be in {low}..{high}")


def engine(
    port: int, identities, engine_id: int, slots: int, rounds: int, k: int, ready, go, storm=None, warmup: int = 0
) -> tuple[list, int, int, list]:
    """One engine: HELLO, announce (then ``ready()``, ``go()`` waits for the others),
    ``warmup`` rounds, ``rounds`` timed rounds. Returns (latencies in seconds, entries and
    draft tokens of the timed rounds, their span: [first send, last reply] on the host's
    monotonic clock, which every process shares). A storm
    engine (``storm``: a callable, True while it should go on) sends NEW_GEN rounds of
    whole windows instead, until told to stop."""
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
            entries = [
                wire.Entry(s, k, int(had[s]), tuple(text[at[s] + had[s] : at[s] + had[s] + step]), new_gen=new_gen)
                for s in range(slots)
            ]
            had[:] += step
            d = c.round(rid, [wire.encode_round_entries(rid, engine_id, 10_000, entries, b"", 0)], 30_000)
            return int(sum(d.counts))

        def storm_entries():  # NEW_GEN of whole windows at the slots' first positions
            return [wire.Entry(s, k, 0, tuple(text[at[s] : at[s] + WINDOW]), new_gen=True) for s in range(slots)]

        round_(1, True)
        for rid in range(2, warmup + 2):  # a storm engine warms up with its own rounds
            round_(rid, storm is not None)
        ready()
        go()
        latencies, drafted = [], 0
        if storm is not None:  # one frame, sent again and again as fast as it is answered
            payload = memoryview(wire.encode_round_entries(0, engine_id, 10_000, storm_entries(), b"", 0))[24:]
            rid = warmup + 1
            while storm():
                rid += 1
                header = wire.encode_header(wire.ROUND, len(payload), engine_id, rid)
                drafted += int(sum(c.round(rid, [header, payload], 30_000).counts))
            return [], (rid - warmup - 1) * slots, drafted, []
        start = time.monotonic()
        for rid in range(warmup + 2, warmup + rounds + 2):
            t0 = time.perf_counter()
            drafted += round_(rid, False)
            latencies.append(time.perf_counter() - t0)
        return latencies, rounds * slots, drafted, [start, time.monotonic()]
    finally:
        c.close()


def engine_main() -> None:
    """An engine process (``python -c``): its arguments as a JSON line on stdin, "ready"
    on stdout after announcing, "go" awaited on stdin, its result a JSON line on stdout."""
    cfg = json.loads(_stdin_line())
    identities = tuple(bytes.fromhex(h) for h in cfg.pop("identities"))
    if cfg.pop("storm", False):
        cfg["storm"] = lambda: not select.select([0], [], [], 0)[0]  # until a "stop" line

    def ready():
        print("ready", flush=True)

    def go():
        if _stdin_line().strip() != "go":
            raise SystemExit("no go")

    print(json.dumps(engine(identities=identities, ready=ready, go=go, **cfg)), flush=True)


def _stdin_line() -> str:
    """One line of stdin, read a byte at a time from its descriptor: what follows stays in
    the pipe, where the storm's select sees it (a buffered readline of "go" could take a
    "stop" already sent along into its buffer, and the storm would never end)."""
    got = bytearray()
    while not got.endswith(b"\n") and (byte := os.read(0, 1)):
        got += byte
    return got.decode()


def _line(proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"an engine process sent no {what} within {timeout_s:.0f} s")
    return line


def _proc_kib(pid: int, field: str) -> int | None:
    """``field`` (VmRSS, VmHWM) of process ``pid`` in KiB, None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(field + ":")), None)
    except OSError:
        return None


def _barrier_rss(pid: int) -> int | None:
    """Process ``pid``'s resident set in KiB now, its peak reset to it (``clear_refs``
    5: Linux), or None where either cannot be done."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _proc_kib(pid, "VmRSS")


def memory_bound(args, engines: int, storm: bool) -> int:
    """The worker's growth the memory table allows for a row's connections, in bytes."""
    from .. import wire
    from ..worker.limits import Limits
    from ..worker.scheduler import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_TOKENS

    limits = Limits(max_slots=max(args.slots, STORM_SLOTS), window=WINDOW)
    bound = INTERPRETER_BYTES
    for e in range(engines):
        slots, k = (STORM_SLOTS, STORM_K) if storm and e > 0 else (args.slots, args.num_spec)
        hello = wire.Hello(b"\0" * 32, b"\0" * 32, e, slots, 0, k)
        bound += 3 * limits.frame_cap(hello) + slots * (8 * WINDOW + 17) + THREAD_BYTES
    if args.drafter == "lm" and args.device == "cpu":
        from ..drafter.lm.budget import part_limit, working_bytes
        from ..drafter.lm.drafter import LMDrafter

        d = LMDrafter(device="cpu", cache_slots=0, window=WINDOW)
        tokens = args.max_batch_tokens or DEFAULT_MAX_TOKENS
        bound += working_bytes(d.model, d.store, DEFAULT_MAX_ENTRIES, part_limit(tokens, d.store.columns))
    return bound


def measure(args, mode: str, bar) -> dict:
    """One row: a worker of its own for ``mode``, its engine processes, their rounds (for
    ``storm``, the honest engine's, beside ``--storm`` storm engines)."""
    import numpy as np

    from ..demo.harness import WorkerProcess

    engines = {"alone": 1, "storm": args.storm + 1}.get(mode, args.engines)
    extra = ["--drafter", args.drafter, "--window", str(WINDOW), "--max-slots", str(max(args.slots, 1024))]
    if args.drafter == "lm":
        extra += ["--lm-device", args.device, "--lm-cache-slots", str(max(args.engines, 1) * args.slots)]
    if mode == "serialized":
        extra.append("--no-batching")
    if args.max_batch_tokens is not None:
        extra += ["--max-batch-tokens", str(args.max_batch_tokens)]
    with WorkerProcess(chaos=False, extra=tuple(extra)) as worker:
        code = "from remote_dspark.bench.worker_engines import engine_main; engine_main()"
        procs = [
            subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(engines)
        ]
        try:
            for e, p in enumerate(procs):
                cfg = dict(port=worker.port, identities=[worker.identity, worker.markov_identity], engine_id=100 + e)
                cfg.update(slots=args.slots, rounds=args.rounds, k=args.num_spec, warmup=args.warmup)
                if mode == "storm" and e > 0:  # engine 0 is the honest one
                    cfg.update(slots=STORM_SLOTS, k=STORM_K, storm=True)
                p.stdin.write(json.dumps(cfg) + "\n")
                p.stdin.flush()
            for p in procs:
                _line(p, 120, "ready")
            started = _barrier_rss(worker.proc.pid)
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            got = []
            for i, p in enumerate(procs):
                if i and mode == "storm":  # the honest engine is done: the storm stops
                    p.stdin.write("stop\n")
                    p.stdin.flush()
                got.append(json.loads(_line(p, 600, "result")))
                bar(f"{mode}: engine {i + 1}/{engines}")
            peak = _proc_kib(worker.proc.pid, "VmHWM") if started is not None else None
            if mode == "storm":  # the honest engine's figures
                got = got[:1]
            wall = max(g[3][1] for g in got) - min(g[3][0] for g in got)  # the timed rounds' span
        finally:
            for p in procs:
                p.stdin.close()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                p.stdout.close()
    lat = np.concatenate([g[0] for g in got]) * 1e3
    entries = sum(g[1] for g in got)
    return {
        "mode": mode,
        "engines": engines,
        "slots": args.slots,
        "p50_ms": round(float(np.percentile(lat, 50)), 3),
        "p99_ms": round(float(np.percentile(lat, 99)), 3),
        "entries_per_s": round(entries / wall, 1),
        "rss_growth_mb": None if peak is None or started is None else round((peak - started) / 1024, 1),
        "rss_bound_mb": round(memory_bound(args, engines, mode == "storm") / 2**20, 1),
        "draft_tokens": sum(g[2] for g in got),
    }


def make_report(args, rows: list[dict]) -> dict:
    by = {r["mode"]: r for r in rows}
    goals = []
    if "batched" in by and "serialized" in by:
        x = by["batched"]["entries_per_s"] / by["serialized"]["entries_per_s"]
        goals.append({"goal": f"batched entries/s >= {GOAL_X}x serialized", "value": round(x, 2), "met": x >= GOAL_X})
    if "batched" in by and "alone" in by:
        x = by["batched"]["p99_ms"] / by["alone"]["p99_ms"]
        goals.append({"goal": f"batched p99 <= {GOAL_P99_X}x alone", "value": round(x, 2), "met": x <= GOAL_P99_X})
    within = all(r["rss_growth_mb"] is None or r["rss_growth_mb"] <= r["rss_bound_mb"] for r in rows)
    goals.append({"goal": "the worker's memory growth within its bound, every row", "value": None, "met": within})
    if "storm" in by and "alone" in by:
        x = by["storm"]["p50_ms"] / by["alone"]["p50_ms"]
        goals.append({"goal": "honest p50 in the storm <= 2x alone", "value": round(x, 2), "met": x <= 2.0})
    names = ("engines", "slots", "rounds", "warmup", "num_spec", "drafter", "device", "storm", "max_batch_tokens")
    config = {k: getattr(args, k) for k in names}
    return {"bench": "worker-engines", "config": config, "rows": rows, "goals": goals}


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [
        f"worker-engines: {c['engines']} engines x {c['slots']} slots, {c['rounds']} rounds each after "
        f"{c['warmup']}, k={c['num_spec']}, drafter {c['drafter']} ({c['device']})",
        f"{'mode':<11} {'engines':>7} {'slots':>5} {'p50 ms':>9} {'p99 ms':>9} {'entries/s':>11} "
        f"{'rss+ MB':>8} {'bound MB':>8}",
        "-" * 76,
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['mode']:<11} {r['engines']:>7} {r['slots']:>5} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f} "
            f"{r['entries_per_s']:>11,.0f} {'-' if r['rss_growth_mb'] is None else r['rss_growth_mb']:>8} "
            f"{r['rss_bound_mb']:>8}"
        )
    for g in report["goals"]:
        value = "" if g["value"] is None else f"{g['value']}x, "
        lines.append(f"goal {g['goal']}: {value}{'met' if g['met'] else 'NOT met'}")
    return "\n".join(lines)


def run(args) -> int:
    from ..progress import Progress

    options(args)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    progress = Progress(args.engines * 2 + 1 + (args.storm + 1 if args.storm else 0), "worker-engines")
    done = iter(range(1, progress.total + 1))
    modes = MODES + (("storm",) if args.storm else ())
    rows = [measure(args, mode, lambda note: progress.update(next(done), note)) for mode in modes]
    report = make_report(args, rows)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0

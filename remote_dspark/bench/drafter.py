"""``remote-dspark bench drafter``: the model drafters' rounds, three ways.

For each drafter (the built-in model; with ``--hf-model DIR`` or ``--hf-random
KIND:LxW`` also a transformers model, through the worker's own loader), each device (CPU,
and the GPU when there is one: side by side in one run) and each entry count
(``--entries``, default 1, 16, 64 and 256), the same rounds are drafted:

``per-entry``   one ``draft_batch`` call per entry (what a drafter without the batched
                protocol costs: n forward passes per draft step), no cache;
``batched``     one call for all entries, each context encoded whole (no cache);
``cached``      one call for all entries, the per-slot KV cache on (a row per entry): each
                entry encodes only the tokens its slot gained since the last round.

The rounds are the worker's own (its :class:`~remote_dspark.worker.windows.Windows`
builds them): the first announces every slot with a 16-token prompt of the synthetic
language and is never measured; every later one appends 3 tokens per slot (2 accepted
drafts and the target's own), so contexts grow to the worker's window (64) and past it.
``--num-spec`` drafts per entry, no margins. On CUDA each row first runs its rounds once
unmeasured with a drafter of its own, so kernels are loaded and the drafter's CUDA graphs
captured for every shape the row meets (a server meets its shapes once). A row's figures: the median and p99 of the
round, and draft tokens per second at the median. The ratios (``batched`` over
``per-entry``, ``cached`` over ``batched``) compare rows of this run. The goals (never
asserted): on CUDA, the built-in model batched >= 20x per-entry at 256 entries; a
transformers model cached >= 5x batched at 256 entries on CUDA and >= 3x at 64 on the
CPU, measured with ``gpt2:12x768`` (GPT-2 small's shape).

Progress goes to stderr; ``--json`` prints one JSON object, and nothing else, on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time

PROMPT_TOKENS = 16
STEP_TOKENS = 3
WINDOW = 64
GOAL_ENTRIES = 256
GOAL_BATCHED_X = 20.0
GOAL_CACHED_X = {"cuda": (256, 5.0), "cpu": (64, 3.0)}  # a transformers model: entries, cached / batched
MODES = ("per-entry", "batched", "cached")
BUILTIN = "lm"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "drafter",
        help="the model drafter: per entry vs batched, cache vs none, CPU and GPU",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--entries", default="1,16,64,256", metavar="N[,N...]", help="entries per round (default 1,16,64,256)"
    )
    p.add_argument(
        "--devices",
        default=None,
        metavar="D[,D...]",
        help="cpu and/or cuda (default: cpu, and cuda when torch sees a GPU)",
    )
    p.add_argument("--num-spec", type=int, default=5, help="k: drafts per entry (default 5)")
    p.add_argument(
        "--rounds",
        type=int,
        default=20,
        help="measured rounds per row (default 20; per-entry rows above 16 entries measure fewer: the rounds column)",
    )
    p.add_argument("--warmup", type=int, default=2, help="unmeasured rounds after the announcing one (default 2)")
    p.add_argument(
        "--history",
        type=int,
        default=PROMPT_TOKENS,
        metavar="T",
        help=f"tokens each slot's announcing round brings (default {PROMPT_TOKENS}); the worker keeps whole "
        "streams, so a cached round reads T tokens of KV per entry and more: its bandwidth is shown",
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        metavar="M[,M...]",
        help=f"rows to measure, of {', '.join(MODES)} (default all; ratios need all three)",
    )
    model = p.add_mutually_exclusive_group()
    model.add_argument("--hf-model", metavar="DIR", help="also a transformers causal LM saved in this local directory")
    model.add_argument(
        "--hf-random",
        metavar="KIND:LxW",
        help="also a randomly initialised transformers model of this shape (gpt2:12x768, llama:4x512...)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    p.set_defaults(func=run)


@dataclasses.dataclass(frozen=True)
class DrafterBenchOptions:
    entries: tuple[int, ...]
    devices: tuple[str, ...]
    num_spec: int
    rounds: int
    warmup: int
    history: int = PROMPT_TOKENS
    modes: tuple[str, ...] = MODES


def options(args) -> DrafterBenchOptions:
    """Raises: ValueError naming the bad argument."""
    import torch

    from .. import wire

    try:
        entries = tuple(int(x) for x in args.entries.split(","))
    except ValueError:
        raise ValueError(f"--entries {args.entries!r}: expected comma-separated integers") from None
    for n in entries:
        if not 1 <= n <= wire.MAX_ENTRIES:
            raise ValueError(f"--entries {n}: must be in 1..{wire.MAX_ENTRIES}")
    if args.devices is None:
        devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    else:
        devices = tuple(d.strip() for d in args.devices.split(",") if d.strip())
        for d in devices:
            if d not in ("cpu", "cuda"):
                raise ValueError(f"--devices {args.devices!r}: unknown device {d!r}; choose cpu or cuda")
            if d == "cuda" and not torch.cuda.is_available():
                raise ValueError("--devices cuda: torch sees no CUDA device here")
        if not devices:
            raise ValueError(f"--devices {args.devices!r}: no device named")
    if not 1 <= args.num_spec <= wire.MAX_N_OUT:
        raise ValueError(f"--num-spec {args.num_spec}: must be in 1..{wire.MAX_N_OUT}")
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: must be >= 0")
    if not 1 <= args.history <= wire.MAX_CONTEXT:
        raise ValueError(f"--history {args.history}: must be in 1..{wire.MAX_CONTEXT}")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--modes {args.modes!r}: expected some of {', '.join(MODES)}")
    return DrafterBenchOptions(entries, devices, args.num_spec, args.rounds, args.warmup, args.history, modes)


def worker_rounds(n: int, rounds: int, num_spec: int, seed: int = 3, history: int = PROMPT_TOKENS) -> list:
    """``rounds`` DraftBatches for ``n`` slots as a worker hands them to a drafter that
    keeps whole streams: the first announces every slot (NEW_GEN, ``history`` tokens),
    each later one appends STEP_TOKENS tokens per slot; the stream fields (session, slots,
    gens, lengths, what the worker keeps of each stream and its reader) are the worker's."""
    import numpy as np

    from ..drafter.contract import DraftBatch
    from ..drafter.markov import SyntheticLanguage
    from ..worker.history import History
    from ..worker.windows import Windows

    text = np.asarray(SyntheticLanguage().text(1 << 14, seed=seed), np.int32)
    starts = np.random.default_rng(seed).integers(0, len(text) - 1, n)
    windows = Windows(n, WINDOW, keep=max(WINDOW, history + rounds * STEP_TOKENS))
    reader = History()
    reader.add(windows)
    reader.held = windows  # the reader holds its windows weakly: the rounds keep them
    slots = np.arange(n, dtype=np.int64)
    had = np.zeros(n, np.int64)
    rows, n_out = np.zeros((n, 0), np.uint8), np.full(n, num_spec, np.int32)
    out = []
    for r in range(rounds):
        step = history if r == 0 else STEP_TOKENS
        at = (starts[:, None] + had[:, None] + np.arange(step)[None, :]).ravel() % len(text)
        offsets = np.arange(0, (n + 1) * step, step, dtype=np.int64)
        adv = windows.advance(slots, had.copy(), np.full(n, r == 0), offsets, text[at])
        had += step
        out.append(
            DraftBatch(
                adv.tokens,
                adv.offsets,
                n_out,
                rows,
                False,
                num_spec,
                session=windows.serial,
                slots=adv.slots,
                gens=adv.gens,
                lengths=adv.lengths,
                positions=adv.starts,
                kept_from=np.zeros(n, np.int64),
                history=reader,
            )
        )
    return out


def _no_stream(batch):
    return dataclasses.replace(batch, slots=None, gens=None, lengths=None)


def _one(batch, i: int):
    """Entry ``i`` of ``batch`` alone, no stream fields (the per-entry path)."""
    import numpy as np

    ctx = batch.context(i)
    return dataclasses.replace(
        batch,
        tokens=ctx,
        offsets=np.array([0, len(ctx)], np.int64),
        n_out=batch.n_out[i : i + 1],
        rows=batch.rows[i : i + 1],
        session=0,
        slots=None,
        gens=None,
        lengths=None,
        positions=None if batch.positions is None else batch.positions[i : i + 1],
    )


def measure(drafter, batches: list, mode: str, skip: int) -> list[int]:
    """Nanoseconds of each round past the first ``skip`` (all of them are drafted)."""
    out = []
    for r, b in enumerate(batches):
        t0 = time.perf_counter_ns()
        if mode == "per-entry":
            for i in range(len(b)):
                drafter.draft_batch(_one(b, i))
        else:
            drafter.draft_batch(b if mode == "cached" else _no_stream(b))
        if r >= skip:
            out.append(time.perf_counter_ns() - t0)
    return out


def reads(drafter, batches: list, num_spec: int, p50_ms: float) -> dict:
    """What a cached round reads from memory at least, and how fast at its median: each of
    its ``num_spec`` steps reads every entry's KV (the streams' mean length over the
    rounds, at what the model keeps per token) and every weight of the model once."""
    import numpy as np

    store = drafter.store
    per_token = store.block_bytes() // store.block
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in drafter.model.parameters()}.values())
    tokens = float(np.mean([b.lengths.sum() for b in batches]))
    read = num_spec * (tokens * per_token + weights)
    return {"read_gb": round(read / 1e9, 3), "read_tb_s": round(read / (p50_ms / 1e3) / 1e12, 3) if p50_ms else None}


def copy_tb_s() -> float:
    """The GPU's memory bandwidth as a device-to-device copy of 1 GiB reaches it (read and
    write counted), best of 5."""
    import torch

    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        stop.record()
        stop.synchronize()
        best = min(best, start.elapsed_time(stop) / 1e3)
    return round(2 * x.numel() / best / 1e12, 3)


def _pct(ns: list[int], q: float) -> float:
    s = sorted(ns)
    return s[min(len(s) - 1, int(q * len(s)))] / 1e6


def makers(hf_path: str | None, hf_name: str | None) -> dict:
    """Each drafter's name -> ``make(device, cache_slots)``, a fresh drafter (a transformers
    model is loaded once per device; its drafters share it, each with a cache of its own)."""
    from ..drafter.lm import builtin_drafter

    out = {BUILTIN: lambda device, slots: builtin_drafter(device=device, cache_slots=slots)}
    if hf_path is not None:
        from ..drafter.lm.hf import load_hf

        loaded = {}

        def hf(device, slots):
            if device not in loaded:
                loaded[device] = load_hf(hf_path, device, WINDOW, cache_slots=0)
            return loaded[device].sibling(slots)

        out[hf_name] = hf
    return out


def run_rows(opts: DrafterBenchOptions, make: dict) -> list[dict]:
    from ..progress import Progress

    plan = [(k, d, n, m) for k in make for d in opts.devices for n in opts.entries for m in opts.modes]
    bar = Progress(len(plan), "drafter rows")
    rows = []
    for i, (kind, device, n, mode) in enumerate(plan):
        bar.update(i, f"{kind} {device} {n} entries {mode}")
        measured = opts.rounds if mode != "per-entry" or n <= 16 else max(3, opts.rounds * 16 // n)
        skip = 1 + opts.warmup
        positions = make[kind](device, 0).max_positions
        if positions is not None and opts.history + (skip + measured) * STEP_TOKENS + opts.num_spec > positions:
            continue  # the streams would pass the model's positions (the built-in model has 512)
        batches = worker_rounds(n, skip + measured, opts.num_spec, history=opts.history)
        slots = n if mode == "cached" else 0
        if device == "cuda":  # every shape of the run seen once first (kernel loading, graph capture)
            measure(make[kind](device, slots), batches, mode, len(batches))
        # A fresh drafter per row: the cached row starts cold (its announcing round fills it).
        drafter = make[kind](device, slots)
        ns = measure(drafter, batches, mode, skip)
        p50 = _pct(ns, 0.5)
        rows.append(
            {
                **(reads(drafter, batches[skip:], opts.num_spec, p50) if mode == "cached" else {}),
                "drafter": kind,
                "device": device,
                "entries": n,
                "mode": mode,
                "rounds": measured,
                "p50_ms": round(p50, 4),
                "p99_ms": round(_pct(ns, 0.99), 4),
                "tokens_per_s": round(n * opts.num_spec / (p50 / 1e3)) if p50 else None,
            }
        )
    bar.update(len(plan))
    return rows


GOAL_SHARE = 0.6  # a transformers model's cached round, 256 entries of GOAL_HISTORY tokens: its reads' share
GOAL_HISTORY = 2000  # of the card's memory bandwidth (a device copy's)


def make_report(opts: DrafterBenchOptions, rows: list[dict], copy: float | None = None) -> dict:
    """The rows, their ratios and goals; ``copy``: the GPU's copy bandwidth (TB/s), which
    a cached CUDA row's reads are a share of."""
    by = {(r["drafter"], r["device"], r["entries"], r["mode"]): r for r in rows}
    ratios, goals = [], []
    for r in rows:
        if copy and r["device"] == "cuda" and r.get("read_tb_s"):
            r["bandwidth_share"] = round(r["read_tb_s"] / copy, 3)
            if r["drafter"] != BUILTIN and r["entries"] == GOAL_ENTRIES and opts.history >= GOAL_HISTORY:
                goal = (
                    f"{r['drafter']} cached round of {GOAL_ENTRIES} x {opts.history} tokens reads at >= {GOAL_SHARE:g}"
                )
                goals.append(
                    {
                        "goal": f"{goal} of the copy bandwidth",
                        "value": r["bandwidth_share"],
                        "met": r["bandwidth_share"] >= GOAL_SHARE,
                    }
                )
    for kind, device, n in dict.fromkeys((r["drafter"], r["device"], r["entries"]) for r in rows):
        if any((kind, device, n, m) not in by for m in MODES):
            continue  # a run of some modes only: no ratios
        per, bat, cac = (by[(kind, device, n, m)]["p50_ms"] for m in MODES)
        ratios.append(
            {
                "drafter": kind,
                "device": device,
                "entries": n,
                "batched_x_per_entry": round(per / bat, 2),
                "cached_x_batched": round(bat / cac, 2),
            }
        )
    for r in ratios:
        if r["drafter"] == BUILTIN and r["device"] == "cuda" and r["entries"] == GOAL_ENTRIES:
            goal, value, want = (
                f"{BUILTIN} batched / per-entry at {GOAL_ENTRIES} entries on cuda",
                "batched_x_per_entry",
                GOAL_BATCHED_X,
            )
        elif r["drafter"] != BUILTIN and GOAL_CACHED_X.get(r["device"], (0,))[0] == r["entries"]:
            want = GOAL_CACHED_X[r["device"]][1]
            goal, value = (
                f"{r['drafter']} cached / batched at {r['entries']} entries on {r['device']}",
                "cached_x_batched",
            )
        else:
            continue
        goals.append({"goal": f"{goal} >= {want:g}x", "value": r[value], "met": r[value] >= want})
    return {
        "config": dataclasses.asdict(opts) | {"window": WINDOW, "step_tokens": STEP_TOKENS, "copy_tb_s": copy},
        "rows": rows,
        "ratios": ratios,
        "goals": goals,
    }


def format_table(report: dict) -> str:
    c = report["config"]
    lines = [
        f"model drafter rounds, k={c['num_spec']}, window {c['window']}: a {c['history']}-token history "
        f"per slot, then {c['step_tokens']} tokens per slot per round; ms per round",
        f"{'drafter':<14} {'device':>6}  {'entries':>7}  {'mode':<10} {'rounds':>6} {'p50':>9} {'p99':>9} "
        f"{'tokens/s':>11}",
        "-" * 81,
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['drafter']:<14} {r['device']:>6}  {r['entries']:>7}  {r['mode']:<10} {r['rounds']:>6} "
            f"{r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} {r['tokens_per_s'] or 0:>11,}"
        )
    lines.append("")
    for r in report["ratios"]:
        lines.append(
            f"{r['drafter']:<14} {r['device']:>6} {r['entries']:>5} entries: batched {r['batched_x_per_entry']}x "
            f"per-entry, cached {r['cached_x_batched']}x batched"
        )
    for r in report["rows"]:
        if "bandwidth_share" in r:
            lines.append(
                f"{r['drafter']:<14} {r['device']:>6} {r['entries']:>5} entries cached: {r['read_gb']} GB a round, "
                f"{r['read_tb_s']} TB/s, {r['bandwidth_share']:.0%} of the copy bandwidth ({c['copy_tb_s']} TB/s)"
            )
    for g in report["goals"]:
        lines.append(f"goal {g['goal']}: {g['value']}, {'met' if g['met'] else 'NOT met'}")
    return "\n".join(lines)


def run(args) -> int:
    from .hf_models import model_dir

    opts = options(args)
    hf = args.hf_model is not None or args.hf_random is not None
    with model_dir(args.hf_model, args.hf_random) if hf else _no_model() as (path, name):
        rows = run_rows(opts, makers(path, name))
    report = make_report(opts, rows, copy_tb_s() if "cuda" in opts.devices else None)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


@contextlib.contextmanager
def _no_model():
    yield None, None

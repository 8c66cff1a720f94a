"""``bench round``'s figures: a row's raw latencies (:class:`RoundRow`), the report made of
them (p50, p99, ratios to the floor and to sync, the goals met or not) and its table."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .options import (
    CONTEXT_TOKENS,
    DESCRIBE,
    GOAL_DRAFT_MS,
    GOAL_ENGINE_CPU_MS,
    GOAL_LINEAR,
    GOAL_LM_PROCESS_MS,
    GOAL_MAC_SHARE,
    GOAL_SAMPLED_X,
    GOAL_SLOTS,
    GOAL_X_FLOOR,
    GOAL_X_SYNC,
    LINEAR_AT,
    PROMPT_TOKENS,
    STEP_TOKENS,
    RoundOptions,
)


@dataclass
class RoundRow:
    mode: str
    slots: int
    rounds: int
    lat_ns: list[int]
    cpu_ns: list[int] | None = None  # engine thread CPU per round (engine rows, launch)
    not_ok: int | None = None  # engine rows: measured rounds whose outcome is not "ok"
    outcomes: dict | None = None  # engine rows: measured rounds by outcome
    extra: dict | None = None  # floor: byte counts; launch: CPU inside launch(); engine rows: CPU per wall-second
    sampled: bool = False  # a sampled row (--sampled): SAMPLED_TOP32 rounds


def pct(values: list[int], q: float) -> float:
    """The q-quantile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def ns_to_ms(ns: float) -> float:
    return round(ns / 1e6, 4)


def _threads() -> dict:
    import torch

    return {
        "torch_num_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
    }


def _rank(r: RoundRow) -> int:
    """A ``--tp`` row's rank; -1 for every other row."""
    return (r.extra or {}).get("tp_rank", -1)


def make_report(opts: RoundOptions, rows: list[RoundRow]) -> dict:
    p50 = {(r.mode, r.slots, r.sampled, _rank(r)): pct(r.lat_ns, 0.5) for r in rows}
    cpu = {(r.mode, r.slots, r.sampled, _rank(r)): pct(r.cpu_ns, 0.5) for r in rows if r.cpu_ns}
    out_rows = []
    for r in rows:  # each row against the floor and sync of its own kind, a sampled one also against its greedy twin
        f, s = p50.get(("floor", r.slots, r.sampled, -1)), p50.get(("sync", r.slots, r.sampled, -1))
        mine, greedy = p50[(r.mode, r.slots, r.sampled, _rank(r))], p50.get((r.mode, r.slots, False, _rank(r)))
        d = {
            "mode": r.mode,
            "sampled": r.sampled,
            "slots": r.slots,
            "rounds": r.rounds,
            "p50_ms": ns_to_ms(mine),
            "p99_ms": ns_to_ms(pct(r.lat_ns, 0.99)),
            "x_floor": None if f is None else round(mine / max(f, 1), 2),
            "x_sync": (
                round(mine / max(s, 1), 2) if s is not None and r.mode in ("thread", "process", "launch") else None
            ),
            "x_greedy": round(mine / max(greedy, 1), 2) if r.sampled and greedy is not None else None,
            "engine_cpu_ms": None if r.cpu_ns is None else ns_to_ms(pct(r.cpu_ns, 0.5)),
            "not_ok": r.not_ok,
        }
        proc = p50.get(("process", r.slots, r.sampled, -1))
        if r.mode == "mac":  # the share of the process round of its kind a MAC would add
            d["x_process"] = None if proc is None else round(mine / max(proc, 1), 3)
        if r.cpu_ns is not None:
            d["engine_cpu_mean_ms"] = ns_to_ms(sum(r.cpu_ns) / len(r.cpu_ns))
        plain = cpu.get((r.mode, r.slots, r.sampled, -1))
        if _rank(r) >= 0 and plain:  # a --tp rank's CPU inside launch() over the single-rank engine's
            d["cpu_x_plain"] = round(pct(r.cpu_ns, 0.5) / plain, 2)
        if r.outcomes is not None:
            d["outcomes"] = r.outcomes
        if r.extra:
            d.update(r.extra)
        out_rows.append(d)
    config = {
        "bench": "round",
        "slots": list(opts.slots),
        "num_spec": opts.num_spec,
        "row_bytes": opts.row_bytes,
        "rounds": opts.rounds,
        "rounds_by_slots": {str(s): opts.rounds_for(s) for s in opts.slots},
        "warmup": opts.warmup,
        "modes": list(opts.modes),
        "timeout_ms": opts.timeout_ms,
        "device": opts.device,
        "device_metadata": opts.device_metadata,
        "drafter": opts.drafter,
        "worker_late_ms": opts.worker_late_ms,
        "sampled": opts.sampled,
        "tp": opts.tp,
        "tp_backend": opts.tp_backend if opts.tp > 1 else None,
        "tokens_per_entry": STEP_TOKENS,
        "prompt_tokens": PROMPT_TOKENS,
        "draft_context_tokens": CONTEXT_TOKENS,
        **_threads(),
    }
    return {"config": config, "rows": out_rows, "targets": targets(out_rows, opts.drafter)}


def _goal(value: float | None, limit: float, what: str) -> dict:
    return {"what": what, "value": value, "limit": limit, "met": value is not None and value <= limit}


def targets(rows: list[dict], drafter: str = "markov") -> dict:
    """The goals that this run's rows can say something about (the others are absent).
    With the model drafter (``lm``) the drafting dominates the round: its goal is the
    whole round's time, and the floor and Markov drafting goals do not apply."""
    by = {(r["mode"], r["slots"]): r for r in rows if not r.get("sampled") and "tp_rank" not in r}
    g, out = GOAL_SLOTS, {}
    proc = by.get(("process", g))
    twin = next((r for r in rows if r.get("sampled") and (r["mode"], r["slots"]) == ("process", g)), None)
    if twin is not None and twin["x_greedy"] is not None:
        out["sampled_process_x_greedy"] = _goal(
            twin["x_greedy"], GOAL_SAMPLED_X, f"sampled process p50 / greedy process p50 at {g} slots"
        )
    for mac in (r for r in rows if r["mode"] == "mac" and r["slots"] == g and r.get("x_process") is not None):
        kind = "sampled" if mac.get("sampled") else "greedy"
        out[f"mac_x_process_{kind}"] = _goal(
            mac["x_process"], GOAL_MAC_SHARE, f"a {kind} DRAFTS' HMAC, both ends, / process p50 at {g} slots"
        )
    if drafter == "lm":
        if proc is not None:
            out["lm_process_ms"] = _goal(
                proc["p50_ms"], GOAL_LM_PROCESS_MS, f"process p50 with the model drafter at {g} slots, ms"
            )
        return out
    if proc is not None and proc["x_floor"] is not None:
        out["process_x_floor"] = _goal(proc["x_floor"], GOAL_X_FLOOR, f"process p50 / floor p50 at {g} slots")
    if proc is not None and proc["x_sync"] is not None:
        out["process_x_sync"] = _goal(proc["x_sync"], GOAL_X_SYNC, f"process p50 / sync p50 at {g} slots")
    if proc is not None:
        out["process_engine_cpu_ms"] = _goal(
            proc["engine_cpu_ms"], GOAL_ENGINE_CPU_MS, f"process engine CPU per round at {g} slots, ms"
        )
    draft = by.get(("draft", g))
    if draft is not None:
        out["draft_ms"] = _goal(draft["p50_ms"], GOAL_DRAFT_MS, f"draft p50 at {g} slots, ms")
    for mode in ("process", "draft"):
        lo, hi = by.get((mode, g)), by.get((mode, LINEAR_AT))
        if lo is not None and hi is not None:
            ratio = (hi["p50_ms"] / LINEAR_AT) / max(lo["p50_ms"] / g, 1e-9)
            out[f"{mode}_linear"] = _goal(
                round(ratio, 2), GOAL_LINEAR, f"{mode} per-slot p50 at {LINEAR_AT} slots / at {g} slots"
            )
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
        f"{c['cpu_count']} CPUs ({c['affinity_cpus']} usable); device {c['device']}; drafter {c['drafter']}"
        + (f", metadata on {'the GPU' if c['device_metadata'] else 'the host'}" if c["device"] == "cuda" else ""),
    ]
    head = (
        f"{'slots':>6}  {'mode':<34}{'rounds':>7}{'p50':>10}{'p99':>10}{'worker':>9}{'x floor':>9}{'x sync':>8}"
        f"{'x greedy':>10}{'engine cpu':>12}  not ok"
    )
    lines += [head, "-" * len(head)]
    for r in report["rows"]:
        flag = (
            "-"
            if r["not_ok"] is None
            else (
                "0"
                if not r["not_ok"]
                else f"{r['not_ok']} NOT OK: "
                + ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()) if k != "ok")
            )
        )
        what = DESCRIBE[r["mode"]] + (f", rank {r['tp_rank']}/{r['tp']}" if "tp_rank" in r else "")
        lines.append(
            f"{r['slots']:>6}  {what + (', sampled' if r.get('sampled') else ''):<34}"
            f"{r['rounds']:>7}{r['p50_ms']:>10.3f}{r['p99_ms']:>10.3f}{_f(r.get('worker_ms'), '.3f', 9)}"
            f"{_f(r['x_floor'], '.2f', 9)}"
            f"{_f(r['x_sync'], '.2f', 8)}{_f(r.get('x_greedy'), '.2f', 10)}{_f(r['engine_cpu_ms'], '.3f', 12)}  {flag}"
        )
    busy = [r for r in report["rows"] if "engine_cpu_per_wall" in r]
    if busy:
        lines.append(
            f"engine process CPU-seconds per wall-second (worker answering {c['worker_late_ms']} ms late): "
            + "; ".join(
                f"{r['slots']} slots {r['mode']}{' sampled' if r.get('sampled') else ''} {r['engine_cpu_per_wall']:.3f}"
                for r in busy
            )
        )
    floors = [r for r in report["rows"] if r["mode"] == "floor"]
    if floors:
        lines.append(
            "floor bytes: "
            + "; ".join(
                f"{r['slots']} slots{' sampled' if r.get('sampled') else ''} ROUND {r['round_bytes']:,} + "
                f"DRAFTS {r['drafts_bytes']:,}"
                for r in floors
            )
        )
    for r in report["rows"]:
        if r["mode"] == "mac":
            share = (
                "no process row" if r.get("x_process") is None else f"{100 * r['x_process']:.1f}% of the process round"
            )
            lines.append(
                f"mac at {r['slots']} slots{' sampled' if r.get('sampled') else ''}: {r['drafts_bytes']:,} bytes of "
                f"DRAFTS tagged and checked in {r['p50_ms']:.4f} ms p50, {share}"
            )
        if r["mode"] == "launch":
            rank = ""
            if "tp_rank" in r:
                ratio = f", {r['cpu_x_plain']:.2f}x the single-rank engine's" if "cpu_x_plain" in r else ""
                rank = f" on tp rank {r['tp_rank']} of {r['tp']} ({r['tp_backend']}{ratio})"
            lines.append(
                f"launch at {r['slots']} slots{rank}: CPU inside launch() p50 {r['engine_cpu_ms']:.3f} / p99 "
                f"{r['launch_cpu_p99_ms']:.3f} ms, wall inside launch() p50 {r['launch_wall_p50_ms']:.3f} ms"
            )
    for t in report["targets"].values():
        v = "not measured" if t["value"] is None else f"{t['value']:g}"
        lines.append(f"goal {t['what']} <= {t['limit']:g}: {v}, {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)

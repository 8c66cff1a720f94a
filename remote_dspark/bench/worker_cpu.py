"""``remote-dspark bench worker-engines``' two views of what the worker costs beside its
drafter: its CPU per round apart from the drafter's own host work, and its entries per
second as a share of what the drafter alone drafts.

**CPU per round.** Each row samples, at its barrier and again when its engines are done,
the worker process's CPU (user and system, every thread's, those ended included: Linux's
``/proc/<pid>/stat``, in clock ticks) and its ``/metrics``: the rounds it answered
(``dspark_worker_rounds_total``), its drafter calls and their entries
(``dspark_worker_drafter_calls_total``, ``dspark_worker_call_entries``) and the CPU its
drafter's calls took on the thread that made each (``dspark_worker_drafter_cpu_seconds_total``,
``time.thread_time`` around each call). The worker's CPU over the row less its drafter's,
over the rounds it answered, is the row's ``worker_cpu_us_per_round``: the receiving,
decoding, windows, batching, replying and sending every round costs. The scrape at the
barrier comes before the CPU sample and the one at the end after it, so neither is in
the row. A tick (10 ms) over the row's rounds is the figure's resolution
(``worker_cpu_resolution_us``). A drafter's threads of its own (torch's intra-op pool on
the CPU) count as the worker's: on a GPU host they are idle.

**Share of the drafter.** The row's drafter calls averaged ``entries_per_call``; the
drafter alone (no worker, no sockets: ``bench drafter``'s ``cached`` row, the same drafter
and device, in this process once the rows are done) drafts rounds of that many entries,
and ``drafter_entries_per_s`` is those entries over its median round. The row's
``share_of_drafter`` is its entries per second over that. Model drafters only (``bench
drafter`` measures those); the steady rows only (a storm's calls are the storm's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ROUNDS = "dspark_worker_rounds_total"
CALLS = "dspark_worker_drafter_calls_total"
CALL_ENTRIES = "dspark_worker_call_entries_sum"
DRAFTER_CPU = "dspark_worker_drafter_cpu_seconds_total"
SHARED_MODES = ("alone", "batched", "serialized")  # the rows whose calls are their engines' alone
DRAFTER_ROUNDS, DRAFTER_WARMUP = 20, 2  # bench drafter's defaults


@dataclass(frozen=True)
class Sample:
    """The worker's running totals at one moment."""

    cpu_s: float | None  # the process's CPU, user + system (None: /proc does not say)
    drafter_cpu_s: float  # its drafter's calls' CPU on the threads that made them
    rounds: float
    calls: float
    call_entries: float  # entries over every drafter call


def process_cpu(pid: int) -> float | None:
    """Process ``pid``'s CPU seconds so far (user + system, its ended threads' included),
    None where ``/proc`` does not say (not Linux, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold anything
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def counters(url: str) -> dict:
    """The totals :class:`Sample` reads from the worker's ``/metrics`` at ``url``.

    Raises:
        RuntimeError: the scrape failed or lacks a family, naming the URL.
    """
    from .round.worker_time import scrape

    values = scrape(url)
    try:
        return {
            "drafter_cpu_s": values[DRAFTER_CPU],
            "rounds": values[ROUNDS],
            "calls": values[CALLS],
            "call_entries": values[CALL_ENTRIES],
        }
    except KeyError as e:
        raise RuntimeError(f"the worker's metrics at {url} lack {e.args[0]}") from None


def at_start(pid: int, url: str) -> Sample:
    """The totals at a row's barrier: the scrape first, so its own CPU is not the row's."""
    got = counters(url)
    return Sample(process_cpu(pid), **got)


def at_end(pid: int, url: str) -> Sample:
    """The totals once a row's engines are done: the CPU first, then the scrape."""
    cpu = process_cpu(pid)
    return Sample(cpu, **counters(url))


def per_round(before: Sample, after: Sample) -> dict:
    """A row's figures from its two samples: the worker's CPU per round apart from its
    drafter's (microseconds; None without a round or without /proc), the drafter's own,
    the resolution (a clock tick over the rounds), and the entries a drafter call
    averaged (None without a call)."""
    rounds, calls = after.rounds - before.rounds, after.calls - before.calls
    drafter = after.drafter_cpu_s - before.drafter_cpu_s
    known = rounds > 0 and before.cpu_s is not None and after.cpu_s is not None
    worker = (after.cpu_s - before.cpu_s - drafter) if known else None
    return {
        "worker_cpu_us_per_round": round(worker / rounds * 1e6, 1) if known else None,
        "drafter_cpu_us_per_round": round(drafter / rounds * 1e6, 1) if rounds > 0 else None,
        "worker_cpu_resolution_us": round(1e6 / os.sysconf("SC_CLK_TCK") / rounds, 1) if known else None,
        "entries_per_call": round((after.call_entries - before.call_entries) / calls, 1) if calls > 0 else None,
    }


def share(entries_per_s: float, drafter_entries_per_s: float | None) -> float | None:
    """A row's entries per second as a share of the drafter's own (None: not measured)."""
    return round(entries_per_s / drafter_entries_per_s, 3) if drafter_entries_per_s else None


def drafter_entries_per_s(args, entries: int) -> float | None:
    """The drafter alone at ``entries`` entries a call (``bench drafter``'s ``cached`` row:
    its median round), the worker's drafter and device (``args``: ``bench worker-engines``'),
    in entries per second; None for a drafter ``bench drafter`` does not measure or rounds
    past the model's positions."""
    from .drafter import BUILTIN, DrafterBenchOptions, makers, run_rows

    if args.drafter != "lm":
        return None
    kind = BUILTIN if args.hf_model_dir is None else "hf"
    make = makers(args.hf_model_dir, "hf")[kind]
    opts = DrafterBenchOptions(
        (entries,), (args.device,), args.num_spec, DRAFTER_ROUNDS, DRAFTER_WARMUP, modes=("cached",)
    )
    rows = run_rows(opts, {kind: make})
    return round(entries / (rows[0]["p50_ms"] / 1e3), 1) if rows and rows[0]["p50_ms"] else None


def add_shares(args, rows: list[dict]) -> None:
    """Each steady row given ``drafter_entries_per_s`` at its entries per call and its
    ``share_of_drafter`` (one measurement per entry count)."""
    measured: dict[int, float | None] = {}
    for r in rows:
        n = r.get("entries_per_call")
        alone = None
        if r["mode"] in SHARED_MODES and n:
            n = max(1, round(n))
            if n not in measured:
                measured[n] = drafter_entries_per_s(args, n)
            alone = measured[n]
        r.update(drafter_entries_per_s=alone, share_of_drafter=share(r.get("entries_per_s", 0.0), alone))

"""What every row of ``remote-dspark bench worker-engines`` (:mod:`.worker_engines`,
:mod:`.worker_long`) shares: its worker's flags and the tokens it keeps a stream, its
engine processes (started with their configs, told "go" and "stop", their lines read
within a bound, ended), the worker's resident set read from /proc (Linux) around the row
and the bound the memory table gives it, and the steady engines' figures; and inside an
engine process, its loops of rounds (timed, with the simulated target's verify step
between them; a storm's) and its stdin.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

WINDOW = 64  # the worker's --window
STORM_SLOTS = 1024  # a storm engine's slots: the worker's own limit
# The interpreter's own growth beside the memory table's numbers: a connection thread's
# stack as touched, its malloc arena and a round's Python objects (measured: 2.2 MiB for
# one connection, 6.8 MiB for eight, on the H200 host), and the worker's once.
THREAD_BYTES, INTERPRETER_BYTES = 1 << 20, 2 << 20


def read_line(proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    """The next line ``proc`` prints, within ``timeout_s``.

    Raises: RuntimeError naming ``what`` was not sent."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    got = proc.stdout.readline() if ready else ""
    if not got:
        raise RuntimeError(f"an engine process sent no {what} within {timeout_s:.0f} s")
    return got


def proc_kib(pid: int, field: str) -> int | None:
    """``field`` (VmRSS, VmHWM) of process ``pid`` in KiB, None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(row.split()[1]) for row in f if row.startswith(field + ":")), None)
    except OSError:
        return None


def barrier_rss(pid: int) -> int | None:
    """Process ``pid``'s resident set in KiB now, its peak reset to it (``clear_refs``
    5: Linux), or None where either cannot be done."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return proc_kib(pid, "VmRSS")


def start_engines(worker, cfgs: list[dict]) -> list[subprocess.Popen]:
    """One engine process per config (:func:`~.worker_engines.engine_main`), each told
    its config; returns once every one is ready (announced and warmed up), or ends them
    all and raises (RuntimeError) when one is not within two minutes."""
    code = "from remote_dspark.bench.worker_engines import engine_main; engine_main()"
    procs = []
    try:
        for e, cfg in enumerate(cfgs):
            p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(p)
            cfg = dict(port=worker.port, identities=[worker.identity, worker.markov_identity], engine_id=100 + e) | cfg
            tell(p, json.dumps(cfg))
        for p in procs:
            read_line(p, 120, "ready")
    except BaseException:
        end_engines(procs)
        raise
    return procs


def tell(p: subprocess.Popen, text: str) -> None:
    """``text`` as a line on ``p``'s stdin."""
    p.stdin.write(text + "\n")
    p.stdin.flush()


def end_engines(procs: list[subprocess.Popen]) -> None:
    """Every engine process ended (its stdin closed: it exits; killed after 10 s)."""
    for p in procs:
        p.stdin.close()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.stdout.close()


def growth(started: int | None, peak: int | None) -> dict:
    """The worker's resident growth over a row (its peak less its set at the barrier)."""
    return {"rss_growth_mb": None if peak is None or started is None else round((peak - started) / 1024, 1)}


def memory_bound(args, hellos: list[tuple], keep: int) -> int:
    """The worker's growth the memory table allows for a row's connections (``hellos``:
    each engine's slots, k and, optionally, whether its session is sampled), whose
    windows keep ``keep`` tokens a stream, in bytes."""
    from .. import wire
    from ..worker.hub_arrays import call_bytes
    from ..worker.limits import Limits
    from ..worker.options import WorkerOptions
    from ..worker.scheduler import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_TOKENS
    from ..worker.windows import Windows

    places = 2 * WorkerOptions().max_connections  # the hub's (server.Worker)
    limits = Limits(max_slots=max(args.slots, STORM_SLOTS), window=WINDOW, max_round_tokens=args.max_round_tokens)
    lanes = args.drafter == "markov"  # a thread each (the Markov lane); else the hub, and its call's arrays
    bound = INTERPRETER_BYTES + (0 if lanes else call_bytes(DEFAULT_MAX_ENTRIES, WINDOW, places))
    for e, (slots, k, *sampled) in enumerate(hellos):
        hello = wire.Hello(b"\0" * 32, b"\0" * 32, e, slots, 0, k, want_sampled=any(sampled))
        bound += limits.served_bytes(hello) + Windows.bytes_of(slots, WINDOW, keep) + (THREAD_BYTES if lanes else 0)
    if args.drafter == "lm" and args.device == "cpu":  # the call's working set in the worker's memory
        from ..drafter.lm.budget import part_limit, working_bytes
        from ..drafter.lm.drafter import LMDrafter
        from ..drafter.lm.hf import load_hf

        d = LMDrafter(device="cpu", cache_slots=0, window=WINDOW)
        if args.hf_model_dir is not None:
            d = load_hf(args.hf_model_dir, "cpu", WINDOW, cache_slots=0)
        tokens = args.max_batch_tokens or DEFAULT_MAX_TOKENS
        bound += working_bytes(d.model, d.store, DEFAULT_MAX_ENTRIES, part_limit(tokens, d.store.columns))
    return bound


def worker_flags(args, mode: str, cache_slots: int) -> tuple[str, ...]:
    """The worker's flags for a row of ``mode`` (a model drafter keeping ``cache_slots``
    streams' KV)."""
    extra = ["--drafter", args.drafter, "--window", str(WINDOW), "--max-slots", str(max(args.slots, 1024))]
    if args.drafter == "lm":
        extra += ["--lm-device", args.device, "--lm-cache-slots", str(cache_slots)]
    if args.hf_model_dir is not None:
        extra = ["--hf-model", args.hf_model_dir, *extra[2:]]
    if mode == "serialized":
        extra.append("--no-batching")
    if mode == "batched-spec":
        extra += ["--lm-speculate", str(args.speculate)]
    for flag in ("max_batch_tokens", "max_round_tokens"):
        if getattr(args, flag) is not None:
            extra += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return tuple(extra)


def acked_keep(worker, slots: int, k: int) -> int:
    """The tokens a stream keeps at ``worker`` (its HELLO_ACK's ``context_tokens``), asked
    by a session of its own, ended at once (before a row's barrier)."""
    from .. import wire
    from ..transport import parse_endpoint
    from ..transport.client import DraftClient

    hello = wire.Hello(bytes.fromhex(worker.identity), bytes.fromhex(worker.markov_identity), 99, slots, 0, k)
    c = DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{worker.port}"), hello, 99, 10.0)
    c.close()
    return c.ack.context_tokens


def steady_row(mode: str, engines: int, slots: int, got: list, wall: float) -> dict:
    """A row's figures from its steady engines' results (:func:`engine`)."""
    import numpy as np

    lat = np.concatenate([g[0] for g in got]) * 1e3
    return {
        "mode": mode,
        "engines": engines,
        "slots": slots,
        "p50_ms": round(float(np.percentile(lat, 50)), 3),
        "p99_ms": round(float(np.percentile(lat, 99)), 3),
        "entries_per_s": round(sum(g[1] for g in got) / wall, 1),
        "draft_tokens": sum(g[2] for g in got),
    }


def timed_rounds(send, took, rounds: int, until, pause, rid: int, clock=time.perf_counter) -> tuple[list, int]:
    """The timed rounds after round ``rid``: ``rounds`` of them (with ``until``: while it
    is True, one at least), each timed on ``clock`` from ``send(rid)`` to its reply;
    ``pause()`` (None: none) between a reply and the next round, outside the timing, as
    ``took(reply)`` (the drafts it counts). Returns (latencies, drafts)."""
    latencies, drafted = [], 0
    while len(latencies) < rounds if until is None else not latencies or until():
        if latencies and pause is not None:
            pause()
        rid += 1
        t0 = clock()
        reply = send(rid)
        latencies.append(clock() - t0)
        drafted += took(reply)
    return latencies, drafted


def storm_rounds(c, engine_id: int, storm, k: int, windows: list, warmup: int) -> tuple[list, int, int, list]:
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


def verify_pause(ms: float, sleep=time.sleep):
    """The simulated target's verify step: a callable that waits ``ms`` milliseconds on
    ``sleep``, or None for 0 (no wait)."""
    return (lambda: sleep(ms / 1e3)) if ms > 0 else None


def stdin_line() -> str:
    """One line of stdin, read a byte at a time from its descriptor: what follows stays in
    the pipe, where the storm's select sees it (a buffered readline of "go" could take a
    "stop" already sent along into its buffer, and the storm would never end)."""
    got = bytearray()
    while not got.endswith(b"\n") and (byte := os.read(0, 1)):
        got += byte
    return got.decode()

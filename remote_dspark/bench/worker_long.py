"""``remote-dspark bench worker-engines --long-slots N``: the ``long`` row. One engine
announces ``N`` slots of ``--long-tokens`` tokens each at once, beside an engine of
``--slots`` slots sending steady rounds (the ``alone`` row's engine).

The long engine speaks the wire itself, so it sends what a chunking engine sends
(:mod:`remote_dspark.engine.values.announce`): contexts cut to HELLO_ACK's
``context_tokens``; a round of at most HELLO_ACK's ``round_tokens`` (the worker's
``--max-round-tokens``), its budget given to the slots oldest first (in slot order); a
slot's first chunk NEW_GEN at position 0, the rest plain entries at the slot's next
position, ``n_out`` 0 until its last chunk, which asks for k drafts (:func:`chunk_rounds`).
Its frames are made before the barrier; it sends each as soon as the last is answered.

The row: the steady engine's rounds from the barrier until the announcement's last reply
(p50, p99: the ``alone`` row's are the same engine's without it), the announcement's
time, and the worker's drafting calls over the row from its ``/metrics``
(``dspark_worker_drafting_duration_seconds``: their count and mean, and the histogram's
bound under which 99 in 100 fall; the encode pieces its long contexts were taken in).
The goal (never asserted): the steady round's delay (its p99 in the row less alone's) at
most one call (the row's mean call).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

LONG_DEADLINE_MS = 600_000  # an announcing round's deadline: a chunk is never dropped as late


def chunk_rounds(slots: int, tokens: int, budget: int) -> Iterator[list[tuple[int, int, int, bool]]]:
    """The rounds that announce ``slots`` contexts of ``tokens`` tokens each, ``budget``
    tokens a round at most, slot after slot: each round's chunks as ``(slot, first,
    count, whole)``, the slot's tokens ``first`` to ``first + count - 1`` (at those
    positions; ``first`` 0: its NEW_GEN), ``whole`` when they end its context.

    Raises: ValueError for a count or budget under 1."""
    if min(slots, tokens, budget) < 1:
        raise ValueError(f"slots {slots}, tokens {tokens}, budget {budget}: each must be >= 1")
    sent, total = 0, slots * tokens  # tokens sent of all contexts, one after another
    while sent < total:
        end, chunks = min(total, sent + budget), []
        while sent < end:
            slot, first = divmod(sent, tokens)
            count = min(tokens - first, end - sent)
            chunks.append((slot, first, count, first + count == tokens))
            sent += count
        yield chunks


def long_engine(port: int, identities, engine_id: int, slots: int, tokens: int, k: int, ready, go) -> dict:
    """The announcing engine (an engine process's, :func:`~.worker_engines.engine_main`):
    HELLO, its rounds' frames made, ``ready()``, ``go()``, then the rounds one after
    another. Returns its figures: the tokens a context had (cut to ``context_tokens``),
    the rounds, draft tokens, and the span [first send, last reply] (monotonic)."""
    import numpy as np

    from .. import wire
    from ..drafter.markov import SyntheticLanguage
    from ..transport import parse_endpoint
    from ..transport.client import DraftClient

    text = np.asarray(SyntheticLanguage().text(1 << 16, seed=engine_id), np.int32)
    hello = wire.Hello(*identities, engine_id, slots, 0, k)
    c = DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{port}"), hello, engine_id, 10.0)
    try:
        tokens = min(tokens, c.ack.context_tokens)
        at = np.random.default_rng(engine_id).integers(0, len(text), slots)
        frames = []
        for rid, chunks in enumerate(chunk_rounds(slots, tokens, c.ack.round_tokens), 2):
            offsets = np.cumsum([0] + [n for _, _, n, _ in chunks]).tolist()
            flat = [np.take(text, at[s] + np.arange(first, first + n), mode="wrap") for s, first, n, _ in chunks]
            frames.append(
                wire.encode_round(
                    rid,
                    engine_id,
                    LONG_DEADLINE_MS,
                    slots=[s for s, *_ in chunks],
                    positions=[first for _, first, _, _ in chunks],
                    n_out=[k if whole else 0 for *_, whole in chunks],
                    flags=[wire.FLAG_NEW_GEN if first == 0 else 0 for _, first, _, _ in chunks],
                    offsets=offsets,
                    tokens=np.concatenate(flat).tolist(),
                    rows=b"",
                    row_bytes=0,
                )
            )
        ready()
        go()
        drafted, start = 0, time.monotonic()
        for rid, frame in enumerate(frames, 2):
            drafted += int(sum(c.round(rid, [frame], LONG_DEADLINE_MS).counts))
        return {"tokens": tokens, "rounds": len(frames), "draft_tokens": drafted, "span": [start, time.monotonic()]}
    finally:
        c.close()


CALLS = "dspark_worker_drafting_duration_seconds"
PIECES = "dspark_worker_encode_pieces"


def scrape(url: str) -> dict:
    """The worker's drafting calls so far from its ``/metrics``: their histogram's
    ``count``, ``sum`` and cumulative ``buckets`` ({upper bound: calls}), and its encode
    pieces."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(url, timeout=10) as r:
        text = r.read().decode()
    got = {"count": 0.0, "sum": 0.0, "buckets": {}, "pieces": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == CALLS + "_bucket":
                got["buckets"][float(s.labels["le"])] = s.value
            elif s.name in (CALLS + "_count", CALLS + "_sum"):
                got[s.name.rsplit("_", 1)[1]] = s.value
            elif s.name == PIECES + "_total":
                got["pieces"] = s.value
    return got


def calls_between(before: dict, after: dict) -> dict:
    """The calls of a row from two scrapes: their count, mean (ms), the bound (ms) under
    which 99 in 100 fall (the histogram's bucket), and the encode pieces."""
    n = after["count"] - before["count"]
    p99 = None
    for bound in sorted(after["buckets"]):
        if n and after["buckets"][bound] - before["buckets"].get(bound, 0.0) >= 0.99 * n:
            p99 = bound
            break
    return {
        "calls": int(n),
        "call_mean_ms": round((after["sum"] - before["sum"]) / n * 1e3, 3) if n else None,
        "call_p99_ms_at_most": None if p99 is None else (p99 * 1e3 if p99 != float("inf") else None),
        "encode_pieces": int(after["pieces"] - before["pieces"]),
    }


def measure_long(args, bar) -> dict:
    """The ``long`` row (module docstring): a worker of its own with its ``/metrics``, the
    steady engine (until the announcement is answered) and the announcing one."""
    from ..demo.harness import WorkerProcess
    from .engine_procs import (
        acked_keep,
        barrier_rss,
        end_engines,
        growth,
        memory_bound,
        proc_kib,
        read_line,
        start_engines,
        steady_row,
        tell,
        worker_flags,
    )

    steady = dict(slots=args.slots, rounds=1, k=args.num_spec, warmup=args.warmup, until=True)
    announcing = dict(long=True, slots=args.long_slots, tokens=args.long_tokens, k=args.num_spec)
    extra = worker_flags(args, "long", args.slots + args.long_slots) + ("--metrics-port", "0")
    with WorkerProcess(chaos=False, extra=extra) as worker:
        keep = acked_keep(worker, args.slots, args.num_spec)
        procs = start_engines(worker, [steady, announcing])
        try:
            before, started = scrape(worker.metrics_url), barrier_rss(worker.proc.pid)
            for p in procs:
                tell(p, "go")
            long = json.loads(read_line(procs[1], 3600, "announcement's result"))
            bar("long: announced")
            tell(procs[0], "stop")
            got = json.loads(read_line(procs[0], 600, "result"))
            peak = proc_kib(worker.proc.pid, "VmHWM") if started is not None else None
            calls = calls_between(before, scrape(worker.metrics_url))
        finally:
            end_engines(procs)
    row = steady_row("long", 2, args.slots, [got], got[3][1] - got[3][0])
    hellos = [(args.slots, args.num_spec), (args.long_slots, args.num_spec)]
    row.update(growth(started, peak), rss_bound_mb=round(memory_bound(args, hellos, keep) / 2**20, 2))
    row.update(long_slots=args.long_slots, long_tokens=long["tokens"], long_rounds=long["rounds"])
    row.update(announce_s=round(long["span"][1] - long["span"][0], 3), long_draft_tokens=long["draft_tokens"])
    row.update(calls)
    return row


def long_goal(by: dict) -> dict | None:
    """The goal of the ``long`` row against ``alone`` (module docstring), or None."""
    if "long" not in by or "alone" not in by or not by["long"]["call_mean_ms"]:
        return None
    delay = by["long"]["p99_ms"] - by["alone"]["p99_ms"]
    x = delay / by["long"]["call_mean_ms"]
    return {"goal": "steady p99 delay in the announcement <= one call (mean)", "value": round(x, 2), "met": x <= 1.0}


def long_line(row: dict) -> str:
    """The ``long`` row's own figures, a line under the table."""
    return (
        f"long: {row['long_slots']} slots x {row['long_tokens']} tokens announced in {row['long_rounds']} rounds, "
        f"{row['announce_s']:.3f} s; worker calls {row['calls']}, mean {row['call_mean_ms']} ms, "
        f"p99 <= {row['call_p99_ms_at_most']} ms; encode pieces {row['encode_pieces']}"
    )

"""``remote-dspark demo``: a loopback worker and a simulated engine drafting through it.

This first demo drives synchronous rounds through the project's own transport and
client (HELLO, ROUND, DRAFTS) and prints what happened: rounds by outcome, round
latency percentiles and accepted drafts per position.
"""

from __future__ import annotations

import argparse
import os
import time

from . import wire
from .client import DraftClient
from .markov import builtin_model
from .progress import Progress
from .sim import SimEngine
from .transport import DeadlineExceeded, Disconnected, parse_endpoint
from .worker import MarkovDrafter, Worker


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="loopback worker + simulated engine; prints what happened",
                       description="Start a reference worker on 127.0.0.1 (a free port), connect a "
                                   "simulated engine through the project's transport, run ROUNDS "
                                   "drafting rounds of SLOTS request slots and print the outcome.")
    p.add_argument("--rounds", type=_positive, default=300, help="rounds to run (default 300)")
    p.add_argument("--slots", type=_positive, default=64, help="request slots per round (default 64)")
    p.add_argument("--num-spec", type=_positive, default=5, help="draft tokens per slot (default 5)")
    p.add_argument("--timeout-ms", type=_positive, default=50, help="per-round deadline (default 50)")
    p.add_argument("--row-bytes", type=int, default=256, help="opaque row bytes per slot (default 256)")
    p.set_defaults(func=run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def run(args: argparse.Namespace) -> int:
    drafter = MarkovDrafter(builtin_model())
    with Worker(drafter, "127.0.0.1", 0) as worker:
        endpoint = parse_endpoint(f"tcp://127.0.0.1:{worker.port}")
        print(f"worker on {endpoint}; drafter {drafter.drafter_identity.hex()[:16]}..., "
              f"markov {drafter.markov_identity.hex()[:16]}...")
        hello = wire.Hello(drafter.drafter_identity, drafter.markov_identity, engine_id=os.getpid(),
                           max_slots=args.slots, row_bytes=args.row_bytes, num_spec=args.num_spec)
        client = DraftClient.connect(endpoint, hello, session=1, timeout_s=1.0)
        report = drive(client, SimEngine(args.slots, args.num_spec), args.rounds, args.timeout_ms,
                       args.row_bytes)
        client.close()
    print_report(report)
    return 0 if report["outcomes"]["ok"] else 1


def drive(client: DraftClient, sim: SimEngine, rounds: int, timeout_ms: int, row_bytes: int,
          progress=None) -> dict:
    outcomes = {"ok": 0, "timeout": 0, "error": 0}
    latencies: list[float] = []
    rows = bytes(len(sim.slots) * row_bytes)
    bar = Progress(rounds, "rounds", progress)
    for r in range(1, rounds + 1):
        entries = sim.entries()
        t0 = time.perf_counter()
        drafts = None
        try:
            reply = client.round(r, wire.round_parts(r, client.session, timeout_ms, entries, rows, row_bytes),
                                 timeout_ms)
        except DeadlineExceeded:
            outcomes["timeout"] += 1
            sim.reannounce()
        except (Disconnected, wire.ProtocolError):
            outcomes["error"] += 1
            sim.reannounce()
        else:
            latencies.append(time.perf_counter() - t0)
            outcomes["ok"] += 1
            sim.sent()
            drafts = [reply.row(i) for i in range(len(entries))]
            sim.reannounce([e.slot for e, st in zip(entries, reply.statuses) if st == wire.STATUS_RESYNC])
        sim.verify(drafts)
        bar.update(r)
    return {"rounds": rounds, "outcomes": outcomes, "latencies": latencies,
            "accepted_at": sim.accepted_at, "offered_at": sim.offered_at,
            "tokens": sim.tokens, "late": client.late}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def print_report(rep: dict) -> None:
    print("\nrounds by outcome")
    for k, v in rep["outcomes"].items():
        print(f"  {k:<10}{v:>8}")
    print(f"  {'late':<10}{rep['late']:>8}")
    lat = rep["latencies"]
    print("round latency (ms): " + "  ".join(
        f"{name} {percentile(lat, q) * 1e3:.3f}" for name, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0))))
    print("accepted drafts by position")
    for i, (a, o) in enumerate(zip(rep["accepted_at"], rep["offered_at"])):
        print(f"  pos {i}: {a:>7} of {o:>7} offered ({a / o * 100 if o else 0:5.1f}%)")
    print(f"tokens decoded: {rep['tokens']} in {rep['rounds']} rounds "
          f"({rep['tokens'] / max(1, rep['rounds'] * 1):.1f} per round over all slots)")

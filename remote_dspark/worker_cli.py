"""``remote-dspark worker``: run the reference remote drafter."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from . import wire
from .worker import DEFAULT_LISTEN, Worker, load_drafter, parse_listen


def add_parser(sub) -> None:
    p = sub.add_parser(
        "worker", help="run the reference remote drafter (tcp://) on loopback",
        description="Serve drafts over the wire contract. Prints the drafter and Markov "
                    "identities at start: copy them into the engine's VLLM_DSPARK_REMOTE_IDENTITY "
                    "and VLLM_DSPARK_REMOTE_MARKOV_IDENTITY. Stops cleanly on SIGTERM or Ctrl-C.")
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                   help=f"address to listen on (default {DEFAULT_LISTEN}; only loopback unless you say otherwise)")
    p.add_argument("--markov", metavar="FILE", help="Markov cache file (default: the built-in model)")
    p.add_argument("--drafter", metavar="MODULE:FACTORY",
                   help="use FACTORY() from MODULE (imported by name from sys.path) as the drafter instead "
                        "of the Markov model: an object with draft_batch(batch) (one call per round, "
                        "remote_dspark/drafter.py) or, the slow path, draft(context, n_out, row) per entry")
    p.add_argument("--identity", metavar="HEX64", help="drafter identity to require (default: derived from the model)")
    p.add_argument("--window", type=int, default=64, help="tokens kept per slot (default 64)")
    p.add_argument("--max-slots", type=int, default=wire.MAX_ENTRIES, help="slots allowed per session")
    p.add_argument("--max-connections", type=int, default=64, help="connections served at once")
    p.add_argument("--chaos", action="store_true",
                   help="fault injection for chaos runs: SIGUSR1 toggles answering every round "
                        "--late-ms late, SIGUSR2 garbles the next reply")
    p.add_argument("--late-ms", type=int, default=200, help="the delay SIGUSR1 switches on (default 200)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    host, port = parse_listen(args.listen)
    for name in ("window", "max_slots", "max_connections"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    identity = wire.parse_hex32(args.identity, "--identity") if args.identity else None
    drafter = load_drafter(args.drafter, args.markov, identity)
    worker = Worker(drafter, host, port, window=args.window, max_slots=args.max_slots,
                    max_connections=args.max_connections)
    if args.chaos:  # before the first line: a chaos driver signals as soon as it reads it
        def toggle_late(*_):
            worker.reply_delay_s = 0.0 if worker.reply_delay_s else args.late_ms / 1000.0

        def garble(*_):
            worker.garble += 1
        signal.signal(signal.SIGUSR1, toggle_late)
        signal.signal(signal.SIGUSR2, garble)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    worker.start()
    print(f"remote-dspark worker listening on tcp://{host}:{worker.port}", flush=True)
    print(f"  VLLM_DSPARK_REMOTE_IDENTITY={drafter.drafter_identity.hex()}", flush=True)
    print(f"  VLLM_DSPARK_REMOTE_MARKOV_IDENTITY={drafter.markov_identity.hex()}", flush=True)
    done.wait()
    worker.stop()
    s = worker.stats
    print(f"worker stopped: {s.connections} connections, {s.rounds} rounds, {s.draft_tokens} draft tokens, "
          f"{s.refused} refused, {s.bad_frames} bad frames", file=sys.stderr)
    return 0

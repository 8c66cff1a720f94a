"""``remote-dspark``: the command line.

Each subcommand lives in the module that owns its work; this file only parses
arguments and maps errors to exit codes (2: bad input or configuration).
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand's parser (each from the module that owns its work)."""
    parser = argparse.ArgumentParser(
        prog="remote-dspark",
        description="Run a speculative-decoding drafter on another machine without stalling the engine.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from ..demo import chaos, demo
    from . import check_config, dashboard
    from . import markov as markov_cli
    from . import worker as worker_cli

    worker_cli.add_parser(sub)
    demo.add_parser(sub)
    chaos.add_parser(sub)
    check_config.add_parser(sub)
    markov_cli.add_parser(sub)
    dashboard.add_parser(sub)

    bench = sub.add_parser(
        "bench",
        help="benchmarks that print figures and ratios measured in one run",
        description="Benchmarks. Each prints its figures side by side; --json for machines.",
    )
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    from ..bench import add_parsers as add_bench_parsers

    add_bench_parsers(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # bad input: a clear message, no traceback
        print(f"remote-dspark {args.command}: {e}", file=sys.stderr)
        return 2

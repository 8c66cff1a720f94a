"""``remote-dspark``: the command line.

Each subcommand lives in the module that owns its work; this file only parses
arguments and maps errors to exit codes (2: bad input or configuration).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import NoReturn


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


class Terminated(KeyboardInterrupt):
    """SIGTERM: raised in the main thread, so a command stops as on Ctrl-C, through every
    ``with`` and ``finally`` on its way out (its worker stopped, its engine closed)."""


class _SigtermStops:
    """While a command runs, SIGTERM raises :class:`Terminated` in the main thread (once;
    a command with a handler of its own, the worker's, replaces this one), and the
    previous handler comes back afterwards. Off the main thread it does nothing (Python
    sets handlers only there)."""

    def __init__(self):
        self._raised = False  # the first SIGTERM raised; later ones return, so the cleanup runs whole
        self._previous = None
        self._installed = threading.current_thread() is threading.main_thread()

    def _handle(self, signum, frame) -> None:
        # A handler that returns, not SIG_IGN, for the later ones: an ignored signal is
        # inherited by a process spawned during the cleanup (a proxy's PDEATHSIG is SIGTERM).
        if not self._raised:
            self._raised = True
            raise Terminated

    def __enter__(self) -> _SigtermStops:
        if self._installed:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)


def entry() -> NoReturn:
    """The installed command and ``python -m remote_dspark``: :func:`main`, then the
    process ends with its code. A command whose parser sets ``ends_at_once`` (the worker:
    its ``stop()`` has released every socket, thread and file it held) ends it with
    ``os._exit`` once logging and stdio are flushed, skipping the interpreter's teardown,
    which for a process that imported torch (a model worker) takes 0.3 s idle and 1 to 2
    s on a loaded host after the work is already done: a stopped worker is gone at once."""
    args = build_parser().parse_args()
    code = run_command(args)
    if getattr(args, "ends_at_once", False):
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a reader gone (a closed pipe): the code still stands
                pass
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run one command; exit codes: its own, 2 for bad input, 130 after Ctrl-C, 143
    after SIGTERM (each a clean stop)."""
    return run_command(build_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """:func:`main` for parsed arguments."""
    try:
        with _SigtermStops():
            return int(args.func(args) or 0)
    except Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # bad input: a clear message, no traceback
        print(f"remote-dspark {args.command}: {e}", file=sys.stderr)
        return 2

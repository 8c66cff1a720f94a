"""``remote-dspark``: the command line.

Each subcommand lives in the module that owns its work; this file only parses
arguments and maps errors to exit codes (2: bad input or configuration).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
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
    _plain_everywhere(parser)
    return parser


# A Sphinx role with its target (:mod:`x`, :func:`~a.b.c`, :class:`text <a.b.C>`), and a
# literal (``x``): what a docstring may hold and a terminal should not show.
_ROLE = re.compile(r":[a-z]+:`(?:(?P<title>[^`<]*?)\s*<[^`>]*>|(?P<short>~?)\.*(?P<target>[^`]*?))`")
_LITERAL = re.compile(r"``(.*?)``", re.S)


def _role_words(m: re.Match) -> str:
    if m["title"] is not None:
        return m["title"]
    return m["target"].rsplit(".", 1)[-1] if m["short"] else m["target"]


def plain(text: str | None) -> str | None:
    """``text`` as a terminal shows it: every Sphinx role by its words (its title, else its
    target; a ``~`` target by its last name, a relative one without its dots) and every
    double-backtick literal by its bare text. The one rule for every --help: each command
    keeps writing its texts as its docstrings do, and :func:`build_parser` applies this
    to all of them."""
    return _LITERAL.sub(r"\1", _ROLE.sub(_role_words, text)) if text else text


def _plain_everywhere(parser: argparse.ArgumentParser) -> None:
    """:func:`plain` over every text of ``parser`` and its subcommands, however deep:
    descriptions, epilogs, group descriptions and each argument's help."""
    parser.description, parser.epilog = plain(parser.description), plain(parser.epilog)
    for group in parser._action_groups:
        group.description = plain(group.description)
    for action in parser._actions:
        action.help = plain(action.help)
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                choice.help = plain(choice.help)
            for sub in set(action.choices.values()):
                _plain_everywhere(sub)


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
    except ModuleNotFoundError as e:  # an install without the command's extra (a worker-only one's demo)
        extra = _extra_for(args.command, e.name or "")
        if extra is None:
            raise
        print(
            f"remote-dspark {args.command}: needs {e.name}, which this install lacks: "
            f"install the {extra} extra (pip install '.[{extra}]' from a clone, or its wheel's [{extra}])",
            file=sys.stderr,
        )
        return 2


# The extra that brings each optional dependency: the engine's for every command that
# runs an engine (demo, chaos, the benchmarks); the worker's own for the worker, whose
# model drafters name their extras themselves.
_ENGINE_EXTRA = {"torch": "engine", "numpy": "engine", "psutil": "engine", "prometheus_client": "engine"}
_EXTRAS = {"worker": {"numpy": "worker", "prometheus_client": "worker"}}


def _extra_for(command: str, module: str) -> str | None:
    """The extra a command needs for ``module`` (a dotted name: its top package counts),
    or None when no extra brings it (a genuine bug, raised as it is)."""
    return _EXTRAS.get(command, _ENGINE_EXTRA).get(module.split(".", 1)[0])

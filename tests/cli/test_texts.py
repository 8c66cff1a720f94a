"""What the command line says to a person: every --help in plain words (no Sphinx markup,
no word of how the code was made), and an install without a command's extra told which
extra to install in one line."""

import argparse
import re
import subprocess
import sys

import pytest

from remote_dspark.cli.main import build_parser, plain


def every_help(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, its --help) for the command line and every subcommand, however deep."""
    yield " ".join(path), parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from every_help(sub, (*path, name))


# Markup a docstring may hold (a role, a literal, a bare backtick) and words about how the
# code was made rather than what it does.
NOT_PLAIN = re.compile(r":[a-z]+:`|`|\bissues?\b|module docstring", re.I)


def test_every_help_is_plain_words():
    helps = dict(every_help(build_parser()))
    assert {"demo", "bench worker-engines", "bench round", "worker"} <= set(helps)  # the walk reaches them
    bad = {cmd: sorted(set(NOT_PLAIN.findall(text))) for cmd, text in helps.items() if NOT_PLAIN.search(text)}
    assert not bad, f"--help texts with markup or references to how the code was made: {bad}"


@pytest.mark.parametrize(
    "text, shown",
    [
        (":mod:`remote_dspark.harness` decodes", "remote_dspark.harness decodes"),
        ("its :class:`~remote_dspark.worker.windows.Windows` builds", "its Windows builds"),
        ("in chunks (:mod:`.worker_long`)", "in chunks (worker_long)"),
        (":func:`the loader <remote_dspark.drafter.lm.hf.load>`", "the loader"),
        ("``--kill-proxy-every N`` kills, ``min(32,\n--window)``", "--kill-proxy-every N kills, min(32,\n--window)"),
        ("no markup: 2 * 3 < 7", "no markup: 2 * 3 < 7"),
    ],
)
def test_plain_shows_the_words_of_the_markup(text, shown):
    assert plain(text) == shown


def test_demo_without_torch_names_the_extra_in_one_line():
    """A worker-only install (no torch): ``remote-dspark demo`` says which extra it needs,
    exit 2, no traceback, before it starts anything."""
    code = (
        "import sys; sys.modules['torch'] = None\n"  # `import torch` fails as where it is not installed
        "from remote_dspark.cli.main import main\n"
        "raise SystemExit(main(['demo', '--rounds', '1']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "remote-dspark demo: needs torch, which this install lacks: install the engine extra "
        "(pip install '.[engine]' from a clone, or its wheel's [engine])"
    ]

"""The docs say what the code does: the README's example is the example the suite runs,
and every extra, command, variable and link the README and docs/ name exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import tomllib

from remote_dspark.cli import build_parser
from remote_dspark.config_env import ENV_ENDPOINT, ENV_MARKOV_CACHE, VARIABLES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {
    p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_readme_example_is_the_example_the_suite_runs():
    example = (ROOT / "examples" / "engine_step.py").read_text()
    block = python_blocks(README.split("## In an engine", 1)[1])[0]
    imports, _, body = block.partition("\n\n\n")
    assert body.startswith("def engine(")
    assert body in example, "README's engine() differs from examples/engine_step.py's"
    for line in imports.splitlines():
        assert line in example.splitlines(), line


def test_every_extra_named_is_declared_and_every_declared_one_is_named():
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {x for group in re.findall(r"remote-dspark\[([a-z,]+)\]", README) for x in group.split(",")}
    assert named == declared


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> set[str]:
    out = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.add(prefix + name)
                out |= subcommands(sub, prefix + name + " ")
    return out


def test_every_command_the_docs_run_exists():
    known = subcommands(build_parser())
    for doc, text in DOCS.items():
        for cmd in re.findall(
            r"`remote-dspark ((?:bench )?[a-z][a-z-]*)|^\$? ?remote-dspark ((?:bench )?[a-z][a-z-]*)", text, re.M
        ):
            cmd = "".join(cmd)
            assert cmd in known, f"{doc} runs remote-dspark {cmd}, which is no command"


def test_every_variable_the_docs_name_is_in_the_contract():
    contract = set(VARIABLES) | {ENV_ENDPOINT, ENV_MARKOV_CACHE}
    for doc, text in DOCS.items():
        for var in set(re.findall(r"\bVLLM_DSPARK_[A-Z0-9_]*[A-Z0-9]", text)):
            assert var in contract, f"{doc} names {var}, which the environment contract does not have"


def test_every_relative_link_resolves():
    for doc, text in DOCS.items():
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (ROOT / doc).parent.joinpath(target).exists(), f"{doc} links {target}"

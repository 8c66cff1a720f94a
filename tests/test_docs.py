"""The docs say what the code does: the README's example is examples/engine_step.py and
runs as written, and every extra, command, variable, link (with its heading), package
file, metric and worker option the README and every page under docs/ name exists."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import REPO, drafter_env

from remote_dspark.cli.main import build_parser
from remote_dspark.config.env import ENV_ENDPOINT, ENV_MARKOV_CACHE, VARIABLES

ROOT = Path(REPO)
README = (ROOT / "README.md").read_text()
DOCS = {
    p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
}


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def readme_example() -> str:
    return python_blocks(README.split("## In an engine", 1)[1])[0]


def test_the_readme_example_is_examples_engine_step():
    assert readme_example() == (ROOT / "examples" / "engine_step.py").read_text(), (
        "README's example differs from examples/engine_step.py"
    )


@pytest.mark.slow
def test_the_readme_example_runs_as_written(tmp_path):
    """The README's block, saved as it stands and run by itself: a toy engine in process
    mode against its own loopback worker, every round answered, drafts accepted."""
    program = tmp_path / "readme_example.py"
    program.write_text(readme_example())
    out = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("30 rounds (30 ok), ") and "mode process" in line, line


def test_every_page_under_docs_is_checked():
    """The checks below read every page under docs/, however deep: a new folder of pages
    is covered without touching this file."""
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages and pages <= set(DOCS)
    assert {"docs/design.md", "docs/benchmarks.md", "docs/integration.md"} <= pages


def test_every_extra_named_is_declared_and_every_declared_one_is_named():
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {x for group in re.findall(r"(?:remote-dspark|\.|\.whl)\[([a-z,]+)\]", README) for x in group.split(",")}
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


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.S), re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return out


def test_every_relative_link_resolves():
    for doc, text in DOCS.items():
        for target, anchor in re.findall(r"\]\(([^)#:]*)(?:#([^)]*))?\)", text):
            path = (ROOT / doc).parent.joinpath(target) if target else ROOT / doc
            assert path.exists(), f"{doc} links {target}"
            if anchor and path.suffix == ".md":
                assert anchor in anchors(path.read_text()), f"{doc} links {target}#{anchor}, no such heading"


# --- names the docs use ---------------------------------------------------------------


NOT_THE_PACKAGES = {"argparse.py"}  # named as a file a user might plant, not one of ours


def test_every_package_path_the_docs_name_exists():
    """``remote_dspark/...``, ``native/x.c`` and ``layout.py``-style names: a file
    moved or renamed without the docs fails here."""
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "remote_dspark").rglob("*") if p.is_file()}
    names = {Path(f).name for f in files}
    for doc, text in DOCS.items():
        for path in set(re.findall(r"\bremote_dspark/[\w/.*-]*\w", text)):
            hits = [f for f in files if Path(f).match(path) or f == path or f.startswith(path + "/")]
            assert hits, f"{doc} names {path}, which does not exist"
        for name in set(re.findall(r"`(?:native/)?([a-z_]+\.(?:py|c|h))`", text)) - NOT_THE_PACKAGES:
            assert name in names, f"{doc} names {name}, which no file of the package is"


def _families(collector) -> set[str]:
    """Every name a scrape shows for the collector's families: the family's own and its
    samples' (``_total``, ``_bucket``, ``_info`` ...)."""
    out = set()
    for fam in collector.collect():
        out.add(fam.name)
        out.update(s.name for s in fam.samples)
    return out


@pytest.fixture(scope="module")
def exposed(tmp_path_factory) -> set[str]:
    """The metric names a process-mode engine (margins asked for) and a worker with a
    cache and a speculation cache expose, collected from their real collectors."""
    from remote_dspark.config import Mode
    from remote_dspark.config.api import RemoteConfig
    from remote_dspark.drafter import CacheInfo, MarkovDrafter
    from remote_dspark.drafter.contract import SpecInfo
    from remote_dspark.drafter.markov import MarkovModel
    from remote_dspark.engine import RemoteDSpark
    from remote_dspark.engine.observe.metrics import RemoteDSparkCollector
    from remote_dspark.worker import Worker
    from remote_dspark.worker.metrics import WorkerCollector

    class Cached(MarkovDrafter):
        def cache_info(self) -> CacheInfo:
            return CacheInfo(slots=1, capacity=2, bytes=3, hits=4, misses=5)

        def spec_info(self) -> SpecInfo:
            return SpecInfo(outcomes=1, hits=(1,), misses=0, dropped=0, seconds=0.0, held=0, blocks=0)

    drafter = Cached(MarkovModel.from_tokens([1, 2, 3] * 10, order=1, top=1))
    worker = Worker(drafter, "127.0.0.1", 0, metrics_port=0).start()
    try:
        stats = str(tmp_path_factory.mktemp("exposed") / "stats.json")
        env = drafter_env(drafter, worker.port, Mode.PROCESS, stats_file=stats, VLLM_DSPARK_REMOTE_WANT_MARGIN="1")
        rd = RemoteDSpark(RemoteConfig.from_env(env), num_spec=2, max_slots=4, row_bytes=4, environ=env).start()
        try:
            names = _families(RemoteDSparkCollector(rd))
        finally:
            rd.close()
        return names | _families(WorkerCollector(worker))
    finally:
        worker.stop()


def test_every_metric_the_docs_name_is_exposed(exposed):
    assert {"dspark_remote_rounds_total", "dspark_worker_round_duration_seconds_bucket"} <= exposed
    for doc, text in DOCS.items():
        for name in set(re.findall(r"\bdspark_(?:remote|worker)_[a-z0-9_]*[a-z0-9]", text)):
            assert name in exposed, f"{doc} names the metric {name}, which nothing exposes"


def test_every_worker_option_the_docs_name_exists():
    """Options the docs give ``remote-dspark worker`` (in its command lines, and every
    option named in a sentence about the worker's limits) are the parser's."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    worker_opts = {o for a in sub.choices["worker"]._actions for o in a.option_strings}
    for doc, text in DOCS.items():
        named = set()
        for line in re.findall(r"remote-dspark worker\b([^\n`]*)", text):
            named |= set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", line))
        for para in re.split(r"\n\s*\n", text):
            if re.search(r"\bworker\b", para, re.I) and not re.search(r"remote-dspark (?!worker)[a-z]", para):
                named |= set(re.findall(r"`(--(?:max|hello|frame|lm|hf|metrics|window|drafter)[a-z-]*)", para))
        assert not named - worker_opts, f"{doc} gives the worker {sorted(named - worker_opts)}, which it lacks"


def mod_references(path: Path, module: str, is_package: bool) -> list[tuple[str, str]]:
    """``(reference, the module it names)`` for every ``:mod:`` reference in a module's
    source, relative ones resolved against the module's package."""
    here = module if is_package else module.rpartition(".")[0]
    out = []
    for ref in re.findall(r":mod:`~?([\w.]+)`", path.read_text()):
        name = ref.lstrip(".")
        if name != ref:  # relative: one dot is the module's own package
            parts = here.split(".")
            parts = parts[: len(parts) - (len(ref) - len(name)) + 1]
            name = ".".join(parts + ([name] if name else []))
        out.append((ref, name))
    return out


def test_every_module_reference_in_the_package_resolves(tmp_path):
    """A ``:mod:`` reference in a docstring names a module of the package: a module moved
    or renamed without its references fails here."""
    from test_layout import module_files

    files = module_files()
    broken = [
        f"{module}: {ref}"
        for module, path in files.items()
        for ref, name in mod_references(path, module, path.name == "__init__.py")
        if name.split(".")[0] == "remote_dspark" and name not in files
    ]
    assert not broken, "module references to nothing: " + "; ".join(broken)
    # The check itself: a relative reference that names nothing is caught.
    (tmp_path / "m.py").write_text('"""See :mod:`.gone` and :mod:`~remote_dspark.wire`."""\n')
    assert mod_references(tmp_path / "m.py", "remote_dspark.proxy.m", False) == [
        (".gone", "remote_dspark.proxy.gone"),
        ("remote_dspark.wire", "remote_dspark.wire"),
    ]


def test_the_readme_tree_names_only_what_exists():
    """README's tree of the package: every folder it shows exists and every module it
    lists beside a folder is a module (or a folder) of it."""
    block = README.split("The package's folders are its parts", 1)[1].split("```", 2)[1]
    package = Path(REPO) / "remote_dspark"
    for line in block.strip().splitlines():
        columns = re.split(r"\s{2,}", line.strip())
        folders = [c for c in columns if c.endswith("/") and " " not in c]
        for folder in folders:
            here = package if folder == "remote_dspark/" else package / folder
            assert here.is_dir(), f"README's tree shows {folder}, which is not a folder of the package"
        if len(columns) < 2 or columns[1] in folders:
            continue
        here = package if columns[0] == "remote_dspark/" else package / columns[0]
        for word in columns[1].split():
            if word.startswith("("):
                break
            if word != "..." and "*" not in word:
                assert (here / f"{word}.py").exists() or (here / word).is_dir(), (
                    f"README's tree lists {here.name}/{word}"
                )


def test_every_test_file_named_exists():
    """A test file the docs, the package's sources (Python and C), the manifests or the
    examples name as the one that holds a rule exists where they say."""
    sources = [*DOCS.items()]
    for folder, pattern in (("remote_dspark", "*.py"), ("remote_dspark", "*.[ch]"), ("deploy", "*"), ("examples", "*")):
        for p in sorted((ROOT / folder).rglob(pattern)):
            if p.is_file() and "__pycache__" not in p.parts:
                sources.append((p.relative_to(ROOT).as_posix(), p.read_text()))
    missing = sorted(
        f"{name} names {path}"
        for name, text in sources
        for path in set(re.findall(r"\btests/[\w/]+\.py\b", text))
        if not (ROOT / path).is_file()
    )
    assert not missing, "test files named that do not exist: " + "; ".join(missing)

"""The repository's Dockerfile read as data, and its steps run as shell outside a builder.

``parse`` gives the build's global ARGs and its stages, each a list of instructions (line
continuations joined, comments dropped). ``run_stages`` runs them in order on this
machine, as a builder would in a fresh image, with three differences it owns:

- one filesystem for every stage: paths are the ARGs the test overrides (a temporary
  directory), so ``COPY --from`` of a stage's own path is a no-op;
- the RUN steps named in ``skips`` (each must match exactly one step, so a stale list
  fails) do not run; every other step does, with ``/bin/sh -c`` as a builder runs it;
- ``base_env`` is the base image's environment (PATH, and what the caller adds).

Only the instructions the Dockerfile uses are known; any other stops the run naming it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

STEP_TIMEOUT_S = 120


@dataclass(frozen=True)
class Instruction:
    op: str  # upper case: RUN, COPY, ...
    args: str  # the rest of the instruction, continuations joined
    line: int  # where it starts (1-based)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, op: str) -> list[Instruction]:
        return [i for i in self.instructions if i.op == op]


def instructions(text: str) -> list[Instruction]:
    """Every instruction of a Dockerfile, in order."""
    out, parts, start = [], [], 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # a comment (or a blank line) also inside a continued instruction
        if not parts:
            start = n
        continued = stripped.endswith("\\")
        parts.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            op, _, args = " ".join(parts).partition(" ")
            out.append(Instruction(op.upper(), args.strip(), start))
            parts = []
    assert not parts, "the Dockerfile ends inside a continued instruction"
    return out


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """The ARGs before the first FROM (name -> default) and the stages."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instructions(text):
        if ins.op == "FROM":
            words = ins.args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert ins.op == "ARG", f"line {ins.line}: {ins.op} before the first FROM"
            name, _, default = ins.args.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append(ins)
    return global_args, stages


_VAR = re.compile(r"\$\{(\w+)(?::([-+])([^}]*))?\}|\$(\w+)")


def expand(text: str, values: dict[str, str]) -> str:
    """A builder's substitution: ``$x``, ``${x}``, ``${x:-default}``, ``${x:+alternative}``."""

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        value = values.get(name, "")
        if m.group(2) == "-":
            return value or m.group(3)
        if m.group(2) == "+":
            return m.group(3) if value else ""
        return value

    return _VAR.sub(one, text)


def exec_form(args: str) -> list[str]:
    """An ENTRYPOINT's or CMD's JSON list."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def copy_args(args: str) -> tuple[dict[str, str], list[str], str]:
    """A COPY's flags, its sources and its destination."""
    words = shlex.split(args)
    flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
    paths = [w for w in words if not w.startswith("--")]
    return flags, paths[:-1], paths[-1]


def stage_args(stage: Stage, global_args: dict[str, str], overrides: dict[str, str]) -> dict[str, str]:
    """The stage's ARGs with their values (an override, else the default, else the global's)."""
    out = {}
    for ins in stage.all("ARG"):
        name, eq, default = ins.args.partition("=")
        if name in overrides:
            out[name] = overrides[name]
        elif eq:
            out[name] = default
        elif name in global_args:
            out[name] = overrides.get(name, global_args[name])
    return out


@dataclass
class Ran:
    """What ``run_stages`` did: each step run or skipped (with the reason), and the
    last stage's environment and user, as the image's would be."""

    ran: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    user: str = ""


def _copy(context: Path, sources: list[str], dest: str, ignore) -> None:
    """A builder's COPY from the context: a folder's contents into ``dest``, a file into
    ``dest`` when it ends with ``/`` (or there are several sources), else as ``dest``."""
    for src in sources:
        path = context / src
        if path.is_dir():
            shutil.copytree(path, dest, ignore=ignore, dirs_exist_ok=True)
            continue
        target = Path(dest) / path.name if dest.endswith("/") or len(sources) > 1 else Path(dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def run_stages(
    text: str,
    context: Path,
    *,
    workdir: Path,
    overrides: dict[str, str],
    base_env: dict[str, str],
    skips: dict[str, str],
    ignore=None,
) -> Ran:
    """Run every stage's steps in order (see the module docstring). ``skips`` maps a
    regular expression over a RUN's command to the reason it does not run here.

    Raises:
        AssertionError: a step failed (with its output), a skip matched no step or
            several, or the Dockerfile uses an instruction this runner does not know.
    """
    global_args, stages = parse(text)
    done = Ran()
    matched = dict.fromkeys(skips, 0)
    for stage in stages:
        values = {**base_env, **stage_args(stage, global_args, overrides)}
        env = dict(base_env)
        for ins in stage.instructions:
            if ins.op == "ARG":
                continue
            elif ins.op == "ENV":
                pairs = [w.split("=", 1) for w in shlex.split(ins.args)]
                new = {k: expand(v, values) for k, v in pairs}
                values.update(new)
                env.update(new)
            elif ins.op == "COPY":
                flags, sources, dest = copy_args(expand(ins.args, values))
                if "from" in flags:
                    assert all(s == dest for s in sources), f"line {ins.line}: one filesystem here: {ins.args}"
                    continue
                _copy(context, sources, dest, ignore)
            elif ins.op == "RUN":
                reasons = [(p, why) for p, why in skips.items() if re.search(p, ins.args)]
                if reasons:
                    for p, _ in reasons:
                        matched[p] += 1
                    done.skipped.append((ins.args, reasons[0][1]))
                    continue
                run_env = {**env, **stage_args(stage, global_args, overrides)}
                proc = subprocess.run(
                    ["/bin/sh", "-c", ins.args],
                    cwd=workdir,
                    env=run_env,
                    capture_output=True,
                    text=True,
                    timeout=STEP_TIMEOUT_S,
                )
                why = f"line {ins.line}: {ins.args}\nexit {proc.returncode}:\n{proc.stderr[-3000:]}"
                assert proc.returncode == 0, why
                done.ran.append(ins.args)
            elif ins.op == "USER":
                done.user = ins.args
            elif ins.op not in ("VOLUME", "EXPOSE", "ENTRYPOINT", "CMD"):
                raise AssertionError(f"line {ins.line}: the steps' runner does not know {ins.op}")
        done.env = env
    stale = [p for p, n in matched.items() if n != 1]
    assert not stale, f"skips matching no RUN step, or several: {stale}"
    return done


def host_env(**extra: str) -> dict[str, str]:
    """A base image's environment: this machine's PATH, and ``extra``."""
    return {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8", **extra}

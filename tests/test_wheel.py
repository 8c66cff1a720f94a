"""A wheel built from the clone, installed offline into a fresh virtual environment with
each extra: the README's build command, the wheel's contents, and what each extra runs.

The wheel is built by the README's command (offline: no build isolation, no index) from a
copy of the sources, and installed with ``--no-index``: the wheel itself plus the local
wheels pip is configured with. The dependencies it does not find there are lent from this
environment's site-packages through a ``.pth`` (torch left out for the worker extra), so
nothing is downloaded; a machine that cannot build offline skips with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from remote_dspark.native import build

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# What the README's Install section runs to build a wheel; the test adds only what keeps it offline.
BUILD_WHEEL = "pip wheel --no-deps -w dist ."


def offline_wheel_build_missing() -> str | None:
    """Why this machine cannot build and install the wheel offline, or None."""
    if importlib.util.find_spec("setuptools") is None:
        return "no setuptools in this environment to build the wheel without an index"
    try:
        pip = tuple(int(part) for part in metadata.version("pip").split(".")[:2])
    except metadata.PackageNotFoundError:
        return "no pip in this environment"
    if pip < (22, 3):
        return f"pip {metadata.version('pip')} cannot install into another environment (--python needs 22.3)"
    return None


WHY_NOT = offline_wheel_build_missing()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("wheel"),
    pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)),
]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built by the README's command from a copy of the package's sources (the
    build writes beside them)."""
    assert BUILD_WHEEL in README, "the README's Install section says how to build a wheel"
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "remote_dspark", src / "remote_dspark", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    command = [sys.executable, "-m", *BUILD_WHEEL.split(), "--no-build-isolation", "--no-index"]
    done = subprocess.run(command, cwd=src, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = (src / "dist").glob("*.whl")
    return path


def test_the_readme_installs_the_wheel_the_build_makes(wheel):
    named = set(re.findall(r"dist/(\S+\.whl)\[", README))
    assert named == {wheel.name}, f"the README installs {named}, the build makes {wheel.name}"


@pytest.mark.parametrize("name", [*(SOURCE.name for SOURCE in (*build.SOURCES, *build.HEADERS)), "gather.ptx"])
def test_the_wheel_carries_the_native_sources(wheel, name):
    assert f"remote_dspark/native/{name}" in zipfile.ZipFile(wheel).namelist()


def fresh_venv(tmp_path: Path, lend_torch: bool) -> tuple[Path, dict[str, str]]:
    """A virtual environment without pip, whose ``.pth`` lends it every distribution of this
    one except remote-dspark's own (and torch's, unless ``lend_torch``); and an environment
    for its processes that names no path into the clone and a cache of their own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    lent = tmp_path / "lent"
    lent.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    skip = re.compile(r"(remote_dspark|__editable__|_remote_dspark)" + ("" if lend_torch else r"|(func)?torch"))
    for entry in here.iterdir():
        if not skip.match(entry.name) and not entry.name.endswith(".pth"):
            (lent / entry.name).symlink_to(entry)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "lent.pth").write_text(f"{lent}\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("VLLM_DSPARK")}
    return venv, dict(env, XDG_CACHE_HOME=str(tmp_path / "cache"))


def in_venv(venv: Path, env: dict[str, str], *command: str) -> str:
    done = subprocess.run(command, cwd=venv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def install(wheel: Path, tmp_path: Path, extra: str) -> tuple[Path, dict[str, str]]:
    """A fresh environment with the wheel installed, ``extra`` with it, offline."""
    venv, env = fresh_venv(tmp_path, lend_torch=extra != "worker")
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-index"]
    in_venv(venv, env, *pip, "--find-links", str(wheel.parent), f"{wheel}[{extra}]")
    return venv, env


def test_the_worker_extra_installs_no_torch_and_the_library_is_built_from_the_wheel(wheel, tmp_path):
    venv, env = install(wheel, tmp_path, "worker")
    python = str(venv / "bin" / "python")
    assert "COMMAND" in in_venv(venv, env, str(venv / "bin" / "remote-dspark"), "--help")
    probe = "import importlib.util as u, remote_dspark.worker as w; print(w.__file__, u.find_spec('torch') is not None)"
    where, has_torch = in_venv(venv, env, python, "-c", probe).split()
    assert where.startswith(str(venv)), f"remote_dspark came from {where}, not the installed wheel"
    assert has_torch == "False", "the worker extra installs no torch"
    # The native library: compiled at first use, into this environment's cache, from the
    # sources the wheel carried.
    library = in_venv(venv, env, python, "-c", "from remote_dspark.native import build; print(build.load().path)")
    assert library.startswith(str(tmp_path / "cache" / "remote-dspark"))


def test_the_torch_extras_install_with_what_they_serve(wheel, tmp_path):
    venv, env = install(wheel, tmp_path, "engine,hf")
    probe = (
        "import importlib.util as u; print(*(u.find_spec(m).origin for m in ('remote_dspark.engine', 'transformers')))"
    )
    ours, transformers = in_venv(venv, env, str(venv / "bin" / "python"), "-c", probe).split()
    assert ours.startswith(str(venv)) and transformers

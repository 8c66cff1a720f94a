"""scripts/install-torch, the Makefile's torch step, and how the Makefile calls it.

The script runs against a fake interpreter and a fake ``uname``/``nvidia-smi`` on a PATH
of its own: what it would ask pip for is recorded, nothing is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "install-torch"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def fake_machine(tmp_path: Path, *, gpu: bool, torch_version: str | None = None) -> tuple[Path, dict[str, str]]:
    """A fake interpreter (its ``-m pip`` writes its arguments to ``pip-args``; its ``-c``
    prints ``torch_version`` or fails as if torch were missing) and the environment whose
    PATH holds only a Linux x86-64 ``uname`` and, with ``gpu``, an ``nvidia-smi``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    tools = {"uname": '[ "$1" = -s ] && echo Linux || echo x86_64'}
    if gpu:
        tools["nvidia-smi"] = "exit 0"
    has = f"echo {torch_version}; exit 0" if torch_version else "exit 1"
    tools["python"] = f'if [ "$1" = -c ]; then {has}; fi\nshift 2\necho "$@" > {tmp_path}/pip-args'
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir / "python", {"PATH": str(bin_dir)}


def install_torch(tmp_path: Path, *args: str, gpu: bool = False, torch_version: str | None = None):
    python, env = fake_machine(tmp_path, gpu=gpu, torch_version=torch_version)
    done = subprocess.run(
        [shutil.which("bash"), str(SCRIPT), str(python), *args], env=env, capture_output=True, text=True, timeout=30
    )
    pip = tmp_path / "pip-args"
    return done, pip.read_text().split() if pip.exists() else None


def test_without_a_gpu_the_default_is_the_cpu_build(tmp_path):
    done, pip = install_torch(tmp_path)
    assert done.returncode == 0, done.stderr
    assert pip == ["install", "torch==2.13.0+cpu"]
    assert "torch==2.13.0+cpu" in done.stdout and "no NVIDIA GPU" in done.stdout


def test_without_a_gpu_a_spec_that_may_be_a_cuda_build_is_refused_before_pip(tmp_path):
    done, pip = install_torch(tmp_path, "torch==2.13.0")
    assert done.returncode == 2 and pip is None
    assert "TORCH_SPEC=torch==2.13.0" in done.stderr and "+cpu" in done.stderr
    done, pip = install_torch(tmp_path / "cpu-index", "torch==2.13.0", CPU_INDEX)  # CPU builds only there
    assert done.returncode == 0 and pip == ["install", "torch==2.13.0", "--index-url", CPU_INDEX]


def test_the_index_goes_to_pip_as_the_index_url(tmp_path):
    done, pip = install_torch(tmp_path, "", CPU_INDEX)
    assert done.returncode == 0, done.stderr
    assert pip == ["install", "torch==2.13.0+cpu", "--index-url", CPU_INDEX]
    assert f"from {CPU_INDEX} (TORCH_INDEX)" in done.stdout


def test_with_a_gpu_the_default_is_the_plain_build_and_any_spec_is_taken(tmp_path):
    done, pip = install_torch(tmp_path, gpu=True)
    assert done.returncode == 0 and pip == ["install", "torch==2.13.0"]
    (tmp_path / "any").mkdir()
    done, pip = install_torch(tmp_path / "any", "torch>=2.4", gpu=True)
    assert done.returncode == 0 and pip == ["install", "torch>=2.4"]


def test_a_torch_already_installed_is_kept(tmp_path):
    done, pip = install_torch(tmp_path, "torch==2.13.0", torch_version="2.12.0")
    assert done.returncode == 0 and pip is None
    assert "torch 2.12.0 is already installed" in done.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_hands_torch_spec_and_torch_index_to_the_torch_step(tmp_path):
    spec, index = "torch==2.12.0+cpu", "https://example.org/whl/cpu"
    done = subprocess.run(
        ["make", "-n", "install", f"VENV={tmp_path}/v", f"TORCH_SPEC={spec}", f"TORCH_INDEX={index}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert f"./scripts/install-torch '{tmp_path}/v/bin/python' '{spec}' '{index}'" in done.stdout
    assert "--quiet" not in done.stdout  # every step shows what it installs

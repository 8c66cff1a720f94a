"""The integration guide's example (examples/engine_step.py) runs as it is: a toy engine
drives RemoteDSpark in process mode against a loopback worker and accepts drafts."""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

ROOT = Path(REPO)


@pytest.mark.slow
def test_the_integration_example_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "engine_step.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("30 rounds (30 ok), ") and "mode process" in line, line

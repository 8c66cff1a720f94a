"""The integration guide's transformers example (examples/transformers_generate.py) runs as
it is: assisted generate() with drafts from a loopback worker, identical output, nearly
every draft accepted."""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

ROOT = Path(REPO)


@pytest.mark.slow
def test_the_transformers_example_runs():
    pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "transformers_generate.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("120 tokens, identical to generate(): True, "), line

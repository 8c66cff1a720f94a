"""The integration guide's example (examples/engine_step.py) runs as it is: a toy engine
drives RemoteDSpark in process mode against a loopback worker and accepts drafts. The
Deployment section's (examples/engine_to_worker.py) reaches ok rounds against a worker
started apart, from the environment that section sets and the worker's vocabulary."""

import importlib.util
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


# --- examples/engine_to_worker.py: the Deployment section's engine ----------------------


@pytest.fixture
def deployed(monkeypatch):
    """A worker started apart (the built-in Markov model, 128 tokens) and the environment
    the README's Deployment section sets for it; yields the example's main()."""
    from remote_dspark.drafter import MarkovDrafter
    from remote_dspark.drafter.markov import builtin_model
    from remote_dspark.worker import Worker

    drafter = MarkovDrafter(builtin_model())
    worker = Worker(drafter, "127.0.0.1", 0).start()
    try:
        for name, value in {
            "VLLM_DSPARK_REMOTE": f"tcp://127.0.0.1:{worker.port}",
            "VLLM_DSPARK_REMOTE_IDENTITY": drafter.drafter_identity.hex(),
            "VLLM_DSPARK_REMOTE_MARKOV_IDENTITY": drafter.markov_identity.hex(),
            "VLLM_DSPARK_REMOTE_POLICY": "capacity",
            "VLLM_DSPARK_REMOTE_ASYNC": "0",  # sync: fast, in process (process mode: the README test)
            "VLLM_DSPARK_REMOTE_STATS_FILE": "",
            "VLLM_DSPARK_REMOTE_LOG_EVERY": "0",
            "VLLM_DSPARK_REMOTE_TIMEOUT_MS": "1000",  # a shared machine's stall must not cost a round
        }.items():
            monkeypatch.setenv(name, value)
        monkeypatch.syspath_prepend(str(ROOT / "examples"))  # as `python examples/...` puts it
        spec = importlib.util.spec_from_file_location("engine_to_worker", ROOT / "examples" / "engine_to_worker.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module.main
    finally:
        worker.stop()


def test_the_deployment_example_takes_the_vocabulary_from_the_worker(deployed, capsys):
    assert deployed([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(", vocabulary 128") and out[-1].startswith("30 rounds (30 ok), "), out


def test_the_deployment_example_takes_the_vocabulary_from_its_flag(deployed, capsys):
    """--vocab is the engine's: 16, under the worker's 128, is refused at HELLO (no ok
    round, exit 1); 200 is served."""
    assert deployed(["--vocab", "16"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("30 rounds (0 ok), ")
    assert deployed(["--vocab", "200"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(", vocabulary 200") and out[-1].startswith("30 rounds (30 ok), "), out

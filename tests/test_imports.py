"""The proxy side stays torch-free: checked in a fresh interpreter, not this one."""

import json
import subprocess
import sys

import pytest

TORCH_FREE = ["remote_dspark", "remote_dspark.proxy_proc", "remote_dspark.wire", "remote_dspark.transport",
              "remote_dspark.transport.tcp", "remote_dspark.transport.ofl", "remote_dspark.client",
              "remote_dspark.link", "remote_dspark.breaker", "remote_dspark.config", "remote_dspark.shm",
              "remote_dspark.native", "remote_dspark.ring", "remote_dspark.streamsync", "remote_dspark.supervisor",
              "remote_dspark.worker", "remote_dspark.markov", "remote_dspark.sim", "remote_dspark.cli",
              "remote_dspark.bench.handoff"]
HEAVY = ("torch", "numpy", "prometheus_client")


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_heavy_dependency(module):
    code = (f"import sys, json, {module}\n"
            f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == []

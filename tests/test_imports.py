"""The proxy side stays torch-free (and numpy-free): checked in a fresh interpreter, not
this one. The worker and its drafters may use numpy (the ``worker`` extra), never torch."""

import json
import subprocess
import sys

import pytest

TORCH_FREE = ["remote_dspark", "remote_dspark.proxy_proc", "remote_dspark.wire", "remote_dspark.wire_frame",
              "remote_dspark.wire_round", "remote_dspark.wire_drafts", "remote_dspark.transport",
              "remote_dspark.transport.tcp", "remote_dspark.transport.ofl", "remote_dspark.client",
              "remote_dspark.link", "remote_dspark.breaker", "remote_dspark.config", "remote_dspark.config_env",
              "remote_dspark.shm",
              "remote_dspark.shm_layout", "remote_dspark.shm_words",
              "remote_dspark.native", "remote_dspark.ring", "remote_dspark.ring_proxy", "remote_dspark.streamsync", "remote_dspark.supervisor",
              "remote_dspark.worker", "remote_dspark.worker_windows", "remote_dspark.markov", "remote_dspark.sim",
              "remote_dspark.cli", "remote_dspark.bench.handoff", "remote_dspark.bench.handoff_peers",
              "remote_dspark.bench.handoff_types", "remote_dspark.bench.round",
              "remote_dspark.bench.round_options", "remote_dspark.bench.round_report", "remote_dspark.bench.round_floor",
              "remote_dspark.bench.round_feeder", "remote_dspark.drafter", "remote_dspark.transport.endpoint",
              "remote_dspark.transport.errors", "remote_dspark.outcome", "remote_dspark.statsfile",
              "remote_dspark.tcp_round", "remote_dspark.trust", "remote_dspark.standby",
              "remote_dspark.proxy_spawn", "remote_dspark.bench.failover"]
HEAVY = ("torch", "numpy", "prometheus_client")
# numpy by design: the worker side, and the simulated engine (it keeps its slots in arrays).
NUMPY_OK = {"remote_dspark.worker", "remote_dspark.worker_windows", "remote_dspark.drafter", "remote_dspark.sim"}


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_heavy_dependency(module):
    heavy = tuple(m for m in HEAVY if not (m == "numpy" and module in NUMPY_OK))
    code = (f"import sys, json, {module}\n"
            f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == []

"""Fixtures shared by the suite. Helpers that tests import by name live in helpers.py."""

import os

import pytest
from helpers import COUNTING, gated_drafter

from remote_dspark import native
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.worker import Worker
from remote_dspark.worker.faults import Faults


@pytest.fixture(scope="session")
def lib(tmp_path_factory) -> native.Native:
    """The hostflag library, built once per test run into the run's temporary directory
    (never ~/.cache). Under xdist each worker has a session and a temporary directory of
    its own below the run's: they share the run's cache, where the first build is renamed
    into place and the others load it (``native.build`` is safe to race)."""
    base = tmp_path_factory.getbasetemp()
    run = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return native.load(environ={"PATH": os.environ.get("PATH", os.defpath)}, cache_dir=run / "hostflag-cache")


# A loopback worker of helpers.COUNTING for every test that asks for ``worker`` (and its
# gated ``drafter``), unless its module defines a worker of its own.
@pytest.fixture
def drafter():
    """A gated drafter of the COUNTING model: clear its ``gate`` to hold drafts back."""
    d = gated_drafter(COUNTING)
    yield d
    d.gate.set()


@pytest.fixture
def worker(drafter):
    """A reference worker on loopback serving ``drafter``, with ``faults`` a test may
    inject (none until it does); stopped after the test."""
    w = Worker(drafter, "127.0.0.1", 0, faults=Faults()).start()
    yield w
    drafter.gate.set()
    w.stop()


@pytest.fixture
def sampling_worker():
    """A loopback worker of COUNTING whose drafter samples (the gated one does not)."""
    w = Worker(MarkovDrafter(COUNTING), "127.0.0.1", 0).start()
    yield w
    w.stop()


def pytest_configure(config):
    """Without a CUDA device, Triton's kernels (the engine's device metadata writer) run
    in its interpreter on CPU tensors: it reads TRITON_INTERPRET when it is imported."""
    try:
        import torch
    except ImportError:  # the worker's tests run without the engine extra
        return
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The tests' tiny forwards run on one torch thread: its intra-op pool only adds
    contention on a small machine, the more so beside xdist's other workers."""
    try:
        import torch
    except ImportError:  # the worker's tests run without the engine extra
        return
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """GPU tests run where torch sees a CUDA device; elsewhere they are skipped with the
    reason, which `make test` prints (-rs)."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if not available:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CUDA; run `python3 -m pytest -m gpu` on a GPU host")
        for item in gpu:
            item.add_marker(skip)

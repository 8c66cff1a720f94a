"""Fixtures shared by the suite. Helpers that tests import by name live in helpers.py."""

import os

import pytest

# A loopback worker of helpers.COUNTING for every test that asks for ``worker`` (and its
# gated ``drafter``), unless its module defines a worker of its own.
from helpers import drafter, worker  # noqa: F401  (fixtures, shared by name)

from remote_dspark import native


@pytest.fixture(scope="session")
def lib(tmp_path_factory) -> native.Native:
    """The hostflag library, built once per test session into the session's temporary
    directory (never ~/.cache)."""
    return native.load(
        environ={"PATH": os.environ.get("PATH", os.defpath)},
        cache_dir=tmp_path_factory.getbasetemp() / "hostflag-cache",
    )


def pytest_collection_modifyitems(config, items):
    """GPU tests run on a machine with CUDA (the device machine); elsewhere they are
    skipped with the reason, which `make test` prints (-rs)."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    try:
        import torch

        available = torch.cuda.is_available()
    except ImportError:
        available = False
    if not available:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU: run `python3 -m pytest -m gpu` on the device machine")
        for item in gpu:
            item.add_marker(skip)

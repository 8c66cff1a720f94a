"""Fixtures shared by the suite. Helpers that tests import by name live in helpers.py."""

import os

import pytest

from remote_dspark import native


@pytest.fixture(scope="session")
def lib(tmp_path_factory) -> native.Native:
    """The hostflag library, built once per test session into the session's temporary
    directory (never ~/.cache)."""
    return native.load(environ={"PATH": os.environ.get("PATH", os.defpath)},
                       cache_dir=tmp_path_factory.getbasetemp() / "hostflag-cache")

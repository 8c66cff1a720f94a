"""What the engine's tests build alike: an engine of a test's environment (``make``), a
small batch over ``ROWS`` (``batch``) and an asynchronous mode's environment
(``async_env``). On the suite's path (``pythonpath`` in pyproject.toml), so the tests of
every folder below ``tests/engine`` import it by name."""

from __future__ import annotations

import torch
from helpers import env_for

from remote_dspark.config.api import RemoteConfig
from remote_dspark.engine import Batch, Mode, RemoteDSpark

K = 3
ROWS = torch.arange(8, dtype=torch.float32).reshape(4, 2)


def make(env, **kw):
    kw.setdefault("num_spec", K)
    kw.setdefault("max_slots", 4)
    kw.setdefault("row_bytes", 8)
    return RemoteDSpark(RemoteConfig.from_env(env), environ=env, **kw)


def batch(new=True, slots=(0, 1), tokens=((1,), (3,)), positions=(0, 0)):
    return Batch.from_lists(
        list(slots), [list(t) for t in tokens], list(positions), [new] * len(slots), ROWS, torch.arange(len(slots))
    )


def async_env(port, tmp_path, proxy, **kw):
    return env_for(port, tmp_path, Mode(proxy), **kw)

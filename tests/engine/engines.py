"""What the engine's tests build alike: an engine of a test's environment (``make``), a
small batch over ``ROWS`` (``batch``), an asynchronous mode's environment
(``async_env``), a sampled engine of an in-process worker (``sampled_engine``) and its
first round that drafts (``first_drafted``). On the suite's path (``pythonpath`` in
pyproject.toml), so the tests of every folder below ``tests/engine`` import it by name."""

from __future__ import annotations

import torch
from helpers import drafter_env, env_for, until

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


def sampled_engine(worker, tmp_path, mode: Mode, name: str, *, num_spec, max_slots, vocab, device="cpu", **env):
    """A sampled engine (``VLLM_DSPARK_SAMPLED_TOP32=1``, a 5 s round deadline) of
    ``worker`` (a ``Worker`` in this process) in ``mode``, its stats file ``name``'s."""
    env = drafter_env(
        worker.drafter,
        worker.port,
        mode,
        stats_file=str(tmp_path / f"stats-{name}.json"),
        VLLM_DSPARK_SAMPLED_TOP32="1",
        VLLM_DSPARK_REMOTE_TIMEOUT_MS="5000",
        **env,
    )
    config = RemoteConfig.from_env(env)
    return RemoteDSpark(
        config, environ=env, num_spec=num_spec, max_slots=max_slots, row_bytes=0, vocab_size=vocab, device=device
    )


def first_drafted(step):
    """The first answer of ``step()`` (a round, or a launch then a stream sync) that
    holds drafts; rounds before an engine's connection or proxy serves come back empty."""
    got = []
    assert until(lambda: got.append(step()) or bool(got[-1].counts.any()), 20.0, 0.01)
    return got[-1]

"""The engine's mode: decided once from the configuration, named by the contract's strings."""

from __future__ import annotations

import json

import pytest

from remote_dspark.config.api import RemoteConfig
from remote_dspark.demo.harness import engine_env
from remote_dspark.engine import Mode, RemoteDSpark

BASE = {
    "VLLM_DSPARK_REMOTE": "tcp://127.0.0.1:1",
    "VLLM_DSPARK_REMOTE_IDENTITY": "ab" * 32,
    "VLLM_DSPARK_REMOTE_POLICY": "capacity",
}


def config(**variables: str) -> RemoteConfig:
    return RemoteConfig.from_env(BASE | {f"VLLM_DSPARK_REMOTE_{k}": v for k, v in variables.items()})


@pytest.mark.parametrize(
    "variables,mode",
    [
        ({}, Mode.SYNC),
        ({"ASYNC": "0"}, Mode.SYNC),
        ({"ASYNC": "0", "ASYNC_PROXY": "thread"}, Mode.SYNC),
        ({"ASYNC": "0", "ASYNC_PROXY": "process"}, Mode.SYNC),
        ({"ASYNC": "1"}, Mode.THREAD),
        ({"ASYNC": "1", "ASYNC_PROXY": "thread"}, Mode.THREAD),
        ({"ASYNC": "1", "ASYNC_PROXY": "process"}, Mode.PROCESS),
    ],
)
def test_the_mode_is_decided_from_async_and_async_proxy(variables, mode):
    cfg = config(**variables)
    assert Mode.of(cfg) is mode
    rd = RemoteDSpark(cfg, num_spec=3, max_slots=4, row_bytes=8, environ=BASE)
    assert rd.mode is mode and rd.mode.handoff == (mode is not Mode.SYNC)


@pytest.mark.parametrize("mode", list(Mode))
def test_a_modes_variables_ask_for_that_mode(mode):
    assert Mode.of(RemoteConfig.from_env(BASE | mode.variables())) is mode


def test_the_modes_are_the_contracts_strings():
    """``stats().mode``, the stats file and the metrics' label say these, as plain strings."""
    assert [m.value for m in Mode] == ["sync", "thread", "process"]
    assert [str(m) for m in Mode] == [f"{m}" for m in Mode] == ["sync", "thread", "process"]
    assert Mode("process") is Mode.PROCESS and Mode.THREAD == "thread"
    cfg = config(ASYNC="1", ASYNC_PROXY="process")
    st = RemoteDSpark(cfg, num_spec=3, max_slots=4, row_bytes=8, environ=BASE).stats()
    assert type(st.mode) is str and st.mode == "process"
    assert json.loads(json.dumps(st.to_json()))["mode"] == "process"


@pytest.mark.parametrize("mode", list(Mode))
def test_the_loopback_environment_asks_for_the_mode_it_is_given(mode, monkeypatch):
    """``harness.engine_env``, which the demo, the benchmarks and the tests build their
    engines' environments with: the mode given wins over this process's environment,
    and the variables given win over everything."""
    monkeypatch.setenv("VLLM_DSPARK_REMOTE_ASYNC", "1" if mode is Mode.SYNC else "0")
    env = engine_env(1234, "ab" * 32, "cd" * 32, mode, VLLM_DSPARK_REMOTE_TIMEOUT_MS="80")
    cfg = RemoteConfig.from_env(env)
    assert Mode.of(cfg) is mode
    assert (cfg.policy, cfg.log_every, cfg.timeout_ms) == ("capacity", 0, 80)
    assert cfg.stats_file == RemoteConfig.from_env(BASE).stats_file  # blank: the contract's default
    assert (env["VLLM_DSPARK_REMOTE"], env["VLLM_DSPARK_REMOTE_IDENTITY"]) == ("tcp://127.0.0.1:1234", "ab" * 32)
    overridden = engine_env(1, "ab" * 32, "cd" * 32, mode, **Mode.SYNC.variables())
    assert Mode.of(RemoteConfig.from_env(overridden)) is Mode.SYNC

"""Authentication end to end, in every mode, against a loopback worker with ``--key-file``.

In process mode (ASYNC_PROXY=process, a warm standby) the key reaches every proxy, the
standby included, through the hand-over pipe: never on a command line or in an
environment (read from /proc), and never from the key file (deleted before a proxy that
authenticates is spawned). An engine without the key gets target-only rounds and a
worker refusal counted ``auth``, and its proxy is not replaced for it. Sync and thread
rounds authenticate too, and STRICT_START raises the worker's refusal. Every process is
ended by its test."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import COUNTING, env_for, until

from remote_dspark import wire
from remote_dspark.config.api import RemoteConfig
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.engine import Batch, Mode, RemoteDSpark
from remote_dspark.outcome import Outcome
from remote_dspark.transport.auth import load_key
from remote_dspark.transport.client import Refused
from remote_dspark.worker import Worker

SECRET = b"the engine's and worker's key, 32"
ROWS = torch.arange(8, dtype=torch.float32).reshape(4, 2)


def batch() -> Batch:
    return Batch.from_lists([0, 1], [[1], [3]], [0, 0], [True, True], ROWS, torch.arange(2))


def served(rd: RemoteDSpark) -> bool:
    """Rounds until one is served by the worker (bounded by ``until``)."""
    return until(lambda: rd.round(batch()).outcome is Outcome.OK, timeout=15)


@pytest.fixture
def key_path(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


@pytest.fixture
def keyed_worker(key_path):
    w = Worker(MarkovDrafter(COUNTING), "127.0.0.1", 0, key=load_key(str(key_path), "--key-file")).start()
    yield w
    w.stop()


def secret_shown(pid: int) -> list[str]:
    """Where process ``pid`` shows the key (its command line, its environment), if anywhere."""
    shown = []
    for part in ("cmdline", "environ"):
        with open(f"/proc/{pid}/{part}", "rb") as f:
            text = f.read()
        shown += [f"{part}: {form!r}" for form in (SECRET, SECRET.hex().encode()) if form in text]
    return shown


def test_process_proxies_authenticate_with_the_key_handed_over_through_the_pipe(keyed_worker, key_path, tmp_path):
    env = env_for(keyed_worker.port, tmp_path, Mode.PROCESS, VLLM_DSPARK_REMOTE_KEY_FILE=str(key_path))
    rd = RemoteDSpark(RemoteConfig.from_env(env), environ=env, num_spec=3, max_slots=4, row_bytes=8)
    rd.start()
    try:
        sup = rd.supervisor
        assert served(rd)
        assert until(lambda: sup.stats().standby == "ready", timeout=15), sup.stats()
        proxy, standby = sup.up.pid, sup.standby.proc.pid
        assert secret_shown(proxy) == [] and secret_shown(standby) == []
        # From here no proxy can read the key from its file: the standby promoted now, and
        # the proxies spawned after it, authenticate with what the engine handed over.
        os.unlink(key_path)
        for _ in range(2):
            before = sup.up.pid
            os.kill(before, signal.SIGKILL)
            assert until(lambda gone=before: sup.up is not None and sup.up.pid != gone, timeout=15), sup.stats()
            assert served(rd)
            assert secret_shown(sup.up.pid) == []
        assert sup.up.pid not in (proxy, standby)  # spawned after the file was gone
        stats = keyed_worker.statistics()
        assert stats.refusals["auth"] == 0 and stats.connections >= 3
    finally:
        rd.close()


def test_a_process_proxy_without_the_key_is_refused_auth_and_stays(keyed_worker, tmp_path):
    env = env_for(keyed_worker.port, tmp_path, Mode.PROCESS, VLLM_DSPARK_REMOTE_ASYNC_STANDBY="0")
    rd = RemoteDSpark(RemoteConfig.from_env(env), environ=env, num_spec=3, max_slots=4, row_bytes=8)
    rd.start()
    try:
        sup = rd.supervisor
        assert until(lambda: keyed_worker.statistics().refusals["auth"] >= 2, timeout=15)  # it backs off and retries
        outs = []
        assert until(lambda: outs.append(rd.round(batch())) or outs[-1].outcome is Outcome.ERROR, timeout=10)
        assert outs[-1].counts.tolist() == [0, 0] and Outcome.OK not in {o.outcome for o in outs}
        assert keyed_worker.statistics().connections == 0  # never given a thread
        assert sum(sup.restarts.values()) == 0 and sup.up is not None  # a refusal is no proxy loss
    finally:
        rd.close()


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.THREAD])
def test_sync_and_thread_rounds_authenticate_with_the_key(keyed_worker, key_path, tmp_path, mode):
    env = env_for(keyed_worker.port, tmp_path, mode, VLLM_DSPARK_REMOTE_KEY_FILE=str(key_path))
    with RemoteDSpark(RemoteConfig.from_env(env), environ=env, num_spec=3, max_slots=4, row_bytes=8) as rd:
        assert rd.mode == mode.value and served(rd)


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.PROCESS])
def test_strict_start_without_the_key_raises_the_workers_refusal(keyed_worker, tmp_path, mode):
    env = env_for(keyed_worker.port, tmp_path, mode, VLLM_DSPARK_REMOTE_STRICT_START="1")
    rd = RemoteDSpark(RemoteConfig.from_env(env), environ=env, num_spec=3, max_slots=4, row_bytes=8)
    with pytest.raises(Refused) as e:
        rd.start()
    assert e.value.code == wire.REFUSE_AUTH and "VLLM_DSPARK_REMOTE_KEY_FILE" in e.value.reason
    rd.close()

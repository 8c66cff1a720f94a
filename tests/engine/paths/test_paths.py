"""The facade over each kind of round path (``engine.paths.base``): what it reads from its path
before start, while started and after close, and the sync path's launch."""

from __future__ import annotations

import pytest
import torch
from helpers import env_for

from remote_dspark.config.api import RemoteConfig
from remote_dspark.engine import Batch, Mode, RemoteDSpark
from remote_dspark.engine.observe.stats import LinkStats
from remote_dspark.engine.paths.sync import SyncPath
from remote_dspark.outcome import Outcome
from remote_dspark.supervisor.restarts import Supervisor

ROWS = torch.arange(8, dtype=torch.float32).reshape(4, 2)


def make(env) -> RemoteDSpark:
    return RemoteDSpark(RemoteConfig.from_env(env), environ=env, num_spec=3, max_slots=4, row_bytes=8)


def batch() -> Batch:
    return Batch.from_lists([0, 1], [[1], [3]], [0, 0], [True, True], ROWS, torch.arange(2))


@pytest.mark.parametrize("mode", list(Mode))
def test_the_facade_reads_its_path_before_start_while_started_and_after_close(worker, tmp_path, mode):
    rd = make(env_for(worker.port, tmp_path, mode))
    # Before start() nothing is open: no supervisor, no wait, no link, no mode's parts.
    st = rd.stats()
    assert (rd.supervisor, rd.wait_cpu_s) == (None, 0.0)
    assert (st.mode, st.link) == (mode.value, LinkStats.none())
    assert (st.connected, st.handoff, st.supervisor) == (None, None, None)
    with rd:
        for _ in range(3):
            assert rd.round(batch()).outcome is Outcome.OK
        sup = rd.supervisor
        assert isinstance(sup, Supervisor) if mode is Mode.PROCESS else sup is None
        # Async rounds on the CPU wait spinning on the release; a sync round waits on its socket.
        assert (rd.wait_cpu_s > 0.0) == mode.handoff
        with pytest.raises(RuntimeError, match=r"launch\(\) is for rounds on CUDA"):
            rd.launch(batch())
        assert rd.round(batch()).outcome is Outcome.OK  # the refused launch left the path
    assert rd.supervisor is sup and rd.stats().total_rounds == 4
    if sup is not None:
        assert sup.stats().state == "closed"


def test_a_sync_launch_is_the_whole_round_now_completed_as_a_launch(worker, tmp_path):
    """``launch()`` on the sync path (ASYNC=0, or a failed self-test on CUDA) runs the
    facade's round now and gives it back as a launch would: the ROUND's id, the drafts
    on the rows' device."""
    spec = make(env_for(worker.port, tmp_path, Mode.SYNC)).spec
    path = SyncPath(spec)
    path.start()
    try:
        asked = []
        launched = path.launch(batch(), lambda b: asked.append(b) or path.round(b))
        assert len(asked) == 1 and launched.round == 1
        assert launched.tokens.device == ROWS.device and launched.tokens.tolist() == [[2, 3, 4], [4, 1, 2]]
        assert launched.counts.tolist() == [3, 3] and (launched.resync, launched.resync_all) == ((), False)
        assert path.stats().connected is True
    finally:
        path.stop(1.0)
        path.users.leave()
    assert path.stats().connected is False  # the last user out closed the connection

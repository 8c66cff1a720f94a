"""An engine on a fleet of two workers (``VLLM_DSPARK_REMOTE`` as a list: 127.0.0.1 and
127.0.0.2, one port), in sync, thread and process modes: a killed worker is left for the
spare before the next round, that round re-announces every slot (a new link epoch:
``resync_all``) and gets drafts, and the engine's stats name the new worker."""

from __future__ import annotations

import pytest
from engines import batch, make
from helpers import COUNTING, env_for, gated_drafter, until

from remote_dspark.drafter import MarkovDrafter
from remote_dspark.engine import Mode
from remote_dspark.outcome import Outcome
from remote_dspark.worker import Worker


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_a_killed_worker_costs_no_round_with_a_spare_ready(tmp_path, mode):
    workers = [Worker(MarkovDrafter(COUNTING), "127.0.0.1", 0).start()]
    port = workers[0].port
    try:
        workers.append(Worker(MarkovDrafter(COUNTING), "127.0.0.2", port).start())
        fleet = f"tcp://127.0.0.1:{port},127.0.0.2:{port}"
        env = env_for(port, tmp_path, None if mode == "sync" else Mode(mode), VLLM_DSPARK_REMOTE=fleet)
        with make(env) as rd:
            assert rd.mode == mode
            assert until(lambda: rd.round(batch()).outcome is Outcome.OK and rd.stats().link.spare, 20.0, 0.01)
            first = rd.stats().link.worker
            assert first in (f"127.0.0.1:{port}", f"127.0.0.2:{port}") and rd.stats().link.incarnation
            workers[0 if first.startswith("127.0.0.1:") else 1].stop()
            assert until(lambda: rd.stats().link.worker not in ("", first), 10.0, 0.01)
            out = rd.round(batch(new=False, tokens=((2,), (4,)), positions=(1, 1)))
            assert out.outcome is Outcome.OK and out.resync_all
            out = rd.round(batch())  # every slot re-announced (NEW_GEN): drafted at once
            assert out.outcome is Outcome.OK and out.tokens.tolist() == [[2, 3, 4], [4, 1, 2]]
            st = rd.stats()
            assert st.link.failovers == {"lost": 1, "stall": 0, "protocol": 0} and st.link.reconnects == 1
    finally:
        for w in workers:
            w.stop()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_stalled_worker_is_left_after_two_deadlines_and_its_replies_are_fenced(tmp_path, mode):
    drafters = [gated_drafter(COUNTING), gated_drafter(COUNTING)]
    workers = [Worker(drafters[0], "127.0.0.1", 0).start()]
    port = workers[0].port
    try:
        workers.append(Worker(drafters[1], "127.0.0.2", port).start())
        fleet = f"tcp://127.0.0.1:{port},127.0.0.2:{port}"
        env = env_for(port, tmp_path, Mode(mode), VLLM_DSPARK_REMOTE=fleet, VLLM_DSPARK_REMOTE_TIMEOUT_MS="100")
        with make(env) as rd:
            assert until(lambda: rd.round(batch()).outcome is Outcome.OK and rd.stats().link.spare, 20.0, 0.01)
            first = rd.stats().link.worker
            stalled = drafters[0 if first.startswith("127.0.0.1:") else 1]
            stalled.gate.clear()
            later = batch(new=False, tokens=((2,), (4,)), positions=(1, 1))
            assert [rd.round(later).outcome for _ in range(2)] == [Outcome.TIMEOUT] * 2
            # On the spare: a new session, every slot to re-announce. The engine hears it
            # from the link's epoch, or (a proxy that switched after this round's
            # hand-over) from the worker, which names each slot RESYNC.
            out = rd.round(later)
            assert out.outcome is Outcome.OK and (out.resync_all or sorted(out.resync) == [0, 1])
            assert rd.round(batch()).tokens.tolist() == [[2, 3, 4], [4, 1, 2]]
            stalled.gate.set()  # its replies to the two rounds come on the connection left
            assert until(lambda: rd.stats().link.fenced == 2, 5.0, 0.01)
            st = rd.stats().link
            assert st.worker != first and st.failovers["stall"] == 1 and st.late == 0
    finally:
        for d in drafters:
            d.gate.set()
        for w in workers:
            w.stop()

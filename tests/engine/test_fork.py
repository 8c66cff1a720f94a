"""A forked engine is inert (``lifecycle``'s FORKED): after ``os.fork()`` of a process
holding a started ``RemoteDSpark``, the child's copy refuses rounds naming the fork, its
``close()`` returns at once touching nothing of the parent's (region, proxy, socket,
watchdog), and the parent carries on with its own drafts and its own proxy. A vLLM
proposer's child exits normally (its finalizer and the collector run) without hanging.

The fork happens in the test's process: the child does its calls, reports one JSON
record through a pipe and leaves by ``os._exit`` (never back into pytest); the parent
reads it within CHILD_LIMIT_S and kills the child on a timeout (a hang is the failure).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import time

import pytest
from engines import async_env, batch, make
from helpers import child

from remote_dspark.engine import EngineState, RemoteForked
from remote_dspark.outcome import Outcome

CHILD_LIMIT_S = 10.0  # the child's whole life; its close() alone must take under CLOSE_BOUND_S
CLOSE_BOUND_S = 0.2
ROUNDS_AFTER = 20  # the parent's rounds once the child is gone
OK_TIMEOUT = {"VLLM_DSPARK_REMOTE_TIMEOUT_MS": "2000"}  # rounds that must come back OK on a loaded machine
PARENT = dict(slots=(0, 1), tokens=((1,), (1,)))  # the counting drafter drafts 2 3 4
CHILD = dict(slots=(2, 3), tokens=((3,), (3,)))  # ... and 4 1 2 for these


def in_forked_child(work) -> dict:
    """Fork; the child runs ``work()`` (a JSON-able dict, or the error it raised) and
    leaves by ``os._exit``; the parent's copy of the record, within CHILD_LIMIT_S (the
    child killed past it, and reaped either way)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(r)
            try:
                record = work()
            except BaseException as e:
                record = {"raised": repr(e)}
            os.write(w, json.dumps(record).encode())
        finally:
            os._exit(0)
    os.close(w)
    got, deadline = b"", time.monotonic() + CHILD_LIMIT_S
    try:
        while (left := deadline - time.monotonic()) > 0 and select.select([r], [], [], left)[0]:
            part = os.read(r, 65536)
            if not part:
                break
            got += part
    finally:
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL)  # gone already, unless it hung
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    assert got, f"the forked child reported nothing within {CHILD_LIMIT_S} s (it hung)"
    return json.loads(got)


def child_calls(rd) -> dict:
    """In the child: a round, stats(), close() twice, each timed."""
    record = {"state": rd.state.value}
    for name, call in (("round", lambda: rd.round(batch(**CHILD))), ("stats", rd.stats)):
        try:
            call()
            record[name] = "no error"
        except RemoteForked as e:
            record[name] = str(e)
    t0 = time.monotonic()
    rd.close()
    rd.close()
    record["close_s"] = time.monotonic() - t0
    return record


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_a_forked_engine_refuses_rounds_and_its_close_leaves_the_parent_untouched(worker, tmp_path, mode):
    rd = make(async_env(worker.port, tmp_path, mode, **OK_TIMEOUT)).start()
    try:
        assert rd.round(batch(**PARENT)).outcome is Outcome.OK
        sup = rd.supervisor
        proxy = (sup.state.pid, sup.spawns) if sup is not None else None
        record = in_forked_child(lambda: child_calls(rd))
        assert record.get("state") == EngineState.FORKED.value, record
        for name in ("round", "stats"):
            assert record[name].startswith(f"RemoteDSpark.{name}(): this engine was started in pid {os.getpid()}; ")
            assert "a forked child (pid " in record[name] and record[name].endswith("cannot use it: start its own")
        assert record["close_s"] < CLOSE_BOUND_S, record
        for _ in range(ROUNDS_AFTER):
            out = rd.round(batch(**PARENT))
            assert out.outcome is Outcome.OK and out.tokens.tolist() == [[2, 3, 4]] * 2, out
        if sup is not None:
            assert (sup.state.pid, sup.spawns) == proxy, "the parent's proxy was stopped and respawned"
        assert rd.state is EngineState.STARTED
    finally:
        rd.close()
    assert rd.stats().rounds[Outcome.OK] == ROUNDS_AFTER + 1  # the child's round reached nothing of the parent's


PROPOSER_EXIT = """
    import os, sys, time
    from types import SimpleNamespace
    import numpy as np
    from remote_dspark.demo.harness import engine_env
    from remote_dspark.drafter import MarkovDrafter
    from remote_dspark.drafter.markov import MarkovModel
    from remote_dspark.engine import Mode
    from remote_dspark.integrations.vllm import RemoteProposer
    from remote_dspark.worker import Worker

    d = MarkovDrafter(MarkovModel.from_tokens([1, 2, 3, 4] * 10, order=1, top=2))
    w = Worker(d, "127.0.0.1", 0).start()
    env = engine_env(w.port, d.drafter_identity.hex(), d.markov_identity.hex(), Mode(sys.argv[1]),
                     stats_file=sys.argv[2], VLLM_DSPARK_REMOTE_TIMEOUT_MS="2000")
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=3),
        scheduler_config=SimpleNamespace(max_num_seqs=2),
        model_config=SimpleNamespace(
            max_model_len=64, hf_config=SimpleNamespace(vocab_size=8), get_vocab_size=lambda: 8
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    p = RemoteProposer(config, environ=env)
    tokens = np.zeros((2, 64), np.int32)
    tokens[0, :3] = (1, 2, 3)
    print("parent before", p.propose([[3]], np.array([3, 0]), tokens), flush=True)
    sup = p.rd.supervisor
    proxy = sup.state.pid if sup else None
    pid = os.fork()
    if pid == 0:
        try:
            p.propose([[3]], np.array([3, 0]), tokens)
        except RuntimeError as e:  # RemoteForked
            print("child refused:", e, flush=True)
        sys.exit(0)  # a normal exit: atexit runs the proposer's finalizer, the collector the rest
    deadline = time.monotonic() + 5.0
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung at exit", flush=True)
            break
        time.sleep(0.01)
    else:
        print("child exited", flush=True)
    tokens[0, 3] = 4
    print("parent after", p.propose([[4]], np.array([4, 0]), tokens), flush=True)
    print("proxy", "same" if (sup.state.pid if sup else None) == proxy else "replaced", flush=True)
    p.close()
    w.stop()
"""


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_forked_proposers_child_exits_normally_and_the_parent_drafts_on(lib, tmp_path, mode):
    code = PROPOSER_EXIT.replace("sys.argv[1]", repr(mode)).replace("sys.argv[2]", repr(str(tmp_path / "stats.json")))
    with child(code, lib) as proc:
        out, err = proc.communicate(timeout=60)
    lines = out.splitlines()
    assert "parent before [[4, 1, 2]]" in lines, (out, err)
    refused = re.compile(r"child refused: RemoteDSpark\.(round|release)\(\): this engine was started in pid")
    assert any(refused.match(line) for line in lines), (out, err)  # (its first call: a freed slot's release)
    assert "child exited" in lines, (out, err)
    assert "parent after [[1, 2, 3]]" in lines and "proxy same" in lines, (out, err)

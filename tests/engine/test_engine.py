"""The engine facade: policies, the three ways to run a round, faults and statistics."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

import pytest
import torch
from engines import ROWS, K, async_env, batch, make
from helpers import COUNTING, env_for, until

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.engine import Mode, RemoteClosed, RemoteRoundFailed
from remote_dspark.outcome import Outcome
from remote_dspark.transport import TransportError
from remote_dspark.worker import Worker

MODEL = COUNTING


def local_drafter(b):
    n = len(b)
    return torch.full((n, K), 9, dtype=torch.int32), torch.full((n,), K, dtype=torch.int32)


def dead_port():
    w = Worker(MarkovDrafter(MODEL), "127.0.0.1", 0).start()
    port = w.port
    w.stop()
    return port


# --------------------------------------------------------------------------- synchronous


def test_sync_capacity_round_returns_device_tensors(worker, tmp_path):
    with make(env_for(worker.port, tmp_path)) as rd:
        out = rd.round(batch())
        assert out.source == "remote" and out.outcome is Outcome.OK
        assert out.tokens.dtype == torch.int32 and out.tokens.tolist() == [[2, 3, 4], [4, 1, 2]]
        assert out.counts.tolist() == [3, 3]
        out = rd.round(batch(new=False, tokens=((2,), (4,)), positions=(1, 1)))
        assert out.tokens.tolist() == [[3, 4, 1], [1, 2, 3]]


def test_sync_rows_reach_the_worker(tmp_path):
    seen = []

    class RowDrafter(MarkovDrafter):
        def draft(self, context, n_out, row):
            seen.append(bytes(row))
            return super().draft(context, n_out, row)

    with Worker(RowDrafter(MODEL), "127.0.0.1", 0) as w, make(env_for(w.port, tmp_path)) as rd:
        b = batch()
        b.row_index = torch.tensor([2, 0])
        rd.round(b)
    assert seen == [bytes(ROWS[2].view(torch.uint8).tolist()), bytes(ROWS[0].view(torch.uint8).tolist())]


def test_capacity_on_fail_raise(tmp_path):
    with make(env_for(dead_port(), tmp_path, VLLM_DSPARK_REMOTE_ON_FAIL="raise")) as rd:
        with pytest.raises(RemoteRoundFailed, match="error"):
            rd.round(batch())


def test_capacity_target_only_gives_zero_drafts(tmp_path):
    with make(env_for(dead_port(), tmp_path)) as rd:
        out = rd.round(batch())
        assert out.source == "none" and out.counts.tolist() == [0, 0] and out.tokens.abs().sum() == 0


def test_strict_start_raises_when_the_worker_is_down(tmp_path):
    rd = make(env_for(dead_port(), tmp_path, VLLM_DSPARK_REMOTE_STRICT_START="1"))
    with pytest.raises(TransportError):
        rd.start()
    rd.close()


def test_resilience_falls_back_to_the_local_drafter(tmp_path):
    with make(
        env_for(dead_port(), tmp_path, VLLM_DSPARK_REMOTE_POLICY="resilience"), local_drafter=local_drafter
    ) as rd:
        out = rd.round(batch())
        assert out.source == "local" and out.tokens.tolist() == [[9, 9, 9]] * 2


def test_shadow_uses_local_and_records_agreement_and_margins(worker, tmp_path):
    def half_right(b):  # agrees with the worker at position 0 only
        return torch.tensor([[2, 0, 0], [4, 0, 0]], dtype=torch.int32), torch.tensor([3, 3], dtype=torch.int32)

    with make(env_for(worker.port, tmp_path, VLLM_DSPARK_REMOTE_POLICY="shadow"), local_drafter=half_right) as rd:
        out = rd.round(batch())
        assert out.source == "local" and out.tokens[:, 0].tolist() == [2, 4]
        st = rd.stats()
        assert st.shadow_compared_at == (2, 2, 2) and st.shadow_agree_at == (2, 0, 0)
        assert st.margin.count == 6  # WANT_MARGIN defaults to 1 in shadow


def test_shadow_use_remote(worker, tmp_path):
    with make(
        env_for(worker.port, tmp_path, VLLM_DSPARK_REMOTE_POLICY="shadow", VLLM_DSPARK_REMOTE_SHADOW_USE="remote"),
        local_drafter=local_drafter,
    ) as rd:
        assert rd.round(batch()).source == "remote"


def test_policies_that_keep_a_local_drafter_need_one(worker, tmp_path):
    with pytest.raises(ValueError, match="needs a local drafter"):
        make(env_for(worker.port, tmp_path, VLLM_DSPARK_REMOTE_POLICY="resilience"))


@pytest.mark.parametrize(
    "policy,depth,n_out,counts",
    [
        ("capacity", dict(depth_mode="conf", dense_cap=[0, 3, 1, 1, 1]), None, [1, 1]),  # 2 requests: cap 1
        ("capacity", dict(depth_mode="conf", dense_cap=[0, 3, 1, 1, 1]), "0", [3, 3]),  # N_OUT=0: all
        ("capacity", dict(depth_mode="fixed", dense_cap=[0, 3, 1, 1, 1]), None, [3, 3]),  # not cap-masking
        ("capacity", dict(depth_mode="conf", depth_file="/x", dense_cap=[0, 3, 1]), None, [3, 3]),
        ("capacity", dict(depth_mode="conf"), None, [3, 3]),  # no schedule
        ("shadow", dict(depth_mode="conf", dense_cap=[0, 3, 1, 1, 1]), None, [3, 3]),  # compares all
    ],
)
def test_n_out_follows_the_schedule_by_request_count(worker, tmp_path, policy, depth, n_out, counts):
    """The engine's depth-policy facts set each round's n_out (config.n_out_table's rules),
    as the worker sees it on the wire; the reason is in stats()."""
    env = env_for(
        worker.port,
        tmp_path,
        VLLM_DSPARK_REMOTE_POLICY=policy,
        **({"VLLM_DSPARK_REMOTE_N_OUT": n_out} if n_out else {}),
    )
    kw = {"local_drafter": local_drafter} if policy == "shadow" else {}
    with make(env, **depth, **kw) as rd:
        remote = rd.round(batch())
        if policy == "shadow":
            assert rd.stats().shadow_compared_at == (2, 2, 2)  # the remote drafted every position
        else:
            assert remote.counts.tolist() == counts
        st = rd.stats()
        assert (st.n_out_table is not None) == (counts == [1, 1] and policy != "shadow") and st.n_out_reason
        b = batch()
        b.n_out = torch.tensor([2, 2])  # a batch's own n_out wins
        if policy != "shadow":
            assert rd.round(b).counts.tolist() == [2, 2]


def test_new_gen_context_is_trimmed_with_its_position(worker, tmp_path):
    with make(env_for(worker.port, tmp_path)) as rd:
        m = rd.meta(batch(tokens=(list(range(100)), (1,))))
        assert m.offsets.tolist() == [0, 64, 65] and m.positions.tolist() == [36, 0]
        assert m.tokens[:64].tolist() == list(range(36, 100))


def test_start_warns_of_a_watchdog_over_a_minute_naming_the_values(worker, tmp_path, caplog):
    """The contract's largest TIMEOUT_MS makes the watchdog 4 x it (kept exactly: days);
    the engine's start says so on remote_dspark.config, naming the values."""
    env = env_for(worker.port, tmp_path, Mode.THREAD, VLLM_DSPARK_REMOTE_TIMEOUT_MS="2147483647")
    with caplog.at_level(logging.WARNING, logger="remote_dspark.config"), make(env) as rd:
        assert rd.cfg.watchdog_ms == 4 * 2147483647
    lines = [r.getMessage() for r in caplog.records if r.name == "remote_dspark.config"]
    assert any("8589934588 ms" in line and "TIMEOUT_MS=2147483647" in line for line in lines), lines
    assert any("TIMEOUT_MS=2147483647" in line and "round deadline" in line for line in lines), lines


def test_start_names_a_misspelled_variable_once(worker, tmp_path, caplog):
    """A variable the package does not read (VLLM_DSPARK_REMOTE_TIMEOUT for TIMEOUT_MS)
    is named at start, once, with the closest known name; the host engine's own
    VLLM_DSPARK_* variables are not."""
    env = env_for(worker.port, tmp_path, VLLM_DSPARK_REMOTE_TIMEOUT="50", VLLM_DSPARK_DEPTH_POLICY="conf")
    with caplog.at_level(logging.WARNING, logger="remote_dspark.config"), make(env):
        pass
    lines = [r.getMessage() for r in caplog.records if r.name == "remote_dspark.config"]
    assert len(lines) == 1 and "VLLM_DSPARK_REMOTE_TIMEOUT is not" in lines[0], lines
    assert "did you mean VLLM_DSPARK_REMOTE_TIMEOUT_MS?" in lines[0]


def test_stats_file_and_log_line(worker, tmp_path, caplog):
    env = env_for(worker.port, tmp_path, VLLM_DSPARK_REMOTE_LOG_EVERY="2")
    with caplog.at_level(logging.INFO, logger="remote_dspark.engine"), make(env) as rd:
        rd.round(batch())
        rd.round(batch())
        lines = [r.getMessage() for r in caplog.records if "rounds" in r.getMessage()]
        assert lines == ["remote DSpark: 2 rounds (ok=2); late 0; budget -"]
        on_disk = json.loads((tmp_path / "stats.json").read_text())
        assert on_disk["rounds"]["ok"] == 2 == rd.stats().rounds[Outcome.OK]
    assert [f.name for f in tmp_path.iterdir()] == ["stats.json"]  # no temp file left


# --------------------------------------------------------------------------- async


def test_thread_mode_round_and_switch_interval(worker, tmp_path):
    before = sys.getswitchinterval()
    with make(async_env(worker.port, tmp_path, "thread", VLLM_DSPARK_REMOTE_SWITCH_INTERVAL_US="700")) as rd:
        assert rd.mode == "thread" and sys.getswitchinterval() == pytest.approx(700e-6)
        assert rd.round(batch()).tokens.tolist() == [[2, 3, 4], [4, 1, 2]]
    assert sys.getswitchinterval() == before


def test_process_mode_respawn_no_proxy_rounds_and_resync_all(worker, tmp_path):
    with make(async_env(worker.port, tmp_path, "process", VLLM_DSPARK_REMOTE_ASYNC_RESPAWNS="1")) as rd:
        assert rd.round(batch()).outcome is Outcome.OK
        sup = rd.supervisor
        first = sup.live
        os.kill(first.pid, signal.SIGKILL)
        assert until(lambda: sup.up is not None and sup.up.pid != first.pid)
        # Until the new proxy serves, rounds are answered here at once (no_proxy); its
        # worker session has no windows, so the engine is told to re-announce every slot.
        outs = [rd.round(batch(new=False, tokens=((2,), (4,)), positions=(1, 1)))]
        end = time.monotonic() + 10
        while outs[-1].outcome is Outcome.NO_PROXY and time.monotonic() < end:
            outs.append(rd.round(batch(new=False, tokens=((2,), (4,)), positions=(1, 1))))
        assert outs[-1].outcome is Outcome.OK and outs[-1].resync_all
        assert rd.round(batch()).outcome is Outcome.OK
        st = rd.stats()
        assert st.supervisor.restarts["signal"] == 1 and st.supervisor.budget_left == 0
        os.kill(sup.up.pid, signal.SIGKILL)
        assert until(lambda: sup.stats().state == "spent")
        out = rd.round(batch())  # released at once (NO_PROXY), not left to the watchdog (WATCHDOG)
        assert out.outcome is Outcome.NO_PROXY and out.source == "none"
    assert not _zombies()


def test_watchdog_releases_a_round_the_worker_answers_too_late(worker, tmp_path):
    env = async_env(
        worker.port,
        tmp_path,
        "process",
        VLLM_DSPARK_REMOTE_TIMEOUT_MS="2000",
        VLLM_DSPARK_REMOTE_ASYNC_WATCHDOG_MS="100",
    )
    with make(env) as rd:
        assert rd.round(batch()).outcome is Outcome.OK
        worker.faults.set_delay(0.3)
        t0 = time.monotonic()
        out = rd.round(batch())
        waited = time.monotonic() - t0
        assert out.outcome is Outcome.WATCHDOG and out.counts.tolist() == [0, 0]
        assert waited >= 0.1  # answered by the watchdog at its limit, not before
        worker.faults.set_delay(0.0)
        assert until(lambda: rd.stats().link.late == 1)  # the proxy's reply came after the watchdog


def test_only_watchdog_rounds_of_the_live_proxy_make_it_stalled(worker, tmp_path):
    """The stall verdict counts rounds the watchdog answered in a row, all seen during
    the live proxy's life: a run that began under its predecessor is not its fault. The
    engine thread alone writes the run; the supervisor only reads it."""
    with make(async_env(worker.port, tmp_path, "process")) as rd:
        assert until(lambda: rd.supervisor.up is not None)
        path, host, up = rd._path.inner.handoff, rd._path.inner.host, rd.supervisor.up
        assert not host._stalled(up)
        path.watchdog_seen = (up.since - 0.5, up.since + 0.1, up.since + 0.2)  # began before it
        assert not host._stalled(up)
        path.watchdog_seen = (up.since + 0.1, up.since + 0.2, up.since + 0.3)
        assert host._stalled(up)
        path._count_watchdog(Outcome.OK)  # a served round ends a run
        assert path.watchdog_seen == () and not host._stalled(up)
        for _ in range(5):
            path._count_watchdog(Outcome.WATCHDOG)
        assert len(path.watchdog_seen) == 3 and host._stalled(up)
        path.watchdog_seen = ()


def test_a_proxy_still_connecting_is_not_stalled(tmp_path, monkeypatch):
    """A worker that accepts and never answers HELLO: the proxy's first connect takes the
    whole CONNECT_TIMEOUT_MS, longer than a start is otherwise given. It is not killed as
    stalled (which would spend the respawn budget on a worker's fault): it starts serving,
    target-only, once the attempt fails."""
    import socket

    from remote_dspark.engine.paths import proxy_host

    monkeypatch.setattr(proxy_host, "PROXY_START_S", 1.0)  # below CONNECT_TIMEOUT_MS, room for a loaded machine
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        env = async_env(
            silent.getsockname()[1],
            tmp_path,
            "process",
            VLLM_DSPARK_REMOTE_CONNECT_TIMEOUT_MS="1500",
            VLLM_DSPARK_REMOTE_BACKOFF_MS="60000",
            VLLM_DSPARK_REMOTE_BACKOFF_MAX_MS="60000",
        )
        rd = make(env)
        rd.start()
        try:
            sup = rd.supervisor
            first = sup.live.pid
            assert until(lambda: rd.round(batch()).outcome is Outcome.ERROR, timeout=10)  # served, target-only
            assert until(lambda: sup.up is not None) and sup.up.pid == first, (first, sup.stats())
            assert sum(sup.restarts.values()) == 0, sup.stats()
        finally:
            rd.close()


def test_stalled_proxy_is_killed_and_replaced(worker, tmp_path):
    env = async_env(worker.port, tmp_path, "process", VLLM_DSPARK_REMOTE_ASYNC_WATCHDOG_MS="100")
    with make(env) as rd:
        assert rd.round(batch()).outcome is Outcome.OK
        sup = rd.supervisor
        stopped = sup.live.pid
        os.kill(stopped, signal.SIGSTOP)
        try:
            # The engine keeps drafting: its round waits until the watchdog answers it or
            # the proxy, silent with a round pending, is judged stalled and replaced
            # (whichever comes first: both are about 100 ms here).
            outcomes = []
            assert until(lambda: outcomes.append(rd.round(batch()).outcome) or sup.restarts["stall"] == 1)
            assert outcomes[0] in (Outcome.WATCHDOG, Outcome.NO_PROXY, Outcome.ORPHAN)
            assert set(outcomes) <= {Outcome.WATCHDOG, Outcome.NO_PROXY, Outcome.ORPHAN, Outcome.OK}
            assert until(lambda: sup.up is not None) and sup.up.pid != stopped
        finally:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert until(lambda: rd.round(batch()).outcome is Outcome.OK, timeout=5)


def _zombies():
    try:
        import psutil
    except ImportError:
        return []
    return [p.pid for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE]


# --------------------------------------------------------------------------- start-up and faults


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_ofl_endpoint_without_its_library_fails_start(tmp_path, mode):
    env = env_for(1, tmp_path, VLLM_DSPARK_REMOTE="o1tcp://127.0.0.1:1")
    if mode != "sync":
        env.update(VLLM_DSPARK_REMOTE_ASYNC="1", VLLM_DSPARK_REMOTE_ASYNC_PROXY=mode)
    rd = make(env)
    with pytest.raises(ValueError, match="VLLM_DSPARK_REMOTE_OFL_DIR"):
        rd.start()
    assert not _children()


# A stand-in ofl module: the interface transport/ofl.py names, over loopback
# TCP. It logs each call beside itself, so the test sees that the rounds went through it.
FAKE_OFL = """
import os, socket
LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.log")


def _log(what):
    with open(LOG, "a") as f:
        f.write(what + "\\n")


class Conn:
    def __init__(self, sock):
        self.sock = sock

    def sendmsg(self, buffers):
        _log("sendmsg %d" % sum(memoryview(b).nbytes for b in buffers))
        for b in buffers:
            self.sock.sendall(b)

    def recv_into(self, view, timeout_s):
        self.sock.settimeout(timeout_s)
        return self.sock.recv_into(view)

    def close(self):
        self.sock.close()


def connect(host, port, *, mode, bind, timeout_s, lib):
    _log("connect %s %s" % (mode, os.path.basename(lib)))
    return Conn(socket.create_connection((host, port), timeout=timeout_s))
"""


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_rounds_are_served_end_to_end_through_an_ofl_module(worker, tmp_path, mode):
    """An o1tcp:// endpoint: the ofl module from OFL_DIR (a directory only this user can
    write, as the trust rules ask) carries HELLO and every round; in the async modes the
    proxy's Python round (``ProxyLoop.serve``) sends them, checked and unpacked in C."""
    ofl = tmp_path / "ofl"
    ofl.mkdir(mode=0o700)
    (ofl / "ofl.py").write_text(FAKE_OFL)
    (ofl / "libofl.so").write_bytes(b"")
    # A generous deadline: this checks the path, and the proxy's Python round over a
    # Python socket may take tens of ms on a loaded 2-core machine.
    env = env_for(
        worker.port,
        tmp_path,
        VLLM_DSPARK_REMOTE=f"o1tcp://127.0.0.1:{worker.port}",
        VLLM_DSPARK_REMOTE_OFL_DIR=str(ofl),
        VLLM_DSPARK_REMOTE_TIMEOUT_MS="5000",
    )
    if mode != "sync":
        env.update(VLLM_DSPARK_REMOTE_ASYNC="1", VLLM_DSPARK_REMOTE_ASYNC_PROXY=mode)
    with make(env) as rd:
        assert rd.mode == mode
        first = rd.round(batch())
        assert (first.outcome, first.tokens.tolist()) == (Outcome.OK, [[2, 3, 4], [4, 1, 2]])
        out = rd.round(batch(new=False, tokens=((2,), (4,)), positions=(1, 1)))
        assert (out.outcome, out.tokens.tolist()) == (Outcome.OK, [[3, 4, 1], [1, 2, 3]])
    calls = (ofl / "calls.log").read_text().splitlines()
    assert calls[0] == "connect tcp libofl.so"
    sends = [int(c.split()[1]) for c in calls if c.startswith("sendmsg")]
    assert len(sends) >= 3 and sends[0] == wire.HEADER.size + 88  # HELLO, then both rounds


@pytest.mark.parametrize("proxy", ["thread", "process"])
def test_strict_start_raises_in_async_modes_and_leaves_nothing_running(tmp_path, proxy):
    rd = make(async_env(dead_port(), tmp_path, proxy, VLLM_DSPARK_REMOTE_STRICT_START="1"))
    with pytest.raises(TransportError):
        rd.start()
    assert not _children()


def test_failed_start_cleans_up_what_it_started(worker, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        env = async_env(worker.port, tmp_path, "process", VLLM_DSPARK_REMOTE_METRICS_PORT=str(taken.getsockname()[1]))
        rd = make(env)
        with pytest.raises(ValueError, match="VLLM_DSPARK_REMOTE_METRICS_PORT"):
            rd.start()
    assert not _children()


@pytest.mark.parametrize("mode", ["sync", "process"])
def test_start_runs_once_and_a_closed_engine_refuses_rounds(worker, tmp_path, mode):
    """start() again (or after close) raises naming the state and starts nothing more;
    a round after close() raises RemoteClosed."""
    env = env_for(worker.port, tmp_path) if mode == "sync" else async_env(worker.port, tmp_path, "process")
    rd = make(env)
    with pytest.raises(RuntimeError, match=r"round\(\) before start\(\)"):
        rd.round(batch())
    rd.start()
    try:
        if mode == "process":  # the warm standby is spawned after start() returns: once it is up
            assert until(lambda: rd.supervisor.stats().standby == "ready")
        children = _children()
        with pytest.raises(RuntimeError, match="start\\(\\) on a started RemoteDSpark: it runs once"):
            rd.start()
        assert _children() == children and rd.round(batch()).outcome is Outcome.OK
    finally:
        rd.close()  # (a failure here must not leave a proxy and a region to the next tests)
    rd.close()  # idempotent
    with pytest.raises(RemoteClosed, match=r"round\(\) after close\(\)"):
        rd.round(batch())
    with pytest.raises(RuntimeError, match="start\\(\\) on a closed RemoteDSpark"):
        rd.start()
    assert not _children()


def test_a_named_native_library_that_is_not_hostflag_fails_start(worker, tmp_path):
    """A configuration error, raised at start naming the variable: never a quiet fall
    back to synchronous rounds."""
    import subprocess

    src = tmp_path / "other.c"
    src.write_text("int other(void) { return 0; }\n")
    so = tmp_path / "other.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True, timeout=60)
    rd = make(async_env(worker.port, tmp_path, "process", VLLM_DSPARK_REMOTE_HOSTFLAG_LIB=str(so)))
    with pytest.raises(ValueError, match="VLLM_DSPARK_REMOTE_HOSTFLAG_LIB=.*not a hostflag library"):
        rd.start()
    assert rd.mode == "process" and not _children()


def test_bad_rows_leave_no_hole_in_the_round_sequence(worker, tmp_path):
    with make(async_env(worker.port, tmp_path, "process")) as rd:
        bad = batch()
        bad.row_index = torch.tensor([0, 99])
        with pytest.raises(ValueError, match="row_index"):
            rd.round(bad)
        assert rd.round(batch()).outcome is Outcome.OK
        ring = rd.stats().handoff
        assert ring.gathered == ring.released == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_proxy_thread_means_target_only_rounds_at_once(worker, tmp_path, monkeypatch, caplog):
    from remote_dspark.proxy import tcp_round

    def broken(self, timeout_s, **_):  # dies holding a round it took
        if self._end.next_round(timeout_s) is not None:
            raise RuntimeError("proxy bug")

    monkeypatch.setattr(tcp_round.TcpRounds, "serve", broken)
    with make(async_env(worker.port, tmp_path, "thread", VLLM_DSPARK_REMOTE_ASYNC_WATCHDOG_MS="100")) as rd:
        assert rd.round(batch()).outcome is Outcome.WATCHDOG  # the round the thread died on
        assert until(lambda: rd.stats().handoff.proxy_thread_alive is False)
        # At once: answered NO_PROXY by the engine, not left to the watchdog (WATCHDOG).
        assert [rd.round(batch()).outcome for _ in range(3)] == [Outcome.NO_PROXY] * 3
    assert [r.getMessage() for r in caplog.records if "proxy thread died" in r.getMessage()] != []


@pytest.mark.parametrize(
    "kw,why",
    [
        ({"num_spec": 0}, "num_spec=0"),
        ({"max_slots": 5000}, "max_slots=5000"),
        ({"row_bytes": -1}, "row_bytes=-1"),  # 0 is an engine without rows
        ({"row_bytes": (1 << 20) + 1}, "row_bytes=1048577"),
        ({"device": "tpu"}, "device='tpu'"),
    ],
)
def test_bad_engine_parameters(tmp_path, kw, why):
    with pytest.raises(ValueError, match=why):
        make(env_for(1, tmp_path), **kw)


def _children():
    import psutil

    return [
        p
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and "proxy_proc" in " ".join(p.cmdline())
    ]


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_stats_is_one_typed_record_whose_parts_follow_the_mode(worker, tmp_path, mode):
    """What metrics, the file, the log line, the demo and chaos read: typed parts that
    exist exactly in the modes that have them, never keys to guess; the file is the
    record's document, and after close() the record is final."""
    env = env_for(worker.port, tmp_path) if mode == "sync" else async_env(worker.port, tmp_path, mode)
    with make(env) as rd:
        assert rd.round(batch()).outcome is Outcome.OK
        # A proxy counts its attempt after it released the round: bounded wait for it.
        assert until(lambda: rd.stats().link.attempts == 1)
        st = rd.stats()
        assert (st.mode, st.rounds[Outcome.OK], st.total_rounds, st.link.attempts) == (mode, 1, 1, 1)
        assert (st.connected is not None) == (mode == "sync")
        assert (st.handoff is not None) == (mode != "sync") and (st.supervisor is not None) == (mode == "process")
        if mode == "thread":
            assert st.handoff.proxy_thread_alive is True
        with pytest.raises(AttributeError):
            st.mode = "other"  # frozen: a snapshot, never a live view
    final = rd.stats()
    assert final is rd.stats() and final.total_rounds == 1
    doc = json.loads((tmp_path / "stats.json").read_text())
    assert doc == json.loads(json.dumps(final.to_json()))
    assert doc["rounds"] == {o.label: int(o is Outcome.OK) for o in Outcome} | {"total": 1}


def test_start_warns_about_settings_that_cannot_work(worker, tmp_path, caplog):
    env = async_env(
        worker.port, tmp_path, "thread", VLLM_DSPARK_REMOTE_TIMEOUT_MS="300", VLLM_DSPARK_REMOTE_ASYNC_WATCHDOG_MS="300"
    )
    with caplog.at_level(logging.WARNING, logger="remote_dspark.engine"), make(env) as rd:
        assert rd.round(batch()).outcome is Outcome.OK  # accepted, and working
    said = [r.getMessage() for r in caplog.records if "ASYNC_WATCHDOG_MS=300" in r.getMessage()]
    assert len(said) == 1 and "VLLM_DSPARK_REMOTE_TIMEOUT_MS=300" in said[0]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_an_idle_engine_costs_no_core_and_its_next_round_is_served(worker, tmp_path, mode):
    """At defaults (ASYNC_NAP_US=0) a proxy whose engine has nothing to draft does not
    spin a whole core: after its spin, it sleeps on the engine's ``published`` word and
    says so in the region's ``sleeping`` word (the CPU figure is the benchmark's). The
    engine's next round wakes it, and is served."""
    with make(async_env(worker.port, tmp_path, mode, VLLM_DSPARK_REMOTE_ASYNC_NAP_US="0")) as rd:  # the default
        for _ in range(20):
            assert rd.round(batch(new=False, tokens=((2,), (4,)), positions=(1, 1))).outcome is not None
        path = rd._path.inner.handoff
        sleeping = path.region.addr(path.region.layout.wake) + 4  # wake words: [published, sleeping]
        assert until(lambda: path.lib.load32(sleeping) == 1)
        assert rd.round(batch()).outcome is Outcome.OK


def test_the_standby_takes_over_a_killed_proxy_with_a_new_session(worker, tmp_path):
    """Process mode keeps a warm standby: a SIGKILL promotes it (new session, slots
    re-announced), the next standby starts, and close() ends both: no zombie, no fd."""

    def open_files():  # what the engine side opens (the in-process worker's sockets and epolls aside)
        def what(fd):
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return "gone"

        return {
            fd for fd in os.listdir("/proc/self/fd") if what(fd).startswith(("/memfd:", "anon_inode:[pidfd]", "pipe:"))
        }

    fds = open_files()
    with make(async_env(worker.port, tmp_path, "process")) as rd:
        sup = rd.supervisor
        assert rd.round(batch()).outcome is Outcome.OK
        assert until(lambda: sup.stats().standby == "ready")
        first, standby = sup.up, sup.standby.proc.pid
        os.kill(first.pid, signal.SIGKILL)
        assert until(lambda: sup.stats().restarts["signal"] == 1)  # reaped: no round reaches it any more
        step = batch(new=False, tokens=((2,), (4,)), positions=(1, 1))
        outs = [rd.round(step)]
        assert until(lambda: outs.append(rd.round(step)) or outs[-1].outcome is Outcome.OK)
        assert sup.live.pid == standby and sup.live.session != first.session
        # The first round handed to the new proxy says resync_all (its connection is new:
        # the worker has no window), whatever its outcome; it comes by the first ok one.
        first_ok = next(i for i, o in enumerate(outs) if o.outcome is Outcome.OK)
        assert any(o.resync_all for o in outs[: first_ok + 1]), [(o.outcome, o.resync_all) for o in outs]
        assert until(lambda: sup.stats().standby == "ready" and getattr(sup.standby.proc, "pid", standby) != standby)
        st = sup.stats()
        assert (st.restarts["signal"], st.standby_spawns, st.standby_failures) == (1, 2, 0)
        pids = [sup.live.pid, sup.standby.proc.pid]
    left = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in open_files() - fds}
    assert not _zombies() and not left, left  # no memfd, pidfd or pipe left
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_standby_can_be_switched_off(worker, tmp_path):
    with make(async_env(worker.port, tmp_path, "process", VLLM_DSPARK_REMOTE_ASYNC_STANDBY="0")) as rd:
        assert rd.round(batch()).outcome is Outcome.OK
        assert rd.supervisor.standby is None and rd.stats().supervisor.standby == "off"


def test_a_slow_set_up_before_the_spawn_does_not_eat_the_wait_for_the_proxy(worker, tmp_path, monkeypatch):
    """The wait for the first proxy counts from its spawn: an engine whose own set-up (on a
    GPU, the hand-off's self-test compiling its kernel) outlasts CONNECT_TIMEOUT_MS + 1 s
    still starts with a proxy serving, and its first round reaches the worker."""
    from remote_dspark.engine import facade
    from remote_dspark.engine.paths import proxy_host

    monkeypatch.setattr(proxy_host, "START_WAIT_SLACK_S", 0.2)

    class SlowSelfTest(facade.AsyncPath):
        def __init__(self, *args, **kw):
            time.sleep(1.0)  # longer than the whole wait: CONNECT_TIMEOUT_MS 500 + 0.2 s
            super().__init__(*args, **kw)

    monkeypatch.setattr(facade, "AsyncPath", SlowSelfTest)
    with make(async_env(worker.port, tmp_path, "process", VLLM_DSPARK_REMOTE_CONNECT_TIMEOUT_MS="500")) as rd:
        assert rd.round(batch()).outcome is Outcome.OK

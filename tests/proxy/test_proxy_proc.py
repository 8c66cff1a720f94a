"""The proxy process end to end: a region, a real worker on loopback, a supervisor-style
spawn, rounds answered through the region; and that the child stays torch-free."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from helpers import drafter_env, readline_within, until

from remote_dspark import wire
from remote_dspark.config.api import RemoteConfig
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import MarkovModel
from remote_dspark.outcome import Outcome
from remote_dspark.proxy import handover
from remote_dspark.proxy.spawn import proxy_environment, spawn_proxy
from remote_dspark.shm import layout, memfd, ring, streamsync

MODEL = MarkovModel.from_tokens([1, 2, 3, 4] * 10, order=1, top=2)
HEAVY = ("torch", "numpy", "prometheus_client")


def proxy_command(fd: int, handover_fd: int) -> list[str]:
    """The proxy process's command line over region ``fd`` and hand-over ``handover_fd``,
    its parent this process."""
    cmd = ["-m", "remote_dspark.proxy_proc", "--fd", str(fd), "--handover", str(handover_fd)]
    return [sys.executable, *cmd, "--parent", str(os.getpid())]


def env_for(worker, lib, **extra):
    settings = {
        "VLLM_DSPARK_REMOTE_ASYNC_NAP_US": "50",  # do not burn a CI core while idle
        "VLLM_DSPARK_REMOTE_TIMEOUT_MS": "1000",
    }
    base = drafter_env(MarkovDrafter(MODEL), worker.port, **{**settings, **extra})
    return proxy_environment(base, lib.path)


def test_the_proxy_environment_is_an_allowlist():
    transport = {
        "LD_LIBRARY_PATH": "/opt/ofl/lib",
        "OFL_LOG": "1",
        "RDMAV_FORK_SAFE": "1",
        "IBV_FORK_SAFE": "1",
        "MLX5_SINGLE_THREADED": "1",
        "FI_PROVIDER": "verbs",
        "UCX_NET_DEVICES": "mlx5_0:1",
    }
    env = proxy_environment(
        {
            "PATH": "/bin",
            "LD_PRELOAD": "/evil.so",
            "PYTHONPATH": "/planted",
            "CUDA_VISIBLE_DEVICES": "0",
            "VLLM_DSPARK_REMOTE_TRIP": "2",
            "SECRET_TOKEN": "x",
            "XFI_PROVIDER": "x",
            **transport,
        },
        "/lib/hostflag.so",
    )
    assert env == {
        "PATH": "/bin",
        "VLLM_DSPARK_REMOTE_TRIP": "2",
        **transport,
        "VLLM_DSPARK_REMOTE_HOSTFLAG_LIB": "/lib/hostflag.so",
    }


def spawn(fd, env, engine_id=7):
    return spawn_proxy(fd, cfg=RemoteConfig.from_env(env), engine_id=engine_id, env=env)


class Engine:
    """The engine side of the tests: one region, the ring's producer, the CPU hand-off."""

    def __init__(self, lib, session=0x1234):
        self.region = memfd.Region.create(layout.Layout(4, 8, 4, 3, 64))
        self.end = ring.EngineEnd(self.region, lib)
        self.end.header.set_session(session)
        self.sync = streamsync.HostFlagSync(self.region, lib, spin_us=100, nap_us=50)

    def round(self, entries, timeout_s=5.0):
        r = self.end.reserve(timeout_s)
        self.end.write_entries(r, entries, deadline_ms=1000)
        self.end.staging(r)[: 4 * len(entries)] = bytes(4 * len(entries))
        assert self.sync.handoff(r, timeout_s).ok
        return self.end.drafts(r)

    def close(self):
        self.region.close()


def test_proxy_process_serves_rounds_through_the_region(lib, worker):
    eng = Engine(lib)
    proc = spawn(eng.region.fd, env_for(worker, lib))
    try:
        assert until(lambda: eng.end.header.proxy_pid == proc.pid)
        d = eng.round([wire.Entry(0, 3, 0, (1,), new_gen=True), wire.Entry(5, 2, 0, (3,), new_gen=True)])
        assert d.outcome == Outcome.OK and d.tokens == ((2, 3, 4), (4, 1))
        d = eng.round([wire.Entry(0, 3, 1, (2,))])
        assert d.tokens == ((3, 4, 1),) and d.statuses == (wire.STATUS_OK,)
        snap = eng.region.proxy_counters(lib).snapshot()
        # attempts are counted by the proxy's Python after the release: wait for them
        assert until(lambda: eng.region.proxy_counters(lib).snapshot().counters["attempts"] == 2)
        assert snap.counters["rounds_ok"] == 2
        assert snap.counters["draft_tokens"] == 8
        assert snap.histograms["round_latency"].count == 2
        assert eng.end.header.heartbeat_ns > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)
        eng.close()


def test_proxy_without_worker_answers_target_only_and_breaker_state_lands_in_the_region(lib, worker):
    eng = Engine(lib)
    port = worker.port
    worker.stop()  # nothing listens: every round is answered empty, never left hanging
    env = env_for(
        worker,
        lib,
        VLLM_DSPARK_REMOTE=f"tcp://127.0.0.1:{port}",
        VLLM_DSPARK_REMOTE_BACKOFF_MS="60000",
        VLLM_DSPARK_REMOTE_BACKOFF_MAX_MS="60000",
    )
    proc = spawn(eng.region.fd, env)
    try:
        for _ in range(3):
            d = eng.round([wire.Entry(0, 3, 0, (1,), new_gen=True)])
            assert d.outcome == Outcome.ERROR and d.counts == ()
        snap = eng.region.proxy_counters(lib).snapshot()
        assert snap.counters["rounds_error"] == 3 and snap.counters["attempts"] == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)
        eng.close()


def test_proxy_process_imports_no_heavy_module(lib, worker):
    """The child's own import log (PYTHONPROFILEIMPORTTIME) names every module it loaded."""
    eng = Engine(lib)
    env = env_for(worker, lib)
    env["PYTHONPROFILEIMPORTTIME"] = "1"
    handover_fd = handover.write(RemoteConfig.from_env(env), 7)
    proc = subprocess.Popen(
        proxy_command(eng.region.fd, handover_fd),
        pass_fds=(eng.region.fd, handover_fd),
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(handover_fd)
    try:
        assert eng.round([wire.Entry(0, 1, 0, (1,), new_gen=True)]).tokens == ((2,),)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
        imported = {line.split("|")[-1].strip() for line in err.splitlines() if line.startswith("import time:")}
        # (-m runs the module itself as __main__; what it imports shows up by name)
        assert {"remote_dspark.shm.ring", "remote_dspark.transport.link", "remote_dspark.shm.memfd"} <= imported
        assert not [m for m in imported if m.split(".")[0] in HEAVY]
    finally:
        proc.kill()
        proc.wait(timeout=10)
        eng.close()


def test_the_proxy_takes_the_engines_configuration_not_the_environment(lib, worker):
    """The engine hands over its validated RemoteConfig and id: an environment that says
    otherwise (here: one the contract refuses, and other identities) changes nothing."""
    env = env_for(worker, lib)
    cfg = RemoteConfig.from_env(env)
    env.update(VLLM_DSPARK_REMOTE_TIMEOUT_MS="soon", VLLM_DSPARK_REMOTE_IDENTITY="00" * 32)
    eng = Engine(lib)
    proc = spawn_proxy(eng.region.fd, cfg=cfg, engine_id=7, env=env)
    try:
        d = eng.round([wire.Entry(0, 3, 0, (1,), new_gen=True)])
        assert d.outcome == Outcome.OK and d.tokens == ((2, 3, 4),)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        eng.close()


def test_a_bad_handover_is_refused_with_status_3(lib, worker):
    eng = Engine(lib)
    r, w = os.pipe()
    os.write(w, b'{"engine_id": 1}')
    os.close(w)
    try:
        proc = subprocess.run(
            proxy_command(eng.region.fd, r),
            pass_fds=(eng.region.fd, r),
            env=env_for(worker, lib),
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        os.close(r)
        eng.close()
    assert proc.returncode == 3 and "hand-over fd" in proc.stderr and "not the engine's document" in proc.stderr


def test_planted_modules_never_run_in_the_proxy(lib, worker, tmp_path, monkeypatch):
    """An engine started from a directory holding ``argparse.py`` (or with one on
    PYTHONPATH) must not run it in its proxies: the proxy's interpreter is isolated and
    works from ``/``."""
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "planted-code-ran"
    for name in ("argparse", "threading", "signal"):
        (planted / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\nraise SystemExit(9)\n")
    monkeypatch.chdir(planted)
    env = env_for(worker, lib)
    env["PYTHONPATH"] = str(planted)
    eng = Engine(lib)
    proc = spawn(eng.region.fd, env)
    try:
        assert until(lambda: eng.end.header.proxy_pid == proc.pid or proc.poll() is not None)
        d = eng.round([wire.Entry(0, 3, 0, (1,), new_gen=True)])
        assert d.outcome == Outcome.OK and d.tokens == ((2, 3, 4),)
        assert os.readlink(f"/proc/{proc.pid}/cwd") == "/"
        assert not marker.exists()
    finally:
        proc.kill()
        proc.wait(timeout=10)
        eng.close()


def test_proxy_exits_when_its_engine_dies(lib, worker, tmp_path):
    """A stand-in engine spawns the proxy and is SIGKILLed: the proxy follows it."""
    code = (
        "import os, sys\n"
        "from remote_dspark.shm import layout, memfd\n"
        "from remote_dspark.proxy.spawn import spawn_proxy\n"
        "r = memfd.Region.create(layout.Layout(4, 8, 4, 3, 64))\n"
        "from remote_dspark.config import RemoteConfig\n"
        "p = spawn_proxy(r.fd, cfg=RemoteConfig.from_env(), engine_id=1, env=dict(os.environ))\n"
        "print(p.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    engine = subprocess.Popen(
        [sys.executable, "-c", code], env=env_for(worker, lib), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    proxy_pid = None
    try:
        proxy_pid = int(readline_within(engine.stdout, 30, "the stand-in engine's proxy pid"))
        engine.kill()
        engine.wait(timeout=10)

        def gone():
            try:
                with open(f"/proc/{proxy_pid}/stat") as f:
                    return f.read().split(")")[1].split()[0] == "Z"  # exited; awaiting init's reap
            except FileNotFoundError:
                return True

        assert until(gone)
    finally:
        engine.kill()
        engine.wait(timeout=10)
        if proxy_pid is not None:
            try:
                os.kill(proxy_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_proxy_refuses_a_bad_fd_with_status_3(lib, worker, tmp_path):
    path = tmp_path / "not-a-region"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDWR)
    env = env_for(worker, lib)
    handover_fd = handover.write(RemoteConfig.from_env(env), 1)
    try:
        proc = subprocess.run(
            proxy_command(fd, handover_fd),
            pass_fds=(fd, handover_fd),
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        os.close(fd)
        os.close(handover_fd)
    assert proc.returncode == 3 and "magic" in proc.stderr

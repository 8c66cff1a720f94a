"""The proxy hosts, each through start and stop over a real region and a loopback worker:
the thread host and the process host behind the one interface the async path uses."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import pytest
from helpers import env_for

from remote_dspark.config.api import RemoteConfig
from remote_dspark.engine import Mode, RemoteDSpark
from remote_dspark.engine.paths.handoff import Handoff
from remote_dspark.engine.paths.proxy_host import ProcessHost, ThreadHost, host_for


@contextlib.contextmanager
def handoff(port: int, tmp_path, mode: Mode, **kw):
    """The region's hand-off of an engine of ``mode`` (not started): its spec and its
    path; the region is unmapped on the way out."""
    env = env_for(port, tmp_path, mode, **kw)
    rd = RemoteDSpark(RemoteConfig.from_env(env), num_spec=3, max_slots=4, row_bytes=8, environ=env)
    path = Handoff(rd.spec, rd.counts)
    try:
        yield rd.spec, path
    finally:
        path.users.shut()
        path.users.leave()


def test_the_thread_host_runs_the_proxy_as_a_thread_of_the_engine(worker, tmp_path):
    before = sys.getswitchinterval()
    with handoff(worker.port, tmp_path, Mode.THREAD, VLLM_DSPARK_REMOTE_SWITCH_INTERVAL_US="700") as (spec, path):
        host = host_for(spec, path)
        assert isinstance(host, ThreadHost) and host.thread_alive is None and host.stop()  # never started: gone
        host = host_for(spec, path)
        host.start()
        try:
            assert host.thread_alive is True and sys.getswitchinterval() == pytest.approx(700e-6)
            assert host.serving_session() == path.end.header.session != 0  # start() waited for it
            assert path.serving_session() == host.serving_session()  # the path asks its host
            assert (host.supervisor, host.supervisor_stats()) == (None, None)
        finally:
            gone = host.stop()
        assert gone and host.thread_alive is False and sys.getswitchinterval() == before
        assert path.users.inside == 0  # the proxy thread left the region


def test_the_process_host_runs_the_proxy_under_a_supervisor(worker, tmp_path):
    env = {"VLLM_DSPARK_REMOTE_ASYNC_STANDBY": "0"}
    with handoff(worker.port, tmp_path, Mode.PROCESS, **env) as (spec, path):
        host = host_for(spec, path)
        assert isinstance(host, ProcessHost) and host.supervisor is None and host.stop()  # never started: gone
        host = host_for(spec, path)
        host.start()
        try:
            up = host.supervisor.up
            assert up is not None  # start() waited for the supervisor's Up
            assert host.serving_session() == up.session == path.end.header.session != 0
            assert host.supervisor_stats().state == "up" and host.thread_alive is None
            pid = up.pid
        finally:
            gone = host.stop()
        assert gone and host.supervisor_stats().state == "closed"
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # ended and reaped


def test_a_sync_engine_has_no_proxy_host(worker, tmp_path):
    with handoff(worker.port, tmp_path, Mode.THREAD) as (spec, path):
        with pytest.raises(ValueError, match="sync mode runs no proxy"):
            host_for(dataclasses.replace(spec, mode=Mode.SYNC), path)

"""The region's context_tokens word: the proxy (its one writer) stores its worker's
HELLO_ACK context on every connection before a round goes out on it, 0 from attach and
after a drop; the engine's end of the region reads it."""

from __future__ import annotations

import pytest
from helpers import drafter_env, until

from remote_dspark.config.api import RemoteConfig
from remote_dspark.outcome import Outcome
from remote_dspark.proxy.loop import ProxyLoop
from remote_dspark.shm import layout, memfd, ring, streamsync
from remote_dspark.transport.breaker import Breaker
from remote_dspark.transport.link import RemoteLink
from remote_dspark.wire import Entry
from remote_dspark.worker import Worker


@pytest.fixture
def region():
    r = memfd.Region.create(layout.Layout(4, 4, 4, 3, 1024))
    yield r
    r.close()


def test_the_word_sits_in_the_proxys_header_line_and_layout_4_has_it():
    assert layout.LAYOUT_VERSION >= 4
    assert layout.OFF_PROXY_PID < layout.OFF_CONTEXT < layout.OFF_HEARTBEAT


def test_the_proxy_writes_its_workers_context_and_the_engine_reads_it(lib, drafter, region):
    eng = ring.EngineEnd(region, lib)
    lib.store32(region.addr(layout.OFF_CONTEXT), 999)  # what an earlier proxy's worker said
    with Worker(drafter, "127.0.0.1", 0, window=256) as w:
        env = drafter_env(drafter, w.port, VLLM_DSPARK_REMOTE_BACKOFF_MS="20", VLLM_DSPARK_REMOTE_BACKOFF_MAX_MS="40")
        loop = ProxyLoop(region, lib, RemoteConfig.from_env(env), engine_id=1, environ=env)
        try:
            assert eng.header.context_tokens == 0  # attached: no HELLO_ACK of its own yet
            loop.connect()
            assert eng.header.context_tokens == 256 == loop.link.context_tokens
            sync = streamsync.HostFlagSync(region, lib)
            r = eng.reserve(1)
            eng.write_entries(r, [Entry(s, 3, 0, tuple(range(1, 257)), new_gen=True) for s in range(4)], 0)
            sync.signal(r)
            loop.step(2.0)
            assert eng.drafts(r).outcome == Outcome.OK
            loop.rounds.detach()
            loop.link.drop("a test drops it")
            assert eng.header.context_tokens in (0, 256)  # 0 until the reconnect's HELLO_ACK
            assert until(lambda: loop.link.connected and eng.header.context_tokens == 256)
        finally:
            loop.rounds.detach()
            loop.link.close()


def test_the_link_tells_its_context_before_the_connection_is_used_and_0_on_a_drop(drafter):
    heard: list[tuple[int, bool]] = []
    with Worker(drafter, "127.0.0.1", 0, window=100) as w:
        env = drafter_env(drafter, w.port, VLLM_DSPARK_REMOTE_BACKOFF_MS="20", VLLM_DSPARK_REMOTE_BACKOFF_MAX_MS="40")
        cfg = RemoteConfig.from_env(env)
        link = RemoteLink(
            cfg.endpoint,
            cfg.hello(1, max_slots=4, row_bytes=4, num_spec=3),
            7,
            connect_timeout_ms=2000,
            backoff_ms=20,
            backoff_max_ms=40,
            breaker=Breaker(3, 3),
            on_context=lambda n: heard.append((n, link.connected)),
        )
        try:
            assert link.context_tokens == 0
            link.connect()
            assert link.context_tokens == 100 and heard == [(100, False)]  # before the connection is published
            link.drop("a test drops it")
            assert heard[1] == (0, False) and link.context_tokens in (0, 100)
            assert until(lambda: len(heard) == 3)
            assert heard[2] == (100, False) and until(lambda: link.context_tokens == 100)
        finally:
            link.close()

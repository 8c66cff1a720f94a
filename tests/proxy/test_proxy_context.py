"""The region's context_tokens and round_tokens words: the proxy (their one writer)
stores its worker's HELLO_ACK context and round cap on every connection before a round
goes out on it, 0 from attach and after a drop; the engine's end of the region reads
them."""

from __future__ import annotations

import pytest
from helpers import drafter_env, until

from remote_dspark.config.api import RemoteConfig
from remote_dspark.outcome import Outcome
from remote_dspark.proxy.loop import ProxyLoop
from remote_dspark.shm import layout, memfd, ring, streamsync, words
from remote_dspark.transport.breaker import Breaker
from remote_dspark.transport.link import RemoteLink
from remote_dspark.wire import Entry
from remote_dspark.worker import Worker


@pytest.fixture
def region():
    r = memfd.Region.create(layout.Layout(4, 4, 4, 3, 1024))
    yield r
    r.close()


def test_the_words_sit_in_the_proxys_header_lines_and_layout_9_has_the_link_words():
    assert layout.LAYOUT_VERSION == 9
    assert layout.OFF_PROXY_PID < layout.OFF_CONTEXT < layout.OFF_HEARTBEAT < layout.OFF_ROUND_TOKENS
    assert layout.OFF_ROUND_TOKENS + 4 <= layout.OFF_BREAKER
    assert layout.OFF_LINK % layout.LINE == 0 and layout.OFF_BREAKER + 32 <= layout.OFF_LINK


def test_the_link_words_round_trip_under_their_sequence(lib, region):
    hw = region.header_words(lib)
    assert hw.link() == words.LinkWords(0, 0, "", False)
    hw.set_link(3, 0xDEADBEEF, "127.0.0.2", 7000, True)
    assert hw.link() == words.LinkWords(3, 0xDEADBEEF, "127.0.0.2:7000", True) and hw.link_epoch == 3
    hw.set_link(4, 9, "::1", 80, False)
    assert hw.link() == words.LinkWords(4, 9, "[::1]:80", False)
    assert lib.load64(region.addr(layout.OFF_LINK)) == 4  # two writes, the sequence even


def test_the_proxy_writes_its_workers_context_and_the_engine_reads_it(lib, drafter, region):
    eng = ring.EngineEnd(region, lib)
    lib.store32(region.addr(layout.OFF_CONTEXT), 999)  # what an earlier proxy's worker said
    lib.store32(region.addr(layout.OFF_ROUND_TOKENS), 999)
    with Worker(drafter, "127.0.0.1", 0, window=256, max_round_tokens=1500) as w:
        env = drafter_env(drafter, w.port, VLLM_DSPARK_REMOTE_BACKOFF_MS="20", VLLM_DSPARK_REMOTE_BACKOFF_MAX_MS="40")
        loop = ProxyLoop(region, lib, RemoteConfig.from_env(env), engine_id=1, environ=env)
        try:
            assert eng.header.context_tokens == 0 == eng.header.round_tokens  # attached: no HELLO_ACK yet
            loop.connect()
            assert eng.header.context_tokens == 256 == loop.link.context_tokens
            assert eng.header.round_tokens == 1500 == loop.link.round_tokens
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
            assert eng.header.round_tokens == 1500
        finally:
            loop.rounds.detach()
            loop.link.close()


def test_the_link_tells_its_context_and_round_cap_before_the_connection_is_used_and_0_on_a_drop(drafter):
    heard: list[tuple[int, int, bool]] = []
    with Worker(drafter, "127.0.0.1", 0, window=100, max_round_tokens=700) as w:
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
            on_acked=lambda n, r: heard.append((n, r, link.connected)),
        )
        try:
            assert link.context_tokens == 0 == link.round_tokens
            link.connect()
            assert (link.context_tokens, link.round_tokens) == (100, 700)
            assert heard == [(100, 700, False)]  # before the connection is published
            link.drop("a test drops it")
            assert heard[1] == (0, 0, False) and link.context_tokens in (0, 100)
            assert until(lambda: len(heard) == 3)
            assert heard[2] == (100, 700, False) and until(lambda: link.context_tokens == 100)
        finally:
            link.close()


class Recording:
    """A native library's store32 and load32, recording each store's word and value."""

    def __init__(self, lib, region):
        self.lib, self.stores = lib, []
        self.names = {region.addr(layout.OFF_CONTEXT): "context", region.addr(layout.OFF_ROUND_TOKENS): "round"}

    def store32(self, addr, value):
        self.stores.append((self.names.get(addr, addr), value))
        self.lib.store32(addr, value)

    def __getattr__(self, name):
        return getattr(self.lib, name)


def test_a_connection_stores_its_round_cap_before_its_context_and_a_drop_after(lib, region):
    """The engine reads the context first: a nonzero context is never paired with an
    earlier connection's round cap."""
    rec = Recording(lib, region)
    header = words.HeaderWords(region, rec)
    header.set_acked(256, 1500)
    header.set_acked(0, 0)
    assert rec.stores == [("round", 1500), ("context", 256), ("context", 0), ("round", 0)]
    assert (header.context_tokens, header.round_tokens) == (0, 0)

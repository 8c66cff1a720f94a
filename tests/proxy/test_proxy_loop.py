"""The proxy loop in this process, one ``step`` at a time, against a real worker: what
Python does around the native round (the breaker, the counters, dropping a connection)."""

from __future__ import annotations

import struct

import pytest
from helpers import drafter_env

from remote_dspark import native, wire
from remote_dspark.config.api import RemoteConfig
from remote_dspark.outcome import Outcome
from remote_dspark.proxy.loop import ProxyLoop
from remote_dspark.shm import layout, memfd, ring, streamsync
from remote_dspark.transport.breaker import State

NEW = [wire.Entry(0, 3, 0, (1,), new_gen=True)]


class Rig:
    def __init__(self, lib, worker, drafter, **env):
        settings = {"VLLM_DSPARK_REMOTE_ASYNC_SPIN_US": "50", "VLLM_DSPARK_REMOTE_TIMEOUT_MS": "2000"}
        base = drafter_env(drafter, worker.port, **{**settings, **env})
        self.region = memfd.Region.create(layout.Layout(4, 4, 4, 3, 64))
        self.eng = ring.EngineEnd(self.region, lib)
        self.sync = streamsync.HostFlagSync(self.region, lib)
        self.loop = ProxyLoop(self.region, lib, RemoteConfig.from_env(base), engine_id=1, environ=base)
        self.loop.connect()

    def round(self, entries=NEW, deadline_ms=0) -> ring.RoundDrafts:
        r = self.eng.reserve(1)
        self.eng.write_entries(r, entries, deadline_ms)
        self.sync.signal(r)
        self.loop.step(2.0)
        assert self.eng.released() == r
        return self.eng.drafts(r)

    def counters(self) -> dict:
        return self.loop.end.counters.snapshot().counters

    def close(self):
        self.loop.rounds.detach()
        self.loop.link.close()
        self.region.close()


@pytest.fixture
def rig(lib, worker, drafter):
    r = Rig(lib, worker, drafter, VLLM_DSPARK_REMOTE_TRIP="2", VLLM_DSPARK_REMOTE_COOLDOWN="2")
    yield r
    r.close()


def test_rounds_go_through_the_native_round_and_are_counted(rig):
    d = rig.round()
    assert d.outcome == Outcome.OK and d.tokens == ((2, 3, 4),)
    c = rig.counters()
    assert (c["rounds_ok"], c["attempts"]) == (1, 1) and rig.loop.link.attempts == 1


def test_idle_ticks_do_not_spend_the_breakers_cooldown(rig, drafter):
    drafter.gate.clear()
    assert [rig.round(deadline_ms=20).outcome for _ in range(2)] == [Outcome.TIMEOUT] * 2
    store = rig.loop.breaker.breaker.store
    assert store.state == State.OPEN and store.cooldown_left == 2
    for _ in range(5):
        rig.loop.step(0.001)  # no round: the breaker is asked once, for the next
    assert [rig.round().outcome for _ in range(2)] == [Outcome.BREAKER_SKIP] * 2
    drafter.gate.set()
    assert rig.round().outcome == Outcome.OK  # the probe
    assert store.state == State.CLOSED and store.probes == 1
    assert rig.region.header_words(native.load()).breaker().state == State.CLOSED  # in the region
    c = rig.counters()  # the timed-out rounds' replies came while the probe waited: late
    assert (c["attempts"], c["rounds_breaker_skip"], c["rounds_late"]) == (3, 2, 2)


@pytest.mark.slow
def test_a_lost_connection_is_dropped_and_rounds_go_target_only_until_it_is_back(rig, worker):
    assert rig.round().outcome == Outcome.OK
    worker.stop()
    # The send or the reply fails, or the link's keeper saw the worker hang up first and
    # the round went nowhere (the connection word already said none).
    assert rig.round().outcome == Outcome.ERROR
    assert not rig.loop.link.connected and not rig.loop.rounds.attached
    assert rig.counters()["failovers_lost"] == 1
    sent = rig.counters()["attempts"]
    assert sent in (1, 2)
    assert rig.round().outcome == Outcome.ERROR  # no connection: at once, not sent
    assert rig.counters()["attempts"] == sent


def test_the_python_round_checks_and_unpacks_in_c_as_the_native_one(rig):
    """The ofl path (``serve``: the round sent by Python) over the same connection: a
    good round's drafts land; a bad descriptor is answered ERROR, never sent, counted."""

    def take(entries, corrupt_slot=None):
        r = rig.eng.reserve(1)
        rig.eng.write_entries(r, entries)
        if corrupt_slot is not None:  # the second entry's slot := the first's
            at = rig.region.layout.desc(r & (rig.region.layout.depth - 1)) + layout.DESC_FIXED
            with rig.region.view(at, wire.round_meta_bytes(len(entries))) as d:
                struct.pack_into("<I", d, wire.round_sections(len(entries), 0, 4).slots + 4, corrupt_slot)
        rig.sync.signal(r)
        rnd = rig.loop.end.next_round(2.0)
        assert rnd is not None and rnd.round == r
        rig.loop.serve(rnd)
        assert rig.eng.released() == r
        return rig.eng.drafts(r)

    d = take(NEW)
    assert d.outcome == Outcome.OK and d.tokens == ((2, 3, 4),)
    d = take([wire.Entry(0, 3, 1, ()), wire.Entry(2, 3, 0, (), new_gen=True)], corrupt_slot=0)
    assert d.outcome == Outcome.ERROR and d.counts == ()
    c = rig.counters()
    assert (c["rounds_ok"], c["rounds_error"], c["rounds_bad_desc"], c["attempts"]) == (1, 1, 1, 1)

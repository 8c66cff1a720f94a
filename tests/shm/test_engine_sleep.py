"""The engine's CPU wait for a round's release: after its spin (``ASYNC_SPIN_US``) it
sleeps on the ``released`` futex, says so in the region's ``waiters`` word, and every
releaser wakes it: the proxy's ``complete`` (``hf_answer``), the C round (``hf_round``),
the watchdog, the release of a dead proxy's orphans (under the watchdog's lock and
without it) and the engine's own no-proxy release (the supervisor's answers for a lost
proxy, and ``close``'s fence).

Each sleeper's own deadline is ``SLEEP_S``: a wake-up that never comes shows as a wait
that long, far past the generous ``WOKEN_S`` the test gives a woken one. A sleeper left
by a failing test is released in ``finally`` if its round is still due, and joined
within its own deadline (never left behind).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
from helpers import until

from remote_dspark import native, wire
from remote_dspark.outcome import Outcome
from remote_dspark.proxy import ring_end
from remote_dspark.proxy.tcp_round import TcpRounds
from remote_dspark.shm import layout, memfd, ring, streamsync

SLEEP_S = 30.0  # the sleeper's own deadline: a lost wake-up waits this long
WOKEN_S = 10.0  # generous: a woken sleeper is back long before this


def make_region() -> memfd.Region:
    return memfd.Region.create(layout.Layout(4, 4, 8, 3, 64))


def waiters(lib, region) -> int:
    return lib.load32(region.addr(region.layout.waiters))


def gathered_round(lib, region, eng: ring.EngineEnd) -> int:
    """A round reserved, described and gathered (the CPU stand-in's part of a hand-off)."""
    r = eng.reserve(1)
    eng.write_entries(r, [wire.Entry(1, 0, 0, [2])])
    lib.signal(region.addr(region.layout.gathered), 0, r, 0)
    return r


@contextlib.contextmanager
def asleep(lib, region, r: int, *, spin_us: int = 0, nap_us: int = 0):
    """An engine thread waiting for round ``r``'s release as ``Handoff.round`` does on
    the CPU (spin 0: asleep at once); the body releases ``r``, and on leaving the thread
    must be back, released, within WOKEN_S, the ``waiters`` word clear again."""
    sync = streamsync.HostFlagSync(region, lib, spin_us=spin_us, nap_us=nap_us)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(sync.wait(r, SLEEP_S)))
    t.start()
    try:
        yield t
        t.join(WOKEN_S)
        assert not t.is_alive(), "the release did not wake the sleeping engine"
        assert got == [True] and waiters(lib, region) == 0
    finally:
        if t.is_alive():  # a failed test: release r if it is still due, else its deadline ends it
            lay = region.layout
            if not ring.seq_geq(lib.load32(region.addr(lay.released)), r):
                lib.publish(region.addr(lay.released), region.addr(lay.waiters), r, native.deadline_ns(1.0))
            t.join(SLEEP_S)


def release_by_complete(lib, region, eng, r):
    end = ring_end.ProxyEnd(region, lib, spin_us=0, nap_us=50)
    rnd = end.next_round(WOKEN_S)
    assert rnd is not None and rnd.round == r
    assert end.complete(rnd, None, Outcome.TIMEOUT)


def release_by_c_round(lib, region, eng, r):
    end = ring_end.ProxyEnd(region, lib, spin_us=0, nap_us=50)
    served = TcpRounds(end, session=1, default_deadline_ms=100).serve(WOKEN_S, send=False, at_once=Outcome.BREAKER_SKIP)
    assert served is not None and served.round == r and served.released


def release_by_watchdog(lib, region, eng, r):
    eng.start_watchdog(20, poll_us=1000)  # stopped by the region's close
    assert until(lambda: ring.seq_geq(eng.released(), r), timeout=WOKEN_S)


def _claim_as_a_dead_proxy(lib, region, r):
    assert lib.claim(region.addr(region.layout.claim), r) == 0


def release_orphans_under_watchdog(lib, region, eng, r):
    _claim_as_a_dead_proxy(lib, region, r)
    eng.start_watchdog(60_000)  # holds the lock the orphans' release takes; never fires here
    assert eng.release_orphans() == 1


def release_orphans_without_watchdog(lib, region, eng, r):
    _claim_as_a_dead_proxy(lib, region, r)
    assert eng.release_orphans() == 1


def release_no_proxy(lib, region, eng, r):
    assert eng.release_no_proxy(r)  # the supervisor's drain and close's fence


RELEASERS = {
    "complete": release_by_complete,
    "c_round": release_by_c_round,
    "watchdog": release_by_watchdog,
    "orphans_watchdog_lock": release_orphans_under_watchdog,
    "orphans_no_watchdog": release_orphans_without_watchdog,
    "no_proxy": release_no_proxy,
}


@pytest.mark.parametrize("how", sorted(RELEASERS))
def test_every_releaser_wakes_the_sleeping_engine(lib, how):
    with make_region() as region:
        eng = ring.EngineEnd(region, lib)
        r = gathered_round(lib, region, eng)
        with asleep(lib, region, r):
            assert until(lambda: waiters(lib, region) == 1), "the engine's wait never went to sleep"
            RELEASERS[how](lib, region, eng, r)


def test_a_nap_keeps_its_meaning_and_never_sleeps_on_the_futex(lib):
    """ASYNC_NAP_US > 0: the wait naps between looks, as the contract says, and never
    announces itself on the futex; it sees the release all the same."""
    with make_region() as region:
        eng = ring.EngineEnd(region, lib)
        r = gathered_round(lib, region, eng)
        with asleep(lib, region, r, spin_us=0, nap_us=200) as t:
            looks = [waiters(lib, region) for _ in range(200) if t.is_alive() and not t.join(0.001)]
            assert looks and set(looks) == {0}
            assert eng.release_no_proxy(r)

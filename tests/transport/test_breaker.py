"""The breaker's transitions, one test each."""

import pytest

from remote_dspark.outcome import RoundEvent
from remote_dspark.transport.breaker import Breaker, BreakerRecord, State


def tripped(trip=3, cooldown=4):
    b = Breaker(trip, cooldown)
    for _ in range(trip):
        assert b.allow()
        b.failure()
    return b


def test_closed_stays_closed_below_trip():
    b = Breaker(3, 4)
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.state == State.CLOSED and b.store.failures == 2


def test_success_resets_consecutive_failures():
    b = Breaker(3, 4)
    for call in (b.failure, b.failure, b.success, b.failure, b.failure):
        call()
    assert b.state == State.CLOSED


def test_trip_consecutive_failures_open():
    b = tripped()
    assert b.state == State.OPEN and b.store.trips == 1 and b.store.cooldown_left == 4


def test_open_skips_exactly_cooldown_rounds_then_probes():
    b = tripped(cooldown=4)
    assert [b.allow() for _ in range(4)] == [False] * 4
    assert b.allow() and b.state == State.PROBING and b.store.probes == 1


def test_probe_success_closes():
    b = tripped(cooldown=1)
    b.allow()
    b.allow()
    b.success()
    assert b.state == State.CLOSED and b.store.failures == 0
    assert b.allow()


def test_probe_failure_reopens_for_a_full_cooldown():
    b = tripped(cooldown=2)
    for _ in range(3):
        b.allow()
    b.failure()
    assert b.state == State.OPEN and b.store.trips == 2 and b.store.cooldown_left == 2
    assert [b.allow() for _ in range(3)] == [False, False, True]


def test_trip_zero_never_opens():
    b = Breaker(0, 4)
    for _ in range(100):
        assert b.allow()
        b.failure()
    assert b.state == State.CLOSED and b.store.trips == 0


def test_state_lives_in_the_store_across_owners():
    """A respawned proxy builds a new Breaker over the same store and carries on."""
    store = BreakerRecord()
    first = Breaker(2, 3, store)
    first.failure()
    first.failure()
    second = Breaker(2, 3, store)
    assert second.state == State.OPEN and [second.allow() for _ in range(4)] == [False, False, False, True]


@pytest.mark.parametrize("trip,cooldown", [(-1, 1), (1, 0)])
def test_bad_parameters(trip, cooldown):
    with pytest.raises(ValueError, match=f"trip={trip}"):
        Breaker(trip, cooldown)


# What each network event means to the breaker, written out here rather than read from
# the module: a worker that answered (even unfittingly) is reachable; silence or a broken
# connection is a failure; a round that never reached the network says nothing.
VERDICT = {
    RoundEvent.OK: "success",
    RoundEvent.BAD_REPLY: "success",
    RoundEvent.TIMEOUT: "failure",
    RoundEvent.LOST: "failure",
    RoundEvent.PROTOCOL: "failure",
    RoundEvent.AT_ONCE: "none",
    RoundEvent.BAD_DESC: "none",
}


@pytest.mark.parametrize("event", list(RoundEvent))
def test_every_event_has_one_verdict(event):
    b = Breaker(trip=2, cooldown=4)
    b.observe(RoundEvent.TIMEOUT)  # one failure on record
    b.observe(event)
    after = (b.state, b.store.failures)
    expected = {"success": (State.CLOSED, 0), "failure": (State.OPEN, 0), "none": (State.CLOSED, 1)}
    assert after == expected[VERDICT[event]]

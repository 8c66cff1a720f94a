"""The keeper against workers that misbehave, and the link's edges: a worker that
accepts and hangs up at once is not dialled in a loop, a PING waits for the link's lock without losing its spare, and a
link closed under a round never fails over. Loopback only (127.0.0.x); stand-ins are
threads of the test."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from helpers import COUNTING, WorkerStandIn, gated_drafter, until

from remote_dspark import wire
from remote_dspark.outcome import RoundEvent
from remote_dspark.transport import parse_endpoint
from remote_dspark.transport.breaker import Breaker
from remote_dspark.transport.link import RemoteLink
from remote_dspark.worker import Worker

DRAFTER = gated_drafter(COUNTING)


def hang_up(conn: socket.socket) -> None:
    conn.close()


def make_link(ips: list[str], port: int, backoff_ms: int = 200, **kw) -> RemoteLink:
    return RemoteLink(
        parse_endpoint(f"tcp://fleet.test:{port}"),
        wire.Hello(DRAFTER.drafter_identity, DRAFTER.markov_identity, 1, 4, 0, 3),
        5,
        connect_timeout_ms=500,
        backoff_ms=backoff_ms,
        backoff_max_ms=4 * backoff_ms,
        breaker=Breaker(3, 2),
        resolve=lambda host, p, timeout_s: list(ips),
        **kw,
    )


@pytest.fixture
def worker():
    w = Worker(DRAFTER, "127.0.0.1", 0).start()
    yield w
    w.stop()


@pytest.mark.parametrize("role", ["active", "spare"])
def test_a_worker_that_accepts_and_hangs_up_at_once_is_not_dialled_in_a_loop(worker, role):
    """Its address answers HELLO, so no dial fails; the connection it hangs up lived a
    moment. The keeper avoids it for the back-off (200 ms here): a few dials in half a
    second, not one per round trip."""
    flapper = WorkerStandIn("127.0.0.2", worker.port if role == "spare" else 0, DRAFTER, after=hang_up)
    ips = ["127.0.0.1", "127.0.0.2"] if role == "spare" else ["127.0.0.2"]
    link = make_link(ips, worker.port if role == "spare" else flapper.port)
    try:
        link.connect()
        assert until(lambda: flapper.hellos >= 2, timeout=5)
        start = flapper.hellos
        time.sleep(0.5)  # a window to count dials in, not a wait for something to happen
        assert flapper.hellos - start <= 5
    finally:
        link.close()
        flapper.close()


def test_a_ping_that_waited_for_the_links_lock_keeps_its_spare(worker):
    """The keeper reads its clock, then waits for the link's lock (a failover under way
    on the round thread, or the GIL): the PING's send deadline starts when it sends."""
    other = Worker(DRAFTER, "127.0.0.2", worker.port).start()
    link = make_link(["127.0.0.1", "127.0.0.2"], worker.port)
    try:
        link.keeper.connect_best()  # the keeper's thread not started: this test is its turn
        spare = link.spare
        assert spare is not None
        link.keeper._send_ping(time.monotonic() - 0.01)  # its clock read 10 ms ago
        assert link.spare is spare, link.last_error
        assert link.keeper._ping is not None and link.keeper._ping[0] is spare  # sent, its answer awaited
    finally:
        link.close()
        other.stop()


def test_a_link_closed_under_a_round_does_not_fail_over(worker):
    """interrupt() shuts the active down for a closing engine: the round it ends is no
    lost worker (no failover counted, the spare not promoted, no new epoch)."""
    other = Worker(DRAFTER, "127.0.0.2", worker.port).start()
    link = make_link(["127.0.0.1", "127.0.0.2"], worker.port)
    try:
        link.connect()
        assert link.spare is not None
        link.interrupt()
        r = link.round_entries(1, [wire.Entry(0, 3, 0, (1,), new_gen=True)], b"", 0, 2000)
        assert r.event is RoundEvent.LOST
        assert link.failovers["lost"] == 0 and link.epoch == 1
    finally:
        link.close()
        other.stop()


def test_a_keeper_turn_that_raises_does_not_end_the_keeper():
    """A hook that raises once on the keeper's thread (the spare's drop) costs that turn,
    not the keeper: the spare's worker back, a spare is made again."""
    raised = []

    def on_change(active, spare):
        if threading.current_thread().name == "link-keeper" and not raised:
            raised.append(1)
            raise RuntimeError("a hook's bug")

    workers = [Worker(DRAFTER, "127.0.0.1", 0).start()]
    port = workers[0].port
    workers.append(Worker(DRAFTER, "127.0.0.2", port).start())
    link = make_link(["127.0.0.1", "127.0.0.2"], port, backoff_ms=20, on_change=on_change)
    try:
        link.connect()
        i = int(link.spare.address.host[-1]) - 1
        workers[i].stop()  # the keeper drops the spare: its hook raises
        assert until(lambda: raised and link.spare is None, timeout=5)
        workers[i] = Worker(DRAFTER, f"127.0.0.{i + 1}", port).start()
        assert until(lambda: link.spare is not None, timeout=5)
    finally:
        link.close()
        for w in workers:
            w.stop()


def test_an_address_gone_from_the_fleet_takes_its_back_off_with_it(worker):
    """The keeper's table of addresses avoided holds only the fleet's: a resolver that
    answers new addresses every time (pods replaced, or a hostile one) grows nothing."""
    ips = ["127.0.0.1", "127.0.0.3"]  # nothing listens on 127.0.0.3 or .4: refused
    link = make_link(ips, worker.port, backoff_ms=20)
    try:
        link.connect()
        avoided = link.keeper._avoid
        assert until(lambda: any(a.host == "127.0.0.3" for a in tuple(avoided)), timeout=5)
        ips[1] = "127.0.0.4"
        link.fleet.retry_s = 0.0
        link.fleet.refresh(force=True)
        assert until(lambda: {a.host for a in tuple(avoided)} == {"127.0.0.4"}, timeout=5), avoided
    finally:
        link.close()


def test_a_spare_left_mid_frame_by_the_keeper_is_never_promoted(worker):
    """A spare whose worker sent part of a frame (the keeper read it and waits for the
    rest): a native reader taking that socket would start mid-frame, so when the active
    goes the link reconnects instead of promoting it."""
    half = WorkerStandIn(
        "127.0.0.2", worker.port, DRAFTER, after=lambda conn: conn.sendall(wire.encode_ping(5, 1)[:10])
    )
    link = make_link(["127.0.0.1", "127.0.0.2"], worker.port)
    try:
        link.connect()
        spare = link.spare
        assert link.active.address.host == "127.0.0.1" and spare is not None
        assert until(lambda: spare.client.chan.mid_frame)
        link.drop("a test leaves the active")
        assert link.active is not spare and link.spare is not spare  # left with the active
        assert until(lambda: link.active is not None)  # the keeper reconnects instead
        assert link.active is not spare and link.failovers["lost"] == 1
    finally:
        link.close()
        half.close()

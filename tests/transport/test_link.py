"""The proxy's network side against a real worker: timeouts, late replies, breaker,
reconnect with back-off."""

import pytest
from helpers import recv_exactly, until

from remote_dspark import wire
from remote_dspark.outcome import Outcome, RoundEvent
from remote_dspark.transport import TransportError, parse_endpoint
from remote_dspark.transport.breaker import Breaker, State
from remote_dspark.transport.link import RemoteLink
from remote_dspark.worker import Worker


def make_link(port, drafter, trip=3, cooldown=2, backoff_ms=20):
    hello = wire.Hello(drafter.drafter_identity, drafter.markov_identity, 1, 4, 0, 3)
    return RemoteLink(
        parse_endpoint(f"tcp://127.0.0.1:{port}"),
        hello,
        session=5,
        connect_timeout_ms=500,
        backoff_ms=backoff_ms,
        backoff_max_ms=4 * backoff_ms,
        breaker=Breaker(trip, cooldown),
    )


NEW = [wire.Entry(0, 3, 0, (1,), new_gen=True)]


def test_ok_round(worker, drafter):
    link = make_link(worker.port, drafter)
    link.connect()
    try:
        r = link.round_entries(1, NEW, b"", 0, 1000)
        assert (r.outcome, r.event) == (Outcome.OK, RoundEvent.OK) and r.drafts.row(0) == [2, 3, 4]
        assert (link.epoch, link.attempts) == (1, 1)
    finally:
        link.close()


def test_timeout_keeps_the_connection_and_the_late_reply_is_dropped(worker, drafter):
    link = make_link(worker.port, drafter)
    link.connect()
    try:
        drafter.gate.clear()
        assert link.round_entries(1, NEW, b"", 0, 30).outcome == Outcome.TIMEOUT
        drafter.gate.set()
        r = link.round_entries(2, [wire.Entry(0, 3, 1, (2,))], b"", 0, 2000)
        assert r.outcome == Outcome.OK and r.drafts.round_id == 2 and r.drafts.row(0) == [3, 4, 1]
        assert link.late == 1 and link.epoch == 1
    finally:
        link.close()


def test_breaker_opens_after_trip_timeouts_and_probes_after_cooldown(worker, drafter):
    link = make_link(worker.port, drafter, trip=2, cooldown=2)
    link.connect()
    try:
        drafter.gate.clear()
        outcomes = [link.round_entries(i, NEW, b"", 0, 20).outcome for i in (1, 2)]
        assert outcomes == [Outcome.TIMEOUT] * 2 and link.breaker.state == State.OPEN
        assert [link.round_entries(i, NEW, b"", 0, 20).outcome for i in (3, 4)] == [Outcome.BREAKER_SKIP] * 2
        drafter.gate.set()
        assert link.round_entries(5, NEW, b"", 0, 2000).outcome == Outcome.OK  # the probe
        assert link.breaker.state == State.CLOSED and link.breaker.store.probes == 1
        assert link.attempts == 3
    finally:
        link.close()


def test_lost_worker_means_backoff_rounds_then_reconnect_and_resync(drafter):
    w = Worker(drafter, "127.0.0.1", 0).start()
    port = w.port
    link = make_link(port, drafter, backoff_ms=20)
    link.connect()
    try:
        assert link.round_entries(1, NEW, b"", 0, 1000).outcome == Outcome.OK
        w.stop()
        # The keeper sees the worker hang up between rounds, or the round finds it broken.
        lost = link.round_entries(2, [wire.Entry(0, 3, 1, (2,))], b"", 0, 1000)
        assert lost.outcome == Outcome.ERROR and lost.event in (RoundEvent.LOST, RoundEvent.AT_ONCE)
        assert link.failovers == {"lost": 1, "stall": 0, "protocol": 0}
        unsent = link.round_entries(3, NEW, b"", 0, 1000)  # no connection: not sent
        assert (unsent.outcome, unsent.event) == (Outcome.ERROR, RoundEvent.AT_ONCE)
        w = Worker(drafter, "127.0.0.1", port).start()
        assert until(lambda: link.connected)
        assert (link.epoch, link.reconnects) == (2, 1)
        r = link.round_entries(4, [wire.Entry(0, 3, 2, (3,))], b"", 0, 1000)  # the new worker lost the window
        assert r.outcome == Outcome.OK and list(r.drafts.statuses) == [wire.STATUS_RESYNC]
    finally:
        link.close()
        w.stop()


def test_start_without_worker_fails_then_reconnects_in_background(drafter):
    probe = Worker(drafter, "127.0.0.1", 0).start()
    port = probe.port
    probe.stop()
    link = make_link(port, drafter, backoff_ms=20)
    with pytest.raises(TransportError):
        link.connect()
    link.start_reconnecting()
    w = Worker(drafter, "127.0.0.1", port).start()
    try:
        assert until(lambda: link.connected) and link.epoch == 1 and link.reconnects == 0
    finally:
        link.close()
        w.stop()


def test_close_stops_the_keeper(drafter):
    link = make_link(1, drafter, backoff_ms=10)
    link.start_reconnecting()
    link.close()
    assert not link.keeper._thread.is_alive()
    r = link.round_entries(1, NEW, b"", 0, 10)
    assert (r.outcome, r.event, link.attempts) == (Outcome.ERROR, RoundEvent.AT_ONCE, 0)


def test_a_worker_that_reads_slowly_cannot_hold_a_round_past_its_deadline(drafter):
    """The whole send is bounded by the round's deadline, not each send call: a peer that
    takes 16 KB at a time would otherwise hold the caller for seconds (CONNECT_TIMEOUT_MS
    per call). The connection is dropped: part of the frame is on the wire."""
    import socket
    import threading

    stop = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))

    def slow_worker():
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            hdr = wire.decode_header(recv_exactly(conn, wire.HEADER.size))
            recv_exactly(conn, hdr.payload_len)
            conn.sendall(
                wire.encode_hello_ack(
                    wire.HelloAck(wire.ACCEPT, drafter.drafter_identity, drafter.markov_identity), hdr.session
                )
            )
            while not stop.is_set() and (chunk := conn.recv(16384)):
                read[0] += len(chunk)
                stop.wait(0.05)

    read = [0]  # bytes of the ROUND the worker has read
    t = threading.Thread(target=slow_worker, daemon=True)
    t.start()
    hello = wire.Hello(drafter.drafter_identity, drafter.markov_identity, 1, 128, 65536, 3)
    link = RemoteLink(
        parse_endpoint(f"tcp://127.0.0.1:{server.getsockname()[1]}"),
        hello,
        session=5,
        connect_timeout_ms=10_000,
        backoff_ms=60_000,
        backoff_max_ms=60_000,
        breaker=Breaker(3, 2),
    )
    try:
        link.connect()
        entries = [wire.Entry(i, 3, 0, (1,), new_gen=True) for i in range(128)]
        r = link.round_entries(1, entries, bytes(128 * 65536), 65536, 200)  # 8 MiB against a trickle
        # Given up at the round's deadline, the connection dropped: not held until the
        # worker had read the frame (25 s at its pace).
        assert (r.outcome, r.event, link.connected) == (Outcome.ERROR, RoundEvent.LOST, False)
        assert read[0] < 128 * 65536
    finally:
        stop.set()
        link.close()
        server.close()
        t.join(10)

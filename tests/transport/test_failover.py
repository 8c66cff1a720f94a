"""A fleet: failover to the spare in one round, fencing, a dead spare found by its PINGs,
the less loaded of two workers taken. Real workers on loopback addresses (127.0.0.x
stand for hosts, all on one port) behind a name that a resolver stand-in, which the
tests control, resolves."""

from __future__ import annotations

import threading

import pytest
from helpers import COUNTING, WorkerStandIn, gated_drafter, until

from remote_dspark import wire
from remote_dspark.outcome import Outcome, RoundEvent
from remote_dspark.transport import keeper as keeper_mod
from remote_dspark.transport import parse_endpoint
from remote_dspark.transport.breaker import Breaker
from remote_dspark.transport.client import DraftClient
from remote_dspark.transport.fleet import Address
from remote_dspark.transport.link import RemoteLink
from remote_dspark.worker import Worker

NEW = [wire.Entry(0, 3, 0, (1,), new_gen=True)]  # slot 0 announced: drafts 2, 3, 4


class Fleet:
    """``n`` workers on 127.0.0.1..n, one port, each with its own gated drafter; the
    name ``fleet.test`` resolves to the addresses in ``ips`` (the test may change it)."""

    def __init__(self, n: int):
        self.drafters = [gated_drafter(COUNTING) for _ in range(n)]
        self.workers = [Worker(self.drafters[0], "127.0.0.1", 0).start()]
        self.port = self.workers[0].port
        try:
            for i in range(1, n):
                self.workers.append(Worker(self.drafters[i], f"127.0.0.{i + 1}", self.port).start())
        except BaseException:
            self.stop()
            raise
        self.ips = [f"127.0.0.{i + 1}" for i in range(n)]
        self.links: list[RemoteLink] = []

    def resolve(self, host: str, port: int, timeout_s: float) -> list[str]:
        assert host == "fleet.test"
        return list(self.ips)

    def link(self, engine_id: int = 1, session: int = 5) -> RemoteLink:
        d = self.drafters[0]
        link = RemoteLink(
            parse_endpoint(f"tcp://fleet.test:{self.port}"),
            wire.Hello(d.drafter_identity, d.markov_identity, engine_id, 4, 0, 3),
            session,
            connect_timeout_ms=500,
            backoff_ms=20,
            backoff_max_ms=80,
            breaker=Breaker(3, 2),
            resolve=self.resolve,
        )
        self.links.append(link)
        return link

    def index(self, address: Address) -> int:
        return ["127.0.0.1", "127.0.0.2", "127.0.0.3"].index(address.host)

    def stop(self) -> None:
        for link in self.links:
            link.close()
        for d in self.drafters:
            d.gate.set()
        for w in self.workers:
            w.stop()


@pytest.fixture
def fleet2():
    f = Fleet(2)
    yield f
    f.stop()


def round_(link: RemoteLink, rid: int, entries=NEW, deadline_ms: int = 2000):
    return link.round_entries(rid, entries, b"", 0, deadline_ms)


def test_a_killed_worker_is_left_for_the_spare_before_the_next_round(fleet2):
    link = fleet2.link()
    link.connect()
    assert until(lambda: link.spare is not None)
    first = link.active.address
    assert {first, link.spare.address} == {Address(ip, fleet2.port) for ip in fleet2.ips}
    assert round_(link, 1).drafts.row(0) == [2, 3, 4]
    fleet2.workers[fleet2.index(first)].stop()  # its kernel closes the connection
    assert until(lambda: link.epoch == 2)  # the keeper saw it hang up: no round needed
    assert link.active.address != first and link.failovers == {"lost": 1, "stall": 0, "protocol": 0}
    r = round_(link, 2)  # every slot re-announced (the caller's resync_all)
    assert (r.outcome, r.drafts.row(0)) == (Outcome.OK, [2, 3, 4])
    assert link.attempts == 2 and link.spare is None  # no third worker to spare


def test_two_deadlines_in_a_row_leave_a_stalled_worker_and_its_late_replies_are_fenced(fleet2):
    link = fleet2.link()
    link.connect()
    assert until(lambda: link.spare is not None)
    assert round_(link, 1).outcome == Outcome.OK
    stalled = fleet2.drafters[fleet2.index(link.active.address)]
    stalled.gate.clear()
    assert round_(link, 2, deadline_ms=50).event == RoundEvent.TIMEOUT
    assert link.epoch == 1  # one deadline keeps the connection
    assert round_(link, 3, deadline_ms=50).event == RoundEvent.TIMEOUT
    assert link.epoch == 2 and link.failovers["stall"] == 1
    r = round_(link, 4)
    assert (r.outcome, r.drafts.round_id, r.drafts.row(0)) == (Outcome.OK, 4, [2, 3, 4])
    stalled.gate.set()  # the stalled worker answers rounds 2 and 3 on the connection left
    assert until(lambda: link.fenced == 2, timeout=keeper_mod.FENCE_S)
    r = round_(link, 5, [wire.Entry(0, 3, 1, (2,))])
    assert (r.outcome, r.drafts.round_id, r.drafts.row(0)) == (Outcome.OK, 5, [3, 4, 1])
    assert link.late == 0  # the left connection's replies were never a round's


def test_no_spare_goes_to_a_worker_that_a_fenced_connection_still_reaches(fleet2, monkeypatch):
    """After a stall the worker left holds this session until its fenced connection
    closes (it would refuse a spare of it): no spare is dialled there meanwhile, and it
    takes the spare once the fence ends."""
    monkeypatch.setattr(keeper_mod, "FENCE_S", 0.5)
    monkeypatch.setattr(keeper_mod, "SHORT_LIFE_S", 0.0)  # (a young connection left: its address not avoided)
    link = fleet2.link()
    link.connect()
    assert until(lambda: link.spare is not None)
    assert round_(link, 1).outcome == Outcome.OK
    left = link.active.address
    stalled = fleet2.drafters[fleet2.index(left)]
    stalled.gate.clear()
    for rid in (2, 3):
        assert round_(link, rid, deadline_ms=50).event == RoundEvent.TIMEOUT
    assert link.epoch == 2 and link.active.address != left
    # No back-off keeps it out (no dial there failed): the fence alone does.
    assert link.keeper.candidates(exclude=link.active.address) == [left]
    assert link.keeper.spare_candidates() == []
    stalled.gate.set()
    assert until(lambda: link.spare is not None, timeout=5) and link.spare.address == left


def test_the_less_loaded_of_the_two_best_workers_is_taken_and_the_other_is_the_spare(fleet2):
    busy = fleet2.workers[1]  # two engines served there: the newcomer goes to the other
    others = [DraftClient.connect(
        parse_endpoint(f"tcp://127.0.0.2:{fleet2.port}"),
        wire.Hello(fleet2.drafters[1].drafter_identity, fleet2.drafters[1].markov_identity, 100 + i, 4, 0, 3),
        50 + i,
        2.0,
    ) for i in range(2)]  # fmt: skip
    try:
        assert until(lambda: busy.sessions_now()[0] == 2)
        for engine_id in (1, 2, 3):  # whatever each one's rendezvous order
            link = fleet2.link(engine_id=engine_id, session=engine_id)
            link.connect()
            assert fleet2.index(link.active.address) == 0 and fleet2.index(link.spare.address) == 1
            link.close()
    finally:
        for c in others:
            c.close()


def test_killing_a_worker_moves_only_its_engines():
    f = Fleet(3)
    try:
        links = [f.link(engine_id=e, session=e) for e in range(1, 7)]
        for link in links:
            link.connect()
            assert round_(link, 1).outcome == Outcome.OK
        before = [f.index(link.active.address) for link in links]
        victim = before[0]
        f.workers[victim].stop()
        moved = [i for i, b in enumerate(before) if b == victim]
        assert until(lambda: all(links[i].epoch == 2 for i in moved))
        after = [f.index(link.active.address) for link in links]
        assert all(after[i] != victim for i in moved)
        assert [after[i] for i in range(6) if i not in moved] == [before[i] for i in range(6) if i not in moved]
        assert all(links[i].epoch == 1 for i in range(6) if i not in moved)
    finally:
        f.stop()


def test_a_spare_that_answers_no_ping_is_dropped_and_made_again(monkeypatch):
    monkeypatch.setattr(keeper_mod, "PING_S", 0.05)
    monkeypatch.setattr(keeper_mod, "PING_TIMEOUT_S", 0.1)
    f = Fleet(1)
    f.ips = ["127.0.0.1", "127.0.0.2"]
    silent = WorkerStandIn("127.0.0.2", f.port, f.drafters[0])  # accepts, then says nothing
    try:
        link = f.link()
        link.connect()
        assert f.index(link.active.address) == 0 and link.spare is not None
        assert until(lambda: silent.hellos >= 2, timeout=5)  # dropped after its PING, made again
        assert "no PING answer" in link.last_error and link.epoch == 1
        assert round_(link, 1).outcome == Outcome.OK  # the active never noticed
    finally:
        f.stop()
        silent.close()


@pytest.mark.parametrize("addresses", [1, 2])
def test_an_idle_keeper_sleeps(addresses):
    """With nothing due (no spare to ping for one address; a ping a second for two) the
    keeper waits in poll: its thread's CPU over half a second is a few milliseconds (a
    keeper that spun would burn the whole half second, and the GIL with it)."""
    import time

    f = Fleet(addresses)
    try:
        link = f.link()
        link.connect()
        assert until(lambda: (link.spare is not None) == (addresses == 2))
        clock = time.pthread_getcpuclockid(link.keeper._thread.ident)
        c0 = time.clock_gettime(clock)
        time.sleep(0.5)
        assert time.clock_gettime(clock) - c0 < 0.05
    finally:
        f.stop()


def test_an_address_that_answers_again_starts_its_back_off_afresh():
    """A spare's worker lost and restarted: while it is down its address is avoided for a
    growing back-off; once a dial to it answers, the back-off is forgotten (so a worker
    restarted many times over a long run is never avoided for BACKOFF_MAX_MS)."""
    f = Fleet(2)
    try:
        link = f.link()
        link.connect()
        assert until(lambda: link.spare is not None)
        i = f.index(link.spare.address)
        f.workers[i].stop()
        assert until(lambda: link.spare is None)
        assert until(lambda: Address(f.ips[i], f.port) in link.keeper._avoid)
        f.workers[i] = Worker(f.drafters[i], f.ips[i], f.port).start()
        assert until(lambda: link.spare is not None)
        assert Address(f.ips[i], f.port) not in link.keeper._avoid and link.epoch == 1
    finally:
        f.stop()


def test_a_failed_dial_looks_the_name_up_again_and_finds_the_worker_that_moved():
    """The name resolved to 127.0.0.1 only; that worker goes, the name now says
    127.0.0.2: the failed dial forces a look-up (not the 30 s schedule), and the link
    connects to the new address."""
    f = Fleet(2)
    try:
        f.ips = ["127.0.0.1"]
        link = f.link()
        link.connect()
        assert f.index(link.active.address) == 0 and link.spare is None
        f.ips = ["127.0.0.2"]
        f.workers[0].stop()
        assert until(lambda: link.active is not None and link.active.address.host == "127.0.0.2", timeout=5)
        assert link.failovers["lost"] == 1 and round_(link, 1).outcome == Outcome.OK
    finally:
        f.stop()


@pytest.fixture
def mute_second():
    """A fleet whose second choice (127.0.0.2) accepts connections and never answers
    HELLO, and a link (CONNECT_TIMEOUT_MS 60 s) of an engine that ranks 127.0.0.1 first:
    (the fleet, the link), not connected yet."""
    from remote_dspark.transport.fleet import rank

    f = Fleet(1)
    f.ips = ["127.0.0.1", "127.0.0.2"]
    mute = WorkerStandIn("127.0.0.2", f.port, f.drafters[0], ack=False)
    try:
        addrs = [Address(ip, f.port) for ip in f.ips]
        link = f.link(engine_id=next(e for e in range(1, 100) if rank(e, addrs)[0] == addrs[0]))
        link.connect_timeout_s = 60.0
        yield f, link
    finally:
        f.stop()
        mute.close()


def test_a_mute_second_choice_never_holds_the_first_connection_back(mute_second):
    """The engine's first choice answered; its second accepts and says nothing: the
    active is in place after SECOND_S, not after CONNECT_TIMEOUT_MS (60 s here), and
    the keeper keeps trying the spare in the background."""
    f, link = mute_second
    done = threading.Event()
    threading.Thread(target=lambda: (link.connect(), done.set()), daemon=True).start()
    assert done.wait(5.0) and f.index(link.active.address) == 0 and link.spare is None
    assert round_(link, 1).outcome == Outcome.OK


def test_a_spare_that_announces_a_payload_is_dropped_at_its_header():
    """A worker that sends its spare a frame with a payload (a DRAFTS nobody asked for,
    announcing megabytes) is dropped at the header: nothing of it is read or allocated."""
    f = Fleet(2)
    try:
        link = f.link()
        link.connect()
        assert until(lambda: link.spare is not None)
        spare = link.spare
        i = f.index(spare.address)
        conn = next(s.conn for s in f.workers[i]._sessions._by_engine.values() if s.conn is not None)
        conn.sendall(wire.encode_header(wire.DRAFTS, 1 << 20, link.session, 1))
        assert until(lambda: link.spare is not spare)
        assert "exceeds this connection's cap 0" in link.last_error
        assert len(spare.client.chan._buf) == 4096 and link.epoch == 1
    finally:
        f.stop()


def test_a_spare_dial_that_hangs_neither_busies_the_keeper_nor_blinds_it(mute_second):
    """The spare's worker accepts and never answers (a dial of CONNECT_TIMEOUT_MS, 60 s
    here): meanwhile the keeper sleeps (its thread's CPU), and it still sees the active's
    worker hang up before any round."""
    import time

    f, link = mute_second
    link.connect()
    assert until(lambda: link.keeper._dialer is not None and link.keeper._dialer.is_alive())
    clock = time.pthread_getcpuclockid(link.keeper._thread.ident)
    c0 = time.clock_gettime(clock)
    time.sleep(0.3)  # a window to measure the keeper's CPU in
    assert time.clock_gettime(clock) - c0 < 0.03
    f.workers[0].stop()
    assert until(lambda: link.failovers["lost"] == 1, timeout=5) and link.attempts == 0

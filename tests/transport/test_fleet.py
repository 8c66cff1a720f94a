"""The fleet: the list form of an endpoint, the resolver's schedule and bounds (a stand-in
the test controls stands for DNS), the bounded system look-up, and rendezvous ranking."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from helpers import until

from remote_dspark.config.api import RemoteConfig
from remote_dspark.transport import fleet, parse_endpoint
from remote_dspark.transport.endpoint import MAX_TARGETS, Endpoint
from remote_dspark.transport.fleet import MAX_ADDRESSES, Address, Fleet, ResolveError, rank

# --- the list form ------------------------------------------------------------------------


def test_the_list_form_keeps_the_first_target_as_host_and_port():
    ep = parse_endpoint("tcp://a.example:7000,10.0.0.2:7001,[::1]:7002?bind=10.0.0.9")
    assert (ep.host, ep.port, ep.bind) == ("a.example", 7000, "10.0.0.9")
    assert ep.targets == (("a.example", 7000), ("10.0.0.2", 7001), ("::1", 7002))
    assert str(ep) == "tcp://a.example:7000,10.0.0.2:7001,[::1]:7002?bind=10.0.0.9"
    assert parse_endpoint(str(ep)) == ep


def test_a_single_target_has_one_target_and_prints_as_before():
    ep = parse_endpoint("o1rdma://10.202.28.1:18620?bind=10.202.28.2")
    assert ep.targets == (("10.202.28.1", 18620),)
    assert str(ep) == "o1rdma://10.202.28.1:18620?bind=10.202.28.2"
    assert Endpoint("tcp", "h", 1).targets == (("h", 1),)  # built by hand, as callers do


def test_the_list_form_survives_the_proxys_hand_over_document():
    env = {"VLLM_DSPARK_REMOTE": "tcp://a:1,b:2", "VLLM_DSPARK_REMOTE_IDENTITY": "ab" * 32}
    cfg = RemoteConfig.from_env(env)
    assert json.loads(cfg.to_json())["endpoint"]["targets"] == [["a", 1], ["b", 2]]
    assert RemoteConfig.from_json(cfg.to_json()).endpoint == cfg.endpoint


@pytest.mark.parametrize(
    "raw,why",
    [
        ("o1tcp://a:1,b:2", "for tcp:// only, not o1tcp://"),
        ("o1rdma://a:1,b:2", "not o1rdma://"),
        ("tcp://a:1,", "missing :PORT in ''"),
        ("tcp://a:1,,b:2", "missing :PORT in ''"),
        ("tcp://a:1,b", "missing :PORT in 'b'"),
        ("tcp://a:1,b:0", "port 0 outside 1..65535"),
        ("tcp://a:1,[::1:2", "bracketed"),
        ("tcp://a:1,b:2,a:1", "'a:1' is listed twice"),
        ("tcp://" + ",".join(f"h{i}:1" for i in range(MAX_TARGETS + 1)), f"more than {MAX_TARGETS}"),
    ],
)
def test_list_form_errors_name_the_variable_and_the_culprit(raw, why):
    with pytest.raises(ValueError) as e:
        parse_endpoint(raw)
    assert str(e.value).startswith(f"VLLM_DSPARK_REMOTE={raw!r}: ") and why in str(e.value)


def test_the_most_targets_are_taken():
    raw = "tcp://" + ",".join(f"h{i}:1" for i in range(MAX_TARGETS))
    assert len(parse_endpoint(raw).targets) == MAX_TARGETS


# --- the schedule and the last good set ---------------------------------------------------


class StandIn:
    """DNS the test controls: ``answers[host]`` is a list of IPs or an exception; every
    call is recorded with its timeout."""

    def __init__(self, **answers):
        self.answers = answers
        self.calls: list[tuple[str, int, float]] = []

    def __call__(self, host, port, timeout_s):
        self.calls.append((host, port, timeout_s))
        answer = self.answers[host]
        if isinstance(answer, Exception):
            raise answer
        return answer


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(raw="tcp://workers:7000", **answers) -> tuple[Fleet, StandIn, Clock]:
    dns, clock = StandIn(**answers), Clock()
    return Fleet(parse_endpoint(raw), timeout_s=0.5, resolve=dns, refresh_s=30, retry_s=1, clock=clock), dns, clock


def test_nothing_is_known_before_the_first_look_up_which_is_due_at_once():
    f, dns, _ = make(workers=["10.0.0.2", "10.0.0.1"])
    assert f.addresses() == () and f.due_in() == 0 and dns.calls == []
    assert f.refresh() == (Address("10.0.0.1", 7000), Address("10.0.0.2", 7000))  # sorted
    assert dns.calls == [("workers", 7000, 0.5)] and f.last_error == ""


def test_resolved_again_only_when_due():
    f, dns, clock = make(workers=["10.0.0.1"])
    f.refresh()
    dns.answers["workers"] = ["10.0.0.1", "10.0.0.3"]
    clock.now += 29.9
    assert f.refresh() == (Address("10.0.0.1", 7000),) and len(dns.calls) == 1
    assert f.due_in() == pytest.approx(0.1)
    clock.now += 0.1
    assert f.refresh() == (Address("10.0.0.1", 7000), Address("10.0.0.3", 7000)) and len(dns.calls) == 2


def test_force_resolves_now_but_never_more_often_than_retry_s():
    f, dns, clock = make(workers=["10.0.0.1"])
    f.refresh()
    clock.now += 0.5
    f.refresh(force=True)
    assert len(dns.calls) == 1  # the last look-up began 0.5 s ago
    clock.now += 0.5
    dns.answers["workers"] = ["10.0.0.9"]
    assert f.refresh(force=True) == (Address("10.0.0.9", 7000),) and len(dns.calls) == 2
    assert f.due_in() == 30  # a good look-up: the full period again


def test_a_failure_keeps_the_last_good_set_and_retries_after_retry_s():
    f, dns, clock = make(workers=["10.0.0.1"])
    good = f.refresh()
    clock.now += 30
    dns.answers["workers"] = ResolveError("the host 'workers' does not resolve (SERVFAIL)")
    assert f.refresh() == good
    assert f.last_error == "the host 'workers' does not resolve (SERVFAIL)" and f.due_in() == 1
    for answer in ([], ["not-an-ip"], RuntimeError("resolver crashed")):  # each a failure, never raised
        dns.answers["workers"] = answer
        clock.now += 1
        assert f.refresh() == good and f.last_error.startswith("workers") and f.due_in() == 1
    dns.answers["workers"] = ["10.0.0.2"]
    clock.now += 1
    assert f.refresh() == (Address("10.0.0.2", 7000),) and f.last_error == "" and f.due_in() == 30


def test_a_target_that_fails_keeps_its_addresses_beside_the_others():
    answers = {"a": ["10.0.0.5"], "b": ["10.0.0.6"], "10.0.0.1": ["10.0.0.1"]}
    f, dns, clock = make("tcp://a:7000,b:7001,10.0.0.1:7000", **answers)
    assert f.refresh() == (Address("10.0.0.1", 7000), Address("10.0.0.5", 7000), Address("10.0.0.6", 7001))
    dns.answers["a"] = OSError("timed out")
    dns.answers["b"] = ["10.0.0.7"]
    clock.now += 30
    assert f.refresh() == (Address("10.0.0.1", 7000), Address("10.0.0.5", 7000), Address("10.0.0.7", 7001))
    assert f.last_error == "a: timed out"


def test_addresses_are_deduplicated_and_canonical():
    f, _, _ = make("tcp://a:7000,b:7000", a=["10.0.0.1", "::1", "0:0::1"], b=["10.0.0.1", "10.0.0.2"])
    assert f.refresh() == (Address("10.0.0.1", 7000), Address("10.0.0.2", 7000), Address("::1", 7000))
    assert [str(a) for a in f.addresses()] == ["10.0.0.1:7000", "10.0.0.2:7000", "[::1]:7000"]


def test_a_hostile_answer_is_capped_before_the_set_is_built():
    """An answer of endless records is read only up to the cap; the set has at most
    MAX_ADDRESSES entries whatever the targets answer."""
    read = []

    def endless():
        i = 0
        while True:
            read.append(i)
            yield f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"
            i += 1

    f, _, _ = make("tcp://a:7000,b:7000", a=endless(), b=[f"10.9.0.{i}" for i in range(MAX_ADDRESSES)])
    got = f.refresh()
    assert len(got) == MAX_ADDRESSES and len(read) == MAX_ADDRESSES and got == tuple(sorted(got))
    read.clear()

    def duplicates():
        while True:
            read.append(1)
            yield "10.0.0.1"

    f, _, _ = make(a=duplicates(), raw="tcp://a:1")
    assert f.refresh() == (Address("10.0.0.1", 1),) and len(read) == fleet.MAX_RECORDS


def test_an_ofl_endpoint_is_a_fleet_of_one_never_resolved():
    f, dns, _ = make("o1tcp://drafter.local:18620")
    assert f.addresses() == f.refresh(force=True) == (Address("drafter.local", 18620),)
    assert dns.calls == [] and f.due_in() == float("inf")


def test_a_refresh_under_way_is_not_waited_for():
    """Another caller gets the current set at once while one look-up runs."""
    entered, release = threading.Event(), threading.Event()

    def slow(host, port, timeout_s):
        entered.set()
        release.wait(10)
        return ["10.0.0.1"]

    f = Fleet(parse_endpoint("tcp://a:1"), timeout_s=1, resolve=slow)
    t = threading.Thread(target=f.refresh)
    t.start()
    try:
        assert entered.wait(10)
        assert f.refresh(force=True) == ()
    finally:
        release.set()
        t.join(10)
    assert f.addresses() == (Address("10.0.0.1", 1),)


# --- the system look-up --------------------------------------------------------------------


def test_a_slow_system_look_up_is_bounded_by_its_timeout(monkeypatch):
    release = threading.Event()

    def stuck(*args, **kwargs):
        release.wait(10)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 1))]

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    start = time.monotonic()
    try:
        with pytest.raises(ResolveError, match="'slow.example' did not resolve within 0.05 s") as e:
            fleet.system_resolve("slow.example", 1, 0.05)
        assert e.value.timed_out and time.monotonic() - start < 5
    finally:
        release.set()
    assert until(lambda: not any(t.name == "dspark-resolve" for t in threading.enumerate()))


def test_the_system_look_up_answers_literals_names_and_failures(monkeypatch):
    def answer(host, port, type=0):
        assert type == socket.SOCK_STREAM
        if host == "gone.example":
            raise socket.gaierror("Name or service not known")
        return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in ("10.0.0.2", "10.0.0.1", "10.0.0.2")]

    monkeypatch.setattr(socket, "getaddrinfo", answer)
    assert fleet.system_resolve("workers.example", 7, 1.0) == ["10.0.0.2", "10.0.0.1"]
    assert fleet.system_resolve("::1", 7, 1.0) == ["::1"]  # a literal: no look-up
    with pytest.raises(ResolveError, match="'gone.example' does not resolve") as e:
        fleet.system_resolve("gone.example", 7, 1.0)
    assert not e.value.timed_out


# --- rendezvous ranking --------------------------------------------------------------------

THREE = [Address(f"10.0.0.{i}", 18620) for i in (1, 2, 3)]


def test_rank_is_deterministic_and_independent_of_input_order():
    assert rank(7, THREE) == rank(7, reversed(THREE)) == rank(7, list(THREE))
    assert sorted(rank(7, THREE)) == THREE
    with pytest.raises(ValueError, match="engine id -1"):
        rank(-1, THREE)


def test_rank_spreads_engines_evenly():
    firsts = [rank(e, THREE)[0] for e in range(1000)]
    for a in THREE:
        assert abs(firsts.count(a) / 1000 - 1 / 3) < 0.05, (a, firsts.count(a))


def test_a_worker_that_joins_takes_only_its_share_and_moves_nobody_else():
    fourth = Address("10.0.0.4", 18620)
    before = [rank(e, THREE)[0] for e in range(1000)]
    after = [rank(e, [*THREE, fourth])[0] for e in range(1000)]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert all(a == fourth for _, a in moved)
    assert abs(len(moved) / 1000 - 1 / 4) < 0.05, len(moved)

"""The worker's fault injection (:class:`~remote_dspark.worker.faults.Faults`): changed
from any thread or a signal handler, read by concurrent rounds as one snapshot each, and
``remote-dspark worker --chaos``'s signals. Every wait is bounded; every thread, worker
and process a test starts is ended by it."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import child, connect, do_round, finish, readline_within

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import MarkovModel, builtin_model
from remote_dspark.transport import parse_endpoint
from remote_dspark.transport.client import DraftClient
from remote_dspark.worker import Worker
from remote_dspark.worker.faults import Fault, Faults

MODEL = MarkovModel.from_tokens([1, 2, 3, 4, 5] * 20, order=1, top=2)
JOIN_S = 10


def test_no_faults_until_told_and_each_order_applies_in_its_order():
    faults = Faults(late_s=0.5)
    assert faults.take() == Fault(0.0, False)
    faults.toggle_late()
    faults.garble_next(2)
    assert [faults.take() for _ in range(3)] == [Fault(0.5, True), Fault(0.5, True), Fault(0.5, False)]
    faults.set_delay(0.1)
    faults.toggle_late()  # a delay is on: the toggle turns it off
    assert faults.take() == Fault(0.0, False)
    faults.garble_next(0)
    assert faults.take() == Fault(0.0, False)
    for bad in (lambda: faults.set_delay(-1), lambda: faults.garble_next(-1), lambda: Faults(late_s=-0.1)):
        with pytest.raises(ValueError, match="must be >= 0"):
            bad()


def race(readers: int, takes: int, ordered: int, delays: tuple[float, ...]) -> tuple[list[Fault], int]:
    """``readers`` threads ``take`` ``takes`` faults each while this thread orders
    ``ordered`` garbled replies and delays; what they took, and the garbled replies still
    owed after them."""
    faults = Faults()
    seen: list[list[Fault]] = [[] for _ in range(readers)]
    start = threading.Barrier(readers + 1, timeout=JOIN_S)

    def read(out: list[Fault]) -> None:
        start.wait()
        out.extend(faults.take() for _ in range(takes))

    threads = [threading.Thread(target=read, args=(out,), daemon=True) for out in seen]
    for t in threads:
        t.start()
    start.wait()
    for i in range(ordered):
        faults.garble_next()
        faults.set_delay(delays[i % len(delays)])
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads)
    owed = 0
    while faults.take().garble:
        owed += 1
    return [f for out in seen for f in out], owed


def test_concurrent_readers_spend_each_garbled_reply_once_and_see_only_delays_that_were_set():
    delays = (0.0, 0.25, 0.5)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between almost any two bytecodes: races show
    try:
        for _ in range(10):  # a race shows in a few of them
            taken, owed = race(8, 5000, 3000, delays)
            assert {f.delay_s for f in taken} <= set(delays)
            assert sum(f.garble for f in taken) + owed == 3000  # none spent twice, none lost
    finally:
        sys.setswitchinterval(interval)


def test_concurrent_rounds_get_exactly_the_garbled_replies_ordered_all_late():
    faults = Faults()
    n, garbled, delay_s = 6, 2, 0.05
    with Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, window=8, faults=faults) as w:
        clients = [connect(w, session=i + 1, engine_id=i + 1) for i in range(n)]
        try:
            faults.garble_next(garbled)
            faults.set_delay(delay_s)
            start = threading.Barrier(n, timeout=JOIN_S)
            results: list[object] = [None] * n

            def one(i: int) -> None:
                start.wait()
                t0 = time.monotonic()
                try:
                    d = do_round(clients[i], 1, [wire.Entry(0, 3, 0, (1, 2), True)])
                    results[i] = (d.row(0), time.monotonic() - t0)
                except wire.ProtocolError as e:
                    results[i] = e

            threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(JOIN_S)
            assert not any(t.is_alive() for t in threads)
            bad = [r for r in results if isinstance(r, wire.ProtocolError)]
            good = [r for r in results if isinstance(r, tuple)]
            assert len(bad) == garbled and len(good) == n - garbled
            assert all(row == [3, 4, 5] and took >= delay_s for row, took in good)
            faults.set_delay(0.0)
            served = next(i for i, r in enumerate(results) if isinstance(r, tuple))
            assert do_round(clients[served], 2, [wire.Entry(0, 3, 2, (3,))]).row(0) == [4, 5, 1]  # none owed
        finally:
            for c in clients:
                c.chan.close()


# The handlers run in the main thread, inside raise_signal (it checks for signals before
# it returns): here while that thread holds the lock a reading thread holds in take().
# A handler that took the lock would wait for itself forever; in a child, so that such a
# deadlock fails the test at the child's timeout instead of hanging the suite.
IN_A_HANDLER = """
import json, signal
from remote_dspark.worker.faults import Faults
faults = Faults(late_s=0.25)
signal.signal(signal.SIGUSR1, lambda *_: faults.toggle_late())
signal.signal(signal.SIGUSR2, lambda *_: faults.garble_next())
with faults._lock:
    signal.raise_signal(signal.SIGUSR1)
    signal.raise_signal(signal.SIGUSR2)
    signal.raise_signal(signal.SIGUSR2)
taken = [faults.take() for _ in range(3)]
signal.raise_signal(signal.SIGUSR1)
taken.append(faults.take())
print(json.dumps([[f.delay_s, f.garble] for f in taken]))
"""


def test_signal_handlers_set_the_faults_even_while_their_thread_holds_the_lock():
    with child(IN_A_HANDLER) as proc:
        taken = json.loads(finish(proc))
    assert taken == [[0.25, True], [0.25, True], [0.25, False], [0.0, False]]


def test_worker_command_with_chaos_garbles_on_sigusr2_and_answers_late_on_sigusr1():
    late_s = 0.3
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote_dspark", "worker", "--listen", "127.0.0.1:0", "--chaos"]
        + ["--late-ms", str(round(late_s * 1000))],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    clients: list[DraftClient] = []
    rounds = itertools.count(1)

    def client(session: int) -> DraftClient:
        ident = bytes.fromhex(lines[1].split("=")[1].strip())
        hello = wire.Hello(ident, builtin_model().identity, 1, 4, 0, 2)
        clients.append(DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{port}"), hello, session, 5.0))
        return clients[-1]

    def timed_round(c: DraftClient) -> float:
        rid = next(rounds)
        t0 = time.monotonic()
        entries = [wire.Entry(0, 2, 0, (1,), True)]
        c.round(rid, [wire.encode_round_entries(rid, c.session, 1000, entries, b"", 0)], 5000)
        return time.monotonic() - t0

    try:
        lines = [readline_within(proc.stdout, 30, "the worker's address and identities") for _ in range(3)]
        port = int(lines[0].rsplit(":", 1)[1])
        c = client(1)
        timed_round(c)
        proc.send_signal(signal.SIGUSR2)  # handled soon, not at once: rounds until one is garbled
        deadline = time.monotonic() + JOIN_S
        with pytest.raises(wire.ProtocolError):
            while time.monotonic() < deadline:
                timed_round(c)
        c = client(2)  # the same engine's next session
        timed_round(c)  # one garbled reply per signal: the next is whole
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + JOIN_S
        while timed_round(c) < late_s:
            assert time.monotonic() < deadline, "no round answered --late-ms late after SIGUSR1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=JOIN_S) == 0
    finally:
        for c in clients:
            c.chan.close()
        proc.kill()
        proc.wait(timeout=JOIN_S)
        proc.stdout.close()

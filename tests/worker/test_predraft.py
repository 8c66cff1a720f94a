"""The drafter thread's idle time (remote_dspark.worker.idle, .scheduler): a drafter that
pre-drafts (its ``predraft``) is called only when the drafter is free and no round is
queued, after a call of rounds ends and again while it pre-drafts something, and not
once it pre-drafts nothing until another call ends; a round that arrives during a
pre-drafting call is drafted right after that call, before any other. With a
thread-mode scheduler and with a hub stand-in (rounds the drafter thread takes itself).
The drafter is a Markov one whose pre-drafts are counted and the first held at a gate;
no GPU, no sleeps (every wait bounded)."""

import math
import threading
import time

import numpy as np
from helpers import COUNTING, stream_batch, submit, until

from remote_dspark.drafter import MarkovDrafter
from remote_dspark.worker.batching import merge
from remote_dspark.worker.jobs import Job
from remote_dspark.worker.scheduler import Scheduler

WAIT_S = 10.0


class Predrafting(MarkovDrafter):
    """The Markov drafter, pre-drafting: each call logged (``("draft", session)``, or
    ``("predraft", rounds queued then)``); a pre-draft returns the next of ``made`` (0
    once spent), the first waiting (bounded) for ``release``."""

    speculates = True

    def __init__(self, made):
        super().__init__(COUNTING)
        self.made, self.log, self.scheduler = list(made), [], None
        self.entered, self.release = threading.Event(), threading.Event()

    def draft_batch(self, batch):
        self.log.append(("draft", int(batch.sessions()[0])))
        return super().draft_batch(batch)

    def predraft(self, max_entries, max_tokens):
        self.log.append(("predraft", self.scheduler.queued()))
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(WAIT_S), "the test never released the pre-draft"
        return self.made.pop(0) if self.made else 0

    def predrafts(self) -> int:
        return sum(kind == "predraft" for kind, _ in self.log)


class Source:
    """A hub stand-in: the rounds the test puts are ready for the drafter thread, which
    takes them itself (one call of them all, or jobs); ``answered[rid]`` is set with
    their answer."""

    def __init__(self):
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.pending, self.batches, self.answered, self.failed = [], {}, {}, []

    def put(self, rid: int, batch) -> None:
        with self.lock:
            self.batches[rid], self.answered[rid] = batch, threading.Event()
            self.pending.append(rid)
        self.wake.set()

    def ready(self, timeout_s: float) -> np.ndarray:
        if timeout_s > 0:
            self.wake.wait(min(timeout_s, WAIT_S))
        with self.lock:
            self.wake.clear()
            ids, self.pending = np.array(self.pending, np.uint32), []
        return ids

    def gather(self, ids, max_entries: int):
        batches = [self.batches[int(i)] for i in ids]
        batch = batches[0] if len(batches) == 1 else merge(batches)
        return batch, np.full(len(ids), time.monotonic()), np.full(len(ids), math.inf)

    def jobs(self, ids) -> list[Job]:
        def deliver(job, rid):
            self.answered[rid].set()

        return [
            Job(0, self.batches[rid], math.inf, None, time.monotonic(), deliver=lambda job, r=rid: deliver(job, r))
            for rid in ids.tolist()
        ]

    def answer(self, ids, result) -> None:
        for rid in ids.tolist():
            self.answered[rid].set()

    def fail(self, ids, error) -> None:
        self.failed += ids.tolist()

    def waiting(self) -> int:
        with self.lock:
            return len(self.pending)

    def poke(self) -> None:
        self.wake.set()


def answered(source: Source, rid: int) -> None:
    assert source.answered[rid].wait(WAIT_S), f"round {rid} not answered within {WAIT_S} s"


def round_of(session: int):
    return stream_batch(session, [0], [[1, 2, session]])


def play(s: Scheduler, d: Predrafting, send, wait) -> None:
    """Round 1; a pre-draft held while round 2 arrives; then pre-drafts until one makes
    nothing; round 3, and its pre-draft. ``send(session)`` starts a round, ``wait`` it
    answered."""
    wait(send(1))  # answered, the drafter thread pre-drafts (woken by the call's end)
    assert d.entered.wait(WAIT_S)
    second = send(2)
    assert until(lambda: s.queued() == 1)  # queued behind the pre-drafting call in flight
    d.release.set()
    wait(second)
    assert until(lambda: d.predrafts() == 3)  # after round 2: until a pre-draft makes nothing
    wait(send(3))
    assert until(lambda: d.predrafts() == 4)


# round 1, its pre-draft (2 made; round 2 waits for it), round 2, pre-drafts (1, then 0
# made: no more), round 3, its pre-draft (0); every pre-draft with nothing queued
LOG = [("draft", 1), ("predraft", 0), ("draft", 2), ("predraft", 0), ("predraft", 0), ("draft", 3), ("predraft", 0)]


def test_a_round_waits_for_one_predraft_at_most_and_predrafting_stops_at_nothing_made_until_a_call_ends():
    d = Predrafting(made=[2, 1, 0, 0])
    s = d.scheduler = Scheduler(d, max_entries=64, max_tokens=1024)
    s.start()
    threads = []

    def send(session):
        threads.append(submit(s, session, round_of(session)))
        return threads[-1]

    def wait(sent):
        t, box = sent
        t.join(WAIT_S)
        assert not t.is_alive() and "result" in box

    try:
        play(s, d, send, wait)
    finally:
        d.release.set()
        s.stop()
    assert not s.alive() and d.log == LOG


def test_the_same_with_the_rounds_of_a_hub():
    d, source = Predrafting(made=[2, 1, 0, 0]), Source()
    s = d.scheduler = Scheduler(d, max_entries=64, max_tokens=1024, source=source)
    s.start()

    def send(session):
        source.put(session, round_of(session))
        return session

    try:
        play(s, d, send, lambda rid: answered(source, rid))
    finally:
        d.release.set()
        s.stop()
    assert not s.alive() and d.log == LOG and not source.failed


class Failing(Predrafting):
    """A drafter whose every pre-draft raises (a device fault, a bug)."""

    def predraft(self, max_entries, max_tokens):
        self.log.append(("predraft", self.scheduler.queued()))
        raise RuntimeError("a pre-draft broke")


def test_a_failing_predraft_costs_its_outcomes_never_a_round_nor_the_drafter_thread():
    d, source = Failing(made=[]), Source()
    s = d.scheduler = Scheduler(d, max_entries=64, max_tokens=1024, source=source)
    s.start()
    try:
        for session in (1, 2, 3):
            source.put(session, round_of(session))
            answered(source, session)
            assert until(lambda n=session: d.predrafts() == n)  # tried after each call, not again
        assert s.alive() and not source.failed
    finally:
        s.stop()
    assert d.log == [("draft", 1), ("predraft", 0), ("draft", 2), ("predraft", 0), ("draft", 3), ("predraft", 0)]

"""The CPU a drafter's calls take on the thread that makes them (``time.thread_time``),
counted per call into the worker's statistics and exported as
``dspark_worker_drafter_cpu_seconds_total``: a drafter that waits (a GPU's host thread
waiting on its kernels) adds its time to the drafting histogram but not its CPU; one that
computes adds its CPU."""

from __future__ import annotations

import threading
import time
from urllib.request import urlopen

from helpers import connect, do_round, families_in, stream_batch, value

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import MarkovModel
from remote_dspark.worker import Worker
from remote_dspark.worker.scheduler import Scheduler
from remote_dspark.worker.stats import WorkerStats

MODEL = MarkovModel.from_tokens([1, 2, 3, 4, 5, 6, 7] * 10, order=1, top=2)
WAIT_S, BURN_S = 0.05, 0.03


class Waiting(MarkovDrafter):
    """Waits ``WAIT_S`` in every call (no CPU), then drafts."""

    def draft_batch(self, batch):
        threading.Event().wait(WAIT_S)
        return super().draft_batch(batch)


class Burning(MarkovDrafter):
    """Computes for ``BURN_S`` of its thread's CPU in every call, then drafts."""

    def draft_batch(self, batch):
        start = time.thread_time()
        while time.thread_time() - start < BURN_S:  # bounded: this thread's CPU only advances while it runs
            pass
        return super().draft_batch(batch)


def drafted(drafter) -> WorkerStats:
    """The worker's statistics after one round through a scheduler of ``drafter``."""
    stats = WorkerStats()
    s = Scheduler(drafter, max_entries=16, max_tokens=1000, on_call=stats.add_call).start()
    try:
        s.draft(1, stream_batch(1, [0, 1], [[1, 2, 3], [4]]))
    finally:
        s.stop()
    return stats


def test_a_call_that_waits_counts_its_time_but_not_as_the_drafters_cpu():
    stats = drafted(Waiting(MODEL))
    assert stats.drafter_calls == 1 and stats.drafting_seconds.snapshot().sum >= WAIT_S
    assert 0 < stats.drafter_cpu_seconds < WAIT_S / 2


def test_a_call_that_computes_counts_its_cpu():
    stats = drafted(Burning(MODEL))
    assert BURN_S <= stats.drafter_cpu_seconds <= stats.drafting_seconds.snapshot().sum
    assert stats.copy().drafter_cpu_seconds == stats.drafter_cpu_seconds


def test_the_metric_is_exported_and_moves_with_a_drafter_call():
    """A worker on its Python round path (the drafter called by the scheduler): 0 before
    any round, at least the burnt CPU after one, never more than the calls' time."""
    w = Worker(Burning(MODEL), "127.0.0.1", 0, window=8, metrics_port=0, round_path="python").start()
    try:
        url = f"http://127.0.0.1:{w.metrics_port}/metrics"

        def scrape() -> str:
            with urlopen(url, timeout=5) as r:
                return r.read().decode()

        before = scrape()
        assert ("dspark_worker_drafter_cpu_seconds_total", "counter") in [f[:2] for f in families_in(before)]
        assert value(before, "dspark_worker_drafter_cpu_seconds_total") == 0
        c = connect(w)
        try:
            d = do_round(c, 1, [wire.Entry(0, 2, 0, (1, 2), True)])
            assert list(d.statuses) == [wire.STATUS_OK]
        finally:
            c.close()
        after = scrape()
    finally:
        w.stop()
    cpu = value(after, "dspark_worker_drafter_cpu_seconds_total")
    assert BURN_S <= cpu <= value(after, "dspark_worker_drafting_duration_seconds_sum")

"""A round's lifecycle in the scheduler (remote_dspark.worker.jobs): one value, Pending
until it ends Answered or Failed, its first end standing; ``outcome`` reads the end."""

import numpy as np
import pytest

from remote_dspark.drafter.contract import DraftBatch, empty_result
from remote_dspark.worker.jobs import Answered, Failed, Job, Pending


def job() -> Job:
    tokens, offsets, n_out = np.array([1, 2], np.int32), np.array([0, 2]), np.array([3], np.int32)
    batch = DraftBatch(tokens, offsets, n_out, np.zeros((1, 0), np.uint8), False, 3)
    return Job(1, batch, float("inf"), np.full(len(batch), 5, np.int64), 0.0)


def test_a_job_is_pending_until_its_first_end_which_stands():
    j, drafts = job(), empty_result(1, 3, False)
    assert isinstance(j.state, Pending) and j.state.taken == 0 and j.state.parts is None and not j.done.is_set()
    assert j.end(Answered(drafts))  # (the scheduler calls it under its lock)
    assert not j.end(Failed(RuntimeError("the worker is stopping")))
    assert j.done.is_set() and isinstance(j.state, Answered) and j.state.result is drafts and j.outcome() is drafts


def test_a_failed_job_raises_what_its_call_raised():
    j = job()
    j.end(Failed(ValueError("the drafter broke")))
    with pytest.raises(ValueError, match="the drafter broke"):
        j.outcome()
    assert isinstance(j.state, Failed)

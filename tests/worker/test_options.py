"""The worker's options (:class:`~remote_dspark.worker.options.WorkerOptions`): one
frozen record, each value checked when it is built with a ValueError naming the option,
and ``Worker``'s keywords as changes to it."""

import dataclasses
import re
import subprocess
import sys

import pytest

from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import MarkovModel
from remote_dspark.worker import Worker
from remote_dspark.worker.options import WorkerOptions

MODEL = MarkovModel.from_tokens([1, 2, 3, 1, 2, 3], order=1)


@pytest.mark.parametrize(
    "kw,why",
    [
        ({"round_path": "gpu"}, "round_path 'gpu': one of served, native, python"),
        ({"window": 0}, "window 0: not in 1.."),
        ({"max_connections": 0}, "max_connections 0, max_pending 128: must be >= 1"),
        ({"hello_timeout_s": 0.0}, "hello_timeout_s 0.0, frame_timeout_s 10.0: must be > 0"),
        ({"max_slots": 5000}, "max_slots 5000: not in 1..4096 (--max-slots)"),
        ({"call_deadline_share": 0.0}, "call_deadline_share 0.0: not in (0, 1] (--call-deadline-share)"),
        ({"call_deadline_share": 1.5}, "call_deadline_share 1.5: not in (0, 1] (--call-deadline-share)"),
    ],
)
def test_an_option_out_of_range_is_refused_when_the_record_is_built(kw, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        WorkerOptions(**kw)


def test_the_record_is_frozen_and_its_limits_follow_from_it():
    opts = WorkerOptions(window=16, max_slots=8)
    assert (opts.limits.window, opts.limits.max_slots) == (16, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.window = 8
    wider = dataclasses.replace(opts, window=32)  # a change derives its limits again
    assert wider.limits.window == 32 and wider.limits.max_slots == 8 and opts.limits.window == 16


def test_worker_keywords_change_the_options_given():
    base = WorkerOptions(window=16, max_connections=3)
    with Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, base, max_pending=5) as w:
        assert w.options == dataclasses.replace(base, max_pending=5) and w.limits.window == 16
    with Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, call_deadline_share=0.5) as w:
        assert w._scheduler._fair.share == 0.5  # the scheduler's fair share has the call's ceiling
    with pytest.raises(TypeError, match="no_such_option"):
        Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, no_such_option=1)


def test_the_worker_command_refuses_a_call_deadline_share_out_of_range_naming_the_flag():
    argv = [sys.executable, "-m", "remote_dspark", "worker", "--listen", "127.0.0.1:0", "--call-deadline-share", "0"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--call-deadline-share 0.0: must be in (0, 1]" in out.stderr

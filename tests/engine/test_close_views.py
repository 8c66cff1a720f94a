"""``close()`` never raises for views of the region still alive: a round's exception
whose traceback's frames hold views of the memfd region (a batch whose rows are the
wrong size fails there) is what the caller sees, whether ``close()`` runs in a
``finally`` or as a ``with`` block's exit; close writes the final stats and stops the
proxy all the same, a second close is a no-op, and the region's descriptors and mapping
go once the exception is dropped (``memfd.Region.close``)."""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch
from engines import ROWS, async_env, batch, make

from remote_dspark.engine import Batch
from remote_dspark.supervisor.states import Closed

MODES = ("thread", "process")
ROWS_WRONG = "rows: 16 bytes per row, RemoteDSpark was built for row_bytes=8"


def bad_batch() -> Batch:
    """Rows of 16 bytes for an engine of 8: refused inside the hand-over, where views of
    the round's slot are bound."""
    return Batch.from_lists([0, 1], [[1], [3]], [0, 0], [True, True], ROWS.double(), torch.arange(2))


def memfds() -> tuple[int, int]:
    """(descriptors, mappings) of memfd regions in this process."""
    fds = 0
    for n in os.listdir("/proc/self/fd"):
        try:
            fds += "memfd:remote-dspark" in os.readlink(f"/proc/self/fd/{n}")
        except OSError:  # the listing's own descriptor, gone already
            pass
    with open("/proc/self/maps") as f:
        maps = sum("memfd:remote-dspark" in line for line in f)
    return fds, maps


def assert_closed(rd, stats_file) -> None:
    """The final stats written and the proxy stopped."""
    doc = json.loads(stats_file.read_text())
    assert doc["rounds"]["total"] == rd.stats().total_rounds == 1
    if rd.supervisor is not None:
        assert isinstance(rd.supervisor.state, Closed)
    else:
        assert rd.stats().handoff.proxy_thread_alive is False


@pytest.mark.parametrize("mode", MODES)
def test_close_in_finally_lets_the_rounds_error_through(worker, tmp_path, mode):
    before = memfds()
    rd = make(async_env(worker.port, tmp_path, mode)).start()
    rd.round(batch())
    with pytest.raises(ValueError, match=ROWS_WRONG) as info:
        try:
            rd.round(bad_batch())
        finally:
            rd.close()
    assert_closed(rd, tmp_path / "stats.json")
    rd.close()  # a no-op
    fds, maps = memfds()
    assert fds - before[0] <= 1 and maps - before[1] <= 1  # at most the mapping the traceback holds, and its fd
    del info
    gc.collect()
    assert memfds() == before


@pytest.mark.parametrize("mode", MODES)
def test_a_with_block_left_by_an_exception_closes_and_raises_it_unchanged(worker, tmp_path, mode):
    before = memfds()
    with pytest.raises(ValueError, match=ROWS_WRONG):
        with make(async_env(worker.port, tmp_path, mode)) as rd:
            rd.round(batch())
            rd.round(bad_batch())
    assert_closed(rd, tmp_path / "stats.json")
    gc.collect()
    assert memfds() == before

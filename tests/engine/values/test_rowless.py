"""An engine without rows (``row_bytes=0``): rounds with an empty rows section in every
mode, and batches held to the engine's rows (given to a rowless engine, or missing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import COUNTING, env_for

from remote_dspark.config.api import RemoteConfig
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.engine import Batch, Mode, RemoteDSpark
from remote_dspark.engine.values.batch import has_rows
from remote_dspark.outcome import Outcome
from remote_dspark.worker import Worker

MODES = [Mode.SYNC, Mode.THREAD, Mode.PROCESS]
ROWS = torch.arange(8, dtype=torch.float32).reshape(4, 2)


def make(port, tmp_path, mode: Mode, row_bytes: int = 0) -> RemoteDSpark:
    env = env_for(port, tmp_path, mode)
    return RemoteDSpark(RemoteConfig.from_env(env), num_spec=3, max_slots=4, row_bytes=row_bytes, environ=env)


def rowless(new=True, tokens=((1,), (3,)), positions=(0, 0)) -> Batch:
    return Batch.from_lists([0, 1], [list(t) for t in tokens], list(positions), [new, new])


def with_rows() -> Batch:
    return Batch.from_lists([0, 1], [[1], [3]], [0, 0], [True, True], ROWS, torch.arange(2))


class RowsSeen(MarkovDrafter):
    """Records the row each entry brought (the per-entry path hands it over)."""

    def __init__(self):
        super().__init__(COUNTING)
        self.rows: list[bytes] = []

    def draft(self, context, n_out, row):
        self.rows.append(bytes(row))
        return super().draft(context, n_out, row)


@pytest.mark.parametrize("mode", MODES)
def test_a_rowless_engine_drafts_in_every_mode(tmp_path, mode):
    drafter = RowsSeen()
    with Worker(drafter, "127.0.0.1", 0) as w, make(w.port, tmp_path, mode) as rd:
        assert rd.mode == mode and rd.row_bytes == 0
        first = rd.round(rowless())
        assert (first.outcome, first.tokens.tolist()) == (Outcome.OK, [[2, 3, 4], [4, 1, 2]])
        out = rd.round(rowless(new=False, tokens=((2,), (4,)), positions=(1, 1)))
        assert (out.outcome, out.tokens.tolist()) == (Outcome.OK, [[3, 4, 1], [1, 2, 3]])
        if mode is not Mode.SYNC:
            ring = rd.stats().handoff
            assert ring.gathered == ring.released == 2
    assert drafter.rows == [b""] * 4  # every entry drafted, with an empty row


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "row_bytes,bad,why",
    [
        (0, with_rows, "rows: given, but RemoteDSpark was built with row_bytes=0"),
        (8, rowless, "rows: None, but RemoteDSpark was built for row_bytes=8"),
    ],
)
def test_rows_that_do_not_fit_the_engine_are_refused_naming_them(worker, tmp_path, mode, row_bytes, bad, why):
    with make(worker.port, tmp_path, mode, row_bytes) as rd:
        with pytest.raises(ValueError, match=why):
            rd.round(bad())
        good = rowless() if row_bytes == 0 else with_rows()
        assert rd.round(good).outcome is Outcome.OK  # nothing sent, and the engine goes on
        if mode is not Mode.SYNC:
            ring = rd.stats().handoff
            assert ring.gathered == ring.released == 1  # no hole in the round sequence


def test_has_rows_names_the_field_given_or_missing():
    b = rowless()
    assert has_rows(b, 0) is False
    b.row_index = np.arange(2)  # converted like any index field
    with pytest.raises(ValueError, match="row_index: given, but RemoteDSpark was built with row_bytes=0"):
        has_rows(b, 0)
    with pytest.raises(ValueError, match="rows: None, but RemoteDSpark was built for row_bytes=4"):
        has_rows(b, 4)
    b.rows = ROWS
    assert has_rows(b, 8) is True
    b.row_index = None
    with pytest.raises(ValueError, match="row_index: None, but RemoteDSpark was built for row_bytes=8"):
        has_rows(b, 8)

"""The negotiated context: a NEW_GEN context is cut to the smaller of the engine's cap
(``context_tokens``) and the window the worker's HELLO_ACK names, in every mode; before
any HELLO_ACK to what a default worker takes."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from helpers import CYCLE4, ContextsSeen, env_for
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.config.api import RemoteConfig
from remote_dspark.engine import Batch, Mode, RemoteDSpark
from remote_dspark.engine.values.meta import host_meta, write_meta
from remote_dspark.engine.writers import device_meta
from remote_dspark.engine.writers.device_meta import write_meta_in_stream
from remote_dspark.outcome import Outcome
from remote_dspark.worker import Worker

MODEL = CYCLE4
SLOTS, K = 4, 3
ROWS = torch.arange(8, dtype=torch.float32).reshape(4, 2)
LONG = list(range(5, 305))  # a NEW_GEN context of 300 tokens


def make(env, **kw) -> RemoteDSpark:
    return RemoteDSpark(RemoteConfig.from_env(env), environ=env, num_spec=K, max_slots=SLOTS, row_bytes=8, **kw)


def long_batch() -> Batch:
    return Batch.from_lists([0, 1], [LONG, [3]], [10, 0], [True, True], ROWS, torch.arange(2))


@pytest.mark.parametrize(
    "context_tokens,why",
    [
        (0, f"context_tokens=0: must be an int in 1..{wire.MAX_TOKENS - K - 1}"),
        (wire.MAX_TOKENS - K, f"context_tokens={wire.MAX_TOKENS - K}"),
        (True, "context_tokens=True"),
        (64.0, "context_tokens=64.0"),
    ],
)
def test_a_cap_out_of_range_is_refused_naming_context_tokens(tmp_path, context_tokens, why):
    with pytest.raises(ValueError, match=why):
        make(env_for(1, tmp_path), context_tokens=context_tokens)


def test_the_cap_sizes_a_batch_and_round_tokens_a_round(tmp_path):
    most = wire.MAX_TOKENS - K - 1  # a bound on a batch, not memory: the region holds one round
    rd = make(env_for(1, tmp_path), context_tokens=most)
    assert rd.context_tokens == most and rd.spec.batch_tokens == SLOTS * (most + K + 1)
    assert rd.spec.max_tokens == most + K + 1 == wire.MAX_TOKENS  # one whole context, not every slot's
    assert make(env_for(1, tmp_path), round_tokens=7).spec.max_tokens == 7


def test_before_any_hello_ack_a_context_is_cut_to_what_a_default_worker_takes(tmp_path):
    rd = make(env_for(1, tmp_path), context_tokens=256)  # not started: no worker has answered
    m = rd.meta(long_batch())
    assert m.offsets.tolist() == [0, 64, 65] and m.positions.tolist() == [10 + 236, 0]
    assert m.tokens[:64].tolist() == LONG[-64:]
    small = make(env_for(1, tmp_path), context_tokens=16).meta(long_batch())
    assert small.offsets.tolist() == [0, 16, 17] and small.positions.tolist() == [10 + 284, 0]


MODES = [None, Mode("thread"), Mode("process")]


@pytest.mark.parametrize("mode", MODES, ids=["sync", "thread", "process"])
@pytest.mark.parametrize("window,cap,sent", [(256, 256, 256), (256, 64, 64), (64, 256, 64), (256, 300, 256)])
def test_the_worker_gets_the_smaller_of_its_window_and_the_engines_cap(tmp_path, mode, window, cap, sent):
    drafter = ContextsSeen()
    with Worker(drafter, "127.0.0.1", 0, window=window, max_slots=SLOTS) as w:
        with make(env_for(w.port, tmp_path, mode), context_tokens=cap) as rd:
            assert rd.mode == (mode or Mode.SYNC)
            m = rd.meta(long_batch())  # the cut the next round makes
            assert m.offsets.tolist() == [0, sent, sent + 1] and m.positions.tolist() == [10 + 300 - sent, 0]
            assert rd.round(long_batch()).outcome is Outcome.OK
    assert drafter.contexts == [LONG[-sent:], [3]]


# --------------------------------------------------------------------------- the cut, host and device


@pytest.mark.skipif(
    not device_meta.available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the metadata kernels on CPU tensors need Triton in its interpreter (pip install triton; no CUDA)",
)
@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 300),
    st.lists(st.tuples(st.integers(0, 400), st.booleans(), st.integers(0, 2**20)), min_size=1, max_size=SLOTS),
)
def test_both_paths_cut_to_the_context_given_with_the_first_sent_tokens_position(lib, context, entries):
    """host_meta and the device path (the metadata kernels over the descriptor, in
    Triton's interpreter on the CPU) cut each NEW_GEN context to its last ``context`` tokens, the position moved to
    the first token sent, and write the same bytes."""
    from remote_dspark.shm import layout, memfd

    tokens = [list(range(1000 * i, 1000 * i + n)) for i, (n, _, _) in enumerate(entries)]
    new_gen = [new for _, new, _ in entries]
    positions = [p for _, _, p in entries]
    batch = Batch.from_lists(list(range(len(entries))), tokens, positions, new_gen, ROWS, list(range(len(entries))))
    meta = host_meta(batch, max_slots=SLOTS, num_spec=K, max_tokens=2000, n_out_default=K, context_tokens=context)
    for i, (toks, new, pos) in enumerate(zip(tokens, new_gen, positions)):
        cut = max(len(toks) - context, 0) if new else 0
        assert meta.tokens[meta.offsets[i] : meta.offsets[i + 1]].tolist() == toks[cut:]
        assert meta.positions[i] == pos + cut
    region = memfd.Region.create(layout.Layout(2, SLOTS, 8, K, 2000))
    try:
        lay = region.layout
        area = region.view(lay.desc(0) + layout.DESC_FIXED, lay.desc_stride - layout.DESC_FIXED)
        d = torch.frombuffer(area, dtype=torch.int32)
        np.frombuffer(area, np.uint32, 3)[:] = (77, len(batch), 8)
        write_meta_in_stream(
            batch, d, max_slots=SLOTS, num_spec=K, max_tokens=2000, n_out_default=K, context_tokens=context
        )
        want = np.zeros(lay.desc_stride, np.uint8)
        size = write_meta(want, meta, deadline_ms=77, row_bytes=8)
        assert bytes(area[:size]) == bytes(want[:size])
        del d, area
        gc.collect(1)  # (Triton's interpreter leaves the tensor in a reference cycle)
    finally:
        region.close()

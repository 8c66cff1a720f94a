"""A stream's tokens beyond its context (remote_dspark.drafter.streams): any span read
from the context or the worker's reader equals the stream's own tokens."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark.drafter.contract import DraftBatch
from remote_dspark.drafter.streams import kept, origins, stream_tokens


class Reader:
    """A worker's reader over whole streams (slot -> its tokens), counting its reads."""

    def __init__(self, streams):
        self.streams, self.reads = streams, 0

    def read(self, sessions, slots, first, stop):
        self.reads += 1
        parts = [self.streams[int(s)][int(f) : int(t)] for s, f, t in zip(slots, first, stop, strict=True)]
        offsets = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        return np.concatenate(parts).astype(np.int32), offsets


def batch_of(streams, ctx, kept_from, start=0):
    lens = np.array([len(s) for s in streams], np.int64)
    tokens = np.concatenate([s[len(s) - c :] for s, c in zip(streams, ctx, strict=True)]).astype(np.int32)
    offsets = np.zeros(len(streams) + 1, np.int64)
    np.cumsum(ctx, out=offsets[1:])
    n = len(streams)
    return DraftBatch(
        tokens,
        offsets,
        np.ones(n, np.int32),
        np.zeros((n, 0), np.uint8),
        False,
        1,
        slots=np.arange(n, dtype=np.int64),
        gens=np.ones(n, np.int64),
        lengths=lens,
        positions=start + lens - np.asarray(ctx),
        kept_from=np.asarray(kept_from, np.int64),
        history=Reader(dict(enumerate(streams))),
    )


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_span_is_the_streams_own_tokens(data):
    n = data.draw(st.integers(1, 5))
    streams = [np.arange(1000 * i, 1000 * i + data.draw(st.integers(1, 40)), dtype=np.int32) for i in range(n)]
    ctx = [data.draw(st.integers(0, len(s))) for s in streams]
    kept_from = [data.draw(st.integers(0, len(s) - c)) for s, c in zip(streams, ctx, strict=True)]
    batch = batch_of(streams, ctx, kept_from, start=7)
    assert list(kept(batch)) == kept_from
    assert list(origins(batch)) == [7] * n
    m = data.draw(st.integers(0, 6))
    idx = np.array([data.draw(st.integers(0, n - 1)) for _ in range(m)], np.int64)
    first = np.array([data.draw(st.integers(kept_from[i], len(streams[i]))) for i in idx], np.int64)
    stop = np.array(
        [data.draw(st.integers(int(f), len(streams[i]))) for f, i in zip(first, idx, strict=True)], np.int64
    )
    tokens, offsets = stream_tokens(batch, idx, first, stop)
    for j, i in enumerate(idx):
        assert list(tokens[offsets[j] : offsets[j + 1]]) == list(streams[i][first[j] : stop[j]])


def test_the_context_is_read_without_the_worker_and_a_span_it_lacks_is_refused():
    streams = [np.arange(50, dtype=np.int32)]
    batch = batch_of(streams, [8], [20])
    tokens, _ = stream_tokens(batch, np.array([0]), np.array([44]), np.array([50]))
    assert list(tokens) == list(range(44, 50)) and batch.history.reads == 0
    tokens, _ = stream_tokens(batch, np.array([0]), np.array([20]), np.array([45]))
    assert list(tokens) == list(range(20, 45)) and batch.history.reads == 1
    with pytest.raises(ValueError, match="stream tokens 19..30 of entry 0: the worker holds 20..50"):
        stream_tokens(batch, np.array([0]), np.array([19]), np.array([30]))

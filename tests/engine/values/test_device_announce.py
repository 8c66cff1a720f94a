"""Long contexts announced in chunks on the device (``engine.values.device_announce``),
here on CPU tensors (the same code runs on CUDA: ``tests/engine/test_gpu.py``): round for
round the same rounds as the host's ``Announcer`` (the rule's home), every context
reaching a worker's windows whole and in order, a freed slot let go, the host's held
slots taken over, and the metadata kernels writing a planned round's bytes as the host
writes the host's plan."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.engine import Batch
from remote_dspark.engine.values.announce import Announcer
from remote_dspark.engine.values.device_announce import DeviceAnnouncer
from remote_dspark.engine.values.meta import host_meta, write_meta
from remote_dspark.engine.writers import device_meta
from remote_dspark.worker.windows import Windows

SLOTS, CAP, K = 6, 16, 3


def as_tensors(b: Batch) -> Batch:
    """``b``'s metadata as torch tensors (the dtypes an engine's are)."""
    return Batch(
        slots=torch.as_tensor(b.slots, dtype=torch.int32),
        tokens=torch.as_tensor(b.tokens, dtype=torch.int64),
        token_offsets=torch.as_tensor(b.token_offsets, dtype=torch.int32),
        positions=torch.as_tensor(b.positions),
        new_gen=torch.as_tensor(b.new_gen),
    )


def both(a: Announcer, dev: DeviceAnnouncer, w: Windows, budget: int, b: Batch, cut: int = CAP):
    """``b`` planned by both; the device's round is the host's, and goes to the worker."""
    meta = host_meta(b, max_slots=SLOTS, num_spec=K, max_tokens=1 << 20, n_out_default=K, context_tokens=cut)
    want = a.plan(meta, cut, budget)
    got, mask = dev.plan(as_tensors(b), cut, budget, K)
    end = int(got.token_offsets[-1])
    assert got.tokens_bounded and got.tokens.shape == (budget,) and end <= budget
    m = want.meta
    assert got.token_offsets.tolist() == m.offsets.tolist()
    assert got.tokens[:end].tolist() == m.tokens.tolist(), "the round's tokens differ from the host's"
    assert got.positions.tolist() == m.positions.tolist() and got.new_gen.tolist() == m.new_gen.tolist()
    assert got.n_out.tolist() == np.broadcast_to(m.n_out, (len(b),)).tolist()
    assert torch.nonzero(mask).flatten().tolist() == sorted(want.announcing.tolist())
    adv = w.advance(m.slots, m.positions, m.new_gen, m.offsets, m.tokens.astype(np.int32))
    assert adv.ok.all(), "an entry the worker answers RESYNC"
    return got


@settings(max_examples=120, deadline=None)
@given(
    st.integers(1, 40),
    st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(0, SLOTS - 1), st.booleans(), st.integers(0, 3 * CAP)), max_size=SLOTS),
            st.lists(st.integers(0, SLOTS - 1), max_size=2),
        ),
        min_size=1,
        max_size=12,
    ),
)
def test_the_device_plans_every_round_as_the_host(budget, steps):
    """Random batches (new contexts of any length, cut or not; continuing entries; gaps;
    requests ending mid-announcement, let go on both) under a random budget: the device's
    round equals the host's, token for token, and the worker never sees a gap."""
    a, dev, w = Announcer(SLOTS, CAP), DeviceAnnouncer(SLOTS, CAP, "cpu"), Windows(SLOTS, CAP)
    nxt, seen = 1000, set()
    for step, ended in steps:
        batch = {}
        for slot, new, length in step:
            if slot in batch or (not new and slot not in seen):
                continue
            toks = list(range(nxt, nxt + (length if new else 1 + length % 3)))
            nxt += len(toks) + 1
            batch[slot] = (toks, new)
        if batch:
            slots = list(batch)
            positions = [0 if batch[s][1] else int(w.next_pos[s]) for s in slots]
            seen.update(slots)
            b = Batch.from_lists(slots, [batch[s][0] for s in slots], positions, [batch[s][1] for s in slots])
            both(a, dev, w, budget, b)
        a.release(ended)
        dev.release(ended)
        seen.difference_update(ended)
        assert dev.counts()[0] == a.pending and bool(dev.maybe_held()) == bool(a.pending)
    dev.release(range(SLOTS))
    assert not dev.maybe_held() and dev.counts()[0] == 0


def test_the_device_takes_over_what_the_host_held():
    """Slots the host left half announced go on from the device, at their next positions."""
    a, dev, w = Announcer(SLOTS, CAP), DeviceAnnouncer(SLOTS, CAP, "cpu"), Windows(SLOTS, CAP)
    b = Batch.from_lists([0, 1], [range(100, 130), range(200, 214)], [0, 0], [True, True])
    meta = host_meta(b, max_slots=SLOTS, num_spec=K, max_tokens=99, n_out_default=K, context_tokens=CAP)
    m = a.plan(meta, CAP, 10).meta
    assert w.advance(m.slots, m.positions, m.new_gen, m.offsets, m.tokens.astype(np.int32)).ok.all()
    assert a.pending == 2
    dev.take(a)
    assert a.pending == 0 and dev.counts()[0] == 2 and dev.maybe_held()
    assert [int(w.next_pos[0]), int(w.next_pos[1])] == [24, 0]  # 10 of slot 0's 16, none of slot 1's
    ref = Announcer(SLOTS, CAP)  # a host that never let go holds the same: its rounds are the device's
    ref.plan(meta, CAP, 10)
    for t in range(3):
        nxt = Batch.from_lists([0, 1], [[130 + t], [214 + t]], [30 + t, 14 + t], [False, False])
        got = both(ref, dev, w, 10, nxt)
    assert got.n_out.tolist() == [K, K]  # both whole
    assert w.window_of(0) == list(range(130 - CAP + 3, 133)) and w.window_of(1) == list(range(217 - CAP, 217))


@pytest.mark.skipif(
    not device_meta.available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the metadata kernels on CPU tensors need Triton in its interpreter (pip install triton; no CUDA)",
)
def test_the_kernels_write_a_round_planned_on_the_device_as_the_host_writes_its_plan():
    """A planned round's tokens are a buffer of the budget: the kernels send its first
    offsets[n] and nothing past them, the bytes the host path writes for the host's plan."""
    a, dev = Announcer(SLOTS, CAP), DeviceAnnouncer(SLOTS, CAP, "cpu")
    b = Batch.from_lists([3, 1, 4], [range(40), range(7), range(60, 90)], [0, 5, 2], [True, False, True])
    meta = host_meta(b, max_slots=SLOTS, num_spec=K, max_tokens=999, n_out_default=K, context_tokens=CAP)
    want_meta = a.plan(meta, CAP, 24).meta
    got, _ = dev.plan(as_tensors(b), CAP, 24, K)
    n, t = len(b), want_meta.n_tokens
    want = np.zeros(wire.round_meta_bytes(n, False) + 4 * (24 + 1), np.uint8)
    size = write_meta(want, want_meta, deadline_ms=0, row_bytes=0)
    d = torch.zeros(len(want) // 4, dtype=torch.int32)
    d[:3] = torch.tensor(want[:12].view(np.int32))
    kw = dict(max_slots=SLOTS, num_spec=K, max_tokens=24, n_out_default=K, context_tokens=CAP)
    device_meta.write_meta_in_stream(got, d, **kw)
    assert bytes(d.numpy().view(np.uint8)[:size]) == bytes(want[:size])
    assert int(d[3]) == t  # n_tokens: the round's, not the buffer's
    del d
    gc.collect(1)

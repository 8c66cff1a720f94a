"""The engine's round metadata in C (``hf_host_meta``, engine.native_meta) against the
Python reference it replaces (engine.values.meta.host_meta and write_meta).

Random batches, honest and broken (slots out of range or named twice, positions past
the wire's u32 or negative, tokens outside int32 or the vocabulary, offsets that do not
run from 0 to the token count or go back, a negative n_out, more tokens than the region
holds), as int32 or int64 tensors and arrays, NEW_GEN contexts long enough to be cut:
both paths must give the same verdict (the same ValueError, or none) and, when accepted,
the same bytes. A refused batch writes nothing.
"""

import dataclasses

import numpy as np
import pytest
import torch
from helpers import COUNTING, drafter_env
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark.config.api import RemoteConfig
from remote_dspark.config.mode import Mode
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.engine.spec import Spec
from remote_dspark.engine.values.batch import Batch
from remote_dspark.engine.values.meta import host_meta, write_meta
from remote_dspark.engine.writers.native_meta import NativeMeta, write_round_meta

MAX_SLOTS, NUM_SPEC, ROW_BYTES = 24, 4, 16
ROOM = 1 << 16


def _spec(max_tokens=400, vocab_size=0) -> Spec:
    cfg = RemoteConfig.from_env(drafter_env(MarkovDrafter(COUNTING), 1, VLLM_DSPARK_REMOTE_TIMEOUT_MS="250"))
    return Spec(
        cfg=cfg,
        num_spec=NUM_SPEC,
        max_slots=MAX_SLOTS,
        row_bytes=ROW_BYTES,
        max_tokens=max_tokens,
        depth=2,
        device="cpu",
        mode=Mode.of(cfg),
        engine_id=1,
        environ={},
        vocab_size=vocab_size,
    )


def _as(values, dtype, kind):
    """``values`` as a numpy array or a tensor of ``dtype``."""
    a = np.asarray(values, dtype=dtype)
    return torch.from_numpy(a) if kind == "tensor" else a


@st.composite
def batches(draw):
    """A random batch and what it is checked against: ``(batch, context_tokens,
    n_out_default, spec)``."""
    n = draw(st.integers(0, 12))
    slots = draw(st.lists(st.integers(0, MAX_SLOTS - 1), min_size=n, max_size=n, unique=True))
    broken = draw(st.sampled_from(["none"] * 6 + [*"slot twice position cut token offsets back wrap n_out".split()]))
    lengths = draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    if broken == "cut" and n:
        lengths[-1] = 12  # over any context_tokens drawn: cut by 4 or more
    vocab = draw(st.sampled_from([0, 0, 60]))
    tokens = draw(st.lists(st.integers(0, (vocab or 1 << 31) - 1), min_size=sum(lengths), max_size=sum(lengths)))
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)
    positions = draw(st.lists(st.integers(0, (1 << 32) - 1 - 12), min_size=n, max_size=n))
    n_out = draw(st.none() | st.lists(st.integers(0, NUM_SPEC + 3), min_size=n, max_size=n))
    new_gen = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    int_kind = draw(st.sampled_from([np.int32, np.int64]))
    if broken == "slot" and n:
        slots[-1] = draw(st.sampled_from([-1, MAX_SLOTS, MAX_SLOTS + 7]))
    elif broken == "twice" and n > 1:
        slots[-1] = slots[0]
    elif broken == "position" and n:
        positions[-1] = draw(st.sampled_from([-1, 1 << 32, -(1 << 40)]))
        int_kind = np.int64
    elif broken == "token" and tokens:
        tokens[-1] = draw(st.sampled_from([-1, 1 << 31, -(1 << 31) - 1, vocab or -5]))
    elif broken == "offsets":
        offsets[draw(st.sampled_from([0, -1]))] += draw(st.sampled_from([1, -1]))
    elif broken == "cut" and n:  # a position within the u32 that the NEW_GEN cut moves past it
        positions[-1], new_gen[-1] = (1 << 32) - 2, True
    elif broken == "wrap" and n > 2:  # offsets whose differences wrap to a sum of len(tokens)
        offsets[1], offsets[2] = (1 << 63) - 1, -2
    elif broken == "back" and n > 1:
        offsets[1] = offsets[2] + draw(st.sampled_from([1, 3]))  # the second entry's length: -1 or -3
    elif broken == "n_out" and n and n_out is not None:
        n_out[-1] = -1
    tokens_kind = (
        np.int64 if any(t < -(1 << 31) or t >= 1 << 31 for t in tokens) else draw(st.sampled_from([np.int32, np.int64]))
    )
    positions_kind = np.int64 if any(p < 0 or p >= 1 << 31 for p in positions) else int_kind
    kind = draw(st.sampled_from(["tensor", "array"]))
    batch = Batch(
        _as(slots, int_kind, kind),
        _as(tokens, tokens_kind, kind),
        _as(offsets, np.int64, kind),
        _as(positions, positions_kind, kind),
        _as(new_gen, np.bool_, kind),
        n_out=None if n_out is None else _as(n_out, int_kind, kind),
    )
    spec = _spec(max_tokens=draw(st.sampled_from([400, 20])), vocab_size=vocab)
    return batch, draw(st.integers(1, 8)), draw(st.integers(0, NUM_SPEC + 2)), spec


def _python(batch, context_tokens, n_out_default, spec):
    """The reference's verdict and bytes: ``(error or None, payload bytes)``."""
    dst = np.zeros(ROOM, np.uint8)
    try:
        meta = host_meta(
            batch,
            max_slots=spec.max_slots,
            num_spec=spec.num_spec,
            max_tokens=spec.max_tokens,
            n_out_default=n_out_default,
            vocab_size=spec.vocab_size,
            context_tokens=context_tokens,
        )
    except ValueError as e:
        return str(e), b""
    return None, dst[: write_meta(dst, meta, deadline_ms=spec.cfg.timeout_ms, row_bytes=spec.row_bytes)].tobytes()


def _native(lib, batch, context_tokens, n_out_default, spec):
    dst = np.full(ROOM, 0xAB, np.uint8)
    try:
        done = NativeMeta(lib, spec).write(
            batch,
            dst.ctypes.data,
            len(dst),
            deadline_ms=spec.cfg.timeout_ms,
            context_tokens=context_tokens,
            n_out_default=n_out_default,
        )
    except ValueError as e:
        assert (dst == 0xAB).all(), "a refused batch wrote into the descriptor"
        return str(e), b""
    assert done is not None, "the C path did not take a batch of int32/int64 host arrays"
    return None, dst[:done].tobytes()


@settings(max_examples=300, deadline=None)
@given(case=batches())
def test_c_and_python_agree_on_every_batch_verdict_for_verdict_and_byte_for_byte(lib, case):
    want = _python(*case)
    assert _native(lib, *case) == want


def test_a_long_new_gen_context_is_cut_to_its_last_tokens_and_its_position_moves(lib):
    """The cut itself, spelled out: a NEW_GEN entry of 10 tokens at position 100 keeps
    its last 4 (position 106); a continuing entry is never cut."""
    batch = Batch(
        torch.tensor([3, 5], dtype=torch.int32),
        torch.arange(12, dtype=torch.int32),
        torch.tensor([0, 10, 12]),
        torch.tensor([100, 7], dtype=torch.int32),
        torch.tensor([True, False]),
    )
    err, got = _native(lib, batch, 4, 2, _spec())
    assert err is None and got == _python(batch, 4, 2, _spec())[1]
    u32 = np.frombuffer(got, np.uint32)
    n = 2
    assert u32[:4].tolist() == [250, n, ROW_BYTES, 6]  # deadline, entries, row bytes, tokens kept
    assert u32[4 + n : 4 + 2 * n].tolist() == [106, 7]  # positions
    assert u32[4 + 5 * n + 1 :].tolist() == [6, 7, 8, 9, 10, 11]  # tokens: 6..9, then 10, 11


def _one_entry(n_tokens: int) -> Batch:
    """A batch of one continuing entry (slot 2, position 9) of ``n_tokens`` tokens."""
    return Batch(
        torch.tensor([2], dtype=torch.int32),
        torch.arange(n_tokens, dtype=torch.int32),
        torch.tensor([0, n_tokens]),
        torch.tensor([9], dtype=torch.int32),
        torch.tensor([False]),
    )


@pytest.mark.parametrize(
    "change",
    [
        lambda b: Batch(b.slots.to(torch.int16), b.tokens, b.token_offsets, b.positions, b.new_gen),
        lambda b: Batch(b.slots, b.tokens[::2], b.token_offsets // 2, b.positions, b.new_gen),
        lambda b: Batch(b.slots, b.tokens, b.token_offsets, b.positions.to(torch.int16), b.new_gen),
        lambda b: Batch(b.slots, b.tokens, b.token_offsets, b.positions, b.new_gen.to(torch.uint8)),
        lambda b: Batch(b.slots, b.tokens, b.token_offsets, b.positions, b.new_gen, temperature=[1.0], seed=[1]),
    ],
    ids=["int16 slots", "strided tokens", "int16 positions", "uint8 new_gen", "sampled"],
)
def test_a_batch_the_c_call_cannot_read_goes_the_python_way_with_the_same_bytes(lib, change):
    batch = change(_one_entry(6))
    native = NativeMeta(lib, _spec())
    assert native.write(batch, 0, 0, deadline_ms=1, context_tokens=8, n_out_default=2) is None
    dst = np.zeros(ROOM, np.uint8)
    if batch.temperature is not None:  # a greedy engine refuses sampling fields, by the Python way's words
        with pytest.raises(ValueError, match="temperature: given, but the engine does not ask for sampled drafts"):
            write_round_meta(_spec(), native, batch, dst, dst.ctypes.data, lambda: 0)
        return
    size = write_round_meta(_spec(), native, batch, dst, dst.ctypes.data, lambda: 0)
    assert dst[:size].tobytes() == _python(batch, 8, NUM_SPEC, _spec())[1]


def test_a_refusal_the_reference_does_not_share_is_a_loud_disagreement(lib):
    native = NativeMeta(lib, _spec())
    dst = np.zeros(16, np.uint8)  # no room for the round: the C call refuses, host_meta accepts
    with pytest.raises(RuntimeError, match="engine_meta.c and engine/values/meta.py disagree"):
        native.write(_one_entry(3), dst.ctypes.data, len(dst), deadline_ms=1, context_tokens=8, n_out_default=2)
    assert not dst.any()


def test_offsets_whose_differences_wrap_and_a_cut_past_the_u32_are_refused_by_both_paths(lib):
    """Offsets 0, 2**63-1, -2, 3: lengths that wrap to a sum of the 3 tokens (once a
    write of 2**63 tokens); a position the NEW_GEN cut moves past the wire's u32."""
    wrap = Batch(
        np.array([0, 1, 2]), np.arange(3), np.array([0, (1 << 63) - 1, -2, 3]), np.zeros(3, np.int64), np.zeros(3, bool)
    )
    late = Batch(np.array([0]), np.arange(12), np.array([0, 12]), np.array([(1 << 32) - 2]), np.array([True]))
    for batch, why in ((wrap, "token_offsets: not non-decreasing (entry 1)"), (late, "after its NEW_GEN cut")):
        err, _ = _native(lib, batch, 8, 2, _spec())
        assert err is not None and why in err and err == _python(batch, 8, 2, _spec())[0]


@pytest.mark.parametrize("acked", [0, 1, 50, 63, 64, 65, 199, 200, 201, 1 << 31, (1 << 32) - 1])
def test_the_cut_read_from_the_acked_word_is_spec_context_cut(lib, acked):
    """A NativeMeta given the region's context word cuts each NEW_GEN context as
    ``Spec.context_cut`` does, from the word's value at the call: the smaller of it and
    the engine's cap, and before any HELLO_ACK (0) the cut of an unknown worker."""
    spec = dataclasses.replace(_spec(), context_tokens=200)
    word = np.array([acked], np.uint32)
    native = NativeMeta(lib, spec, word.ctypes.data)
    batch = Batch(np.array([2]), np.arange(300), np.array([0, 300]), np.array([9]), np.array([True]))
    dst = np.zeros(ROOM, np.uint8)
    size = native.write(batch, dst.ctypes.data, len(dst), deadline_ms=spec.cfg.timeout_ms, n_out_default=2)
    kept = int(dst[:16].view(np.uint32)[3])  # the fixed part's token count
    assert kept == spec.context_cut(acked) and dst[:size].tobytes() == _python(batch, kept, 2, spec)[1][:size]

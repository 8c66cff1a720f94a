"""The engine's batch path equals a slow per-entry reference: metadata checked and cut,
written byte for byte as the wire's ROUND, and answers turned into ``Drafts`` value for
value. Bad fields are refused by name."""

from __future__ import annotations

import dataclasses
import gc
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.demo.sim import SimEngine
from remote_dspark.engine.values.batch import CONTEXT_TOKENS, Batch, gather_rows_host, has_rows
from remote_dspark.engine.values.drafts import to_drafts
from remote_dspark.engine.values.meta import host_meta, write_meta
from remote_dspark.engine.writers import device_meta

# The device's metadata writer is Triton's kernels; CPU tensors need its interpreter (conftest).
needs_triton = pytest.mark.skipif(
    not device_meta.available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the metadata kernels on CPU tensors need Triton in its interpreter (pip install triton; no CUDA)",
)

MAX_SLOTS, K, ROW_BYTES = 16, 4, 8
ROWS = torch.arange(MAX_SLOTS * 2, dtype=torch.float32).reshape(MAX_SLOTS, 2)  # 8 bytes a row


@st.composite
def batches(draw):
    n = draw(st.integers(0, MAX_SLOTS))
    slots = draw(st.permutations(range(MAX_SLOTS)))[:n]
    tokens = [draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=CONTEXT_TOKENS + 8)) for _ in range(n)]
    positions = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    new_gen = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    n_out = draw(st.none() | st.lists(st.integers(0, 2 * K), min_size=n, max_size=n))
    row_index = draw(st.lists(st.integers(0, MAX_SLOTS - 1), min_size=n, max_size=n))
    return Batch.from_lists(slots, tokens, positions, new_gen, ROWS, row_index, n_out), tokens


def reference_entries(batch: Batch, tokens, default_n_out: int) -> list[wire.Entry]:
    """The first version's per-entry rule: a NEW_GEN context keeps its last
    CONTEXT_TOKENS tokens and its position moves with the cut; n_out capped at K."""
    out = []
    for i in range(len(batch)):
        toks, pos, new = list(tokens[i]), int(batch.positions[i]), bool(batch.new_gen[i])
        if new and len(toks) > CONTEXT_TOKENS:
            pos += len(toks) - CONTEXT_TOKENS
            toks = toks[-CONTEXT_TOKENS:]
        n_out = default_n_out if batch.n_out is None else min(int(batch.n_out[i]), K)
        out.append(wire.Entry(int(batch.slots[i]), n_out, pos, toks, new))
    return out


@settings(max_examples=150, deadline=None)
@given(batches())
def test_round_bytes_equal_the_per_entry_reference(case):
    batch, tokens = case
    meta = host_meta(batch, max_slots=MAX_SLOTS, num_spec=K, max_tokens=10_000, n_out_default=3)
    buf = np.zeros(wire.round_meta_bytes(MAX_SLOTS) + 4 * 10_000, dtype=np.uint8)
    size = write_meta(buf, meta, deadline_ms=77, row_bytes=ROW_BYTES)
    rows = np.zeros((MAX_SLOTS, ROW_BYTES), dtype=np.uint8)
    gather_rows_host(batch, rows, ROW_BYTES)
    want_rows = b"".join(ROWS[int(i)].numpy().tobytes() for i in batch.row_index)
    want = wire.encode_round_entries(5, 0, 77, reference_entries(batch, tokens, 3), want_rows, ROW_BYTES)
    assert bytes(buf[:size]) + rows[: len(batch)].tobytes() == want[wire.HEADER.size :]
    # The same batch as int32 tensors (an engine's own dtypes) writes the same bytes.
    as_tensors = Batch(
        *(
            torch.from_numpy(getattr(batch, f).astype(np.int32)) if f != "new_gen" else torch.from_numpy(batch.new_gen)
            for f in ("slots", "tokens", "token_offsets", "positions", "new_gen")
        ),
        ROWS,
        torch.from_numpy(batch.row_index),
        None if batch.n_out is None else torch.from_numpy(batch.n_out.astype(np.int32)),
    )
    again = np.zeros_like(buf)
    meta = host_meta(as_tensors, max_slots=MAX_SLOTS, num_spec=K, max_tokens=10_000, n_out_default=3)
    assert write_meta(again, meta, deadline_ms=77, row_bytes=ROW_BYTES) == size
    assert bytes(again[:size]) == bytes(buf[:size])


@st.composite
def answers(draw):
    n = draw(st.integers(0, MAX_SLOTS))
    width = draw(st.integers(0, K))
    counts = draw(st.lists(st.integers(0, width), min_size=n, max_size=n))
    statuses = draw(st.lists(st.sampled_from([wire.STATUS_OK, wire.STATUS_RESYNC]), min_size=n, max_size=n))
    tokens = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n * width, max_size=n * width))
    margins = draw(st.none() | st.lists(st.floats(0, 1, width=32), min_size=n * width, max_size=n * width))
    slots = draw(st.permutations(range(MAX_SLOTS)))[:n]
    return slots, counts, statuses, width, tokens, margins


@settings(max_examples=150, deadline=None)
@given(answers(), st.booleans())
def test_drafts_equal_the_per_entry_reference(answer, want_margin):
    slots, counts, statuses, width, tokens, margins = answer
    n = len(slots)
    d = to_drafts(
        K,
        np.array(slots, dtype=np.int64),
        np.array(counts, dtype=np.uint16),
        np.array(statuses, dtype=np.uint16),
        np.array(tokens, dtype=np.int32).reshape(n, width),
        None if margins is None else np.array(margins, dtype=np.float32).reshape(n, width),
        "ok",
        want_margin,
    )
    assert d.tokens.dtype == torch.int32 and tuple(d.tokens.shape) == (n, K)
    for i in range(n):  # the slow reference: row by row, nothing past a count
        c = counts[i]
        assert d.tokens[i].tolist() == tokens[i * width : i * width + c] + [0] * (K - c)
        if want_margin:
            m = (
                [0.0] * K
                if margins is None
                else [float(np.float32(x)) for x in margins[i * width : i * width + c]] + [0.0] * (K - c)
            )
            assert d.margins[i].tolist() == m
    assert d.counts.tolist() == counts and (d.margins is None) == (not want_margin)
    assert d.resync == tuple(s for s, st_ in zip(slots, statuses) if st_ == wire.STATUS_RESYNC)


def meta_of(**kw):
    base = dict(
        slots=[0, 1], tokens=[[1], [2, 3]], positions=[0, 4], new_gen=[False, False], rows=ROWS, row_index=[0, 1]
    )
    base.update(kw)
    return Batch.from_lists(**base)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(slots=[0, MAX_SLOTS]), "slots: 16 out of 0..15"),
        (dict(slots=[-1, 1]), "slots: -1 out of"),
        (dict(slots=[3, 3]), "slots: 3 repeated"),
        (dict(positions=[0, -5]), "positions: -5 (entry 1) outside 0..4294967295"),
        (dict(positions=[2**32, 0]), "positions: 4294967296 (entry 0) outside"),
        (dict(tokens=[[1], [2, 2**31]]), "tokens: values outside the wire's int32"),
        (dict(n_out=[1, -1]), "n_out: negative"),
        (dict(new_gen=[False]), "new_gen: shape (1,)"),
    ],
)
def test_bad_fields_are_named(kw, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        host_meta(meta_of(**kw), max_slots=MAX_SLOTS, num_spec=K, max_tokens=100, n_out_default=K)


def with_offsets(offsets, tokens=(1, 2, 3)) -> Batch:
    good = meta_of()
    return Batch(
        good.slots, torch.tensor(tokens), torch.tensor(offsets), good.positions, good.new_gen, ROWS, good.row_index
    )


@pytest.mark.parametrize(
    "offsets, why",
    [
        ([0, 2, 2], "token_offsets: run from 0 to 2, expected 0 to len"),
        ([1, 2, 3], "token_offsets: run from 1 to 3"),
        ([0, 3, 1, 3], "token_offsets: shape"),
        ([0, 4, 3], "token_offsets: not non-decreasing"),
    ],
)
def test_bad_offsets_are_named(offsets, why):
    with pytest.raises(ValueError, match=why):
        host_meta(with_offsets(offsets), max_slots=MAX_SLOTS, num_spec=K, max_tokens=100, n_out_default=K)


def test_token_cap_row_index_and_row_size_are_named():
    good = meta_of()
    with pytest.raises(ValueError, match="tokens: 3 in one round"):
        host_meta(good, max_slots=MAX_SLOTS, num_spec=K, max_tokens=2, n_out_default=K)
    with pytest.raises(ValueError, match="row_index: values must be in 0..15"):
        gather_rows_host(meta_of(row_index=[0, 16]), np.zeros((MAX_SLOTS, ROW_BYTES), np.uint8), ROW_BYTES)
    with pytest.raises(ValueError, match="rows: 8 bytes per row, RemoteDSpark was built for row_bytes=4"):
        gather_rows_host(good, np.zeros((MAX_SLOTS, 4), np.uint8), 4)


@pytest.mark.parametrize(
    "field, value",
    [
        ("tokens", np.array([1.0, 2.0, 3.7])),
        ("tokens", torch.tensor([1.0, 2.0, 3.7])),
        ("tokens", torch.tensor([True, False, True])),
        ("slots", np.array([0.0, 1.0])),
        ("positions", torch.tensor([0.0, 4.5])),
        ("token_offsets", np.array([0.0, 1.0, 3.0])),
        ("n_out", np.array([1.0, 2.0], np.float32)),
    ],
    ids=lambda v: v if isinstance(v, str) else str(v.dtype),
)
def test_ids_and_counts_of_another_dtype_than_an_integer_are_refused_on_both_paths(field, value):
    """Never truncated (3.7 as token 3): the host path and the device path refuse the
    dtype in the same words, before a value is read."""
    batch = dataclasses.replace(meta_of(), **{field: value})
    why = rf"^{field}: dtype {value.dtype}, expected an integer dtype"
    with pytest.raises(ValueError, match=why):
        host_meta(batch, max_slots=MAX_SLOTS, num_spec=K, max_tokens=100, n_out_default=K)
    with pytest.raises(ValueError, match=why):
        device_meta.check_meta_shapes(batch, MAX_SLOTS)


def test_lists_of_floats_are_kept_floats_and_refused_never_truncated():
    batch = meta_of(tokens=[[1], [2, 3.7]])
    assert batch.tokens.tolist() == [1, 2, 3.7]
    with pytest.raises(ValueError, match=r"^tokens: dtype float64, expected an integer dtype"):
        host_meta(batch, max_slots=MAX_SLOTS, num_spec=K, max_tokens=100, n_out_default=K)
    with pytest.raises(ValueError, match=r"^row_index: dtype float64, expected an integer dtype"):
        has_rows(meta_of(row_index=[0, 1.5]), ROW_BYTES)
    empty = Batch.from_lists([], [], [], [], ROWS, [])  # nothing to refuse: an empty list is any dtype's
    assert empty.tokens.dtype == empty.row_index.dtype == np.int64


def test_sim_arrays_are_each_slots_unsent_tokens():
    sim = SimEngine(6, 3, seed=3, prompt=5, length=(8, 12))
    first = sim.arrays()
    assert first.new_gen.all() and (first.positions == 0).all()
    for s in range(6):
        assert first.tokens[first.offsets[s] : first.offsets[s + 1]].tolist() == sim.truth[s, :5].tolist()
    sim.mark_sent()
    truth_next = np.stack([sim.truth[s, 5 : 5 + 3] for s in range(6)])
    counts = np.array([3, 2, 0, 3, 1, 3])
    wrong = truth_next.copy()
    wrong[3, 1] += 1  # slot 3: the second draft is wrong
    assert sim.verify(wrong, counts) == 3 + 2 + 0 + 1 + 1 + 3
    assert sim.accepted_at.tolist() == [5, 3, 2] and sim.offered_at.tolist() == [5, 4, 2]
    sim.reannounce([4])
    nxt = sim.arrays()
    assert nxt.new_gen.tolist() == [False, False, False, False, True, False]
    for s, got in enumerate([4, 3, 1, 2, 2, 4]):  # accepted + the target's own token
        assert nxt.offsets[s + 1] - nxt.offsets[s] == (5 + got if s == 4 else got)
        assert nxt.positions[s] == (0 if s == 4 else 5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, MAX_SLOTS - 1), max_size=MAX_SLOTS))
def test_native_row_gather_equals_numpy(lib, index):
    """The engine's C copy loop (process and thread modes) moves the same bytes as np.take."""
    b = meta_of(
        slots=list(range(len(index))),
        tokens=[[]] * len(index),
        positions=[0] * len(index),
        new_gen=[False] * len(index),
        row_index=index,
    )
    want = np.zeros((MAX_SLOTS, ROW_BYTES), np.uint8)
    got = np.zeros((MAX_SLOTS, ROW_BYTES), np.uint8)
    gather_rows_host(b, want, ROW_BYTES)
    gather_rows_host(b, got, ROW_BYTES, lib, got.ctypes.data)
    assert got.tobytes() == want.tobytes()


def test_native_row_gather_names_the_bad_index(lib):
    out = np.zeros((MAX_SLOTS, ROW_BYTES), np.uint8)
    with pytest.raises(ValueError, match=r"row_index: 16 \(entry 1\) outside 0..15"):
        gather_rows_host(meta_of(row_index=[3, 16]), out, ROW_BYTES, lib, out.ctypes.data)
    with pytest.raises(ValueError, match=r"row_index: -1 \(entry 0\)"):
        gather_rows_host(meta_of(row_index=[-1, 0]), out, ROW_BYTES, lib, out.ctypes.data)


def test_an_empty_answer_clears_the_tokens_block(lib):
    """launch() copies a drafts slot's tokens as they are: an empty answer (no proxy,
    watchdog, orphan, timeout) must leave no stale tokens behind."""
    from remote_dspark.shm import layout, memfd, ring

    with memfd.Region.create(layout.Layout(2, 4, 8, 3, 16)) as region:
        end = ring.EngineEnd(region, lib)
        lay = region.layout
        r = end.reserve(1.0)
        tokens = region.view(lay.drafts(r & 1) + lay.d_tokens, 4 * 4 * 3)
        tokens[:] = b"\xff" * len(tokens)  # what an earlier round left there
        end.release_no_proxy(r)
        assert bytes(tokens) == bytes(len(tokens))
        tokens.release()


# --------------------------------------------------------------------------- metadata on the device


def region_rig(lib):
    from remote_dspark.proxy import ring_end
    from remote_dspark.shm import layout, memfd, ring

    region = memfd.Region.create(layout.Layout(2, MAX_SLOTS, ROW_BYTES, K, 10_000))
    return region, ring.EngineEnd(region, lib), ring_end.ProxyEnd(region, lib)


def write_in_stream(region, r: int, batch: Batch) -> None:
    """What launch() does for metadata on the device, with a CPU tensor over the region
    standing in for the device view (the same kernels, run in Triton's interpreter)."""
    from remote_dspark.engine.writers.device_meta import check_meta_shapes, write_meta_in_stream
    from remote_dspark.shm import layout

    lay = region.layout
    area = region.view(lay.desc(r & 1) + layout.DESC_FIXED, lay.desc_stride - layout.DESC_FIXED)
    round_word = np.frombuffer(region.view(lay.desc(r & 1), 4), np.uint32)
    round_word[0] = r
    d = torch.frombuffer(area, dtype=torch.int32)
    n = check_meta_shapes(batch, MAX_SLOTS)
    np.frombuffer(area, np.uint32, 3)[:] = (77, n, ROW_BYTES)
    write_meta_in_stream(batch, d, max_slots=MAX_SLOTS, num_spec=K, max_tokens=lay.max_tokens, n_out_default=3)
    del d, round_word, area  # no view may outlive the region
    gc.collect(1)  # (Triton's interpreter leaves the tensor in a reference cycle)


@needs_triton
@settings(max_examples=100, deadline=None)
@given(batches())
def test_metadata_written_in_stream_equals_the_host_path(lib, case):
    """The device path (the metadata kernels, no host read) writes the very bytes
    host_meta + write_meta write, NEW_GEN cut included, and the proxy's C check accepts
    them."""
    from remote_dspark.shm import layout

    batch, _ = case
    region, end, proxy = region_rig(lib)
    try:
        r = end.reserve(1.0)
        write_in_stream(region, r, batch)
        lay = region.layout
        meta = host_meta(batch, max_slots=MAX_SLOTS, num_spec=K, max_tokens=lay.max_tokens, n_out_default=3)
        want = np.zeros(lay.desc_stride, np.uint8)
        size = write_meta(want, meta, deadline_ms=77, row_bytes=ROW_BYTES)
        got = bytes(region.view(lay.desc(r & 1) + layout.DESC_FIXED, size))
        assert got == bytes(want[:size])
        proxy.check_descriptor(r)
    finally:
        region.close()


@needs_triton
@pytest.mark.parametrize(
    "change, why",
    [
        (dict(slots=[0, MAX_SLOTS + 5]), "slot 16"),  # out of range: refused
        (dict(slots=[-1, 1]), "slot 16"),
        (dict(slots=[2, 2]), "twice"),
        (dict(token_offsets=[0, 1, 2]), "n_tokens 10001 over max_tokens"),  # does not end at len(tokens)
        (dict(token_offsets=[1, 1, 3]), "n_tokens 10001 over max_tokens"),  # does not start at 0
        (dict(token_offsets=[0, 4, 3]), "offsets"),  # goes back: refused by the C
    ],
)
def test_bad_metadata_in_stream_is_refused_where_it_lands(lib, change, why):
    from remote_dspark.engine.values.batch import Batch as B

    base = dict(slots=[0, 1], tokens=[1, 2, 3], token_offsets=[0, 1, 3], positions=[0, 4], new_gen=[False, False])
    base.update(change)
    batch = B(**{k: torch.tensor(v) for k, v in base.items()}, rows=ROWS, row_index=torch.tensor([0, 1]))
    region, end, proxy = region_rig(lib)
    try:
        r = end.reserve(1.0)
        write_in_stream(region, r, batch)
        with pytest.raises(ValueError, match=why):
            proxy.check_descriptor(r)
    finally:
        region.close()


# --------------------------------------------------------------------------- a sampled engine's metadata on the device

TEMPERATURES = st.floats(0, 3.0e38, width=64) | st.sampled_from([-0.0, 0.0, 1e-45, 1e-40, 0.7])
SEEDS = st.integers(-(2**63), 2**63 - 1)  # a negative int64 is a u64 seed of 2**63 or more


@st.composite
def sampled_batches(draw):
    """A batch of :func:`batches` with temperatures and seeds in every form an engine
    may hold them: float64 or float32 (numpy or torch) or int temperatures, -0.0
    included; int64 seeds (huge u64 seeds as negative int64), numpy uint64 or int32."""
    batch, _ = draw(batches())
    n = len(batch)
    temps = draw(st.lists(TEMPERATURES, min_size=n, max_size=n))
    seeds = draw(st.lists(SEEDS, min_size=n, max_size=n))
    temperature = {
        "f64": np.asarray(temps, np.float64),
        "f32": np.asarray(temps, np.float32),
        "torch_f64": torch.tensor(temps, dtype=torch.float64),
        "torch_f32": torch.tensor(temps, dtype=torch.float32),
        "int": np.asarray(temps, np.float64).clip(0, 2**40).astype(np.int64),
    }[draw(st.sampled_from(["f64", "f32", "torch_f64", "torch_f32", "int"]))]
    bits = np.asarray(seeds, np.int64)
    seed = {
        "i64": bits,
        "torch_i64": torch.from_numpy(bits.copy()),
        "u64": bits.view(np.uint64),
        "i32": bits.astype(np.int32),
    }[draw(st.sampled_from(["i64", "torch_i64", "u64", "i32"]))]
    return dataclasses.replace(batch, temperature=temperature, seed=seed)


def device_path_bytes(
    batch: Batch,
    sampled: bool,
    max_tokens: int = 10_000,
    device: str = "cpu",
    max_slots: int = MAX_SLOTS,
    context_tokens: int = CONTEXT_TOKENS,
) -> np.ndarray:
    """What launch() writes for metadata on the device (Handoff._write_device_meta), into
    a plain payload area: on the CPU a CPU tensor stands in for the device view (the
    metadata kernels in Triton's interpreter); on CUDA a device tensor."""
    from remote_dspark.engine.writers.device_meta import check_meta_shapes, write_meta_in_stream

    area = np.zeros(wire.round_meta_bytes(max_slots, True) + 4 * (max_tokens + 1), np.uint8)
    n = check_meta_shapes(batch, max_slots, sampled)
    area[:12].view(np.uint32)[:] = (77, n, ROW_BYTES)
    d = torch.from_numpy(area).view(torch.int32).to(device)
    kw = dict(max_slots=max_slots, num_spec=K, max_tokens=max_tokens, n_out_default=3, context_tokens=context_tokens)
    write_meta_in_stream(batch, d, **kw, sampled=sampled)
    return d.cpu().numpy().view(np.uint8)


def host_path_bytes(
    batch: Batch, sampled: bool, max_tokens: int = 10_000, max_slots: int = MAX_SLOTS, context_tokens=CONTEXT_TOKENS
):
    """host_meta + write_meta's bytes of ``batch`` (fields on any device) and their size."""
    host = Batch(**{f.name: _on_host(getattr(batch, f.name)) for f in dataclasses.fields(batch)})
    kw = dict(max_slots=max_slots, num_spec=K, max_tokens=max_tokens, n_out_default=3, context_tokens=context_tokens)
    meta = host_meta(host, **kw, sampled=sampled)
    want = np.zeros(wire.round_meta_bytes(max_slots, True) + 4 * (max_tokens + 1), np.uint8)
    return want, write_meta(want, meta, deadline_ms=77, row_bytes=ROW_BYTES)


def _on_host(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _on_cuda(batch: Batch, which: int) -> Batch:
    """``batch`` with the metadata fields picked by the bits of ``which`` on CUDA (an
    engine's batch may mix them; u64 seeds stay on the host, as numpy holds them), the
    rows always there."""
    fields = ("slots", "tokens", "token_offsets", "positions", "new_gen", "n_out", "temperature", "seed")
    moved = {}
    for bit, name in enumerate(fields):
        value = getattr(batch, name)
        if which >> bit & 1 and value is not None and getattr(value, "dtype", None) != np.uint64:
            moved[name] = torch.as_tensor(value).cuda()
    index = torch.as_tensor(batch.row_index).cuda()
    return dataclasses.replace(batch, rows=batch.rows.cuda(), row_index=index, **moved)


@pytest.mark.gpu
@settings(max_examples=150, deadline=None)
@given(sampled_batches(), st.booleans(), st.integers(0, 255), st.integers(1, 16))
def test_the_metadata_kernel_writes_the_host_paths_bytes(batch, sampled, which, context_tokens):
    """On CUDA the metadata kernel (engine.writers.device_meta) writes what host_meta + write_meta
    write, byte for byte: NEW_GEN contexts cut (to a context of 1 to 16 tokens, so most
    are), n_out given or not, temperatures and seeds in every form, any mix of fields on
    the host and on the device."""
    from remote_dspark.engine.writers import device_meta

    assert device_meta.available()
    if not sampled:
        batch = dataclasses.replace(batch, temperature=None, seed=None)
    batch = _on_cuda(batch, which)
    want, size = host_path_bytes(batch, sampled, context_tokens=context_tokens)
    got = device_path_bytes(batch, sampled, device="cuda", context_tokens=context_tokens)
    assert bytes(got[:size]) == bytes(want[:size])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1023, 1024, 1025, 3000])
def test_the_metadata_kernel_carries_its_offsets_across_blocks_of_entries_and_tokens(n):
    """Rounds of more entries than one block of the kernel's walk, and more tokens than one
    of its programs: every NEW_GEN cut and offset carried across, as the host path has them."""
    rng = np.random.default_rng(n)
    lens = rng.integers(0, 90, n)
    tokens = [rng.integers(0, 1000, k).tolist() for k in lens]
    batch = Batch.from_lists(
        list(rng.permutation(4096)[:n]), tokens, rng.integers(0, 10_000, n).tolist(), (rng.random(n) < 0.5).tolist(),
        ROWS, [0] * n, temperature=rng.random(n).tolist(), seed=rng.integers(0, 2**62, n).tolist(),
    )  # fmt: skip
    batch = _on_cuda(batch, 255)
    max_tokens = int(lens.sum()) + 10
    want, size = host_path_bytes(batch, True, max_tokens, max_slots=4096)
    got = device_path_bytes(batch, True, max_tokens, device="cuda", max_slots=4096)
    assert bytes(got[:size]) == bytes(want[:size])


@needs_triton
@settings(max_examples=150, deadline=None)
@given(sampled_batches(), st.integers(1, 16))
def test_a_sampled_rounds_metadata_in_stream_equals_the_host_path(batch, context_tokens):
    """Temperatures (float32 bits, -0.0 as 0.0) and seeds (an int64's bits as the u64)
    land where host_meta + write_meta put them, the tokens after them (NEW_GEN contexts
    cut to 1 to 16 tokens), byte for byte."""
    kw = dict(max_slots=MAX_SLOTS, num_spec=K, max_tokens=10_000, n_out_default=3, context_tokens=context_tokens)
    meta = host_meta(batch, **kw, sampled=True)
    want = np.zeros(wire.round_meta_bytes(MAX_SLOTS, True) + 4 * 10_001, np.uint8)
    size = write_meta(want, meta, deadline_ms=77, row_bytes=ROW_BYTES)
    got = device_path_bytes(batch, sampled=True, context_tokens=context_tokens)
    assert bytes(got[:size]) == bytes(want[:size])
    sec = wire.round_sections(len(batch), meta.n_tokens, ROW_BYTES, True)
    assert not (got[sec.temperature : sec.seed].view(np.uint32) == 0x8000_0000).any()  # no -0.0 on the wire


def test_a_sampled_engines_fields_are_refused_by_name_without_reading_a_value():
    """Missing on a sampled engine, given to another, the wrong shape or dtype: the
    device path's words are the host path's (meta.sampling_meta)."""
    from remote_dspark.engine.writers.device_meta import check_meta_shapes

    plain = meta_of(slots=[0, 1], tokens=[[1], [2]], positions=[0, 0], new_gen=[True, True])
    both = dataclasses.replace(plain, temperature=np.zeros(2), seed=np.zeros(2, np.int64))
    cases = [
        (dataclasses.replace(plain, seed=np.zeros(2, np.int64)), True, "temperature: None, but"),
        (dataclasses.replace(plain, temperature=np.zeros(2)), True, "seed: None, but"),
        (both, False, "temperature: given, but"),
        (dataclasses.replace(plain, seed=np.zeros(2, np.int64)), False, "seed: given, but"),
        (dataclasses.replace(both, seed=np.zeros(2)), True, "seed: dtype float64"),
        (dataclasses.replace(both, temperature=np.zeros(2, bool)), True, "temperature: dtype bool"),
    ]
    for b, sampled, words in cases:
        with pytest.raises(ValueError) as on_host:
            host_meta(b, max_slots=MAX_SLOTS, num_spec=K, max_tokens=100, n_out_default=3, sampled=sampled)
        with pytest.raises(ValueError) as on_device:
            check_meta_shapes(b, MAX_SLOTS, sampled)
        assert str(on_device.value).startswith(words) and str(on_device.value) == str(on_host.value), words
    for name in ("temperature", "seed"):
        long = dataclasses.replace(both, **{name: torch.zeros(3, dtype=torch.int64)})
        with pytest.raises(ValueError, match=rf"{name}: shape \(3,\), expected \[2\]"):
            check_meta_shapes(long, MAX_SLOTS, True)
    assert check_meta_shapes(both, MAX_SLOTS, True) == 2


def test_an_empty_sampled_round_in_stream_is_the_host_paths():
    empty = Batch.from_lists([], [], [], [], ROWS, [], temperature=[], seed=[])
    meta = host_meta(empty, max_slots=MAX_SLOTS, num_spec=K, max_tokens=100, n_out_default=3, sampled=True)
    want = np.zeros(64, np.uint8)
    size = write_meta(want, meta, deadline_ms=77, row_bytes=ROW_BYTES)
    assert bytes(device_path_bytes(empty, sampled=True, max_tokens=100)[:size]) == bytes(want[:size])


def test_the_metadata_kernel_is_chosen_only_on_cuda_and_only_once_it_checks_out(monkeypatch, caplog):
    from remote_dspark.engine.writers import device_meta

    assert device_meta.choose("cpu") is False
    monkeypatch.setattr(device_meta, "available", lambda: True)

    def differs(device):
        raise RuntimeError("the metadata kernel differs from the host path for a round of 5 entries")

    monkeypatch.setattr(device_meta, "self_check", differs)
    assert device_meta.choose("cuda") is False
    assert "metadata kernel off (the metadata kernel differs" in caplog.text
    monkeypatch.setattr(device_meta, "available", lambda: False)
    assert device_meta.choose("cuda") is False
    assert "no Triton (the gpu extra)" in caplog.text


@pytest.mark.gpu
def test_the_metadata_kernel_checks_out_on_cuda():
    from remote_dspark.engine.writers import device_meta

    device_meta.self_check("cuda")
    assert device_meta.choose("cuda") is True

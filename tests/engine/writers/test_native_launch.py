"""The native launch: ``hf_cuda_launch``'s order of driver calls and its failures, on the
CPU with stand-in entry points (what it asks of the driver, step by step); and on a GPU
the kernel against ``index_select``, the rows and indexes it takes, and launch() by it
against launch() through torch (marked gpu: skipped elsewhere, with the reason)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int, c_size_t, c_uint, c_uint32, c_uint64, c_void_p

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark.native import CudaIn, LaunchIn

LAUNCH = ctypes.CFUNCTYPE(c_int, c_void_p, *(c_uint,) * 7, c_void_p, POINTER(c_void_p), c_void_p)
VALUE32 = ctypes.CFUNCTYPE(c_int, c_void_p, c_uint64, c_uint32, c_uint)
MEMCPY = ctypes.CFUNCTYPE(c_int, c_uint64, c_uint64, c_size_t, c_void_p)
GATHERED, RELEASED, STREAM, KERNEL = 0x1000, 0x2000, 0x77, 0x99


class FakeDriver:
    """Entry points that record each call (and the gather's arguments) and return the
    error set for their kind (0: success)."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.fail: dict[str, int] = {}
        self.wake = np.zeros(2, dtype=np.uint32)

        def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            args = [ctypes.cast(params[k], POINTER(c_uint64)).contents.value for k in range(6)]
            args += [ctypes.cast(params[k], POINTER(c_uint32)).contents.value for k in (6, 7)]
            self.calls.append(("gather", fn, (gx, gy, gz), (bx, by, bz), shared, stream, tuple(args)))
            return self.fail.get("gather", 0)

        def write(stream, address, value, flags):
            self.calls.append(("write", stream, address, value, flags, int(self.wake[0])))
            return self.fail.get("write", 0)

        def wait(stream, address, value, flags):
            self.calls.append(("wait", stream, address, value, flags))
            return self.fail.get("wait", 0)

        def memcpy(dst, src, size, stream):
            self.calls.append(("copy", dst, src, size, stream))
            return self.fail.get(f"copy{dst}", 0)

        self._keep = (LAUNCH(launch), VALUE32(write), VALUE32(wait), MEMCPY(memcpy))
        addr = [ctypes.cast(f, c_void_p).value for f in self._keep]
        self.c = CudaIn(*addr, KERNEL, GATHERED, RELEASED, self.wake.ctypes.data)


def job(n=3, round_id=41, copies=((0xA0, 0xB0, 12), (0xA1, 0xB1, 0), (0xA2, 0xB2, 4))) -> LaunchIn:
    j = LaunchIn(stream=STREAM, src=0x5000, index=0x6000, dst=0x7000, src_stride=300, row_units=257, src_rows=9, n=n)
    j.index_bytes, j.unit_bytes, j.round, j.n_copies = 8, 4, round_id, len(copies)
    for k, (d, s, b) in enumerate(copies):
        j.copy[k].dst, j.copy[k].src, j.copy[k].bytes = d, s, b
    return j


def test_a_launch_enqueues_gather_store_wait_and_copies_in_that_order(lib):
    drv, j = FakeDriver(), job()
    assert lib.cuda_launch(ctypes.byref(drv.c), ctypes.byref(j)) == 0
    gather, write, wait, *copies = drv.calls
    # One block of 256 threads per (row, stretch of 256 units): 257 units take two.
    assert gather == ("gather", KERNEL, (3, 2, 1), (256, 1, 1), 0, STREAM, (0x5000, 0x6000, 0x7000, 300, 257, 9, 8, 4))
    assert write == ("write", STREAM, GATHERED, 41, 0, 41)  # announced before the store was enqueued
    assert wait == ("wait", STREAM, RELEASED, 41, 0)  # GEQ, cyclic
    assert copies == [("copy", 0xA0, 0xB0, 12, STREAM), ("copy", 0xA2, 0xB2, 4, STREAM)]  # none of 0 bytes
    assert j.step == 100  # HF_STEP_DONE


def test_a_launch_without_rows_enqueues_no_kernel(lib):
    drv, j = FakeDriver(), job(n=0, copies=())
    assert lib.cuda_launch(ctypes.byref(drv.c), ctypes.byref(j)) == 0
    assert [c[0] for c in drv.calls] == ["write", "wait"]


@pytest.mark.parametrize(
    ("fail", "step", "enqueued"),
    [
        ("gather", 0, ["gather"]),
        ("write", 1, ["gather", "write"]),
        ("wait", 2, ["gather", "write", "wait"]),
        ("copy162", 5, ["gather", "write", "wait", "copy", "copy"]),  # copy 2 (0xA2; copy 1 has no bytes)
    ],
)
def test_a_failed_step_stops_the_launch_and_is_named(lib, fail, step, enqueued):
    drv, j = FakeDriver(), job()
    drv.fail[fail] = 700
    assert lib.cuda_launch(ctypes.byref(drv.c), ctypes.byref(j)) == 700
    assert j.step == step and [c[0] for c in drv.calls] == enqueued


def test_the_gather_alone_and_a_grid_past_the_limits(lib):
    drv = FakeDriver()
    assert lib.cuda_gather(ctypes.byref(drv.c), ctypes.byref(job(n=5))) == 0
    assert [c[0] for c in drv.calls] == ["gather"] and drv.calls[0][2] == (5, 2, 1)
    assert lib.cuda_gather(ctypes.byref(drv.c), ctypes.byref(job(n=0))) == 0  # no grid of no blocks
    assert len(drv.calls) == 1
    too_wide = job()
    too_wide.row_units = 256 * 65535 + 1  # a grid's y past 65,535 blocks
    assert lib.cuda_gather(ctypes.byref(drv.c), ctypes.byref(too_wide)) == -1
    assert lib.cuda_launch(ctypes.byref(drv.c), ctypes.byref(too_wide)) == -1 and too_wide.step == 0
    assert len(drv.calls) == 1  # nothing more was enqueued


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 16), st.sampled_from([0, 1, 2]), st.integers(0, 2**32 - 1)), max_size=40),
    st.integers(0, 40),
)
def test_the_summary_of_an_answer_counts_as_numpy_does(lib, entries, got):
    """hf_drafts_summary against the reference: of the first ``got`` entries, those with
    drafts, their tokens, and the slots of those the worker lost (status RESYNC), in order."""
    counts, statuses, slots = (np.array([e[k] for e in entries] + [9] * 40, dtype) for k, dtype in
                               enumerate((np.int32, np.int32, np.uint32)))  # fmt: skip
    got = min(got, len(entries))
    out, lost = np.zeros(3, np.uint64), np.full(40, 7, np.uint32)
    lib.drafts_summary(
        counts.ctypes.data, statuses.ctypes.data, slots.ctypes.data, got, out.ctypes.data, lost.ctypes.data
    )
    c, s = counts[:got], statuses[:got]
    want_lost = slots[:got][s == 1].tolist()  # wire.STATUS_RESYNC
    assert out.tolist() == [np.count_nonzero(c), c.sum(), len(want_lost)]
    assert lost[: len(want_lost)].tolist() == want_lost and (lost[len(want_lost) :] == 7).all()


# --------------------------------------------------------------------------- on a GPU


@pytest.fixture
def launcher(lib):
    """A NativeLaunch on a registered region of 4 x 8 slots of 16-byte rows (GPU only)."""
    import types

    import torch

    from remote_dspark.engine.writers import native_launch
    from remote_dspark.shm import layout, memfd, streamsync

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with memfd.Region.create(layout.Layout(4, 8, 16, 3, 64)) as region:
        sync = streamsync.HostFlagSync(region, lib, backend="cuda")
        spec = types.SimpleNamespace(row_bytes=16, depth=4, num_spec=3, sampled=False, device="cuda")
        launch = native_launch.NativeLaunch(lib, sync.backend, region, spec)
        yield launch
        torch.cuda.synchronize()
        launch.close()
        sync.unregister()


def gathered(launch, rows, index, n):
    import torch

    out = torch.full((max(n, 1), 16), 7, dtype=torch.uint8, device="cuda")
    launch.gather(torch.cuda.current_stream().cuda_stream, rows, index, out)
    return out[:n]


@pytest.mark.gpu
def test_the_kernel_equals_index_select_and_zeroes_an_index_outside_the_rows(launcher):
    from remote_dspark.engine.writers import native_launch

    native_launch.self_check(launcher)


@pytest.mark.gpu
def test_the_rows_and_indexes_an_engine_passes_are_gathered_as_their_bytes(launcher):
    import torch

    from remote_dspark.engine.values.batch import as_bytes

    wide = torch.randint(0, 1 << 30, (8, 9), dtype=torch.int32, device="cuda")
    cases = {
        "bf16 rows": torch.randn(8, 8, device="cuda").to(torch.bfloat16),
        "rows a column slice (rows further apart than their bytes)": wide[:, 1:5],
        "rows of three dimensions": torch.randn(8, 2, 2, device="cuda"),
        "rows a column slice at an odd byte": wide.view(torch.uint8)[:, 3:19],
    }
    indexes = {
        "int32": torch.tensor([7, 0, 7], dtype=torch.int32, device="cuda"),
        "int64 on the host": torch.tensor([2, 5, 1]),
        "numpy": np.array([3, 3, 6]),
        "strided": torch.arange(6, device="cuda")[::2],
    }
    for what, rows in cases.items():
        for how, index in indexes.items():
            want = as_bytes(rows)[torch.as_tensor(index).long().cuda()]
            assert torch.equal(gathered(launcher, rows, index, 3), want), (what, how)


@pytest.mark.gpu
def test_rows_or_an_index_it_cannot_take_are_named(launcher):
    import torch

    rows = torch.zeros(8, 4, device="cuda")
    with pytest.raises(ValueError, match=r"rows: on cpu, but the engine's stream is on cuda"):
        gathered(launcher, rows.cpu(), torch.zeros(2, dtype=torch.int64, device="cuda"), 2)
    with pytest.raises(ValueError, match=r"row_index: shape \(2, 1\), expected \[2\]"):
        launcher._rows(rows, torch.zeros(2, 1, dtype=torch.int64, device="cuda"), 2, 0)
    with pytest.raises(ValueError, match=r"row_index: torch.float32, expected integers"):
        launcher._rows(rows, torch.zeros(2, device="cuda"), 2, 0)
    with pytest.raises(ValueError, match="rows: 8 bytes per row, RemoteDSpark was built for row_bytes=16"):
        gathered(launcher, torch.zeros(8, 2, device="cuda"), torch.zeros(2, dtype=torch.int64, device="cuda"), 2)


@pytest.mark.gpu
def test_the_kernel_reaches_rows_past_four_gigabytes(launcher):
    import torch

    launcher._spec.row_bytes = 4096
    rows = torch.zeros((1 << 20) + 16, 4096, dtype=torch.uint8, device="cuda")  # 4.3 GB: offsets past 2^32
    rows[-16:] = torch.randint(0, 256, (16, 4096), dtype=torch.uint8, device="cuda")
    index = torch.arange(rows.shape[0] - 16, rows.shape[0], device="cuda").flip(0)
    out = torch.zeros(16, 4096, dtype=torch.uint8, device="cuda")
    launcher.gather(torch.cuda.current_stream().cuda_stream, rows, index, out)
    assert torch.equal(out, rows[index])
    del rows

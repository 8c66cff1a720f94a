"""``launch()``'s stream work in one C call (:class:`NativeLaunch`): ``hf_cuda_launch``
(``native/cuda_launch.c``) enqueues, on the engine's stream, the gather of the round's
rows into its staging slot (``native/gather.ptx``, loaded once per engine), the store of
``gathered``, the wait for ``released`` and the copies of the answer into the engine's
tensors. Through torch that is five launches (a kernel, two stream memory operations,
two clones), each tens of microseconds of the engine's CPU in Python and torch's
dispatch; here it is one ctypes call of a few driver calls.

The gather's contract is :mod:`.gather`'s, ``out[i] = bytes of rows[row_index[i]]``, and
one thing more: an index outside the rows writes a row of zeros (nothing can make the
stream fault), where ``index_select`` stops the device on an assertion. The engine
builds a :class:`NativeLaunch` once its self-check (:func:`self_check`) finds the kernel
equal to ``index_select``; otherwise ``launch()`` keeps the Python stream work.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from ... import wire
from ...native import CudaIn, LaunchIn
from ...native.binding import SOURCE_DIR
from ...shm import memfd
from ..values.batch import as_bytes

log = logging.getLogger("remote_dspark.engine")

PTX = SOURCE_DIR / "gather.ptx"
STEP_SIGNAL = 1  # HF_STEP_SIGNAL: a failure at a later step leaves the round handed over
_INDEX_DTYPES = {torch.int32: 4, torch.int64: 8}


class LaunchError(RuntimeError):
    """``hf_cuda_launch`` failed; ``handed_over``: its store of ``gathered`` was enqueued
    (the round is the proxy's; only the steps after it failed)."""

    def __init__(self, message: str, handed_over: bool):
        super().__init__(message)
        self.handed_over = handed_over


class NativeLaunch:
    """One engine's ``hf_cuda_launch`` (the engine thread's: one round at a time).

    ``backend``: the engine's :class:`~remote_dspark.shm.streamsync.CudaBackend` (the
    region registered, its driver bound; torch's context current)."""

    def __init__(self, lib, backend, region: memfd.Region, spec):
        self._lib, self._drv, self._spec = lib, backend.driver, spec
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._module = self._drv.module_load(PTX.read_bytes())
        try:
            gathered, released, wake = backend.words()
            self._c = CudaIn(gather=self._drv.module_function(self._module, "hf_gather"), gathered=gathered,
                             released=released, wake=wake, **self._drv.entry_points())  # fmt: skip
        except BaseException:
            self.close()
            raise
        self._c_ref = ctypes.byref(self._c)
        self._job = LaunchIn()
        self._job_ref = ctypes.byref(self._job)
        self._copy = tuple(self._job.copy)  # held: each index of a ctypes array makes a new view
        lay, base = region.layout, backend.device_base
        self._staging = [base + lay.staging(i) for i in range(spec.depth)]
        # Where each depth slot's answer is copied from: tokens, counts, q_ids, q_weights, status.
        self._answer = [
            (d + lay.d_tokens, d + memfd.D_COUNTS, d + lay.d_q_ids, d + lay.d_q_weights, d + memfd.D_STATUS)
            for d in (base + lay.drafts(i) for i in range(spec.depth))
        ]

    def close(self) -> None:
        """Unload the kernel (idempotent): once the stream has finished with it."""
        module, self._module = getattr(self, "_module", 0), 0
        if module:
            self._drv.module_unload(module)

    def launch(
        self, stream: int, r: int, batch, with_rows: bool, out: tuple[torch.Tensor, ...] = (), status=None
    ) -> None:
        """Enqueue round ``r``'s stream work on ``stream`` (its descriptor written): the
        gather of ``batch``'s rows when ``with_rows``, ``gathered``, the wait, and the
        copies of the answer's first ``len(batch)`` entries into ``out`` (shaped as
        ``drafts.round_tensors`` makes them, contiguous; none: no copy) and of the round's outcome
        into ``status`` (an int32 on the device, when given).

        Raises:
            ValueError: rows or an index this call cannot take (their device, shape or
                size, named); nothing was enqueued.
            LaunchError: a driver call failed (its step and error named).
        """
        job, n = self._job, len(batch)
        i = r & (self._spec.depth - 1)
        job.stream, job.round, job.n = stream, r, 0
        if with_rows:
            self._rows(batch.rows, batch.row_index, n, self._staging[i])
        self._copies(i, n, out, status)
        rc = self._lib.cuda_launch(self._c_ref, self._job_ref)
        if rc:
            step = job.step
            raise LaunchError(
                f"hf_cuda_launch: {_STEPS.get(step, 'a copy')} failed: {self._error(rc)}", step > STEP_SIGNAL
            )

    def gather(self, stream: int, rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        """The gather alone, into ``out`` (a device tensor of room for the rows): the
        self-check's and the tests' way to hold the kernel to ``index_select``.

        Raises:
            ValueError, LaunchError: as :meth:`launch`.
        """
        n = len(index) if getattr(index, "ndim", 1) == 1 else -1
        if out.numel() * out.element_size() < max(n, 0) * self._spec.row_bytes:
            raise ValueError(f"out: {out.numel() * out.element_size()} bytes, too small for {n} rows")
        self._job.stream = stream
        self._rows(rows, index, n, out.data_ptr())
        rc = self._lib.cuda_gather(self._c_ref, self._job_ref)
        if rc:
            raise LaunchError(f"hf_cuda_gather: {self._error(rc)}", False)

    def _error(self, rc: int) -> str:
        return "a grid past the driver's limits" if rc < 0 else f"{self._drv.error_name(rc)} ({rc})"

    def _rows(self, rows, index, n: int, dst: int) -> None:
        """The gather's part of the call: ``rows`` as rows of ``row_bytes`` bytes on the
        engine's device, gathered by ``index`` ([n] int32 or int64 there) into ``dst``."""
        row_bytes = self._spec.row_bytes
        if not isinstance(rows, torch.Tensor) or rows.device != self._device:
            raise ValueError(
                f"rows: on {getattr(rows, 'device', 'the host')}, but the engine's stream is on {self._device}"
            )
        if rows.dim() != 2 or rows.stride(1) != 1 or rows.is_neg() or rows.is_conj():
            rows = as_bytes(rows.resolve_neg().resolve_conj(), row_bytes)  # a contiguous copy where it must
        size = rows.element_size()
        if rows.shape[1] * size != row_bytes:
            as_bytes(rows, row_bytes)  # raises, naming the sizes
        if not isinstance(index, torch.Tensor) or index.device != self._device or index.dtype not in _INDEX_DTYPES:
            index = torch.as_tensor(index, device=self._device)
            if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
                raise ValueError(f"row_index: {index.dtype}, expected integers")
            index = index.to(torch.int64)
        if index.shape != (n,):
            raise ValueError(f"row_index: shape {tuple(index.shape)}, expected [{n}]")
        if not index.is_contiguous():
            index = index.contiguous()
        job, src, stride = self._job, rows.data_ptr(), rows.stride(0) * size
        unit = 4 if row_bytes % 4 == 0 and stride % 4 == 0 and src % 4 == 0 and dst % 4 == 0 else 1
        job.src, job.index, job.dst, job.n = src, index.data_ptr(), dst, n
        job.src_stride, job.row_units, job.src_rows = stride // unit, row_bytes // unit, rows.shape[0]
        job.index_bytes, job.unit_bytes = _INDEX_DTYPES[index.dtype], unit

    def _copies(self, i: int, n: int, out: tuple[torch.Tensor, ...], status) -> None:
        c, (tokens, counts, q_ids, q_weights, outcome), k = self._copy, self._answer[i], self._spec.num_spec
        m = 0
        if out:
            c0, c1 = c[0], c[1]
            c0.dst, c0.src, c0.bytes = out[0].data_ptr(), tokens, 4 * n * k
            c1.dst, c1.src, c1.bytes = out[1].data_ptr(), counts, 4 * n
            m = 2
        if len(out) == 4:
            q, c2, c3 = n * k * wire.SAMPLED_TOP, c[2], c[3]
            c2.dst, c2.src, c2.bytes = out[2].data_ptr(), q_ids, 4 * q
            c3.dst, c3.src, c3.bytes = out[3].data_ptr(), q_weights, 2 * q
            m = 4
        if status is not None:
            cm = c[m]
            cm.dst, cm.src, cm.bytes = status.data_ptr(), outcome, 4
            m += 1
        self._job.n_copies = m


def self_check(launch: NativeLaunch, rows: int = 97) -> None:
    """The kernel against ``index_select`` on the current stream: rows of the engine's
    size in three dtypes (4-byte words and, for an odd start, bytes), int32 and int64
    indexes of 0, 1 and ``rows`` entries, repeats included; and an index outside the rows
    (negative, or past them) writes zeros.

    Raises:
        RuntimeError: naming the case whose bytes differ.
    """
    row_bytes = launch._spec.row_bytes
    if not row_bytes:
        return
    g = torch.Generator().manual_seed(5)
    stream = torch.cuda.current_stream()
    dev = launch._device
    raw = torch.randint(0, 256, (rows, row_bytes + 1), dtype=torch.uint8, generator=g).to(dev)
    cases = [("uint8 rows at an odd address", raw[:, 1:])]
    if row_bytes % 4 == 0:
        cases += [(f"{dt} rows", raw[:, :row_bytes].contiguous().view(dt)) for dt in (torch.int32, torch.bfloat16)]
    for what, src in cases:
        for n in (0, 1, rows):
            for dtype in _INDEX_DTYPES:
                index = torch.randint(0, rows, (n,), generator=g, dtype=dtype).to(dev)
                want = torch.index_select(as_bytes(src), 0, index.to(torch.int64)) if n else None
                got = torch.full((max(n, 1), row_bytes), 7, dtype=torch.uint8, device=dev)
                launch.gather(stream.cuda_stream, src, index, got)
                if n and not torch.equal(got, want):
                    raise RuntimeError(f"the native gather differs from index_select: {what}, {n} rows, {dtype} index")
    index = torch.tensor([-1, rows, 0], dtype=torch.int64, device=dev)
    got = torch.full((3, row_bytes), 7, dtype=torch.uint8, device=dev)
    launch.gather(stream.cuda_stream, cases[0][1], index, got)
    if got[:2].any() or not torch.equal(got[2], as_bytes(cases[0][1])[0]):
        raise RuntimeError("the native gather does not write zeros for an index outside the rows")


_STEPS = {0: "the gather", 1: "the store of gathered", 2: "the wait for released"}


def choose(setting: bool | None, lib, backend, region: memfd.Region, spec) -> NativeLaunch | None:
    """The native launch for an engine on CUDA under ``VLLM_DSPARK_REMOTE_FUSED_GATHER``
    (None: auto): its gather is a fused one-launch gather, so ``0`` (torch's
    ``index_select``) keeps the Python stream work, as does a CPU engine. Otherwise it is
    built and held to :func:`self_check`; a failure is one warning, and ``launch()`` then
    enqueues its stream work through torch (with the Triton gather, which ``1`` then
    requires)."""
    if setting is False or spec.device != "cuda":
        return None
    launch = None
    try:
        launch = NativeLaunch(lib, backend, region, spec)
        self_check(launch)
    except Exception as e:
        log.warning("native launch off (%s); launch() enqueues its stream work through torch", e)
        if launch is not None:
            launch.close()
        return None
    return launch

"""The few CUDA driver calls the GPU hand-off needs, through ctypes on ``libcuda.so.1``.

Host registration of the region (``cuMemHostRegister``: portable, mapped), its device
address (``cuMemHostGetDevicePointer``), and the stream memory operations
(``cuStreamWriteValue32`` / ``cuStreamWaitValue32``, the ``_v2`` entry points where the
driver has them). The calls act on the calling thread's current context: torch's
primary context, made current by any CUDA work torch did on this thread first.

The engine's native launch (``native/cuda_launch.c``) calls the driver from C: this
module loads its gather kernel (``cuModuleLoadData`` of ``native/gather.ptx``) and hands
it the entry points' addresses (``entry_points``), so the library itself links no CUDA.

Also timing events (``cuEventCreate`` / ``Record`` / ``Synchronize`` / ``ElapsedTime``)
for the benchmarks: torch's ``Event.record`` releases the GIL, so under a GIL-hogging
thread each record costs a switch interval; these keep it.

Nothing here imports torch; the stream is passed as its raw handle
(``torch.cuda.current_stream().cuda_stream``).
"""

from __future__ import annotations

import ctypes
from ctypes import c_int, c_size_t, c_uint, c_uint32, c_uint64, c_void_p

CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
CU_STREAM_WAIT_VALUE_GEQ = 0x0  # (int32_t)(*addr - value) >= 0: cyclic, like the ring
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # with a memory barrier before the write


class CudaError(RuntimeError):
    """A driver call failed; the message names the call and the driver's error."""


class Driver:
    """Bound driver entry points. Raises CudaError at construction without a driver."""

    def __init__(self, path: str = "libcuda.so.1"):
        try:
            # PyDLL: the calls keep the GIL. They only enqueue (microseconds); releasing
            # and re-taking the GIL around each would cost an engine thread a switch
            # interval per call whenever another Python thread is busy.
            self._lib = ctypes.PyDLL(path)
        except OSError as e:
            raise CudaError(f"no CUDA driver ({path}): {e}") from e
        self._register = self._bind(("cuMemHostRegister_v2", "cuMemHostRegister"), c_void_p, c_size_t, c_uint)
        self._unregister = self._bind(("cuMemHostUnregister",), c_void_p)
        self._devptr = self._bind(
            ("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"), ctypes.POINTER(c_uint64), c_void_p, c_uint
        )
        self._write32 = self._bind(
            ("cuStreamWriteValue32_v2", "cuStreamWriteValue32"), c_void_p, c_uint64, c_uint32, c_uint
        )
        self._wait32 = self._bind(
            ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"), c_void_p, c_uint64, c_uint32, c_uint
        )
        self._name = self._bind(("cuGetErrorName",), c_int, ctypes.POINTER(ctypes.c_char_p))
        self._launch = self._bind(
            ("cuLaunchKernel",), c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p, c_void_p,
            c_void_p,
        )  # fmt: skip
        self._memcpy = self._bind(("cuMemcpyAsync",), c_uint64, c_uint64, c_size_t, c_void_p)
        self._mod_load = self._bind(("cuModuleLoadData",), ctypes.POINTER(c_void_p), ctypes.c_char_p)
        self._mod_function = self._bind(("cuModuleGetFunction",), ctypes.POINTER(c_void_p), c_void_p, ctypes.c_char_p)
        self._mod_unload = self._bind(("cuModuleUnload",), c_void_p)
        self._ev_create = self._bind(("cuEventCreate",), ctypes.POINTER(c_void_p), c_uint)
        self._ev_record = self._bind(("cuEventRecord",), c_void_p, c_void_p)
        self._ev_sync = self._bind(("cuEventSynchronize",), c_void_p)
        self._ev_elapsed = self._bind(
            ("cuEventElapsedTime_v2", "cuEventElapsedTime"), ctypes.POINTER(ctypes.c_float), c_void_p, c_void_p
        )
        self._ev_destroy = self._bind(("cuEventDestroy_v2", "cuEventDestroy"), c_void_p)

    def _bind(self, names: tuple[str, ...], *argtypes):
        for name in names:
            fn = getattr(self._lib, name, None)
            if fn is not None:
                fn.restype = c_int
                fn.argtypes = argtypes
                fn.name_ = name
                return fn
        raise CudaError(f"the CUDA driver has none of {names}")

    def error_name(self, rc: int) -> str:
        """The driver's name of error ``rc`` (``CUDA_ERROR_...``)."""
        name = ctypes.c_char_p()
        self._name(rc, ctypes.byref(name))
        return name.value.decode() if name.value else "CUDA error"

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise CudaError(f"{what}: {self.error_name(rc)} ({rc})")

    def host_register(self, addr: int, size: int) -> int:
        """Pin and map ``size`` bytes at ``addr``; returns their device address."""
        self._check(
            self._register(addr, size, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP),
            f"cuMemHostRegister({size} bytes)",
        )
        dptr = c_uint64()
        try:
            self._check(self._devptr(ctypes.byref(dptr), addr, 0), "cuMemHostGetDevicePointer")
        except CudaError:
            self._unregister(addr)
            raise
        return dptr.value

    def host_unregister(self, addr: int) -> None:
        self._check(self._unregister(addr), "cuMemHostUnregister")

    def write_value32(self, stream: int, dptr: int, value: int) -> None:
        self._check(
            self._write32(stream, dptr, value & 0xFFFFFFFF, CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32"
        )

    def wait_value32(self, stream: int, dptr: int, value: int) -> None:
        self._check(self._wait32(stream, dptr, value & 0xFFFFFFFF, CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")

    # ------------------------------------------------------------------ the native launch

    def entry_points(self) -> dict[str, int]:
        """The addresses of the entry points ``hf_cuda_launch`` calls (``struct hf_cuda``'s
        names), the same ones this object binds."""
        address = lambda fn: ctypes.cast(fn, c_void_p).value  # noqa: E731
        return {
            "launch_kernel": address(self._launch),
            "write_value32": address(self._write32),
            "wait_value32": address(self._wait32),
            "memcpy_async": address(self._memcpy),
        }

    def module_load(self, image: bytes) -> int:
        """A module of the current context from ``image`` (PTX, NUL-terminated here: the
        driver compiles it for the device); ``module_unload`` it."""
        module = c_void_p()
        self._check(self._mod_load(ctypes.byref(module), image.rstrip(b"\0") + b"\0"), "cuModuleLoadData")
        return module.value

    def module_function(self, module: int, name: str) -> int:
        fn = c_void_p()
        self._check(self._mod_function(ctypes.byref(fn), module, name.encode()), f"cuModuleGetFunction({name})")
        return fn.value

    def module_unload(self, module: int) -> None:
        self._check(self._mod_unload(module), "cuModuleUnload")

    # ------------------------------------------------------------------ timing events

    def event_create(self) -> int:
        """A timing event (default flags) of the current context; ``event_destroy`` it."""
        ev = c_void_p()
        self._check(self._ev_create(ctypes.byref(ev), 0), "cuEventCreate")
        return ev.value

    def event_record(self, event: int, stream: int) -> None:
        self._check(self._ev_record(event, stream), "cuEventRecord")

    def event_synchronize(self, event: int) -> None:
        """Wait (GIL kept: a benchmark's own wait) until ``event`` has happened."""
        self._check(self._ev_sync(event), "cuEventSynchronize")

    def event_elapsed_ns(self, start: int, stop: int) -> int:
        ms = ctypes.c_float()
        self._check(self._ev_elapsed(ctypes.byref(ms), start, stop), "cuEventElapsedTime")
        return int(ms.value * 1e6)

    def event_destroy(self, event: int) -> None:
        self._check(self._ev_destroy(event), "cuEventDestroy")

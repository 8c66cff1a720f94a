"""``streamsync``: the engine stream's side of the hand-off.

The engine's stream writes ``gathered = r`` once round r's rows are in staging, then
waits for ``released >= r`` before it uses the drafts. On a GPU both are stream memory
operations on the registered region (a later backend); here, with no GPU, the CPU
backend does both from the engine thread through the native library: a release store,
then a wait inside C with the GIL released (``ASYNC_SPIN_US`` of spinning, then a sleep
on the ``released`` futex that every releaser wakes, or, with ``ASYNC_NAP_US`` > 0, naps
between looks), so the proxy never needs this process's GIL and this thread's wait costs
no other thread its turn nor a core (after an optional short spin that keeps the GIL,
``hold_gil_us``).

A backend is two operations, ``signal(round)`` (how ``gathered`` is written) and
``wait(round, deadline_ns)`` (how ``released`` is awaited), plus ``handoff`` (both, timed
from the store of ``gathered`` to the observed ``released``), made by
``Backend(region, lib, spin_us, nap_us, hold_gil_us)``. A CUDA backend swaps those three
and nothing else.

torch is not imported here (nor by anything this module imports).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

from .. import native
from ..native import Status, check
from . import layout, memfd


def current_stream(torch) -> int:
    """The current CUDA stream of the current device as a handle (an int), as
    ``torch.cuda.current_stream().cuda_stream`` gives it but without building a ``Stream``
    object (10 to 20 us of a round's CPU on the H200 host): torch's raw lookup, the one
    Triton's launcher uses; the public call where this torch lacks it. CUDA is
    initialized (the engine started)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream().cuda_stream
    return raw(torch._C._cuda_getDevice())


class HandoffTimes(NamedTuple):
    """One hand-off. Timestamps are CLOCK_MONOTONIC ns taken by the backend (in C on the
    CPU): the store of ``gathered`` and the first look that saw ``released >= round``."""

    ok: bool  # False: the deadline passed first
    gathered_ns: int
    released_ns: int

    @property
    def latency_ns(self) -> int:
        return self.released_ns - self.gathered_ns


class CpuBackend:
    """The CPU stand-in for the stream: the calling thread stores and waits.

    With ``hold_gil_us`` > 0 a wait first spins that long keeping the GIL, then goes on
    with it released (see ``HostFlagSync``)."""

    def __init__(self, region: memfd.Region, lib: native.Native, spin_us: int, nap_us: int, hold_gil_us: int):
        lay = region.layout
        self._lib = lib
        self._gathered = region.addr(lay.gathered)
        self._released = region.addr(lay.released)
        self._waiters = region.addr(lay.waiters)
        self._gathered_ns = region.addr(lay.gathered_ns(0))
        self._wake = region.addr(lay.wake)
        self._mask = lay.depth - 1
        self._spin, self._nap = spin_us, nap_us
        self._hold_ns = hold_gil_us * 1000
        self._out = (ctypes.c_uint64 * 2)()
        self._out_addr = ctypes.addressof(self._out)

    def _held_until(self, deadline_ns: int) -> int:
        return min(deadline_ns, self._lib.now_ns() + self._hold_ns)

    def signal(self, round_id: int) -> None:
        self._lib.signal(self._gathered, self._gathered_ns + 8 * (round_id & self._mask), round_id, self._wake)

    def wait(self, round_id: int, deadline_ns: int, hold: bool = True) -> bool:
        lib, rc = self._lib, Status.TIMEOUT
        if self._hold_ns and hold:
            rc = lib.wait_geq_holding(self._released, round_id, self._spin, 0, self._held_until(deadline_ns))
        if rc == Status.TIMEOUT:
            rc = lib.wait_released(self._released, self._waiters, round_id, self._spin, self._nap, deadline_ns)
        return rc == Status.OK or check(rc, f"wait for round {round_id}") is Status.OK

    def handoff(self, round_id: int, deadline_ns: int) -> HandoffTimes:
        lib, out = self._lib, self._out_addr
        stamp = self._gathered_ns + 8 * (round_id & self._mask)
        if self._hold_ns:
            rc = lib.handoff_holding(
                self._gathered,
                stamp,
                self._released,
                None,  # holding the GIL: spin only, never sleep
                round_id,
                self._spin,
                0,
                self._held_until(deadline_ns),
                out,
                self._wake,
            )
            if rc == Status.TIMEOUT:  # go on waiting with the GIL released
                rc = lib.wait_at(self._released, self._waiters, round_id, self._spin, self._nap, deadline_ns, out + 8)
        else:
            rc = lib.handoff(
                self._gathered,
                stamp,
                self._released,
                self._waiters,
                round_id,
                self._spin,
                self._nap,
                deadline_ns,
                out,
                self._wake,
            )
        return HandoffTimes(check(rc, f"hand off round {round_id}") is Status.OK, self._out[0], self._out[1])


class CudaBackend:
    """The engine's CUDA stream writes ``gathered`` and waits for ``released`` itself
    (stream memory operations on the registered region); the engine's CPU thread only
    enqueues them and never waits. The proxy makes no CUDA call: it sees plain memory.

    The whole region is registered (portable, mapped) at construction and unregistered
    by ``region.close`` (a close hook), after the caller has let the stream finish.
    Construction runs a self-test on the current stream: the stream writes a probe
    word, this thread answers it, the stream waits for the answer. A failure raises
    (the engine then falls back to synchronous rounds) and never leaves the stream
    parked: the answer is written whatever happened.

    What a CUDA graph can hold: the gather and the two stream memory operations are
    capturable (the round id is then fixed at capture, so a graph replays one round id:
    it must be re-captured or the ids driven through a device-side counter). The CPU
    parts of a round (reserving it, writing its descriptor) are not in the stream and
    cannot be captured.
    """

    SELF_TEST_S = 5.0

    def __init__(self, region: memfd.Region, lib: native.Native, spin_us: int, nap_us: int, hold_gil_us: int):
        import torch

        from .cuda_driver import Driver

        self._torch = torch
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # makes torch's primary context current here
        self.driver = Driver()
        self._lib = lib
        self._region = region
        self._host = region.base
        self.device_base = self.driver.host_register(self._host, region.layout.size)
        region.add_close_hook(self.unregister)
        lay = region.layout
        self._gathered = self.device_base + lay.gathered
        self._released = self.device_base + lay.released
        self._wake = region.addr(lay.wake)
        self._self_test()

    def words(self) -> tuple[int, int, int]:
        """The device addresses of ``gathered`` and ``released`` and this process's of
        the announce word (for the native launch, which stores and waits on them)."""
        return self._gathered, self._released, self._wake

    def _stream(self) -> int:
        return current_stream(self._torch)

    def _self_test(self) -> None:
        lay, lib = self._region.layout, self._lib
        probe, ack = lay.words_at + layout.W_PROBE, lay.words_at + layout.W_PROBE_ACK
        token = (lib.load32(self._region.addr(probe)) + 1) & 0xFFFFFFFF or 1
        stream = self._torch.cuda.current_stream()
        self.driver.write_value32(stream.cuda_stream, self.device_base + probe, token)
        self.driver.wait_value32(stream.cuda_stream, self.device_base + ack, token)
        done = self._torch.cuda.Event()
        done.record(stream)
        seen = lib.wait_geq(self._region.addr(probe), token, 100, 100, native.deadline_ns(self.SELF_TEST_S))
        lib.store32(self._region.addr(ack), token)  # always: the stream must not stay parked
        done.synchronize()
        if seen != Status.OK:
            raise RuntimeError("CUDA hand-off self-test: the stream's write never reached host memory")

    def device_view(self, offset: int, shape: tuple[int, ...], dtype):
        """A CUDA tensor aliasing ``shape`` of the registered region at ``offset``
        (uint16, which the array interface may not map to torch, is viewed through int16)."""
        torch = self._torch
        if dtype == torch.uint16:
            return self.device_view(offset, shape, torch.int16).view(torch.uint16)
        typestr = {torch.uint8: "|u1", torch.int16: "<i2", torch.int32: "<i4", torch.float32: "<f4"}[dtype]

        class _Mapped:  # __cuda_array_interface__ v3: a view, not a copy
            __cuda_array_interface__ = {
                "shape": shape,
                "typestr": typestr,
                "version": 3,
                "data": (self.device_base + offset, False),
                "strides": None,
            }

        return torch.as_tensor(_Mapped(), device="cuda")

    def wait_word(self, offset: int, value: int) -> None:
        """Enqueue a wait until the region's 32-bit word at ``offset`` is >= ``value``
        (cyclic). For benchmarks that hold the stream until a whole sequence is queued."""
        self.driver.wait_value32(self._stream(), self.device_base + offset, value)

    def signal(self, round_id: int, stream: int | None = None) -> None:
        """Announce the round from the CPU (a sleeping proxy wakes and spins until the
        stream gets there), then enqueue the stream's store of ``gathered``."""
        self._lib.announce(self._wake, round_id)
        self.driver.write_value32(self._stream() if stream is None else stream, self._gathered, round_id)

    def wait(self, round_id: int, deadline_ns: int, stream: int | None = None) -> bool:
        """Enqueue the stream's wait; the native watchdog bounds it (no deadline here)."""
        self.driver.wait_value32(self._stream() if stream is None else stream, self._released, round_id)
        return True

    def handoff(self, round_id: int, deadline_ns: int) -> HandoffTimes:
        raise NotImplementedError("the CUDA backend times hand-offs with CUDA events (bench handoff --device cuda)")

    def unregister(self) -> None:
        """Unpin the region (idempotent). The region's close runs it too, but the engine
        calls it at close from its own thread, where torch's context is current."""
        if self._host:
            host, self._host = self._host, 0
            self.driver.host_unregister(host)


BACKENDS = {"cpu": CpuBackend, "cuda": CudaBackend}


class HostFlagSync:
    """Hand rounds to the proxy through the region's ``gathered``/``released`` words.

    ``spin_us``/``nap_us`` shape the CPU wait as VLLM_DSPARK_REMOTE_ASYNC_SPIN_US and
    _NAP_US do the proxy's: spin ``spin_us``, then nap ``nap_us`` between looks, or, with
    nap_us 0, sleep on the ``released`` futex until a releaser wakes it.

    ``hold_gil_us`` (CPU backend): spin that long keeping the GIL before releasing it for
    the rest of the wait. Only for a proxy in another process, whose answer never needs
    this process's GIL: releasing the GIL for a hand-off of a few microseconds wakes a
    thread that waits for it, which, on a machine with fewer cores than busy threads, can
    then take this thread's core for a whole scheduler time slice (milliseconds; see the
    hand-off benchmark). Keep 0 when the proxy is a thread of this process: it needs the
    GIL to answer.

    Raises (at construction):
        ValueError: an unknown backend, or a negative hold.
    """

    def __init__(
        self,
        region: memfd.Region,
        lib: native.Native,
        *,
        backend: str = "cpu",
        spin_us: int = 1000,
        nap_us: int = 0,
        hold_gil_us: int = 0,
    ):
        try:
            make = BACKENDS[backend]
        except KeyError:
            raise ValueError(f"backend={backend!r}: expected one of {sorted(BACKENDS)}") from None
        if hold_gil_us < 0:
            raise ValueError(f"hold_gil_us={hold_gil_us}: must be >= 0")
        self.backend = make(region, lib, spin_us, nap_us, hold_gil_us)

    def signal(self, round_id: int, stream: int | None = None) -> None:
        """Round ``round_id``'s rows are in staging: publish ``gathered``. ``stream``: the
        CUDA stream's raw handle when the caller has it (default: the current stream)."""
        if stream is None:
            self.backend.signal(round_id)
        else:
            self.backend.signal(round_id, stream)

    def wait(self, round_id: int, timeout_s: float, stream: int | None = None, *, hold: bool = True) -> bool:
        """Wait until ``released >= round_id``; False at the deadline. On CUDA the wait is
        enqueued on ``stream`` (default: the current stream) and this returns at once.
        ``hold=False`` (the CPU backend's only) skips the spin holding the GIL: the caller
        has spun it."""
        if not hold:
            return self.backend.wait(round_id, native.deadline_ns(timeout_s), hold=False)
        if stream is None:
            return self.backend.wait(round_id, native.deadline_ns(timeout_s))
        return self.backend.wait(round_id, native.deadline_ns(timeout_s), stream)

    def unregister(self) -> None:
        """CUDA: unpin the region now (idempotent); nothing on the CPU."""
        unregister = getattr(self.backend, "unregister", None)
        if unregister is not None:
            unregister()

    def handoff(self, round_id: int, timeout_s: float) -> HandoffTimes:
        """``signal`` then ``wait``, timed by the backend."""
        return self.backend.handoff(round_id, native.deadline_ns(timeout_s))

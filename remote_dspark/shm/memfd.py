"""``shm``: the memfd region the engine and its proxy process share.

One memfd, created and pre-faulted by the engine (its pages are charged to the engine
and are real before any CUDA registration), sealed against shrinking and growing,
mapped shared by the engine and, through a descriptor passed with ``pass_fds``, by the
proxy. Its byte layout (``Layout`` and the offset tables, with the writer of every
word) is :mod:`~remote_dspark.shm.layout`; the header words and counters blocks, as a
process reads and writes them, are :mod:`~remote_dspark.shm.words`.

Invariants: the file's size equals ``Layout.size`` (sealed); the header's creator
fields never change after ``create``.

This module imports only the standard library (the proxy is torch- and numpy-free).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
from collections.abc import Callable

# Besides what Region uses: the parts the engine side (engine, ring, proxy loop) names as
# ``memfd.X`` (D_*, DESC_*, DRAFTS_*, LATENCY_BOUNDS_NS, OFF_HEARTBEAT, BreakerState, HistogramWords).
from .layout import (  # noqa: F401
    D_COUNTS,
    D_N,
    D_ROUND,
    D_STATUS,
    DESC_FIXED,
    DESC_PENDING,
    DESC_ROUND,
    DRAFTS_HEAD,
    DRAFTS_MARGINS,
    DRAFTS_SAMPLED,
    ENGINE_COUNTERS,
    HEADER,
    LATENCY_BOUNDS_NS,
    LAYOUT_VERSION,
    MAGIC,
    OFF_ENGINE_PID,
    OFF_HEARTBEAT,
    OPT_SAMPLED,
    PROXY_COUNTERS,
    Layout,
)
from .words import BreakerState, Counters, HeaderWords, HistogramWords  # noqa: F401

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


class Region:
    """The mapped region. ``create`` in the engine, ``attach`` in the proxy.

    Invariants: while open, ``base`` is the mapping's address in this process and
    ``fd`` the memfd (close-on-exec: a child gets it only through ``pass_fds``); after
    ``close`` the fd is closed, ``base`` is 0, the close hooks (e.g. the watchdog's
    stop) have run in the process that mapped it, and the mapping is unmapped, or, while
    views of it are alive, is unmapped when the last of them goes (see ``close``).
    """

    # Class-level sentinels: close() works on a half-built or closed Region.
    _fd = -1
    _mm: mmap.mmap | None = None
    _buf: memoryview | None = None
    _hooks: list[Callable[[], None]] | tuple = ()
    base = 0
    _pid = 0  # the process that mapped it: its close hooks are that process's
    layout: Layout

    @classmethod
    def create(cls, layout: Layout, name: str = "remote-dspark") -> Region:
        """Make, size, seal, map and pre-fault a new region; write its header.

        Raises:
            OSError: the kernel refused (no memfd, no memory).
        """
        self = cls()
        try:
            self._fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(self._fd, layout.size)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, SEALS)
            self._map(self._fd, layout)
            self._prefault()
            self._mm[0 : HEADER.size] = layout.header_bytes()
            struct.pack_into("<I", self._mm, OFF_ENGINE_PID, os.getpid())
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def attach(cls, fd: int) -> Region:
        """Map a region created by another process and check it. On success the Region
        owns ``fd`` (made close-on-exec again); on failure the caller still does.

        Raises:
            ValueError: not a region of this layout version, or its size does not match
                its header, naming what mismatched.
        """
        self = cls()
        try:
            layout = _check_file(fd)
            self._map(fd, layout)
            if self._mm[0 : HEADER.size] != layout.header_bytes():
                raise ValueError(f"region fd {fd}: header changed while attaching")
        except BaseException:
            self.close()
            raise
        os.set_inheritable(fd, False)
        self._fd = fd
        return self

    def _map(self, fd: int, layout: Layout) -> None:
        self.layout = layout
        self._mm = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._buf = memoryview(self._mm)
        # The address only: the ctypes object (an export of the mapping) dies at once.
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._hooks = []
        self._pid = os.getpid()

    def _prefault(self) -> None:
        try:
            self._mm.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):  # older kernel: touch every page instead
            for off in range(0, len(self._mm), self.layout.page_size):
                self._mm[off] = 0

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def closed(self) -> bool:
        return self._mm is None

    def addr(self, offset: int) -> int:
        """This process's address of byte ``offset`` (for the native library)."""
        if self._buf is None:
            raise ValueError("region is closed")
        return self.base + offset

    def view(self, offset: int, size: int) -> memoryview:
        """A writable view of ``size`` bytes at ``offset``. It keeps the mapping (not the
        region) alive: a view that outlives ``close`` reads and writes memory nobody
        else uses, and the mapping goes with the last view."""
        if self._buf is None:
            raise ValueError("region is closed")
        return self._buf[offset : offset + size]

    def descriptor(self, index: int) -> memoryview:
        return self.view(self.layout.desc(index), self.layout.desc_stride)

    def staging(self, index: int) -> memoryview:
        return self.view(self.layout.staging(index), self.layout.max_slots * self.layout.row_bytes)

    def drafts(self, index: int) -> memoryview:
        return self.view(self.layout.drafts(index), self.layout.drafts_stride)

    def proxy_counters(self, lib) -> Counters:
        return Counters(self, lib, PROXY_COUNTERS, self.layout.proxy_counters_at)

    def engine_counters(self, lib) -> Counters:
        return Counters(self, lib, ENGINE_COUNTERS, self.layout.engine_counters_at)

    def header_words(self, lib) -> HeaderWords:
        return HeaderWords(self, lib)

    def add_close_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` first thing in ``close`` (stop whatever uses the mapping)."""
        self._hooks.append(hook)

    def close(self) -> None:
        """Run the close hooks, unmap, close the fd. Idempotent; never raises for views.

        Views of the region still alive (a round's exception, whose traceback's frames
        hold them, while it propagates; a caller's array) keep the mapping, and the
        mmap's own duplicate of the fd, until the last of them goes: the mmap object
        then dies and unmaps. Nothing that addresses the region by its ``base`` may be
        left by then (the engine's ``lifecycle.Users`` frees the region only once its
        last user is out); ``base`` and every view method refuse from here on.

        In a forked child (not the process that mapped it) the hooks are dropped, not
        run: they stop threads and registrations of the parent, which fork did not copy
        (joining one would wait for good); only the child's own copies of the fd and
        the mapping are closed.
        """
        hooks, self._hooks = list(self._hooks), []
        if self._pid == os.getpid():
            for hook in reversed(hooks):
                hook()
        buf, self._buf = self._buf, None
        if buf is not None:
            try:
                buf.release()
            except BufferError:
                pass  # an export of the whole view is alive: it goes with the mapping, below
        mm, self._mm = self._mm, None
        self.base = 0
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views alive: the mapping goes with the last of them (the mmap object's end)
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _check_file(fd: int) -> Layout:
    """The layout a region file's header describes, checked against the file."""
    size = os.fstat(fd).st_size
    if size < HEADER.size:
        raise ValueError(f"region fd {fd}: {size} bytes, too small for a header")
    head = os.pread(fd, HEADER.size, 0)
    magic, version, page, depth, slots, row, spec, tokens, options, total = HEADER.unpack(head)
    if magic != MAGIC:
        raise ValueError(f"region fd {fd}: magic {magic!r}, expected {MAGIC!r}")
    if version != LAYOUT_VERSION:
        raise ValueError(f"region fd {fd}: layout version {version}, this side reads version {LAYOUT_VERSION}")
    if page != mmap.PAGESIZE:
        raise ValueError(f"region fd {fd}: page size {page}, this process has {mmap.PAGESIZE}")
    if options & ~OPT_SAMPLED:
        raise ValueError(f"region fd {fd}: header options {options:#x}, this side knows only sampled ({OPT_SAMPLED})")
    try:
        layout = Layout(depth, slots, row, spec, tokens, page, sampled=bool(options & OPT_SAMPLED))
    except ValueError as e:
        raise ValueError(f"region fd {fd}: header sizes refused: {e}") from e
    if total != layout.size:
        raise ValueError(f"region fd {fd}: header total_size {total}, its sizes need {layout.size}")
    if size != layout.size:
        raise ValueError(f"region fd {fd}: file size {size} bytes, its header's layout needs {layout.size}")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SEALS != SEALS:
        raise ValueError(f"region fd {fd}: seals {seals:#x}, expected shrink, grow and seal")
    return layout

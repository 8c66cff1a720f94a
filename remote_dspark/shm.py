"""``shm``: the memfd region the engine and its proxy process share.

One memfd, created and pre-faulted by the engine (its pages are charged to the engine
and are real before any CUDA registration), sealed against shrinking and growing,
mapped shared by the engine and, through a descriptor passed with ``pass_fds``, by the
proxy. The layout is computed in one place (``Layout``) from five sizes: ``depth`` (D,
rounds in flight, a power of two), ``max_slots`` (S, entries per round), ``row_bytes``
(R), ``num_spec`` (K, draft tokens per entry) and ``max_tokens`` (T, the token block of
one round). P is the page size, L = 128 (a line: no two writers share one).

Region (offsets in bytes)::

    offset                  size            part
    0                       P               header page
    P                       P               hand-off words page
    2P                      D x desc        descriptor ring, desc = align(8 + M(S) + 4 (T + 1), L),
                                            M(n) = wire.round_meta_bytes(n) = 20 + 20 n
    staging_at (P-aligned)  D x stage       staging rows, stage = align(S R, P): each depth
                                            slot page-aligned (registered with CUDA later)
    drafts_at               D x drafts      drafts slots (see below)
    proxy_counters_at       PROXY_BLOCK     written by the proxy only
    engine_counters_at      ENGINE_BLOCK    written by the engine side only
    size = align(end, P)

Header page (all little-endian)::

    offset size field                 writer
    0x000  8    magic b"DSPKSHM1"     creator, before any other process maps the region
    0x008  4    layout_version        creator
    0x00c  4    page_size             creator
    0x010  4    depth                 creator
    0x014  4    max_slots             creator
    0x018  4    row_bytes             creator
    0x01c  4    num_spec              creator
    0x020  4    max_tokens            creator
    0x028  8    total_size            creator
    0x080  8    session               engine (supervisor), before it spawns a proxy
    0x088  4    engine_pid            creator
    0x100  4    proxy_pid             proxy, when it attaches
    0x108  8    heartbeat_ns          proxy (CLOCK_MONOTONIC ns of its last beat)
    0x180  4    breaker state         proxy  (0 closed, 1 open, 2 probing)
    0x184  4    consecutive failures  proxy
    0x188  4    cooldown rounds left  proxy
    0x190  8    breaker trips         proxy
    0x198  8    breaker probes        proxy
    0x1a0  ...  room (zero)

Hand-off words page (each word on its own 128-byte line; 32-bit sequence words,
compared cyclically, so a run may start near 2^32 and wrap)::

    offset  size  word         writer
    P+0x000 4     gathered     engine stream: last round whose rows are in staging
    P+0x080 4     released     the round's claimer, after its claim and its drafts
    P+0x100 4     claim        compare-and-swap: proxy, watchdog or engine (no proxy)
    P+0x180 8 D   gathered_ns  engine stream, before gathered: CLOCK_MONOTONIC ns of
                               each depth slot's gather (0 = unknown, e.g. a GPU stream)
    P+0x400 4     probe        engine stream: the CUDA self-test's write (startup only)
    P+0x480 4     probe_ack    engine thread: the self-test's answer to the stream

Descriptor of round r (depth slot r % D), written by the engine (or, for metadata
that lives on the device, by its stream) before gathered = r: the round id, then the
wire ROUND payload without its rows, compact for the round's n entries, so the proxy
sends it as one block straight from the region and the rows from the staging slot::

    +0                4       round
    +8                M(n)    wire.ROUND_FIXED, then slots, positions, n_out, flags [n],
                              offsets [n + 1] (u32 each; wire.round_sections)
    +8 + M(n)         4 T'    tokens, i32 (T' = n_tokens <= T)

Drafts slot of round r (depth slot r % D), written by whoever claimed r, then
published by its release store of ``released``::

    +0                4       round the answer is for
    +4                4       status: ring.Outcome (ok, timeout, error, watchdog, ...)
    +8                4       n_entries
    +12               4       flags: bit 0, margins present
    +128              4 S     counts, i32 per entry
    es = align(128 + 4 S, L)   4 S     entry status, i32 (wire.STATUS_OK / STATUS_RESYNC)
    tk = align(es + 4 S, L)    4 S K   tokens, i32 [S][K]
    mg = align(tk + 4 S K, L)  4 S K   margins, f32 [S][K]
    stride = align(mg + 4 S K, L)

An empty answer (watchdog, no proxy, timeout) zeroes +8 up to the end of tokens, and an
OK answer's rows are zero past each count, so the tokens block is always clean.

Counters blocks: u64 words, relaxed atomic adds through the native library, one writer
per block (per counter in the engine block, named in ``ENGINE_COUNTERS``). A histogram
is ``len(LATENCY_BOUNDS_NS) + 1`` bucket counts (not cumulative; the last is +Inf)
followed by the sum of the observed values in ns.

Invariants: every offset is fixed by the five sizes, the page size and
``LAYOUT_VERSION``; the file's size equals ``Layout.size`` (sealed); the header's
creator fields never change after ``create``.

This module imports only the standard library (the proxy is torch- and numpy-free).
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import mmap
import os
import struct
import types
from dataclasses import dataclass, field
from typing import Callable, Mapping

from . import wire

MAGIC = b"DSPKSHM1"
LAYOUT_VERSION = 2
LINE = 128
MAX_DEPTH = 64

# Header page: creator fields (one struct), then the words others write.
HEADER = struct.Struct("<8sIIIIIIIIQ")  # magic .. max_tokens, pad, total_size
OFF_SESSION = 0x080
OFF_ENGINE_PID = 0x088
OFF_PROXY_PID = 0x100
OFF_HEARTBEAT = 0x108
OFF_BREAKER = 0x180

# Hand-off words, relative to the words page.
W_GATHERED = 0x000
W_RELEASED = 0x080
W_CLAIM = 0x100
W_GATHERED_NS = 0x180       # up to 0x180 + 8 x MAX_DEPTH = 0x380
W_PROBE = 0x400
W_PROBE_ACK = 0x480

# Descriptor slot: the round id, then the ROUND payload without rows.
DESC_ROUND = 0
DESC_FIXED = 8

# Drafts slot header.
DRAFTS_HEAD = struct.Struct("<IIII")  # round, status, n_entries, flags
D_ROUND, D_STATUS, D_N = 0, 4, 8
D_COUNTS = LINE
DRAFTS_MARGINS = 1

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14

# Histogram bucket upper bounds (ns), shared by every latency histogram.
LATENCY_BOUNDS_NS = (
    1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000,
    1_000_000, 2_000_000, 5_000_000, 10_000_000, 20_000_000, 50_000_000,
    100_000_000, 200_000_000, 500_000_000, 1_000_000_000)


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# --------------------------------------------------------------------------- counters


@dataclass(frozen=True)
class CounterBlock:
    """The shape of one counters block: plain counters, then histograms."""

    counters: tuple[str, ...]
    histograms: tuple[str, ...] = ()
    offsets: Mapping[str, int] = field(init=False, repr=False)
    size: int = field(init=False)

    def __post_init__(self):
        offsets = {name: 8 * i for i, name in enumerate(self.counters)}
        at = 8 * len(self.counters)
        for name in self.histograms:
            offsets[name] = at
            at += 8 * (len(LATENCY_BOUNDS_NS) + 2)  # buckets, +Inf, sum
        object.__setattr__(self, "offsets", types.MappingProxyType(offsets))
        object.__setattr__(self, "size", align(at, LINE))

    @property
    def words(self) -> int:
        return self.size // 8


# Written by the proxy only (its loop thread).
PROXY_COUNTERS = CounterBlock(
    counters=("rounds_ok", "rounds_timeout", "rounds_error", "rounds_breaker_skip",
              "rounds_late", "attempts", "drafts", "draft_tokens", "reconnects",
              # Rounds whose descriptor broke the layout or the wire's rules: answered
              # ERROR (so also in rounds_error) without being sent.
              "rounds_bad_desc"),
    histograms=("round_latency", "handoff_latency"))

# Written by the engine side; the writer of each counter:
#   watchdog_releases  the native watchdog thread
#   no_proxy_rounds    the engine thread (rounds answered empty while no proxy is up)
#                      and the supervisor (rounds a lost proxy left; atomic adds)
#   orphan_releases    the supervisor (rounds a dead proxy had claimed)
#   ring_full          the engine thread (reserve refused: DEPTH rounds in flight)
ENGINE_COUNTERS = CounterBlock(
    counters=("watchdog_releases", "no_proxy_rounds", "orphan_releases", "ring_full"))


@dataclass(frozen=True)
class Histogram:
    bounds_ns: tuple[int, ...]
    buckets: tuple[int, ...]  # per bucket, not cumulative; the last is +Inf
    sum_ns: int

    @property
    def count(self) -> int:
        return sum(self.buckets)


@dataclass(frozen=True)
class Snapshot:
    """A frozen copy of one counters block (each word read atomically)."""

    counters: Mapping[str, int]
    histograms: Mapping[str, Histogram]


class Counters:
    """One counters block of a region. ``add``/``observe`` are for the block's writer
    only; ``snapshot`` is for anyone."""

    def __init__(self, region: "Region", lib, block: CounterBlock, at: int):
        self._lib = lib
        self._block = block
        self._base = region.addr(at)
        self._addr = {name: self._base + off for name, off in block.offsets.items()}
        self._region = region  # keeps the mapping referenced while this lives

    @property
    def base(self) -> int:
        """The block's address in this process (word i of the block is at base + 8 i)."""
        return self._base

    def addr(self, name: str) -> int:
        return self._addr[name]

    def add(self, name: str, n: int = 1) -> None:
        self._lib.add64(self._addr[name], n)

    def observe(self, name: str, ns: int) -> None:
        """Count one latency ``ns`` in histogram ``name``."""
        base = self._addr[name]
        self._lib.add64(base + 8 * bisect.bisect_left(LATENCY_BOUNDS_NS, ns), 1)
        self._lib.add64(base + 8 * (len(LATENCY_BOUNDS_NS) + 1), max(ns, 0))

    def snapshot(self) -> Snapshot:
        words = (ctypes.c_uint64 * self._block.words)()
        self._lib.snapshot64(self._base, ctypes.addressof(words), self._block.words)
        offs = self._block.offsets
        nb = len(LATENCY_BOUNDS_NS) + 1
        counters = {n: words[offs[n] // 8] for n in self._block.counters}
        hists = {}
        for n in self._block.histograms:
            i = offs[n] // 8
            hists[n] = Histogram(LATENCY_BOUNDS_NS, tuple(words[i:i + nb]), words[i + nb])
        return Snapshot(types.MappingProxyType(counters), types.MappingProxyType(hists))


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Every offset of a region, from its five sizes (see the module docstring).

    Raises (at construction):
        ValueError: a size out of range, naming it and its value.
    """

    depth: int
    max_slots: int
    row_bytes: int
    num_spec: int
    max_tokens: int
    page_size: int = mmap.PAGESIZE
    words_at: int = field(init=False)
    desc_at: int = field(init=False)
    desc_stride: int = field(init=False)
    staging_at: int = field(init=False)
    staging_stride: int = field(init=False)
    drafts_at: int = field(init=False)
    drafts_stride: int = field(init=False)
    d_entry_status: int = field(init=False)
    d_tokens: int = field(init=False)
    d_margins: int = field(init=False)
    proxy_counters_at: int = field(init=False)
    engine_counters_at: int = field(init=False)
    size: int = field(init=False)

    def __post_init__(self):
        _in_range("depth", self.depth, 1, MAX_DEPTH)
        if self.depth & (self.depth - 1):
            raise ValueError(f"depth={self.depth}: must be a power of two (round % depth "
                             "must stay continuous when the 32-bit round id wraps)")
        _in_range("max_slots", self.max_slots, 1, wire.MAX_ENTRIES)
        _in_range("row_bytes", self.row_bytes, 1, wire.MAX_ROW_BYTES)
        _in_range("num_spec", self.num_spec, 1, wire.MAX_N_OUT)
        _in_range("max_tokens", self.max_tokens, 0, wire.MAX_TOKENS)
        if self.page_size < 4096 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size}: not a power of two >= 4096")
        P, S, K = self.page_size, self.max_slots, self.num_spec
        o = {}
        o["words_at"] = P
        o["desc_at"] = 2 * P
        # One token cell past T: metadata on the device is cut in stream order by a
        # scatter whose dropped tokens land there (never sent: n_tokens <= T).
        o["desc_stride"] = align(DESC_FIXED + wire.round_meta_bytes(S) + 4 * (self.max_tokens + 1), LINE)
        o["staging_at"] = align(o["desc_at"] + self.depth * o["desc_stride"], P)
        o["staging_stride"] = align(S * self.row_bytes, P)
        o["drafts_at"] = o["staging_at"] + self.depth * o["staging_stride"]
        o["d_entry_status"] = align(D_COUNTS + 4 * S, LINE)
        o["d_tokens"] = align(o["d_entry_status"] + 4 * S, LINE)
        o["d_margins"] = align(o["d_tokens"] + 4 * S * K, LINE)
        o["drafts_stride"] = align(o["d_margins"] + 4 * S * K, LINE)
        o["proxy_counters_at"] = o["drafts_at"] + self.depth * o["drafts_stride"]
        o["engine_counters_at"] = o["proxy_counters_at"] + PROXY_COUNTERS.size
        o["size"] = align(o["engine_counters_at"] + ENGINE_COUNTERS.size, P)
        for k, v in o.items():
            object.__setattr__(self, k, v)

    # Absolute offsets of the hand-off words and per-round slots.
    @property
    def gathered(self) -> int:
        return self.words_at + W_GATHERED

    @property
    def released(self) -> int:
        return self.words_at + W_RELEASED

    @property
    def claim(self) -> int:
        return self.words_at + W_CLAIM

    def gathered_ns(self, index: int) -> int:
        return self.words_at + W_GATHERED_NS + 8 * index

    def desc(self, index: int) -> int:
        return self.desc_at + index * self.desc_stride

    def staging(self, index: int) -> int:
        return self.staging_at + index * self.staging_stride

    def drafts(self, index: int) -> int:
        return self.drafts_at + index * self.drafts_stride

    def header_bytes(self) -> bytes:
        """The creator fields, as ``create`` writes them at offset 0."""
        return HEADER.pack(MAGIC, LAYOUT_VERSION, self.page_size, self.depth, self.max_slots,
                           self.row_bytes, self.num_spec, self.max_tokens, 0, self.size)


def _in_range(name: str, value: int, lo: int, hi: int) -> None:
    if not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}={value!r}: must be an integer in {lo}..{hi}")


# --------------------------------------------------------------------------- region


class Region:
    """The mapped region. ``create`` in the engine, ``attach`` in the proxy.

    Invariants: while open, ``base`` is the mapping's address in this process and
    ``fd`` the memfd (close-on-exec: a child gets it only through ``pass_fds``); after
    ``close`` both are gone and close hooks (e.g. the watchdog's stop) have run.
    """

    # Class-level sentinels: close() works on a half-built or closed Region.
    _fd = -1
    _mm: mmap.mmap | None = None
    _buf: memoryview | None = None
    _hooks: list[Callable[[], None]] | tuple = ()
    base = 0
    layout: Layout

    @classmethod
    def create(cls, layout: Layout, name: str = "remote-dspark") -> "Region":
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
            self._mm[0:HEADER.size] = layout.header_bytes()
            struct.pack_into("<I", self._mm, OFF_ENGINE_PID, os.getpid())
        except BaseException:
            self.close()
            raise
        return self

    @classmethod
    def attach(cls, fd: int) -> "Region":
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
            if self._mm[0:HEADER.size] != layout.header_bytes():
                raise ValueError(f"region fd {fd}: header changed while attaching")
        except BaseException:
            self.close()
            raise
        os.set_inheritable(fd, False)
        self._fd = fd
        return self

    def _map(self, fd: int, layout: Layout) -> None:
        self.layout = layout
        self._mm = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._buf = memoryview(self._mm)
        # The address only: the ctypes object (an export of the mapping) dies at once.
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._hooks = []

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
        """A writable view of ``size`` bytes at ``offset``. Release (or drop) every view
        before ``close``."""
        if self._buf is None:
            raise ValueError("region is closed")
        return self._buf[offset:offset + size]

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

    def header_words(self, lib) -> "HeaderWords":
        return HeaderWords(self, lib)

    def add_close_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` first thing in ``close`` (stop whatever uses the mapping)."""
        self._hooks.append(hook)

    def close(self) -> None:
        """Run the close hooks, unmap, close the fd. Idempotent.

        Raises:
            BufferError: views of the region are still alive (the region stays mapped;
                release them and close again).
        """
        hooks, self._hooks = list(self._hooks), []
        for hook in reversed(hooks):
            hook()
        if self._buf is not None:
            self._buf.release()
            self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError as e:
                raise BufferError("Region.close(): views of the region are still alive; "
                                  "release them first") from e
            self._mm = None
            self.base = 0
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


@dataclass(frozen=True)
class BreakerState:
    state: int               # 0 closed, 1 open, 2 probing
    consecutive_failures: int
    cooldown_left: int
    trips: int
    probes: int


class HeaderWords:
    """The header's mutable words, each read and written atomically through the native
    library. Writers as in the module docstring's table."""

    def __init__(self, region: Region, lib):
        self._lib = lib
        self._region = region
        self._session = region.addr(OFF_SESSION)
        self._engine_pid = region.addr(OFF_ENGINE_PID)
        self._proxy_pid = region.addr(OFF_PROXY_PID)
        self._heartbeat = region.addr(OFF_HEARTBEAT)
        self._breaker = region.addr(OFF_BREAKER)

    @property
    def session(self) -> int:
        return self._lib.load64(self._session)

    def set_session(self, session: int) -> None:  # engine
        self._lib.store64(self._session, session)

    @property
    def engine_pid(self) -> int:
        return self._lib.load32(self._engine_pid)

    @property
    def proxy_pid(self) -> int:
        return self._lib.load32(self._proxy_pid)

    def set_proxy_pid(self, pid: int) -> None:  # proxy
        self._lib.store32(self._proxy_pid, pid)

    @property
    def heartbeat_ns(self) -> int:
        return self._lib.load64(self._heartbeat)

    def beat(self, now_ns: int) -> None:  # proxy
        self._lib.store64(self._heartbeat, now_ns)

    def breaker(self) -> BreakerState:
        b, lib = self._breaker, self._lib
        return BreakerState(lib.load32(b), lib.load32(b + 4), lib.load32(b + 8),
                            lib.load64(b + 16), lib.load64(b + 24))

    def set_breaker(self, s: BreakerState) -> None:  # proxy
        b, lib = self._breaker, self._lib
        lib.store32(b, s.state)
        lib.store32(b + 4, s.consecutive_failures)
        lib.store32(b + 8, s.cooldown_left)
        lib.store64(b + 16, s.trips)
        lib.store64(b + 24, s.probes)


def _check_file(fd: int) -> Layout:
    """The layout a region file's header describes, checked against the file."""
    size = os.fstat(fd).st_size
    if size < HEADER.size:
        raise ValueError(f"region fd {fd}: {size} bytes, too small for a header")
    head = os.pread(fd, HEADER.size, 0)
    magic, version, page, depth, slots, row, spec, tokens, _, total = HEADER.unpack(head)
    if magic != MAGIC:
        raise ValueError(f"region fd {fd}: magic {magic!r}, expected {MAGIC!r}")
    if version != LAYOUT_VERSION:
        raise ValueError(f"region fd {fd}: layout version {version}, this side reads "
                         f"version {LAYOUT_VERSION}")
    if page != mmap.PAGESIZE:
        raise ValueError(f"region fd {fd}: page size {page}, this process has {mmap.PAGESIZE}")
    try:
        layout = Layout(depth, slots, row, spec, tokens, page)
    except ValueError as e:
        raise ValueError(f"region fd {fd}: header sizes refused: {e}") from e
    if total != layout.size:
        raise ValueError(f"region fd {fd}: header total_size {total}, its sizes need {layout.size}")
    if size != layout.size:
        raise ValueError(f"region fd {fd}: file size {size} bytes, its header's layout "
                         f"needs {layout.size}")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SEALS != SEALS:
        raise ValueError(f"region fd {fd}: seals {seals:#x}, expected shrink, grow and seal")
    return layout

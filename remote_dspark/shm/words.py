"""``region.words``: the region's live words, as this process reads and writes them.

The header's mutable words (:class:`HeaderWords`: session, pids, the negotiated context
and round cap, heartbeat, the breaker's state) and the counters blocks (:class:`Counters`: counters and latency
histograms, read back as a frozen :class:`Snapshot`). Every word is read and written
atomically through the native library (counters with relaxed atomic adds), one writer
per word as in :mod:`~remote_dspark.shm.layout`'s tables. Each accessor takes a mapped
:class:`~remote_dspark.shm.memfd.Region`; ``Region.proxy_counters``, ``engine_counters`` and
``header_words`` build them.

This module imports only the standard library (the proxy is torch- and numpy-free).
"""

from __future__ import annotations

import ctypes
import types
from collections.abc import Mapping
from dataclasses import dataclass

from .layout import (
    LATENCY_BOUNDS_NS,
    OFF_BREAKER,
    OFF_CONTEXT,
    OFF_HEARTBEAT,
    OFF_PROXY_PID,
    OFF_ROUND_TOKENS,
    OFF_SESSION,
    CounterBlock,
)


@dataclass(frozen=True)
class HistogramWords:
    """One latency histogram as a counters block's words hold it (ns), copied in a snapshot."""

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
    histograms: Mapping[str, HistogramWords]


class Counters:
    """One counters block of a region. ``add``/``observe`` are for the block's writer
    only; ``snapshot`` is for anyone."""

    def __init__(self, region, lib, block: CounterBlock, at: int):
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

    def snapshot(self) -> Snapshot:
        words = (ctypes.c_uint64 * self._block.words)()
        self._lib.snapshot64(self._base, ctypes.addressof(words), self._block.words)
        offs = self._block.offsets
        nb = len(LATENCY_BOUNDS_NS) + 1
        counters = {n: words[offs[n] // 8] for n in self._block.counters}
        hists = {}
        for n in self._block.histograms:
            i = offs[n] // 8
            hists[n] = HistogramWords(LATENCY_BOUNDS_NS, tuple(words[i : i + nb]), words[i + nb])
        return Snapshot(types.MappingProxyType(counters), types.MappingProxyType(hists))


@dataclass(frozen=True)
class BreakerState:
    state: int  # 0 closed, 1 open, 2 probing
    consecutive_failures: int
    cooldown_left: int
    trips: int
    probes: int


class HeaderWords:
    """The header's mutable words, each read and written atomically through the native
    library. Writers as in the header table of region.layout's docstring."""

    def __init__(self, region, lib):
        self._lib = lib
        self._region = region
        self._session = region.addr(OFF_SESSION)
        self._proxy_pid = region.addr(OFF_PROXY_PID)
        self._context = self.context_at = region.addr(OFF_CONTEXT)  # (context_at: for a C reader)
        self._round_tokens = region.addr(OFF_ROUND_TOKENS)
        self._heartbeat = region.addr(OFF_HEARTBEAT)
        self._breaker = region.addr(OFF_BREAKER)

    @property
    def session(self) -> int:
        return self._lib.load64(self._session)

    def set_session(self, session: int) -> None:  # engine
        self._lib.store64(self._session, session)

    @property
    def proxy_pid(self) -> int:
        return self._lib.load32(self._proxy_pid)

    def set_proxy_pid(self, pid: int) -> None:  # proxy
        self._lib.store32(self._proxy_pid, pid)

    @property
    def context_tokens(self) -> int:
        """The context the proxy's worker keeps per slot (its HELLO_ACK); 0: none yet."""
        return self._lib.load32(self._context)

    @property
    def round_tokens(self) -> int:
        """The most tokens a round may carry to the proxy's worker (its HELLO_ACK); 0:
        none yet. Read after a nonzero :attr:`context_tokens`, it is that connection's
        or a later one's (:meth:`set_acked`'s order)."""
        return self._lib.load32(self._round_tokens)

    def set_acked(self, context_tokens: int, round_tokens: int) -> None:  # proxy
        """Store a connection's HELLO_ACK (both nonzero) or its drop (both 0). Each store
        is a release: on a connection the round cap goes first, on a drop last, so the
        engine never pairs a connection's context with an older connection's cap."""
        if context_tokens:
            self._lib.store32(self._round_tokens, round_tokens)
            self._lib.store32(self._context, context_tokens)
        else:
            self._lib.store32(self._context, 0)
            self._lib.store32(self._round_tokens, round_tokens)

    @property
    def heartbeat_ns(self) -> int:
        return self._lib.load64(self._heartbeat)

    def breaker(self) -> BreakerState:
        b, lib = self._breaker, self._lib
        return BreakerState(lib.load32(b), lib.load32(b + 4), lib.load32(b + 8), lib.load64(b + 16), lib.load64(b + 24))

    def set_breaker(self, s: BreakerState) -> None:  # proxy
        b, lib = self._breaker, self._lib
        lib.store32(b, s.state)
        lib.store32(b + 4, s.consecutive_failures)
        lib.store32(b + 8, s.cooldown_left)
        lib.store64(b + 16, s.trips)
        lib.store64(b + 24, s.probes)

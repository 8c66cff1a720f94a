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
import ipaddress
import types
from collections.abc import Mapping
from dataclasses import dataclass

from .layout import (
    LATENCY_BOUNDS_NS,
    OFF_BREAKER,
    OFF_CONTEXT,
    OFF_HEARTBEAT,
    OFF_LINK,
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


@dataclass(frozen=True)
class LinkWords:
    """The proxy's link as the region's link words hold it."""

    epoch: int  # active connections so far (0: none yet)
    incarnation: int  # the active worker's (0: no active)
    address: str  # the active worker's "ip:port" ("" : no active)
    spare: bool  # a spare connection is ready


LINK_READ_TRIES = 64  # a reader's tries at a consistent copy (a write takes microseconds)


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
        self._link = region.addr(OFF_LINK)

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

    @property
    def link_epoch(self) -> int:
        """The proxy's link epoch (engine, before each round: a change is a new worker
        session). One word, no sequence needed."""
        return self._lib.load64(self._link + 8)

    def set_link(self, epoch: int, incarnation: int, host: str, port: int, spare: bool) -> None:  # proxy
        """Store the link words (``host`` "" and ``port`` 0: no active) under the sequence
        word: odd while written. Each store is a release, so a reader that sees the
        sequence even and unchanged around its loads has one write's words."""
        lib, at = self._lib, self._link
        try:
            ip = ipaddress.ip_address(host).packed if host else bytes(16)
        except ValueError:  # a name an ofl library resolves itself: no address to show
            ip = bytes(16)
        if len(ip) == 4:
            ip = ipaddress.IPv6Address("::ffff:" + host).packed
        seq = lib.load64(at)
        lib.store64(at, seq + 1)
        lib.store64(at + 16, incarnation)
        lib.store64(at + 24, int.from_bytes(ip[:8], "little"))
        lib.store64(at + 32, int.from_bytes(ip[8:], "little"))
        lib.store32(at + 40, port)
        lib.store32(at + 44, int(spare))
        lib.store64(at + 8, epoch)
        lib.store64(at, seq + 2)

    def link(self) -> LinkWords:
        """A consistent copy of the link words (the last one read if the writer kept
        writing through LINK_READ_TRIES tries: a metric a scrape late at worst)."""
        lib, at = self._lib, self._link
        for _ in range(LINK_READ_TRIES):
            seq = lib.load64(at)
            epoch, incarnation = lib.load64(at + 8), lib.load64(at + 16)
            ip = lib.load64(at + 24).to_bytes(8, "little") + lib.load64(at + 32).to_bytes(8, "little")
            port, spare = lib.load32(at + 40), lib.load32(at + 44)
            if seq % 2 == 0 and lib.load64(at) == seq:
                break
        address = ""
        if port:
            v6 = ipaddress.IPv6Address(ip)
            host = str(v6.ipv4_mapped) if v6.ipv4_mapped else f"[{v6}]"
            address = f"{host}:{port}"
        return LinkWords(epoch, incarnation, address, bool(spare))

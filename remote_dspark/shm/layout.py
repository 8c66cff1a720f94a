"""``region.layout``: the byte layout of the region the engine and its proxy share
(:mod:`remote_dspark.shm.memfd` maps it).

The layout is computed in one place (``Layout``) from five sizes and one option:
``depth`` (D, rounds in flight, a power of two), ``max_slots`` (S, entries per round),
``row_bytes`` (R), ``num_spec`` (K, draft tokens per entry), ``max_tokens`` (T, the
token block of one round) and ``sampled`` (the engine asks for sampled drafts: its
descriptors carry temperatures and seeds, its drafts slots the distributions; then
S <= wire.MAX_SAMPLED_ENTRIES and K <= wire.MAX_SAMPLED_N_OUT). P is the page size,
L = 128 (a line: no two writers share one).

Region (offsets in bytes)::

    offset                  size            part
    0                       P               header page
    P                       P               hand-off words page
    2P                      D x desc        descriptor ring, desc = align(8 + M(S) + 4 (T + 1), L),
                                            M(n) = wire.round_meta_bytes(n, sampled)
                                            = 20 + 20 n (+ 12 n sampled: temperature, seed)
    staging_at (P-aligned)  D x stage       staging rows, stage = align(S R, P): each depth
                                            slot page-aligned (registered with CUDA later);
                                            R = 0 (an engine without rows): no staging,
                                            stage = 0 and drafts_at = staging_at
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
    0x024  4    options               creator: bit 0 sampled (OPT_SAMPLED); others zero
    0x028  8    total_size            creator
    0x080  8    session               engine (supervisor), before it spawns a proxy
    0x088  4    engine_pid            creator
    0x100  4    proxy_pid             proxy, when it attaches
    0x104  4    context_tokens        proxy: the context its worker keeps per slot (HELLO_ACK),
                                      stored on each connection before a round goes out on
                                      it; 0 from attach and after a drop (no HELLO_ACK).
                                      The engine reads it for each round's NEW_GEN cut.
    0x110  4    round_tokens          proxy: the most tokens its worker takes in a round
                                      (HELLO_ACK), stored before context_tokens on a
                                      connection and after it on a drop. The engine's
                                      rounds carry at most it (and its own round_tokens).
    0x108  8    heartbeat_ns          proxy (CLOCK_MONOTONIC ns of its last beat)
    0x180  4    breaker state         proxy  (0 closed, 1 open, 2 probing)
    0x184  4    consecutive failures  proxy
    0x188  4    cooldown rounds left  proxy
    0x190  8    breaker trips         proxy
    0x198  8    breaker probes        proxy
    0x200  8    link sequence         proxy: odd while it writes the link words below (a
                                      seqlock: a reader retries on odd or changed)
    0x208  8    link epoch            proxy: its link's active connections so far, stored
                                      before a round can take a new one. The engine reads
                                      it before each round: a change is a new worker
                                      session, so that round re-announces every slot
    0x210  8    worker incarnation    proxy: the active worker's (its HELLO_ACK); 0: none
    0x218  16   worker address        proxy: the active's IP (IPv6, or IPv4-mapped)
    0x228  4    worker port           proxy: the active's port (0: no active)
    0x22c  4    spare                 proxy: 1 while a spare connection is ready, else 0
    0x230  ...  room (zero)

Hand-off words page (each word on its own 128-byte line; 32-bit sequence words,
compared cyclically, so a run may start near 2^32 and wrap)::

    offset  size  word         writer
    P+0x000 4     gathered     engine stream: last round whose descriptor is written and
                               whose rows are in staging, or, from a CPU engine's C
                               hand-over, being copied there (the descriptor's pending)
    P+0x080 4     released     the round's claimer, after its claim and its drafts (a futex
                               word: the engine's CPU wait sleeps on it after its spin)
    P+0x084 4     waiters      engine: how many of its threads sleep on released (every
                               releaser wakes them when nonzero); on released's line, so
                               a release touches no other line
    P+0x100 4     claim        compare-and-swap: proxy, watchdog or engine (no proxy)
    P+0x180 8 D   gathered_ns  engine stream, before gathered: CLOCK_MONOTONIC ns of
                               each depth slot's gather (0 = unknown, e.g. a GPU stream)
    P+0x400 4     probe        engine stream: the CUDA self-test's write (startup only)
    P+0x480 4     probe_ack    engine thread: the self-test's answer to the stream
    P+0x500 4     published    engine CPU, before the stream writes gathered: the last
                               round handed over (a futex word: the idle proxy sleeps on it)
    P+0x504 4     sleeping     proxy: 1 while it sleeps on published (the engine wakes it)
    P+0x580 4     standby_go   the promotion handshake (a futex): the supervisor offers the
                               role (the standby's pid), the standby accepts (pid | 1 << 31),
                               the supervisor withdraws an offer not accepted (0)
    P+0x584 4     standby_pid  standby proxy: its pid once it is ready (0: none ready)

Descriptor of round r (depth slot r % D), written by the engine (or, for metadata
that lives on the device, by its stream) before gathered = r: the round id, then the
wire ROUND payload without its rows, compact for the round's n entries, so the proxy
sends it as one block straight from the region and the rows from the staging slot::

    +0                4       round
    +4                4       pending: entries whose rows are not in staging yet. A CPU
                              engine's C hand-over (hf_host_round) publishes gathered = r
                              with pending = n, then copies the rows and counts pending
                              down (release stores, every 64 KiB or so), so the proxy sends
                              each row once the count no longer covers it; every other
                              writer leaves it 0 (rows in staging before gathered)
    +8                M(n)    wire.ROUND_FIXED, then slots, positions, n_out, flags [n],
                              offsets [n + 1] (u32 each), and in a sampled layout
                              temperature f32 [n], seed u64 [n] (wire.round_sections)
    +8 + M(n)         4 T'    tokens, i32 (T' = n_tokens <= T)

Drafts slot of round r (depth slot r % D), written by whoever claimed r, then
published by its release store of ``released``::

    +0                4       round the answer is for
    +4                4       status: outcome.Outcome (ok, timeout, error, watchdog, ...)
    +8                4       n_entries
    +12               4       flags: bit 0 margins present, bit 1 distributions present
    +128              4 S     counts, i32 per entry
    es = align(128 + 4 S, L)   4 S     entry status, i32 (wire.STATUS_OK / STATUS_RESYNC)
    tk = align(es + 4 S, L)    4 S K   tokens, i32 [S][K]
    qi = align(tk + 4 S K, L)  4 S K Q q_ids, i32 [S][K][Q] (Q = 32; 0 bytes unsampled)
    qw = align(qi + .., L)     2 S K Q q_weights, u16 [S][K][Q] (0 bytes unsampled)
    mg = align(qw + .., L)     4 S K   margins, f32 [S][K]
    stride = align(mg + 4 S K, L)

An empty answer (watchdog, no proxy, timeout) zeroes +8 up to the end of tokens, or of
q_weights in a sampled layout (``zero_end``), and an OK answer's rows are zero past
each count, so the tokens and q blocks are always clean.

Counters blocks: u64 words, relaxed atomic adds through the native library, one writer
per block (per counter in the engine block, named in ``ENGINE_COUNTERS``). A histogram
is ``len(LATENCY_BOUNDS_NS) + 1`` bucket counts (not cumulative; the last is +Inf)
followed by the sum of the observed values in ns.

Invariants: every offset is fixed by the five sizes, the option, the page size and
``LAYOUT_VERSION``.

This module imports only the standard library (the proxy is torch- and numpy-free).
"""

from __future__ import annotations

import mmap
import struct
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import wire

MAGIC = b"DSPKSHM1"
LAYOUT_VERSION = 9
LINE = 128
MAX_DEPTH = 64

# Header page: creator fields (one struct), then the words others write.
HEADER = struct.Struct("<8sIIIIIIIIQ")  # magic .. max_tokens, options, total_size
OPT_SAMPLED = 1  # header options: a sampled layout
OFF_SESSION = 0x080
OFF_ENGINE_PID = 0x088
OFF_PROXY_PID = 0x100
OFF_CONTEXT = 0x104
OFF_HEARTBEAT = 0x108
OFF_ROUND_TOKENS = 0x110
OFF_BREAKER = 0x180
OFF_LINK = 0x200  # the link words: sequence, epoch, incarnation, address, port, spare

# Hand-off words, relative to the words page.
W_GATHERED = 0x000
W_RELEASED = 0x080
W_WAITERS = 0x084  # engine threads asleep on released (hostflag.c, "the engine's sleep")
W_CLAIM = 0x100
W_GATHERED_NS = 0x180  # up to 0x180 + 8 x MAX_DEPTH = 0x380
W_PROBE = 0x400
W_PROBE_ACK = 0x480
W_WAKE = 0x500  # [published, sleeping] (hostflag.c, "sleeping when idle")
W_STANDBY_GO = 0x580
W_STANDBY_PID = 0x584

# Descriptor slot: the round id; the entries whose rows are not in staging yet (a CPU
# engine publishes a round before its rows and counts them down as it copies them,
# hostflag.h's hf_rows_pending; 0 from every other writer); then the ROUND payload
# without rows.
DESC_ROUND = 0
DESC_PENDING = 4
DESC_FIXED = 8

# Drafts slot header.
DRAFTS_HEAD = struct.Struct("<IIII")  # round, status, n_entries, flags
D_ROUND, D_STATUS, D_N = 0, 4, 8
D_COUNTS = LINE
DRAFTS_MARGINS = 1
DRAFTS_SAMPLED = 2

# Histogram bucket upper bounds (ns), shared by every latency histogram.
LATENCY_BOUNDS_NS = (
    1_000,
    2_000,
    5_000,
    10_000,
    20_000,
    50_000,
    100_000,
    200_000,
    500_000,
    1_000_000,
    2_000_000,
    5_000_000,
    10_000_000,
    20_000_000,
    50_000_000,
    100_000_000,
    200_000_000,
    500_000_000,
    1_000_000_000,
)


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
    counters=(
        "rounds_ok",
        "rounds_timeout",
        "rounds_error",
        "rounds_breaker_skip",
        "rounds_late",
        "attempts",
        "drafts",
        "draft_tokens",
        "reconnects",
        # Rounds whose descriptor broke the layout or the wire's rules: answered
        # ERROR (so also in rounds_error) without being sent.
        "rounds_bad_desc",
        # The link's active connections left, by cause (transport.link.Cause), and the
        # replies read from a connection left after a stall, dropped (fencing). The
        # link's keeper thread adds to them too (relaxed atomic adds).
        "failovers_lost",
        "failovers_stall",
        "failovers_protocol",
        "fenced_replies",
    ),
    histograms=("round_latency", "handoff_latency"),
)

# Written by the engine side; the writer of each counter:
#   watchdog_releases  the native watchdog thread
#   no_proxy_rounds    the engine thread (rounds answered empty while no proxy is up)
#                      and the supervisor (rounds a lost proxy left; atomic adds)
#   orphan_releases    the supervisor (rounds a dead proxy had claimed)
#   ring_full          the engine thread (reserve refused: DEPTH rounds in flight)
ENGINE_COUNTERS = CounterBlock(counters=("watchdog_releases", "no_proxy_rounds", "orphan_releases", "ring_full"))


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Every offset of a region, from its five sizes and ``sampled`` (see the module
    docstring).

    Raises (at construction):
        ValueError: a size out of range, naming it and its value (a sampled layout's
            max_slots and num_spec held to the sampled caps).
    """

    depth: int
    max_slots: int
    row_bytes: int
    num_spec: int
    max_tokens: int
    page_size: int = mmap.PAGESIZE
    sampled: bool = False
    words_at: int = field(init=False)
    desc_at: int = field(init=False)
    desc_stride: int = field(init=False)
    staging_at: int = field(init=False)
    staging_stride: int = field(init=False)
    drafts_at: int = field(init=False)
    drafts_stride: int = field(init=False)
    d_entry_status: int = field(init=False)
    d_tokens: int = field(init=False)
    d_q_ids: int = field(init=False)
    d_q_weights: int = field(init=False)
    zero_end: int = field(init=False)
    d_margins: int = field(init=False)
    proxy_counters_at: int = field(init=False)
    engine_counters_at: int = field(init=False)
    size: int = field(init=False)

    def __post_init__(self):
        _in_range("depth", self.depth, 1, MAX_DEPTH)
        if self.depth & (self.depth - 1):
            raise ValueError(
                f"depth={self.depth}: must be a power of two (round % depth "
                "must stay continuous when the 32-bit round id wraps)"
            )
        _in_range("max_slots", self.max_slots, 1, wire.MAX_ENTRIES)
        _in_range("row_bytes", self.row_bytes, 0, wire.MAX_ROW_BYTES)
        _in_range("num_spec", self.num_spec, 1, wire.MAX_N_OUT)
        _in_range("max_tokens", self.max_tokens, 0, wire.MAX_TOKENS)
        if not isinstance(self.sampled, bool):
            raise ValueError(f"sampled={self.sampled!r}: must be a bool")
        if self.sampled:
            _in_range("max_slots", self.max_slots, 1, wire.MAX_SAMPLED_ENTRIES, " (wire.MAX_SAMPLED_ENTRIES, sampled)")
            _in_range("num_spec", self.num_spec, 1, wire.MAX_SAMPLED_N_OUT, " (wire.MAX_SAMPLED_N_OUT, sampled)")
        if self.page_size < 4096 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size}: not a power of two >= 4096")
        P, S, K = self.page_size, self.max_slots, self.num_spec
        o = {}
        o["words_at"] = P
        o["desc_at"] = 2 * P
        # One token cell past T: metadata on the device is cut in stream order by a
        # scatter whose dropped tokens land there (never sent: n_tokens <= T).
        meta = wire.round_meta_bytes(S, self.sampled)
        o["desc_stride"] = align(DESC_FIXED + meta + 4 * (self.max_tokens + 1), LINE)
        o["staging_at"] = align(o["desc_at"] + self.depth * o["desc_stride"], P)
        o["staging_stride"] = align(S * self.row_bytes, P)
        o["drafts_at"] = o["staging_at"] + self.depth * o["staging_stride"]
        o["d_entry_status"] = align(D_COUNTS + 4 * S, LINE)
        o["d_tokens"] = align(o["d_entry_status"] + 4 * S, LINE)
        q = S * K * wire.SAMPLED_TOP if self.sampled else 0  # distributions' cells
        o["d_q_ids"] = align(o["d_tokens"] + 4 * S * K, LINE)
        o["d_q_weights"] = align(o["d_q_ids"] + 4 * q, LINE)
        o["zero_end"] = o["d_q_weights"] + 2 * q if self.sampled else o["d_tokens"] + 4 * S * K
        o["d_margins"] = align(o["d_q_weights"] + 2 * q, LINE)
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
    def waiters(self) -> int:
        return self.words_at + W_WAITERS

    @property
    def claim(self) -> int:
        return self.words_at + W_CLAIM

    @property
    def wake(self) -> int:
        """The wake words: published, then sleeping."""
        return self.words_at + W_WAKE

    @property
    def standby_go(self) -> int:
        return self.words_at + W_STANDBY_GO

    @property
    def standby_pid(self) -> int:
        return self.words_at + W_STANDBY_PID

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
        return HEADER.pack(
            MAGIC,
            LAYOUT_VERSION,
            self.page_size,
            self.depth,
            self.max_slots,
            self.row_bytes,
            self.num_spec,
            self.max_tokens,
            OPT_SAMPLED if self.sampled else 0,
            self.size,
        )


def _in_range(name: str, value: int, lo: int, hi: int, cap: str = "") -> None:
    if not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name}={value!r}: must be an integer in {lo}..{hi}{cap}")

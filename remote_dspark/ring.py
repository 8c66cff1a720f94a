"""``ring``: rounds through the region, from the engine to the proxy and back.

One round r, in depth slot r % D (every access to a hand-off word goes through the
native library: acquire loads, release stores, compare-and-swap)::

    engine     reserve r: refused while D rounds are in flight (r - released > D);
               write descriptor r and its staging rows
    stream     gathered_ns[r % D] = now; gathered = r (release)     [streamsync]
    proxy      sees gathered >= r (acquire) and claim < r; sends the round straight from
               the region; on the reply (or its failure): claim r (CAS claim: r-1 -> r),
               writes drafts slot r % D, released = r (release) once released == r-1
    watchdog   r gathered, not released, no claim in flight, older than watchdog_ms:
               claim r, empty drafts with status WATCHDOG, released = r  (native thread)
    engine     sees released >= r (acquire); reads drafts slot r % D

Invariants:
  * gathered, claim and released only move forward (32-bit, compared cyclically);
    released <= claim, and claim - released <= 1 except while a claimer waits for the
    one before it to publish.
  * Exactly one claimer per round (the CAS); only the claimer writes the round's drafts
    slot and releases it; released moves one round at a time, after the drafts.
  * The producer writes depth slot r % D only when r - D is released, so a slot is never
    rewritten while the engine may still read its drafts. A proxy holding a round the
    watchdog has answered may see its slot rewritten: ``ProxyRound.pending`` says so.
  * A reply after another claimer answered the round is dropped and counted ``late``.

This module imports only the standard library and the package's own torch-free modules.
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass
from typing import Sequence

from . import native, shm, wire
from .native import Status, check
from .outcome import Outcome

MASK = 0xFFFFFFFF
PUBLISH_TIMEOUT_NS = 1_000_000_000  # how long a claimer waits for the previous one


def seq_geq(a: int, b: int) -> bool:
    """a >= b for 32-bit sequence numbers (cyclic: wrap safe)."""
    return ((a - b) & MASK) < 0x80000000


def seq_add(a: int, n: int) -> int:
    return (a + n) & MASK


_PROXY_COUNTER = {Outcome.OK: "rounds_ok", Outcome.TIMEOUT: "rounds_timeout",
                  Outcome.ERROR: "rounds_error", Outcome.BREAKER_SKIP: "rounds_breaker_skip"}


class RingFull(TimeoutError):
    """``depth`` rounds are in flight and none was released in time."""


def geometry(region: shm.Region) -> native.RingGeom:
    """The native library's view of ``region``'s words and drafts slots."""
    lay = region.layout
    return native.RingGeom(
        gathered=region.addr(lay.gathered), released=region.addr(lay.released),
        claim=region.addr(lay.claim), gathered_ns=region.addr(lay.gathered_ns(0)),
        drafts=region.addr(lay.drafts(0)), drafts_stride=lay.drafts_stride, depth=lay.depth,
        d_round=shm.D_ROUND, d_status=shm.D_STATUS, d_zero=shm.D_N,
        # An empty answer clears the tokens too, so the engine can copy a slot's tokens
        # block as it is whatever answered it (an OK answer is zero past each count).
        zero_bytes=lay.d_tokens + 4 * lay.max_slots * lay.num_spec - shm.D_N)


class _End:
    """What both ends hold: the region, the library and the words' addresses."""

    def __init__(self, region: shm.Region, lib: native.Native):
        self.region = region
        self.layout = region.layout
        self._lib = lib
        self._geom = geometry(region)
        self._geom_ref = ctypes.byref(self._geom)
        self._gathered = self._geom.gathered
        self._released = self._geom.released
        self._claim = self._geom.claim
        self._mask = region.layout.depth - 1

    def gathered(self) -> int:
        return self._lib.load32(self._gathered)

    def released(self) -> int:
        return self._lib.load32(self._released)

    def claimed(self) -> int:
        return self._lib.load32(self._claim)



# --------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class RoundDrafts:
    """A released round's answer, copied out of its drafts slot."""

    round: int
    outcome: Outcome
    counts: tuple[int, ...]                 # per entry; () for an empty answer
    statuses: tuple[int, ...]               # per entry: wire.STATUS_OK / STATUS_RESYNC
    tokens: tuple[tuple[int, ...], ...]     # per entry, counts[i] tokens
    margins: tuple[tuple[float, ...], ...] | None


class Watchdog:
    """The native watchdog thread of one region (see ``EngineEnd.start_watchdog``)."""

    _handle = None

    def __init__(self, lib: native.Native, geom: native.RingGeom, counter_addr: int,
                 limit_ns: int, poll_ns: int):
        self._lib = lib
        handle = lib.watchdog_start(ctypes.byref(geom), counter_addr, Outcome.WATCHDOG,
                                    limit_ns, poll_ns)
        if not handle:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot start the watchdog thread: {os.strerror(err)}")
        self._handle = handle

    @property
    def running(self) -> bool:
        return self._handle is not None

    def stop(self) -> None:
        """Stop and join the thread. Idempotent."""
        handle, self._handle = self._handle, None
        if handle:
            check(self._lib.watchdog_stop(handle), "stop the watchdog")


class EngineEnd(_End):
    """The engine's side of the ring: the single producer, the drafts reader and the
    engine's own releases (no proxy, orphans, the watchdog).

    Invariants: ``last`` is the last reserved round; ``last - released <= depth``.
    """

    def __init__(self, region: shm.Region, lib: native.Native, *, start: int | None = None):
        """``start``: set gathered, claim and released to this round id (the round
        "before the first"), e.g. near 2^32 to exercise the wrap. Only while no proxy is
        attached."""
        super().__init__(region, lib)
        self.counters = region.engine_counters(lib)
        self.header = region.header_words(lib)
        if start is not None:
            for word in (self._gathered, self._claim, self._released):
                lib.store32(word, start & MASK)
        self._last = self.gathered()

    @property
    def last(self) -> int:
        return self._last

    def try_reserve(self) -> int | None:
        """The next round id, or None (counted ``ring_full``) while ``depth`` rounds are
        in flight. Never waits."""
        r = seq_add(self._last, 1)
        if not seq_geq(seq_add(self.released(), self.layout.depth), r):
            self.counters.add("ring_full")
            return None
        self._last = r
        return r

    def reserve(self, timeout_s: float, spin_us: int = 1000, nap_us: int = 50) -> int:
        """The next round id, waiting (GIL released) up to ``timeout_s`` for room.

        Raises:
            RingFull: still ``depth`` rounds in flight at the deadline (counted).
        """
        r = seq_add(self._last, 1)
        if seq_geq(self.released(), seq_add(r, -self.layout.depth)):
            self._last = r    # room now: no wait, and the GIL is never handed to another thread
            return r
        rc = self._lib.wait_geq(self._released, seq_add(r, -self.layout.depth), spin_us,
                                nap_us, native.deadline_ns(timeout_s))
        if check(rc, "reserve a round") is Status.TIMEOUT:
            self.counters.add("ring_full")
            raise RingFull(f"round {r}: {self.layout.depth} rounds in flight, released is "
                           f"{self.released()} after {timeout_s}s")
        self._last = r
        return r

    def unreserve(self, round_id: int) -> None:
        """Give back the round just reserved, before its stream gathered it (a failed
        hand-over), so the next reserve reuses its id."""
        if round_id != self._last:
            raise RuntimeError(f"unreserve({round_id}): the last reserved round is {self._last}")
        self._last = seq_add(round_id, -1)

    def write_entries(self, round_id: int, entries: Sequence[wire.Entry], deadline_ms: int = 0) -> None:
        """Write ``round_id``'s descriptor from records (the slow convenience for tests and
        tools: it walks the entries; the engine writes whole arrays in place).

        Raises:
            ValueError: the entries do not fit the layout (count, n_out, tokens) or a
                wire cap, naming the limit.
        """
        lay = self.layout
        if len(entries) > lay.max_slots:
            raise ValueError(f"round {round_id}: {len(entries)} entries over max_slots={lay.max_slots}")
        if sum(len(e.tokens) for e in entries) > lay.max_tokens:
            raise ValueError(f"round {round_id}: tokens over max_tokens={lay.max_tokens}")
        if any(e.n_out > lay.num_spec for e in entries):
            raise ValueError(f"round {round_id}: an n_out over num_spec={lay.num_spec}")
        # Encoded without rows (they go to the staging slot), then given the layout's row size.
        payload = bytearray(wire.encode_round_entries(round_id, 0, deadline_ms, entries, b"", 0)
                            [wire.HEADER.size:])
        struct.pack_into("<I", payload, 8, lay.row_bytes)
        with self.region.descriptor(round_id & self._mask) as d:
            struct.pack_into("<I", d, shm.DESC_ROUND, round_id)
            d[shm.DESC_FIXED:shm.DESC_FIXED + len(payload)] = payload

    def staging(self, round_id: int) -> memoryview:
        """The staging rows of ``round_id``'s depth slot (max_slots x row_bytes)."""
        return self.region.staging(round_id & self._mask)

    def drafts(self, round_id: int) -> RoundDrafts:
        """Copy out the answer of a released round.

        Raises:
            RuntimeError: the round is not released, or its slot holds another round.
        """
        if not seq_geq(self.released(), round_id):
            raise RuntimeError(f"round {round_id} is not released (released={self.released()})")
        lay, K = self.layout, self.layout.num_spec
        with self.region.drafts(round_id & self._mask) as d:
            rnd, status, n, flags = shm.DRAFTS_HEAD.unpack_from(d, 0)
            if rnd != round_id:
                raise RuntimeError(f"drafts slot {round_id & self._mask} holds round {rnd}, "
                                   f"expected {round_id}: read after the slot was reused")
            counts = struct.unpack_from(f"<{n}i", d, shm.D_COUNTS)
            statuses = struct.unpack_from(f"<{n}i", d, lay.d_entry_status)
            toks = struct.unpack_from(f"<{n * K}i", d, lay.d_tokens)
            marg = (struct.unpack_from(f"<{n * K}f", d, lay.d_margins)
                    if flags & shm.DRAFTS_MARGINS else None)
        rows = range(n)
        return RoundDrafts(
            round_id, Outcome(status), counts, statuses,
            tuple(toks[i * K:i * K + counts[i]] for i in rows),
            None if marg is None else tuple(marg[i * K:i * K + counts[i]] for i in rows))

    def release_no_proxy(self, round_id: int) -> bool:
        """Answer ``round_id`` empty (NO_PROXY) and release it, when no proxy is up.
        False when somebody else answered it first."""
        rc = self._lib.release_empty(self._geom_ref, round_id, Outcome.NO_PROXY,
                                     native.deadline_ns(PUBLISH_TIMEOUT_NS / 1e9))
        status = check(rc, f"release round {round_id} (no proxy)")
        if status is Status.TIMEOUT:
            raise RuntimeError(f"round {seq_add(round_id, -1)}'s claimer never released it; "
                               "call release_orphans once that proxy is known dead")
        if status is Status.OK:
            self.counters.add("no_proxy_rounds")
        return status is Status.OK

    def release_orphans(self) -> int:
        """Release the rounds a dead claimer holds (claimed, never released), empty with
        status ORPHAN; returns how many. Only once the proxy is known dead (its pidfd or
        waitpid said so): a live claimer may still be writing those drafts slots."""
        n = 0
        rel, claim = self.released(), self.claimed()
        while not seq_geq(rel, claim):
            r = seq_add(rel, 1)
            self._lib.zero_drafts(self._geom_ref, r, Outcome.ORPHAN)
            if check(self._lib.publish(self._released, r, native.deadline_ns(1.0)),
                     f"release orphaned round {r}") is not Status.OK:
                raise RuntimeError(f"round {r}: released word stuck at {self.released()}")
            rel, n = r, n + 1
        if n:
            self.counters.add("orphan_releases", n)
        return n

    def start_watchdog(self, watchdog_ms: int, poll_us: int | None = None) -> Watchdog:
        """Start the native watchdog: a round gathered ``watchdog_ms`` ago and not
        released, with no claim in flight, is answered empty (WATCHDOG), released and
        counted. Stopped by ``Watchdog.stop`` or, at the latest, by ``region.close``.

        Raises:
            ValueError: watchdog_ms < 1.
            OSError: the thread cannot be started.
        """
        if watchdog_ms < 1:
            raise ValueError(f"watchdog_ms={watchdog_ms}: must be >= 1")
        limit = watchdog_ms * 1_000_000
        poll = poll_us * 1000 if poll_us else min(max(limit // 10, 50_000), 5_000_000)
        wd = Watchdog(self._lib, self._geom, self.counters.addr("watchdog_releases"), limit, poll)
        self.region.add_close_hook(wd.stop)
        return wd


# --------------------------------------------------------------------------- proxy


class ProxyRound:
    """A round the proxy took from the ring. Its views are the region's own bytes."""

    __slots__ = ("round", "index", "_end")

    def __init__(self, end: "ProxyEnd", round_id: int, index: int):
        self.round = round_id
        self.index = index
        self._end = end

    def fields(self) -> tuple[int, int, int, int]:
        """(deadline_ms, n_entries, row_bytes, n_tokens) of a descriptor checked whole, in
        C (``hf_check_desc``: the round id, the sizes, the offsets, every entry's slot,
        n_out and flags), so it may be sent as it is.

        Raises:
            ValueError: the descriptor is not this round's or breaks a rule, naming the
                field (and the entry).
        """
        self._end.check_descriptor(self.round)
        with self._end.region.descriptor(self.index) as d:
            return wire.ROUND_FIXED.unpack_from(d, shm.DESC_FIXED)

    def wire_parts(self, session: int, fields: tuple[int, int, int, int] | None = None) -> list:
        """The ROUND frame as buffers for one ``sendmsg``: the wire header, a view of the
        descriptor's block (fixed part, entry arrays, tokens) and a view of the staging
        rows; nothing is copied. ``fields``: what ``fields()`` just returned, to spare
        checking the descriptor twice.

        Raises:
            ValueError: the descriptor breaks a rule (``fields``).
        """
        _, n, row_bytes, n_tokens = fields if fields is not None else self.fields()
        region, lay = self._end.region, self._end.layout
        block = region.view(lay.desc(self.index) + shm.DESC_FIXED,
                            wire.round_meta_bytes(n) + 4 * n_tokens)
        rows = region.view(lay.staging(self.index), n * row_bytes)
        return [wire.encode_header(wire.ROUND, len(block) + len(rows), session, self.round), block, rows]

    def slots(self) -> tuple[int, ...]:
        """The slot id of each entry, in order.

        Raises:
            ValueError: the descriptor breaks a rule (``fields``).
        """
        n = self.fields()[1]
        at = self._end.layout.desc(self.index) + shm.DESC_FIXED + wire.ROUND_FIXED.size
        with self._end.region.view(at, 4 * n) as raw, raw.cast("I") as slots:
            return tuple(slots)

    def pending(self) -> bool:
        """True while nobody has claimed the round. A proxy that sent the round and then
        finds it False may have sent a slot the engine was already rewriting."""
        return not seq_geq(self._end.claimed(), self.round)


class ProxyEnd(_End):
    """The proxy's side: take rounds in order, answer each exactly once or drop the
    answer as late. One thread (the proxy loop) uses it.

    ``next_round`` and ``complete`` are one native call each (``hf_take``, ``hf_answer``:
    the wait, the heartbeat, the claim, the drafts, the release and every proxy counter
    and histogram are in C), for a proxy whose network round is in Python (the ofl
    transports); on TCP the whole round is one call, :class:`~remote_dspark.tcp_round.
    TcpRounds`, over this end. Descriptors are checked and drafts unpacked by the same C
    as ``hf_round``'s (``hf_check_desc``, ``hf_unpack``): drafts go into a private
    slot-shaped image first and are copied in after the claim, so a late answer never
    touches a slot.

    Invariants: ``next`` is the next round to take; every round before it was returned
    by ``next_round`` or had been claimed by someone else when the proxy reached it.
    """

    def __init__(self, region: shm.Region, lib: native.Native, *, spin_us: int = 1000,
                 nap_us: int = 0, pid: int | None = None):
        super().__init__(region, lib)
        lay = self.layout
        self.counters = region.proxy_counters(lib)
        self.header = region.header_words(lib)
        offs = shm.PROXY_COUNTERS.offsets
        self._bounds = (ctypes.c_uint64 * len(shm.LATENCY_BOUNDS_NS))(*shm.LATENCY_BOUNDS_NS)
        self._seen = (ctypes.c_uint64 * lay.depth)()
        self._stamps = (ctypes.c_uint32 * lay.max_slots)()
        self._image = (ctypes.c_char * lay.drafts_stride)()
        self._image_addr = ctypes.addressof(self._image)
        self._state = native.ProxyState(
            ring=self._geom, heartbeat=region.addr(shm.OFF_HEARTBEAT),
            counters=self.counters.base,
            bounds=ctypes.addressof(self._bounds), seen_ns=ctypes.addressof(self._seen),
            stamps=ctypes.addressof(self._stamps),
            publish_timeout_ns=PUBLISH_TIMEOUT_NS, n_bounds=len(shm.LATENCY_BOUNDS_NS),
            next=seq_add(self.claimed(), 1), spin_us=spin_us, nap_us=nap_us,
            c_outcome=(ctypes.c_uint32 * 4)(*(offs[_PROXY_COUNTER[o]] // 8 for o in sorted(_PROXY_COUNTER))),
            c_late=offs["rounds_late"] // 8, c_drafts=offs["drafts"] // 8,
            c_draft_tokens=offs["draft_tokens"] // 8, h_round=offs["round_latency"] // 8,
            h_handoff=offs["handoff_latency"] // 8, d_counts=shm.D_COUNTS,
            d_entry_status=lay.d_entry_status, d_tokens=lay.d_tokens, d_margins=lay.d_margins,
            num_spec=lay.num_spec, max_slots=lay.max_slots, c_bad_desc=offs["rounds_bad_desc"] // 8)
        self._state_addr = ctypes.addressof(self._state)
        # This end's own link, for the checks of a round sent by Python (ofl): its receive
        # buffer grows to the largest DRAFTS payload seen.
        self._rx = (ctypes.c_char * 0)()
        self._rx_view = memoryview(self._rx).cast("B")
        self._link = self.new_link(0, 0)
        self._link_addr = ctypes.addressof(self._link)
        self.header.set_proxy_pid(os.getpid() if pid is None else pid)

    @property
    def next(self) -> int:
        """The next round this end will take."""
        return self._state.next

    @property
    def lib(self) -> native.Native:
        return self._lib

    @property
    def state_addr(self) -> int:
        """The address of this end's ``struct hf_proxy`` (for ``hf_round``)."""
        return self._state_addr

    @property
    def image_addr(self) -> int:
        """The address of the private drafts image ``hf_answer`` copies from."""
        return self._image_addr

    def new_link(self, rx: int, rx_cap: int, *, session: int = 0,
                 default_deadline_ms: int = 0) -> native.LinkState:
        """A ``struct hf_link`` over this end's region (descriptors, staging, the drafts
        image) with the receive buffer ``rx`` of ``rx_cap`` bytes; no connection yet."""
        lay, region = self.layout, self.region
        return native.LinkState(
            desc=region.addr(lay.desc(0)), staging=region.addr(lay.staging(0)), image=self._image_addr,
            rx=rx, desc_stride=lay.desc_stride, staging_stride=lay.staging_stride, session=session,
            row_bytes=lay.row_bytes, max_tokens=lay.max_tokens, rx_cap=rx_cap,
            max_entries=wire.MAX_ENTRIES, max_n_out=wire.MAX_N_OUT,
            default_deadline_ms=default_deadline_ms, fd=-1)

    def check_descriptor(self, round_id: int) -> None:
        """Check ``round_id``'s descriptor as ``hf_round`` does before sending it.

        Raises:
            ValueError: it breaks a rule, naming the field (and the entry).
        """
        if self._lib.check_desc(self._state_addr, self._link_addr, round_id) != 0:
            raise ValueError(f"round {round_id}: {self._link.why.decode(errors='replace')}")

    def next_round(self, timeout_s: float) -> ProxyRound | None:
        """Beat, then wait (GIL released, spin then nap) for the next gathered round
        nobody has answered; None at the deadline. Rounds already claimed are skipped,
        never sent."""
        r = self._lib.take(self._state_addr, int(timeout_s * 1e9) if timeout_s > 0 else 0)
        if r < 0:
            check(-r, "take a round")   # TIMEOUT: the wait has no other failure
            return None
        return ProxyRound(self, r, r & self._mask)

    def complete(self, rnd: ProxyRound, drafts: wire.Drafts | None = None,
                 outcome: Outcome = Outcome.OK) -> bool:
        """Answer ``rnd`` and release it: ``drafts`` with OK, or empty (``drafts`` None,
        or any failure outcome); counted in the proxy's block. True when released; False
        when another claimer (the watchdog) answered it first: the answer is dropped and
        counted ``rounds_late``.

        Raises:
            ValueError: ``outcome`` is not the proxy's, or ``drafts`` do not fit the
                round (checked before claiming: answer it with ERROR instead).
            RuntimeError: a ring invariant is broken (see ``native.check``), or the
                previous round's claimer never released it.
        """
        if not Outcome.OK <= outcome <= Outcome.BREAKER_SKIP:
            raise ValueError(f"outcome {outcome!r} is not one the proxy writes")
        r = rnd.round
        if drafts is None or outcome != Outcome.OK:
            rc = self._lib.answer(self._state_addr, r, outcome, None)
        elif self._pack(rnd, drafts):
            rc = self._lib.answer(self._state_addr, r, outcome, self._image_addr)
        else:
            rc = Status.LATE
            self.counters.add("rounds_late")
        if rc == Status.OK:
            return True
        status = check(rc, f"answer round {r}")
        if status is Status.TIMEOUT:
            raise RuntimeError(f"round {r} is claimed but round {seq_add(r, -1)}'s claimer did "
                               "not release it; the engine must release_orphans")
        return False   # LATE, counted

    def _pack(self, rnd: ProxyRound, d: wire.Drafts) -> bool:
        """Write ``d`` into the private drafts image, validated against the round; False
        when the round was claimed by someone else meanwhile (its descriptor may be reused
        already, so it cannot be checked against).

        Raises:
            ValueError: the drafts do not fit the round, while it is still unclaimed.
        """
        if not rnd.pending():
            return False
        try:
            self._pack_checked(rnd, d)
        except ValueError:
            if rnd.pending():   # nobody claimed it, so its descriptor is intact: a bad reply
                raise
            return False
        return True

    def _pack_checked(self, rnd: ProxyRound, d: wire.Drafts) -> None:
        """The DRAFTS payload of ``d`` into this end's receive buffer (one copy), then
        ``hf_unpack``: the checks and the unpacking of ``hf_round``, into the image.

        Raises:
            ValueError: ``d`` is not ``rnd``'s, breaks the wire's rules or does not fit
                the round (the C reader's verdict).
        """
        if d.round_id != rnd.round:
            raise ValueError(f"drafts for round {d.round_id}, expected {rnd.round}")
        payload = memoryview(wire.encode_drafts(d, 0))[wire.HEADER.size:]
        if len(payload) > len(self._rx):
            self._rx_view.release()
            self._rx = (ctypes.c_char * len(payload))()
            self._rx_view = memoryview(self._rx).cast("B")
            self._link.rx, self._link.rx_cap = ctypes.addressof(self._rx), len(payload)
        self._rx_view[:len(payload)] = payload
        if self._lib.unpack(self._state_addr, self._link_addr, rnd.round, len(payload)) != 0:
            raise ValueError(f"round {rnd.round}: {self._link.why.decode(errors='replace')}")

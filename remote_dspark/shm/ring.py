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
    engine     sees released >= r (acquire), on the CPU after a spin and a sleep on the
               released futex (counted in ``waiters``; every release above wakes it);
               reads drafts slot r % D

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

Here: the words, the engine's end and the watchdog; the proxy's end is
:mod:`remote_dspark.proxy.ring_end`. Both import only the standard library and the package's own
torch-free modules.
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .. import native, wire
from ..native import Status, check
from ..outcome import Outcome
from ..wire import seq_add, seq_geq  # noqa: F401  (ring.seq_*: the round ids' arithmetic)
from . import memfd

MASK = 0xFFFFFFFF
PUBLISH_TIMEOUT_NS = 1_000_000_000  # how long a claimer waits for the previous one


class RingFull(TimeoutError):
    """``depth`` rounds are in flight and none was released in time."""


def geometry(region: memfd.Region) -> native.RingGeom:
    """The native library's view of ``region``'s words and drafts slots."""
    lay = region.layout
    return native.RingGeom(
        gathered=region.addr(lay.gathered),
        released=region.addr(lay.released),
        claim=region.addr(lay.claim),
        waiters=region.addr(lay.waiters),
        gathered_ns=region.addr(lay.gathered_ns(0)),
        drafts=region.addr(lay.drafts(0)),
        drafts_stride=lay.drafts_stride,
        depth=lay.depth,
        d_round=memfd.D_ROUND,
        d_status=memfd.D_STATUS,
        d_zero=memfd.D_N,
        # An empty answer clears the tokens (and a sampled layout's q blocks) too, so the
        # engine can copy a slot's tokens and q blocks as they are whatever answered it
        # (an OK answer is zero past each count).
        zero_bytes=lay.zero_end - memfd.D_N,
    )


class RingEnd:
    """What both ends hold: the region, the library and the words' addresses."""

    def __init__(self, region: memfd.Region, lib: native.Native):
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
    counts: tuple[int, ...]  # per entry; () for an empty answer
    statuses: tuple[int, ...]  # per entry: wire.STATUS_OK / STATUS_RESYNC
    tokens: tuple[tuple[int, ...], ...]  # per entry, counts[i] tokens
    margins: tuple[tuple[float, ...], ...] | None


class Watchdog:
    """The native watchdog thread of one region (see ``EngineEnd.start_watchdog``)."""

    _handle = None

    def __init__(self, lib: native.Native, geom: native.RingGeom, counter_addr: int, limit_ns: int, poll_ns: int):
        self._lib = lib
        handle = lib.watchdog_start(ctypes.byref(geom), counter_addr, Outcome.WATCHDOG, limit_ns, poll_ns)
        if not handle:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot start the watchdog thread: {os.strerror(err)}")
        self._handle = handle

    def release_orphans(self, status: int) -> int | None:
        """Release a dead claimer's rounds (``EngineEnd.release_orphans``) under the
        thread's lock, so its own claim cannot come between the reads of released and
        claim; None once the thread is stopped (the caller releases them itself).

        Raises:
            RuntimeError: the released word does not move (a broken ring).
        """
        if self._handle is None:
            return None
        n = self._lib.watchdog_release_orphans(self._handle, status)
        if n < 0:
            check(-n, "release orphaned rounds")
            raise RuntimeError("orphaned rounds: the released word does not move")
        return n

    def stop(self) -> None:
        """Stop and join the thread. Idempotent."""
        handle, self._handle = self._handle, None
        if handle:
            check(self._lib.watchdog_stop(handle), "stop the watchdog")


class EngineEnd(RingEnd):
    """The engine's side of the ring: the single producer, the drafts reader and the
    engine's own releases (no proxy, orphans, the watchdog).

    Invariants: ``last`` is the last reserved round; ``last - released <= depth``.
    """

    def __init__(self, region: memfd.Region, lib: native.Native, *, start: int | None = None):
        """``start``: set gathered, claim and released to this round id (the round
        "before the first"), e.g. near 2^32 to exercise the wrap. Only while no proxy is
        attached."""
        super().__init__(region, lib)
        self.counters = region.engine_counters(lib)
        self.header = region.header_words(lib)
        if start is not None:
            for word in (self._gathered, self._claim, self._released, region.addr(region.layout.wake)):
                lib.store32(word, start & MASK)
        self._last = self.gathered()
        self._watchdog: Watchdog | None = None

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
        if seq_geq(self._lib.load32(self._released), seq_add(r, -self.layout.depth)):
            self._last = r  # room now: no wait, and the GIL is never handed to another thread
            return r
        rc = self._lib.wait_geq(
            self._released, seq_add(r, -self.layout.depth), spin_us, nap_us, native.deadline_ns(timeout_s)
        )
        if check(rc, "reserve a round") is Status.TIMEOUT:
            self.counters.add("ring_full")
            raise RingFull(
                f"round {r}: {self.layout.depth} rounds in flight, released is {self.released()} after {timeout_s}s"
            )
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
        tools: it walks the entries; the engine writes whole arrays in place); a sampled
        layout's with each entry's temperature and seed.

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
        frame = wire.encode_round_entries(round_id, 0, deadline_ms, entries, b"", 0, lay.sampled)
        payload = bytearray(frame[wire.HEADER.size :])
        struct.pack_into("<I", payload, 8, lay.row_bytes)
        with self.region.descriptor(round_id & self._mask) as d:
            struct.pack_into("<I", d, memfd.DESC_ROUND, round_id)
            d[memfd.DESC_FIXED : memfd.DESC_FIXED + len(payload)] = payload

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
            rnd, status, n, flags = memfd.DRAFTS_HEAD.unpack_from(d, 0)
            if rnd != round_id:
                raise RuntimeError(
                    f"drafts slot {round_id & self._mask} holds round {rnd}, "
                    f"expected {round_id}: read after the slot was reused"
                )
            counts = struct.unpack_from(f"<{n}i", d, memfd.D_COUNTS)
            statuses = struct.unpack_from(f"<{n}i", d, lay.d_entry_status)
            toks = struct.unpack_from(f"<{n * K}i", d, lay.d_tokens)
            marg = struct.unpack_from(f"<{n * K}f", d, lay.d_margins) if flags & memfd.DRAFTS_MARGINS else None
        rows = range(n)
        return RoundDrafts(
            round_id,
            Outcome(status),
            counts,
            statuses,
            tuple(toks[i * K : i * K + counts[i]] for i in rows),
            None if marg is None else tuple(marg[i * K : i * K + counts[i]] for i in rows),
        )

    def release_no_proxy(self, round_id: int) -> bool:
        """Answer ``round_id`` empty (NO_PROXY) and release it, when no proxy is up.
        False when somebody else answered it first."""
        rc = self._lib.release_empty(
            self._geom_ref, round_id, Outcome.NO_PROXY, native.deadline_ns(PUBLISH_TIMEOUT_NS / 1e9)
        )
        status = check(rc, f"release round {round_id} (no proxy)")
        if status is Status.TIMEOUT:
            raise RuntimeError(
                f"round {seq_add(round_id, -1)}'s claimer never released it; "
                "call release_orphans once that proxy is known dead"
            )
        if status is Status.OK:
            self.counters.add("no_proxy_rounds")
        return status is Status.OK

    def release_orphans(self) -> int:
        """Release the rounds a dead claimer holds (claimed, never released), empty with
        status ORPHAN; returns how many. Only once the proxy is known dead (its pidfd or
        waitpid said so): a live claimer may still be writing those drafts slots."""
        n = self._watchdog.release_orphans(Outcome.ORPHAN) if self._watchdog is not None else None
        if n is not None:
            if n:
                self.counters.add("orphan_releases", n)
            return n
        n = 0
        rel, claim = self.released(), self.claimed()
        while not seq_geq(rel, claim):
            r = seq_add(rel, 1)
            self._lib.zero_drafts(self._geom_ref, r, Outcome.ORPHAN)
            if (
                check(
                    self._lib.publish(self._released, self._geom.waiters, r, native.deadline_ns(1.0)),
                    f"release orphaned round {r}",
                )
                is not Status.OK
            ):
                raise RuntimeError(f"round {r}: released word stuck at {self.released()}")
            rel, n = r, n + 1
        if n:
            self.counters.add("orphan_releases", n)
        return n

    def drain(self, deadline: float) -> None:
        """Answer (no proxy) every round handed over so far, each once its stream has
        gathered it, until ``deadline``. Rounds not gathered by then are the watchdog's.
        Only gathered rounds are answered: the stream has finished with the drafts slot
        such a round reuses. A round a live proxy claimed first is left to it."""
        r, last = seq_add(self.released(), 1), self.last  # what was handed over by now only:
        while seq_geq(last, r):  # later rounds are a new proxy's
            left = deadline - time.monotonic()
            rc = self._lib.wait_geq(self._gathered, r, 100, 100, native.deadline_ns(max(left, 0.0)))
            if rc != Status.OK:
                return
            self.release_no_proxy(r)
            r = seq_add(r, 1)

    def fence(self, proxy_dead: bool) -> None:
        """Closing (any thread; the proxy stopped or stopping): answer every round
        gathered by now, target-only, through the claim the watchdog uses. With the
        proxy known dead its claimed rounds are released too (orphans); a live claimer's
        round is left to it (it answers within its deadline)."""
        if proxy_dead:
            self.release_orphans()
        gathered = self.gathered()
        while seq_geq(gathered, r := seq_add(self.released(), 1)):
            # Only the round right after ``released``, so the claim never waits on a
            # live claimer's release: a claimed round stops the pass until it is answered.
            if seq_geq(self.claimed(), r) or not self.release_no_proxy(r):
                return

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
        self._watchdog = wd
        return wd

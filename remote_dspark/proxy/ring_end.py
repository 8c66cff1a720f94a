"""The proxy's end of the ring (see :mod:`remote_dspark.shm.ring` for the protocol and its invariants):
take the next gathered round, read its descriptor where it lies, answer it once.
Torch-free: the proxy process imports it."""

from __future__ import annotations

import ctypes
import os

from .. import native, wire
from ..native import Status, check
from ..outcome import Outcome, RoundEvent
from ..shm import memfd
from ..shm.ring import PUBLISH_TIMEOUT_NS, RingEnd, seq_add, seq_geq

_PROXY_COUNTER = {
    Outcome.OK: "rounds_ok",
    Outcome.TIMEOUT: "rounds_timeout",
    Outcome.ERROR: "rounds_error",
    Outcome.BREAKER_SKIP: "rounds_breaker_skip",
}

NO_CONN = 0xFFFFFFFF  # struct hf_link's conn word with no connection: epoch 0, descriptor -1


class ProxyRound:
    """A round the proxy took from the ring. Its views are the region's own bytes."""

    __slots__ = ("round", "index", "_end")

    def __init__(self, end: ProxyEnd, round_id: int, index: int):
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
            return wire.ROUND_FIXED.unpack_from(d, memfd.DESC_FIXED)

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
        meta = wire.round_meta_bytes(n, lay.sampled)
        block = region.view(lay.desc(self.index) + memfd.DESC_FIXED, meta + 4 * n_tokens)
        rows = region.view(lay.staging(self.index), n * row_bytes)
        return [wire.encode_header(wire.ROUND, len(block) + len(rows), session, self.round), block, rows]

    def slots(self) -> tuple[int, ...]:
        """The slot id of each entry, in order.

        Raises:
            ValueError: the descriptor breaks a rule (``fields``).
        """
        n = self.fields()[1]
        at = self._end.layout.desc(self.index) + memfd.DESC_FIXED + wire.ROUND_FIXED.size
        with self._end.region.view(at, 4 * n) as raw, raw.cast("I") as slots:
            return tuple(slots)

    def pending(self) -> bool:
        """True while nobody has claimed the round. A proxy that sent the round and then
        finds it False may have sent a slot the engine was already rewriting."""
        return not seq_geq(self._end.claimed(), self.round)


class ProxyEnd(RingEnd):
    """The proxy's side: take rounds in order, answer each exactly once or drop the
    answer as late. One thread (the proxy loop) uses it.

    ``next_round`` and ``complete`` are one native call each (``hf_take``, ``hf_answer``:
    the wait, the heartbeat, the claim, the drafts, the release and every proxy counter
    and histogram are in C), for a proxy whose network round is in Python (the ofl
    transports); on TCP the whole round is one call, :class:`~remote_dspark.proxy.tcp_round.
    TcpRounds`, over this end. Descriptors are checked and drafts unpacked by the same C
    as ``hf_round``'s (``hf_check_desc``, ``hf_unpack``): drafts go into a private
    slot-shaped image first and are copied in after the claim, so a late answer never
    touches a slot.

    Invariants: ``next`` is the next round to take; every round before it was returned
    by ``next_round`` or had been claimed by someone else when the proxy reached it.
    """

    def __init__(
        self,
        region: memfd.Region,
        lib: native.Native,
        *,
        spin_us: int = 1000,
        nap_us: int = 0,
        pid: int | None = None,
        vocab_size: int = 0,
        want_margin: bool = False,
        want_sampled: bool | None = None,
    ):
        """``want_sampled``: the session asks for sampled drafts (HELLO's option; None:
        the region's, ``layout.sampled``).

        Raises:
            ValueError: ``want_sampled`` is not the region's layout's ``sampled``.
        """
        super().__init__(region, lib)
        lay = self.layout
        if want_sampled is not None and bool(want_sampled) != lay.sampled:
            raise ValueError(
                f"want_sampled={want_sampled!r}, but the region's layout has sampled={lay.sampled}: "
                "the engine and its proxy disagree on VLLM_DSPARK_SAMPLED_TOP32"
            )
        self.counters = region.proxy_counters(lib)
        self.header = region.header_words(lib)
        offs = memfd.PROXY_COUNTERS.offsets
        self._bounds = (ctypes.c_uint64 * len(memfd.LATENCY_BOUNDS_NS))(*memfd.LATENCY_BOUNDS_NS)
        self._seen = (ctypes.c_uint64 * lay.depth)()
        self._stamps = (ctypes.c_uint32 * lay.max_slots)()
        self._image = (ctypes.c_char * lay.drafts_stride)()
        self._image_addr = ctypes.addressof(self._image)
        self._state = native.ProxyState(
            ring=self._geom,
            heartbeat=region.addr(memfd.OFF_HEARTBEAT),
            counters=self.counters.base,
            bounds=ctypes.addressof(self._bounds),
            seen_ns=ctypes.addressof(self._seen),
            stamps=ctypes.addressof(self._stamps),
            publish_timeout_ns=PUBLISH_TIMEOUT_NS,
            n_bounds=len(memfd.LATENCY_BOUNDS_NS),
            next=seq_add(self.claimed(), 1),
            spin_us=spin_us,
            nap_us=nap_us,
            c_outcome=(ctypes.c_uint32 * 4)(*(offs[_PROXY_COUNTER[o]] // 8 for o in sorted(_PROXY_COUNTER))),
            c_late=offs["rounds_late"] // 8,
            c_drafts=offs["drafts"] // 8,
            c_draft_tokens=offs["draft_tokens"] // 8,
            h_round=offs["round_latency"] // 8,
            h_handoff=offs["handoff_latency"] // 8,
            d_counts=memfd.D_COUNTS,
            d_entry_status=lay.d_entry_status,
            d_tokens=lay.d_tokens,
            d_margins=lay.d_margins,
            num_spec=lay.num_spec,
            max_slots=lay.max_slots,
            c_bad_desc=offs["rounds_bad_desc"] // 8,
            vocab_size=vocab_size,
            want_margin=int(want_margin),
            want_sampled=int(lay.sampled),
            d_q_ids=lay.d_q_ids,
            d_q_weights=lay.d_q_weights,
            # An idle proxy sleeps on the engine's ``published`` word (nap_us or not).
            wake=region.addr(lay.wake),
            desc=region.addr(lay.desc(0)),
            desc_stride=lay.desc_stride,
        )
        self._state_addr = ctypes.addressof(self._state)
        # This end's own link, for the checks of a round sent by Python (ofl): its receive
        # buffer grows to the largest DRAFTS payload seen.
        self._rx = (ctypes.c_char * 0)()
        self._rx_view = memoryview(self._rx).cast("B")
        self._link = self.new_link(0, 0)
        self._link_addr = ctypes.addressof(self._link)
        self._checked: wire.DraftsFrame | None = None  # the drafts check_reply left in the image
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

    def new_link(self, rx: int, rx_cap: int, *, session: int = 0, default_deadline_ms: int = 0) -> native.LinkState:
        """A ``struct hf_link`` over this end's region (descriptors, staging, the drafts
        image) with the receive buffer ``rx`` of ``rx_cap`` bytes; no connection yet."""
        lay, region = self.layout, self.region
        return native.LinkState(
            desc=region.addr(lay.desc(0)),
            staging=region.addr(lay.staging(0)),
            image=self._image_addr,
            rx=rx,
            desc_stride=lay.desc_stride,
            staging_stride=lay.staging_stride,
            session=session,
            row_bytes=lay.row_bytes,
            max_tokens=lay.max_tokens,
            rx_cap=rx_cap,
            max_entries=wire.MAX_ENTRIES,
            max_n_out=wire.MAX_N_OUT,
            default_deadline_ms=default_deadline_ms,
            conn=NO_CONN,
            cur=NO_CONN,
            fd=-1,
        )

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
            check(-r, "take a round")  # TIMEOUT: the wait has no other failure
            return None
        return ProxyRound(self, r, r & self._mask)

    def complete(self, rnd: ProxyRound, drafts: wire.DraftsFrame | None = None, outcome: Outcome = Outcome.OK) -> bool:
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
            raise RuntimeError(
                f"round {r} is claimed but round {seq_add(r, -1)}'s claimer did "
                "not release it; the engine must release_orphans"
            )
        return False  # LATE, counted

    def check_reply(self, rnd: ProxyRound, d: wire.DraftsFrame) -> None:
        """Hold ``d`` to ``hf_round``'s rules for ``rnd`` (``hf_unpack``) before the round
        is answered, for a caller that received the reply itself (the ofl round: a
        ``check`` of ``RemoteLink.round``). A round claimed by someone else meanwhile is
        not checked (``complete`` drops its answer as late).

        Raises:
            wire.BadReply: well-formed drafts of other entries or slots (the connection
                is kept).
            wire.ProtocolError: any other broken rule (the connection is dropped).
        """
        self._checked = None
        if not rnd.pending():
            return
        try:
            self._pack_checked(rnd, d)
        except _Refused as e:
            if rnd.pending():  # nobody claimed it, so its descriptor is intact: a bad reply
                error = wire.BadReply if e.event == RoundEvent.BAD_REPLY else wire.ProtocolError
                raise error(str(e)) from None
            return
        self._checked = d  # the image holds d now: complete() need not unpack it again

    def _pack(self, rnd: ProxyRound, d: wire.DraftsFrame) -> bool:
        """Write ``d`` into the private drafts image, validated against the round; False
        when the round was claimed by someone else meanwhile (its descriptor may be reused
        already, so it cannot be checked against).

        Raises:
            ValueError: the drafts do not fit the round, while it is still unclaimed.
        """
        if not rnd.pending():
            return False
        if self._checked is d and d.round_id == rnd.round:
            self._checked = None
            return True
        try:
            self._pack_checked(rnd, d)
        except ValueError:
            if rnd.pending():  # nobody claimed it, so its descriptor is intact: a bad reply
                raise
            return False
        return True

    def _pack_checked(self, rnd: ProxyRound, d: wire.DraftsFrame) -> None:
        """The DRAFTS payload of ``d`` re-encoded (one copy), then ``unpack``.

        Raises:
            _Refused: ``d`` is not ``rnd``'s, breaks the wire's rules or does not fit
                the round (the C reader's verdict, its event attached).
        """
        if d.round_id != rnd.round:
            raise _Refused(RoundEvent.PROTOCOL, f"drafts for round {d.round_id}, expected {rnd.round}")
        event, why = self.unpack(rnd.round, memoryview(wire.encode_drafts(d, 0))[wire.HEADER.size :])
        if event != RoundEvent.OK:
            raise _Refused(event, f"round {rnd.round}: {why}")

    def unpack(self, round_id: int, payload) -> tuple[RoundEvent, str]:
        """``hf_unpack``, the C reader of ``hf_round``, on a DRAFTS ``payload`` (bytes-like,
        no header) for ``round_id``: its descriptor checked again, the payload checked by
        the wire's rules and against the round and the session's terms, and, when OK,
        unpacked into the private drafts image. Returns the event (OK, PROTOCOL,
        BAD_REPLY, BAD_DESC) and why ("" when OK). The binding of the C reply check that
        the tests hold to its Python twin, ``engine.reply.check_reply``."""
        payload = memoryview(payload).cast("B")
        if len(payload) > len(self._rx):  # the receive buffer grows to the largest payload seen
            self._rx_view.release()
            self._rx = (ctypes.c_char * len(payload))()
            self._rx_view = memoryview(self._rx).cast("B")
            self._link.rx, self._link.rx_cap = ctypes.addressof(self._rx), len(payload)
        self._rx_view[: len(payload)] = payload
        event = RoundEvent(self._lib.unpack(self._state_addr, self._link_addr, round_id, len(payload)))
        return event, "" if event == RoundEvent.OK else self._link.why.decode(errors="replace")


class _Refused(ValueError):
    """``hf_unpack`` refused a reply; ``event`` says how (PROTOCOL, BAD_REPLY, BAD_DESC)."""

    def __init__(self, event: RoundEvent, why: str):
        super().__init__(why)
        self.event = event

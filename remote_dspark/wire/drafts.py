"""``wire.drafts``: the DRAFTS frame, the worker's answer (part of the wire contract,
:mod:`remote_dspark.wire`).

DRAFTS payload (protocol 2; unchanged in 3)::

    fixed     n_entries u32, width u16, flags u16 (bit 0: margins present)
    slots     n x u32                 ROUND's slots, in ROUND's order
    counts    n x u16                 <= width, <= the entry's n_out; 0 with RESYNC
    statuses  n x u16                 STATUS_OK or STATUS_RESYNC
    tokens    n x width x i32         row i: entry i's drafts, zero past counts[i];
                                      each counted one in 0..vocab_size-1 (HELLO)
    margins   n x width x f32         exactly when HELLO's want_margin: each counted
                                      one finite, in [0, 1]

``status`` is ``STATUS_OK`` or ``STATUS_RESYNC`` (the worker has no window for the slot,
or a gap in its positions: the engine must re-announce the slot with NEW_GEN).

:func:`decode_drafts` checks what the frame alone tells (caps, length, counts <= width,
known statuses). Whether the reply answers the round that was asked (its session and
round in the header, its entries and slots, width <= num_spec, the counts, token ids
and margins above) is checked by the engine before anything is delivered, by one rule
written twice: ``engine.reply.check_reply`` (sync mode) and ``unpack_drafts`` in
``native/tcp_round.c`` (the proxy's rounds, both transports).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

from .frame import (
    DRAFTS,
    DRAFTS_FIXED,
    DRAFTS_MARGINS,
    MAX_ENTRIES,
    MAX_N_OUT,
    STATUS_RESYNC,
    Header,
    ProtocolError,
    encode_header,
    require,
)


@dataclass(frozen=True)
class DraftsSections:
    """Byte offsets of a DRAFTS payload's sections (``drafts_sections``)."""

    n: int
    width: int
    slots: int
    counts: int
    statuses: int
    tokens: int
    margins: int  # == size when there are no margins
    size: int


def drafts_sections(n: int, width: int, margins: bool) -> DraftsSections:
    """Where each section of a DRAFTS payload is."""
    slots = DRAFTS_FIXED.size
    counts = slots + 4 * n
    statuses = counts + 2 * n
    tokens = statuses + 2 * n
    marg = tokens + 4 * n * width
    return DraftsSections(n, width, slots, counts, statuses, tokens, marg, marg + (4 * n * width if margins else 0))


@dataclass(frozen=True)
class Drafts:
    """The worker's answer, per entry in ROUND order: ``counts[i]`` of row i's ``width``
    tokens are drafts. Decoded, every array is a view of the payload."""

    round_id: int
    slots: Sequence[int]
    counts: Sequence[int]
    statuses: Sequence[int]
    width: int
    tokens: Sequence[int]  # n x width, row-major; past count: 0
    margins: Sequence[float] | None = None  # n x width, when margins were asked for

    def row(self, i: int) -> list[int]:
        return list(self.tokens[i * self.width : i * self.width + self.counts[i]])


def encode_drafts(d: Drafts, session: int) -> bytes:
    """A whole DRAFTS frame from any sequences (the worker writes arrays in place with
    ``drafts_sections`` instead)."""
    n = len(d.slots)
    require(n <= MAX_ENTRIES and 0 <= d.width <= MAX_N_OUT, "DRAFTS over its caps")
    require(
        len(d.counts) == n == len(d.statuses) and len(d.tokens) == n * d.width,
        "DRAFTS fields disagree on the entry count",
    )
    parts = [
        DRAFTS_FIXED.pack(n, d.width, DRAFTS_MARGINS if d.margins is not None else 0),
        array.array("I", d.slots).tobytes(),
        array.array("H", d.counts).tobytes(),
        array.array("H", d.statuses).tobytes(),
        array.array("i", d.tokens).tobytes(),
    ]
    if d.margins is not None:
        require(len(d.margins) == n * d.width, "DRAFTS margins do not match tokens")
        parts.append(array.array("f", d.margins).tobytes())
    payload = b"".join(parts)
    return encode_header(DRAFTS, len(payload), session, d.round_id) + payload


def decode_drafts(hdr: Header, payload) -> Drafts:
    """Check a DRAFTS payload (caps, length, counts <= width, known statuses) and return
    views of its arrays.

    Raises:
        ProtocolError: naming the field that broke the contract.
    """
    mv = memoryview(payload).cast("B")
    if len(mv) < DRAFTS_FIXED.size:
        raise ProtocolError(f"DRAFTS payload of {len(mv)} bytes, under {DRAFTS_FIXED.size}")
    n, width, flags = DRAFTS_FIXED.unpack_from(mv)
    if n > MAX_ENTRIES or width > MAX_N_OUT:
        raise ProtocolError(f"DRAFTS of {n} entries x {width} over the caps")
    if flags & ~DRAFTS_MARGINS:
        raise ProtocolError(f"DRAFTS unknown flags {flags:#x}")
    has_m = bool(flags & DRAFTS_MARGINS)
    sec = drafts_sections(n, width, has_m)
    if len(mv) != sec.size:
        raise ProtocolError(f"DRAFTS payload of {len(mv)} bytes, its fields say {sec.size}")
    counts = mv[sec.counts : sec.statuses].cast("H")
    statuses = mv[sec.statuses : sec.tokens].cast("H")
    if n and max(counts) > width:
        raise ProtocolError(f"DRAFTS counts: {max(counts)} over the width {width}")
    if n and max(statuses) > STATUS_RESYNC:
        raise ProtocolError(f"DRAFTS statuses: unknown status {max(statuses)}")
    return Drafts(
        hdr.round,
        mv[sec.slots : sec.counts].cast("I"),
        counts,
        statuses,
        width,
        mv[sec.tokens : sec.margins].cast("i"),
        mv[sec.margins : sec.size].cast("f") if has_m else None,
    )

"""``wire.drafts``: the DRAFTS frame, the worker's answer (part of the wire contract,
:mod:`remote_dspark.wire`).

DRAFTS payload (protocol 2; the distributions since protocol 6)::

    fixed     n_entries u32, width u16, flags u16 (bit 0 DRAFTS_MARGINS: margins
                                      present; bit 1 DRAFTS_SAMPLED: distributions)
    slots     n x u32                 ROUND's slots, in ROUND's order
    counts    n x u16                 <= width, <= the entry's n_out; 0 with RESYNC
    statuses  n x u16                 STATUS_OK or STATUS_RESYNC
    tokens    n x width x i32         row i: entry i's drafts, zero past counts[i];
                                      each counted one in 0..vocab_size-1 (HELLO)
    margins   n x width x f32         exactly when HELLO's OPTION_MARGINS: each counted
                                      one finite, in [0, 1]
    q_ids     n x width x 32 x i32    exactly when HELLO's OPTION_SAMPLED: each drafted
                                      position's distribution, its 32 token ids
    q_weights n x width x 32 x u16    and their weights; both zero past counts[i]

``status`` is ``STATUS_OK`` or ``STATUS_RESYNC`` (the worker has no window for the slot,
or a gap in its positions: the engine must re-announce the slot with NEW_GEN).

A sampled reply (``DRAFTS_SAMPLED``) has at most ``MAX_SAMPLED_ENTRIES`` entries and a
width of at most ``MAX_SAMPLED_N_OUT`` (a sampled HELLO's caps): at most 3 MiB of
distributions. Each drafted position (j < counts[i]) holds the distribution its draft
was drawn from (SAMPLED_TOP32, :mod:`remote_dspark.drafter.sampling`): 32 distinct ids
in 0..vocab_size-1, weights summing to exactly ``SAMPLED_TOTAL`` (65535) and never
rising along the ids, the drafted token among the ids of weight > 0; draft j of entry i
is ``pick(q_ids[i, j], q_weights[i, j], uniform_u32(seed[i], p, j))``, ``p`` its
absolute position (the ROUND's ``positions[i]`` + the entry's token count + j). An entry
with RESYNC or with no drafts has zeros there.

:func:`decode_drafts` checks what the frame alone tells (caps, length, counts <= width,
known statuses). Whether the reply answers the round that was asked (its session and
round in the header, its entries and slots, width <= num_spec, the counts, token ids,
margins and distributions above) is checked by the engine before anything is
delivered, by one rule written twice: ``engine.reply.check_reply`` (sync mode) and
``hf_unpack_drafts`` in ``native/reply_check.c`` (the proxy's rounds, both transports).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

from .frame import (
    DRAFTS,
    DRAFTS_FIXED,
    DRAFTS_MARGINS,
    DRAFTS_SAMPLED,
    MAX_ENTRIES,
    MAX_N_OUT,
    MAX_SAMPLED_ENTRIES,
    MAX_SAMPLED_N_OUT,
    SAMPLED_TOP,
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
    margins: int  # == q_ids when there are no margins
    size: int
    q_ids: int = 0  # == q_weights == size when there are no distributions
    q_weights: int = 0


def drafts_sections(n: int, width: int, margins: bool, sampled: bool = False) -> DraftsSections:
    """Where each section of a DRAFTS payload is (``sampled``: with the distributions)."""
    slots = DRAFTS_FIXED.size
    counts = slots + 4 * n
    statuses = counts + 2 * n
    tokens = statuses + 2 * n
    marg = tokens + 4 * n * width
    q_ids = marg + (4 * n * width if margins else 0)
    q_weights = q_ids + (4 * n * width * SAMPLED_TOP if sampled else 0)
    size = q_weights + (2 * n * width * SAMPLED_TOP if sampled else 0)
    return DraftsSections(n, width, slots, counts, statuses, tokens, marg, size, q_ids, q_weights)


@dataclass(frozen=True)
class DraftsFrame:
    """The worker's answer, per entry in ROUND order: ``counts[i]`` of row i's ``width``
    tokens are drafts. Decoded, every array is a view of the payload."""

    round_id: int
    slots: Sequence[int]
    counts: Sequence[int]
    statuses: Sequence[int]
    width: int
    tokens: Sequence[int]  # n x width, row-major; past count: 0
    margins: Sequence[float] | None = None  # n x width, when margins were asked for
    q_ids: Sequence[int] | None = None  # n x width x 32, row-major, when a sampled session's
    q_weights: Sequence[int] | None = None  # n x width x 32 (u16), when a sampled session's

    @property
    def sampled(self) -> bool:
        return self.q_ids is not None

    def row(self, i: int) -> list[int]:
        return list(self.tokens[i * self.width : i * self.width + self.counts[i]])


def encode_drafts(d: DraftsFrame, session: int) -> bytes:
    """A whole DRAFTS frame from any sequences (the worker writes arrays in place with
    ``drafts_sections`` instead)."""
    n = len(d.slots)
    require(n <= MAX_ENTRIES and 0 <= d.width <= MAX_N_OUT, "DRAFTS over its caps")
    require(
        len(d.counts) == n == len(d.statuses) and len(d.tokens) == n * d.width,
        "DRAFTS fields disagree on the entry count",
    )
    require(d.sampled == (d.q_weights is not None), "DRAFTS q_ids and q_weights: both (sampled) or neither")
    if d.sampled:
        require(
            n <= MAX_SAMPLED_ENTRIES and d.width <= MAX_SAMPLED_N_OUT,
            f"sampled DRAFTS of {n} entries x {d.width} over the caps {MAX_SAMPLED_ENTRIES} x {MAX_SAMPLED_N_OUT}",
        )
        size = n * d.width * SAMPLED_TOP
        require(len(d.q_ids) == size == len(d.q_weights), "DRAFTS q_ids or q_weights do not match n x width x 32")
    flags = (DRAFTS_MARGINS if d.margins is not None else 0) | (DRAFTS_SAMPLED if d.sampled else 0)
    parts = [
        DRAFTS_FIXED.pack(n, d.width, flags),
        array.array("I", d.slots).tobytes(),
        array.array("H", d.counts).tobytes(),
        array.array("H", d.statuses).tobytes(),
        array.array("i", d.tokens).tobytes(),
    ]
    if d.margins is not None:
        require(len(d.margins) == n * d.width, "DRAFTS margins do not match tokens")
        parts.append(array.array("f", d.margins).tobytes())
    if d.sampled:
        parts += [array.array("i", d.q_ids).tobytes(), array.array("H", d.q_weights).tobytes()]
    payload = b"".join(parts)
    return encode_header(DRAFTS, len(payload), session, d.round_id) + payload


def decode_drafts(hdr: Header, payload) -> DraftsFrame:
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
    if flags & ~(DRAFTS_MARGINS | DRAFTS_SAMPLED):
        raise ProtocolError(f"DRAFTS unknown flags {flags:#x}")
    has_m, has_q = bool(flags & DRAFTS_MARGINS), bool(flags & DRAFTS_SAMPLED)
    if has_q and (n > MAX_SAMPLED_ENTRIES or width > MAX_SAMPLED_N_OUT):
        raise ProtocolError(
            f"sampled DRAFTS of {n} entries x {width} over the caps {MAX_SAMPLED_ENTRIES} x {MAX_SAMPLED_N_OUT}"
        )
    sec = drafts_sections(n, width, has_m, has_q)
    if len(mv) != sec.size:
        raise ProtocolError(f"DRAFTS payload of {len(mv)} bytes, its fields say {sec.size}")
    counts = mv[sec.counts : sec.statuses].cast("H")
    statuses = mv[sec.statuses : sec.tokens].cast("H")
    if n and max(counts) > width:
        raise ProtocolError(f"DRAFTS counts: {max(counts)} over the width {width}")
    if n and max(statuses) > STATUS_RESYNC:
        raise ProtocolError(f"DRAFTS statuses: unknown status {max(statuses)}")
    return DraftsFrame(
        hdr.round,
        mv[sec.slots : sec.counts].cast("I"),
        counts,
        statuses,
        width,
        mv[sec.tokens : sec.margins].cast("i"),
        mv[sec.margins : sec.q_ids].cast("f") if has_m else None,
        mv[sec.q_ids : sec.q_weights].cast("i") if has_q else None,
        mv[sec.q_weights : sec.size].cast("H") if has_q else None,
    )

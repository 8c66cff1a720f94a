"""``wire.round``: the ROUND frame (part of the wire contract, :mod:`remote_dspark.wire`).

ROUND payload (unchanged since protocol 2; the protocol is 3): the engine's own batch
layout, each section one array laid end to end, so encoding is copying whole arrays into
place and decoding is taking views (``round_sections`` gives every offset)::

    fixed     deadline_ms u32, n_entries u32, row_bytes u32, n_tokens u32
    slots     n x u32                 the entry's slot, < the session's max_slots, unique
    positions n x u32                 the position of the entry's first token
    n_out     n x u32                 drafts wanted, <= MAX_N_OUT
    flags     n x u32                 bit 0: FLAG_NEW_GEN
    offsets   (n + 1) x u32           entry i owns tokens[offsets[i]:offsets[i + 1]]:
                                      offsets[0] = 0, non-decreasing, offsets[n] = n_tokens
    tokens    n_tokens x i32          flat, entry order (as vLLM's query_start_loc)
    rows      n x row_bytes           opaque bytes, entry order

Every section but the rows is 4-byte aligned, so the proxy sends the first seven as one
block straight from its descriptor and the rows straight from the staging slot (one
``sendmsg``, nothing copied). An entry's tokens are the ones accepted since its
previous round, starting at ``positions[i]``; with ``FLAG_NEW_GEN`` they are the slot's
whole context and replace whatever the worker had for it.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

from .frame import (
    FLAG_NEW_GEN,
    MAX_ENTRIES,
    MAX_N_OUT,
    MAX_PAYLOAD,
    MAX_ROW_BYTES,
    MAX_TOKENS,
    ROUND,
    ROUND_FIXED,
    Header,
    ProtocolError,
    encode_header,
    require,
)

ROUND_ARRAYS = ("slots", "positions", "n_out", "flags", "offsets")  # u32 each, in order


@dataclass(frozen=True)
class RoundSections:
    """Byte offsets of a ROUND payload's sections (``round_sections``). ``meta`` is the
    fixed part and the five entry arrays; ``tokens`` starts there; ``rows`` follow the
    tokens; ``size`` is the whole payload."""

    n: int
    n_tokens: int
    row_bytes: int
    slots: int
    positions: int
    n_out: int
    flags: int
    offsets: int
    tokens: int
    rows: int
    size: int

    @property
    def meta(self) -> int:
        return self.tokens


def round_meta_bytes(n: int) -> int:
    """Bytes of a ROUND's fixed part and entry arrays for ``n`` entries (the tokens
    start there)."""
    return ROUND_FIXED.size + 4 * (5 * n + 1)


def round_sections(n: int, n_tokens: int, row_bytes: int) -> RoundSections:
    """Where each section of a ROUND payload of ``n`` entries and ``n_tokens`` tokens is."""
    at = ROUND_FIXED.size
    slots, positions, n_out, flags = at, at + 4 * n, at + 8 * n, at + 12 * n
    offsets = at + 16 * n
    tokens = round_meta_bytes(n)
    rows = tokens + 4 * n_tokens
    return RoundSections(
        n, n_tokens, row_bytes, slots, positions, n_out, flags, offsets, tokens, rows, rows + n * row_bytes
    )


@dataclass(frozen=True)
class Entry:
    """One slot of a round, as a record (the slow convenience: tests and simple clients;
    the engine and the worker move whole arrays). ``tokens`` are those accepted since the
    slot's previous round (from ``position`` on), or its whole context when ``new_gen``."""

    slot: int
    n_out: int
    position: int
    tokens: Sequence[int]
    new_gen: bool = False


@dataclass(frozen=True)
class Round:
    """A decoded ROUND: every array a view of the payload (``memoryview`` cast to u32,
    tokens to i32), valid while the payload is."""

    round_id: int
    deadline_ms: int
    row_bytes: int
    slots: Sequence[int]
    positions: Sequence[int]
    n_out: Sequence[int]
    flags: Sequence[int]
    offsets: Sequence[int]
    tokens: Sequence[int]
    rows: memoryview  # n x row_bytes, entry order

    def __len__(self) -> int:
        return len(self.slots)

    def entries(self) -> list[Entry]:
        """The round as records (slow: a loop over entries; tests and tools)."""
        o = self.offsets
        return [
            Entry(
                self.slots[i],
                self.n_out[i],
                self.positions[i],
                list(self.tokens[o[i] : o[i + 1]]),
                bool(self.flags[i] & FLAG_NEW_GEN),
            )
            for i in range(len(self))
        ]


def encode_round_entries(
    round_id: int, session: int, deadline_ms: int, entries: Sequence[Entry], rows, row_bytes: int
) -> bytes:
    """A whole ROUND frame from records (the slow reference encoder: tests and simple
    clients; it walks the entries).

    Raises:
        ValueError: an entry breaks a cap, or ``rows`` is not entries x row_bytes.
    """
    offsets = [0]
    for e in entries:
        offsets.append(offsets[-1] + len(e.tokens))
    return encode_round(
        round_id,
        session,
        deadline_ms,
        slots=[e.slot for e in entries],
        positions=[e.position for e in entries],
        n_out=[e.n_out for e in entries],
        flags=[FLAG_NEW_GEN if e.new_gen else 0 for e in entries],
        offsets=offsets,
        tokens=[t for e in entries for t in e.tokens],
        rows=rows,
        row_bytes=row_bytes,
    )


def encode_round(
    round_id: int,
    session: int,
    deadline_ms: int,
    *,
    slots,
    positions,
    n_out,
    flags,
    offsets,
    tokens,
    rows,
    row_bytes: int,
) -> bytes:
    """A whole ROUND frame from its arrays (any int sequences; ``rows`` bytes-like).

    Raises:
        ValueError: the arrays disagree on their lengths or break a cap.
    """
    n = len(slots)
    require(n <= MAX_ENTRIES, f"{n} entries over the cap {MAX_ENTRIES}")
    require(row_bytes <= MAX_ROW_BYTES, f"row_bytes {row_bytes} over the cap {MAX_ROW_BYTES}")
    require(
        len(positions) == len(n_out) == len(flags) == n and len(offsets) == n + 1,
        "ROUND arrays disagree on the entry count",
    )
    require(len(tokens) <= MAX_TOKENS, f"{len(tokens)} tokens over the cap {MAX_TOKENS}")
    require(offsets[0] == 0 and offsets[-1] == len(tokens), "offsets must run from 0 to len(tokens)")
    require(len(rows) == n * row_bytes, "rows do not match entries x row_bytes")
    require(max(n_out, default=0) <= MAX_N_OUT, f"n_out over {MAX_N_OUT}")
    sec = round_sections(n, len(tokens), row_bytes)
    require(sec.size <= MAX_PAYLOAD, f"ROUND of {sec.size} bytes over the cap {MAX_PAYLOAD}")
    meta = array.array("I", [deadline_ms, n, row_bytes, len(tokens)])
    for part in (slots, positions, n_out, flags, offsets):
        meta.extend(part)
    return (
        encode_header(ROUND, sec.size, session, round_id)
        + meta.tobytes()
        + array.array("i", tokens).tobytes()
        + bytes(rows)
    )


def decode_round(hdr: Header, payload) -> Round:
    """Check a ROUND payload and return views of its arrays.

    Every rule of the contract is checked here, with C-speed builtins over the arrays
    (no loop over entries in Python): the sizes against the caps and the payload's
    length, known flags, ``n_out`` caps, and offsets that run from 0 to ``n_tokens``
    without going back. What only the receiver knows (its slot range, unique slots) is
    the receiver's to check.

    Raises:
        ProtocolError: naming the field that broke the contract.
    """
    mv = memoryview(payload).cast("B")
    if len(mv) < ROUND_FIXED.size:
        raise ProtocolError(f"ROUND payload of {len(mv)} bytes, under {ROUND_FIXED.size}")
    deadline_ms, n, row_bytes, n_tokens = ROUND_FIXED.unpack_from(mv)
    if n > MAX_ENTRIES:
        raise ProtocolError(f"ROUND with {n} entries over the cap {MAX_ENTRIES}")
    if row_bytes > MAX_ROW_BYTES:
        raise ProtocolError(f"ROUND row_bytes {row_bytes} over the cap {MAX_ROW_BYTES}")
    if n_tokens > MAX_TOKENS:
        raise ProtocolError(f"ROUND with {n_tokens} tokens over the cap {MAX_TOKENS}")
    sec = round_sections(n, n_tokens, row_bytes)
    if len(mv) != sec.size:
        raise ProtocolError(f"ROUND payload of {len(mv)} bytes, its fields say {sec.size}")
    u32 = mv[ROUND_FIXED.size : sec.tokens].cast("I")
    slots, positions, n_out, flags = (u32[k * n : (k + 1) * n] for k in range(4))
    offsets = u32[4 * n :]
    if n and max(flags) & ~FLAG_NEW_GEN:
        raise ProtocolError(f"ROUND flags: unknown bits {max(flags) & ~FLAG_NEW_GEN:#x}")
    if n and max(n_out) > MAX_N_OUT:
        raise ProtocolError(f"ROUND n_out: {max(n_out)} over the cap {MAX_N_OUT}")
    if offsets[0] != 0 or offsets[n] != n_tokens:
        raise ProtocolError(f"ROUND offsets run from {offsets[0]} to {offsets[n]}, expected 0 to n_tokens={n_tokens}")
    if n > 1 and offsets.tolist() != sorted(offsets):
        raise ProtocolError("ROUND offsets go back: an entry with a negative token count")
    return Round(
        hdr.round,
        deadline_ms,
        row_bytes,
        slots,
        positions,
        n_out,
        flags,
        offsets,
        mv[sec.tokens : sec.rows].cast("i"),
        mv[sec.rows : sec.size],
    )

"""The wire contract between the engine side (proxy) and the remote drafter (worker).

Every frame is a fixed 24-byte header followed by a payload. All integers are
little-endian. The header is checked, and every length in it capped, before a single
byte of payload is allocated or read; a frame that breaks any rule raises
:class:`ProtocolError`, which drops that one connection and nothing else.

Header (``HEADER``, 24 bytes)::

    offset size field
         0    4 magic          b"DSPW"
         4    2 version        PROTOCOL_VERSION
         6    2 type           HELLO=1 HELLO_ACK=2 ROUND=3 DRAFTS=4 BYE=5
         8    4 payload_len    <= MAX_PAYLOAD and the type's own cap
        12    8 session        the proxy's session (new for every proxy process)
        20    4 round          the round id (cyclic u32); 0 outside ROUND/DRAFTS

HELLO payload (``_HELLO``, 84 bytes): drafter identity (32 B), Markov identity (32 B),
engine id (u64: stays the same across the engine's proxy respawns, so the worker can
drop an old session's windows), max_slots (u32), row_bytes (u32), num_spec (u16),
row_format (u8), want_margin (u8).

HELLO_ACK payload: accept (u8), reason code (u8), reason length (u16), the worker's
drafter and Markov identities (32 B each), then the reason (UTF-8, <= MAX_REASON).

ROUND payload (protocol 2): the engine's own batch layout, each section one array laid
end to end, so encoding is copying whole arrays into place and decoding is taking views
(``round_sections`` gives every offset)::

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

DRAFTS payload (protocol 2)::

    fixed     n_entries u32, width u16, flags u16 (bit 0: margins present)
    slots     n x u32                 ROUND's slots, in ROUND's order
    counts    n x u16                 <= width
    statuses  n x u16                 STATUS_OK or STATUS_RESYNC
    tokens    n x width x i32         row i: entry i's drafts, zero past counts[i]
    margins   n x width x f32         only with DRAFTS_MARGINS

``status`` is ``STATUS_OK`` or ``STATUS_RESYNC`` (the worker has no window for the slot,
or a gap in its positions: the engine must re-announce the slot with NEW_GEN).

BYE has an empty payload.
"""

from __future__ import annotations

import array
import struct
import sys
from dataclasses import dataclass
from typing import Sequence

# Sections are read as native arrays (memoryview casts, numpy views): little-endian hosts only.
if sys.byteorder != "little":
    raise ImportError("remote_dspark.wire: the wire is little-endian and is read in place; "
                      "this host is big-endian")

MAGIC = b"DSPW"
PROTOCOL_VERSION = 2

HELLO, HELLO_ACK, ROUND, DRAFTS, BYE = 1, 2, 3, 4, 5
FRAME_NAMES = {HELLO: "HELLO", HELLO_ACK: "HELLO_ACK", ROUND: "ROUND", DRAFTS: "DRAFTS", BYE: "BYE"}

FLAG_NEW_GEN = 1
DRAFTS_MARGINS = 1
STATUS_OK, STATUS_RESYNC = 0, 1

# HELLO_ACK reason codes.
ACCEPT, REFUSE_DRAFTER, REFUSE_MARKOV, REFUSE_VERSION, REFUSE_LIMITS, REFUSE_MALFORMED = range(6)

# Caps, checked before any allocation. A peer that needs more is refused, not served.
MAX_PAYLOAD = 64 << 20
MAX_ENTRIES = 4096
MAX_ROW_BYTES = 1 << 20
MAX_N_OUT = 64
MAX_TOKENS = 1 << 22          # all tokens of one ROUND (NEW_GEN contexts included)
MAX_REASON = 512

HEADER = struct.Struct("<4sHHIQI")
_HELLO = struct.Struct("<32s32sQIIHBB")
_ACK = struct.Struct("<BBH32s32s")
ROUND_FIXED = struct.Struct("<IIII")
DRAFTS_FIXED = struct.Struct("<IHH")

# The largest payload each frame type may announce (the header is refused above it).
_TYPE_CAP = {
    HELLO: _HELLO.size,
    HELLO_ACK: _ACK.size + MAX_REASON,
    ROUND: MAX_PAYLOAD,
    DRAFTS: DRAFTS_FIXED.size + MAX_ENTRIES * (8 + 8 * MAX_N_OUT),
    BYE: 0,
}


def frame_cap(ftype: int) -> int:
    """The largest payload a frame of type ``ftype`` may announce."""
    return _TYPE_CAP[ftype]


class ProtocolError(Exception):
    """A frame that breaks the contract. The connection it came on must be dropped."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version (``version`` is what it sent)."""

    def __init__(self, version: int):
        super().__init__(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
        self.version = version


def parse_hex32(raw: str, name: str) -> bytes:
    """Parse a 64-hex-digit identity; ``name`` (the variable or option) is in the error.

    Raises:
        ValueError: naming ``name`` and the value, when it is not 64 hex digits.
    """
    text = raw.strip().lower()
    if text.startswith("0x"):
        text = text[2:]
    if len(text) != 64:
        raise ValueError(f"{name}={raw!r}: expected 64 hex digits (32 bytes), got {len(text)}")
    try:
        return bytes.fromhex(text)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r}: not hexadecimal") from e


@dataclass(frozen=True)
class Header:
    type: int
    payload_len: int
    session: int
    round: int

    @property
    def name(self) -> str:
        return FRAME_NAMES.get(self.type, str(self.type))


def encode_header(ftype: int, payload_len: int, session: int = 0, round_id: int = 0) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, ftype, payload_len, session, round_id & 0xFFFFFFFF)


def pack_header_into(buf, ftype: int, payload_len: int, session: int = 0, round_id: int = 0) -> None:
    """``encode_header`` written at the start of ``buf`` (a send buffer reused per round)."""
    HEADER.pack_into(buf, 0, MAGIC, PROTOCOL_VERSION, ftype, payload_len, session, round_id & 0xFFFFFFFF)


def decode_header(buf) -> Header:
    """Check a header. Raises ProtocolError before the caller allocates the payload."""
    if len(buf) != HEADER.size:
        raise ProtocolError(f"truncated header: {len(buf)} of {HEADER.size} bytes")
    magic, version, ftype, length, session, round_id = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(version)
    cap = _TYPE_CAP.get(ftype)
    if cap is None:
        raise ProtocolError(f"unknown frame type {ftype}")
    if length > cap:
        raise ProtocolError(f"{FRAME_NAMES[ftype]} payload of {length} bytes exceeds the cap {cap}")
    return Header(ftype, length, session, round_id)


# --------------------------------------------------------------------------- HELLO


@dataclass(frozen=True)
class Hello:
    drafter_identity: bytes
    markov_identity: bytes
    engine_id: int
    max_slots: int
    row_bytes: int
    num_spec: int
    row_format: int = 0
    want_margin: bool = False


def encode_hello(h: Hello, session: int) -> bytes:
    _check(len(h.drafter_identity) == 32 and len(h.markov_identity) == 32, "identities are 32 bytes")
    _check(0 < h.max_slots <= MAX_ENTRIES, f"max_slots {h.max_slots} not in 1..{MAX_ENTRIES}")
    _check(0 <= h.row_bytes <= MAX_ROW_BYTES, f"row_bytes {h.row_bytes} over {MAX_ROW_BYTES}")
    _check(0 < h.num_spec <= MAX_N_OUT, f"num_spec {h.num_spec} not in 1..{MAX_N_OUT}")
    payload = _HELLO.pack(h.drafter_identity, h.markov_identity, h.engine_id, h.max_slots,
                          h.row_bytes, h.num_spec, h.row_format, int(h.want_margin))
    return encode_header(HELLO, len(payload), session) + payload


def decode_hello(payload) -> Hello:
    if len(payload) != _HELLO.size:
        raise ProtocolError(f"HELLO payload of {len(payload)} bytes, expected {_HELLO.size}")
    d, m, engine_id, max_slots, row_bytes, num_spec, row_format, want = _HELLO.unpack(payload)
    if not 0 < max_slots <= MAX_ENTRIES:
        raise ProtocolError(f"HELLO max_slots {max_slots} not in 1..{MAX_ENTRIES}")
    if row_bytes > MAX_ROW_BYTES:
        raise ProtocolError(f"HELLO row_bytes {row_bytes} over the cap {MAX_ROW_BYTES}")
    if not 0 < num_spec <= MAX_N_OUT:
        raise ProtocolError(f"HELLO num_spec {num_spec} not in 1..{MAX_N_OUT}")
    if want > 1:
        raise ProtocolError(f"HELLO want_margin {want} is not 0 or 1")
    return Hello(d, m, engine_id, max_slots, row_bytes, num_spec, row_format, bool(want))


@dataclass(frozen=True)
class HelloAck:
    code: int
    drafter_identity: bytes
    markov_identity: bytes
    reason: str = ""

    @property
    def accepted(self) -> bool:
        return self.code == ACCEPT


def encode_hello_ack(a: HelloAck, session: int) -> bytes:
    reason = a.reason.encode("utf-8")[:MAX_REASON]
    payload = _ACK.pack(int(a.code == ACCEPT), a.code, len(reason),
                        a.drafter_identity, a.markov_identity) + reason
    return encode_header(HELLO_ACK, len(payload), session) + payload


def decode_hello_ack(payload) -> HelloAck:
    if len(payload) < _ACK.size:
        raise ProtocolError(f"HELLO_ACK payload of {len(payload)} bytes, under {_ACK.size}")
    accept, code, n, d, m = _ACK.unpack_from(payload)
    if len(payload) != _ACK.size + n:
        raise ProtocolError(f"HELLO_ACK reason length {n} does not match the payload")
    if accept != (code == ACCEPT) or code > REFUSE_MALFORMED:
        raise ProtocolError(f"HELLO_ACK accept={accept} with reason code {code}")
    reason = bytes(payload[_ACK.size:]).decode("utf-8", errors="replace")
    return HelloAck(code, d, m, reason)


# --------------------------------------------------------------------------- ROUND

ROUND_ARRAYS = ("slots", "positions", "n_out", "flags", "offsets")   # u32 each, in order


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
    return RoundSections(n, n_tokens, row_bytes, slots, positions, n_out, flags, offsets, tokens,
                         rows, rows + n * row_bytes)


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
    rows: memoryview          # n x row_bytes, entry order

    def __len__(self) -> int:
        return len(self.slots)

    def entries(self) -> list[Entry]:
        """The round as records (slow: a loop over entries; tests and tools)."""
        o = self.offsets
        return [Entry(self.slots[i], self.n_out[i], self.positions[i], list(self.tokens[o[i]:o[i + 1]]),
                      bool(self.flags[i] & FLAG_NEW_GEN)) for i in range(len(self))]


def encode_round_entries(round_id: int, session: int, deadline_ms: int, entries: Sequence[Entry],
                         rows, row_bytes: int) -> bytes:
    """A whole ROUND frame from records (the slow reference encoder: tests and simple
    clients; it walks the entries).

    Raises:
        ValueError: an entry breaks a cap, or ``rows`` is not entries x row_bytes.
    """
    offsets = [0]
    for e in entries:
        offsets.append(offsets[-1] + len(e.tokens))
    return encode_round(round_id, session, deadline_ms,
                        slots=[e.slot for e in entries], positions=[e.position for e in entries],
                        n_out=[e.n_out for e in entries],
                        flags=[FLAG_NEW_GEN if e.new_gen else 0 for e in entries], offsets=offsets,
                        tokens=[t for e in entries for t in e.tokens], rows=rows, row_bytes=row_bytes)


def encode_round(round_id: int, session: int, deadline_ms: int, *, slots, positions, n_out, flags,
                 offsets, tokens, rows, row_bytes: int) -> bytes:
    """A whole ROUND frame from its arrays (any int sequences; ``rows`` bytes-like).

    Raises:
        ValueError: the arrays disagree on their lengths or break a cap.
    """
    n = len(slots)
    _check(n <= MAX_ENTRIES, f"{n} entries over the cap {MAX_ENTRIES}")
    _check(row_bytes <= MAX_ROW_BYTES, f"row_bytes {row_bytes} over the cap {MAX_ROW_BYTES}")
    _check(len(positions) == len(n_out) == len(flags) == n and len(offsets) == n + 1,
           "ROUND arrays disagree on the entry count")
    _check(len(tokens) <= MAX_TOKENS, f"{len(tokens)} tokens over the cap {MAX_TOKENS}")
    _check(offsets[0] == 0 and offsets[-1] == len(tokens), "offsets must run from 0 to len(tokens)")
    _check(len(rows) == n * row_bytes, "rows do not match entries x row_bytes")
    _check(max(n_out, default=0) <= MAX_N_OUT, f"n_out over {MAX_N_OUT}")
    sec = round_sections(n, len(tokens), row_bytes)
    _check(sec.size <= MAX_PAYLOAD, f"ROUND of {sec.size} bytes over the cap {MAX_PAYLOAD}")
    meta = array.array("I", [deadline_ms, n, row_bytes, len(tokens)])
    for part in (slots, positions, n_out, flags, offsets):
        meta.extend(part)
    return (encode_header(ROUND, sec.size, session, round_id) + meta.tobytes()
            + array.array("i", tokens).tobytes() + bytes(rows))


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
    u32 = mv[ROUND_FIXED.size:sec.tokens].cast("I")
    slots, positions, n_out, flags = (u32[k * n:(k + 1) * n] for k in range(4))
    offsets = u32[4 * n:]
    if n and max(flags) & ~FLAG_NEW_GEN:
        raise ProtocolError(f"ROUND flags: unknown bits {max(flags) & ~FLAG_NEW_GEN:#x}")
    if n and max(n_out) > MAX_N_OUT:
        raise ProtocolError(f"ROUND n_out: {max(n_out)} over the cap {MAX_N_OUT}")
    if offsets[0] != 0 or offsets[n] != n_tokens:
        raise ProtocolError(f"ROUND offsets run from {offsets[0]} to {offsets[n]}, "
                            f"expected 0 to n_tokens={n_tokens}")
    if n > 1 and offsets.tolist() != sorted(offsets):
        raise ProtocolError("ROUND offsets go back: an entry with a negative token count")
    return Round(hdr.round, deadline_ms, row_bytes, slots, positions, n_out, flags, offsets,
                 mv[sec.tokens:sec.rows].cast("i"), mv[sec.rows:sec.size])


# --------------------------------------------------------------------------- DRAFTS


@dataclass(frozen=True)
class DraftsSections:
    """Byte offsets of a DRAFTS payload's sections (``drafts_sections``)."""

    n: int
    width: int
    slots: int
    counts: int
    statuses: int
    tokens: int
    margins: int      # == size when there are no margins
    size: int


def drafts_sections(n: int, width: int, margins: bool) -> DraftsSections:
    """Where each section of a DRAFTS payload is."""
    slots = DRAFTS_FIXED.size
    counts = slots + 4 * n
    statuses = counts + 2 * n
    tokens = statuses + 2 * n
    marg = tokens + 4 * n * width
    return DraftsSections(n, width, slots, counts, statuses, tokens, marg,
                          marg + (4 * n * width if margins else 0))


@dataclass(frozen=True)
class Drafts:
    """The worker's answer, per entry in ROUND order: ``counts[i]`` of row i's ``width``
    tokens are drafts. Decoded, every array is a view of the payload."""

    round_id: int
    slots: Sequence[int]
    counts: Sequence[int]
    statuses: Sequence[int]
    width: int
    tokens: Sequence[int]                   # n x width, row-major; past count: 0
    margins: Sequence[float] | None = None  # n x width, when margins were asked for

    def row(self, i: int) -> list[int]:
        return list(self.tokens[i * self.width:i * self.width + self.counts[i]])


def encode_drafts(d: Drafts, session: int) -> bytes:
    """A whole DRAFTS frame from any sequences (the worker writes arrays in place with
    ``drafts_sections`` instead)."""
    n = len(d.slots)
    _check(n <= MAX_ENTRIES and 0 <= d.width <= MAX_N_OUT, "DRAFTS over its caps")
    _check(len(d.counts) == n == len(d.statuses) and len(d.tokens) == n * d.width,
           "DRAFTS fields disagree on the entry count")
    parts = [DRAFTS_FIXED.pack(n, d.width, DRAFTS_MARGINS if d.margins is not None else 0),
             array.array("I", d.slots).tobytes(), array.array("H", d.counts).tobytes(),
             array.array("H", d.statuses).tobytes(), array.array("i", d.tokens).tobytes()]
    if d.margins is not None:
        _check(len(d.margins) == n * d.width, "DRAFTS margins do not match tokens")
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
    counts = mv[sec.counts:sec.statuses].cast("H")
    statuses = mv[sec.statuses:sec.tokens].cast("H")
    if n and max(counts) > width:
        raise ProtocolError(f"DRAFTS counts: {max(counts)} over the width {width}")
    if n and max(statuses) > STATUS_RESYNC:
        raise ProtocolError(f"DRAFTS statuses: unknown status {max(statuses)}")
    return Drafts(hdr.round, mv[sec.slots:sec.counts].cast("I"), counts, statuses, width,
                  mv[sec.tokens:sec.margins].cast("i"),
                  mv[sec.margins:sec.size].cast("f") if has_m else None)


def encode_bye(session: int = 0) -> bytes:
    return encode_header(BYE, 0, session)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)

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

ROUND payload, laid out so the proxy sends the staging rows straight from the shared
region (one iovec for the head, one memoryview for all rows, one for the tokens)::

    fixed   deadline_ms u32, n_entries u32, row_bytes u32, n_tokens u32
    entries n_entries x (slot u32, flags u16, n_out u16, position u32, n_tok u32)
    rows    n_entries x row_bytes   (opaque bytes, entry order)
    tokens  n_tokens x i32          (each entry's n_tok tokens, entry order)

An entry's tokens are the ones accepted since its previous round, starting at
``position``; with ``FLAG_NEW_GEN`` they are the slot's whole context and replace
whatever the worker had for it.

DRAFTS payload::

    fixed   n_entries u32, width u16, flags u16 (bit 0: margins present)
    entries n_entries x (slot u32, count u16, status u16)
    tokens  n_entries x width x i32
    margins n_entries x width x f32   (only with DRAFTS_MARGINS)

``status`` is ``STATUS_OK`` or ``STATUS_RESYNC`` (the worker has no window for the slot,
or a gap in its positions: the engine must re-announce the slot with NEW_GEN).

BYE has an empty payload.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

MAGIC = b"DSPW"
PROTOCOL_VERSION = 1

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
ROUND_ENTRY = struct.Struct("<IHHII")
_DRAFTS_FIXED = struct.Struct("<IHH")
_DRAFTS_ENTRY = struct.Struct("<IHH")

# The largest payload each frame type may announce (the header is refused above it).
_TYPE_CAP = {
    HELLO: _HELLO.size,
    HELLO_ACK: _ACK.size + MAX_REASON,
    ROUND: MAX_PAYLOAD,
    DRAFTS: _DRAFTS_FIXED.size + MAX_ENTRIES * (_DRAFTS_ENTRY.size + 8 * MAX_N_OUT),
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


@dataclass(frozen=True)
class Entry:
    """One slot of a round. ``tokens`` are those accepted since the slot's previous
    round (from ``position`` on), or its whole context when ``new_gen``."""

    slot: int
    n_out: int
    position: int
    tokens: Sequence[int]
    new_gen: bool = False


@dataclass(frozen=True)
class Round:
    round_id: int
    deadline_ms: int
    entries: Sequence[Entry]
    rows: bytes | memoryview  # n_entries x row_bytes, entry order
    row_bytes: int


def round_head(round_id: int, session: int, deadline_ms: int, entries: Sequence[Entry],
               row_bytes: int) -> tuple[bytes, bytes]:
    """The parts of a ROUND frame that are not rows: (header + fixed + entry table,
    tokens). The caller sends ``head, rows, tokens`` in one ``sendmsg``, the rows being
    a memoryview of the staging slot, so they are never copied in Python.

    Raises:
        ValueError: an entry breaks a cap (the engine side's bug, not the peer's).
    """
    n = len(entries)
    _check(n <= MAX_ENTRIES, f"{n} entries over the cap {MAX_ENTRIES}")
    _check(row_bytes <= MAX_ROW_BYTES, f"row_bytes {row_bytes} over the cap {MAX_ROW_BYTES}")
    table = bytearray(ROUND_FIXED.size + n * ROUND_ENTRY.size)
    n_tokens = 0
    tokens: list[int] = []
    for i, e in enumerate(entries):
        _check(0 <= e.n_out <= MAX_N_OUT, f"slot {e.slot}: n_out {e.n_out} over {MAX_N_OUT}")
        ROUND_ENTRY.pack_into(table, ROUND_FIXED.size + i * ROUND_ENTRY.size, e.slot,
                               FLAG_NEW_GEN if e.new_gen else 0, e.n_out, e.position, len(e.tokens))
        tokens.extend(e.tokens)
        n_tokens += len(e.tokens)
    _check(n_tokens <= MAX_TOKENS, f"{n_tokens} tokens over the cap {MAX_TOKENS}")
    ROUND_FIXED.pack_into(table, 0, deadline_ms, n, row_bytes, n_tokens)
    tok = struct.pack(f"<{n_tokens}i", *tokens)
    payload_len = len(table) + n * row_bytes + len(tok)
    _check(payload_len <= MAX_PAYLOAD, f"ROUND of {payload_len} bytes over the cap {MAX_PAYLOAD}")
    return encode_header(ROUND, payload_len, session, round_id) + bytes(table), tok


def round_parts(round_id: int, session: int, deadline_ms: int, entries: Sequence[Entry], rows,
                row_bytes: int) -> list:
    """A ROUND frame as the buffers of one ``sendmsg``: head, rows (as given), tokens."""
    head, tok = round_head(round_id, session, deadline_ms, entries, row_bytes)
    _check(len(rows) == len(entries) * row_bytes, "rows do not match entries x row_bytes")
    return [head, rows, tok]


def encode_round(r: Round, session: int) -> bytes:
    """The whole ROUND frame as one bytes object (tests and simple clients)."""
    return b"".join(bytes(p) for p in round_parts(r.round_id, session, r.deadline_ms, r.entries,
                                                   r.rows, r.row_bytes))


def decode_round(hdr: Header, payload) -> Round:
    mv = memoryview(payload)
    if len(mv) < ROUND_FIXED.size:
        raise ProtocolError(f"ROUND payload of {len(mv)} bytes, under {ROUND_FIXED.size}")
    deadline_ms, n, row_bytes, n_tokens = ROUND_FIXED.unpack_from(mv)
    if n > MAX_ENTRIES:
        raise ProtocolError(f"ROUND with {n} entries over the cap {MAX_ENTRIES}")
    if row_bytes > MAX_ROW_BYTES:
        raise ProtocolError(f"ROUND row_bytes {row_bytes} over the cap {MAX_ROW_BYTES}")
    if n_tokens > MAX_TOKENS:
        raise ProtocolError(f"ROUND with {n_tokens} tokens over the cap {MAX_TOKENS}")
    rows_at = ROUND_FIXED.size + n * ROUND_ENTRY.size
    tok_at = rows_at + n * row_bytes
    if len(mv) != tok_at + 4 * n_tokens:
        raise ProtocolError(f"ROUND payload of {len(mv)} bytes, its fields say {tok_at + 4 * n_tokens}")
    all_tokens = struct.unpack_from(f"<{n_tokens}i", mv, tok_at)
    entries = []
    cursor = 0
    for i in range(n):
        slot, flags, n_out, position, n_tok = ROUND_ENTRY.unpack_from(
            mv, ROUND_FIXED.size + i * ROUND_ENTRY.size)
        if flags & ~FLAG_NEW_GEN:
            raise ProtocolError(f"ROUND entry {i}: unknown flags {flags:#x}")
        if n_out > MAX_N_OUT:
            raise ProtocolError(f"ROUND entry {i}: n_out {n_out} over the cap {MAX_N_OUT}")
        if n_tok > n_tokens - cursor:
            raise ProtocolError(f"ROUND entry {i}: {n_tok} tokens past the token block")
        entries.append(Entry(slot, n_out, position, all_tokens[cursor:cursor + n_tok],
                             bool(flags & FLAG_NEW_GEN)))
        cursor += n_tok
    if cursor != n_tokens:
        raise ProtocolError(f"ROUND entries use {cursor} of {n_tokens} tokens")
    return Round(hdr.round, deadline_ms, entries, mv[rows_at:tok_at], row_bytes)


# --------------------------------------------------------------------------- DRAFTS


@dataclass(frozen=True)
class Drafts:
    """The worker's answer: per entry (ROUND order) up to ``width`` tokens."""

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
    n = len(d.slots)
    _check(n <= MAX_ENTRIES and 0 <= d.width <= MAX_N_OUT, "DRAFTS over its caps")
    _check(len(d.counts) == n == len(d.statuses) and len(d.tokens) == n * d.width,
           "DRAFTS fields disagree on the entry count")
    parts = [_DRAFTS_FIXED.pack(n, d.width, DRAFTS_MARGINS if d.margins is not None else 0)]
    parts.extend(_DRAFTS_ENTRY.pack(s, c, st) for s, c, st in zip(d.slots, d.counts, d.statuses))
    parts.append(struct.pack(f"<{n * d.width}i", *d.tokens))
    if d.margins is not None:
        _check(len(d.margins) == n * d.width, "DRAFTS margins do not match tokens")
        parts.append(struct.pack(f"<{n * d.width}f", *d.margins))
    payload = b"".join(parts)
    return encode_header(DRAFTS, len(payload), session, d.round_id) + payload


def decode_drafts(hdr: Header, payload) -> Drafts:
    mv = memoryview(payload)
    if len(mv) < _DRAFTS_FIXED.size:
        raise ProtocolError(f"DRAFTS payload of {len(mv)} bytes, under {_DRAFTS_FIXED.size}")
    n, width, flags = _DRAFTS_FIXED.unpack_from(mv)
    if n > MAX_ENTRIES or width > MAX_N_OUT:
        raise ProtocolError(f"DRAFTS of {n} entries x {width} over the caps")
    if flags & ~DRAFTS_MARGINS:
        raise ProtocolError(f"DRAFTS unknown flags {flags:#x}")
    has_m = bool(flags & DRAFTS_MARGINS)
    tok_at = _DRAFTS_FIXED.size + n * _DRAFTS_ENTRY.size
    want = tok_at + 4 * n * width * (2 if has_m else 1)
    if len(mv) != want:
        raise ProtocolError(f"DRAFTS payload of {len(mv)} bytes, its fields say {want}")
    slots, counts, statuses = [], [], []
    for i in range(n):
        s, c, st = _DRAFTS_ENTRY.unpack_from(mv, _DRAFTS_FIXED.size + i * _DRAFTS_ENTRY.size)
        if c > width or st > STATUS_RESYNC:
            raise ProtocolError(f"DRAFTS entry {i}: count {c} (width {width}), status {st}")
        slots.append(s)
        counts.append(c)
        statuses.append(st)
    tokens = struct.unpack_from(f"<{n * width}i", mv, tok_at)
    margins = (struct.unpack_from(f"<{n * width}f", mv, tok_at + 4 * n * width)
               if has_m else None)
    return Drafts(hdr.round, slots, counts, statuses, width, tokens, margins)


def encode_bye(session: int = 0) -> bytes:
    return encode_header(BYE, 0, session)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)

"""``wire.frame``: the frame header, the contract's numbers and caps, and its errors
(part of the wire contract, :mod:`remote_dspark.wire`).

Header (``HEADER``, 24 bytes)::

    offset size field
         0    4 magic          b"DSPW"
         4    2 version        PROTOCOL_VERSION
         6    2 type           HELLO=1 HELLO_ACK=2 ROUND=3 DRAFTS=4 BYE=5 AUTH=6
                               PING=7
         8    4 payload_len    <= MAX_PAYLOAD and the type's own cap
        12    8 session        the proxy's session (new for every proxy process)
        20    4 round          the round id (cyclic u32) of a ROUND/DRAFTS; a PING's
                               sequence number; 0 otherwise

The caps are checked against the header before a payload is allocated; the payload
structs' fixed parts are here because the caps are made of them.
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass

from ..sampled import TOP, TOTAL

# Sections are read as native arrays (memoryview casts, numpy views): little-endian hosts only.
if sys.byteorder != "little":
    raise ImportError("remote_dspark.wire: the wire is little-endian and is read in place; this host is big-endian")

MAGIC = b"DSPW"
PROTOCOL_VERSION = 8  # what each version changed: docs/design.md, "Versions"

HELLO, HELLO_ACK, ROUND, DRAFTS, BYE, AUTH, PING = 1, 2, 3, 4, 5, 6, 7
FRAME_NAMES = {
    HELLO: "HELLO",
    HELLO_ACK: "HELLO_ACK",
    ROUND: "ROUND",
    DRAFTS: "DRAFTS",
    BYE: "BYE",
    AUTH: "AUTH",
    PING: "PING",
}

FLAG_NEW_GEN = 1
DRAFTS_MARGINS, DRAFTS_SAMPLED = 1, 2  # DRAFTS flags: margins, distributions (wire.drafts)
# HELLO options: margins, sampled drafts, a spare connection (wire.hello)
OPTION_MARGINS, OPTION_SAMPLED, OPTION_SPARE = 1, 2, 4
STATUS_OK, STATUS_RESYNC = 0, 1

# HELLO_ACK reason codes.
ACCEPT, REFUSE_DRAFTER, REFUSE_MARKOV, REFUSE_VERSION, REFUSE_LIMITS, REFUSE_MALFORMED, REFUSE_AUTH = range(7)

# Caps, checked before any allocation. A peer that needs more is refused, not served.
MAX_PAYLOAD = 64 << 20
MAX_ENTRIES = 4096
MAX_ROW_BYTES = 1 << 20
MAX_N_OUT = 64
MAX_TOKENS = 1 << 22  # all tokens of one ROUND (NEW_GEN contexts included)
MAX_REASON = 512
MAX_CONTEXT = MAX_TOKENS  # context tokens a worker keeps per slot (HELLO_ACK): at most one round's
MAX_VOCAB = 1 << 31  # token ids are i32: a vocabulary of at most 2^31 ids
# Sampled drafts (SAMPLED_TOP32; the rule is remote_dspark.drafter.sampling's): each
# drafted position carries SAMPLED_TOP ids (i32) and weights (u16) summing to
# SAMPLED_TOTAL, 6 bytes an id. A sampled session is capped tighter than a greedy one so
# that its DRAFTS stays small: 1024 entries x 16 drafts x 32 ids x 6 B = 3 MiB of
# distributions (at the greedy caps, 4096 x 64 x 32 x 6 B would be 48 MiB a reply).
SAMPLED_TOP, SAMPLED_TOTAL = TOP, TOTAL  # a drafted position's ids, and its weights' exact sum
MAX_SAMPLED_N_OUT = 16  # a sampled HELLO's num_spec at most
MAX_SAMPLED_ENTRIES = 1024  # a sampled HELLO's max_slots at most (so a sampled round's entries)

HEADER = struct.Struct("<4sHHIQI")
HELLO_STRUCT = struct.Struct("<32s32sQIIHBBI")
NONCE_BYTES = 32  # an engine's or a worker's fresh nonce (authentication, wire.auth)
PROOF_BYTES = 32  # an HMAC-SHA256 proof (wire.auth)
ACK_STRUCT = struct.Struct("<BBH32s32sIIIIIIIQ")
ROUND_FIXED = struct.Struct("<IIII")
DRAFTS_FIXED = struct.Struct("<IHH")

# The largest payload each frame type may announce (the header is refused above it).
_TYPE_CAP = {
    HELLO: HELLO_STRUCT.size + NONCE_BYTES,  # the nonce only from an engine with a key
    HELLO_ACK: ACK_STRUCT.size + MAX_REASON,
    ROUND: MAX_PAYLOAD,
    # The larger of a greedy reply at the greedy caps and a sampled one at the sampled caps
    # (per entry: slot, count, status; per draft: token, margin; per id: i32 and u16).
    DRAFTS: DRAFTS_FIXED.size
    + max(
        MAX_ENTRIES * (8 + 8 * MAX_N_OUT),
        MAX_SAMPLED_ENTRIES * (8 + MAX_SAMPLED_N_OUT * (8 + 6 * SAMPLED_TOP)),
    ),
    BYE: 0,
    PING: 0,
    AUTH: NONCE_BYTES + PROOF_BYTES,  # the worker's; the engine's is its proof alone
}


def frame_cap(ftype: int) -> int:
    """The largest payload a frame of type ``ftype`` may announce."""
    return _TYPE_CAP[ftype]


class ProtocolError(Exception):
    """A frame that breaks the contract. The connection it came on must be dropped."""


class BadReply(ProtocolError):
    """A well-formed DRAFTS that does not answer the round asked (other entries, other
    slots): the round is an ERROR (``RoundEvent.BAD_REPLY``) and the connection is kept.
    Every other broken rule of a reply is a plain :class:`ProtocolError`, which drops it."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version (``version`` is what it sent)."""

    def __init__(self, version: int):
        super().__init__(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}")
        self.version = version


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


def seq_geq(a: int, b: int) -> bool:
    """a >= b for u32 sequence numbers (round ids): cyclic, so wrap safe."""
    return ((a - b) & 0xFFFFFFFF) < 0x80000000


def seq_add(a: int, n: int) -> int:
    """The u32 sequence number ``n`` after ``a`` (``n`` may be negative)."""
    return (a + n) & 0xFFFFFFFF


def random_id() -> int:
    """A random non-zero u64: a session (new for every proxy process) or an engine id."""
    return int.from_bytes(os.urandom(8), "little") or 1


def require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)

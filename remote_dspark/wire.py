"""The wire contract between the engine side (proxy) and the remote drafter (worker).

Every frame is a fixed 24-byte header followed by a payload. All integers are
little-endian. The header is checked, and every length in it capped, before a single
byte of payload is allocated or read; a frame that breaks any rule raises
:class:`ProtocolError`, which drops that one connection and nothing else.

The contract is written out beside the code that encodes and checks each part: the
header, the caps and the errors in :mod:`~remote_dspark.wire_frame`, ROUND in
:mod:`~remote_dspark.wire_round`, DRAFTS in :mod:`~remote_dspark.wire_drafts`, and the
handshake here. This module is the contract's one namespace: every name of it is
``wire.X``, whichever part defines it.

HELLO payload (``_HELLO``, 88 bytes; protocol 3)::

    offset size field
         0   32 drafter identity
        32   32 Markov identity
        64    8 engine id      stays the same across the engine's proxy respawns, so the
                               worker can drop an old session's windows
        72    4 max_slots      1..MAX_ENTRIES
        76    4 row_bytes      <= MAX_ROW_BYTES
        80    2 num_spec       1..MAX_N_OUT
        82    1 row_format
        83    1 want_margin    0 or 1
        84    4 vocab_size     the engine's vocabulary (token ids 0..vocab_size-1), <=
                               MAX_VOCAB; 0: unknown. A worker whose drafter's vocabulary
                               is larger refuses the HELLO (REFUSE_DRAFTER, both sizes in
                               the reason); the engine refuses draft tokens outside it.

HELLO_ACK payload: accept (u8), reason code (u8), reason length (u16), the worker's
drafter and Markov identities (32 B each), then the reason (UTF-8, <= MAX_REASON). The
header's session is the HELLO's; an accepting worker's identities are the HELLO's (the
engine side refuses any other answer: ``client.DraftClient.connect``).

BYE has an empty payload.
"""

from __future__ import annotations

from dataclasses import dataclass

from .wire_drafts import (  # noqa: F401
    Drafts,
    DraftsSections,
    decode_drafts,
    drafts_sections,
    encode_drafts,
)
from .wire_frame import (  # noqa: F401
    _ACK,
    _HELLO,
    ACCEPT,
    BYE,
    DRAFTS,
    DRAFTS_FIXED,
    DRAFTS_MARGINS,
    FLAG_NEW_GEN,
    FRAME_NAMES,
    HEADER,
    HELLO,
    HELLO_ACK,
    MAGIC,
    MAX_ENTRIES,
    MAX_N_OUT,
    MAX_PAYLOAD,
    MAX_REASON,
    MAX_ROW_BYTES,
    MAX_TOKENS,
    MAX_VOCAB,
    PROTOCOL_VERSION,
    REFUSE_DRAFTER,
    REFUSE_LIMITS,
    REFUSE_MALFORMED,
    REFUSE_MARKOV,
    REFUSE_VERSION,
    ROUND,
    ROUND_FIXED,
    STATUS_OK,
    STATUS_RESYNC,
    BadReply,
    Header,
    ProtocolError,
    VersionMismatch,
    _check,
    decode_header,
    encode_header,
    frame_cap,
    pack_header_into,
    random_id,
    seq_add,
    seq_geq,
)
from .wire_round import (  # noqa: F401
    ROUND_ARRAYS,
    Entry,
    Round,
    RoundSections,
    decode_round,
    encode_round,
    encode_round_entries,
    round_meta_bytes,
    round_sections,
)


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
    vocab_size: int = 0  # 0: unknown


def encode_hello(h: Hello, session: int) -> bytes:
    _check(len(h.drafter_identity) == 32 and len(h.markov_identity) == 32, "identities are 32 bytes")
    _check(0 < h.max_slots <= MAX_ENTRIES, f"max_slots {h.max_slots} not in 1..{MAX_ENTRIES}")
    _check(0 <= h.row_bytes <= MAX_ROW_BYTES, f"row_bytes {h.row_bytes} over {MAX_ROW_BYTES}")
    _check(0 < h.num_spec <= MAX_N_OUT, f"num_spec {h.num_spec} not in 1..{MAX_N_OUT}")
    _check(0 <= h.vocab_size <= MAX_VOCAB, f"vocab_size {h.vocab_size} not in 0..{MAX_VOCAB}")
    payload = _HELLO.pack(
        h.drafter_identity,
        h.markov_identity,
        h.engine_id,
        h.max_slots,
        h.row_bytes,
        h.num_spec,
        h.row_format,
        int(h.want_margin),
        h.vocab_size,
    )
    return encode_header(HELLO, len(payload), session) + payload


def decode_hello(payload) -> Hello:
    if len(payload) != _HELLO.size:
        raise ProtocolError(f"HELLO payload of {len(payload)} bytes, expected {_HELLO.size}")
    d, m, engine_id, max_slots, row_bytes, num_spec, row_format, want, vocab = _HELLO.unpack(payload)
    if not 0 < max_slots <= MAX_ENTRIES:
        raise ProtocolError(f"HELLO max_slots {max_slots} not in 1..{MAX_ENTRIES}")
    if row_bytes > MAX_ROW_BYTES:
        raise ProtocolError(f"HELLO row_bytes {row_bytes} over the cap {MAX_ROW_BYTES}")
    if not 0 < num_spec <= MAX_N_OUT:
        raise ProtocolError(f"HELLO num_spec {num_spec} not in 1..{MAX_N_OUT}")
    if want > 1:
        raise ProtocolError(f"HELLO want_margin {want} is not 0 or 1")
    if vocab > MAX_VOCAB:
        raise ProtocolError(f"HELLO vocab_size {vocab} over the cap {MAX_VOCAB}")
    return Hello(d, m, engine_id, max_slots, row_bytes, num_spec, row_format, bool(want), vocab)


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
    payload = _ACK.pack(int(a.code == ACCEPT), a.code, len(reason), a.drafter_identity, a.markov_identity) + reason
    return encode_header(HELLO_ACK, len(payload), session) + payload


def decode_hello_ack(payload) -> HelloAck:
    if len(payload) < _ACK.size:
        raise ProtocolError(f"HELLO_ACK payload of {len(payload)} bytes, under {_ACK.size}")
    accept, code, n, d, m = _ACK.unpack_from(payload)
    if len(payload) != _ACK.size + n:
        raise ProtocolError(f"HELLO_ACK reason length {n} does not match the payload")
    if accept != (code == ACCEPT) or code > REFUSE_MALFORMED:
        raise ProtocolError(f"HELLO_ACK accept={accept} with reason code {code}")
    reason = bytes(payload[_ACK.size :]).decode("utf-8", errors="replace")
    return HelloAck(code, d, m, reason)


def encode_bye(session: int = 0) -> bytes:
    return encode_header(BYE, 0, session)

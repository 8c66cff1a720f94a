"""The handshake: HELLO, HELLO_ACK, BYE and PING (part of the wire contract,
:mod:`remote_dspark.wire`).

HELLO payload (``HELLO_STRUCT``, 88 bytes, then an engine's nonce: 120 bytes; protocol 6)::

    offset size field
         0   32 drafter identity
        32   32 Markov identity
        64    8 engine id      stays the same across the engine's proxy respawns, so the
                               worker can drop an old session's windows
        72    4 max_slots      1..MAX_ENTRIES
        76    4 row_bytes      <= MAX_ROW_BYTES
        80    2 num_spec       1..MAX_N_OUT
        82    1 row_format
        83    1 options        bit 0 OPTION_MARGINS: DRAFTS carry margins;
                               bit 1 OPTION_SAMPLED: a sampled session (SAMPLED_TOP32):
                               its ROUNDs carry a temperature and a seed per entry and
                               its DRAFTS the distributions (wire.round, wire.drafts);
                               bit 2 OPTION_SPARE: a spare connection, held idle
                               (answering PINGs) until its first ROUND makes it the
                               engine's active one (protocol 8);
                               any other bit set is a ProtocolError. A sampled HELLO has
                               num_spec <= MAX_SAMPLED_N_OUT (16) and max_slots <=
                               MAX_SAMPLED_ENTRIES (1024): its DRAFTS stay under 3 MiB
                               (1024 x 16 x 32 ids x 6 B)
        84    4 vocab_size     the engine's vocabulary (token ids 0..vocab_size-1), <=
                               MAX_VOCAB; 0: unknown. A worker whose drafter's vocabulary
                               is larger refuses the HELLO (REFUSE_DRAFTER, both sizes in
                               the reason); the engine refuses draft tokens outside it.
        88   32 nonce          only from an engine with a key (VLLM_DSPARK_REMOTE_KEY_FILE):
                               its fresh nonce, which asks the worker to authenticate
                               (wire.auth); without a key the payload ends at 88 bytes

HELLO_ACK payload (``ACK_STRUCT``, 104 bytes, then the reason; protocol 8)::

    offset size field
         0    1 accept          1 when the code is ACCEPT, else 0
         1    1 reason code     ACCEPT or a REFUSE_* (REFUSE_AUTH: wire.auth)
         2    2 reason length   <= MAX_REASON
         4   32 drafter identity
        36   32 Markov identity
        68    4 context_tokens  the context tokens the worker keeps per slot (its
                                window, or what a drafter that keeps whole
                                streams keeps): 1..MAX_CONTEXT when accepting, <= MAX_CONTEXT
                                otherwise. The engine cuts a NEW_GEN context to the
                                smaller of this and its own cap.
        72    4 round_tokens    the most tokens the worker takes in one ROUND (its
                                --max-round-tokens; a longer round is a ProtocolError):
                                1..MAX_TOKENS when accepting, <= MAX_TOKENS otherwise.
                                The engine's rounds carry at most the smaller of this
                                and its own round_tokens.
        76    4 vocab_size      the drafter's vocabulary, <= MAX_VOCAB; 0: unknown
        80    4 max_slots       the worker's other limits, for a probe's report (a HELLO
        84    4 max_row_bytes   beyond them is refused, the reason naming the value):
        88    4 max_round_bytes <= MAX_ENTRIES, MAX_ROW_BYTES and MAX_PAYLOAD
        92    4 engines         the engines the worker serves now (sessions not spare,
                                this one not counted): an engine choosing between
                                two workers takes the less loaded (transport.fleet)
        96    8 incarnation     the worker process's own random nonzero id, new at every
                                start: a restarted worker at the same address is another
                                one (0 in a refusal from before the worker knows it)
       104    n reason          UTF-8

Every field is sent with a refusal too, so that a probe can say what the worker takes.

The header's session is the HELLO's; an accepting worker's identities are the HELLO's
(the engine side refuses any other answer: ``client.DraftClient.connect``).

BYE has an empty payload. So has PING: the engine sends it on an idle connection (its
spare) with a sequence number in the header's round field, and the worker answers at
once with a PING of the same session and number. A spare that does not answer within
its deadline is dead to the engine, found in seconds rather than TCP keepalive's minute.
"""

from __future__ import annotations

from dataclasses import dataclass

from .frame import (
    ACCEPT,
    ACK_STRUCT,
    BYE,
    HELLO,
    HELLO_ACK,
    HELLO_STRUCT,
    MAX_CONTEXT,
    MAX_ENTRIES,
    MAX_N_OUT,
    MAX_PAYLOAD,
    MAX_REASON,
    MAX_ROW_BYTES,
    MAX_SAMPLED_ENTRIES,
    MAX_SAMPLED_N_OUT,
    MAX_TOKENS,
    MAX_VOCAB,
    NONCE_BYTES,
    OPTION_MARGINS,
    OPTION_SAMPLED,
    OPTION_SPARE,
    PING,
    REFUSE_AUTH,
    ProtocolError,
    encode_header,
    require,
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

# The context a HelloAck names unless told otherwise: a worker's default --window.
DEFAULT_CONTEXT = 64


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
    nonce: bytes = b""  # an engine with a key: its fresh nonce (NONCE_BYTES); b"": no key
    want_sampled: bool = False  # a sampled session (OPTION_SAMPLED): temperatures, seeds, distributions
    spare: bool = False  # a spare connection (OPTION_SPARE): held idle until its first ROUND

    @property
    def options(self) -> int:
        """HELLO's options byte: OPTION_MARGINS | OPTION_SAMPLED | OPTION_SPARE as asked."""
        return (
            (OPTION_MARGINS if self.want_margin else 0)
            | (OPTION_SAMPLED if self.want_sampled else 0)
            | (OPTION_SPARE if self.spare else 0)
        )


def sampled_caps_broken(num_spec: int, max_slots: int) -> str | None:
    """Why a sampled session of ``num_spec`` drafts and ``max_slots`` slots is beyond the
    sampled caps (each value and its cap), or None."""
    why = []
    if num_spec > MAX_SAMPLED_N_OUT:
        why.append(f"num_spec {num_spec} over the sampled cap MAX_SAMPLED_N_OUT={MAX_SAMPLED_N_OUT}")
    if max_slots > MAX_SAMPLED_ENTRIES:
        why.append(f"max_slots {max_slots} over the sampled cap MAX_SAMPLED_ENTRIES={MAX_SAMPLED_ENTRIES}")
    return "; ".join(why) or None


def encode_hello(h: Hello, session: int) -> bytes:
    require(len(h.drafter_identity) == 32 and len(h.markov_identity) == 32, "identities are 32 bytes")
    require(0 < h.max_slots <= MAX_ENTRIES, f"max_slots {h.max_slots} not in 1..{MAX_ENTRIES}")
    require(0 <= h.row_bytes <= MAX_ROW_BYTES, f"row_bytes {h.row_bytes} over {MAX_ROW_BYTES}")
    require(0 < h.num_spec <= MAX_N_OUT, f"num_spec {h.num_spec} not in 1..{MAX_N_OUT}")
    require(0 <= h.vocab_size <= MAX_VOCAB, f"vocab_size {h.vocab_size} not in 0..{MAX_VOCAB}")
    require(len(h.nonce) in (0, NONCE_BYTES), f"a nonce is {NONCE_BYTES} bytes, or none")
    over = sampled_caps_broken(h.num_spec, h.max_slots) if h.want_sampled else None
    require(over is None, f"a sampled HELLO: {over}")
    payload = HELLO_STRUCT.pack(
        h.drafter_identity,
        h.markov_identity,
        h.engine_id,
        h.max_slots,
        h.row_bytes,
        h.num_spec,
        h.row_format,
        h.options,
        h.vocab_size,
    )
    return encode_header(HELLO, len(payload) + len(h.nonce), session) + payload + h.nonce


def decode_hello(payload) -> Hello:
    if len(payload) not in (HELLO_STRUCT.size, HELLO_STRUCT.size + NONCE_BYTES):
        raise ProtocolError(
            f"HELLO payload of {len(payload)} bytes, expected {HELLO_STRUCT.size} (or "
            f"{HELLO_STRUCT.size + NONCE_BYTES} with a nonce)"
        )
    d, m, engine_id, max_slots, row_bytes, num_spec, row_format, options, vocab = HELLO_STRUCT.unpack_from(payload)
    if not 0 < max_slots <= MAX_ENTRIES:
        raise ProtocolError(f"HELLO max_slots {max_slots} not in 1..{MAX_ENTRIES}")
    if row_bytes > MAX_ROW_BYTES:
        raise ProtocolError(f"HELLO row_bytes {row_bytes} over the cap {MAX_ROW_BYTES}")
    if not 0 < num_spec <= MAX_N_OUT:
        raise ProtocolError(f"HELLO num_spec {num_spec} not in 1..{MAX_N_OUT}")
    unknown = options & ~(OPTION_MARGINS | OPTION_SAMPLED | OPTION_SPARE)
    if unknown:
        known = "0x01 margins, 0x02 sampled, 0x04 spare"
        raise ProtocolError(f"HELLO options {options:#04x}: unknown bits {unknown:#04x} (known: {known})")
    sampled = bool(options & OPTION_SAMPLED)
    over = sampled_caps_broken(num_spec, max_slots) if sampled else None
    if over is not None:
        raise ProtocolError(f"HELLO sampled: {over}")
    if vocab > MAX_VOCAB:
        raise ProtocolError(f"HELLO vocab_size {vocab} over the cap {MAX_VOCAB}")
    nonce = bytes(payload[HELLO_STRUCT.size :])
    margins = bool(options & OPTION_MARGINS)
    spare = bool(options & OPTION_SPARE)
    return Hello(d, m, engine_id, max_slots, row_bytes, num_spec, row_format, margins, vocab, nonce, sampled, spare)


@dataclass(frozen=True)
class HelloAck:
    """A worker's answer to HELLO (the layout above). The limits default to the wire's
    caps: a peer that states none takes what the contract allows."""

    code: int
    drafter_identity: bytes
    markov_identity: bytes
    reason: str = ""
    context_tokens: int = DEFAULT_CONTEXT  # context tokens the worker keeps per slot (its window, or more)
    round_tokens: int = MAX_TOKENS  # the most tokens it takes in one ROUND (--max-round-tokens)
    vocab_size: int = 0  # its drafter's vocabulary; 0: unknown
    max_slots: int = MAX_ENTRIES  # --max-slots
    max_row_bytes: int = MAX_ROW_BYTES  # --max-row-bytes
    max_round_bytes: int = MAX_PAYLOAD  # --max-round-bytes
    engines: int = 0  # the engines it serves now (not spare, not this one)
    incarnation: int = 0  # the worker process's random id (0: not told)

    @property
    def accepted(self) -> bool:
        return self.code == ACCEPT

    def out_of_range(self) -> str | None:
        """The first field out of its range (the layout above), named with its value and
        range, or None."""
        low = 1 if self.accepted else 0
        for name, lo, hi in (
            ("context_tokens", low, MAX_CONTEXT),
            ("round_tokens", low, MAX_TOKENS),
            ("vocab_size", 0, MAX_VOCAB),
            ("max_slots", 0, MAX_ENTRIES),
            ("max_row_bytes", 0, MAX_ROW_BYTES),
            ("max_round_bytes", 0, MAX_PAYLOAD),
        ):
            value = getattr(self, name)
            if not lo <= value <= hi:
                why = " (an accepting worker takes at least one token)" if lo else ""
                return f"{name} {value} not in {lo}..{hi}{why}"
        return None


def encode_hello_ack(a: HelloAck, session: int) -> bytes:
    wrong = a.out_of_range()
    require(wrong is None, f"HELLO_ACK {wrong}")
    reason = a.reason.encode("utf-8")[:MAX_REASON]
    fields = (
        a.context_tokens,
        a.round_tokens,
        a.vocab_size,
        a.max_slots,
        a.max_row_bytes,
        a.max_round_bytes,
        a.engines,
        a.incarnation,
    )
    head = ACK_STRUCT.pack(int(a.code == ACCEPT), a.code, len(reason), a.drafter_identity, a.markov_identity, *fields)
    payload = head + reason
    return encode_header(HELLO_ACK, len(payload), session) + payload


def decode_hello_ack(payload) -> HelloAck:
    if len(payload) < ACK_STRUCT.size:
        raise ProtocolError(f"HELLO_ACK payload of {len(payload)} bytes, under {ACK_STRUCT.size}")
    accept, code, n, d, m, *fields = ACK_STRUCT.unpack_from(payload)
    if len(payload) != ACK_STRUCT.size + n:
        raise ProtocolError(f"HELLO_ACK reason length {n} does not match the payload")
    if accept != (code == ACCEPT) or code > REFUSE_AUTH:
        raise ProtocolError(f"HELLO_ACK accept={accept} with reason code {code}")
    reason = bytes(payload[ACK_STRUCT.size :]).decode("utf-8", errors="replace")
    ack = HelloAck(code, d, m, reason, *fields)
    wrong = ack.out_of_range()
    if wrong is not None:
        raise ProtocolError(f"HELLO_ACK {wrong}")
    return ack


def encode_bye(session: int = 0) -> bytes:
    return encode_header(BYE, 0, session)


def encode_ping(session: int, seq: int) -> bytes:
    """A PING (the engine's on an idle connection, or the worker's answer echoing it)."""
    return encode_header(PING, 0, session, seq)

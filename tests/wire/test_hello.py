"""HELLO, HELLO_ACK and BYE (wire.hello): round trips; HELLO's options byte and the
sampled caps (protocol 6); a HELLO with or without the engine's nonce (protocol 5,
authentication); HELLO_ACK's context_tokens, the context a worker keeps per slot,
round-tripped and held to the wire's caps on decode (0 is no answer from an accepting
worker); HELLO_ACK's round cap, vocabulary and limits (protocol 7), the same way;
the identities' hex form."""

from __future__ import annotations

import dataclasses
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wire_cases import split

from remote_dspark import wire
from remote_dspark.wire import auth

IDS = (b"\x11" * 32, b"\x22" * 32)
HELLO = wire.Hello(*IDS, engine_id=7, max_slots=8, row_bytes=4, num_spec=3, vocab_size=100)
ident = st.binary(min_size=32, max_size=32)


def hello(**kw) -> wire.Hello:
    fields = dict(engine_id=7, max_slots=8, row_bytes=4, num_spec=3, vocab_size=100)
    fields.update(kw)
    return wire.Hello(*IDS, **fields)


@given(
    ident,
    ident,
    st.integers(0, 2**64 - 1),
    st.integers(1, wire.MAX_ENTRIES),
    st.integers(0, wire.MAX_ROW_BYTES),
    st.integers(1, wire.MAX_N_OUT),
    st.integers(0, 255),
    st.booleans(),
    st.integers(0, 2**64 - 1),
)
def test_hello_round_trip(d, m, engine, slots, row_bytes, num_spec, fmt, margin, session):
    h = wire.Hello(d, m, engine, slots, row_bytes, num_spec, fmt, margin)
    hdr, payload = split(wire.encode_hello(h, session))
    assert (hdr.type, hdr.session) == (wire.HELLO, session)
    assert wire.decode_hello(payload) == h


@given(st.sampled_from(range(6)), ident, ident, st.text(max_size=100))
def test_hello_ack_round_trip(code, d, m, reason):
    a = wire.HelloAck(code, d, m, reason)
    hdr, payload = split(wire.encode_hello_ack(a, 9))
    back = wire.decode_hello_ack(payload)
    assert back == a and back.accepted == (code == wire.ACCEPT)


def test_a_hello_without_a_key_is_the_88_byte_hello_of_before():
    frame = wire.encode_hello(HELLO, 9)
    hdr = wire.decode_header(frame[: wire.HEADER.size])
    assert hdr.payload_len == wire.HELLO_STRUCT.size == 88
    fields = (*IDS, 7, 8, 4, 3, 0, 0, 100)
    assert frame[wire.HEADER.size :] == wire.HELLO_STRUCT.pack(*fields)
    assert wire.decode_hello(frame[wire.HEADER.size :]).nonce == b""


def test_an_engine_with_a_key_appends_its_nonce_and_it_round_trips():
    nonce = auth.new_nonce()
    frame = wire.encode_hello(wire.Hello(*IDS, 7, 8, 4, 3, vocab_size=100, nonce=nonce), 9)
    assert wire.decode_header(frame[: wire.HEADER.size]).payload_len == 88 + 32 == wire.frame_cap(wire.HELLO)
    assert frame[-32:] == nonce and wire.decode_hello(frame[wire.HEADER.size :]).nonce == nonce
    assert auth.new_nonce() != nonce  # fresh per call


@pytest.mark.parametrize("size", [87, 89, 119, 121])
def test_a_hello_of_another_length_is_a_protocol_error(size):
    payload = (wire.encode_hello(HELLO, 1)[wire.HEADER.size :] + bytes(64))[:size]
    with pytest.raises(wire.ProtocolError, match=f"HELLO payload of {size} bytes"):
        wire.decode_hello(payload)


def test_a_nonce_is_32_bytes_or_none():
    with pytest.raises(ValueError, match="a nonce is 32 bytes"):
        wire.encode_hello(wire.Hello(*IDS, 7, 8, 4, 3, nonce=b"short"), 1)


# --------------------------------------------------------------------------- options


@given(st.booleans(), st.booleans(), st.integers(1, wire.MAX_SAMPLED_ENTRIES), st.integers(1, wire.MAX_SAMPLED_N_OUT))
def test_hello_options_round_trip_and_are_byte_83(margin, sampled, slots, num_spec):
    h = hello(want_margin=margin, want_sampled=sampled, max_slots=slots, num_spec=num_spec)
    hdr, payload = split(wire.encode_hello(h, 9))
    assert payload[83] == (1 if margin else 0) | (2 if sampled else 0) == h.options
    assert wire.decode_hello(payload) == h


@pytest.mark.parametrize("options", [0x08, 0x80, 0x0F, 0xFF])
def test_an_unknown_option_bit_is_refused_naming_it(options):
    payload = bytearray(split(wire.encode_hello(hello(), 9))[1])
    payload[83] = options
    with pytest.raises(wire.ProtocolError, match=f"unknown bits {options & ~7:#04x}"):
        wire.decode_hello(bytes(payload))


@pytest.mark.parametrize(
    "field,value,cap",
    [
        ("num_spec", wire.MAX_SAMPLED_N_OUT + 1, "MAX_SAMPLED_N_OUT=16"),
        ("max_slots", wire.MAX_SAMPLED_ENTRIES + 1, "MAX_SAMPLED_ENTRIES=1024"),
    ],
)
def test_a_sampled_hello_over_the_sampled_caps_is_refused_naming_value_and_cap(field, value, cap):
    with pytest.raises(ValueError, match=f"{field} {value} over the sampled cap {cap}"):
        wire.encode_hello(hello(want_sampled=True, **{field: value}), 1)
    unsampled = split(wire.encode_hello(hello(**{field: value}), 1))[1]  # fine without sampling
    assert wire.decode_hello(unsampled).want_sampled is False
    payload = bytearray(unsampled)
    payload[83] = wire.OPTION_SAMPLED
    with pytest.raises(wire.ProtocolError, match=f"{field} {value} over the sampled cap {cap}"):
        wire.decode_hello(bytes(payload))


# --------------------------------------------------------------------------- HELLO_ACK


def test_a_hello_ack_may_refuse_auth_and_no_code_past_it():
    ack = wire.encode_hello_ack(wire.HelloAck(wire.REFUSE_AUTH, *IDS, "auth", context_tokens=0), 3)
    assert wire.decode_hello_ack(ack[wire.HEADER.size :]).code == wire.REFUSE_AUTH == 6
    bad = bytearray(ack[wire.HEADER.size :])
    bad[1] = wire.REFUSE_AUTH + 1
    with pytest.raises(wire.ProtocolError, match="reason code 7"):
        wire.decode_hello_ack(bytes(bad))


@given(st.integers(1, wire.MAX_CONTEXT), st.text(max_size=40))
def test_an_accepting_hello_ack_round_trips_its_context(context, reason):
    a = wire.HelloAck(wire.ACCEPT, *IDS, reason, context_tokens=context)
    hdr, payload = split(wire.encode_hello_ack(a, 7))
    assert hdr.type == wire.HELLO_ACK and len(payload) == wire.ACK_STRUCT.size + len(reason.encode())
    back = wire.decode_hello_ack(payload)
    assert back == a and back.context_tokens == context


@given(st.sampled_from(range(1, 6)), st.integers(0, wire.MAX_CONTEXT))
def test_a_refusal_carries_any_context_within_the_cap(code, context):
    a = wire.HelloAck(code, *IDS, "no", context_tokens=context)
    assert wire.decode_hello_ack(split(wire.encode_hello_ack(a, 1))[1]) == a


def test_the_context_is_the_u32_after_the_identities_then_the_round_cap_vocabulary_and_limits():
    ack = wire.HelloAck(
        wire.ACCEPT, *IDS, context_tokens=256, round_tokens=40, vocab_size=50257, max_slots=8,
        max_row_bytes=4, max_round_bytes=9000,
    )  # fmt: skip
    payload = split(wire.encode_hello_ack(ack, 1))[1]
    assert wire.ACK_STRUCT.size == 104 and struct.unpack_from("<6I", payload, 68) == (256, 40, 50257, 8, 4, 9000)


def test_an_ack_names_the_engines_served_and_the_incarnation_after_the_limits():
    ack = wire.HelloAck(wire.ACCEPT, *IDS, engines=3, incarnation=0xDEADBEEF12345678)
    payload = split(wire.encode_hello_ack(ack, 1))[1]
    assert struct.unpack_from("<IQ", payload, 92) == (3, 0xDEADBEEF12345678)
    assert wire.decode_hello_ack(payload) == ack


def test_a_spare_hello_sets_options_bit_2_and_round_trips():
    h = dataclasses.replace(HELLO, spare=True)
    payload = split(wire.encode_hello(h, 1))[1]
    assert payload[83] == wire.OPTION_SPARE == 4
    assert wire.decode_hello(payload) == h
    assert not wire.decode_hello(split(wire.encode_hello(HELLO, 1))[1]).spare


def test_a_ping_is_an_empty_frame_whose_round_field_is_its_number():
    hdr = wire.decode_header(wire.encode_ping(0xAB, 7)[: wire.HEADER.size])
    assert (hdr.type, hdr.name, hdr.payload_len, hdr.session, hdr.round) == (wire.PING, "PING", 0, 0xAB, 7)


def _ack_payload(accept: int, code: int, context: int, *limits: int) -> bytes:
    fields = limits or (wire.MAX_TOKENS, 0, wire.MAX_ENTRIES, wire.MAX_ROW_BYTES, wire.MAX_PAYLOAD)
    return wire.ACK_STRUCT.pack(accept, code, 0, *IDS, context, *fields, 0, 0)


LIMITS = st.tuples(
    st.integers(1, wire.MAX_TOKENS),
    st.integers(0, wire.MAX_VOCAB),
    st.integers(0, wire.MAX_ENTRIES),
    st.integers(0, wire.MAX_ROW_BYTES),
    st.integers(0, wire.MAX_PAYLOAD),
)
NAMES = ("round_tokens", "vocab_size", "max_slots", "max_row_bytes", "max_round_bytes")


@given(st.sampled_from(range(7)), st.integers(1, wire.MAX_CONTEXT), LIMITS)
def test_the_round_cap_vocabulary_and_limits_round_trip(code, context, limits):
    a = wire.HelloAck(code, *IDS, "r", context, **dict(zip(NAMES, limits)))
    assert wire.decode_hello_ack(split(wire.encode_hello_ack(a, 5))[1]) == a


@pytest.mark.parametrize(
    "name,value",
    [
        ("round_tokens", wire.MAX_TOKENS + 1),
        ("vocab_size", wire.MAX_VOCAB + 1),
        ("max_slots", wire.MAX_ENTRIES + 1),
        ("max_row_bytes", wire.MAX_ROW_BYTES + 1),
        ("max_round_bytes", wire.MAX_PAYLOAD + 1),
    ],
)
@pytest.mark.parametrize("accept,code", [(1, wire.ACCEPT), (0, wire.REFUSE_LIMITS)])
def test_a_limit_out_of_range_is_refused_by_name_both_ways(name, value, accept, code):
    fields = dict(zip(NAMES, (wire.MAX_TOKENS, 0, wire.MAX_ENTRIES, wire.MAX_ROW_BYTES, wire.MAX_PAYLOAD)))
    fields[name] = value
    with pytest.raises(wire.ProtocolError, match=f"HELLO_ACK {name} {value} not in [01]\\.\\."):
        wire.decode_hello_ack(_ack_payload(accept, code, 64, *fields.values()))
    with pytest.raises(ValueError, match=f"HELLO_ACK {name} {value} not in"):
        wire.encode_hello_ack(wire.HelloAck(code, *IDS, context_tokens=64, **fields), 1)


def test_an_accepting_ack_takes_at_least_one_token_a_round_and_a_refusal_may_say_none():
    no_tokens = (0, 0, wire.MAX_ENTRIES, wire.MAX_ROW_BYTES, wire.MAX_PAYLOAD)
    with pytest.raises(wire.ProtocolError, match=r"HELLO_ACK round_tokens 0 not in 1\.\..*at least one token"):
        wire.decode_hello_ack(_ack_payload(1, wire.ACCEPT, 64, *no_tokens))
    assert wire.decode_hello_ack(_ack_payload(0, wire.REFUSE_LIMITS, 64, *no_tokens)).round_tokens == 0
    with pytest.raises(ValueError, match="HELLO_ACK round_tokens 0 not in 1"):
        wire.encode_hello_ack(wire.HelloAck(wire.ACCEPT, *IDS, round_tokens=0), 1)


def test_decode_refuses_an_accepting_ack_of_no_context():
    with pytest.raises(wire.ProtocolError, match=r"context_tokens 0 not in 1\.\."):
        wire.decode_hello_ack(_ack_payload(1, wire.ACCEPT, 0))
    assert wire.decode_hello_ack(_ack_payload(0, wire.REFUSE_LIMITS, 0)).context_tokens == 0


@pytest.mark.parametrize("accept,code", [(1, wire.ACCEPT), (0, wire.REFUSE_DRAFTER)])
def test_decode_refuses_a_context_over_the_wire_cap(accept, code):
    with pytest.raises(wire.ProtocolError, match=f"context_tokens {wire.MAX_CONTEXT + 1} not in"):
        wire.decode_hello_ack(_ack_payload(accept, code, wire.MAX_CONTEXT + 1))


@pytest.mark.parametrize("context", [0, wire.MAX_CONTEXT + 1])
def test_encode_refuses_an_accepting_ack_out_of_range(context):
    with pytest.raises(ValueError, match=f"context_tokens {context} not in 1"):
        wire.encode_hello_ack(wire.HelloAck(wire.ACCEPT, *IDS, context_tokens=context), 1)


@pytest.mark.parametrize(
    "raw,ok",
    [
        ("ab" * 32, True),
        ("0x" + "AB" * 32, True),
        (" " + "0" * 64 + " ", True),
        ("ab" * 31, False),
        ("zz" * 32, False),
        ("", False),
    ],
)
def test_parse_hex32(raw, ok):
    if ok:
        assert len(wire.parse_hex32(raw, "VAR")) == 32
    else:
        with pytest.raises(ValueError, match="VAR="):
            wire.parse_hex32(raw, "VAR")

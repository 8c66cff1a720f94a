"""HELLO_ACK's context_tokens: the context a worker keeps per slot, round-tripped and
held to the wire's caps on decode (0 is no answer from an accepting worker)."""

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from remote_dspark import wire

IDS = (b"d" * 32, b"m" * 32)


def split(frame: bytes):
    return wire.decode_header(frame[: wire.HEADER.size]), frame[wire.HEADER.size :]


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


def test_the_context_is_the_u32_after_the_identities():
    payload = split(wire.encode_hello_ack(wire.HelloAck(wire.ACCEPT, *IDS, context_tokens=256), 1))[1]
    assert wire.ACK_STRUCT.size == 72 and struct.unpack_from("<I", payload, 68) == (256,)


def _ack_payload(accept: int, code: int, context: int) -> bytes:
    return wire.ACK_STRUCT.pack(accept, code, 0, *IDS, context)


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

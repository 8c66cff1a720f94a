"""The frame (wire.frame): the header's checks and the protocol's version, the caps
before allocation, the sampled constants, and fuzzed input through the real channel that
raises only protocol errors."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_cases import _Bytes, read_frame, u32

from remote_dspark import wire
from remote_dspark.drafter import sampling
from remote_dspark.transport import Disconnected, FrameChannel


def test_the_sampled_constants_are_the_rule_s():
    assert (wire.SAMPLED_TOP, wire.SAMPLED_TOTAL) == (sampling.TOP, sampling.TOTAL) == (32, 65535)
    assert (wire.OPTION_MARGINS, wire.OPTION_SAMPLED, wire.DRAFTS_SAMPLED) == (1, 2, 2)
    # The caps keep a sampled DRAFTS' distributions at 3 MiB: 1024 x 16 x 32 x 6 B.
    assert wire.MAX_SAMPLED_ENTRIES * wire.MAX_SAMPLED_N_OUT * wire.SAMPLED_TOP * 6 == 3 << 20


def test_header_checks():
    good = wire.encode_header(wire.BYE, 0)
    with pytest.raises(wire.ProtocolError, match="magic"):
        wire.decode_header(b"XXXX" + good[4:])
    with pytest.raises(wire.VersionMismatch) as e:
        wire.decode_header(good[:4] + struct.pack("<H", 99) + good[6:])
    assert e.value.version == 99
    with pytest.raises(wire.ProtocolError, match="unknown frame type"):
        wire.decode_header(good[:6] + struct.pack("<H", 77) + good[8:])
    with pytest.raises(wire.ProtocolError, match="truncated"):
        wire.decode_header(good[:5])


def test_a_protocol_1_peer_is_refused_by_version():
    frame = bytearray(wire.encode_bye())
    struct.pack_into("<H", frame, 4, 1)
    with pytest.raises(wire.VersionMismatch, match=f"protocol version 1, this side speaks {wire.PROTOCOL_VERSION}"):
        wire.decode_header(bytes(frame))


def test_the_protocol_is_version_8_and_a_version_7_peer_is_refused():
    assert wire.PROTOCOL_VERSION == 8  # 8: spares, PING, HELLO_ACK's engines and incarnation (tests/wire/test_hello.py)
    frame = bytearray(wire.encode_bye())
    struct.pack_into("<H", frame, 4, 7)
    with pytest.raises(wire.VersionMismatch, match="protocol version 7, this side speaks 8"):
        wire.decode_header(bytes(frame))


@pytest.mark.parametrize(
    "ftype,cap",
    [(wire.HELLO, 88 + 32), (wire.AUTH, 64), (wire.BYE, 0), (wire.PING, 0), (wire.ROUND, wire.MAX_PAYLOAD)],
)
def test_oversized_frame_refused_before_allocation(ftype, cap):
    stream = _Bytes(wire.encode_header(ftype, cap + 1) + b"x" * 64)
    with pytest.raises(wire.ProtocolError, match="exceeds the cap"):
        FrameChannel(stream).recv_frame(float("inf"))
    assert stream.asked == [wire.HEADER.size]  # nothing read (or allocated) past the header


def test_truncated_frame_is_a_disconnect_not_a_partial_frame():
    frame = wire.encode_hello(wire.Hello(bytes(32), bytes(32), 1, 4, 0, 5), 1)
    with pytest.raises(Disconnected):
        read_frame(frame[:-1])
    with pytest.raises(Disconnected):
        read_frame(frame[:10])


@settings(max_examples=400)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_protocol_errors(data):
    try:
        read_frame(data)
    except (wire.ProtocolError, Disconnected):  # Disconnected: the bytes ended mid-frame
        pass


@settings(max_examples=300)
@given(st.sampled_from([wire.HELLO, wire.HELLO_ACK, wire.ROUND, wire.DRAFTS]), st.binary(max_size=200), u32, u32)
def test_valid_header_arbitrary_payload_raises_only_protocol_errors(ftype, payload, session, rnd):
    frame = wire.encode_header(ftype, len(payload), session, rnd) + payload
    try:
        read_frame(frame)
    except wire.ProtocolError:
        pass

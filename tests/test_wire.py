"""The wire contract: round trips, caps before allocation, and fuzzed input."""

import struct

import pytest
from hypothesis import given, settings, strategies as st

from remote_dspark import wire
from remote_dspark.transport import Disconnected, FrameChannel

ident = st.binary(min_size=32, max_size=32)
u32 = st.integers(0, 2**32 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def rounds(draw):
    row_bytes = draw(st.integers(0, 64))
    entries = draw(st.lists(st.builds(
        wire.Entry, slot=u32, n_out=st.integers(0, wire.MAX_N_OUT), position=u32,
        tokens=st.lists(i32, max_size=20).map(tuple), new_gen=st.booleans()), max_size=12))
    rows = draw(st.binary(min_size=len(entries) * row_bytes, max_size=len(entries) * row_bytes))
    return wire.Round(draw(u32), draw(u32), entries, rows, row_bytes)


@st.composite
def drafts(draw):
    n = draw(st.integers(0, 10))
    width = draw(st.integers(0, 8))
    counts = draw(st.lists(st.integers(0, width), min_size=n, max_size=n))
    tokens = draw(st.lists(i32, min_size=n * width, max_size=n * width))
    margins = draw(st.none() | st.lists(st.floats(0, 1, width=32), min_size=n * width, max_size=n * width))
    return wire.Drafts(draw(u32), draw(st.lists(u32, min_size=n, max_size=n)), counts,
                       draw(st.lists(st.sampled_from([wire.STATUS_OK, wire.STATUS_RESYNC]), min_size=n, max_size=n)),
                       width, tuple(tokens), None if margins is None else tuple(margins))


def split(frame: bytes):
    hdr = wire.decode_header(frame[:wire.HEADER.size])
    payload = frame[wire.HEADER.size:]
    assert hdr.payload_len == len(payload)
    return hdr, payload


@given(ident, ident, st.integers(0, 2**64 - 1), st.integers(1, wire.MAX_ENTRIES),
       st.integers(0, wire.MAX_ROW_BYTES), st.integers(1, wire.MAX_N_OUT), st.integers(0, 255),
       st.booleans(), st.integers(0, 2**64 - 1))
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


@given(rounds(), st.integers(0, 2**64 - 1))
def test_round_round_trip(r, session):
    hdr, payload = split(wire.encode_round(r, session))
    back = wire.decode_round(hdr, payload)
    assert (back.round_id, back.deadline_ms, back.row_bytes) == (r.round_id, r.deadline_ms, r.row_bytes)
    assert list(back.entries) == list(r.entries)
    assert bytes(back.rows) == r.rows


@given(drafts())
def test_drafts_round_trip(d):
    hdr, payload = split(wire.encode_drafts(d, 3))
    back = wire.decode_drafts(hdr, payload)
    assert back == wire.Drafts(d.round_id, list(d.slots), list(d.counts), list(d.statuses), d.width,
                               tuple(d.tokens), d.margins)
    assert [back.row(i) for i in range(len(d.slots))] == \
        [list(d.tokens[i * d.width:i * d.width + c]) for i, c in enumerate(d.counts)]


def test_round_head_sends_rows_uncopied():
    """The proxy sends head + a memoryview of the staging rows + tokens: same bytes."""
    entries = [wire.Entry(3, 5, 10, (1, 2)), wire.Entry(7, 5, 0, (4, 5, 6), new_gen=True)]
    rows = bytearray(range(2 * 16))
    head, tok = wire.round_head(11, 5, 50, entries, 16)
    assert head + bytes(memoryview(rows)) + tok == wire.encode_round(wire.Round(11, 50, entries, bytes(rows), 16), 5)


class _Bytes:
    """A ByteStream over fixed bytes that records how much the channel asked for."""

    def __init__(self, data: bytes):
        self.data = data
        self.asked = []

    def recv_into(self, view, timeout_s):
        self.asked.append(len(view))
        n = min(len(view), len(self.data))
        view[:n] = self.data[:n]
        self.data = self.data[n:]
        return n

    def sendmsg(self, buffers):
        pass

    def close(self):
        pass


def read_frame(data: bytes):
    """Decode one frame from raw bytes through the real channel (caps included)."""
    hdr, payload = FrameChannel(_Bytes(data)).recv_frame(float("inf"))
    decode = {wire.HELLO: lambda: wire.decode_hello(payload),
              wire.HELLO_ACK: lambda: wire.decode_hello_ack(payload),
              wire.ROUND: lambda: wire.decode_round(hdr, payload),
              wire.DRAFTS: lambda: wire.decode_drafts(hdr, payload),
              wire.BYE: lambda: None}[hdr.type]
    return decode()


@settings(max_examples=400)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_protocol_errors(data):
    try:
        read_frame(data)
    except (wire.ProtocolError, Disconnected):  # Disconnected: the bytes ended mid-frame
        pass


@settings(max_examples=300)
@given(st.sampled_from([wire.HELLO, wire.HELLO_ACK, wire.ROUND, wire.DRAFTS]), st.binary(max_size=200),
       u32, u32)
def test_valid_header_arbitrary_payload_raises_only_protocol_errors(ftype, payload, session, rnd):
    frame = wire.encode_header(ftype, len(payload), session, rnd) + payload
    try:
        read_frame(frame)
    except wire.ProtocolError:
        pass


@given(drafts().filter(lambda d: len(d.slots) > 0), st.data())
def test_corrupted_drafts_fields_are_protocol_errors(d, data):
    frame = bytearray(wire.encode_drafts(d, 1))
    i = data.draw(st.integers(wire.HEADER.size, wire.HEADER.size + 7))
    frame[i] ^= data.draw(st.integers(1, 255))
    try:
        read_frame(bytes(frame))
    except wire.ProtocolError:
        pass


@pytest.mark.parametrize("ftype,cap", [(wire.HELLO, 84), (wire.BYE, 0), (wire.ROUND, wire.MAX_PAYLOAD)])
def test_oversized_frame_refused_before_allocation(ftype, cap):
    stream = _Bytes(wire.encode_header(ftype, cap + 1) + b"x" * 64)
    with pytest.raises(wire.ProtocolError, match="exceeds the cap"):
        FrameChannel(stream).recv_frame(float("inf"))
    assert stream.asked == [wire.HEADER.size]  # nothing read (or allocated) past the header


def test_huge_counts_in_small_round_refused():
    payload = wire.ROUND_FIXED.pack(50, wire.MAX_ENTRIES + 1, 16, 0)
    hdr = wire.decode_header(wire.encode_header(wire.ROUND, len(payload)))
    with pytest.raises(wire.ProtocolError, match="entries over the cap"):
        wire.decode_round(hdr, payload)
    payload = wire.ROUND_FIXED.pack(50, 1, 16, 2**30)
    with pytest.raises(wire.ProtocolError, match="tokens over the cap"):
        wire.decode_round(hdr, payload)


def test_truncated_frame_is_a_disconnect_not_a_partial_frame():
    frame = wire.encode_hello(wire.Hello(bytes(32), bytes(32), 1, 4, 0, 5), 1)
    with pytest.raises(Disconnected):
        read_frame(frame[:-1])
    with pytest.raises(Disconnected):
        read_frame(frame[:10])


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


def test_round_entry_tokens_past_block_refused():
    r = wire.Round(1, 50, [wire.Entry(0, 5, 0, (1, 2, 3))], b"", 0)
    frame = bytearray(wire.encode_round(r, 1))
    # Say the entry has 4 tokens while the block holds 3.
    at = wire.HEADER.size + wire.ROUND_FIXED.size + 12
    struct.pack_into("<I", frame, at, 4)
    with pytest.raises(wire.ProtocolError, match="past the token block"):
        read_frame(bytes(frame))


@pytest.mark.parametrize("raw,ok", [("ab" * 32, True), ("0x" + "AB" * 32, True), (" " + "0" * 64 + " ", True),
                                    ("ab" * 31, False), ("zz" * 32, False), ("", False)])
def test_parse_hex32(raw, ok):
    if ok:
        assert len(wire.parse_hex32(raw, "VAR")) == 32
    else:
        with pytest.raises(ValueError, match="VAR="):
            wire.parse_hex32(raw, "VAR")


def test_encoder_refuses_caps():
    with pytest.raises(ValueError, match="n_out"):
        wire.round_head(1, 1, 50, [wire.Entry(0, wire.MAX_N_OUT + 1, 0, ())], 0)
    with pytest.raises(ValueError, match="num_spec"):
        wire.encode_hello(wire.Hello(bytes(32), bytes(32), 1, 4, 0, 0), 1)

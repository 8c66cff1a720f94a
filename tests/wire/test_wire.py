"""The wire contract: round trips, caps before allocation, and fuzzed input."""

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.transport import Disconnected, FrameChannel

ident = st.binary(min_size=32, max_size=32)
u32 = st.integers(0, 2**32 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def rounds(draw, sampled: bool = False):
    """(round id, deadline, entries, rows, row_bytes); ``sampled``: each entry with a
    temperature (finite, >= 0: -0.0 included, it is 0) and a u64 seed."""
    row_bytes = draw(st.integers(0, 64))
    per_entry = {"temperature": st.floats(0, 2.0**100, width=32), "seed": st.integers(0, 2**64 - 1)} if sampled else {}
    entries = draw(
        st.lists(
            st.builds(
                wire.Entry,
                slot=u32,
                n_out=st.integers(0, wire.MAX_N_OUT),
                position=u32,
                tokens=st.lists(i32, max_size=20).map(tuple),
                new_gen=st.booleans(),
                **per_entry,
            ),
            max_size=12,
        )
    )
    rows = draw(st.binary(min_size=len(entries) * row_bytes, max_size=len(entries) * row_bytes))
    return draw(u32), draw(u32), entries, rows, row_bytes


@st.composite
def drafts(draw):
    n = draw(st.integers(0, 10))
    width = draw(st.integers(0, 8))
    counts = draw(st.lists(st.integers(0, width), min_size=n, max_size=n))
    tokens = draw(st.lists(i32, min_size=n * width, max_size=n * width))
    margins = draw(st.none() | st.lists(st.floats(0, 1, width=32), min_size=n * width, max_size=n * width))
    return wire.DraftsFrame(
        draw(u32),
        draw(st.lists(u32, min_size=n, max_size=n)),
        counts,
        draw(st.lists(st.sampled_from([wire.STATUS_OK, wire.STATUS_RESYNC]), min_size=n, max_size=n)),
        width,
        tuple(tokens),
        None if margins is None else tuple(margins),
    )


def split(frame: bytes):
    hdr = wire.decode_header(frame[: wire.HEADER.size])
    payload = frame[wire.HEADER.size :]
    assert hdr.payload_len == len(payload)
    return hdr, payload


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


@given(rounds(), st.integers(0, 2**64 - 1))
def test_round_round_trip(r, session):
    round_id, deadline_ms, entries, rows, row_bytes = r
    hdr, payload = split(wire.encode_round_entries(round_id, session, deadline_ms, entries, rows, row_bytes))
    back = wire.decode_round(hdr, payload)
    assert (back.round_id, back.deadline_ms, back.row_bytes) == (round_id, deadline_ms, row_bytes)
    assert back.entries() == [wire.Entry(e.slot, e.n_out, e.position, list(e.tokens), e.new_gen) for e in entries]
    assert bytes(back.rows) == rows and len(back) == len(entries)


def test_round_sections_are_the_arrays_end_to_end():
    """The layout the engine, the proxy's C and the worker all index: u32 arrays, then
    the tokens, then the rows, every section but the rows 4-byte aligned."""
    entries = [wire.Entry(3, 5, 10, (1, 2)), wire.Entry(7, 4, 0, (4, 5, 6), new_gen=True)]
    frame = wire.encode_round_entries(11, 5, 50, entries, bytes(range(2 * 3)), 3)
    payload = frame[wire.HEADER.size :]
    sec = wire.round_sections(2, 5, 3)
    assert struct.unpack_from("<4I", payload) == (50, 2, 3, 5)
    assert struct.unpack_from("<2I", payload, sec.slots) == (3, 7)
    assert struct.unpack_from("<2I", payload, sec.positions) == (10, 0)
    assert struct.unpack_from("<2I", payload, sec.n_out) == (5, 4)
    assert struct.unpack_from("<2I", payload, sec.flags) == (0, wire.FLAG_NEW_GEN)
    assert struct.unpack_from("<3I", payload, sec.offsets) == (0, 2, 5)
    assert struct.unpack_from("<5i", payload, sec.tokens) == (1, 2, 4, 5, 6)
    assert payload[sec.rows :] == bytes(range(6)) and sec.size == len(payload)
    assert sec.tokens == wire.round_meta_bytes(2) and sec.tokens % 4 == 0


@given(drafts())
def test_drafts_round_trip(d):
    hdr, payload = split(wire.encode_drafts(d, 3))
    back = wire.decode_drafts(hdr, payload)
    assert (back.round_id, back.width) == (d.round_id, d.width)
    assert (list(back.slots), list(back.counts), list(back.statuses)) == (list(d.slots), d.counts, d.statuses)
    assert list(back.tokens) == list(d.tokens)
    assert (back.margins is None) == (d.margins is None)
    if d.margins is not None:
        assert list(back.margins) == list(d.margins)
    assert [back.row(i) for i in range(len(d.slots))] == [
        list(d.tokens[i * d.width : i * d.width + c]) for i, c in enumerate(d.counts)
    ]


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

    def sendmsg(self, buffers, deadline=None):
        pass

    def close(self):
        pass


def read_frame(data: bytes):
    """Decode one frame from raw bytes through the real channel (caps included)."""
    hdr, payload = FrameChannel(_Bytes(data)).recv_frame(float("inf"))
    decode = {
        wire.HELLO: lambda: wire.decode_hello(payload),
        wire.HELLO_ACK: lambda: wire.decode_hello_ack(payload),
        wire.ROUND: lambda: wire.decode_round(hdr, payload),
        wire.DRAFTS: lambda: wire.decode_drafts(hdr, payload),
        wire.BYE: lambda: None,
    }[hdr.type]
    return decode()


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


@given(drafts().filter(lambda d: len(d.slots) > 0), st.data())
def test_corrupted_drafts_fields_are_protocol_errors(d, data):
    frame = bytearray(wire.encode_drafts(d, 1))
    i = data.draw(st.integers(wire.HEADER.size, wire.HEADER.size + 7))
    frame[i] ^= data.draw(st.integers(1, 255))
    try:
        got = read_frame(bytes(frame))
    except wire.ProtocolError:
        return
    # Still a valid frame: only a changed width of an empty grid keeps every length right,
    # and then the frame says something else than d did.
    assert d.width == 0 or got.width == 0, (d, got)
    assert got != d


@pytest.mark.parametrize(
    "ftype,cap", [(wire.HELLO, 88 + 32), (wire.AUTH, 64), (wire.BYE, 0), (wire.ROUND, wire.MAX_PAYLOAD)]
)
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


def round_payload(entries, row_bytes=0) -> bytearray:
    return bytearray(
        wire.encode_round_entries(1, 1, 50, entries, bytes(len(entries) * row_bytes), row_bytes)[wire.HEADER.size :]
    )


@pytest.mark.parametrize(
    "section, index, value, why",
    [
        ("offsets", 1, 4, "offsets go back"),  # entry 0 claims 4 of the 3 tokens before entry 1's
        ("offsets", 0, 1, "offsets run from 1 to 3"),
        ("offsets", 2, 2, "offsets run from 0 to 2, expected 0 to n_tokens=3"),
        ("flags", 1, 2, "unknown bits 0x2"),
        ("n_out", 0, wire.MAX_N_OUT + 1, f"n_out: {wire.MAX_N_OUT + 1} over the cap"),
    ],
)
def test_round_field_rules_are_protocol_errors(section, index, value, why):
    entries = [wire.Entry(0, 5, 0, (1, 2)), wire.Entry(1, 5, 0, (3,))]
    payload = round_payload(entries)
    struct.pack_into("<I", payload, getattr(wire.round_sections(2, 3, 0), section) + 4 * index, value)
    hdr = wire.decode_header(wire.encode_header(wire.ROUND, len(payload)))
    with pytest.raises(wire.ProtocolError, match=why):
        wire.decode_round(hdr, payload)


def test_round_length_must_match_its_fields():
    payload = round_payload([wire.Entry(0, 5, 0, (1, 2, 3))], row_bytes=4)
    hdr = wire.decode_header(wire.encode_header(wire.ROUND, len(payload) - 1))
    with pytest.raises(wire.ProtocolError, match="its fields say"):
        wire.decode_round(hdr, payload[:-1])


def test_a_protocol_1_peer_is_refused_by_version():
    frame = bytearray(wire.encode_bye())
    struct.pack_into("<H", frame, 4, 1)
    with pytest.raises(wire.VersionMismatch, match=f"protocol version 1, this side speaks {wire.PROTOCOL_VERSION}"):
        wire.decode_header(bytes(frame))


def test_drafts_field_rules_are_protocol_errors():
    d = wire.DraftsFrame(1, [0, 1], [1, 2], [0, 1], 2, [5, 6, 7, 8])
    payload = bytearray(wire.encode_drafts(d, 1)[wire.HEADER.size :])
    sec = wire.drafts_sections(2, 2, False)
    hdr = wire.decode_header(wire.encode_header(wire.DRAFTS, len(payload)))
    bad = bytearray(payload)
    struct.pack_into("<H", bad, sec.counts + 2, 3)
    with pytest.raises(wire.ProtocolError, match="counts: 3 over the width 2"):
        wire.decode_drafts(hdr, bad)
    bad = bytearray(payload)
    struct.pack_into("<H", bad, sec.statuses, 7)
    with pytest.raises(wire.ProtocolError, match="unknown status 7"):
        wire.decode_drafts(hdr, bad)


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


def test_encoder_refuses_caps():
    with pytest.raises(ValueError, match="n_out"):
        wire.encode_round_entries(1, 1, 50, [wire.Entry(0, wire.MAX_N_OUT + 1, 0, ())], b"", 0)
    with pytest.raises(ValueError, match="rows do not match"):
        wire.encode_round_entries(1, 1, 50, [wire.Entry(0, 1, 0, ())], b"xy", 4)
    with pytest.raises(ValueError, match="num_spec"):
        wire.encode_hello(wire.Hello(bytes(32), bytes(32), 1, 4, 0, 0), 1)

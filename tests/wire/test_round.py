"""ROUND (wire.round): round trips, the sections every reader indexes, the field rules
and caps; sampled sessions' temperature and seed sections (protocol 6), where an
unsampled ROUND is protocol 5's byte for byte but the header's version."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_cases import i32, split, u32

from remote_dspark import wire


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


def round_payload(entries, row_bytes=0) -> bytearray:
    return bytearray(
        wire.encode_round_entries(1, 1, 50, entries, bytes(len(entries) * row_bytes), row_bytes)[wire.HEADER.size :]
    )


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


def test_huge_counts_in_small_round_refused():
    payload = wire.ROUND_FIXED.pack(50, wire.MAX_ENTRIES + 1, 16, 0)
    hdr = wire.decode_header(wire.encode_header(wire.ROUND, len(payload)))
    with pytest.raises(wire.ProtocolError, match="entries over the cap"):
        wire.decode_round(hdr, payload)
    payload = wire.ROUND_FIXED.pack(50, 1, 16, 2**30)
    with pytest.raises(wire.ProtocolError, match="tokens over the cap"):
        wire.decode_round(hdr, payload)


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


def test_encoder_refuses_caps():
    with pytest.raises(ValueError, match="n_out"):
        wire.encode_round_entries(1, 1, 50, [wire.Entry(0, wire.MAX_N_OUT + 1, 0, ())], b"", 0)
    with pytest.raises(ValueError, match="rows do not match"):
        wire.encode_round_entries(1, 1, 50, [wire.Entry(0, 1, 0, ())], b"xy", 4)
    with pytest.raises(ValueError, match="num_spec"):
        wire.encode_hello(wire.Hello(bytes(32), bytes(32), 1, 4, 0, 0), 1)


# --------------------------------------------------------------------------- sampled


@given(rounds(sampled=True))
def test_a_sampled_round_round_trips_with_its_temperatures_and_seeds(r):
    round_id, deadline_ms, entries, rows, row_bytes = r
    frame = wire.encode_round_entries(round_id, 5, deadline_ms, entries, rows, row_bytes, sampled=True)
    hdr, payload = split(frame)
    back = wire.decode_round(hdr, payload, sampled=True)
    assert back.sampled and (back.round_id, back.deadline_ms, len(back)) == (round_id, deadline_ms, len(entries))
    assert back.entries() == [
        wire.Entry(e.slot, e.n_out, e.position, list(e.tokens), e.new_gen, e.temperature, e.seed) for e in entries
    ]
    assert bytes(back.rows) == rows
    n = len(entries)
    sec = wire.round_sections(n, sum(len(e.tokens) for e in entries), row_bytes, sampled=True)
    assert (sec.temperature, sec.seed, sec.tokens) == (
        sec.offsets + 4 * (n + 1),
        sec.offsets + 8 * n + 4,
        sec.seed + 8 * n,
    )
    assert sec.size == len(payload) and sec.tokens == wire.round_meta_bytes(n, sampled=True)
    assert sec.seed % 4 == 0 and (wire.HEADER.size + sec.seed) % 8 == 4  # 4-aligned, never 8: read unaligned
    got = struct.unpack_from(f"<{n}f{n}Q", payload, sec.temperature)
    assert list(got) == [e.temperature for e in entries] + [e.seed for e in entries]


@given(rounds(sampled=True))
def test_an_unsampled_round_is_protocol_5_s_bytes_but_for_the_version(r):
    """Protocol 5's ROUND written out by hand: the fixed part, five u32 arrays, the
    tokens, the rows. Protocol 6 adds nothing to a session that does not sample."""
    round_id, deadline_ms, entries, rows, row_bytes = r
    frame = wire.encode_round_entries(round_id, 5, deadline_ms, entries, rows, row_bytes)
    offsets = [0]
    for e in entries:
        offsets.append(offsets[-1] + len(e.tokens))
    tokens = [t for e in entries for t in e.tokens]
    n, t = len(entries), len(tokens)
    v5 = (
        struct.pack("<4I", deadline_ms, n, row_bytes, t)
        + struct.pack(f"<{n}I", *[e.slot for e in entries])
        + struct.pack(f"<{n}I", *[e.position for e in entries])
        + struct.pack(f"<{n}I", *[e.n_out for e in entries])
        + struct.pack(f"<{n}I", *[wire.FLAG_NEW_GEN if e.new_gen else 0 for e in entries])
        + struct.pack(f"<{n + 1}I", *offsets)
        + struct.pack(f"<{t}i", *tokens)
        + rows
    )
    header_v5 = struct.pack("<4sHHIQI", b"DSPW", 5, wire.ROUND, len(v5), 5, round_id)
    assert frame[:4] + frame[6:] == header_v5[:4] + header_v5[6:] + v5
    assert struct.unpack_from("<H", frame, 4) == (wire.PROTOCOL_VERSION,)
    assert wire.round_sections(n, t, row_bytes) == wire.round_sections(n, t, row_bytes, sampled=False)
    assert wire.round_meta_bytes(n) == 20 + 20 * n
    assert wire.decode_round(*split(frame)).temperature is None


def sampled_frame(temperatures, seeds=None) -> bytes:
    entries = [wire.Entry(i, 2, 0, (1, 2), True, t, s) for i, (t, s) in enumerate(zip(temperatures, seeds or [0] * 9))]
    return wire.encode_round_entries(1, 5, 50, entries, b"", 0, sampled=True)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, -1e-30])
def test_a_temperature_not_finite_or_negative_is_refused_naming_the_entry(bad):
    with pytest.raises(ValueError, match="temperature of entry 2"):
        sampled_frame([0.0, 1.0, bad])
    hdr, payload = split(sampled_frame([0.0, 1.0, 0.5]))
    payload = bytearray(payload)
    struct.pack_into("<f", payload, wire.round_sections(3, 6, 0, sampled=True).temperature + 8, bad)
    with pytest.raises(wire.ProtocolError, match="temperature of entry 2"):
        wire.decode_round(hdr, bytes(payload), sampled=True)


def test_minus_zero_is_a_temperature_of_zero():
    back = wire.decode_round(*split(sampled_frame([-0.0, 0.0])), sampled=True)
    assert list(back.temperature) == [0.0, 0.0]


def test_whether_a_round_has_the_sections_is_the_session_s():
    sampled, plain = sampled_frame([0.5, 1.0]), wire.encode_round_entries(1, 5, 50, [wire.Entry(0, 2, 0, (1,))], b"", 0)
    with pytest.raises(wire.ProtocolError, match="its fields say"):
        wire.decode_round(*split(sampled), sampled=False)
    with pytest.raises(wire.ProtocolError, match=r"its fields say \d+ \(sampled\)"):
        wire.decode_round(*split(plain), sampled=True)


def test_a_sampled_round_over_the_sampled_entries_cap_is_refused():
    payload = wire.ROUND_FIXED.pack(50, wire.MAX_SAMPLED_ENTRIES + 1, 0, 0)
    hdr = wire.decode_header(wire.encode_header(wire.ROUND, len(payload)))
    with pytest.raises(wire.ProtocolError, match="entries over the cap 1024 \\(sampled\\)"):
        wire.decode_round(hdr, payload, sampled=True)
    with pytest.raises(ValueError, match="over the cap 1024"):
        wire.encode_round(
            1, 1, 0, slots=[0] * 1025, positions=[0] * 1025, n_out=[0] * 1025, flags=[0] * 1025,
            offsets=[0] * 1026, tokens=[], rows=b"", row_bytes=0, temperature=[0.0] * 1025, seed=[0] * 1025,
        )  # fmt: skip


def test_temperature_and_seed_go_together():
    with pytest.raises(ValueError, match="both"):
        wire.encode_round(
            1, 1, 0, slots=[0], positions=[0], n_out=[1], flags=[0], offsets=[0, 0], tokens=[], rows=b"",
            row_bytes=0, temperature=[1.0],
        )  # fmt: skip


@settings(max_examples=300)
@given(st.binary(max_size=300), u32)
def test_arbitrary_sampled_round_payloads_raise_only_protocol_errors(payload, rnd):
    hdr = wire.decode_header(wire.encode_header(wire.ROUND, len(payload), 1, rnd))
    try:
        wire.decode_round(hdr, payload, sampled=True)
    except wire.ProtocolError:
        pass


@pytest.mark.parametrize("seed", [2**64, -1])
def test_a_seed_outside_u64_is_a_value_error_naming_seed(seed):
    with pytest.raises(ValueError, match="seed"):
        sampled_frame([1.0], [seed])

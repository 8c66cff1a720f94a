"""Sampled drafts on the wire (protocol 6): HELLO's options byte and the sampled caps,
ROUND's temperature and seed sections, DRAFTS' distributions; an unsampled ROUND is
protocol 5's byte for byte but the header's version."""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_wire import rounds

from remote_dspark import wire
from remote_dspark.drafter import sampling

IDS = (b"\x11" * 32, b"\x22" * 32)
u32 = st.integers(0, 2**32 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)


def split(frame: bytes):
    hdr = wire.decode_header(frame[: wire.HEADER.size])
    return hdr, frame[wire.HEADER.size :]


def hello(**kw) -> wire.Hello:
    fields = dict(engine_id=7, max_slots=8, row_bytes=4, num_spec=3, vocab_size=100)
    fields.update(kw)
    return wire.Hello(*IDS, **fields)


def test_the_sampled_constants_are_the_rule_s():
    assert (wire.SAMPLED_TOP, wire.SAMPLED_TOTAL) == (sampling.TOP, sampling.TOTAL) == (32, 65535)
    assert (wire.OPTION_MARGINS, wire.OPTION_SAMPLED, wire.DRAFTS_SAMPLED) == (1, 2, 2)
    # The caps keep a sampled DRAFTS' distributions at 3 MiB: 1024 x 16 x 32 x 6 B.
    assert wire.MAX_SAMPLED_ENTRIES * wire.MAX_SAMPLED_N_OUT * wire.SAMPLED_TOP * 6 == 3 << 20


# --------------------------------------------------------------------------- HELLO


@given(st.booleans(), st.booleans(), st.integers(1, wire.MAX_SAMPLED_ENTRIES), st.integers(1, wire.MAX_SAMPLED_N_OUT))
def test_hello_options_round_trip_and_are_byte_83(margin, sampled, slots, num_spec):
    h = hello(want_margin=margin, want_sampled=sampled, max_slots=slots, num_spec=num_spec)
    hdr, payload = split(wire.encode_hello(h, 9))
    assert payload[83] == (1 if margin else 0) | (2 if sampled else 0) == h.options
    assert wire.decode_hello(payload) == h


@pytest.mark.parametrize("options", [0x04, 0x08, 0x80, 0x07, 0xFF])
def test_an_unknown_option_bit_is_refused_naming_it(options):
    payload = bytearray(split(wire.encode_hello(hello(), 9))[1])
    payload[83] = options
    with pytest.raises(wire.ProtocolError, match=f"unknown bits {options & ~3:#04x}"):
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


# --------------------------------------------------------------------------- ROUND


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
    assert struct.unpack_from("<H", frame, 4) == (6,)
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


# --------------------------------------------------------------------------- DRAFTS


@st.composite
def sampled_drafts(draw):
    n = draw(st.integers(0, 6))
    width = draw(st.integers(0, 4))
    size = n * width * wire.SAMPLED_TOP
    margins = draw(st.none() | st.lists(st.floats(0, 1, width=32), min_size=n * width, max_size=n * width))
    return wire.DraftsFrame(
        draw(u32),
        draw(st.lists(u32, min_size=n, max_size=n)),
        draw(st.lists(st.integers(0, width), min_size=n, max_size=n)),
        draw(st.lists(st.sampled_from([wire.STATUS_OK, wire.STATUS_RESYNC]), min_size=n, max_size=n)),
        width,
        tuple(draw(st.lists(i32, min_size=n * width, max_size=n * width))),
        None if margins is None else tuple(margins),
        tuple(draw(st.lists(i32, min_size=size, max_size=size))),
        tuple(draw(st.lists(st.integers(0, 65535), min_size=size, max_size=size))),
    )


@given(sampled_drafts())
def test_drafts_with_distributions_round_trip(d):
    hdr, payload = split(wire.encode_drafts(d, 3))
    n, margins = len(d.slots), d.margins is not None
    assert struct.unpack_from("<IHH", payload) == (n, d.width, (1 if margins else 0) | wire.DRAFTS_SAMPLED)
    sec = wire.drafts_sections(n, d.width, margins, sampled=True)
    assert sec.size == len(payload) and sec.q_ids == sec.margins + (4 * n * d.width if margins else 0)
    assert sec.q_weights == sec.q_ids + 128 * n * d.width and sec.size == sec.q_weights + 64 * n * d.width
    back = wire.decode_drafts(hdr, payload)
    assert back.sampled and list(back.q_ids) == list(d.q_ids) and list(back.q_weights) == list(d.q_weights)
    assert list(back.tokens) == list(d.tokens) and (back.margins is None) == (not margins)
    assert wire.drafts_sections(n, d.width, margins) == wire.drafts_sections(n, d.width, margins, False)
    plain = dataclasses.replace(d, q_ids=None, q_weights=None)
    assert wire.decode_drafts(*split(wire.encode_drafts(plain, 3))).q_ids is None


def test_a_sampled_drafts_over_the_sampled_caps_is_refused():
    n, width = wire.MAX_SAMPLED_ENTRIES, wire.MAX_SAMPLED_N_OUT + 1
    payload = wire.DRAFTS_FIXED.pack(n, width, wire.DRAFTS_SAMPLED)
    hdr = wire.decode_header(wire.encode_header(wire.DRAFTS, len(payload)))
    with pytest.raises(wire.ProtocolError, match="sampled DRAFTS of 1024 entries x 17 over the caps 1024 x 16"):
        wire.decode_drafts(hdr, payload)
    with pytest.raises(wire.ProtocolError, match="unknown flags 0x4"):
        wire.decode_drafts(hdr, wire.DRAFTS_FIXED.pack(0, 0, 4))


def test_the_drafts_frame_cap_holds_a_full_sampled_reply_and_a_full_greedy_one():
    sampled = wire.drafts_sections(wire.MAX_SAMPLED_ENTRIES, wire.MAX_SAMPLED_N_OUT, True, True).size
    greedy = wire.drafts_sections(wire.MAX_ENTRIES, wire.MAX_N_OUT, True).size
    assert wire.frame_cap(wire.DRAFTS) == max(sampled, greedy) == sampled


@pytest.mark.parametrize("seed", [2**64, -1])
def test_a_seed_outside_u64_is_a_value_error_naming_seed(seed):
    with pytest.raises(ValueError, match="seed"):
        sampled_frame([1.0], [seed])

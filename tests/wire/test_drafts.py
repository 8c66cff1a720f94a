"""DRAFTS (wire.drafts): round trips, the field rules, corrupted fields; sampled
sessions' distributions (protocol 6) and their caps."""

from __future__ import annotations

import dataclasses
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wire_cases import i32, read_frame, split, u32

from remote_dspark import wire


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


# --------------------------------------------------------------------------- sampled


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

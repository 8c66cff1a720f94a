"""A sampled region (``Layout(..., sampled=True)``): its descriptors carry each entry's
temperature and seed, its drafts slots the distributions (q blocks), an empty answer
clears them, and the header's options word says so to whoever attaches."""

from __future__ import annotations

import math
import os
import struct

import numpy as np
import pytest

from remote_dspark import wire
from remote_dspark.outcome import Outcome
from remote_dspark.proxy import ring_end
from remote_dspark.shm import layout, ring
from remote_dspark.shm.layout import LINE, Layout, align
from remote_dspark.shm.memfd import Region

S, K, T = 16, 5, 100
SAMPLED = Layout(depth=4, max_slots=S, row_bytes=300, num_spec=K, max_tokens=T, sampled=True)
PLAIN = Layout(depth=4, max_slots=S, row_bytes=300, num_spec=K, max_tokens=T)
TOP = wire.SAMPLED_TOP
ENTRIES = [
    wire.Entry(3, 2, 0, [1], temperature=0.5, seed=9),
    wire.Entry(1, 3, 5, [2, 4], temperature=0.0, seed=2**64 - 1),
]


def test_a_sampled_layout_puts_the_q_blocks_between_tokens_and_margins_each_line_aligned():
    lay, q = SAMPLED, S * K * TOP
    assert lay.desc_stride == align(layout.DESC_FIXED + wire.round_meta_bytes(S, True) + 4 * (T + 1), LINE)
    assert lay.d_q_ids == align(lay.d_tokens + 4 * S * K, LINE)
    assert lay.d_q_weights == align(lay.d_q_ids + 4 * q, LINE)
    assert lay.d_margins == align(lay.d_q_weights + 2 * q, LINE)
    assert lay.drafts_stride == align(lay.d_margins + 4 * S * K, LINE)
    assert lay.zero_end == lay.d_q_weights + 2 * q  # an empty answer clears the q blocks too
    assert all(off % LINE == 0 for off in (lay.d_q_ids, lay.d_q_weights, lay.d_margins))


def test_an_unsampled_layout_has_empty_q_blocks_and_the_offsets_of_one_without_them():
    lay = PLAIN
    assert lay.d_q_ids == lay.d_q_weights == lay.d_margins == align(lay.d_tokens + 4 * S * K, LINE)
    assert lay.zero_end == lay.d_tokens + 4 * S * K
    assert lay.desc_stride == align(layout.DESC_FIXED + wire.round_meta_bytes(S) + 4 * (T + 1), LINE)
    assert lay.drafts_stride == align(lay.d_margins + 4 * S * K, LINE)
    assert struct.unpack_from("<I", lay.header_bytes(), 0x24) == (0,)
    assert struct.unpack_from("<I", SAMPLED.header_bytes(), 0x24) == (layout.OPT_SAMPLED,)


@pytest.mark.parametrize(
    "field,value,cap",
    [
        ("max_slots", wire.MAX_SAMPLED_ENTRIES + 1, "MAX_SAMPLED_ENTRIES"),
        ("num_spec", wire.MAX_SAMPLED_N_OUT + 1, "MAX_SAMPLED_N_OUT"),
    ],
)
def test_a_sampled_layout_refuses_sizes_over_the_sampled_caps_naming_them(field, value, cap):
    kw = dict(depth=2, max_slots=8, row_bytes=0, num_spec=4, max_tokens=8)
    kw[field] = value
    Layout(**kw)  # a greedy session's caps are wider
    with pytest.raises(ValueError, match=rf"{field}={value}: .*{cap}"):
        Layout(**kw, sampled=True)
    with pytest.raises(ValueError, match="sampled=1: must be a bool"):
        Layout(2, 8, 0, 4, 8, sampled=1)


def test_attach_reads_the_sampled_option_and_refuses_a_header_that_disagrees_with_the_file():
    with Region.create(SAMPLED) as region:
        with Region.attach(os.dup(region.fd)) as other:
            assert other.layout == SAMPLED and other.layout.sampled
        with region.view(0x24, 4) as options:
            options[:] = struct.pack("<I", 0)  # the same sizes, not sampled: another layout
        with pytest.raises(ValueError, match=f"header total_size {SAMPLED.size}, its sizes need {PLAIN.size}"):
            Region.attach(region.fd)
        with region.view(0x24, 4) as options:
            options[:] = struct.pack("<I", layout.OPT_SAMPLED | 4)
        with pytest.raises(ValueError, match="header options 0x5, this side knows only sampled"):
            Region.attach(region.fd)


def test_a_proxy_end_refuses_a_session_that_disagrees_with_the_region(lib):
    with Region.create(PLAIN) as region:
        with pytest.raises(ValueError, match="want_sampled=True, but the region's layout has sampled=False"):
            ring_end.ProxyEnd(region, lib, want_sampled=True)


def test_an_empty_answer_zeroes_the_q_blocks_and_leaves_the_margins(lib):
    with Region.create(SAMPLED) as region:
        eng = ring.EngineEnd(region, lib)
        r = eng.reserve(1)
        lay = SAMPLED
        with region.drafts(r & 3) as slot:
            slot[:] = b"\xff" * len(slot)
        assert eng.release_no_proxy(r)
        with region.drafts(r & 3) as slot:
            head = struct.unpack_from("<IIII", slot, 0)
            cleared = bytes(slot[layout.D_N : lay.zero_end])
            margins = bytes(slot[lay.d_margins : lay.d_margins + 4 * S * K])
        assert head == (r, Outcome.NO_PROXY, 0, 0)
        assert cleared == bytes(len(cleared)) and len(cleared) > 6 * S * K * TOP  # the q blocks included
        assert margins == b"\xff" * len(margins)  # past the count nothing reads them: not cleared


def test_a_sampled_descriptor_is_checked_and_sent_with_its_temperatures_and_seeds(lib):
    with Region.create(SAMPLED) as region:
        eng = ring.EngineEnd(region, lib)
        end = ring_end.ProxyEnd(region, lib, want_sampled=True)
        r = eng.reserve(1)
        eng.write_entries(r, ENTRIES)
        rnd = ring_end.ProxyRound(end, r, r & 3)
        header, block, rows = rnd.wire_parts(0x77)
        payload = bytes(block) + bytes(rows)
        decoded = wire.decode_round(wire.decode_header(bytes(header)), payload, sampled=True)
        assert decoded.entries() == ENTRIES
        block.release(), rows.release()
        at = layout.DESC_FIXED + wire.round_sections(2, 3, 300, True).temperature
        for bad, shown in ((math.nan, "nan"), (-0.5, "-0.5"), (math.inf, "inf")):
            with region.view(lay_desc(r) + at + 4, 4) as t:
                t[:] = np.float32(bad).tobytes()
            with pytest.raises(ValueError, match=f"entry 1: temperature {shown} not a finite float32 >= 0"):
                end.check_descriptor(r)
        del end


def lay_desc(r: int) -> int:
    return SAMPLED.desc(r & (SAMPLED.depth - 1))

"""The worker's DRAFTS frame: allocated whole, its sections handed out as writable numpy
views at ``wire.drafts_sections`` offsets, so a round's reply is written from the
drafter's arrays in place (no per-entry packing)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import wire


@dataclass
class DraftsArrays:
    """Writable views of a DRAFTS frame's sections (:func:`drafts_frame`)."""

    slots: np.ndarray       # [n] u32
    counts: np.ndarray      # [n] u16
    statuses: np.ndarray    # [n] u16
    tokens: np.ndarray      # [n, width] i32
    margins: np.ndarray | None   # [n, width] f32


def drafts_frame(session: int, round_id: int, n: int, width: int, margins: bool) -> tuple[bytearray, DraftsArrays]:
    """A whole zeroed DRAFTS frame (header and fixed part written) and views of its
    sections, at ``wire.drafts_sections`` offsets, for the caller to fill."""
    sec = wire.drafts_sections(n, width, margins)
    at = wire.HEADER.size
    frame = bytearray(at + sec.size)
    frame[:at] = wire.encode_header(wire.DRAFTS, sec.size, session, round_id)
    wire.DRAFTS_FIXED.pack_into(frame, at, n, width, wire.DRAFTS_MARGINS if margins else 0)

    def view(dtype, offset: int, count: int) -> np.ndarray:
        return np.frombuffer(frame, dtype, count, at + offset)
    return frame, DraftsArrays(
        view(np.uint32, sec.slots, n), view(np.uint16, sec.counts, n), view(np.uint16, sec.statuses, n),
        view(np.int32, sec.tokens, n * width).reshape(n, width),
        view(np.float32, sec.margins, n * width).reshape(n, width) if margins else None)

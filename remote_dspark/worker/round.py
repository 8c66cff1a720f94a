"""One round at the worker, as arrays (:func:`answer`): the ROUND's sections applied to
the session's windows and handed to the drafter as one
:class:`~remote_dspark.drafter.DraftBatch` (:func:`drafting_batch`; drafted through the
worker's scheduler), and the drafter's result written into the DRAFTS frame
(:func:`reply_frame`: the frame allocated whole, its sections writable numpy views at
``wire.drafts_sections`` offsets). No Python loop over the entries."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .. import wire
from ..drafter.contract import DraftBatch, DraftResult, empty_result
from .limits import Limits
from .sessions import Session


class RoundIn(Protocol):
    """A faster path in for :func:`answer` (:class:`~.native_round.NativeRounds`): what
    :func:`drafting_batch` makes of the decoded round, from the payload, as
    ``(deadline_ms, slots, ok, drafted, width, batch)``, raising as it does."""

    def drafting_batch(
        self, session: Session, hdr: wire.Header, payload, limits: Limits, max_positions: int | None
    ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, int, DraftBatch]: ...


@dataclass
class DraftsArrays:
    """Writable views of a DRAFTS frame's sections (:func:`drafts_frame`)."""

    slots: np.ndarray  # [n] u32
    counts: np.ndarray  # [n] u16
    statuses: np.ndarray  # [n] u16
    tokens: np.ndarray  # [n, width] i32
    margins: np.ndarray | None  # [n, width] f32
    q_ids: np.ndarray | None = None  # [n, width, 32] i32, a sampled session's
    q_weights: np.ndarray | None = None  # [n, width, 32] u16, a sampled session's


def drafts_frame(
    session: int, round_id: int, n: int, width: int, margins: bool, sampled: bool = False
) -> tuple[bytearray, DraftsArrays]:
    """A whole zeroed DRAFTS frame (header and fixed part written) and views of its
    sections, at ``wire.drafts_sections`` offsets, for the caller to fill (``sampled``:
    with the distributions' sections)."""
    sec = wire.drafts_sections(n, width, margins, sampled)
    at = wire.HEADER.size
    frame = bytearray(at + sec.size)
    frame[:at] = wire.encode_header(wire.DRAFTS, sec.size, session, round_id)
    flags = (wire.DRAFTS_MARGINS if margins else 0) | (wire.DRAFTS_SAMPLED if sampled else 0)
    wire.DRAFTS_FIXED.pack_into(frame, at, n, width, flags)
    top = wire.SAMPLED_TOP

    def view(dtype, offset: int, count: int) -> np.ndarray:
        return np.frombuffer(frame, dtype, count, at + offset)

    return frame, DraftsArrays(
        view(np.uint32, sec.slots, n),
        view(np.uint16, sec.counts, n),
        view(np.uint16, sec.statuses, n),
        view(np.int32, sec.tokens, n * width).reshape(n, width),
        view(np.float32, sec.margins, n * width).reshape(n, width) if margins else None,
        view(np.int32, sec.q_ids, n * width * top).reshape(n, width, top) if sampled else None,
        view(np.uint16, sec.q_weights, n * width * top).reshape(n, width, top) if sampled else None,
    )


def reply_frame(
    session: int,
    round_id: int,
    slots: np.ndarray,
    ok: np.ndarray,
    width: int,
    result: DraftResult,
    drafted: np.ndarray | None = None,
    sampled: bool = False,
) -> bytearray:
    """The DRAFTS frame of a round of ``slots``: RESYNC where not ``ok``, else the
    drafter's result (its rows are the ``drafted`` entries, in entry order: ``ok`` when
    None; an ``ok`` entry not drafted is answered OK with no drafts). ``sampled``: a
    sampled session's reply, with the result's distributions (zeros for entries not
    drafted, RESYNC ones, and a result without them: an expired round's)."""
    reply, out = drafts_frame(session, round_id, len(slots), width, result.margins is not None, sampled)
    out.slots[:] = slots
    out.statuses[:] = np.where(ok, wire.STATUS_OK, wire.STATUS_RESYNC)
    drafted = ok if drafted is None else drafted
    where = slice(None) if bool(drafted.all()) else drafted
    out.counts[where] = result.counts
    out.tokens[where] = result.tokens
    if out.margins is not None:
        out.margins[where] = result.margins
    if out.q_ids is not None and result.q_ids is not None:
        out.q_ids[where] = result.q_ids
        out.q_weights[where] = result.q_weights
    return reply


def check_for_session(session: Session, rnd: wire.Round, limits: Limits) -> np.ndarray:
    """A decoded ROUND held to what only this worker and the session know: the HELLO's
    row size, this worker's token limit, slots inside the session and each named once.
    Returns the round's slots ([n] int64).

    Raises: wire.ProtocolError naming the rule and the culprit."""
    if session.row_bytes is not None and rnd.row_bytes != session.row_bytes:
        raise wire.ProtocolError(f"ROUND row_bytes {rnd.row_bytes}, the session said {session.row_bytes}")
    if len(rnd.tokens) > limits.max_round_tokens:
        raise wire.ProtocolError(
            f"ROUND of {len(rnd.tokens)} tokens, over this worker's {limits.max_round_tokens} (--max-round-tokens)"
        )
    slots = np.frombuffer(rnd.slots, np.uint32).astype(np.int64)
    session.windows.check_slots(slots)
    return slots


def kept_streams(session: Session, lengths: np.ndarray) -> dict:
    """The batch's ``kept_from`` and ``history`` for a session whose drafter keeps whole
    streams (``session.history``): each stream's indices from ``lengths - min(lengths,
    keep)`` on are in its windows; nothing (the contexts only) for any other session."""
    if session.history is None:
        return {}
    return {"kept_from": lengths - np.minimum(lengths, session.windows.keep), "history": session.history}


def drafting_batch(
    session: Session, rnd: wire.Round, limits: Limits, max_positions: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, DraftBatch]:
    """Apply a decoded ROUND to ``session``'s windows. Returns ``(slots [n] int64, ok [n]
    bool, drafted [n] bool, width, batch)``: the round's slots, which of them have a
    window (else RESYNC), which of those are drafted (the others' context and width pass
    the drafter's position table ``max_positions``: no drafts, never wrapped positions),
    the drafts' width (``n_out`` at most, ``num_spec`` at most) and the drafter's batch of
    the ``drafted`` entries, each naming its stream (session serial, slot, generation,
    length) and its context's absolute position, in a sampled session its temperature
    and seed (the ROUND's, for the entries kept), and for a drafter that keeps whole
    streams what its windows keep of each (:func:`kept_streams`).

    Raises: wire.ProtocolError naming what breaks the session's HELLO or this worker's
    limits, or a slot outside the session or named twice.
    """
    slots = check_for_session(session, rnd, limits)
    n = len(rnd)
    n_out = np.frombuffer(rnd.n_out, np.uint32)
    adv = session.windows.advance(
        slots,
        np.frombuffer(rnd.positions, np.uint32).astype(np.int64),
        (np.frombuffer(rnd.flags, np.uint32) & wire.FLAG_NEW_GEN) != 0,
        np.frombuffer(rnd.offsets, np.uint32).astype(np.int64),
        np.frombuffer(rnd.tokens, np.int32),
    )
    ok = adv.ok
    width = min(int(n_out.max()) if n else 0, session.num_spec)
    all_ok = bool(ok.all())
    rows = np.frombuffer(rnd.rows, np.uint8).reshape(n, rnd.row_bytes)
    temperature = seed = None
    if rnd.sampled:  # seeds lie 4-aligned: numpy reads the unaligned view, astype copies it aligned
        temperature = np.frombuffer(rnd.temperature, np.float32).astype(np.float32)
        seed = np.frombuffer(rnd.seed, "<u8").astype(np.uint64)
        temperature, seed = (temperature, seed) if all_ok else (temperature[ok], seed[ok])
    batch = DraftBatch(
        adv.tokens,
        adv.offsets,
        np.minimum(n_out if all_ok else n_out[ok], width).astype(np.int32),
        rows if all_ok else rows[ok],
        session.want_margin,
        width,
        session=session.windows.serial,
        slots=adv.slots,
        gens=adv.gens,
        lengths=adv.lengths,
        positions=adv.starts,
        temperature=temperature,
        seed=seed,
        **kept_streams(session, adv.lengths),
    )
    beyond = batch.beyond(max_positions)
    if not beyond.any():
        return slots, ok, ok, width, batch
    drafted = ok.copy()
    drafted[ok] = ~beyond
    return slots, ok, drafted, width, batch.subset(~beyond)


@dataclass(frozen=True)
class Told:
    """What one answered round adds to the worker's counters."""

    entries: int
    resyncs: int
    beyond_positions: int
    draft_tokens: int
    expired: bool  # the drafter could not draft it before its deadline (passed, or too close)


def answer(
    session: Session,
    hdr: wire.Header,
    payload,
    limits: Limits,
    max_positions: int | None,
    draft: Callable[[int, DraftBatch, float], DraftResult | None],
    received: float,
    native: RoundIn | None = None,
) -> tuple[bytearray, Told]:
    """One ROUND of ``session`` in, its DRAFTS frame out (and what it adds to the
    counters): the windows advanced, the drafting entries handed to ``draft(session
    serial, batch, deadline)`` (the scheduler's: None when the deadline, counted from
    ``received``, passed in its queue: no drafts). A round with nothing to draft (empty,
    or every slot to re-announce) makes no call. ``native``: the C path takes the round
    in (:mod:`.native_round`); None: the Python reference. Raises: as
    :func:`drafting_batch`."""
    if native is not None:
        deadline_ms, slots, ok, drafted, width, batch = native.drafting_batch(
            session, hdr, payload, limits, max_positions
        )
    else:
        rnd = wire.decode_round(hdr, payload, session.want_sampled)
        deadline_ms = rnd.deadline_ms
        slots, ok, drafted, width, batch = drafting_batch(session, rnd, limits, max_positions)
    result, expired = None, False
    if len(batch):
        deadline = received + deadline_ms / 1000 if deadline_ms else math.inf
        result = draft(session.windows.serial, batch, deadline)
        expired = result is None
    if result is None:
        result = empty_result(len(batch), width, session.want_margin)
    reply = reply_frame(hdr.session, hdr.round, slots, ok, width, result, drafted, session.want_sampled)
    n_ok = int(np.count_nonzero(ok))
    told = Told(len(slots), len(slots) - n_ok, n_ok - len(batch), int(result.counts.sum()), expired)
    return reply, told

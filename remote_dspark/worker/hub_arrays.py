"""The arrays the hub (:mod:`.hub`) hands C: a drafting call's, which whole rounds are
gathered into (:class:`CallArrays`, made once, reused by every call), and a drafter's
result as ``hf_result`` (:func:`result_of`), which C writes the replies from."""

from __future__ import annotations

import numpy as np

from ..drafter.contract import DraftBatch, DraftResult


def result_of(result: DraftResult | None):
    """``hf_result`` of a drafter's result (None, or no entries: no drafts), and the
    arrays it points into (contiguous copies where the result's were not), which the
    caller keeps alive while C reads them."""
    from ..native import HubResult

    r = HubResult()
    if result is None or not len(result.counts):
        return r, ()
    tokens, margins = result.tokens, result.margins
    if tokens.strides[1] != 4 or (margins is not None and margins.strides != tokens.strides):
        tokens = np.ascontiguousarray(tokens, np.int32)
        margins = None if margins is None else np.ascontiguousarray(margins, np.float32)
    counts = np.ascontiguousarray(result.counts, np.int32)
    r.counts, r.tokens, r.stride = counts.ctypes.data, tokens.ctypes.data, tokens.strides[0] // 4
    keep = [counts, tokens, margins]
    if margins is not None:
        r.margins = margins.ctypes.data
    if result.q_ids is not None:
        q_ids = np.ascontiguousarray(result.q_ids, np.int32)
        q_weights = np.ascontiguousarray(result.q_weights, np.uint16)
        r.q_ids, r.q_weights, r.qstride = q_ids.ctypes.data, q_weights.ctypes.data, q_ids.strides[0] // 4
        keep += [q_ids, q_weights]
    return r, keep


def call_bytes(room: int, window: int, rounds: int) -> int:
    """What a call's arrays (:class:`CallArrays`) hold for ``room`` entries of ``window``
    context tokens and ``rounds`` rounds, rows apart (the memory table's row)."""
    return room * (4 * window + 72) + 16 * rounds + 8


class CallArrays:
    """The arrays a call of whole rounds is gathered into (``hf_call``), made once for
    ``room`` entries of ``window`` context tokens each and ``rounds`` rounds (the hub's
    connections: a round may have no entry to draft); rows grow to what a call needs."""

    def __init__(self, room: int, window: int, rounds: int):
        from ..native import HubCall

        self.room = room
        n, i8 = room, np.int64
        self.tokens = np.empty(room * window, np.int32)
        self.offsets, self.n_out = np.empty(n + 1, i8), np.empty(n, np.int32)
        self.slots, self.gens, self.lengths = np.empty(n, i8), np.empty(n, i8), np.empty(n, i8)
        self.starts, self.kept_from, self.sessions = np.empty(n, i8), np.empty(n, i8), np.empty(n, i8)
        self.temperature, self.seed = np.empty(n, np.float32), np.empty(n, np.uint64)
        self.received, self._deadlines = np.empty(rounds, np.uint64), np.empty(rounds, np.uint64)
        self.rows = np.empty(0, np.uint8)
        self.c = HubCall(room_entries=n, room_tokens=len(self.tokens), room_rounds=rounds)
        for name in ("tokens", "offsets", "n_out", "slots", "gens", "lengths", "starts", "kept_from"):
            setattr(self.c, name, getattr(self, name).ctypes.data)
        for name in ("sessions", "temperature", "seed"):
            setattr(self.c, name, getattr(self, name).ctypes.data)
        self.c.received_ns, self.c.deadline_ns = self.received.ctypes.data, self._deadlines.ctypes.data

    def grow_rows(self, need: int) -> bool:
        """Room for ``need`` bytes of rows (at most 64 MiB: a call past it takes the jobs' way)."""
        if need <= len(self.rows) or need > 64 << 20:
            return False
        self.rows = np.empty(need, np.uint8)
        self.c.rows, self.c.room_rows = self.rows.ctypes.data, need
        return True

    def deadlines(self, k: int) -> np.ndarray:
        """The gathered rounds' deadlines, time.monotonic() seconds (inf: none)."""
        d = self._deadlines[:k]
        return np.where(d == np.uint64((1 << 64) - 1), np.inf, d / 1e9)

    def batch(self, history, session: int | None):
        """The gathered call as the drafter's batch: views of these arrays (``session``:
        the one session of a call of one round; None: each entry's)."""
        c, m = self.c, self.c.m
        sampled = bool(c.sampled)
        return DraftBatch(
            self.tokens[: c.n_tokens],
            self.offsets[: m + 1],
            self.n_out[:m],
            self.rows[: m * c.row_bytes].reshape(m, c.row_bytes),
            bool(c.margins),
            c.width,
            session=self.sessions[:m] if session is None else session,
            slots=self.slots[:m],
            gens=self.gens[:m],
            lengths=self.lengths[:m],
            positions=self.starts[:m],
            temperature=self.temperature[:m] if sampled else None,
            seed=self.seed[:m] if sampled else None,
            kept_from=self.kept_from[:m] if history is not None else None,
            history=history,
        )

"""The worker's per-round path in the C library (:class:`NativeRounds`): one call,
``hf_worker_round`` (``native/worker_round.c``), takes a received ROUND, holds it to
every rule :func:`~remote_dspark.wire.decode_round` and
:func:`~remote_dspark.worker.round.check_for_session` hold it to, applies it to the
session's windows and writes the drafter's :class:`~remote_dspark.drafter.DraftBatch`
into arrays allocated here: a handful of array views around one C loop instead of about
a hundred numpy operations.

The Python path (:func:`~remote_dspark.worker.round.drafting_batch` on a decoded
round) stays the reference: the tests drive both over random rounds and windows and
require the same verdicts, windows and batches. A round the C check refuses is checked
again by the reference's own checks, which raise its ``ProtocolError`` (the messages are
written once, in Python); that they always do is tested too.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref

import numpy as np

from .. import wire
from ..drafter.contract import DraftBatch
from .limits import Limits
from .round import check_for_session, kept_streams
from .sessions import Session

log = logging.getLogger("remote_dspark.worker")

# The batch's arrays as hf_worker_round writes them ([n] entries, [n x window] tokens):
# name, dtype, length (in entries, or "tokens"), whether only a sampled session has it.
_ARRAYS = (
    ("ok", np.bool_, "n", False),
    ("drafted", np.bool_, "n", False),
    ("tokens", np.int32, "tokens", False),
    ("n_out", np.int32, "n", False),
    ("offsets", np.int64, "n+1", False),
    ("slots", np.int64, "n", False),
    ("gens", np.int64, "n", False),
    ("lengths", np.int64, "n", False),
    ("starts", np.int64, "n", False),
    ("temperature", np.float32, "n", True),
    ("seed", np.uint64, "n", True),
)


_ENTRY_BYTES = wire.round_meta_bytes(1) - wire.round_meta_bytes(0)  # a ROUND's meta bytes per entry
_U64_MAX = (1 << 64) - 1  # hf_windows' max_positions when the drafter has no position table
_ANY_ROW_BYTES = (1 << 32) - 1  # hostflag.h's HF_ANY_ROW_BYTES: the session's row size is not checked


@functools.lru_cache(maxsize=64)
def _layout(n: int, window: int, sampled: bool) -> tuple[int, tuple[tuple[str, type, int, int], ...]]:
    """Bytes of one buffer holding a round's batch arrays, and each array's (name, dtype,
    byte offset, length), 8-aligned."""
    at, parts = 0, []
    for name, dtype, length, sampled_only in _ARRAYS:
        if sampled_only and not sampled:
            continue
        count = {"n": n, "n+1": n + 1, "tokens": n * window}[length]
        parts.append((name, dtype, at, count))
        at += -(-count * np.dtype(dtype).itemsize // 8) * 8
    return at, tuple(parts)


def batch_arrays(n: int, window: int, sampled: bool):
    """One buffer for a round's batch arrays with room for ``n`` entries, the
    ``BatchOut`` pointing into it, and the arrays' layout (:func:`_layout`)."""
    from ..native import BatchOut

    size, parts = _layout(n, window, sampled)
    buf = np.empty(size, np.uint8)
    base = buf.ctypes.data
    return buf, BatchOut(n_room=n, **{name: base + at for name, _, at, _ in parts}), parts


def load() -> NativeRounds | None:
    """The C path, or None (with one warning) when the library cannot be loaded: the
    worker then serves every round by the Python path."""
    from .. import native

    try:
        return NativeRounds(native.load())
    except (native.NativeError, ValueError) as e:
        log.warning("the native library is not available (%s): rounds take the Python path", e)
        return None


class NativeRounds:
    """``hf_worker_round`` for every session of a worker (any connection thread may call
    :meth:`drafting_batch`; each session's windows are its connection's)."""

    def __init__(self, lib):
        self.lib = lib
        self._call = lib.worker_round
        self._views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Windows -> (struct, seen marks)

    def view(self, session: Session, limits: Limits, max_positions: int | None):
        """The session's ``WindowsView`` with the worker's terms of this call (one per
        windows, kept while they live; the windows' guard word then serializes
        ``forget_all`` with a round served in C, whatever becomes of this object)."""
        got = self._views.get(session.windows)
        if got is None:
            from ..native import WindowsView

            w = session.windows
            seen = np.zeros(w.max_slots, np.uint8)
            view = WindowsView(
                ring=w.ring.ctypes.data,
                written=w.written.ctypes.data,
                gen=w.gen.ctypes.data,
                next_pos=w.next_pos.ctypes.data,
                known=w.known.ctypes.data,
                seen=seen.ctypes.data,
                max_slots=w.max_slots,
                window=w.window,
                keep=w.keep,
                num_spec=session.num_spec,
                sampled=int(session.want_sampled),
                row_bytes=_ANY_ROW_BYTES if session.row_bytes is None else session.row_bytes,
                guard=w.guard.ctypes.data,
            )
            got = self._views[w] = (view, seen)
            w.native_forget = functools.partial(self.lib.windows_forget, ctypes.byref(view))
        view = got[0]
        # The worker's terms, as given this call (the session's own are fixed at its HELLO).
        view.max_positions = _U64_MAX if max_positions is None else min(max_positions, _U64_MAX)
        view.max_round_tokens = limits.max_round_tokens
        return view

    def drafting_batch(
        self, session: Session, hdr: wire.Header, payload, limits: Limits, max_positions: int | None
    ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, int, DraftBatch]:
        """What :func:`~remote_dspark.worker.round.drafting_batch` makes of the decoded
        round, from the payload: ``(deadline_ms, slots, ok, drafted, width, batch)``
        (``slots`` a u32 view of the payload).

        Raises: wire.ProtocolError, the reference's, naming the rule the round broke."""
        view = self.view(session, limits, max_positions)
        data = np.frombuffer(payload, np.uint8)
        # Room for the entries the payload can hold, at most the session's slots (a round
        # names each once): never more than the peer's count, nor a buffer it could make
        # larger than half the session's own ring by announcing more.
        fixed = wire.ROUND_FIXED.size
        told = int(data[4:8].view(np.uint32)[0]) if len(data) >= fixed else 0
        n = min(told, session.max_slots, max(0, len(data) - fixed) // _ENTRY_BYTES)
        buf, out, parts = batch_arrays(n, session.windows.window, session.want_sampled)
        with session.windows.lock:
            rule = self._call(ctypes.byref(view), data.ctypes.data, len(data), ctypes.byref(out))
        if rule:
            self.refused(session, hdr, payload, limits, rule)
        return written(session, arrays_of(buf, parts), out, data)

    @staticmethod
    def refused(session: Session, hdr: wire.Header, payload, limits: Limits, rule: int | None) -> None:
        """The reference's checks of a round the C check refused (``rule``; None: the hub's,
        which does not say): they raise its ProtocolError, naming the culprit. Raises
        RuntimeError when they accept it (the two disagree: a bug the tests exist to
        catch)."""
        check_for_session(session, wire.decode_round(hdr, payload, session.want_sampled), limits)
        by = "the hub" if rule is None else f"rule {rule}"
        raise RuntimeError(
            f"ROUND {hdr.round}: refused by the native check ({by}), accepted by the Python "
            "reference; native/worker_round.c and worker/round.py disagree"
        )


def arrays_of(buf: np.ndarray, parts) -> dict[str, np.ndarray]:
    """The batch arrays in ``buf`` (:func:`batch_arrays`' buffer and layout), whole."""
    return {name: np.frombuffer(buf, dtype, count, at) for name, dtype, at, count in parts}


def written(
    session: Session, a: dict[str, np.ndarray], out, data: np.ndarray
) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, int, DraftBatch]:
    """What ``hf_worker_round`` wrote of the round in ``data`` (its payload) into the
    arrays ``a`` (:func:`arrays_of`) and ``out`` (their ``BatchOut``), as
    :meth:`NativeRounds.drafting_batch` returns it: ``(deadline_ms, slots, ok, drafted,
    width, batch)``, each a view."""
    n, m, width, row_bytes = out.n, out.m, out.width, out.row_bytes
    rows = data[len(data) - n * row_bytes :].reshape(n, row_bytes)
    drafted = a["drafted"][:n]
    if m < n:
        rows = rows[drafted]
    sampled = session.want_sampled
    batch = DraftBatch(
        a["tokens"][: out.n_tokens],
        a["offsets"][: m + 1],
        a["n_out"][:m],
        rows,
        session.want_margin,
        width,
        session=session.windows.serial,
        slots=a["slots"][:m],
        gens=a["gens"][:m],
        lengths=a["lengths"][:m],
        positions=a["starts"][:m],
        temperature=a["temperature"][:m] if sampled else None,
        seed=a["seed"][:m] if sampled else None,
        **kept_streams(session, a["lengths"][:m]),
    )
    slots = data[wire.ROUND_FIXED.size : wire.ROUND_FIXED.size + 4 * n].view(np.uint32)
    return out.deadline_ms, slots, a["ok"][:n], drafted, width, batch

"""The worker's one reader of its streams' tokens (:class:`History`): what a drafter that
keeps whole streams reads beyond an entry's context
(:class:`~remote_dspark.drafter.streams.TokenReader`).

Every session's windows are registered here by their serial (``Windows.serial``, what a
batch's ``session`` names), weakly: a session that ends takes its windows with it, and
its tokens are never read again. The same registry is the worker's count of the memory
its sessions' windows hold (:meth:`History.nbytes`), which admission holds to
``--history-mb`` (:class:`~.sessions.Sessions`).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from .windows import Windows


class History:
    """Session serial -> its windows (weakly), for every session of a worker."""

    def __init__(self):
        self._windows: weakref.WeakValueDictionary[int, Windows] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()  # add / nbytes from connection threads, read from the drafter's

    def add(self, windows: Windows) -> None:
        with self._lock:
            self._windows[windows.serial] = windows

    def nbytes(self) -> int:
        """The bytes the live sessions' windows hold at most (:meth:`Windows.nbytes`)."""
        with self._lock:
            return sum(w.nbytes for w in self._windows.values())

    def read(
        self, sessions: np.ndarray, slots: np.ndarray, first: np.ndarray, stop: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Stream ``(sessions[i], slots[i])``'s tokens at indices ``first[i]`` to ``stop[i] -
        1``, as one flat int32 array and its ``[m + 1]`` int64 offsets: one
        :meth:`Windows.read` per session named (a loop over the few sessions, not the
        entries).

        Raises: ValueError naming a session that is gone, or (:meth:`Windows.read`) a span
        its slot no longer holds."""
        sessions, slots, first, stop = (np.asarray(a, np.int64) for a in (sessions, slots, first, stop))
        counts = stop - first
        offsets = np.zeros(len(slots) + 1, np.int64)
        np.cumsum(np.maximum(counts, 0), out=offsets[1:])
        out = np.empty(int(offsets[-1]), np.int32)
        for serial in np.unique(sessions).tolist():
            with self._lock:
                windows = self._windows.get(serial)
            if windows is None:
                raise ValueError(f"session {serial}: gone (its connection ended), its stream tokens with it")
            of = np.flatnonzero(sessions == serial)
            tokens, got = windows.read(slots[of], first[of], stop[of])
            lead = np.repeat(offsets[of] - got[:-1], np.diff(got))
            out[lead + np.arange(len(tokens))] = tokens
        return out, offsets

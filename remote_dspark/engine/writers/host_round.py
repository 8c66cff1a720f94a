"""The engine's host side of a round in C (:class:`HostRound`): a CPU engine's whole
hand-over and answer, and every engine's summary of a released round.

``hf_host_round`` (``native/engine_round.c``) hands a reserved round over: the batch's
metadata checked and written into the round's descriptor (``hf_host_meta``), its rows
gathered into the staging slot, the descriptor's round word, ``gathered`` published and,
in process mode, the first microseconds of the wait for ``released`` spun with the GIL
held (streamsync's hold). ``hf_host_answer`` copies the released answer into the
engine's new tensors and sums it, or, for a round ``launch()`` enqueued, only sums it.
The Python steps they replace, each a microsecond or a few of the engine thread's CPU,
were most of a process round's cost on the host (docs/benchmarks.md).

The hand-over takes what :class:`~.native_meta.NativeMeta` takes, with rows as a CPU
tensor of rows contiguous within themselves and a contiguous int32 or int64 index; the
answer's copy is for an engine that asked for no margins and no distributions. Anything
else goes the Python way (``Handoff._hand_over`` and ``Handoff._answer``), which stays the
reference these calls are tested against; a batch refused here is checked again there,
so every message is written once.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ...native import HostRoundCode, HostRoundIn
from ...outcome import Outcome
from ...shm import memfd, ring
from ..values.batch import Batch, row_outside
from ..values.drafts import Drafts, empty_drafts
from .native_meta import NativeMeta

_INDEX = {torch.int64: 8, torch.int32: 4}
_NP_INDEX = {np.dtype(np.int64): 8, np.dtype(np.int32): 4}
_OUTCOMES = {int(o): o for o in Outcome}


class HostRound:
    """One engine's host side of its rounds in C (its engine thread's: one round at a
    time). Holds addresses into ``region``, not views: the engine calls it only between a
    round's ``users.enter()`` and ``leave()``, while the region is mapped.

    ``meta``: the engine's :class:`~.native_meta.NativeMeta` (None for a sampled engine,
    whose hand-over is Python's); ``hold_us``: the hand-over's spin for the release."""

    def __init__(self, lib, region: memfd.Region, spec, meta: NativeMeta | None, hold_us: int):
        lay = region.layout
        self._spec, self._meta = spec, meta
        self._round, self._answer, self._summary = lib.host_round, lib.host_answer, lib.host_summary
        self._geom = ring.geometry(region)
        self._lost = np.zeros(spec.max_slots, np.uint32)
        self._h = HostRoundIn(
            ring=ctypes.addressof(self._geom),
            meta=meta.struct_addr if meta is not None else None,
            wake=region.addr(lay.wake),
            lost=self._lost.ctypes.data,
            desc=region.addr(lay.desc(0)),
            staging=region.addr(lay.staging(0)),
            desc_stride=lay.desc_stride,
            desc_room=lay.desc_stride - memfd.DESC_FIXED,
            staging_stride=lay.staging_stride,
            d_counts=memfd.D_COUNTS,
            d_statuses=lay.d_entry_status,
            d_tokens=lay.d_tokens,
            hold_ns=hold_us * 1000,
            row_bytes=spec.row_bytes,
            num_spec=spec.num_spec,
            max_slots=spec.max_slots,
        )
        self._ref = ctypes.byref(self._h)
        self.spin_cpu_s = 0.0  # the CPU of the last hand-over's spin for the release (its wait's)

    def hand_over(self, batch: Batch, r: int) -> bool | None:
        """Hand reserved round ``r`` over (cut by the acked word: ``NativeMeta``): True
        when it was released within the hold, False when not yet, None when this call
        does not take the batch (nothing handed over: the caller goes the Python way).

        Raises:
            ValueError: naming what is wrong with the batch (nothing handed over)."""
        spec, h = self._spec, self._h
        n = len(batch)
        meta = self._meta
        if meta is None or not meta.reads_acked:
            return None  # (a sampled engine's, or a cut the C struct cannot hold: the Python way)
        if not meta.fill(batch, deadline_ms=spec.cfg.timeout_ms, n_out_default=spec.n_out_for(n)):
            return None
        if spec.row_bytes:  # (rows missing or given to a rowless engine: the Python way names them)
            if not self._rows(batch.rows, batch.row_index, n):
                return None
        elif batch.rows is not None or batch.row_index is not None:
            return None
        h.round = r
        rc = self._round(self._ref)
        if rc == HostRoundCode.OK:
            self.spin_cpu_s = h.spin_cpu_ns / 1e9
            return bool(h.released_now)
        if rc == HostRoundCode.META:
            self._meta.refused(batch, h.meta_rule)  # raises, naming the culprit
        if rc == HostRoundCode.ROW:
            raise row_outside(batch.row_index, h.bad_entry, h.src_rows)
        raise RuntimeError(f"hf_host_round: {HostRoundCode(rc).name}")

    def _rows(self, rows, index, n: int) -> bool:
        """Point the struct at ``rows`` and ``index``: False for rows or an index this
        call does not take as they are (the Python gather converts or refuses them)."""
        if not isinstance(rows, torch.Tensor) or not rows.is_cpu or rows.dim() != 2 or rows.stride(1) != 1:
            return False
        size = rows.element_size()
        if rows.shape[1] * size != self._spec.row_bytes or rows.is_neg() or rows.is_conj():
            return False
        if isinstance(index, torch.Tensor):
            index_bytes = _INDEX.get(index.dtype)
            if not index_bytes or not index.is_cpu or index.shape != (n,) or not index.is_contiguous():
                return False
            addr = index.data_ptr()
        elif isinstance(index, np.ndarray) and index.shape == (n,) and index.flags.c_contiguous:
            index_bytes = _NP_INDEX.get(index.dtype)
            if not index_bytes:
                return False
            addr = index.ctypes.data
        else:
            return False
        h = self._h
        h.rows, h.src_stride, h.src_rows = rows.data_ptr(), rows.stride(0) * size, rows.shape[0]
        h.index, h.index_bytes = addr, index_bytes
        return True

    def answer(self, r: int, n: int) -> tuple[Outcome, Drafts]:
        """Released round ``r``'s answer for its ``n`` entries: one copy of its counts and
        tokens into new tensors.

        Raises:
            RuntimeError: the drafts slot holds another round (read after it was reused),
                or an entry count that is neither 0 nor ``n``."""
        k = self._spec.num_spec
        # (numpy's allocation and torch.from_numpy: about half torch.empty's time)
        counts, tokens = torch.from_numpy(np.empty(n, np.int32)), torch.from_numpy(np.empty((n, k), np.int32))
        rc = self._answer(self._ref, r, n, counts.data_ptr(), tokens.data_ptr())
        outcome = self._outcome(rc, r, n)
        if not self._h.got:
            return outcome, empty_drafts(n, k, outcome, False)
        h = self._h
        sums = (h.drafted, h.draft_tokens)
        return outcome, Drafts(tokens, counts, None, "remote", outcome, self._lost_slots(), sums=sums)

    def summary(self, r: int) -> tuple[Outcome, int, int, tuple[int, ...]]:
        """Released round ``r``'s outcome, its entries with drafts and their tokens, and
        the slots the worker lost: what a launched round is counted by (of at most the
        engine's slots). Raises as :meth:`answer` (another round in the slot)."""
        outcome = self._outcome(self._summary(self._ref, r), r)
        h = self._h
        return outcome, h.drafted, h.draft_tokens, self._lost_slots()

    def _outcome(self, rc: int, r: int, n: int = 0) -> Outcome:
        """The read answer's outcome; raises for a refused read (``rc``)."""
        h = self._h
        if not rc:  # (the common case first: an IntEnum's comparisons cost a call each)
            outcome = _OUTCOMES.get(h.status)
            return Outcome(h.status) if outcome is None else outcome  # (an unknown status raises, naming it)
        if rc == HostRoundCode.OTHER:
            slot = r & (self._spec.depth - 1)
            raise RuntimeError(
                f"drafts slot {slot} holds round {h.head_round}, expected {r}: read after the slot was reused"
            )
        if rc == HostRoundCode.GOT:
            raise RuntimeError(f"drafts slot of round {r}: {h.got} entries, the round has {n}")
        raise RuntimeError(f"hf_host_answer: {HostRoundCode(rc).name}")

    def _lost_slots(self) -> tuple[int, ...]:
        n = self._h.n_lost
        return tuple(self._lost[:n].tolist()) if n else ()

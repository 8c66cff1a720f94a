"""The engine's round metadata by one C call (:class:`NativeMeta`): ``hf_host_meta``
(``native/engine_meta.c``) holds a batch's metadata to every rule of
:func:`~remote_dspark.engine.values.meta.host_meta`, cuts its NEW_GEN contexts and writes the
ROUND payload's fixed part, entry arrays and tokens where the round goes, the bytes
:func:`~remote_dspark.engine.values.meta.write_meta` writes: one C loop instead of about twenty
numpy operations, each of a few microseconds, on the engine's critical path.

It takes the common batch: metadata on the host as int32 or int64 tensors or arrays
(``new_gen`` bool), one-dimensional and contiguous, of a greedy engine. Any other batch
(a sampled engine's, lists made arrays of another dtype, strided views) goes the Python
way, which is also the reference the tests hold this path to. A batch the C check
refuses is checked again by ``host_meta``, whose ValueError names the culprit, so the
messages are written once; the two disagreeing is a loud RuntimeError.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import torch

from ...native import MetaIn
from ..values.batch import Batch
from ..values.meta import host_meta, write_meta

_INTS = {torch.int32: 4, torch.int64: 8}  # a tensor's dtype -> its element size
_BOOLS = {torch.bool: 1}
_U32_MAX = (1 << 32) - 1


def _address(x, n: int, bools: bool = False) -> tuple[int, int] | None:
    """``(address, element size)`` of a host array or tensor of ``n`` ints (``bools``:
    of bools) that the C call can read as it is, else None."""
    if isinstance(x, torch.Tensor):  # (the fewest calls into torch: each is most of this check's cost)
        size = (_BOOLS if bools else _INTS).get(x.dtype)
        if size is None or x.shape != (n,) or not x.is_contiguous() or not x.is_cpu or x.is_neg():
            return None  # (a negative view's memory is not its values; no int or bool view is conjugate)
        return x.data_ptr(), size
    if not isinstance(x, np.ndarray) or x.ndim != 1 or x.shape[0] != n or not x.flags.c_contiguous:
        return None
    if (x.dtype == np.bool_) if bools else (x.dtype.char in "il" and x.dtype.isnative):
        return x.ctypes.data, x.dtype.itemsize
    return None


class NativeMeta:
    """``hf_host_meta`` for one engine's rounds (its terms fixed here; one thread at a
    time: the duplicate check's marks are this object's)."""

    def __init__(self, lib, spec, acked_at: int = 0):
        """``spec``: the engine's :class:`~remote_dspark.engine.spec.Spec` (its slots,
        num_spec, max_tokens, vocab_size and row_bytes are the call's terms). ``acked_at``:
        the address of the region's ``context_tokens`` word, which each call then reads
        for the round's cut (``Spec.context_cut``'s rule, in C); 0: each caller gives
        the cut."""
        self._call = lib.host_meta
        self._stamps = np.zeros(spec.max_slots, np.uint32)
        self._m = MetaIn(
            stamps=self._stamps.ctypes.data,
            max_slots=spec.max_slots,
            num_spec=spec.num_spec,
            max_tokens=spec.max_tokens,
            vocab_size=spec.vocab_size,
            row_bytes=spec.row_bytes,
        )
        if acked_at and 0 < spec.context_tokens <= _U32_MAX:  # (a cap past the u32: the caller's cut)
            m = self._m
            m.acked, m.context_cap, m.context_first = acked_at, spec.context_tokens, spec.context_cut(0)
        self.reads_acked = bool(self._m.acked)  # the calls cut by the acked word
        self._ref = ctypes.byref(self._m)
        self.struct_addr = ctypes.addressof(self._m)  # for a call that takes the struct by pointer (host_round)

    def write(
        self, batch: Batch, dst: int, room: int, *, deadline_ms: int, n_out_default: int, context_tokens: int = 0
    ) -> int | None:
        """Check ``batch`` and write its ROUND metadata at address ``dst`` (``room``
        bytes): the bytes written, or None when this call does not take the batch (the
        caller goes the Python way). ``context_tokens``: the cut, for a ``NativeMeta``
        that reads no acked word.

        Raises:
            ValueError: ``host_meta``'s, naming what is wrong with a refused batch."""
        if not self.fill(batch, deadline_ms=deadline_ms, context_tokens=context_tokens, n_out_default=n_out_default):
            return None
        rule = self._call(self._ref, dst, room)
        if rule:
            self.refused(batch, rule)
        return self._m.written

    def fill(self, batch: Batch, *, deadline_ms: int, n_out_default: int, context_tokens: int = 0) -> bool:
        """Point the struct at ``batch``'s arrays and set the round's terms (``context_tokens``
        as :meth:`write`'s): False when the C call does not take the batch (nothing set that
        a later fill would not set again)."""
        if batch.temperature is not None or batch.seed is not None:
            return False  # a sampled engine's (or a batch refused for its sampling fields)
        if not (self.reads_acked or 0 < context_tokens <= _U32_MAX) or not 0 <= n_out_default <= _U32_MAX:
            return False  # terms the C struct cannot hold (the engine's are always within)
        slots = batch.slots
        n = slots.shape[0] if isinstance(slots, (torch.Tensor, np.ndarray)) and slots.ndim == 1 else -1
        tokens = batch.tokens
        n_tokens = tokens.shape[0] if isinstance(tokens, (torch.Tensor, np.ndarray)) and tokens.ndim == 1 else -1
        got = [
            _address(slots, n),
            _address(batch.positions, n),
            _address(batch.token_offsets, n + 1),
            _address(tokens, n_tokens),
            _address(batch.new_gen, n, bools=True),
        ]
        n_out = None if batch.n_out is None else _address(batch.n_out, n)
        if n < 0 or n_tokens < 0 or None in got or (batch.n_out is not None and n_out is None):
            return False
        m = self._m
        (m.slots, m.slots_size), (m.positions, m.positions_size), (m.offsets, m.offsets_size) = got[:3]
        (m.tokens, m.tokens_size), (m.new_gen, _) = got[3:]
        m.n_out, m.n_out_size = n_out or (None, 0)
        m.n, m.n_tokens, m.deadline_ms, m.n_out_default = n, n_tokens, deadline_ms, n_out_default
        if not self.reads_acked:
            m.context_tokens = context_tokens
        return True

    def refused(self, batch: Batch, rule: int) -> None:
        """The reference's checks of the filled batch the C check refused (``rule``), with
        the cut that call used: they raise its ValueError. Raises RuntimeError when they
        accept it (the two disagree)."""
        m = self._m
        host_meta(
            batch,
            max_slots=m.max_slots,
            num_spec=m.num_spec,
            max_tokens=m.max_tokens,
            n_out_default=m.n_out_default,
            vocab_size=m.vocab_size,
            context_tokens=m.context_tokens,
        )
        raise RuntimeError(
            f"a batch refused by the native check (rule {rule}), accepted by the Python reference; "
            "native/engine_meta.c and engine/values/meta.py disagree"
        )


def write_round_meta(
    spec, native: NativeMeta | None, batch: Batch, dst: np.ndarray, dst_addr: int, acked: Callable[[], int]
) -> int | None:
    """``batch``'s ROUND metadata checked, cut and written into ``dst`` (a uint8 view at
    address ``dst_addr``) for an engine of ``spec`` whose worker acknowledged ``acked()``
    context tokens (read only where the cut is Python's): by ``native`` when it takes the
    batch, else by ``host_meta`` and ``write_meta``. Returns the bytes written, or None,
    writing nothing, when the batch's metadata is on a device (the caller writes it in
    stream order).

    Raises:
        ValueError: ``host_meta``'s, naming what is wrong."""
    deadline_ms = spec.cfg.timeout_ms
    if native is not None:
        cut = 0 if native.reads_acked else spec.context_cut(acked())
        done = native.write(
            batch,
            dst_addr,
            len(dst),
            deadline_ms=deadline_ms,
            n_out_default=spec.n_out_for(len(batch)),
            context_tokens=cut,
        )
        if done is not None:
            return done
    if batch.meta_on_device:
        return None
    return write_meta(dst, spec.meta(batch, acked()), deadline_ms=deadline_ms, row_bytes=spec.row_bytes)

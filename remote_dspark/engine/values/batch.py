"""A round's batch as the engine holds it, and the few whole-array copies that move it.

A :class:`Batch` is the engine's own layout (as vLLM's input batch): ``slots`` [n],
``tokens`` flattened with ``token_offsets`` [n + 1] (entry i owns
``tokens[token_offsets[i]:token_offsets[i + 1]]``, like ``query_start_loc``),
``positions`` [n], ``new_gen`` [n], the engine tensor ``rows`` with ``row_index`` [n]
(both None for an engine built with ``row_bytes=0``: no rows; :func:`has_rows`),
optionally ``n_out`` [n], and, exactly when the engine asks for sampled drafts
(``VLLM_DSPARK_SAMPLED_TOP32=1``), ``temperature`` [n] and ``seed`` [n]. Every field is
an int (float: temperature; bool: new_gen) tensor, on the CPU or on the device, or a
numpy array on the host (as an engine keeps numpy views of its pinned
CPU tensors); :meth:`Batch.from_lists` takes Python lists and converts them once (the
slow convenience). An id or count of another dtype than an integer (a float, a bool) is
refused by name when the round reads it (:func:`require_integers`), never truncated.

The wire's ROUND payload is exactly these arrays laid end to end (``wire.round_sections``),
so a round is:

- host metadata: checked and cut as numpy arrays (:func:`.meta.host_meta`, vectorized; a
  bad field is a ``ValueError`` naming it), then written with one slice assignment per
  section into the region's descriptor or the synchronous send buffer
  (:func:`.meta.write_meta`): :mod:`.meta` is the rule's home;
- metadata on the device: written into the registered descriptor in stream order
  (:mod:`..writers.device_meta`), never read back by the host; the proxy checks it where
  it lands, and a bad round is answered target-only and counted;
- the rows: one ``np.take`` into the staging slot on the CPU (numpy's copy runs on the
  calling thread: the engine's small copies never fan out to torch's intra-op pool and
  compete with the proxy and the worker for cores), one gather launch on the device;
- the answer: numpy views of the drafts slot (or of the DRAFTS payload), one copy per
  array into the ``Drafts`` tensors (:func:`.drafts.to_drafts`).

No function here loops over entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# The default cap on a NEW_GEN context (RemoteDSpark's context_tokens): the whole context of
# the common models (2,048 to 8,192 positions); a worker's HELLO_ACK cuts it to what it keeps.
CONTEXT_TOKENS = 8192

META_FIELDS = ("slots", "token_offsets", "positions", "new_gen", "n_out", "tokens")
SAMPLING_FIELDS = ("temperature", "seed")
INTEGER_FIELDS = ("slots", "token_offsets", "positions", "n_out", "tokens")  # of an integer dtype (require_integers)
_DTYPES = {"new_gen": bool, "temperature": np.float64, "seed": np.uint64}  # of a list; else int64


@dataclass
class Batch:
    """One drafting round (see the module docstring for the layout).

    ``tokens`` of entry i are those it accepted since its previous round, the first at
    ``positions[i]``; with ``new_gen[i]`` they are its whole context (positions[i] is
    then the position of the first of them, usually 0) and only the last
    ``context_tokens`` are sent (the engine's cap, or less: what the worker keeps).
    ``rows[row_index[i]]`` is its row of the engine tensor (``row_bytes`` bytes, any
    dtype); an engine of ``row_bytes=0`` takes a batch without ``rows`` and
    ``row_index``. ``n_out[i]`` drafts are asked for (capped at
    ``num_spec``), or the engine's n_out table's value for the batch size when None.

    A sampled engine's entries each draft at ``temperature[i]`` (finite, >= 0; 0: that
    entry's drafts are greedy) with randomness from ``seed[i]`` (an integer; an int64's
    bits are taken as the wire's u64): the same seed, context and temperature draw the
    same drafts, and no two positions of an entry share randomness
    (:mod:`remote_dspark.drafter.sampling`). Both are required by a sampled engine and
    refused by any other (:func:`.meta.host_meta`).
    """

    slots: torch.Tensor | np.ndarray
    tokens: torch.Tensor | np.ndarray
    token_offsets: torch.Tensor | np.ndarray
    positions: torch.Tensor | np.ndarray
    new_gen: torch.Tensor | np.ndarray
    rows: torch.Tensor | None = None
    row_index: torch.Tensor | np.ndarray | None = None
    n_out: torch.Tensor | np.ndarray | None = None
    temperature: torch.Tensor | np.ndarray | None = None
    seed: torch.Tensor | np.ndarray | None = None
    # ``tokens`` is a buffer and the round's tokens are its first ``token_offsets[-1]``:
    # a round planned on the device (``device_announce``), whose count no host has read.
    tokens_bounded: bool = False

    def __post_init__(self):
        for name in META_FIELDS + SAMPLING_FIELDS + ("row_index",):  # anything else (lists): numpy, once
            value = getattr(self, name)
            if value is not None and not isinstance(value, (torch.Tensor, np.ndarray)):
                setattr(self, name, _from_list(value, name))

    @classmethod
    def from_lists(
        cls,
        slots: Sequence[int],
        tokens: Sequence[Sequence[int]],
        positions: Sequence[int],
        new_gen: Sequence[bool],
        rows: torch.Tensor | None = None,
        row_index=None,
        n_out: Sequence[int] | None = None,
        temperature: Sequence[float] | None = None,
        seed: Sequence[int] | None = None,
    ) -> Batch:
        """A batch from per-entry Python lists (the slow convenience: it walks them once)."""
        lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
        offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = [t for ts in tokens for t in ts]  # made an array by __post_init__, never truncated
        return cls(slots, flat, offsets, positions, new_gen, rows, row_index, n_out, temperature, seed)

    def __len__(self) -> int:
        return int(self.slots.shape[0])

    @property
    def meta_on_device(self) -> bool:
        """True when any metadata tensor lives on an accelerator (an engine whose
        accepted tokens are still on the GPU)."""
        for t in (self.slots, self.tokens, self.token_offsets, self.positions, self.new_gen, self.n_out) + (
            self.temperature,
            self.seed,
        ):
            if isinstance(t, torch.Tensor) and not t.is_cpu:
                return True
        return False


def meta_to_host(batch: Batch) -> Batch:
    """``batch`` with its metadata (the sampling fields too) copied to the host, a
    blocking copy of each device tensor (a bounded ``tokens`` cut to its round's);
    ``rows`` and ``row_index`` as they are."""
    fields = META_FIELDS + SAMPLING_FIELDS
    cpu = {f: (v.cpu() if isinstance(v := getattr(batch, f), torch.Tensor) else v) for f in fields}
    if batch.tokens_bounded:
        cpu["tokens"] = cpu["tokens"][: int(cpu["token_offsets"][-1])]
    return Batch(rows=batch.rows, row_index=batch.row_index, **cpu)


@dataclass(frozen=True)
class HostMeta:
    """A batch's metadata on the host, checked, NEW_GEN contexts cut: the ROUND's arrays."""

    slots: np.ndarray  # [n] int64
    positions: np.ndarray  # [n] int64
    n_out: np.ndarray | int  # [n] int64, 0..num_spec; or one value for every entry
    new_gen: np.ndarray  # [n] bool: the wire's flags (FLAG_NEW_GEN is bit 0, so True is it)
    offsets: np.ndarray  # [n + 1] int64
    tokens: np.ndarray  # [T] any int dtype
    temperature: np.ndarray | None = None  # [n] float32, finite, >= 0: a sampled engine's
    seed: np.ndarray | None = None  # [n] uint64: a sampled engine's

    @property
    def sampled(self) -> bool:
        return self.temperature is not None

    @property
    def n(self) -> int:
        return int(self.slots.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


def _from_list(value, name: str) -> np.ndarray:
    """A field given as a list, as numpy: in its field's dtype, except a list of other
    than integers for an integer field, kept in numpy's own dtype for
    :func:`require_integers` to refuse (a float id is never truncated)."""
    want = _DTYPES.get(name, np.int64)
    if name not in INTEGER_FIELDS + ("row_index",):
        return np.asarray(value, dtype=want)
    a = np.asarray(value)
    return np.asarray(value, dtype=want) if a.size == 0 or a.dtype.kind in "iu" else a


def dtype_kind(x) -> str:
    """numpy's dtype kind of an array or a tensor (b, i, u, f, c)."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            return "b"
        if x.is_floating_point():
            return "f"
        if x.is_complex():
            return "c"
        return "i" if x.dtype.is_signed else "u"
    return np.asarray(x).dtype.kind


def require_integers(x, name: str) -> None:
    """The rule for the ids and counts an engine gives (a batch's slots, tokens, offsets,
    positions, n_out and row_index; the vLLM proposer's token ids and lengths): an
    integer dtype, so that no value is ever rounded or truncated on its way to the wire.
    Read from the dtype alone (a device tensor is not synced).

    Raises:
        ValueError: naming ``name`` and the dtype: a float, a bool or anything else.
    """
    if dtype_kind(x) not in "iu":
        raise ValueError(f"{name}: dtype {x.dtype}, expected an integer dtype (an id or count is never truncated)")


def host_array(t, name: str, n: int | None) -> np.ndarray:
    """``t`` (a CPU tensor or an array) as a one-dimensional numpy array of ``n`` values
    (None: any number).

    Raises:
        ValueError: naming ``name``: another shape."""
    a = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    if a.ndim != 1 or (n is not None and a.shape[0] != n):
        want = "1-D" if n is None else f"[{n}]"
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {want}")
    return a


def has_rows(batch: Batch, row_bytes: int) -> bool:
    """Whether ``batch`` has rows to gather, held to the engine's ``row_bytes``: an engine
    of ``row_bytes`` > 0 needs ``rows`` and ``row_index``, one of ``row_bytes=0`` takes
    neither (nothing is gathered, no kernel launched).

    Raises:
        ValueError: naming ``rows`` or ``row_index``, given to a rowless engine or
            missing for one with rows; a ``row_index`` not of an integer dtype.
    """
    given = [name for name in ("rows", "row_index") if getattr(batch, name) is not None]
    if row_bytes == 0:
        if given:
            raise ValueError(f"{given[0]}: given, but RemoteDSpark was built with row_bytes=0 (no rows); pass None")
        return False
    for name in ("rows", "row_index"):
        if name not in given:
            raise ValueError(f"{name}: None, but RemoteDSpark was built for row_bytes={row_bytes}")
    require_integers(batch.row_index, "row_index")
    return True


def gather_rows_host(batch: Batch, out: np.ndarray, row_bytes: int, lib=None, out_addr: int = 0) -> None:
    """``out[i] = bytes of rows[row_index[i]]`` for a CPU ``rows`` tensor, on this
    thread: with ``lib`` (the native library) one C copy loop into ``out_addr`` (the
    address of ``out``), else one ``np.take``.

    Raises:
        ValueError: rows of another size than ``row_bytes``, or a row index out of range.
    """
    if not batch.rows.is_cpu:
        raise ValueError(f"rows: on {batch.rows.device}, but RemoteDSpark runs on the CPU")
    src = as_bytes(batch.rows, row_bytes)
    n = len(batch)
    if lib is not None:
        index = batch.row_index
        if isinstance(index, torch.Tensor):
            if not index.is_cpu:
                index = index.cpu()  # the C loop reads it on the host
            if index.dtype != torch.int64 or not index.is_contiguous():
                index = index.to(torch.int64).contiguous()
            addr = index.data_ptr()
        else:
            index = np.ascontiguousarray(index, dtype=np.int64)
            addr = index.ctypes.data
        if tuple(index.shape) != (n,):
            raise ValueError(f"row_index: shape {tuple(index.shape)}, expected [{n}]")
        done = lib.gather_rows(out_addr, src.data_ptr(), src.stride(0), src.shape[0], addr, n, row_bytes)
        if done != n:
            raise row_outside(index, done, src.shape[0])
        return
    index = host_array(batch.row_index, "row_index", n)
    src = src.numpy()
    if n and (index.min() < 0 or index.max() >= src.shape[0]):
        raise ValueError(f"row_index: values must be in 0..{src.shape[0] - 1}, got {index.min()}..{index.max()}")
    np.take(src, index, axis=0, out=out[:n], mode="clip")  # in range, so clip only skips buffering


def row_outside(index, entry: int, n_rows: int) -> ValueError:
    """The error for entry ``entry`` of ``index`` naming no row of the ``n_rows`` rows."""
    return ValueError(f"row_index: {int(index[entry])} (entry {entry}) outside 0..{n_rows - 1}")


def as_bytes(rows: torch.Tensor, row_bytes: int | None = None) -> torch.Tensor:
    """``rows`` as ``[N, row_bytes]`` uint8 (each row must be contiguous within itself).

    Raises:
        ValueError: rows of another size than ``row_bytes``.
    """
    flat = rows.reshape(rows.shape[0], -1)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = flat.view(torch.uint8)
    if row_bytes is not None and out.shape[1] != row_bytes:
        raise ValueError(f"rows: {out.shape[1]} bytes per row, RemoteDSpark was built for row_bytes={row_bytes}")
    return out

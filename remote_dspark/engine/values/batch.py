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
slow convenience).

The wire's ROUND payload is exactly these arrays laid end to end (``wire.round_sections``),
so a round is:

- host metadata: checked and cut as numpy arrays (:func:`host_meta`, vectorized; a bad
  field is a ``ValueError`` naming it), then written with one slice assignment per
  section into the region's descriptor or the synchronous send buffer (:func:`write_meta`);
- metadata on the device: copied section by section into the registered descriptor in
  stream order (:mod:`..writers.device_meta`), never read back by the host; the proxy checks it where it
  lands, and a bad round is answered target-only and counted;
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

from ... import wire

CONTEXT_TOKENS = wire.DEFAULT_CONTEXT  # the default cut of a NEW_GEN context (RemoteDSpark's context_tokens)

assert wire.FLAG_NEW_GEN == 1  # a bool array is the flags section as it is
U32_MAX, I32_MIN, I32_MAX = 2**32 - 1, -(2**31), 2**31 - 1
_META_FIELDS = ("slots", "token_offsets", "positions", "new_gen", "n_out", "tokens")
_SAMPLING_FIELDS = ("temperature", "seed")
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
    refused by any other (:func:`host_meta`).
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

    def __post_init__(self):
        for name in _META_FIELDS + _SAMPLING_FIELDS + ("row_index",):  # anything else (lists): numpy, once
            value = getattr(self, name)
            if value is not None and not isinstance(value, (torch.Tensor, np.ndarray)):
                setattr(self, name, np.asarray(value, dtype=_DTYPES.get(name, np.int64)))

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
        flat = np.fromiter((t for ts in tokens for t in ts), dtype=np.int64, count=int(offsets[-1]))
        return cls(
            np.asarray(slots, dtype=np.int64),
            flat,
            offsets,
            np.asarray(positions, dtype=np.int64),
            np.asarray(new_gen, dtype=bool),
            rows,
            row_index,
            None if n_out is None else np.asarray(n_out, dtype=np.int64),
            temperature,
            seed,
        )

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


def _np(t, name: str, n: int | None) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    if a.ndim != 1 or (n is not None and a.shape[0] != n):
        want = "1-D" if n is None else f"[{n}]"
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {want}")
    return a


def host_meta(
    batch: Batch,
    *,
    max_slots: int,
    num_spec: int,
    max_tokens: int,
    n_out_default: int,
    vocab_size: int = 0,
    context_tokens: int = CONTEXT_TOKENS,
    sampled: bool = False,
) -> HostMeta:
    """Check ``batch``'s metadata (on the host) and cut its NEW_GEN contexts to their last
    ``context_tokens`` (each cut entry's position moves to its first token sent): a few
    whole-array operations (each costs microseconds, so the common case takes the
    fewest: no NEW_GEN entry means no cut to compute).

    ``vocab_size`` (0: unknown) bounds the token ids. ``sampled``: the engine asks for
    sampled drafts (:func:`sampling_meta`). Metadata on the device
    (``device_meta.write_meta_in_stream``) is not read here, so it cannot be refused here: the
    proxy's descriptor check (``hf_check_round`` in ``native/desc_check.c``) refuses a round
    with a token id outside the vocabulary instead, answering it ERROR, unsent, counted
    ``rounds_bad_desc``.

    Raises:
        ValueError: naming the field: ``slots`` out of 0..max_slots-1 or repeated,
            ``positions`` outside the wire's u32, ``tokens`` outside its i32 (or outside
            0..vocab_size-1), a negative ``n_out``, ``token_offsets`` that do not run
            from 0 to len(tokens) without going back, lengths that disagree, too many
            tokens; a sampling field wrong (:func:`sampling_meta`).
    """
    slots = _np(batch.slots, "slots", None).astype(np.int64, copy=False)
    n = slots.shape[0]
    if n > max_slots:
        raise ValueError(f"slots: a batch of {n} entries over max_slots={max_slots}")
    if n and slots.view(np.uint64).max() >= max_slots:  # a negative slot is huge as uint64
        bad = slots[(slots < 0) | (slots >= max_slots)][0]
        raise ValueError(f"slots: {bad} out of 0..{max_slots - 1}")
    if n and np.bincount(slots, minlength=max_slots).max() > 1:
        raise ValueError(f"slots: {int(np.bincount(slots).argmax())} repeated in one batch")
    positions = _np(batch.positions, "positions", n).astype(np.int64, copy=False)
    if n and positions.view(np.uint64).max() > U32_MAX:  # negative, or past the wire's u32
        bad = int(np.argmax((positions < 0) | (positions > U32_MAX)))
        raise ValueError(f"positions: {positions[bad]} (entry {bad}) outside 0..{U32_MAX}")
    new_gen = _np(batch.new_gen, "new_gen", n).astype(bool, copy=False)
    offsets = _np(batch.token_offsets, "token_offsets", n + 1).astype(np.int64, copy=False)
    tokens = _np(batch.tokens, "tokens", None)
    if tokens.dtype.itemsize > 4 and tokens.size and (tokens.min() < I32_MIN or tokens.max() > I32_MAX):
        raise ValueError(f"tokens: values outside the wire's int32 ({tokens.min()}..{tokens.max()})")
    if vocab_size and tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = int(np.argmax((tokens < 0) | (tokens >= vocab_size)))
        raise ValueError(f"tokens: {tokens[bad]} (token {bad}) outside 0..{vocab_size - 1}, the vocabulary")
    if offsets[0] != 0 or offsets[-1] != tokens.shape[0]:
        raise ValueError(
            f"token_offsets: run from {offsets[0]} to {offsets[-1]}, expected 0 to len(tokens)={tokens.shape[0]}"
        )
    back = offsets[1:] < offsets[:-1]  # (not lengths < 0: offsets near 2**63 make a difference wrap)
    if n and back.any():
        raise ValueError(f"token_offsets: not non-decreasing (entry {int(back.argmax())})")
    lengths = np.diff(offsets)
    if batch.n_out is None:
        n_out: np.ndarray | int = min(n_out_default, num_spec)  # one value for every entry
    else:
        n_out = _np(batch.n_out, "n_out", n).astype(np.int64, copy=False)
        if n and n_out.min() < 0:
            raise ValueError(f"n_out: negative value {n_out.min()} (entry {int(n_out.argmin())})")
        n_out = np.minimum(n_out, num_spec)
    if new_gen.any():
        tokens, offsets, positions = _cut(tokens, offsets, positions, lengths, new_gen, context_tokens)
    if tokens.shape[0] > max_tokens:
        raise ValueError(
            f"tokens: {tokens.shape[0]} in one round (NEW_GEN contexts cut to "
            f"{context_tokens}) over the region's max_tokens={max_tokens}"
        )
    temperature, seed = sampling_meta(batch, n, sampled)
    return HostMeta(slots, positions, n_out, new_gen, offsets, tokens, temperature, seed)


def _cut(tokens, offsets, positions, lengths, new_gen, context_tokens: int) -> tuple[np.ndarray, ...]:
    """``(tokens, offsets, positions)`` with each NEW_GEN context (of ``lengths``) cut
    to its last ``context_tokens`` tokens, its position moved to its first token sent.

    Raises:
        ValueError: a position moved past the wire's u32."""
    cut = np.where(new_gen, np.maximum(lengths - context_tokens, 0), 0)
    if not cut.any():
        return tokens, offsets, positions
    keep = lengths - cut
    new_offsets = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(keep, out=new_offsets[1:])
    take = np.repeat(offsets[:-1] + cut - new_offsets[:-1], keep) + np.arange(new_offsets[-1])
    positions = positions + cut
    if positions.max() > U32_MAX:  # a cut entry's first token sent
        bad = int(positions.argmax())
        raise ValueError(f"positions: {positions[bad]} (entry {bad}, after its NEW_GEN cut) over {U32_MAX}")
    return tokens[take], new_offsets, positions


def check_sampling_given(batch: Batch, sampled: bool) -> bool:
    """Whether ``batch`` carries sampling inputs, held to the engine: ``temperature`` and
    ``seed`` given exactly when it is ``sampled``, of a float (or int) and an int dtype.
    What can be known without reading a value, so the host path and the device path
    (``device_meta``) both ask it; :func:`sampling_meta` then checks the values.

    Raises:
        ValueError: naming ``temperature`` or ``seed``.
    """
    given = [name for name in _SAMPLING_FIELDS if getattr(batch, name) is not None]
    if not sampled:
        if given:
            raise ValueError(
                f"{given[0]}: given, but the engine does not ask for sampled drafts "
                "(VLLM_DSPARK_SAMPLED_TOP32=0); pass None"
            )
        return False
    for name in _SAMPLING_FIELDS:
        if name not in given:
            raise ValueError(
                f"{name}: None, but the engine asks for sampled drafts (VLLM_DSPARK_SAMPLED_TOP32=1); "
                "pass one per entry (temperature 0: that entry greedy)"
            )
    if dtype_kind(batch.temperature) not in "fiu":
        raise ValueError(f"temperature: dtype {batch.temperature.dtype}, expected a float")
    if dtype_kind(batch.seed) not in "iu":
        raise ValueError(f"seed: dtype {batch.seed.dtype}, expected an integer (an int64's bits are the u64 seed)")
    return True


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


def sampling_meta(batch: Batch, n: int, sampled: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``batch``'s temperatures (float32, -0.0 made 0) and seeds (uint64, an int64's
    bits) on the host, held to the engine: both exactly when ``sampled``.

    Raises:
        ValueError: naming ``temperature`` or ``seed``: :func:`check_sampling_given`'s,
            a shape that is not ``[n]``, a temperature negative or not finite (after its
            conversion to the wire's float32).
    """
    if not check_sampling_given(batch, sampled):
        return None, None
    with np.errstate(over="ignore"):  # past float32: inf, refused below
        temperature = _np(batch.temperature, "temperature", n).astype(np.float32)
    good = np.isfinite(temperature) & (temperature >= 0)
    if not good.all():
        bad = int(np.argmin(good))
        raise ValueError(f"temperature: {temperature[bad]} (entry {bad}) not a finite float32 >= 0 (0: greedy)")
    temperature += 0  # -0.0 + 0 is +0.0: one zero on the wire
    seed = _np(batch.seed, "seed", n)
    wide = np.int64 if seed.dtype.kind == "i" else np.uint64
    return temperature, seed.astype(wide, copy=False).view(np.uint64)


def write_meta(dst: np.ndarray, meta: HostMeta, *, deadline_ms: int, row_bytes: int) -> int:
    """Write the ROUND payload's fixed part, entry arrays and tokens (rows excepted) into
    ``dst`` (a uint8 array: a descriptor slot's payload area, or the send buffer past the
    header): one slice assignment per section. Returns the bytes written."""
    n, t = meta.n, meta.n_tokens
    sec = wire.round_sections(n, t, row_bytes, meta.sampled)
    u32 = dst[: sec.temperature].view(np.uint32)
    u32[:4] = (deadline_ms, n, row_bytes, t)
    at = wire.ROUND_FIXED.size // 4
    for arr in (meta.slots, meta.positions, meta.n_out, meta.new_gen):
        u32[at : at + n] = arr
        at += n
    u32[at : at + n + 1] = meta.offsets
    if meta.sampled:  # a sampled session's sections, last in the meta (seed 4-aligned only)
        dst[sec.temperature : sec.seed].view(np.float32)[:] = meta.temperature
        dst[sec.seed : sec.tokens].view(np.uint64)[:] = meta.seed
    dst[sec.tokens : sec.rows].view(np.int32)[:] = meta.tokens
    return sec.rows


def has_rows(batch: Batch, row_bytes: int) -> bool:
    """Whether ``batch`` has rows to gather, held to the engine's ``row_bytes``: an engine
    of ``row_bytes`` > 0 needs ``rows`` and ``row_index``, one of ``row_bytes=0`` takes
    neither (nothing is gathered, no kernel launched).

    Raises:
        ValueError: naming ``rows`` or ``row_index``, given to a rowless engine or
            missing for one with rows.
    """
    given = [name for name in ("rows", "row_index") if getattr(batch, name) is not None]
    if row_bytes == 0:
        if given:
            raise ValueError(f"{given[0]}: given, but RemoteDSpark was built with row_bytes=0 (no rows); pass None")
        return False
    for name in ("rows", "row_index"):
        if name not in given:
            raise ValueError(f"{name}: None, but RemoteDSpark was built for row_bytes={row_bytes}")
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
    index = _np(batch.row_index, "row_index", n)
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

"""The rule of a round's metadata, and its bytes: the one home of both.

:func:`host_meta` holds a batch's metadata (on the host) to the rule and cuts its NEW_GEN
contexts, a few whole-array numpy operations, a bad field a ``ValueError`` naming it;
:func:`write_meta` writes the ROUND payload's fixed part, entry arrays and tokens with
one slice assignment per section. The engine's faster writers are held to them, verdict
for verdict and byte for byte: the C call ``hf_host_meta`` (``native/engine_meta.c``,
:mod:`..writers.native_meta`), which has a batch it refuses checked again here so that
every message is written once, and the device's kernels (:mod:`..writers.device_meta`),
whose bad rounds the proxy's descriptor check refuses where they land. Both stay
running here: sync mode, a sampled engine and any batch the C call does not take are
written by these two.
"""

from __future__ import annotations

import numpy as np

from ... import wire
from .batch import (
    CONTEXT_TOKENS,
    INTEGER_FIELDS,
    SAMPLING_FIELDS,
    Batch,
    HostMeta,
    dtype_kind,
    host_array,
    require_integers,
)

assert wire.FLAG_NEW_GEN == 1  # a bool array is the flags section as it is
U32_MAX, I32_MIN, I32_MAX = 2**32 - 1, -(2**31), 2**31 - 1


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
            0..vocab_size-1), a negative ``n_out``, an id or count of another dtype than
            an integer (:func:`check_integer_fields`), ``token_offsets`` that do not run
            from 0 to len(tokens) without going back, lengths that disagree, too many
            tokens; a sampling field wrong (:func:`sampling_meta`).
    """
    check_integer_fields(batch)
    slots = host_array(batch.slots, "slots", None).astype(np.int64, copy=False)
    n = slots.shape[0]
    if n > max_slots:
        raise ValueError(f"slots: a batch of {n} entries over max_slots={max_slots}")
    if n and slots.view(np.uint64).max() >= max_slots:  # a negative slot is huge as uint64
        bad = slots[(slots < 0) | (slots >= max_slots)][0]
        raise ValueError(f"slots: {bad} out of 0..{max_slots - 1}")
    if n and np.bincount(slots, minlength=max_slots).max() > 1:
        raise ValueError(f"slots: {int(np.bincount(slots).argmax())} repeated in one batch")
    positions = host_array(batch.positions, "positions", n).astype(np.int64, copy=False)
    if n and positions.view(np.uint64).max() > U32_MAX:  # negative, or past the wire's u32
        bad = int(np.argmax((positions < 0) | (positions > U32_MAX)))
        raise ValueError(f"positions: {positions[bad]} (entry {bad}) outside 0..{U32_MAX}")
    new_gen = host_array(batch.new_gen, "new_gen", n).astype(bool, copy=False)
    offsets = host_array(batch.token_offsets, "token_offsets", n + 1).astype(np.int64, copy=False)
    tokens = host_array(batch.tokens, "tokens", None)
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
        n_out = host_array(batch.n_out, "n_out", n).astype(np.int64, copy=False)
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


def check_integer_fields(batch: Batch) -> None:
    """Hold ``batch``'s ids and counts (:data:`~.batch.INTEGER_FIELDS`) to an integer
    dtype (:func:`~.batch.require_integers`), from the dtypes alone, so the host path and
    the device path (``device_meta``) both ask it.

    Raises:
        ValueError: naming the first field of another dtype (a float id is never truncated).
    """
    for name in INTEGER_FIELDS:
        if (value := getattr(batch, name)) is not None:
            require_integers(value, name)


def check_sampling_given(batch: Batch, sampled: bool) -> bool:
    """Whether ``batch`` carries sampling inputs, held to the engine: ``temperature`` and
    ``seed`` given exactly when it is ``sampled``, of a float (or int) and an int dtype.
    What can be known without reading a value, so the host path and the device path
    (``device_meta``) both ask it; :func:`sampling_meta` then checks the values.

    Raises:
        ValueError: naming ``temperature`` or ``seed``.
    """
    given = [name for name in SAMPLING_FIELDS if getattr(batch, name) is not None]
    if not sampled:
        if given:
            raise ValueError(
                f"{given[0]}: given, but the engine does not ask for sampled drafts "
                "(VLLM_DSPARK_SAMPLED_TOP32=0); pass None"
            )
        return False
    for name in SAMPLING_FIELDS:
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
        temperature = host_array(batch.temperature, "temperature", n).astype(np.float32)
    good = np.isfinite(temperature) & (temperature >= 0)
    if not good.all():
        bad = int(np.argmin(good))
        raise ValueError(f"temperature: {temperature[bad]} (entry {bad}) not a finite float32 >= 0 (0: greedy)")
    temperature += 0  # -0.0 + 0 is +0.0: one zero on the wire
    seed = host_array(batch.seed, "seed", n)
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

"""A round's metadata that lives on the device, written into the region's descriptor in
stream order with tensor operations only (the host never reads a value): the device
half of :mod:`..values.batch`'s host path (:func:`~..values.batch.host_meta`, :func:`~..values.batch.write_meta`),
carrying the same round.

A sampled engine's batch also carries ``temperature`` and ``seed``: written as the
ROUND's sampled sections (float32 bits and u64 words) with the same tensor operations,
their values unread. The proxy's descriptor check refuses a temperature that is negative
or not finite where it lands, as :func:`~..values.batch.sampling_meta` refuses it on the host."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from ... import wire
from ..values.batch import CONTEXT_TOKENS, Batch, check_sampling_given
from . import meta_kernel

log = logging.getLogger("remote_dspark.engine")

# A batch's metadata fields (all but the rows and their index).
_META_FIELDS = ("slots", "tokens", "token_offsets", "positions", "new_gen", "n_out", "temperature", "seed")


def check_meta_shapes(batch: Batch, max_slots: int, sampled: bool = False) -> int:
    """The entry count of a batch whose metadata is not read on the host: its shapes
    checked (they are known without a sync), and its sampling fields held to the engine
    (``sampled``: both given, with a float or int temperature and an int seed; else
    neither), in the words of :func:`~..values.batch.sampling_meta`.

    Raises:
        ValueError: naming the field whose shape or dtype disagrees, or a sampling field
            missing from a sampled engine's batch or given to another's, or too many
            entries or tokens.
    """
    check_sampling_given(batch, sampled)
    n, t = len(batch), int(batch.tokens.shape[0])
    if n > max_slots or t > wire.MAX_TOKENS:
        raise ValueError(
            f"a batch of {n} entries and {t} tokens over max_slots={max_slots} or the wire's {wire.MAX_TOKENS} tokens"
        )
    fields = (("token_offsets", n + 1), ("positions", n), ("new_gen", n), ("n_out", n), ("temperature", n), ("seed", n))
    for name, want in fields:
        got = getattr(batch, name)
        if got is not None and tuple(got.shape) != (want,):
            raise ValueError(f"{name}: shape {tuple(got.shape)}, expected [{want}]")
    return n


def seed_bits(seed) -> torch.Tensor | np.ndarray:
    """``seed`` [n] as int64 whose bits are the wire's u64 (a view where it is 64 bits
    unsigned, else a sign- or zero-extension as ``astype``), without reading a value."""
    if isinstance(seed, torch.Tensor):
        return seed.view(torch.int64) if seed.dtype == torch.uint64 else seed.to(torch.int64)
    seed = np.asarray(seed)
    return seed.view(np.int64) if seed.dtype == np.uint64 else seed.astype(np.int64, copy=False)


def write_meta_in_stream(
    batch: Batch,
    d: torch.Tensor,
    *,
    max_slots: int,
    num_spec: int,
    max_tokens: int,
    n_out_default: int,
    context_tokens: int = CONTEXT_TOKENS,
    sampled: bool = False,
    kernel: bool = False,
) -> None:
    """Write ``batch``'s ROUND arrays and ``n_tokens`` into ``d``, an int32 tensor over a
    descriptor's payload area with room for ``max_tokens + 1`` tokens, with tensor
    operations only: on the device they run in stream order and the host never reads a
    value (no sync). NEW_GEN contexts are cut to their last ``context_tokens`` as
    :func:`~..values.batch.host_meta` cuts them, so the wire carries the same round. No value is
    trusted: every index stays in range whatever the metadata holds (a token that is
    dropped, or that the offsets cannot place, lands in the spare cell past
    ``max_tokens``; a slot out of range becomes ``max_slots``; offsets that do not run
    from 0 to len(tokens) make ``n_tokens`` ``max_tokens + 1``), so a bad round is
    refused where it lands (the proxy's descriptor check). Token ids are not checked
    against the vocabulary here either (that needs a host sync): the descriptor check
    refuses a round with one outside ``0..vocab_size-1`` (answered ERROR, unsent,
    counted ``rounds_bad_desc``), as :func:`~..values.batch.host_meta` would. Positions and tokens are
    written as the wire's 32 bits. ``sampled``: the engine asks for sampled drafts, and
    the batch's temperatures (float32 bits, -0.0 written as 0.0 as on the host) and seeds
    (u64: an int64's bits, two little-endian words) go after the offsets, the tokens after
    them (``wire.round_sections(n, t, row_bytes, True)``); the proxy's descriptor check
    refuses a temperature that is negative or not finite. The caller writes deadline, n
    and row_bytes (``d[0:3]``) and has checked the shapes (:func:`check_meta_shapes`).
    ``kernel`` (CUDA, :func:`choose`): the same bytes by :mod:`.meta_kernel`'s two
    launches instead of these twenty-odd tensor operations."""
    n, t = len(batch), int(batch.tokens.shape[0])
    if not n:
        d[3:4] = 0 if t == 0 else max_tokens + 1
        return
    dev = d.device
    if kernel:
        _by_kernel(batch, d, n, t, max_slots, num_spec, max_tokens, n_out_default, context_tokens, sampled)
        return

    def on_dev(x, dtype):  # a field of a mixed batch may still be on the host
        return torch.as_tensor(x).to(dev, dtype, non_blocking=True)

    slots = on_dev(batch.slots, torch.int64)
    offsets = on_dev(batch.token_offsets, torch.int64)
    new_gen = on_dev(batch.new_gen, torch.bool)
    lengths = offsets[1:] - offsets[:-1]
    cut = torch.where(new_gen, (lengths - context_tokens).clamp(min=0), 0)
    kept = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(lengths - cut, 0, out=kept[1:])  # the offsets after the cut
    at = wire.ROUND_FIXED.size // 4
    d[at : at + n] = torch.where((slots < 0) | (slots >= max_slots), max_slots, slots)
    d[at + n : at + 2 * n] = on_dev(batch.positions, torch.int64) + cut
    if batch.n_out is None:
        d[at + 2 * n : at + 3 * n] = min(n_out_default, num_spec)
    else:
        d[at + 2 * n : at + 3 * n] = on_dev(batch.n_out, torch.int64).clamp(max=num_spec)
    d[at + 3 * n : at + 4 * n] = new_gen  # True -> FLAG_NEW_GEN (1)
    d[at + 4 * n : at + 5 * n + 1] = kept
    whole = (offsets[:1] == 0) & (offsets[n:] == t)
    d[3:4] = torch.where(whole, kept[n:], max_tokens + 1)  # n_tokens
    if sampled:
        sec = wire.round_sections(n, 0, 0, True)
        temperature = on_dev(batch.temperature, torch.float32) + 0.0  # -0.0 + 0.0 is +0.0: one zero
        d[sec.temperature // 4 : sec.seed // 4] = temperature.view(torch.int32)
        d[sec.seed // 4 : sec.tokens // 4] = on_dev(seed_bits(batch.seed), torch.int64).view(torch.int32)
    if t:
        # Token j of entry e (the last offset at or before j) goes to kept[e] + its index
        # in the entry - cut[e]; one dropped or unplaceable, to the spare cell.
        j = torch.arange(t, device=dev)
        e = torch.searchsorted(offsets[1:], j, right=True).clamp(max=n - 1)
        within = j - offsets[e] - cut[e]
        dest = kept[e] + within
        dest = torch.where((within >= 0) & (dest >= 0) & (dest < max_tokens), dest, max_tokens)
        tok_at = wire.round_meta_bytes(n, sampled) // 4
        d[tok_at : tok_at + max_tokens + 1].scatter_(0, dest, on_dev(batch.tokens, torch.int32))


def _by_kernel(
    batch: Batch,
    d: torch.Tensor,
    n: int,
    t: int,
    max_slots: int,
    num_spec: int,
    max_tokens: int,
    n_out_default: int,
    context_tokens: int,
    sampled: bool,
) -> None:
    """:func:`write_meta_in_stream` by :mod:`.meta_kernel`'s two launches: each field as
    it is (on the device, contiguous; its dtype unconverted), nothing read on the host."""
    dev = d.device

    def on_dev(x):
        x = x if isinstance(x, torch.Tensor) and x.device == dev else torch.as_tensor(x).to(dev, non_blocking=True)
        x = x if x.is_contiguous() else x.contiguous()
        return x.view(torch.uint8) if x.dtype == torch.bool else x

    meta_kernel.write(
        d,
        n=n,
        t=t,
        slots=on_dev(batch.slots),
        offsets=on_dev(batch.token_offsets),
        new_gen=on_dev(batch.new_gen),
        positions=on_dev(batch.positions),
        n_out=None if batch.n_out is None else on_dev(batch.n_out),
        temperature=on_dev(batch.temperature) if sampled else None,
        seed=on_dev(seed_bits(batch.seed)) if sampled else None,
        tokens=on_dev(batch.tokens),
        max_slots=max_slots,
        num_spec=num_spec,
        n_out_fixed=min(n_out_default, num_spec),
        context_tokens=context_tokens,
        max_tokens=max_tokens,
    )


def choose(device: str) -> bool:
    """Whether an engine on ``device`` writes device metadata by :mod:`.meta_kernel`: on
    CUDA with Triton, once :func:`self_check` finds its bytes equal to the tensor
    operations' (which also compiles it, so no round pays for that); else, with one
    warning, the tensor operations."""
    if device != "cuda" or not meta_kernel.available():
        return False
    try:
        self_check(device)
    except Exception as e:
        log.warning("metadata kernel off (%s); device metadata is written by tensor operations", e)
        return False
    return True


def self_check(device: str = "cuda") -> None:
    """The kernel against the tensor operations on ``device``: rounds of 1, 5 and 1,500
    entries (past one block of the kernel's walk), NEW_GEN contexts cut and not, ``n_out``
    given and not, greedy and sampled, in the dtypes an engine's tensors have.

    Raises:
        RuntimeError: naming the round whose bytes differ.
    """
    g = torch.Generator().manual_seed(11)
    for n, sampled, with_n_out in ((1, False, False), (5, True, True), (1500, False, True), (1500, True, False)):
        lens = torch.randint(0, 3 * CONTEXT_TOKENS, (n,), generator=g)
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=offsets[1:])
        t = int(offsets[-1])
        batch = Batch(
            slots=torch.randperm(4 * n, generator=g)[:n],
            tokens=torch.randint(0, 1 << 20, (t,), generator=g, dtype=torch.int32),
            token_offsets=offsets,
            positions=torch.randint(0, 1 << 20, (n,), generator=g),
            new_gen=torch.rand(n, generator=g) < 0.5,
            rows=torch.zeros(n, 0, dtype=torch.uint8),
            row_index=torch.zeros(n, dtype=torch.int64),
            n_out=torch.randint(0, 9, (n,), generator=g) if with_n_out else None,
            temperature=torch.rand(n, generator=g) * 2 if sampled else None,
            seed=torch.randint(-(1 << 62), 1 << 62, (n,), generator=g) if sampled else None,
        )
        on_device = {f: getattr(batch, f).to(device) for f in _META_FIELDS if getattr(batch, f) is not None}
        batch = dataclasses.replace(batch, **on_device)
        kw = dict(max_slots=4 * n, num_spec=5, max_tokens=t + 8, n_out_default=3, sampled=sampled)
        size = (wire.round_meta_bytes(n, sampled) // 4) + t
        by_ops, by_kernel = (torch.zeros(size + 9, dtype=torch.int32, device=device) for _ in range(2))
        write_meta_in_stream(batch, by_ops, **kw)
        write_meta_in_stream(batch, by_kernel, **kw, kernel=True)
        if not torch.equal(by_ops[:size], by_kernel[:size]):
            raise RuntimeError(f"the metadata kernel differs from the tensor operations for a round of {n} entries")

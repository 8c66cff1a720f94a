"""A round's metadata that lives on the device, written into the region's descriptor in
stream order by two Triton launches, the host reading no value: the device's writer of
the bytes whose rule is :mod:`..values.meta`'s (:func:`~..values.meta.host_meta`,
:func:`~..values.meta.write_meta`: the home of the rule, which the tests hold this
writer to).

- ``entries`` (one program) walks the entries in blocks: each entry's NEW_GEN cut, the
  offsets after the cut (a running sum carried from block to block), and the slots,
  positions, drafts wanted, flags, offsets, ``n_tokens`` and a sampled round's
  temperature bits and seed words, into the descriptor; the cuts and the offsets after
  the cut also into a scratch tensor for the second launch.
- ``tokens`` (a program per block of tokens) finds each token's entry by a binary search
  of the offsets and scatters it to its place after the cut; a token that is dropped or
  that the offsets cannot place goes to the spare cell past ``max_tokens``.

No value is trusted: every index stays in range whatever the metadata holds (a slot out
of range becomes ``max_slots``; offsets that do not run from 0 to len(tokens) make
``n_tokens`` ``max_tokens + 1``), so a bad round is refused where it lands, by the
proxy's descriptor check (``native/desc_check.c``), which also holds token ids to the
vocabulary and temperatures to finite values >= 0: answered ERROR, unsent, counted
``rounds_bad_desc``.

One writer: an engine uses it on CUDA once :func:`choose` finds Triton and the kernel's
bytes equal to the host path's. Without Triton (the ``gpu`` extra installs it) or when
that self-check fails, an engine copies such metadata to the host (one sync:
``batch.meta_to_host``) and writes it by the host path. On CPU tensors (the tests) the
same kernels run in Triton's interpreter (TRITON_INTERPRET=1 before Triton's import).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np
import torch

from ... import wire
from ..values.batch import CONTEXT_TOKENS, Batch
from ..values.meta import check_integer_fields, check_sampling_given, host_meta, write_meta

log = logging.getLogger("remote_dspark.engine")

BLOCK = 1024  # entries a step of ``entries``, tokens a program of ``tokens``
CHECK_CONTEXT = 64  # the self-check's cut
SEARCH_STEPS = 13  # a binary search over at most 2**13 - 1 entries (wire.MAX_ENTRIES is 4096)
# A batch's metadata fields (all but the rows and their index).
META_FIELDS = ("slots", "tokens", "token_offsets", "positions", "new_gen", "n_out", "temperature", "seed")


def check_meta_shapes(batch: Batch, max_slots: int, sampled: bool = False) -> int:
    """The entry count of a batch whose metadata is not read on the host: its shapes
    checked (they are known without a sync), and its sampling fields held to the engine
    (``sampled``: both given, with a float or int temperature and an int seed; else
    neither), in the words of :func:`~..values.meta.sampling_meta`.

    Raises:
        ValueError: naming the field whose shape or dtype disagrees (an id or count of a
            float dtype: :func:`~..values.meta.check_integer_fields`), or a sampling field
            missing from a sampled engine's batch or given to another's, or too many
            entries or tokens.
    """
    check_integer_fields(batch)
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


@functools.cache
def available() -> bool:
    """Triton imports (the kernels are compiled at their first launch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    """The two kernels (compiled at their first launch; with TRITON_INTERPRET=1 set before
    Triton is imported, run in its interpreter instead: CPU tensors, the tests)."""
    import triton
    import triton.language as tl

    @triton.jit
    def entries(
        d, scratch, slots, offsets, new_gen, positions, n_out, temperature, seed,
        n, t, max_slots, num_spec, n_out_fixed, context_tokens, max_tokens, at, temp_at, seed_at,
        HAS_N_OUT: tl.constexpr, SAMPLED: tl.constexpr, BOUNDED: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        carry = tl.sum(tl.zeros([BLOCK], tl.int64), 0)
        for start in range(0, n, BLOCK):
            i = start + tl.arange(0, BLOCK)
            m = i < n
            o0 = tl.load(offsets + i, mask=m, other=0).to(tl.int64)
            o1 = tl.load(offsets + i + 1, mask=m, other=0).to(tl.int64)
            g = tl.load(new_gen + i, mask=m, other=0) != 0
            length = o1 - o0
            cut = tl.where(g, tl.maximum(length - context_tokens, 0), 0)
            kept = tl.where(m, length - cut, 0)
            after = tl.cumsum(kept, 0) + carry  # the offset after entry i, once cut
            s = tl.load(slots + i, mask=m, other=0).to(tl.int64)
            s = tl.where((s < 0) | (s >= max_slots), max_slots, s)
            tl.store(d + at + i, s.to(tl.int32), mask=m)
            p = tl.load(positions + i, mask=m, other=0).to(tl.int64) + cut
            tl.store(d + at + n + i, p.to(tl.int32), mask=m)
            if HAS_N_OUT:
                k = tl.minimum(tl.load(n_out + i, mask=m, other=0).to(tl.int64), num_spec)
            else:
                k = tl.zeros([BLOCK], tl.int64) + n_out_fixed
            tl.store(d + at + 2 * n + i, k.to(tl.int32), mask=m)
            tl.store(d + at + 3 * n + i, g.to(tl.int32), mask=m)
            tl.store(d + at + 4 * n + 1 + i, after.to(tl.int32), mask=m)
            tl.store(scratch + i, after - kept, mask=m)  # where entry i's kept tokens start
            tl.store(scratch + n + i, cut, mask=m)
            if SAMPLED:
                temp = tl.load(temperature + i, mask=m, other=0).to(tl.float32)
                temp = tl.where(temp == 0.0, 0.0, temp)  # -0.0 as 0.0: one zero on the wire
                tl.store(d + temp_at + i, temp.to(tl.int32, bitcast=True), mask=m)
                bits = tl.load(seed + i, mask=m, other=0).to(tl.int64)
                tl.store(d + seed_at + 2 * i, (bits & 0xFFFFFFFF).to(tl.int32), mask=m)
                tl.store(d + seed_at + 2 * i + 1, (bits >> 32).to(tl.int32), mask=m)
            carry += tl.sum(kept, 0)
        tl.store(d + at + 4 * n, 0)
        end = tl.load(offsets + n).to(tl.int64)
        whole = (tl.load(offsets).to(tl.int64) == 0) & ((end <= t) if BOUNDED else (end == t))
        tl.store(d + 3, tl.where(whole, carry, max_tokens + 1).to(tl.int32))

    @triton.jit
    def tokens(
        d, scratch, offsets, src, n, t, max_tokens, tok_at,
        SEARCH_STEPS: tl.constexpr, BOUNDED: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = j < t
        if BOUNDED:  # the round's tokens are the buffer's first offsets[n]
            m = m & (j < tl.load(offsets + n).to(tl.int64))
        lo = tl.zeros([BLOCK], tl.int64)  # the entries whose end is at or before j: searchsorted(right)
        hi = tl.zeros([BLOCK], tl.int64) + n
        for _ in tl.static_range(SEARCH_STEPS):
            go = lo < hi
            mid = (lo + hi) // 2
            end = tl.load(offsets + 1 + mid, mask=m & go, other=0).to(tl.int64)
            right = end <= j
            lo = tl.where(go & right, mid + 1, lo)
            hi = tl.where(go & ~right, mid, hi)
        e = tl.minimum(lo, n - 1)
        start = tl.load(offsets + e, mask=m, other=0).to(tl.int64)
        within = j - start - tl.load(scratch + n + e, mask=m, other=0)
        dest = tl.load(scratch + e, mask=m, other=0) + within
        dest = tl.where((within >= 0) & (dest >= 0) & (dest < max_tokens), dest, max_tokens)
        tl.store(d + tok_at + dest, tl.load(src + j, mask=m, other=0).to(tl.int32), mask=m)

    return entries, tokens


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
) -> None:
    """Write ``batch``'s ROUND arrays and ``n_tokens`` into ``d``, an int32 tensor over a
    descriptor's payload area with room for ``max_tokens + 1`` tokens, in two launches on
    the current stream (CPU tensors: in Triton's interpreter, :func:`_kernels`): the host
    reads no value (no sync). NEW_GEN contexts are cut to their last ``context_tokens`` as
    :func:`~..values.meta.host_meta` cuts them, so the wire carries the same round; what
    the module docstring says of bad values holds. Positions and tokens are written as
    the wire's 32 bits. ``sampled``: the engine asks for sampled drafts, and the batch's
    temperatures (float32 bits, -0.0 written as 0.0 as on the host) and seeds (u64: an
    int64's bits, two little-endian words) go after the offsets, the tokens after them
    (``wire.round_sections(n, t, row_bytes, True)``). A batch whose ``tokens_bounded``
    (a round planned on the device) sends the first ``token_offsets[n]`` of its tokens,
    at most all of them. The fields may be of any integer
    dtype (a float or int temperature), each on ``d``'s device or the host (copied
    there). The caller writes deadline, n and row_bytes (``d[0:3]``) and has checked the
    shapes (:func:`check_meta_shapes`).

    Raises:
        ImportError: Triton is not installed (:func:`available`).
    """
    n, t = len(batch), int(batch.tokens.shape[0])
    if not n:
        d[3:4] = 0 if t == 0 else max_tokens + 1
        return
    dev = d.device

    def on_dev(x):
        x = x if isinstance(x, torch.Tensor) and x.device == dev else torch.as_tensor(x).to(dev, non_blocking=True)
        x = x if x.is_contiguous() else x.contiguous()
        return x.view(torch.uint8) if x.dtype == torch.bool else x

    entries, scatter = _kernels()
    sec = wire.round_sections(n, 0, 0, sampled)
    scratch = torch.empty(2 * n, dtype=torch.int64, device=dev)
    offsets = on_dev(batch.token_offsets)
    n_out = None if batch.n_out is None else on_dev(batch.n_out)
    temperature = on_dev(batch.temperature) if sampled else d
    seed = on_dev(seed_bits(batch.seed)) if sampled else d
    entries[(1,)](
        d, scratch, on_dev(batch.slots), offsets, on_dev(batch.new_gen),
        on_dev(batch.positions), d if n_out is None else n_out, temperature, seed,
        n, t, max_slots, num_spec, min(n_out_default, num_spec), context_tokens, max_tokens,
        wire.ROUND_FIXED.size // 4, sec.temperature // 4, sec.seed // 4,
        HAS_N_OUT=n_out is not None, SAMPLED=sampled, BOUNDED=batch.tokens_bounded, BLOCK=BLOCK,
    )  # fmt: skip
    if t:
        tok_at = wire.round_meta_bytes(n, sampled) // 4
        scatter[(-(-t // BLOCK),)](
            d, scratch, offsets, on_dev(batch.tokens), n, t, max_tokens, tok_at,
            SEARCH_STEPS=SEARCH_STEPS, BOUNDED=batch.tokens_bounded, BLOCK=BLOCK,
        )  # fmt: skip


def choose(device: str) -> bool:
    """Whether an engine on ``device`` writes device metadata by the kernels: on CUDA
    with Triton, once :func:`self_check` finds their bytes equal to the host path's
    (which also compiles them, so no round pays for that); else, with one warning, the
    engine copies such metadata to the host and writes it there."""
    if device != "cuda" or not available():
        if device == "cuda":
            log.warning("no Triton (the gpu extra): metadata on the GPU is copied to the host to be written")
        return False
    try:
        self_check(device)
    except Exception as e:
        log.warning("metadata kernel off (%s); metadata on the GPU is copied to the host to be written", e)
        return False
    return True


def self_check(device: str = "cuda") -> None:
    """The kernels against the host path (:func:`~..values.meta.host_meta` and
    :func:`~..values.meta.write_meta`) on ``device``: rounds of 1, 5 and 1,500 entries
    (past one block of the kernel's walk), NEW_GEN contexts cut and not, ``n_out`` given
    and not, greedy and sampled, tokens bounded (a buffer with room) and not, in the
    dtypes an engine's tensors have.

    Raises:
        RuntimeError: naming the round whose bytes differ.
    """
    g = torch.Generator().manual_seed(11)
    cases = ((1, False, False, False), (5, True, True, True), (1500, False, True, False), (1500, True, False, True))
    for n, sampled, with_n_out, bounded in cases:
        lens = torch.randint(0, 3 * CHECK_CONTEXT, (n,), generator=g)
        offsets = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=offsets[1:])
        t = int(offsets[-1])
        host = Batch(
            slots=torch.randperm(4 * n, generator=g)[:n],
            tokens=torch.randint(0, 1 << 20, (t,), generator=g, dtype=torch.int32),
            token_offsets=offsets,
            positions=torch.randint(0, 1 << 20, (n,), generator=g),
            new_gen=torch.rand(n, generator=g) < 0.5,
            n_out=torch.randint(0, 9, (n,), generator=g) if with_n_out else None,
            temperature=torch.rand(n, generator=g) * 2 if sampled else None,
            seed=torch.randint(-(1 << 62), 1 << 62, (n,), generator=g) if sampled else None,
        )
        on_device = {f: getattr(host, f).to(device) for f in META_FIELDS if getattr(host, f) is not None}
        if bounded:  # a round planned on the device: its tokens a buffer with room past them
            on_device["tokens"] = torch.cat(
                (on_device["tokens"], torch.full((7,), -1, dtype=torch.int32, device=device))
            )
        kw = dict(max_slots=4 * n, num_spec=5, max_tokens=t + 8, n_out_default=3, sampled=sampled)
        want = np.zeros(wire.round_meta_bytes(n, sampled) + 4 * (t + 9), np.uint8)
        size = write_meta(want, host_meta(host, context_tokens=CHECK_CONTEXT, **kw), deadline_ms=0, row_bytes=0)
        got = torch.zeros(len(want) // 4, dtype=torch.int32, device=device)
        got[:3] = torch.tensor(want[:12].view(np.int32))  # the fixed part's first words are the caller's
        device_batch = dataclasses.replace(host, **on_device, tokens_bounded=bounded)
        write_meta_in_stream(device_batch, got, context_tokens=CHECK_CONTEXT, **kw)
        if bytes(got.cpu().numpy().view(np.uint8)[:size]) != bytes(want[:size]):
            raise RuntimeError(f"the metadata kernel differs from the host path for a round of {n} entries")

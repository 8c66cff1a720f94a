"""A round's device metadata written by two Triton launches: the fast twin of
:func:`~.device_meta.write_meta_in_stream`'s tensor operations (about twenty launches,
each some tens of microseconds of the engine's CPU), writing the same bytes.

- ``entries`` (one program) walks the entries in blocks: each entry's NEW_GEN cut, the
  offsets after the cut (a running sum carried from block to block), and the slots,
  positions, drafts wanted, flags, offsets, ``n_tokens`` and a sampled round's
  temperature bits and seed words, into the descriptor; the cuts and the offsets after
  the cut also into a scratch tensor for the second launch.
- ``tokens`` (a program per block of tokens) finds each token's entry by a binary search
  of the offsets and scatters it to its place after the cut; a token that is dropped or
  that the offsets cannot place goes to the spare cell past ``max_tokens``.

No value is read on the host and every index stays in range whatever the metadata holds,
as in the reference: a bad round is refused where it lands (the proxy's descriptor
check). Offsets that go back are such a round; there the reference's search and this
one may place tokens differently, both in range and both refused. The GPU tests hold the
two paths' bytes equal, and to the host path's (``tests/engine/values/test_batch.py``).
Imported only on CUDA with Triton (:func:`available`).
"""

from __future__ import annotations

import functools

import torch

from ... import wire

BLOCK = 1024  # entries a step of ``entries``, tokens a program of ``tokens``
SEARCH_STEPS = 13  # a binary search over at most 2**13 - 1 entries (wire.MAX_ENTRIES is 4096)


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
    import triton
    import triton.language as tl

    @triton.jit
    def entries(
        d, scratch, slots, offsets, new_gen, positions, n_out, temperature, seed,
        n, t, max_slots, num_spec, n_out_fixed, context_tokens, max_tokens, at, temp_at, seed_at,
        HAS_N_OUT: tl.constexpr, SAMPLED: tl.constexpr, BLOCK: tl.constexpr,
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
        whole = (tl.load(offsets).to(tl.int64) == 0) & (tl.load(offsets + n).to(tl.int64) == t)
        tl.store(d + 3, tl.where(whole, carry, max_tokens + 1).to(tl.int32))

    @triton.jit
    def tokens(d, scratch, offsets, src, n, t, max_tokens, tok_at, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr):
        j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = j < t
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


def write(
    d: torch.Tensor,
    *,
    n: int,
    t: int,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    new_gen: torch.Tensor,
    positions: torch.Tensor,
    n_out: torch.Tensor | None,
    temperature: torch.Tensor | None,
    seed: torch.Tensor | None,
    tokens: torch.Tensor,
    max_slots: int,
    num_spec: int,
    n_out_fixed: int,
    context_tokens: int,
    max_tokens: int,
) -> None:
    """Write a round of ``n`` (>= 1) entries and ``t`` tokens into ``d`` (the descriptor's
    int32 payload view) in two launches on the current stream. The tensors are the
    batch's, on ``d``'s device, any integer dtype (``new_gen`` as uint8, ``seed`` as the
    int64 bits of the u64); ``n_out`` None: every entry ``n_out_fixed``;
    ``temperature`` and ``seed`` both or neither (a sampled round)."""
    entries, scatter = _kernels()
    sampled = temperature is not None
    sec = wire.round_sections(n, 0, 0, sampled)
    scratch = torch.empty(2 * n, dtype=torch.int64, device=d.device)
    entries[(1,)](
        d, scratch, slots, offsets, new_gen, positions,
        d if n_out is None else n_out, temperature if sampled else d, seed if sampled else d,
        n, t, max_slots, num_spec, n_out_fixed, context_tokens, max_tokens,
        wire.ROUND_FIXED.size // 4, sec.temperature // 4, sec.seed // 4,
        HAS_N_OUT=n_out is not None, SAMPLED=sampled, BLOCK=BLOCK,
    )  # fmt: skip
    if t:
        tok_at = wire.round_meta_bytes(n, sampled) // 4
        scatter[(-(-t // BLOCK),)](
            d, scratch, offsets, tokens, n, t, max_tokens, tok_at, SEARCH_STEPS=SEARCH_STEPS, BLOCK=BLOCK
        )

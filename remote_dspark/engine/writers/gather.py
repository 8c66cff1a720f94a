"""Gather the round's rows of an engine tensor into its staging slot.

Two paths with one contract, ``gather(rows, index, out)``: ``out[i] = bytes of
rows[index[i]]`` for i < len(index), where ``out`` is ``[>= n, row_bytes]`` uint8 (on a
GPU: a device view of the registered staging slot, so the rows land in host memory the
proxy reads):

- the torch path: one ``index_select`` into ``out`` (one kernel, byte-wise);
- the fused path: one Triton launch that reads each selected row and writes it straight
  into ``out``, 64-bit offsets throughout, in 4-byte words when the rows allow it.

``VLLM_DSPARK_REMOTE_FUSED_GATHER``: ``auto`` (default) turns the fused path on, on CUDA,
after :func:`self_check` finds it equal to the torch path on random rows of every dtype
an engine uses; ``1`` requires it (a failed check raises); ``0`` keeps the torch path.
"""

from __future__ import annotations

import logging

import torch

from ..values.batch import as_bytes

log = logging.getLogger("remote_dspark.gather")

BLOCK = 1024
ENGINE_DTYPES = ("float32", "float16", "bfloat16", "int32", "int64", "uint8", "float8_e4m3fn")


def torch_gather(rows, index, out) -> None:
    """One ``index_select`` written straight into ``out`` (no temporary, one kernel)."""
    n = index.numel()
    if n:
        torch.index_select(as_bytes(rows), 0, index, out=out[:n])


_kernel = None


def _triton_kernel():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def gather_rows(src, idx, dst, src_stride, row_words, BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < row_words
            r = tl.load(idx + row).to(tl.int64)
            v = tl.load(src + r * src_stride + offs, mask=mask)
            tl.store(dst + row * row_words + offs, v, mask=mask)

        _kernel = gather_rows
    return _kernel


def fused_gather(rows, index, out) -> None:
    """One launch for any row count (none for zero rows)."""
    n = index.numel()
    if not n:
        return
    src = as_bytes(rows)
    dst = out
    row_bytes = src.shape[1]
    # Copy 4-byte words when every row start is 4-byte aligned on both sides.
    if row_bytes % 4 == 0 and src.stride(0) % 4 == 0 and src.data_ptr() % 4 == 0 and dst.data_ptr() % 4 == 0:
        src, dst = src.view(torch.int32), dst.view(torch.int32)
    words = src.shape[1]
    grid = (n, (words + BLOCK - 1) // BLOCK)
    _triton_kernel()[grid](src, index, dst, src.stride(0), words, BLOCK=BLOCK)


def self_check(device="cuda", rows: int = 97, row_bytes: int = 1000) -> None:
    """Compare the fused path with the torch path on random rows of every engine dtype,
    row counts 0, 1 and many, and odd and 4-byte-multiple row sizes.

    Raises:
        RuntimeError: naming the dtype and shape where they differ.
    """
    g = torch.Generator(device="cpu").manual_seed(7)
    for name in ENGINE_DTYPES:
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        for rb in (row_bytes, 4 * row_bytes):
            elem = torch.empty(0, dtype=dtype).element_size()
            per_row = max(1, rb // elem)
            raw = torch.randint(0, 256, (rows, per_row * elem), dtype=torch.uint8, generator=g)
            src = raw.to(device).view(dtype).reshape(rows, per_row)
            for n in (0, 1, rows):
                index = torch.randint(0, rows, (n,), generator=g).to(device)
                a = torch.zeros(rows, per_row * elem, dtype=torch.uint8, device=device)
                b = torch.zeros_like(a)
                torch_gather(src, index, a)
                fused_gather(src, index, b)
                if not torch.equal(a, b):
                    raise RuntimeError(
                        f"fused gather differs from the torch path for {name} rows of {per_row * elem} bytes, {n} rows"
                    )


def choose(setting: bool | None, device: str):
    """The gather to use for ``VLLM_DSPARK_REMOTE_FUSED_GATHER`` (None = auto).

    Raises:
        ValueError: ``1`` but the fused path is unavailable or fails its self-check.
    """
    if setting is False or (setting is None and device != "cuda"):
        return torch_gather
    try:
        if device != "cuda":
            raise RuntimeError("the fused gather runs on CUDA only")
        self_check(device)
    except Exception as e:
        if setting:
            raise ValueError(f"VLLM_DSPARK_REMOTE_FUSED_GATHER=1 but the fused gather is not usable: {e}") from e
        log.warning("fused gather off (%s); using the torch path", e)
        return torch_gather
    return fused_gather

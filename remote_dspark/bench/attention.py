"""The paged attention kernel's read bandwidth on CUDA (``python -m
remote_dspark.bench.attention [--json]``; :func:`measure`, a ``bench`` row).

Each case is a round's attention in one layer, GPT-2 small's heads (12 of 64) in bf16, over
a pool of ``block``-token blocks dealt shuffled to the streams (a stream's blocks anywhere
in the pool, as after a while of streams coming and going):

``decode-2k``    256 entries, each one query at column 2,047 (a 2,048-token history);
``short-4q``     256 entries, 4 queries each, ending at columns 80 to 100;
``prefill-512``  16 entries, 512 queries each at columns 0 to 511.

A row's figure is the bytes of keys and values its queries must read (each entry's key
head's columns up to its last query's, read once) over the kernel's median time (Triton's
``do_bench``, the L2 cache flushed before each run): the fraction of the card's memory
bandwidth the kernel reaches. The goal for ``decode-2k``: about 70% of the card's
(H100 SXM 3.35 TB/s, H200 4.8 TB/s). ``tests/drafter/attention_tiles.py`` times the
kernel's other tiles on the same rows (how its tiles were chosen).
"""

from __future__ import annotations

import argparse
import json
import sys

CASES = {"decode-2k": (256, 1, 2048, 2048), "short-4q": (256, 4, 81, 101), "prefill-512": (16, 512, 512, 512)}
"""case: (entries, queries, shortest, longest history in columns; the last query's column + 1)."""
BLOCKS = (16, 32, 64)
HEADS, HEAD_DIM, LAYERS = 12, 64, 2


def case_round(case: str, block: int, seed: int = 0):
    """A pool ``[blocks, LAYERS, 2, HEADS, block, HEAD_DIM]`` (bf16, CUDA) and one layer's
    round of ``case`` over it: ``(q, k, v, table, rows, positions, bytes to read)``."""
    import torch

    entries, queries, shortest, longest = CASES[case]
    g = torch.Generator().manual_seed(seed)
    ends = torch.randint(shortest, longest + 1, (entries,), generator=g)
    held = (ends + block - 1) // block
    dealt = 1 + torch.randperm(int(held.sum()), generator=g)  # block 0: the trash block
    table = torch.zeros(entries, int(held.max()), dtype=torch.int64)
    for r, (start, count) in enumerate(zip((held.cumsum(0) - held).tolist(), held.tolist())):
        table[r, :count] = dealt[start : start + count]
    kv = torch.randn(1 + len(dealt), LAYERS, 2, HEADS, block, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(entries, HEADS, queries, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    rows = torch.randperm(entries, generator=g)
    positions = ends[rows][:, None] - torch.arange(queries, 0, -1)
    read = int(ends.sum()) * HEADS * HEAD_DIM * 2 * kv.element_size()
    return q, kv[:, 0, 0], kv[:, 0, 1], table.cuda(), rows.cuda(), positions.cuda(), read


def measure(case: str, block: int, attend=None, label: str = "chosen") -> dict:
    """One row: ``case`` over ``block``-token blocks, attended by ``attend`` (the
    arguments of :func:`~remote_dspark.drafter.lm.attention.paged_attention`, its default;
    ``label`` names it in the row), checked against the reference first."""
    from triton.testing import do_bench

    from remote_dspark.drafter.lm.attention import paged_attention, reference_attention

    attend = attend or paged_attention
    q, k, v, table, rows, positions, read = case_round(case, block)

    def run():
        return attend(q, k, v, table, rows, positions, 0.125)

    sample = slice(0, 8)  # the reference's gather of every entry would not fit beside the pool
    want = reference_attention(q[sample].float(), k.float(), v.float(), table, rows[sample], positions[sample], 0.125)
    error = float((run()[sample].float() - want).abs().max())
    ms = do_bench(run, warmup=25, rep=100, return_mode="median")
    return {
        "case": case,
        "block": block,
        "kernel": label,
        "ms": ms,
        "GB": read / 1e9,
        "TB/s": read / ms / 1e9,
        "err": error,
    }


def row_line(r: dict) -> str:
    return (
        f"{r['case']:12} block {r['block']:3}  {r['kernel']:16} {r['ms'] * 1e3:8.1f} us  "
        f"{r['GB']:6.3f} GB  {r['TB/s']:5.2f} TB/s  err {r['err']:.3f}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--cases", default=",".join(CASES), help="cases, comma-separated (default all)")
    p.add_argument("--blocks", default="16,32,64", help="pool block sizes (default 16,32,64)")
    p.add_argument("--json", action="store_true", help="one JSON list on stdout")
    args = p.parse_args(argv)
    import torch

    print(f"# {torch.cuda.get_device_name()}", file=sys.stderr)
    rows = []
    for case in args.cases.split(","):
        for block in map(int, args.blocks.split(",")):
            rows.append(measure(case, block))
            print(row_line(rows[-1]), file=sys.stderr)
            torch.cuda.empty_cache()
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

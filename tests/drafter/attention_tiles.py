"""The paged attention kernel's tiles, swept on CUDA over the benchmark's rows
(``python tests/drafter/attention_tiles.py [CASE,...] [BLOCK,...]``, from the repository
root): each ``(BLOCK_N, num_warps, num_stages)`` of :data:`SWEEP` beside the tiles
``_kernels.tiles`` chooses, on ``remote_dspark.bench.attention``'s cases. How the chosen
tiles were found; rerun it on a new card or Triton before changing them."""

import functools
import sys

from remote_dspark.bench.attention import BLOCKS, CASES, measure, row_line
from remote_dspark.drafter.lm import _kernels

SWEEP = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (256, 4, 2), (64, 2, 3), (128, 2, 2), (128, 8, 2)]
"""(BLOCK_N, num_warps, num_stages)."""


def sweep(cases, blocks) -> list[dict]:
    rows = []
    for case in cases:
        for block in blocks:
            rows.append(measure(case, block))
            entries, queries = CASES[case][:2]
            block_m = _kernels.tiles(queries)[0]  # GPT-2's heads: one query head a key head
            for block_n, warps, stages in SWEEP:
                launch = functools.partial(
                    _kernels.launch, block_m=block_m, block_n=block_n, warps=warps, stages=stages
                )
                rows.append(measure(case, block, launch, f"{block_m}x{block_n} w{warps} s{stages}"))
            for r in rows[-1 - len(SWEEP) :]:
                print(row_line(r), flush=True)
    return rows


if __name__ == "__main__":
    cases = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES)
    blocks = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else list(BLOCKS)
    sweep(cases, blocks)

"""``bench round``'s ``mac`` row (opt-in: ``--modes ...,mac``): what authenticating every
DRAFTS frame would add to a round, next to the round itself.

A MAC on the frames after HELLO would be computed twice on a round's path: the worker
tags its DRAFTS, the engine checks the tag before anything of it is delivered. The row
times exactly that pair on a DRAFTS frame of the round's size (``floor.drafts_bytes``:
header and sections, ``--num-spec`` drafts per entry, a sampled one with its top-32
distributions): HMAC-SHA256 from the standard library (OpenSSL's one-shot ``HMAC``,
SHA-NI where the CPU has it) under a 32-byte key, then ``hmac.compare_digest``. Nothing
is sent; the bytes' values do not change the cost of a hash. ``x_process`` is its p50
over the process round's p50 of the same kind (greedy or sampled) in the same run: the
share of the round a MAC would cost (goal: at most ``GOAL_MAC_SHARE`` at 256 slots).
"""

from __future__ import annotations

import hmac
import os
import time

from .floor import drafts_bytes
from .options import DRAFT_BATCHES, RoundOptions
from .report import RoundRow

KEY_BYTES = 32


def mac_row(opts: RoundOptions, slots: int, sampled: bool = False) -> RoundRow:
    """Tag and check DRAFTS frames of ``slots`` entries, rotating through DRAFT_BATCHES
    frames of random bytes (so no frame stays in the cache from the round before)."""
    size = drafts_bytes(slots, opts.num_spec, sampled)
    key = os.urandom(KEY_BYTES)
    frames = [os.urandom(size) for _ in range(DRAFT_BATCHES)]
    rounds = opts.rounds_for(slots)
    lat = []
    for i in range(opts.warmup + rounds):
        frame = frames[i % DRAFT_BATCHES]
        t0 = time.perf_counter_ns()
        tag = hmac.digest(key, frame, "sha256")  # the worker's
        ok = hmac.compare_digest(tag, hmac.digest(key, frame, "sha256"))  # the engine's
        t1 = time.perf_counter_ns()
        if not ok:
            raise RuntimeError("bench round mac: the same bytes gave two tags")
        if i >= opts.warmup:
            lat.append(t1 - t0)
    return RoundRow("mac", slots, rounds, lat, extra={"drafts_bytes": size}, sampled=sampled)

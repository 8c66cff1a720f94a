"""The model drafter's KV pool under a flood of NEW_GEN streams from many engines, through
a real worker: the pool never grows (its blocks, its bytes, its memory), and every entry
drafted still drafts what a fresh encode of its stream's whole sequence drafts."""

from __future__ import annotations

import time

import numpy as np
from lm_common import agreeing_prefix, connect, hello

from remote_dspark import wire
from remote_dspark.drafter.lm.drafter import LMDrafter
from remote_dspark.worker import Worker

PLAIN = LMDrafter(device="cpu", cache_slots=0, window=8)  # the reference: re-encodes every round


def test_a_flood_of_new_gen_streams_from_many_engines_never_grows_the_pool_and_drafts_stay_right():
    """Four engines of 6 slots each send their rounds at once (the worker drafts them in
    shared calls), every slot NEW_GEN again every other round at any position with up to
    60 tokens, appends between: far more KV than a pool of 3 whole streams and 12 cache
    rows for 24 streams, so streams are evicted and re-encoded from the worker's tokens
    round after round. After every round the pool's blocks (in use and free) add up to
    the same count, its bytes and its memory are the ones allocated at start, and every
    entry drafted drafts what encoding its stream's whole sequence afresh does."""
    window, k, engines, slots = 8, 3, 4, 6
    probe = LMDrafter(device="cpu", cache_slots=1, window=window, max_context=64)
    blocks = 3 * probe.store.max_blocks + 1  # three whole streams and the trash block
    d = LMDrafter(
        device="cpu", cache_slots=12, window=window, max_context=64, kv_bytes=blocks * probe.store.block_bytes()
    )
    nbytes, address = d.store.nbytes(), d.store.kv.data_ptr()
    rng = np.random.default_rng(3)
    seqs = {}  # (engine, slot) -> (position of its first token, its tokens)
    drafted = 0
    with Worker(d, "127.0.0.1", 0, window=window) as w:
        clients = [connect(w.port, hello(d, engine_id=e, max_slots=slots, num_spec=k), session=e + 1) for e in range(4)]
        try:
            for rid in range(1, 11):
                sent = {}
                for e, c in enumerate(clients):
                    entries = []
                    for s in range(slots):
                        if rid % 2 or (e, s) not in seqs:  # NEW_GEN anywhere, up to 60 tokens
                            at, toks = int(rng.integers(0, 300)), rng.integers(0, 128, int(rng.integers(1, 61)))
                            seqs[e, s] = (at, toks.tolist())
                            entries.append(wire.Entry(s, k, at, tuple(toks.tolist()), new_gen=True))
                        else:
                            at, seq = seqs[e, s]
                            more = rng.integers(0, 128, 3).tolist()
                            entries.append(wire.Entry(s, k, at + len(seq), tuple(more)))
                            seq.extend(more)
                    c.send([wire.encode_round_entries(rid, e + 1, 5000, entries, b"", 0)])
                    sent[e] = entries
                for e, c in enumerate(clients):  # every engine's round queued before any answer is read
                    got = c.recv_drafts(rid, time.monotonic() + 30)
                    for s in range(slots):
                        if not got.counts[s]:
                            continue
                        drafted += 1
                        at, seq = seqs[e, s]
                        want, margins = PLAIN.greedy_one(seq, k, at)  # 63 tokens at most: all kept
                        a, b = agreeing_prefix(want, margins, got.row(s))
                        assert a == b, f"round {rid}, engine {e}, slot {s}"
                info = d.cache_info()
                assert info.blocks_used + info.blocks_free == blocks - 1  # the trash block is never a stream's
                assert d.store.blocks == blocks and d.store.nbytes() == nbytes == info.bytes
                assert d.store.kv.data_ptr() == address  # never reallocated
        finally:
            for c in clients:
                c.close()
    info = d.cache_info()
    assert info.evicted > 0 and info.misses > 24  # the flood passed the pool many times over
    assert drafted == 10 * engines * slots  # every entry drafted (in waves where the pool is short)

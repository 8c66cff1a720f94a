"""numpy views of one depth slot of the shared region, as the engine reads and writes
it on the host: the descriptor's payload area, the staging rows and the drafts slot's
arrays (:class:`SlotViews`); and the device views the stream uses (:class:`DeviceSlots`)."""

from __future__ import annotations

import numpy as np
import torch

from ... import wire
from ...shm import memfd


class SlotViews:
    """numpy views of one depth slot of the region: the descriptor's payload area, the
    staging rows and the drafts slot's arrays. Dropped before the region is unmapped."""

    def __init__(self, region: memfd.Region, i: int):
        lay = region.layout
        S, K = lay.max_slots, lay.num_spec

        def arr(offset: int, count: int, dtype) -> np.ndarray:
            return np.frombuffer(region.view(offset, count * np.dtype(dtype).itemsize), dtype=dtype)

        self.round_word = arr(lay.desc(i) + memfd.DESC_ROUND, 1, np.uint32)
        self.desc = arr(lay.desc(i) + memfd.DESC_FIXED, lay.desc_stride - memfd.DESC_FIXED, np.uint8)
        self.desc_addr = region.addr(lay.desc(i) + memfd.DESC_FIXED)
        self.staging = arr(lay.staging(i), S * lay.row_bytes, np.uint8).reshape(S, lay.row_bytes)
        d = lay.drafts(i)
        self.head = arr(d, 4, np.uint32)  # round, status, n_entries, flags (memfd.DRAFTS_HEAD)
        self.counts = arr(d + memfd.D_COUNTS, S, np.int32)
        self.statuses = arr(d + lay.d_entry_status, S, np.int32)
        self.tokens = arr(d + lay.d_tokens, S * K, np.int32).reshape(S, K)
        self.margins = arr(d + lay.d_margins, S * K, np.float32).reshape(S, K)
        q = S * K * wire.SAMPLED_TOP if lay.sampled else 0  # a sampled layout's distributions
        self.q_ids = arr(d + lay.d_q_ids, q, np.int32).reshape(-1, K, wire.SAMPLED_TOP)
        self.q_weights = arr(d + lay.d_q_weights, q, np.uint16).reshape(-1, K, wire.SAMPLED_TOP)

    def slots(self, n: int) -> np.ndarray:
        """The round's slots, as its descriptor holds them (the wire's slots section)."""
        return self.desc[wire.ROUND_FIXED.size : wire.ROUND_FIXED.size + 4 * n].view(np.uint32)


class DeviceSlots:
    """Device views (CUDA, through the region's mapping) of every depth slot the stream
    reads or writes: staging rows (none without rows: a zero-width view would alias the
    drafts slot), descriptor payloads, and the drafts slots' tokens, counts, outcome word
    and a sampled layout's q blocks. Each is a list indexed by the slot."""

    def __init__(self, region: memfd.Region, device_view):
        lay = region.layout
        S, K, depth = lay.max_slots, lay.num_spec, range(lay.depth)
        self.staging = [device_view(lay.staging(i), (S, lay.row_bytes), torch.uint8) for i in depth if lay.row_bytes]
        payload = ((lay.desc_stride - memfd.DESC_FIXED) // 4,)
        self.desc = [device_view(lay.desc(i) + memfd.DESC_FIXED, payload, torch.int32) for i in depth]
        self.tokens = [device_view(lay.drafts(i) + lay.d_tokens, (S, K), torch.int32) for i in depth]
        self.counts = [device_view(lay.drafts(i) + memfd.D_COUNTS, (S,), torch.int32) for i in depth]
        self.status = [device_view(lay.drafts(i) + memfd.D_STATUS, (1,), torch.int32) for i in depth]
        q = (S, K, wire.SAMPLED_TOP)
        self.q = [
            (
                device_view(lay.drafts(i) + lay.d_q_ids, q, torch.int32),
                device_view(lay.drafts(i) + lay.d_q_weights, q, torch.uint16),
            )
            for i in (depth if lay.sampled else ())
        ]

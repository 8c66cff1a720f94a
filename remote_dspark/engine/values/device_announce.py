"""Long contexts announced in chunks on the device: :class:`DeviceAnnouncer` plans a round
whose metadata lives on the device (a ``launch()`` of device tensors) by the rule of
:mod:`.announce` (its home; the tests hold this planner to :class:`~.announce.Announcer`
round for round), in torch operations enqueued on the current stream, the host reading
no value.

What lives on the device, per slot (index: slot; a spare row ``max_slots`` takes what a
slot out of range would write, so every index stays in range whatever the metadata
holds)::

    state  [S + 1] int8          IDLE, FIRST or REST (as the Announcer's)
    since  [S + 1] int64         when its request's context came (the oldest first)
    start  [S + 1] int64         the position of its first held token
    count  [S + 1] int64         the tokens it holds
    ring   [S + 1, cap] int32    its held tokens by position: the token at position p in
                                 column p % cap (a slot holds at most cap positions in a
                                 row, so none collide; keeping a queue's tail moves nothing)

A round (:meth:`DeviceAnnouncer.plan`) is a fixed number of whole-tensor operations of
shapes the host knows (the batch's entries and tokens, the round's budget): each entry's
queue (held, then its own tokens, a NEW_GEN context cut to ``cut``), the grants (the
queues sorted by age, a prefix sum against the budget), the round's tokens gathered into
a buffer of ``budget`` tokens (each a binary search of the round's offsets, then the
ring or the batch), and the tokens each slot keeps scattered into its ring, after every
read. The planned batch's ``tokens`` is that buffer (``Batch.tokens_bounded``: the round
is its first ``token_offsets[-1]``), which the metadata kernels write as any other.

The host keeps only what it knows: the clock of ``since`` (rounds planned) and whether
a slot may still be held. After each planned round the count of slots held and of
chunks sent is copied to pinned memory behind an event; a later round reads it only once
the event has passed (``query``, never a wait), and until a count of 0 is read every
round of device metadata is planned here (a round with nothing held goes as it is, as
on the host).
"""

from __future__ import annotations

import numpy as np
import torch

from .announce import FIRST, IDLE, REST, Announcer
from .batch import Batch


class DeviceAnnouncer:
    """The per-slot state on ``device`` (see the module docstring); one owner, the
    engine's round path on its engine thread."""

    def __init__(self, max_slots: int, cap: int, device: torch.device | str):
        self.cap, self.slots = cap, max_slots
        dev = torch.device(device)
        z = dict(device=dev)
        self.state = torch.zeros(max_slots + 1, dtype=torch.int8, **z)
        self.since = torch.zeros(max_slots + 1, dtype=torch.int64, **z)
        self.start = torch.zeros(max_slots + 1, dtype=torch.int64, **z)
        self.count = torch.zeros(max_slots + 1, dtype=torch.int64, **z)
        self.ring = torch.zeros(max_slots + 1, cap, dtype=torch.int32, **z)
        self.chunks = torch.zeros((), dtype=torch.int64, **z)  # entries sent as chunks (the Announcer's count)
        self.rounds = 0  # rounds planned: the clock of ``since`` (the host's)
        self._cuda = dev.type == "cuda"
        self._seen = torch.zeros(2, dtype=torch.int64, pin_memory=self._cuda)  # (held, chunks) at the event
        self._event = torch.cuda.Event() if self._cuda else None
        self._maybe_held = False  # a slot may be held: rounds are planned here until a count of 0 is read
        self._read = (0, 0)  # (held, chunks) of the last snapshot whose copy was done when read

    def maybe_held(self) -> bool:
        """Whether a slot may still be held (the last count read, or a count not read yet)."""
        if self._event is None or self._event.query():  # the last snapshot's copy is done: whole
            self._read = (int(self._seen[0]), int(self._seen[1]))
            self._maybe_held = self._maybe_held and bool(self._read[0])
        return self._maybe_held

    def counts(self) -> tuple[int, int]:
        """(slots held, chunks sent) as of the last snapshot read whole: never a wait (stats)."""
        self.maybe_held()
        return self._read

    def take(self, host: Announcer) -> None:
        """Take over what ``host`` holds (the host's metadata rounds held it; a device round
        now comes): its arrays copied to the device (no read back), its slots let go there."""
        s = torch.nonzero(torch.from_numpy(host.state != IDLE)).flatten()
        if not len(s):
            return
        idx = s.numpy()
        start, count = host.start[idx], host.count[idx]
        cols = (torch.from_numpy(start)[:, None] + torch.arange(host.cap)) % self.cap
        keep = torch.arange(host.cap)[None, :] < torch.from_numpy(count)[:, None]
        rows = s[:, None].expand_as(cols)
        dev = self.state.device
        self.ring[rows[keep].to(dev), cols[keep].to(dev)] = torch.from_numpy(host.held[idx])[keep].to(dev)
        for mine, theirs in ((self.state, host.state), (self.since, host.since), (self.start, host.start)):
            mine[s.to(dev)] = torch.from_numpy(theirs[idx]).to(dev)
        self.count[s.to(dev)] = torch.from_numpy(count).to(dev)
        self.rounds = max(self.rounds, host.rounds)
        host.release(idx)
        self._snapshot()

    def release(self, slots) -> None:
        """The engine freed ``slots``: what they hold is dropped (in stream order)."""
        s = torch.as_tensor(slots if isinstance(slots, torch.Tensor) else np.asarray(slots, np.int64)).to(torch.int64)
        if not len(s) or not self._maybe_held:
            return
        s = s[(s >= 0) & (s < self.slots)].to(self.state.device)
        self.state[s], self.count[s] = IDLE, 0
        self._snapshot()

    def plan(self, batch: Batch, cut: int, budget: int, n_out_default: int) -> tuple[Batch, torch.Tensor]:
        """The round of at most ``budget`` tokens of ``batch`` (device tensors, shapes
        checked), its NEW_GEN contexts cut to ``cut`` (at most ``cap``), and the slots'
        state after it; with the round's slots still announcing as a mask (bool [S])."""
        dev, n, t = self.state.device, len(batch), int(batch.tokens.shape[0])
        x = {f: torch.as_tensor(getattr(batch, f)).to(dev) for f in ("slots", "token_offsets", "positions")}
        slots = x["slots"].to(torch.int64)
        s = torch.where((slots < 0) | (slots >= self.slots), self.slots, slots)  # out of range: the spare row
        off = x["token_offsets"].to(torch.int64).clamp(0, t)
        g = torch.as_tensor(batch.new_gen).to(dev).to(torch.bool)
        lens = (off[1:] - off[:-1]).clamp(min=0)
        lead = torch.where(g, (lens - cut).clamp(min=0), 0)  # a NEW_GEN context's cut
        own_off, own_len, own_pos = off[:-1] + lead, lens - lead, x["positions"].to(torch.int64) + lead
        st, had, hstart = self.state[s], self.count[s], self.start[s]
        follows = ~g & (st != IDLE) & (own_pos == hstart + had)  # queue = held + own
        carried = torch.where(follows, had, 0)
        drop = torch.where(follows, (carried + own_len - cut).clamp(min=0), 0)  # a queue over the cut
        queue = carried + own_len - drop
        first = g | (follows & (st == FIRST)) | (drop > 0)
        qstart = torch.where(follows, hstart, own_pos) + drop
        self.rounds += 1
        arrival = self.rounds * self.slots + torch.arange(n, device=dev)  # this round's, in batch order
        key = torch.where(g, arrival, torch.where(follows, self.since[s], 0))
        order = torch.sort(key, stable=True).indices
        sorted_queue = queue[order]
        grant = torch.empty_like(queue)
        grant[order] = torch.minimum(
            (budget - (torch.cumsum(sorted_queue, 0) - sorted_queue)).clamp(min=0), sorted_queue
        )
        offsets = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        torch.cumsum(grant, 0, out=offsets[1:])
        src = torch.cat(
            (torch.as_tensor(batch.tokens).to(dev).to(torch.int32), torch.zeros(1, dtype=torch.int32, device=dev))
        )
        # The round's tokens: output j is token k of entry e's queue (index at in held + own).
        j = torch.arange(budget, device=dev)
        e = torch.searchsorted(offsets[1:], j, right=True).clamp(max=max(n - 1, 0))
        at = j - offsets[e] + drop[e]
        held_tok = self.ring[s[e], torch.remainder(hstart[e] + at, self.cap)]
        own_tok = src[(own_off[e] + at - carried[e]).clamp(0, t)]
        tokens = torch.where(j < offsets[n], torch.where(at < carried[e], held_tok, own_tok), 0)
        rest = queue - grant
        keep = torch.minimum(rest, torch.as_tensor(cut, device=dev))
        skipped = rest - keep  # past the cut: the slot's next chunk goes NEW_GEN again
        new_start = qstart + grant + skipped
        self._keep_own(src, off, s, own_off, own_pos, new_start, t)  # after every read of the ring
        self.state[s] = torch.where(rest > 0, torch.where(skipped > 0, FIRST, REST), IDLE).to(torch.int8)
        self.count[s], self.start[s], self.since[s] = keep, new_start, key
        whole = rest == 0
        self.chunks += torch.count_nonzero(~whole | (carried > 0))
        announcing = torch.zeros(self.slots + 1, dtype=torch.bool, device=dev)
        announcing[s] = ~whole
        self._snapshot()
        n_out = batch.n_out if batch.n_out is not None else torch.full((n,), n_out_default, dtype=torch.int64)
        planned = Batch(
            slots=batch.slots,
            tokens=tokens,
            token_offsets=offsets,
            positions=qstart,
            new_gen=first,
            rows=batch.rows,
            row_index=batch.row_index,
            n_out=torch.where(whole, torch.as_tensor(n_out).to(dev).to(torch.int64), 0),
            temperature=batch.temperature,
            seed=batch.seed,
            tokens_bounded=True,
        )
        return planned, announcing[: self.slots]

    def _keep_own(self, src, off, s, own_off, own_pos, new_start, t: int) -> None:
        """Scatter each entry's own tokens that its slot keeps (positions from
        ``new_start`` on) into the slot's ring row; the others go to the spare row."""
        if not t:
            return
        dev = src.device
        i = torch.arange(t, device=dev)
        e = torch.searchsorted(off[1:], i, right=True).clamp(max=len(s) - 1)
        p = own_pos[e] + i - own_off[e]
        kept = (i >= own_off[e]) & (p >= new_start[e])
        rows = torch.where(kept, s[e], self.slots)
        self.ring[rows, torch.remainder(p, self.cap)] = src[:t]

    def _snapshot(self) -> None:
        """The slots held and the chunks sent, copied to the host behind an event."""
        vals = torch.stack((torch.count_nonzero(self.state[: self.slots]), self.chunks))
        self._seen.copy_(vals, non_blocking=self._cuda)
        if self._event is not None:
            self._event.record()
        self._maybe_held = True

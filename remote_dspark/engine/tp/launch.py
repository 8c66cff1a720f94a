"""``launch()`` across a ``tp_group``: every rank's drafts, outcome and resync slots in
stream order, with no host synchronisation on any rank.

Rank 0 launches as a single-rank engine does, but into one fixed-size device record
(its answer tensors are views of it), then broadcasts the record on the group from its
stream; every other rank posts the same broadcast into a record of its own and takes its
``Launched`` as views of it. The size depends on the engine's shape alone (``max_slots``,
``num_spec``, sampled), never on the batch, so a rank's call is always the same
collective as rank 0's: a batch of another size cannot put the ranks out of step or
leave a collective waiting for bytes that never come.

The record, int32 words (``RecordLayout``)::

    head    [8]        outcome, flags, n, resync_all, round, 0, 0, 0
    mask    [M/4 ⌉]    M bytes, one per slot: 1 where the worker lost the slot (all 1 with
                       resync_all), viewed as ``bool`` [M]
    announcing [M/4 ⌉] M bytes, one per slot: 1 where the slot's context is still being
                       announced in chunks (``Launched.announcing``), viewed as ``bool`` [M]
    counts  [M]        the first n are the round's
    tokens  [M * k]    the first n * k are the round's, [n, k]
    q_ids   [M*k*32]   a sampled engine's, [n, k, 32]
    q_w     [M*k*16]   a sampled engine's uint16 pairs, [n, k, 32]

Who writes what on rank 0's stream, in order: the path's copies of the answer into
counts, tokens and q, and of the drafts slot's status word into ``outcome`` (after the
stream's wait for the round's release; a round answered at once, by no proxy or in sync
mode, writes them as values); one host-to-device copy of the head's other words and the
masks (values the host knows at launch: the round id, resync, the slots announcing), from pageable memory,
which CUDA stages before the call returns; then the broadcast. On NCCL the broadcast
runs on NCCL's stream after the engine's stream has reached it, and the engine's stream
waits for it: the host waits for nothing. (The staging holds about a thousand such small
copies queued behind a stalled stream, far more than the ring's depth lets an engine
launch ahead. On gloo, which carries CUDA tensors by the host, the broadcast is a host
wait; it is how the record is tested without two GPUs.)

A failure of rank 0's proxy or worker is an answer like any other (target-only drafts,
the outcome saying why), so it reaches every rank in stream order. A launch that raises
on rank 0 before its record went out (a closed engine, a batch its checks refuse, a
driver error) broadcasts a target-only record flagged ``FAILED`` with outcome ERROR
first, then raises on rank 0 only: the other ranks cannot learn of it without a host
sync, so they draft target-only. A batch of more than ``max_slots`` entries raises on
every rank (each checks its own, after its broadcast). Another rank whose launch raises
before its broadcast (a closed or unstarted engine) still takes part in rank 0's record
(``Ranks.follow``): every rank posts exactly one broadcast per ``launch()``. If rank 0's
process dies, the other ranks' broadcasts wait for the group's own timeout (NCCL's
watchdog then aborts the communicator), as every other collective of a tensor-parallel
engine would.

Every other rank counts its launched rounds from its records, without waiting: the
records' heads and counts go to the host a batch at a time (one stack, one copy to pinned
memory, one event per ``Follower.BATCH`` rounds), read once the event has passed (at a
later launch, or at close within a bound). A record whose n is not the rank's own batch
size raises ``ValueError`` at that later launch, once every record of its batch is
counted. Slots the worker lost are counted by rank 0 only (it reads them from the
region); a FAILED record is counted as an ERROR round here, where rank 0 raised.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
import torch

from ... import wire
from ...outcome import Outcome
from ..values.drafts import Launched

HEAD = 8
OUTCOME, FLAGS, N, RESYNC_ALL, ROUND = range(5)  # head words
FAILED = 1  # flags: rank 0's launch raised before its record went out (target-only)
_OUTCOMES = {int(o): o for o in Outcome}


class RecordLayout:
    """Where each part of a record is, in int32 words, for an engine of ``max_slots``
    slots and ``num_spec`` drafts (and ``sampled`` q)."""

    def __init__(self, max_slots: int, num_spec: int, sampled: bool):
        self.max_slots, self.num_spec, self.sampled = max_slots, num_spec, sampled
        self.mask_at = HEAD
        self.announcing_at = HEAD + (max_slots + 3) // 4
        self.counts_at = self.announcing_at + (max_slots + 3) // 4
        self.tokens_at = self.counts_at + max_slots
        self.q_ids_at = self.tokens_at + max_slots * num_spec
        self.q_weights_at = self.q_ids_at + max_slots * num_spec * wire.SAMPLED_TOP
        half = wire.SAMPLED_TOP // 2  # q_weights: two uint16 a word
        self.words = self.q_weights_at + max_slots * num_spec * half if sampled else self.q_ids_at

    def views(self, record: torch.Tensor, n: int) -> Views:
        """``record``'s parts for a round of ``n`` entries (views, no copy)."""
        k, top = self.num_spec, wire.SAMPLED_TOP
        out = (record.as_strided((n, k), (k, 1), self.tokens_at), record[self.counts_at : self.counts_at + n])
        if self.sampled:
            at = self.q_weights_at
            out += (
                record.as_strided((n, k, top), (k * top, top, 1), self.q_ids_at),
                record[at : at + n * k * top // 2].view(torch.uint16).view(n, k, top),
            )
        m = self.max_slots
        mask = record[self.mask_at : self.announcing_at].view(torch.uint8)[:m].view(torch.bool)
        announcing = record[self.announcing_at : self.counts_at].view(torch.uint8)[:m].view(torch.bool)
        return Views(record[OUTCOME : OUTCOME + 1], mask, announcing, out)


@dataclasses.dataclass(frozen=True)
class Views:
    outcome: torch.Tensor  # int32 [1]
    mask: torch.Tensor  # bool [max_slots]
    announcing: torch.Tensor  # bool [max_slots]
    answer: tuple[torch.Tensor, ...]  # tokens, counts[, q_ids, q_weights]: what a path launches into

    def launched(self, round_id, resync, resync_all, announcing) -> Launched:
        a = self.answer
        q = a[2:] or (None, None)
        return Launched(round_id, *a[:2], resync, resync_all, *q, self.outcome, self.mask, announcing, self.announcing)


def check_size(n: int, layout: RecordLayout, rank: int) -> None:
    if n > layout.max_slots:
        raise ValueError(f"tp_group rank {rank}: a batch of {n} entries, more than max_slots={layout.max_slots}")


class Leader:
    """Rank 0's side: a launch into a record, then its broadcast."""

    def __init__(self, ranks, layout: RecordLayout, device: torch.device):
        self.ranks, self.layout, self.device = ranks, layout, device
        self._host = slice(FLAGS, layout.counts_at)  # the head's host words and the mask

    def launch(self, n: int, launch) -> Launched:
        """``launch(out, status)`` (the engine's launch into the record's views) and the
        record's broadcast. A raise before the broadcast sends a ``FAILED`` record first.

        Raises:
            Whatever ``launch`` raises.
        """
        lay, sent = self.layout, False
        try:
            record = torch.empty(lay.words, dtype=torch.int32, device=self.device)
            views = lay.views(record, min(n, lay.max_slots))
            check_size(n, lay, 0)
            got = launch(views.answer, views.outcome)
            head = np.zeros(self._host.stop - FLAGS, dtype=np.int32)
            head[N - FLAGS], head[RESYNC_ALL - FLAGS] = n, got.resync_all
            head[ROUND - FLAGS] = np.uint32(got.round).view(np.int32)
            masks = head[HEAD - FLAGS :].view(np.uint8)
            mask, announcing = masks[: 4 * (lay.announcing_at - HEAD)], masks[4 * (lay.announcing_at - HEAD) :]
            if got.resync_all:
                mask[: lay.max_slots] = 1
            else:
                mask[list(got.resync)] = 1
            if got.announcing is not None:  # (None: planned on the device, its mask in stream order)
                announcing[list(got.announcing)] = 1
            self._write(record[self._host], head)
            if got.announcing is None:
                views.announcing.copy_(got.announcing_mask)
            sent = True
            self.ranks.broadcast_record(record)
            return views.launched(got.round, got.resync, got.resync_all, got.announcing)
        except BaseException as e:
            if not sent:
                self._send_failed(n, e)
            raise

    def _write(self, dst: torch.Tensor, values: np.ndarray) -> None:
        """Host values into the record in stream order, without a sync: an asynchronous
        copy from pageable memory, which CUDA stages before the call returns (the array
        may go at once) and which waits for nothing on the device."""
        dst.copy_(torch.from_numpy(values), non_blocking=True)

    def _send_failed(self, n: int, e: BaseException) -> None:
        try:
            record = torch.zeros(self.layout.words, dtype=torch.int32, device=self.device)
            self._write(record[: N + 1], np.array([int(Outcome.ERROR), FAILED, n], dtype=np.int32))
            self.ranks.broadcast_record(record)
        except BaseException as again:  # the group itself is broken: the launch's error still wins
            e.add_note(f"tp_group: rank 0's FAILED record could not be broadcast either: {again!r}")


class Follower:
    """Another rank's side: the broadcast into a record of its own, the launch's views of
    it, and the rounds counted from the records' heads and counts, brought to the host
    BATCH records at a time (one stack, one copy, one event, on the stream the records
    came on) and read once their event has passed. Its launches are the engine thread's;
    ``finish`` comes from ``close()``, on any thread, once no launch is inside."""

    BATCH = 16  # records a copy to the host takes (fewer where they are big: BATCH_BYTES)
    BATCH_BYTES = 64 << 20  # the records a batch keeps alive until its copy is enqueued
    MAX_UNREAD = 8  # batches copied, not yet read; past it, a launch waits for the oldest

    def __init__(self, ranks, layout: RecordLayout, device: torch.device, counts, batch: int | None = None):
        self.ranks, self.layout, self.device, self.counts = ranks, layout, device, counts
        self.batch = batch or max(1, min(self.BATCH, self.BATCH_BYTES // (4 * layout.words)))
        self._cuda = device.type == "cuda"
        self._pending: list[tuple[int, torch.Tensor]] = []  # (n, head + mask + counts view), not yet copied
        self._stream = None  # the stream the pending records came on (CUDA)
        self._unread: collections.deque = collections.deque()  # (ns, host copy, its event or None)
        self._wrong: tuple[int, int] | None = None  # the first (n, rank 0's n) that differed, not yet raised

    def launch(self, n: int) -> Launched:
        """Rank 0's answer to this round, in stream order.

        Raises:
            ValueError: this batch has more than ``max_slots`` entries, or an earlier
                round's record says rank 0's batch had another size (each after the
                broadcast: the ranks stay in step).
        """
        lay = self.layout
        record = torch.empty(lay.words, dtype=torch.int32, device=self.device)
        self.ranks.broadcast_record(record)
        check_size(n, lay, self.ranks.rank)
        stream = torch.cuda.current_stream() if self._cuda else None
        if self._pending and stream != self._stream:
            self._copy_out(wait=True)  # a batch is one stream's records
        self._stream = stream
        self._pending.append((n, record[: lay.tokens_at]))
        if len(self._pending) >= self.batch:
            self._copy_out(wait=True)
            self.count(wait_s=0.0)
        self._raise_wrong()
        return lay.views(record, n).launched(None, None, None, None)

    def finish(self, wait_s: float) -> None:
        """Closing (no launch inside): count every record, waiting ``wait_s`` at most for
        their copies (never for the stream beyond it).

        Raises: as :meth:`launch`, for a record of another size."""
        if self._pending:
            self._copy_out(wait=False)
        self.count(wait_s)
        self._raise_wrong()

    def _copy_out(self, wait: bool) -> None:
        """The pending records' heads to the host: one stack and one copy on their stream,
        and its event. With ``wait``, when MAX_UNREAD batches are unread, the oldest is
        waited for first (the stream is far behind)."""
        if wait and len(self._unread) >= self.MAX_UNREAD:
            event = self._unread[0][2]
            if event is not None:
                event.synchronize()
            self.count(wait_s=0.0)
        ns, heads = zip(*self._pending)
        self._pending = []
        if not self._cuda:
            self._unread.append((ns, torch.stack(heads), None))
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            stacked = torch.stack(heads)
            host = torch.empty(stacked.shape, dtype=torch.int32, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._unread.append((ns, host, event))

    def count(self, wait_s: float) -> None:
        """Count the records whose copy has landed; with ``wait_s``, wait that long at
        most for the rest. A record of another size than its launch's is kept for
        :meth:`_raise_wrong` (every record is counted first)."""
        deadline = time.monotonic() + wait_s
        while self._unread:
            ns, host, event = self._unread[0]
            if event is not None and not event.query():
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.001)
                continue
            self._unread.popleft()
            words = host.numpy()
            for i, n in enumerate(ns):
                got = self._count_one(words[i])
                if got != n and self._wrong is None:
                    self._wrong = (n, got)

    def _raise_wrong(self) -> None:
        if self._wrong is not None:
            (n, got), self._wrong = self._wrong, None
            raise ValueError(
                f"tp_group rank {self.ranks.rank}: a launch() of {n} entries, but rank 0's round had "
                f"{got}: every rank must pass the same batch"
            )

    def _count_one(self, words: np.ndarray) -> int:
        """Count one record's round; its n."""
        lay = self.layout
        got = int(words[N])
        counts = words[lay.counts_at : lay.counts_at + min(max(got, 0), lay.max_slots)]
        outcome = _OUTCOMES.get(int(words[OUTCOME]), Outcome.ERROR)
        self.counts.record_totals(outcome, int(np.count_nonzero(counts)), int(counts.sum(dtype=np.int64)), 0)
        return got

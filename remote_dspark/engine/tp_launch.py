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
    counts  [M]        the first n are the round's
    tokens  [M * k]    the first n * k are the round's, [n, k]
    q_ids   [M*k*32]   a sampled engine's, [n, k, 32]
    q_w     [M*k*16]   a sampled engine's uint16 pairs, [n, k, 32]

Who writes what on rank 0's stream, in order: the path's copies of the answer into
counts, tokens and q, and of the drafts slot's status word into ``outcome`` (after the
stream's wait for the round's release; a round answered at once, by no proxy or in sync
mode, writes them as values); one host-to-device copy of the head's other words and the
mask, from pinned memory (values the host knows at launch: the round id, resync); then
the broadcast. On NCCL the broadcast runs on NCCL's stream after the engine's stream has
reached it, and the engine's stream waits for it: the host waits for nothing. (On gloo,
which carries CUDA tensors by the host, the broadcast is a host wait; it is how the
record is tested without two GPUs.)

A failure of rank 0's proxy or worker is an answer like any other (target-only drafts,
the outcome saying why), so it reaches every rank in stream order. A launch that raises
on rank 0 before its record went out (a closed engine, a batch its checks refuse, a
driver error) broadcasts a target-only record flagged ``FAILED`` with outcome ERROR
first, then raises on rank 0 only: the other ranks cannot learn of it without a host
sync, so they draft target-only. A batch of more than ``max_slots`` entries raises on
every rank (each checks its own, after its broadcast). If rank 0's process dies, the
other ranks' broadcasts wait for the group's own timeout (NCCL's watchdog then aborts
the communicator), as every other collective of a tensor-parallel engine would.

Every other rank counts its launched rounds from its records, without waiting: a small
copy of the head and counts to pinned memory and an event per round, read once the
event has passed (at a later launch, or at close within a bound). A record whose n is
not the rank's own batch size raises ``ValueError`` at that later launch. Slots the
worker lost are counted by rank 0 only (it reads them from the region).
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
import torch

from .. import wire
from ..outcome import Outcome
from .handoff import Launched

HEAD = 8
OUTCOME, FLAGS, N, RESYNC_ALL, ROUND = range(5)  # head words
FAILED = 1  # flags: rank 0's launch raised before its record went out (target-only)
MAX_UNREAD = 64  # another rank's records not yet counted; past it, the oldest is waited for
_OUTCOMES = {int(o): o for o in Outcome}


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """Where each part of a record is, in int32 words, for an engine of ``max_slots``
    slots and ``num_spec`` drafts (and ``sampled`` q)."""

    max_slots: int
    num_spec: int
    sampled: bool

    @property
    def mask_at(self) -> int:
        return HEAD

    @property
    def counts_at(self) -> int:
        return HEAD + (self.max_slots + 3) // 4

    @property
    def tokens_at(self) -> int:
        return self.counts_at + self.max_slots

    @property
    def q_ids_at(self) -> int:
        return self.tokens_at + self.max_slots * self.num_spec

    @property
    def words(self) -> int:
        q = self.max_slots * self.num_spec * (wire.SAMPLED_TOP + wire.SAMPLED_TOP // 2) if self.sampled else 0
        return self.q_ids_at + q

    def views(self, record: torch.Tensor, n: int) -> Views:
        """``record``'s parts for a round of ``n`` entries (views, no copy)."""
        k, top = self.num_spec, wire.SAMPLED_TOP
        out = [record[self.tokens_at : self.tokens_at + n * k].view(n, k), record[self.counts_at :][:n]]
        if self.sampled:
            at, nq = self.q_ids_at, self.max_slots * k * top
            out.append(record[at : at + n * k * top].view(n, k, top))
            out.append(record[at + nq : at + nq + n * k * top // 2].view(torch.uint16).view(n, k, top))
        mask = record[self.mask_at : self.counts_at].view(torch.uint8)[: self.max_slots].view(torch.bool)
        return Views(record[OUTCOME : OUTCOME + 1], mask, tuple(out))


@dataclasses.dataclass(frozen=True)
class Views:
    outcome: torch.Tensor  # int32 [1]
    mask: torch.Tensor  # bool [max_slots]
    answer: tuple[torch.Tensor, ...]  # tokens, counts[, q_ids, q_weights]: what a path launches into

    def launched(self, round_id, resync, resync_all) -> Launched:
        a = self.answer
        return Launched(round_id, *a[:2], resync, resync_all, *(a[2:] or (None, None)), self.outcome, self.mask)


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
            mask = head[HEAD - FLAGS :].view(np.uint8)
            if got.resync_all:
                mask[: lay.max_slots] = 1
            else:
                mask[list(got.resync)] = 1
            self._write(record[self._host], head)
            sent = True
            self.ranks.broadcast_record(record)
            return views.launched(got.round, got.resync, got.resync_all)
        except BaseException as e:
            if not sent:
                self._send_failed(n, e)
            raise

    def _write(self, dst: torch.Tensor, values: np.ndarray) -> None:
        """Host values into the record in stream order, without a sync: from pinned memory
        on CUDA (its block is not reused before the copy has run: torch's host allocator)."""
        src = torch.from_numpy(values)
        if dst.is_cuda:
            src = src.pin_memory()
        dst.copy_(src, non_blocking=dst.is_cuda)

    def _send_failed(self, n: int, e: BaseException) -> None:
        record = torch.zeros(self.layout.words, dtype=torch.int32)
        record[OUTCOME], record[FLAGS], record[N] = int(Outcome.ERROR), FAILED, n
        try:
            self.ranks.broadcast_record(record.to(self.device))
        except BaseException as again:  # the group itself is broken: the launch's error still wins
            e.add_note(f"tp_group: rank 0's FAILED record could not be broadcast either: {again!r}")


class Follower:
    """Another rank's side: the broadcast into a record of its own, the launch's views of
    it, and the rounds counted from records whose copies have landed. Engine thread only."""

    def __init__(self, ranks, layout: RecordLayout, device: torch.device, counts):
        self.ranks, self.layout, self.device, self.counts = ranks, layout, device, counts
        self._unread: collections.deque = collections.deque()  # (n, pinned head+mask+counts, event)
        self._read = slice(0, layout.tokens_at)

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
        self._keep(n, record)
        self.count(wait_s=0.0)
        return lay.views(record, n).launched(None, None, None)

    def _keep(self, n: int, record: torch.Tensor) -> None:
        if len(self._unread) >= MAX_UNREAD:  # the stream is far behind: wait for the oldest
            self._unread[0][2].synchronize()
            self.count(wait_s=0.0)
        part = record[self._read]
        if not record.is_cuda:
            self._unread.append((n, part.clone(), None))
            return
        host = torch.empty(part.shape, dtype=torch.int32, pin_memory=True)
        host.copy_(part, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._unread.append((n, host, event))

    def count(self, wait_s: float) -> None:
        """Count every record whose copy has landed; with ``wait_s``, wait that long at
        most for the rest (closing).

        Raises:
            ValueError: a record of rank 0's of another size than this rank's batch.
        """
        deadline = time.monotonic() + wait_s
        while self._unread:
            n, host, event = self._unread[0]
            if event is not None and not event.query():
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.001)
                continue
            self._unread.popleft()
            self._count_one(n, host.numpy())

    def _count_one(self, n: int, words: np.ndarray) -> None:
        lay = self.layout
        got = int(words[N])
        counts = words[lay.counts_at : lay.counts_at + min(max(got, 0), lay.max_slots)]
        outcome = _OUTCOMES.get(int(words[OUTCOME]), Outcome.ERROR)
        self.counts.record_totals(outcome, int(np.count_nonzero(counts)), int(counts.sum(dtype=np.int64)), 0)
        if got != n:
            raise ValueError(
                f"tp_group rank {self.ranks.rank}: a launch() of {n} entries, but rank 0's round had {got}: "
                "every rank must pass the same batch"
            )

"""Tensor parallelism: who does what when ``RemoteDSpark`` runs on every rank of a
``tp_group``, and the records rank 0 broadcasts to the others.

Rank 0 of the group (its rank in the group, whatever its global rank) is the engine of
the single-rank design: it checks that the endpoint is reachable, starts the proxy,
connects, writes the stats file and serves /metrics. Every other rank opens nothing (no
region, no native library, no proxy, no socket): its path is a :class:`FollowerPath`,
whose round is the answer rank 0 broadcast. What is shared is the remote round's answer,
not the policy's output: the policy runs on every rank over the same answer, so a shadow
or resilience local drafter (tensor parallel itself) runs on every rank in the same
rounds, and ``ON_FAIL=raise`` raises on every rank from the same outcome.

The collectives, which every rank runs in the same order:

    start()   all_gather of the configuration's per-field digests (a difference raises
              ValueError on every rank, naming the variables and the ranks); then one
              record from rank 0: STARTED (with its mode) or ERROR
    round()   one record from rank 0: DRAFTS or ERROR

    launch()  one fixed-size device record from rank 0, in stream order (:mod:`.launch`)

``close()`` and ``stats()`` run none. The start() and round() records are
:mod:`.records`'; a rank that fails a step before it took part in the step's record
still takes part (:meth:`Ranks.follow`): rank 0 sends one for every step.

Failures: rank 0 broadcasts whatever leaves its start or its round before the record
went out as an ERROR record, then raises it; every other rank raises an exception of the
same class with the same arguments (and simple attributes, such as ``Refused.code``), with
a note that it came from rank 0. A class the receiving rank has not loaded arrives as a
``RuntimeError`` naming it. A rank's wait for a record is bounded by the group's own
timeout (``init_process_group(timeout=...)``), not by this module.

torch.distributed is imported only when a group is given (by :class:`Ranks`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable

import torch

from ...config.env import TABLE
from ...config.mode import Mode
from ..observe.stats import EngineCounts
from ..paths.base import NothingOpen
from ..spec import Spec
from ..values.batch import Batch
from ..values.drafts import Drafts, Launched
from .launch import Follower, Leader, RecordLayout
from .records import (
    DRAFTS,
    ERROR,
    HEADER_WORDS,
    KIND_NAMES,
    STARTED,
    drafts_body_words,
    drafts_from_record,
    drafts_record,
    error_from_record,
    error_record,
)

MODES = tuple(Mode)  # a STARTED record's mode, by its index here
_VARIABLE = {v.field: v.name for v in TABLE if v.field}  # a config field -> the variable that sets it
log = logging.getLogger("remote_dspark.engine")


class Ranks:
    """This process's place in a tensor-parallel group and the records it sends (rank 0)
    or receives (every other rank). Used by the engine thread only (start, rounds).

    Raises:
        ValueError: this process is not a member of ``group``.
    """

    def __init__(self, group):
        import torch.distributed as dist  # here only: an engine without a tp_group never loads it

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("tp_group: this process is not one of its ranks")
        self.size = dist.get_world_size(group)
        self._src = dist.get_process_group_ranks(group)[0]  # broadcast's src is a global rank
        # NCCL moves CUDA tensors only; every other backend here (gloo) takes CPU tensors.
        nccl = dist.get_backend(group) == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._owed = False  # rank 0 inside a round whose record has not gone out yet
        self._leader: Leader | None = None  # rank 0's launch(), from its first
        self._records = 0  # records this rank took part in (sent, received or skipped)

    @property
    def leader(self) -> bool:
        """Rank 0 of the group: the one that opens the path to the remote drafter."""
        return self.rank == 0

    # ------------------------------------------------------------------ start

    def start(
        self, spec: Spec, open_path: Callable[[], None], mode: Callable[[], Mode], counts: EngineCounts
    ) -> FollowerPath | None:
        """Every rank: compare the configuration; then rank 0 runs ``open_path`` and says
        how it went (``mode()`` once open), the others learn it. Returns None on rank 0,
        the rank's :class:`FollowerPath` elsewhere.

        Raises:
            ValueError: the configuration differs across the ranks (on every rank).
            Whatever ``open_path`` raises on rank 0 (on every rank).
        """
        self.check_same(spec)
        if self.leader:
            self.lead(open_path)
            self._send(STARTED, MODES.index(mode()))
            return None
        header, _ = self._receive(STARTED)
        return FollowerPath(self, dataclasses.replace(spec, mode=MODES[header[1]]), counts)

    def check_same(self, spec: Spec) -> None:
        """Every rank: the digests of every configuration field (and of the round's shape)
        gathered from every rank; any difference raises on every rank alike.

        Raises:
            ValueError: naming each rank that differs from rank 0 and its variables.
        """
        names, digests = config_digests(spec)
        mine = torch.tensor(digests, dtype=torch.int64, device=self._device)
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        self._dist.all_gather(everyone, mine, group=self.group)
        table = torch.stack(everyone).cpu()
        differ = table != table[0]
        if bool(differ.any()):
            which = "; ".join(
                f"rank {r}: " + ", ".join(names[i] for i in differ[r].nonzero().flatten().tolist())
                for r in range(self.size)
                if bool(differ[r].any())
            )
            raise ValueError(
                f"tp_group: the remote DSpark configuration differs across the ranks ({which} "
                "differ from rank 0's); every rank must read the same environment"
            )

    # ------------------------------------------------------------------ rounds

    def lead(self, fn: Callable, *args, **kwargs):
        """Rank 0: ``fn(*args, **kwargs)``; an exception that leaves it before the record of this
        step went out is broadcast as an ERROR record first (the other ranks wait for
        one), then raised."""
        self._owed = True
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            if self._owed:
                self._owed = False  # never twice, even if this broadcast fails
                self._send_error(e)
            raise
        finally:
            self._owed = False

    def share(self, path, batch: Batch) -> Drafts:
        """The round's remote answer on every rank: rank 0 asks its path and broadcasts
        the answer; another rank's path (a :class:`FollowerPath`) receives it."""
        drafts = path.round(batch)
        if self.leader:
            self._owed = False
            header, body = drafts_record(drafts)
            self._send(*header, body=body)
        return drafts

    def receive_drafts(self, n: int) -> Drafts:
        """A rank other than 0: rank 0's answer to a round of ``n`` entries.

        Raises:
            ValueError: rank 0's round had another number of entries (the record is read
                whole first, so the ranks stay in step).
            Whatever rank 0 raised in this round, rebuilt.
        """
        header, body = self._receive(DRAFTS)
        got = header[1]
        if got != n:
            raise ValueError(
                f"tp_group rank {self.rank}: a batch of {n} entries, but rank 0's had {got}: "
                "every rank must pass the same batch"
            )
        return drafts_from_record(header, body)

    def launch(self, spec: Spec, batch: Batch, launch: Callable) -> Launched:
        """Every rank's ``launch()`` (:mod:`.launch`): on rank 0 ``launch(batch, out,
        status)`` into a record, then its broadcast (a raise before it sends a FAILED
        record); on the others ``launch(batch)``, their path taking rank 0's record (a
        raise before it still takes part: :meth:`follow`)."""
        if not self.leader:
            return self.follow(lambda: launch(batch), lambda: self.skip_launch(spec))
        if self._leader is None:
            layout = RecordLayout(spec.max_slots, spec.num_spec, spec.sampled)
            self._leader = Leader(self, layout, torch.device("cuda", torch.cuda.current_device()))
        return self._leader.launch(len(batch), lambda out, status: launch(batch, out, status))

    def broadcast_record(self, record: torch.Tensor) -> None:
        """One launch() record from group rank 0, in place, on the record's own device."""
        self._records += 1
        self._dist.broadcast(record, src=self._src, group=self.group)

    def follow(self, step: Callable, catch_up: Callable[[], None]):
        """A rank other than 0: ``step()``. If it raises before this rank took part in
        the step's record (a closed or unstarted engine, an allocation that failed),
        ``catch_up()`` takes part first: rank 0 sends a record for every step, a failed
        one included, so a rank that skipped one would pair its next collective with it."""
        before = self._records
        try:
            return step()
        except BaseException as e:
            if self._records == before:
                try:
                    catch_up()
                except BaseException as again:  # the group itself is broken: the step's error still wins
                    e.add_note(f"tp_group rank {self.rank}: rank 0's record of this step could not be taken: {again!r}")
            raise

    def skip_round(self) -> None:
        """Take part in rank 0's round() record and drop it (``follow``'s catch-up)."""
        try:
            self._receive(DRAFTS)
        except Exception:  # an ERROR record, rebuilt: this rank raises its own
            pass

    def skip_launch(self, spec: Spec) -> None:
        """Take part in rank 0's launch() record into a record of its own and drop it."""
        words = RecordLayout(spec.max_slots, spec.num_spec, spec.sampled).words
        self.broadcast_record(torch.empty(words, dtype=torch.int32, device=torch.cuda.current_device()))

    # ------------------------------------------------------------------ records

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self._device)
        self._dist.broadcast(t, src=self._src, group=self.group)
        return t

    def _send(
        self,
        kind: int,
        n: int = 0,
        k: int = 0,
        outcome: int = 0,
        source: int = 0,
        resync_all: int = 0,
        n_resync: int = 0,
        flags: int = 0,
        n_announcing: int = 0,
        body: torch.Tensor | None = None,
    ) -> None:
        header = [kind, n, k, outcome, source, resync_all, n_resync, flags, n_announcing]
        self._broadcast(torch.tensor(header, dtype=torch.int64))
        if body is not None and body.numel():  # the receivers size it from the header (an empty one: no call)
            self._broadcast(body)

    def _send_error(self, e: BaseException) -> None:
        raw = error_record(e)
        self._send(ERROR, len(raw), body=torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def _receive(self, want: int) -> tuple[list[int], torch.Tensor | None]:
        """The next record (header and body, read whole whatever it is); an ERROR is raised.

        Raises:
            RuntimeError: a record of another kind than ``want`` (the ranks' calls are out of step).
        """
        self._records += 1
        header = self._broadcast(torch.zeros(HEADER_WORDS, dtype=torch.int64)).tolist()
        kind, n, k, _, _, _, n_resync, flags, n_announcing = header
        body = None
        if kind == ERROR:
            body = self._broadcast(torch.empty(n, dtype=torch.uint8))
            raise error_from_record(body.cpu().numpy().tobytes(), self.rank)
        if kind == DRAFTS:
            body = torch.empty(drafts_body_words(n, k, n_resync, flags, n_announcing), dtype=torch.int32)
            if body.numel():
                body = self._broadcast(body)
        if kind != want:
            raise RuntimeError(
                f"tp_group rank {self.rank}: rank 0 sent a {KIND_NAMES.get(kind, kind)} record "
                f"where a {KIND_NAMES[want]} was due: the ranks' start()/round() calls are out "
                "of step"
            )
        return header, body


class FollowerPath(NothingOpen):
    """A rank other than 0's path: nothing opened; a round is rank 0's answer, a launch
    rank 0's record. Closing has nothing to interrupt: a round here waits in a
    collective, bounded by the group's timeout (``close()`` returns anyway; the round
    leaves when rank 0's record comes)."""

    COUNT_AT_CLOSE_S = 1.0  # closing: how long launched rounds' records may take to be counted

    def __init__(self, ranks: Ranks, spec: Spec, counts: EngineCounts):
        super().__init__()
        self.ranks = ranks
        self.spec = spec  # rank 0's mode: the mode its answers come from
        self.counts = counts
        self._follower: Follower | None = None  # launch(), from its first

    def round(self, batch: Batch) -> Drafts:
        return self.ranks.receive_drafts(len(batch))

    def launch(self, batch: Batch, answer: Callable[[Batch], Drafts], out=(), status=None) -> Launched:
        if self._follower is None:
            layout = RecordLayout(self.spec.max_slots, self.spec.num_spec, self.spec.sampled)
            device = torch.device("cuda", torch.cuda.current_device())
            self._follower = Follower(self.ranks, layout, device, self.counts)
        return self._follower.launch(len(batch))

    def stop(self, limit_s: float) -> None:
        super().stop(limit_s)
        if self._follower is not None and self.users.wait_alone(time.monotonic()):  # no launch inside
            try:
                self._follower.finish(min(limit_s, self.COUNT_AT_CLOSE_S))
            except ValueError as e:
                log.warning("remote DSpark: close: %s", e)


def shares_failure(method):
    """Decorates ``RemoteDSpark.round``: on rank 0 of a ``tp_group`` the call runs under
    :meth:`Ranks.lead`, so a failure before its answer was broadcast (a closed engine, a
    bad batch, a local drafter's error) reaches every rank; on another rank under
    :meth:`Ranks.follow`, so one that fails before it took rank 0's record still takes
    it. Without a group the call is unchanged."""

    @functools.wraps(method)
    def wrapper(engine, *args, **kwargs):
        ranks = engine._ranks
        if ranks is None:
            return method(engine, *args, **kwargs)
        if not ranks.leader:
            return ranks.follow(lambda: method(engine, *args, **kwargs), ranks.skip_round)
        return ranks.lead(method, engine, *args, **kwargs)

    return wrapper


def config_digests(spec: Spec) -> tuple[list[str], list[int]]:
    """(names, digests): every configuration field and the round's shape, named by the
    variable that sets it (or the constructor argument), each with a 64-bit digest."""
    doc = json.loads(spec.cfg.to_json()) | {
        "num_spec": spec.num_spec,
        "max_slots": spec.max_slots,
        "row_bytes": spec.row_bytes,
    }
    fields = sorted(doc)
    digests = [
        int.from_bytes(hashlib.sha256(json.dumps(doc[f], sort_keys=True).encode()).digest()[:8], "little", signed=True)
        for f in fields
    ]
    return [_VARIABLE.get(f, f) for f in fields], digests

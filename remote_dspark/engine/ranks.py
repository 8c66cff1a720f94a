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

    launch()  one fixed-size device record from rank 0, in stream order (:mod:`.tp_launch`)

``close()`` and ``stats()`` run none. A record of start() and round() is two broadcasts
from group rank 0, a header and the body it sizes (STARTED has none):

    header  int64 [8]: kind, n, num_spec, outcome, source, resync_all, n_resync, flags
            (ERROR: n is the body's length in bytes; STARTED: n is the mode's index;
            DRAFTS: flags bit 0 margins, bit 1 sampled q)
    DRAFTS  int32 [n * k tokens | n counts | n_resync slots | n * k margins as float32 bits
            | n * k * 32 q_ids | n * k * 16 words of q_weights, uint16 pairs in memory order]
    ERROR   uint8: JSON {"type": "module:qualname", "args": [...], "attrs": {...}, "message": str}

Why tensors and not ``broadcast_object_list``: the same calls work on gloo (CPU tensors)
and NCCL (tensors on the rank's current CUDA device) with nothing else to set up; the
drafts are int32 tensors already (one concatenation, one broadcast, no loop over
entries; q_weights travel as int32 words, which NCCL and gloo both carry, where uint16 is
not in every gloo operation); and nothing received is unpickled: an error is JSON,
rebuilt only as an exception class the receiving rank has already loaded. The header goes
first so that a rank whose batch has another size than rank 0's still reads the whole
record (it stays in step) and raises ``ValueError`` naming both sizes. Every rank's
drafts carry q exactly when rank 0's do, which is when its engine is sampled (every
answer of a sampled engine carries q, an empty one zeros; the ranks' configurations are
the same). On NCCL a receiver copies the header to the host once per record
(``round()`` blocks anyway).

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
import sys
import time
from collections.abc import Callable

import torch

from .. import wire
from ..config.env import TABLE
from ..config.mode import Mode
from ..outcome import Outcome
from .batch import Batch
from .drafts import Drafts
from .handoff import Launched
from .path import NothingOpen
from .spec import Spec
from .stats import EngineCounts
from .tp_launch import Follower, Leader, RecordLayout

MODES = tuple(Mode)  # a STARTED record's mode, by its index here
SOURCES = ("remote", "local", "none")
STARTED, DRAFTS, ERROR = 1, 2, 3
KIND_NAMES = {STARTED: "STARTED", DRAFTS: "DRAFTS", ERROR: "ERROR"}
HEADER_WORDS = 8
FLAG_MARGINS, FLAG_SAMPLED = 1, 2  # a DRAFTS header's flags
Q_WORDS = wire.SAMPLED_TOP + wire.SAMPLED_TOP // 2  # a drafted position's q_ids and q_weights, in int32 words
_VARIABLE = {v.field: v.name for v in TABLE if v.field}  # a config field -> the variable that sets it
_SIMPLE = (str, int, float, bool, type(None))  # what an ERROR record carries as it is
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

    def launch(self, spec: Spec, n: int, launch: Callable) -> Launched:
        """Rank 0: ``launch(out, status)`` into a record, then its broadcast (:mod:`.tp_launch`)."""
        if self._leader is None:
            layout = RecordLayout(spec.max_slots, spec.num_spec, spec.sampled)
            self._leader = Leader(self, layout, torch.device("cuda", torch.cuda.current_device()))
        return self._leader.launch(n, launch)

    def broadcast_record(self, record: torch.Tensor) -> None:
        """One launch() record from group rank 0, in place, on the record's own device."""
        self._dist.broadcast(record, src=self._src, group=self.group)

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
        body: torch.Tensor | None = None,
    ) -> None:
        self._broadcast(torch.tensor([kind, n, k, outcome, source, resync_all, n_resync, flags], dtype=torch.int64))
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
        header = self._broadcast(torch.zeros(HEADER_WORDS, dtype=torch.int64)).tolist()
        kind, n, k, _, _, _, n_resync, flags = header
        body = None
        if kind == ERROR:
            body = self._broadcast(torch.empty(n, dtype=torch.uint8))
            raise error_from_record(body.cpu().numpy().tobytes(), self.rank)
        if kind == DRAFTS:
            body = torch.empty(drafts_body_words(n, k, n_resync, flags), dtype=torch.int32)
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
    bad batch, a local drafter's error) reaches every rank. Without a group, or on
    another rank, the call is unchanged."""

    @functools.wraps(method)
    def wrapper(engine, *args, **kwargs):
        ranks = engine._ranks
        if ranks is None or not ranks.leader:
            return method(engine, *args, **kwargs)
        return ranks.lead(method, engine, *args, **kwargs)

    return wrapper


def drafts_body_words(n: int, k: int, n_resync: int, flags: int) -> int:
    """The int32 words of a DRAFTS record's body of ``n`` entries of ``num_spec`` ``k``."""
    per_position = 1 + (flags & FLAG_MARGINS) + (Q_WORDS if flags & FLAG_SAMPLED else 0)
    return n * k * per_position + n + n_resync


def drafts_record(d: Drafts) -> tuple[list[int], torch.Tensor]:
    """``d`` as a DRAFTS record: the header's 8 values and the int32 body (on the CPU),
    one concatenation; q_weights' uint16 pairs are viewed as int32 words, not widened."""
    n, k = d.tokens.shape
    parts = [d.tokens.reshape(-1), d.counts.reshape(-1), torch.tensor(d.resync, dtype=torch.int32)]
    flags = 0
    if d.margins is not None:
        flags |= FLAG_MARGINS
        parts.append(d.margins.to(torch.float32).reshape(-1).view(torch.int32))
    if d.q_ids is not None:
        flags |= FLAG_SAMPLED
        parts.append(d.q_ids.reshape(-1))
        parts.append(d.q_weights.to("cpu", torch.uint16).contiguous().reshape(-1).view(torch.int32))
    body = torch.cat([p.to("cpu", torch.int32) for p in parts])
    header = [DRAFTS, n, k, int(d.outcome), SOURCES.index(d.source), int(d.resync_all), len(d.resync), flags]
    return header, body


def drafts_from_record(header: list[int], body: torch.Tensor | None) -> Drafts:
    """The ``Drafts`` a DRAFTS record carries (views of the body, brought to the CPU once).

    Raises:
        ValueError: a body of another length than the header sizes.
    """
    _, n, k, outcome, source, resync_all, n_resync, flags = header
    words = drafts_body_words(n, k, n_resync, flags)
    body = torch.zeros(0, dtype=torch.int32) if body is None else body.cpu()
    if body.numel() != words:
        raise ValueError(f"a DRAFTS record of {body.numel()} words, its header sizes {words}")
    nk, top = n * k, wire.SAMPLED_TOP
    tokens, counts = body[:nk].view(n, k), body[nk : nk + n]
    at = nk + n + n_resync
    resync = tuple(body[nk + n : at].tolist())
    margins = q_ids = q_weights = None
    if flags & FLAG_MARGINS:
        margins, at = body[at : at + nk].view(torch.float32).view(n, k), at + nk
    if flags & FLAG_SAMPLED:
        q_ids = body[at : at + nk * top].view(n, k, top)
        q_weights = body[at + nk * top :].view(torch.uint16).view(n, k, top)
    return Drafts(
        tokens, counts, margins, SOURCES[source], Outcome(outcome), resync, bool(resync_all), q_ids, q_weights
    )


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


def error_record(e: BaseException) -> bytes:
    """``e`` as an ERROR record's body: its class's path, its arguments (as they are when
    they are simple values, else its message), its simple public attributes."""
    cls = type(e)
    args = list(e.args) if all(isinstance(a, _SIMPLE) for a in e.args) else [str(e)]
    attrs = {k: v for k, v in vars(e).items() if not k.startswith("_") and isinstance(v, _SIMPLE)}
    return json.dumps(
        {"type": f"{cls.__module__}:{cls.__qualname__}", "args": args, "attrs": attrs, "message": str(e)}
    ).encode()


def error_from_record(raw: bytes, rank: int) -> BaseException:
    """The exception an ERROR record describes, of the same class when this process has
    loaded it (nothing is imported for it), else a RuntimeError naming the class."""
    doc = json.loads(raw)
    module, _, qualname = doc["type"].partition(":")
    cls = sys.modules.get(module)
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    args = tuple(doc["args"])
    exc: BaseException | None = None
    if isinstance(cls, type) and issubclass(cls, BaseException):
        try:
            exc = cls(*args)
        except Exception:  # a constructor that takes other arguments (Refused(code, reason))
            try:
                exc = cls.__new__(cls)
                exc.args = args
            except Exception:
                exc = None
        for key, value in doc["attrs"].items() if exc is not None else ():
            try:
                setattr(exc, key, value)
            except (AttributeError, TypeError):
                pass
    if exc is None:
        exc = RuntimeError(f"{module}.{qualname}: {doc['message']}")
    exc.add_note(f"raised on rank 0 of the tp_group; broadcast to rank {rank}")
    return exc

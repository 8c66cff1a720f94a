"""The drafter's own thread: every engine's rounds queue, and whenever the drafter is free
it drafts what is queued, in one call where it can (continuous batching).

A connection thread decodes its ROUND and advances its windows, then hands the round's
:class:`~remote_dspark.drafter.contract.DraftBatch` to :meth:`Scheduler.draft` and waits
for its part of the answer; it sends its reply itself, as soon as that part is done. No
round waits for a partner: the drafter thread takes whatever is queued the moment it is
free, and a round arriving while it drafts goes in the next call.

What one call takes (:meth:`Scheduler._take`): ``max_entries`` entries and
``max_tokens`` tokens at most (caps), and a time budget, shared between the queued
engines by :class:`~.fair.FairShare`, the one owner of the fair share and of the budget
(deficit round robin on predicted drafter seconds, credit that cannot be hoarded; a call
about as long as the rounds ready to draft take, at most ``call_share`` of the tightest
deadline queued). What the drafter costs is :class:`~.cost.DrafterCost`'s, learnt from
every call (its shape and seconds); before the first call shares are in tokens. What it
guarantees, in its words: a round ready to draft of a session with nothing else queued,
of at most ``max_entries // n`` entries (``n`` sessions queued), is drafted whole in the
next call taken after it is queued, whatever the other sessions queue. A bigger round
is drafted in pieces of consecutive entries, and answered when its last piece is
drafted. An entry larger than the whole call is encoded in pieces, a call each, when its
drafter keeps its streams' state (:class:`~.batching.Charge`), else taken alone when
nothing else is (it would never fit otherwise).

Deadlines: a ROUND carries its deadline (``deadline_ms``, relative to its receipt; 0:
none). A round is never drafted once its deadline has passed: it is answered at once
with the drafts of its pieces drafted, or none (:meth:`Scheduler.draft` returns None;
the worker counts it) rather than drafted for an engine that stopped waiting; its
windows advanced already, so the stream stays in step. Nor is it given more of a call
than the cost model says the drafter can draft before its deadline, but a round none of
which is drafted yet gets at least one entry while its deadline is ahead (the model is
learnt from calls: a model that refused every round would never be corrected). This is
checked when the call is taken, and again just before each drafter call of a call made
in several (the groups drafted before it may outlast a deadline).

Rounds from a hub (:mod:`.hub`, the ``source``; :mod:`.idle`): the drafter thread takes them itself
(waiting in C, the interpreter lock released); when it is free, nothing is queued and
together they are what a lone round drafted at once must be (:meth:`FairShare.alone`),
they are one call, gathered and answered in C; else each becomes a job, ended by its
``deliver`` (its reply, sent by the hub) once the lock is released.

Idle time (:mod:`.idle`): a drafter that pre-drafts (the contract's ``predraft``) is
called by the drafter thread whenever it is free and nothing is queued, once after every
call and again while its last pre-draft made outcomes (one that made none is not repeated
until another call ends); a pre-drafting call is a call like any other
(``_busy``), so a round arriving meanwhile waits for that one call, never for more, and
pre-drafting never takes a queued round's place.

Who makes a call: the drafter thread, or, when a round arrives to find the drafter free
and nothing else queued, the connection's own thread, at once (no hand-off between
threads on an idle worker: the round's latency is the drafter's). That thread goes on
making calls, taken as the drafter thread would take them, until its own round is
answered (a round drafted in pieces needs no hand-off per piece), then leaves what is
still queued to the drafter thread. Either way one call at a time (``_busy``). A round
that finds the drafter free and nothing queued, and fits a call whole, is that call:
it never enters the queue (the common round of a lone engine costs no queue, no turn and
no wake-up on top of its drafting). A round's own state is one value (:mod:`.jobs`:
Pending, then Answered or Failed), changed under the scheduler's lock only.

Several rounds in one call: when the drafter takes batches of several sessions
(``mixed_sessions``, :func:`~remote_dspark.drafter.contract.mixed_sessions_of`), the
rounds taken together with the same width, row size and kind (greedy or sampled) are
concatenated (:func:`~.batching.merge`: a session per entry, margins if any asks) and
the answer split back (:func:`~.batching.part`), each round getting exactly what it would
get alone. Such calls are made narrowest first, and each call's rounds are answered as
soon as it returns: a round of 5 drafts never rides in, nor waits for, a call of 64 draft
steps taken with it, so one engine's width does not decide another's latency. Any other
drafter is called once per round, in the same fair order.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable

from .. import wire
from ..drafter.answer import check_result
from ..drafter.contract import DraftBatch, DraftResult, empty_result, mixed_sessions_of, predrafts_of
from .batching import Charge, gather, merge, part
from .cost import DrafterCost
from .fair import DEFAULT_CALL_SHARE, FairShare
from .idle import IdleAndHub
from .jobs import Answered, Failed, Job, Pending, Piece

log = logging.getLogger("remote_dspark.worker")

WAIT_SLACK_S = 60.0  # how long past its deadline a connection waits for a drafting call before giving up
DEFAULT_MAX_ENTRIES = 1024  # a call's budget: entries (--max-batch-entries) of a drafter that reserves memory ...
DEFAULT_MAX_TOKENS = 1 << 15  # ... and tokens: contexts plus drafts (--max-batch-tokens)


class Scheduler(IdleAndHub):
    """The drafter thread and its queue (module docstring). Owned by the worker:
    :meth:`start` once, :meth:`stop` at the end; :meth:`draft` from any connection thread.

    ``on_call(seconds, rounds, entries, tokens, waits, pieces, piece_tokens, cpu_seconds)``
    is told of each drafter call (the worker's statistics): its duration, the pieces of
    rounds, entries and budget tokens it drafted, each round's wait in the queue, the
    pieces of an over-budget entry's encode and their tokens, and the drafter's own host
    CPU on the calling thread (``time.thread_time`` around ``draft_batch`` and
    ``encodes``; the drafter's own threads, such as torch's, are not in it). ``clock``
    dates deadlines and the drafter's seconds (a test's clock the drafter moves makes both
    deterministic). ``max_tokens`` None: derived at :meth:`reserve` from the device's
    memory (at most ``DEFAULT_MAX_TOKENS``; that for a drafter that cannot say).
    ``max_entries`` None: ``DEFAULT_MAX_ENTRIES`` for a drafter that reserves working
    memory for a call (``reserve``), else the wire's ``MAX_ENTRIES``. ``batching=False``:
    one round (or piece) a call even for a drafter that mixes sessions (``bench
    worker-engines``' serialized rows). ``call_share``: the ceiling of a call's time, a
    fraction of the tightest deadline queued (``--call-deadline-share``). ``source``: a
    hub (:class:`~.hub.Hub`) whose ready rounds the drafter thread takes itself."""

    def __init__(
        self,
        drafter,
        *,
        max_entries: int | None,
        max_tokens: int | None,
        on_call: Callable[[float, int, int, int, list[float], int, int, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        batching: bool = True,
        call_share: float = DEFAULT_CALL_SHARE,
        source=None,
    ):
        if (max_entries is not None and max_entries < 1) or (max_tokens is not None and max_tokens < 1):
            raise ValueError(f"max_entries {max_entries}, max_tokens {max_tokens}: must be >= 1")
        if max_entries is None:
            max_entries = DEFAULT_MAX_ENTRIES if callable(getattr(drafter, "reserve", None)) else wire.MAX_ENTRIES
        self.derived = max_tokens is None  # the drafter derives it at reserve(), up to the default
        self.drafter, self.max_entries = drafter, max_entries
        self.max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        self.mixed = batching and mixed_sessions_of(drafter)
        self.predrafts = predrafts_of(drafter)  # it pre-drafts in idle time: woken after every call
        self.charge = Charge(drafter)  # what an entry costs in a call
        self.on_call, self.clock, self.source = on_call, clock, source
        self._cond = threading.Condition()
        self.cost = DrafterCost()  # what the drafter costs by a call's shape, learnt from every call
        self._fair = FairShare(self.charge, self.cost, call_share)  # the queued rounds, each call's share
        # Invariants, under _cond: a job in a queue is Pending or done (a done one is
        # dropped when reached); _busy is True while one thread makes a call, which it
        # alone may then take pieces for and gather into.
        self._busy = False  # a call is being made (by the drafter thread or a connection's)
        self._due = False  # pre-drafting is due: a call ended, or the last pre-draft made outcomes
        self._stopping = False
        self._outbox: list[Job] = []  # ended jobs with a ``deliver``, to call outside the lock
        self._thread = threading.Thread(target=self._loop, name="drafter", daemon=True)

    def reserve(self) -> None:
        """The drafter's working memory for a call at the budget, allocated now (its
        optional ``reserve(max_entries, max_tokens, derive=...)``, which returns the token
        budget: derived from the device's memory when the worker was given none).

        Raises: ValueError naming the budget's flags when it does not fit."""
        reserve = getattr(self.drafter, "reserve", None)
        if callable(reserve):
            try:
                self.max_tokens = int(reserve(self.max_entries, self.max_tokens, derive=self.derived))
            except ValueError as e:
                tokens = "" if self.derived else f", --max-batch-tokens {self.max_tokens}"
                raise ValueError(f"--max-batch-entries {self.max_entries}{tokens}: {e}") from e

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking rounds; those still queued are answered with an error."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self.source is not None:
            self.source.poke()
        self._thread.join(timeout_s)
        stopping = RuntimeError("the worker is stopping")
        with self._cond:
            for job in self._fair.clear():
                self._end(job, Failed(stopping))
        self._deliver()
        if self.source is not None and not self._thread.is_alive():  # ready after its last look
            self.source.fail(self.source.ready(0.0), stopping)

    def alive(self) -> bool:  # the drafter thread runs (a call may be in flight)
        return self._thread.is_alive()

    def queued(self) -> int:
        """Rounds waiting for the drafter: queued here, and ready in the source."""
        with self._cond:
            return self._fair.queued() + (self.source.waiting() if self.source is not None else 0)

    def draft(self, session: int, batch: DraftBatch, deadline: float = math.inf) -> DraftResult | None:
        """``batch``'s drafts (checked against the contract), or None when its
        ``deadline`` (the clock's seconds) passed before the drafter reached it.

        Raises: what the drafter raised for the call this round was in; RuntimeError when
        the worker stops, or no call answers within ``WAIT_SLACK_S`` past the deadline."""
        if not len(batch):  # nothing to draft (it would never be taken)
            return empty_result(0, batch.width, batch.want_margin)
        job = Job(session, batch, deadline, None, self.clock())
        with self._cond:
            if self._stopping:
                raise RuntimeError("the worker is stopping")
            lead = not self._busy  # the drafter is free: this thread makes the call itself
            if lead:  # the drafter between calls: what it would encode is what the call finds
                self._fair.costs(job)
            # ... and nothing queued, the round within a call's budget and its deadline
            # ahead: what _take would make its call of, drafted without the queue.
            alone = (
                lead
                and not self._fair
                and self._whole(job)
                and self._fair.alone(job, job.queued, self.max_entries, self.max_tokens)
            )
            if lead:
                self._busy = True
            if alone:
                job.state, taken_at = Pending(len(batch)), job.queued  # taken whole, at once (never queued)
            else:
                self._fair.add(job)
                if lead:
                    pieces, late, taken_at = self._take()
        if alone:  # never queued: no other thread sees the job, its end is this return
            try:
                return self._draft([Piece(job, 0, batch, job.cost)], taken_at)[job]
            finally:
                self._free()
        if lead:
            self._run(pieces, late, taken_at, until=job)
        wait = None if math.isinf(deadline) else max(0.0, deadline - self.clock()) + WAIT_SLACK_S
        if not job.done.wait(wait):
            raise RuntimeError(f"no drafting call answered within {WAIT_SLACK_S:.0f} s past the round's deadline")
        return job.outcome()

    # ------------------------------------------------------------------ the drafter thread

    def _loop(self) -> None:
        while True:
            if self.source is not None:
                self._pull()
            elif self._predraft():
                continue
            with self._cond:
                while (not self._fair or self._busy) and not self._stopping and not self._due:
                    if self.source is not None:
                        break  # (its wait is the source's, in _pull)
                    self._cond.wait()
                if self._stopping:
                    return
                if not self._fair or self._busy:
                    continue  # (or pre-draft: a call ended)
                self._busy = True
                pieces, late, taken_at = self._take()
            self._run(pieces, late, taken_at)

    def _whole(self, job: Job) -> bool:
        """The round fits a call's budget whole."""
        return job.cost <= self.max_tokens and len(job.batch) <= self.max_entries

    def _run(self, pieces: list[Piece], late: list[Job], taken_at: float, until: Job | None = None) -> None:
        """One call's pieces drafted and its rounds answered, by whoever holds ``_busy``
        (the drafter thread, or a connection's thread that found the drafter free), which
        it gives back at the end, waking the drafter thread for what queued meanwhile.
        ``until``: a connection's thread keeps making calls (what is queued, taken as the
        drafter thread would) until its own round is answered, so a round drafted in
        pieces never waits for a hand-off between threads at each piece."""
        try:
            self._draft_pieces(pieces, late, taken_at)
            while until is not None and not until.done.is_set():
                with self._cond:
                    if self._stopping or not self._fair:
                        break
                    pieces, late, taken_at = self._take()
                self._draft_pieces(pieces, late, taken_at)
        finally:
            self._free()

    def _free(self, ended: bool = True) -> None:
        """The call's maker gives ``_busy`` back, waking the drafter thread for what
        queued meanwhile, or (``ended``: a call of rounds, or a pre-draft that made
        outcomes) to pre-draft."""
        with self._cond:
            self._busy = False
            self._due = self._due or (ended and self.predrafts)
            if not self._fair and not self._due:  # (else no wake-up)
                return
            self._cond.notify()
        if self.source is not None:
            self.source.poke()

    def _draft_pieces(self, pieces: list[Piece], late: list[Job], taken_at: float) -> None:
        """A call's drafter calls, each group's rounds answered as soon as it is drafted (a
        round never waits for a wider group of the same call)."""
        if late:
            with self._cond:
                for job in late:  # answered with the pieces drafted, or None: none was
                    if isinstance(job.state, Pending):
                        self._end(job, Answered(job.state.parts))
            self._deliver()
        if self.mixed:  # one call per width, row size and kind, the narrowest first
            groups = collections.defaultdict(list)
            for piece in pieces:
                groups[piece.batch.width, piece.batch.rows.shape[1], piece.batch.sampled].append(piece)
            calls = [groups[key] for key in sorted(groups)]
        else:
            calls = [[piece] for piece in pieces]
        for i, group in enumerate(calls):  # a round has one piece a call at most: its group holds it
            if i:  # the groups drafted before it may have outlasted a deadline: checked again
                group = self._in_time(group)
            if group:
                self._call(group, taken_at)
            self._deliver()  # each group's rounds answered as soon as it is drafted

    def _in_time(self, group: list[Piece]) -> list[Piece]:
        """The pieces of ``group`` the drafter can still draft before their round's
        deadline (the cost model's seconds); the others' rounds answered now with the pieces drafted."""
        now = self.clock()
        late = [p for p in group if p.job.deadline <= now + self.cost.seconds(len(p.batch), p.cost, p.batch.width)]
        if not late:
            return group
        with self._cond:
            for p in late:
                if isinstance(p.job.state, Pending):
                    self._end(p.job, Answered(p.job.state.parts))
        return [p for p in group if p not in late]

    def _take(self) -> tuple[list[Piece], list[Job], float]:
        """Under the lock: the pieces of one call (:mod:`.fair`'s share), the rounds that
        cannot be drafted before their deadline, and the clock when taken."""
        now = self.clock()
        pieces, late = self._fair.take(now, self.max_entries, self.max_tokens)
        return pieces, late, now

    def _call(self, pieces: list[Piece], taken_at: float) -> None:
        """One drafter call for ``pieces`` (one, or several of the same row size), its
        rounds' states moved on under the lock: answered (their last piece) or their parts
        gathered. Whatever fails in it (the merge, the drafter, its answer's check, the
        statistics, a split) fails every round of the call, each on its own connection,
        and never the thread making the call: the drafter thread lives on for the rounds
        still queued."""
        try:
            gathered = self._draft(pieces, taken_at)
        except BaseException as e:
            with self._cond:
                for piece in pieces:
                    self._end(piece.job, Failed(e))
            return
        with self._cond:
            for job, parts in gathered.items():
                state = job.state
                if not isinstance(state, Pending):  # ended meanwhile (the worker stopping)
                    continue
                if state.taken == len(job.batch):  # its last piece: answered now
                    self._end(job, Answered(parts))
                else:
                    job.state = state._replace(parts=parts)

    def _draft(self, pieces: list[Piece], taken_at: float) -> dict[Job, DraftResult]:
        """The drafter's call for ``pieces``, told to ``on_call``: each round's drafts
        gathered so far, with this call's pieces (its parts are this thread's while it
        makes the call: no lock to read them). Raises what the call raised."""
        batches = [p.drafted() for p in pieces]
        batch = batches[0] if len(pieces) == 1 else merge(batches)
        waits = [taken_at - p.job.queued for p in pieces if p.start == 0 and not p.after]
        encoding = [p.cost for p in pieces if p.partial]  # pieces of an over-budget entry's encode
        tokens = sum(p.cost for p in pieces)  # a call merges rounds of one width: their costs add up
        result = self._timed(batch, len(pieces), tokens, waits, len(encoding), sum(encoding))
        gathered: dict[Job, DraftResult] = {}  # a job may have several pieces in one call
        at = 0
        for p, piece in zip(pieces, batches, strict=True):
            job = p.job
            state = job.state
            so_far = gathered.get(job, state.parts if isinstance(state, Pending) else None)
            got = result if len(pieces) == 1 else part(result, at, piece)
            gathered[job] = so_far if p.partial else gather(so_far, len(job.batch), p.start, got)
            at += len(piece)
        return gathered

    def _timed(self, batch: DraftBatch, rounds: int, tokens: int, waits, pieces: int = 0, piece_tokens: int = 0):
        """The drafter's call for ``batch`` (``rounds`` pieces of rounds, ``tokens`` of the
        budget), its answer checked, its time learnt and told to ``on_call``. Raises what
        the call raised."""
        t0, c0, cpu0 = time.perf_counter(), self.clock(), time.thread_time()
        drafted = self.drafter.draft_batch(batch)
        cpu = time.thread_time() - cpu0  # the drafter's own host work (its result's check is the worker's) ...
        with self._cond:
            cpu += self.charge.take_cpu()  # ... and its encodes() since the last call
        result = check_result(drafted, batch)
        with self._cond:  # (read under the lock when calls are taken)
            self.cost.observe(len(batch), tokens, batch.width, self.clock() - c0)
        if self.on_call is not None:
            self.on_call(time.perf_counter() - t0, rounds, len(batch), tokens, waits, pieces, piece_tokens, cpu)
        return result

    def _end(self, job: Job, state: Answered | Failed) -> None:
        """Under the lock: ``job`` ended (:meth:`Job.end`); one with a ``deliver`` goes in
        the outbox for :meth:`_deliver`."""
        if job.end(state) and job.deliver is not None:
            self._outbox.append(job)

    def _deliver(self) -> None:
        """The ended jobs' ``deliver`` called, outside the lock (their replies)."""
        with self._cond:
            if not self._outbox:
                return
            out, self._outbox = self._outbox, []
        for job in out:
            try:
                job.deliver(job)
            except Exception:  # one round's reply never stops the drafter thread
                log.exception("delivering a round's drafts failed")

"""The drafter thread's work beside the queue (:class:`~.scheduler.Scheduler`'s, a part
of it kept here): the rounds a hub has ready (:meth:`IdleAndHub._pull`, drafted in one
call where they fit: :meth:`IdleAndHub._whole_call`), and pre-drafting when nothing is
queued (:meth:`IdleAndHub._predraft`: the drafter's optional ``predraft``, one call at a
time like every other, so a round that arrives meanwhile waits for that call only, and
that call is sized by the cost model to about the recent calls' usual length).

The state used here is the scheduler's (its lock, ``_busy``, its queue), under its rules.
"""

from __future__ import annotations

import logging

from .jobs import Job

log = logging.getLogger("remote_dspark.worker")

IDLE_WAIT_S = 1.0  # the drafter thread's longest wait in its source before it looks at its own state again


class IdleAndHub:
    """The hub's rounds and pre-drafting, for :class:`~.scheduler.Scheduler` (its base)."""

    def _pull(self) -> None:
        """The source's ready rounds (waited for up to ``IDLE_WAIT_S`` when nothing else is
        queued): one call of them all (:meth:`_whole_call`), else queued as jobs."""
        with self._cond:
            idle = not self._fair or self._busy
        ready = self.source.ready(0.0)
        if not len(ready) and idle:
            if self._predraft():
                return
            ready = self.source.ready(IDLE_WAIT_S)
        if not len(ready):
            return
        if self.mixed or len(ready) == 1:
            try:
                if self._whole_call(ready):
                    return
            except Exception:  # (a fault before drafting, the rounds untouched: the jobs' way answers them)
                log.exception("a call of whole rounds failed before drafting; its rounds are queued")
        jobs = self.source.jobs(ready)
        if jobs:
            with self._cond:
                for job in jobs:
                    self._fair.add(job)

    def _predraft_entries(self) -> int:
        """A pre-drafting call's entries: within the caps, and within what the recent
        calls took (:meth:`~.cost.DrafterCost.typical`), so that a round arriving during it
        waits about one usual call; at least one."""
        seconds, width = self.cost.typical()
        if not seconds:
            return self.max_entries
        return max(1, min(self.max_entries, self.cost.entries_within(seconds, width)))

    def _whole_call(self, ready) -> bool:
        """The source's ``ready`` rounds drafted in one call, their replies written and sent
        by the source (no job, turn or merge): when the drafter is free, nothing else is
        queued, and together they are what a lone round drafted at once must be
        (:meth:`FairShare.alone`: both caps, the time budget, the tightest deadline).
        False (nothing drafted) otherwise: the caller queues them as jobs."""
        got = self.source.gather(ready, self.max_entries)
        if got is None:
            return False
        batch, received, deadlines = got
        if not len(batch):  # every slot to re-announce, or nothing asked: answered now
            self.source.answer(ready, None)
            return True
        now = self.clock()
        together = Job(-1, batch, float(deadlines.min()), None, now)  # (never queued: the fair share's measure)
        with self._cond:
            tokens = 0 if self._busy or self._fair or self._stopping else int(self._fair.costs(together).sum())
            fits = 0 < tokens <= self.max_tokens and len(batch) <= self.max_entries
            if not fits or not self._fair.alone(together, now, self.max_entries, self.max_tokens):
                return False
            self._busy = True
        try:
            result = self._timed(batch, len(ready), tokens, (now - received).tolist())
        except BaseException as e:
            self.source.fail(ready, e)  # (each round's connection ends)
            return True
        finally:
            self._free()
        self.source.answer(ready, result)  # (never raises: its rounds are answered, or failed)
        return True

    def _predraft(self) -> bool:
        """One call of the drafter's pre-drafting (its ``predraft``) when it is due (a call
        ended, or the last pre-draft made some: ``_due``), the drafter is free and no round
        is queued: a round arriving meanwhile waits for this call only. Whether it
        pre-drafted any outcome (then it is due again; False: the thread may wait, and
        looks again only once another call ends)."""
        with self._cond:
            due, self._due = self._due, False
            if not due or not self.predrafts or self._busy or self._fair or self._stopping:
                return False  # (busy or queued: that call's end makes it due again)
            self._busy = True
        made = False
        try:
            made = self.drafter.predraft(self._predraft_entries(), self.max_tokens) > 0
        except Exception:  # (a failed pre-draft costs its outcomes, never a round)
            log.exception("pre-drafting failed")
        finally:
            self._free(ended=made)
        return made

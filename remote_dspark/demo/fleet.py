"""A fleet of reference workers on loopback, and what ``remote-dspark chaos --workers N``
adds with one: worker kills and stalls aimed at the engine's active worker, and the
checks on the failovers they cause.

:class:`WorkerFleet` runs worker ``i`` on 127.0.0.(i+1) (each its own port; Linux
routes all of 127/8 to loopback), the engine's endpoint their list. In a chaos fleet
each worker signs its drafts (:mod:`.tagged`), so a round's drafts say who made them.

:class:`FleetWatch` sees every round of the run with the link as the engine's stats
showed it after the round (its active worker's address and incarnation, the
connections made active so far, failovers), and checks:

- **no drafts from a fenced session**: a round's drafts carry the tag of the worker
  that was active around it. The window of round r is from the link read after round
  r-1 to the one after round r: a switch inside it allows either end's worker; a worker
  the engine left (after a stall, it wakes up and answers) is at neither end of any
  later window, so one of its drafts delivered is a tag that fails. Exact, and a dict
  look-up a round.
- **every worker failover counted**: a kill or stall of the active worker shows up in
  ``link.failovers`` (lost or stall) by the first ok round after it;
- **the target-only rounds of each failover bounded**: the rounds from the fault to the
  first ok round, at most 1 for a kill and ``STALL_ROUNDS`` + 1 for a stall. The
  bound holds where the fault found a steady engine (the last round ok, a spare ready,
  no other fault under way): a worker fault waits up to ``STEADY_WAIT_S`` for one, and
  one that lands without is counted, not bounded.
"""

from __future__ import annotations

import signal
import statistics
from dataclasses import dataclass, field

from ..transport.link import STALL_ROUNDS
from .harness import WorkerProcess

WORKER_FAULTS = ("kill_worker", "stall_worker")
BOUND = {"kill": 1, "stall": STALL_ROUNDS + 1}  # target-only rounds of one failover, a spare ready
STEADY_WAIT_S = 2.0  # the longest a worker fault waits for a steady engine


class WorkerFleet:
    """``n`` reference workers, worker ``i`` on 127.0.0.(i+1) (``tagged``: signing its
    drafts, :mod:`.tagged`; ``chaos=False``: without ``--chaos``, so each serves its
    rounds on its default path, the C hub or lane, where faults come only as signals);
    :meth:`stop` ends them all. Raises as WorkerProcess (the workers started so far
    stopped first)."""

    def __init__(
        self, n: int, *, late_ms: int = 200, extra: tuple[str, ...] = (), tagged: bool = False, chaos: bool = True
    ):
        from .tagged import MAX_WORKERS

        if not 1 <= n <= MAX_WORKERS:
            raise ValueError(f"workers {n}: not in 1..{MAX_WORKERS}")
        self.workers: list[WorkerProcess] = []
        try:
            for i in range(n):
                sign = ("--drafter", f"remote_dspark.demo.tagged:worker_{i}") if tagged else ()
                self.workers.append(
                    WorkerProcess(host=f"127.0.0.{i + 1}", late_ms=late_ms, extra=(*extra, *sign), chaos=chaos)
                )
        except BaseException:
            self.stop()
            raise

    @property
    def endpoint(self) -> str:
        return "tcp://" + ",".join(f"{w.host}:{w.port}" for w in self.workers)

    def env(self, mode=None, **variables: str) -> dict[str, str]:
        """An engine environment for the whole fleet (:meth:`WorkerProcess.env`)."""
        return self.workers[0].env(mode, **variables) | {"VLLM_DSPARK_REMOTE": self.endpoint}

    def index(self, address: str) -> int | None:
        """The worker at ``address`` ("ip:port"), None for none of them."""
        return next((i for i, w in enumerate(self.workers) if f"{w.host}:{w.port}" == address), None)

    def at(self, address: str) -> WorkerProcess | None:
        i = self.index(address)
        return None if i is None else self.workers[i]

    def revive(self, worker: WorkerProcess) -> None:
        """Start ``worker`` again on its address if it is down (a timer's call)."""
        with worker._lock:
            if worker.proc is None or worker.proc.poll() is not None:
                worker.start()

    def stop(self) -> None:
        for w in self.workers:
            w.signal(signal.SIGCONT)  # a stopped worker could not end on SIGTERM
            w.stop()

    def running(self) -> list[int]:
        """The pids of workers whose process has not ended (and been reaped)."""
        return [w.proc.pid for w in self.workers if w.proc is not None and w.proc.returncode is None]


@dataclass
class WorkerFault:
    kind: str  # "kill" or "stall"
    step: int  # rounds done when it landed
    steady: bool  # it found a steady engine (its bound applies)
    failovers: int  # link.failovers lost + stall then


@dataclass
class FleetWatch:
    fleet: WorkerFleet
    faults: list[WorkerFault] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)  # round r was ok
    failovers: list[int] = field(default_factory=list)  # lost + stall after round r
    checked: int = 0  # rounds whose drafts were checked (ok, some drafted)
    wrong: list[str] = field(default_factory=list)  # rounds with a foreign worker's drafts
    link: object = None  # the link after the last round
    _key: tuple = ("", 0, 0)
    _waiting_since: float | None = None

    def observe(self, out, link) -> None:
        """Round ``len(self.ok)`` returned ``out`` (Drafts); ``link``: LinkStats after it."""
        from ..outcome import Outcome
        from .tagged import tag_of, tags_of

        key = (link.worker, link.incarnation, link.reconnects)
        ok = out.outcome is Outcome.OK
        tags = tags_of(out.tokens.numpy(), out.counts.numpy()) if ok else ()
        if len(tags):
            self.checked += 1
            ends = (self.fleet.index(self._key[0]), self.fleet.index(link.worker))
            allowed = {tag_of(i) for i in ends if i is not None}
            foreign = sorted(set(tags.tolist()) - allowed)
            if foreign and len(self.wrong) < 5:
                self.wrong.append(f"round {len(self.ok)}: tags {foreign}, active {self._key[0]!r} -> {link.worker!r}")
            elif foreign:
                self.wrong.append("")
        self._key, self.link = key, link
        self.ok.append(ok)
        self.failovers.append(link.failovers["lost"] + link.failovers["stall"])

    def steady(self, timers: list) -> bool:
        link = self.link
        return (
            link is not None
            and bool(self.ok)
            and self.ok[-1]
            and link.spare
            and self.fleet.at(link.worker) is not None
            and not any(t.is_alive() for t in timers)
        )

    def ready(self, timers: list, now: float) -> tuple[bool, bool]:
        """(go, steady) for a worker fault due ``now``: go once the engine is steady, or
        after STEADY_WAIT_S of waiting for it."""
        if self._waiting_since is None:
            self._waiting_since = now
        steady = self.steady(timers)
        go = steady or now - self._waiting_since >= STEADY_WAIT_S
        if go:
            self._waiting_since = None
        return go, steady

    def inject(self, fault: str, steady: bool, rng, timers: list, later) -> WorkerProcess | None:
        """``fault`` (kill_worker, stall_worker, restart_worker) on the active worker;
        its restart or SIGCONT scheduled with ``later(delay, fn)``. Returns the worker hit."""
        worker = self.fleet.at(self.link.worker) if self.link is not None else None
        if worker is None:
            return None
        kind = "stall" if fault == "stall_worker" else "kill"
        self.faults.append(WorkerFault(kind, len(self.ok), steady, self.failovers[-1] if self.failovers else 0))
        if fault == "restart_worker":
            worker.restart()
        elif fault == "kill_worker":
            worker.kill()
            timers.append(later(rng.uniform(0.3, 1.0), self.fleet.revive, worker))
        else:
            worker.signal(signal.SIGSTOP)
            timers.append(later(rng.uniform(0.3, 1.0), worker.signal, signal.SIGCONT))
        return worker

    def _after(self, f: WorkerFault) -> tuple[int | None, bool]:
        """(target-only rounds from ``f`` to the first ok round, None if none came;
        whether a failover was counted by then)."""
        first = next((r for r in range(f.step, len(self.ok)) if self.ok[r]), None)
        if first is None:
            return None, False
        return first - f.step, max(self.failovers[f.step : first + 1]) > f.failovers

    def checks(self, stats, ran: list[int]) -> list[tuple[str, bool, str]]:
        """The fleet's checks, (name, ok, detail) each; ``ran``: worker pids left running."""
        after = [(f, *self._after(f)) for f in self.faults]
        fo = stats.link.failovers
        counted = [f for f, _, seen in after if not seen]
        bounded = {k: [n for f, n, _ in after if f.kind == k and f.steady] for k in BOUND}
        over = [(f.kind, n) for f, n, _ in after if f.steady and (n is None or n > BOUND[f.kind])]
        figures = "; ".join(
            f"{k} {len(v)} steady: worst {max((n for n in v if n is not None), default=0)}, mean "
            f"{statistics.fmean([n for n in v if n is not None] or [0]):.2f} (bound {BOUND[k]})"
            for k, v in bounded.items()
        )
        unsteady = sum(not f.steady for f in self.faults)
        kinds = {k: sum(f.kind == k for f in self.faults) for k in BOUND}
        return [
            (
                "every worker failover counted",
                bool(self.faults) and not counted,
                f"{kinds['kill']} kills, {kinds['stall']} stalls of the active worker, {len(counted)} not "
                f"counted; failovers lost {fo['lost']}, stall {fo['stall']}, protocol {fo['protocol']}",
            ),
            (
                "target-only rounds per worker failover within the bound",
                not over and all(bounded.values()),
                f"{figures}; {unsteady} without a steady engine (not bounded); over the bound {over}",
            ),
            (
                "no drafts from a fenced session",
                not self.wrong and self.checked > 0,
                f"{self.checked} rounds' drafts from the active worker; {len(self.wrong)} not "
                f"{[w for w in self.wrong if w]}; fenced {stats.link.fenced}, late {stats.link.late}",
            ),
            ("every worker process ended", not ran, f"running {ran}" if ran else "all ended and reaped"),
        ]

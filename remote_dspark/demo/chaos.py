"""``remote-dspark chaos``: a bounded chaos run against the demo engine, with checks.

The engine (process mode) drafts continuously while faults land at random times, in
cycles that each contain every fault once: SIGKILL the proxy; SIGSTOP it (a stall) and
SIGCONT it later; kill and restart the worker; make the worker answer after the
deadline for a while; send the worker garbage frames and make it send garbage replies.
With ``--workers N`` (2 or more) the engine's endpoint is a fleet of N workers on
127.0.0.1..N, and each cycle also SIGKILLs the active worker (restarted on its address
later) and SIGSTOPs it (SIGCONT later); the worker faults above hit the active worker.
Between cycles the run goes quiet for longer than ``RESPAWN_RESET_S``, so the budget's
reset window is exercised. At the end it checks, and prints:

  * every gathered round was released exactly once (the releases of the proxy, the
    watchdog, the no-proxy path and the orphan path add up to the rounds launched, and
    the ring ends with released == gathered);
  * no round waited longer than the watchdog deadline plus 10 ms;
  * respawns never exceeded the budget, and the budget came back after the reset window;
  * the engine's outcome counters add up to the rounds;
  * no zombie, no leaked fd or memfd;
  * the engine closed cleanly;
  * with a fleet: every kill or stall of the active worker counted as a failover, the
    target-only rounds of each within its bound (1 for a kill, 3 for a stall, where
    the fault found a spare ready), no drafts from a worker the engine had left, every
    worker process ended.

Exit status 0 only when every check holds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..progress import Progress

if TYPE_CHECKING:
    from ..engine import Stats

FAULTS = ("kill_proxy", "stall_proxy", "restart_worker", "late_worker", "garbage")
WAIT_SLACK_S = 0.010
ON_ACTIVE = ("restart_worker", "kill_worker", "stall_worker")  # with a fleet: the active worker's, tracked


def add_parser(sub) -> None:
    p = sub.add_parser(
        "chaos",
        help="kill, stall and garble the proxy and worker under load; check nothing is lost",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run (default 60)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: from the clock; printed)")
    p.add_argument("--slots", type=int, default=64, help="request slots (default 64)")
    p.add_argument("--respawns", type=int, default=4, help="respawn budget (default 4)")
    p.add_argument("--reset-s", type=int, default=2, help="VLLM_DSPARK_REMOTE_ASYNC_RESPAWN_RESET_S (default 2)")
    p.add_argument("--workers", type=int, default=1, help="workers in the fleet, 1 to 8 (default 1)")
    p.add_argument("--json", action="store_true", help="print the checks and counts as JSON")
    p.set_defaults(func=run)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class ChaosResult:
    seed: int
    rounds: int
    faults: dict[str, int]
    stats: Stats | None
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def run(args: argparse.Namespace) -> int:
    if args.seconds <= 0 or args.slots < 1 or args.respawns < 1 or args.reset_s < 1 or not 1 <= args.workers <= 8:
        raise ValueError("--seconds, --slots, --respawns and --reset-s must be positive, --workers in 1..8")
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    seed = args.seed if args.seed is not None else int(time.time())
    result = run_chaos(
        args.seconds,
        seed=seed,
        slots=args.slots,
        respawns=args.respawns,
        reset_s=args.reset_s,
        workers=args.workers,
        progress=True,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "seed": result.seed,
                    "rounds": result.rounds,
                    "faults": result.faults,
                    "ok": result.ok,
                    "checks": [c.__dict__ for c in result.checks],
                },
                indent=1,
            )
        )
    else:
        print(
            f"\nchaos: {result.rounds} rounds in {args.seconds:g} s, seed {seed}; faults: "
            + ", ".join(f"{k} {v}" for k, v in result.faults.items())
        )
        print("rounds: " + ", ".join(f"{o.label} {n}" for o, n in result.stats.rounds.items() if n))
        for c in result.checks:
            print(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    return 0 if result.ok else 1


def run_chaos(
    seconds: float,
    *,
    seed: int,
    slots: int = 64,
    respawns: int = 4,
    reset_s: int = 2,
    workers: int = 1,
    progress: bool = False,
) -> ChaosResult:
    from ..config.api import RemoteConfig
    from ..config.mode import Mode
    from ..engine import RemoteDSpark
    from .fleet import WORKER_FAULTS, FleetWatch, WorkerFleet
    from .harness import DemoEngine, worker_limits
    from .sim import SimEngine

    rng = random.Random(seed)
    fds_before = _fds()
    kinds = FAULTS + (WORKER_FAULTS if workers > 1 else ())
    faults = dict.fromkeys(kinds, 0)
    fleet = WorkerFleet(workers, late_ms=120, extra=worker_limits(slots, 64), tagged=workers > 1)
    watch = FleetWatch(fleet) if workers > 1 else None
    closed_cleanly = False
    engine = None
    try:
        env = fleet.env(
            Mode.PROCESS,
            VLLM_DSPARK_REMOTE_ASYNC_RESPAWNS=str(respawns),
            VLLM_DSPARK_REMOTE_ASYNC_RESPAWN_RESET_S=str(reset_s),
            VLLM_DSPARK_REMOTE_ASYNC_NAP_US="20",
            VLLM_DSPARK_REMOTE_BACKOFF_MS="50",
            VLLM_DSPARK_REMOTE_BACKOFF_MAX_MS="200",
            VLLM_DSPARK_REMOTE_TRIP="3",
            VLLM_DSPARK_REMOTE_COOLDOWN="16",
        )
        cfg = RemoteConfig.from_env(env)
        rd = RemoteDSpark(cfg, num_spec=5, max_slots=slots, row_bytes=64, environ=env).start()
        timers: list[threading.Timer] = []
        try:
            engine = DemoEngine(rd, SimEngine(slots, 5, seed=seed))
            _drive(engine, fleet, watch, _Plan(rng, reset_s, kinds), faults, timers, seconds, progress)
            for t in timers:
                t.join(2.0)
        finally:
            for t in timers:
                t.cancel()
            _cont(rd)
            rd.close()
            closed_cleanly = True
        stats = rd.stats()
    finally:
        fleet.stop()
    result = ChaosResult(seed, len(engine.steps) if engine else 0, faults, stats)
    result.checks = _checks(result, cfg, respawns, closed_cleanly, fds_before)
    if watch is not None:
        result.checks += [Check(*c) for c in watch.checks(stats, fleet.running())]
    return result


def _drive(engine, fleet, watch, plan, faults: dict, timers: list, seconds: float, progress: bool) -> None:
    """Rounds back to back for ``seconds``, the plan's faults landing between them. With a
    fleet (``watch``), every round is shown to the watch with the link after it, and a
    fault on the active worker waits (bounded) for a steady engine."""
    rd = engine.rd
    sup = rd.supervisor
    bar = Progress(int(seconds), "chaos seconds") if progress else None
    start = time.monotonic()
    while (now := time.monotonic()) - start < seconds:
        fault = plan.due(now)
        if fault is not None and watch is not None and fault in ON_ACTIVE:
            go, steady = watch.ready(timers, now)
            if not go:
                plan.defer(fault, now)
            elif watch.inject(fault, steady, plan.rng, timers, _later) is not None:
                faults[fault] += 1
        elif fault is not None:
            target = fleet.at(watch.link.worker) if watch is not None and watch.link is not None else None
            _inject(fault, sup, target or fleet.workers[0], plan.rng, timers)
            faults[fault] += 1
        out = engine.step()
        if watch is not None:
            watch.observe(out, rd.stats().link)
        if bar:
            bar.update(int(now - start), f"rounds {len(engine.steps)}")


class _Plan:
    """Cycles through every fault in a shuffled order, 0.3 to 1.0 s apart, then stays
    quiet for longer than the reset window, so the budget can come back."""

    def __init__(self, rng: random.Random, reset_s: int, kinds: tuple[str, ...] = FAULTS):
        self.rng = rng
        self.reset_s = reset_s
        self.kinds = kinds
        self.queue: list[str] = []
        self.next_at = time.monotonic() + 0.5

    def due(self, now: float) -> str | None:
        if now < self.next_at:
            return None
        if not self.queue:
            self.queue = list(self.kinds)
            self.rng.shuffle(self.queue)
        fault = self.queue.pop()
        self.next_at = now + (self.reset_s + 1.0 if not self.queue else self.rng.uniform(0.3, 1.0))
        return fault

    def defer(self, fault: str, now: float) -> None:
        """``fault`` waits: due again in 10 ms, the rest of the cycle after it."""
        self.queue.append(fault)
        self.next_at = now + 0.01


def _inject(fault: str, sup, worker, rng: random.Random, timers: list) -> None:
    up = sup.up
    if fault == "kill_proxy" and up:
        os.kill(up.pid, signal.SIGKILL)
    elif fault == "stall_proxy" and up:
        os.kill(up.pid, signal.SIGSTOP)
        timers.append(_later(rng.uniform(0.05, 0.4), _resume, up.pid))
    elif fault == "restart_worker":
        worker.restart()
    elif fault == "late_worker":
        worker.answer_late()
        timers.append(_later(rng.uniform(0.2, 0.6), worker.answer_late))
    elif fault == "garbage":
        worker.garble_next()
        _send_garbage(worker.host, worker.port, rng)


def _later(delay: float, fn, *args) -> threading.Timer:
    t = threading.Timer(delay, fn, args)
    t.daemon = True
    t.start()
    return t


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _cont(rd) -> None:
    """Never leave a stopped proxy behind (close must be able to end it)."""
    up = rd.supervisor.live if rd.supervisor is not None else None
    if up:
        _resume(up.pid)


def _send_garbage(host: str, port: int, rng: random.Random) -> None:
    """A connection that sends random bytes to the worker: it must drop just that one."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as s:
            s.sendall(rng.randbytes(512))
    except OSError:
        pass  # the worker may be restarting


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _memfds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                out.append(fd)
        except OSError:
            pass
    return out


def _zombies() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True) if p.status() == psutil.STATUS_ZOMBIE]


def _checks(res: ChaosResult, cfg, respawns: int, closed_cleanly: bool, fds_before: set[str]) -> list[Check]:
    st = res.stats
    total = st.total_rounds
    pc, ec = st.handoff.proxy_counters, st.handoff.engine_counters
    by_proxy = pc["rounds_ok"] + pc["rounds_timeout"] + pc["rounds_error"] + pc["rounds_breaker_skip"]
    releases = by_proxy + ec["watchdog_releases"] + ec["no_proxy_rounds"] + ec["orphan_releases"]
    ring = st.handoff
    sup = st.supervisor
    losses = sum(sup.restarts.values())
    respawned = sup.spawns - 1
    allowed = respawns * (1 + sup.budget_restored)
    limit = cfg.watchdog_ms / 1000 + WAIT_SLACK_S
    leaked = sorted(_fds() - fds_before)
    return [
        Check(
            "every round released exactly once",
            releases == total and ring.released == ring.gathered,
            f"{total} rounds; released by proxy {by_proxy}, watchdog {ec['watchdog_releases']}, no proxy "
            f"{ec['no_proxy_rounds']}, orphan {ec['orphan_releases']} (sum {releases}); ring released "
            f"{ring.released} gathered {ring.gathered}",
        ),
        Check(
            "no round waited past the watchdog + 10 ms",
            ring.max_wait_s <= limit,
            f"longest wait {ring.max_wait_s * 1e3:.1f} ms, limit {limit * 1e3:.0f} ms",
        ),
        Check(
            "respawns within the budget",
            respawned <= allowed and sup.budget_left >= 0 and respawned <= losses,
            f"{losses} proxies lost, {respawned} respawned, budget {respawns} restored {sup.budget_restored} times",
        ),
        Check(
            "the budget came back after the reset window",
            sup.budget_restored >= 1 or losses == 0,
            f"restored {sup.budget_restored} times, {sup.budget_left} left at the end",
        ),
        Check("outcome counters add up to the rounds", total == res.rounds, f"{res.rounds} steps, {total} counted"),
        Check(
            "no zombie, no leaked fd or memfd",
            not _zombies() and not leaked and not _memfds(),
            f"zombies {_zombies()}, leaked fds {leaked}, memfds {_memfds()}",
        ),
        Check("the engine closed cleanly", closed_cleanly, "close() returned" if closed_cleanly else "close() failed"),
    ]

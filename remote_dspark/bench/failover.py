"""``remote-dspark bench failover``: what an idle engine costs, and how long a lost or
stalled proxy keeps rounds target-only, with the warm standby and without, in one run.

Rows (process mode, defaults otherwise, against a loopback worker process):

- **idle**: CPU of the proxy process and of the engine process (its supervisor thread,
  its watchdog) over ``--idle-s`` seconds with no round, as a share of one core; and the
  first round after that idle gap (the sleeping proxy's wake-up included).
- **kill**: SIGKILL of the serving proxy, then rounds back to back until one is ``ok``:
  the time from the kill to that round's return. ``--kills`` times, standby on and off.
- **stall**: SIGSTOP of the serving proxy, the same measure (the stall verdict, the
  kill, the replacement). ``--stalls`` times, standby on and off; the stopped proxy is
  resumed (SIGCONT) once it has been killed, so nothing stays stopped.
- **frozen**: SIGSTOP of the ready standby, then SIGKILL of the serving proxy, the same
  measure (the standby found silent and killed, a fresh proxy's start). ``--frozen``
  times, standby on only.

With ``--workers N`` (2 or more) the worker rows follow (:mod:`.failover_workers`):
a worker SIGKILLed or SIGSTOPped under an engine whose link keeps a spare, and 8 engines
spread over the fleet.

Every row also says the respawn-budget units each fault cost (at most one each).

Each row waits for a new serving proxy (and, with the standby, a ready standby) before
its next fault, so every fault lands on a steady engine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field

GOAL_IDLE_CORE = 0.02  # idle CPU of the proxy and of the engine process
GOAL_KILL_P50_MS = 10.0  # SIGKILL -> first ok round, with the standby
GOAL_STALL_SLACK_MS = 20.0  # SIGSTOP -> first ok round within the watchdog + this
SETTLE_S = 10.0  # the most a row waits for a steady engine before a fault
ROUND_LIMIT_S = 10.0  # the most a measure waits for an ok round


@dataclass
class FailoverRow:
    name: str
    standby: bool
    samples_ms: list[float]
    respawns: list[int] = field(default_factory=list)  # respawn-budget units each fault cost

    @property
    def p50(self) -> float:
        s = sorted(self.samples_ms)
        return s[len(s) // 2] if s else float("nan")

    @property
    def worst(self) -> float:
        return max(self.samples_ms) if self.samples_ms else float("nan")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "failover",
        help="idle CPU, and SIGKILL / SIGSTOP of the proxy to the next ok round, with the warm standby and without",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--kills", type=int, default=10, help="SIGKILLs per row (default 10)")
    p.add_argument("--stalls", type=int, default=5, help="SIGSTOPs per row (default 5)")
    p.add_argument(
        "--frozen", type=int, default=3, help="SIGKILLs of the proxy with the standby SIGSTOPped (default 3)"
    )
    p.add_argument("--idle-s", type=float, default=3.0, help="the idle measure's length, seconds (default 3)")
    p.add_argument("--workers", type=int, default=1, help="workers for the worker rows, 2 or 3 (default 1: none)")
    p.add_argument("--worker-kills", type=int, default=10, help="SIGKILLs of the active worker (default 10)")
    p.add_argument("--worker-stalls", type=int, default=5, help="SIGSTOPs of the active worker (default 5)")
    p.add_argument("--rate", type=float, default=100.0, help="rounds a second in the worker rows (default 100)")
    p.add_argument("--slots", type=int, default=64, help="entries per round (default 64)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.kills < 1 or args.stalls < 0 or args.frozen < 0 or args.idle_s <= 0 or not 1 <= args.slots <= 4096:
        raise ValueError("--kills >= 1, --stalls >= 0, --frozen >= 0, --idle-s > 0 and --slots in 1..4096")
    if not 1 <= args.workers <= 8 or args.worker_kills < 0 or args.worker_stalls < 0 or not args.rate > 0:
        raise ValueError("--workers in 1..8, --worker-kills >= 0, --worker-stalls >= 0 and --rate > 0")
    from ..demo.harness import WorkerProcess

    worker = WorkerProcess()
    try:
        idle = measure_idle(worker, args.slots, args.idle_s)
        rows = []
        for standby in (True, False):
            rows.append(measure_faults(worker, args.slots, "kill", args.kills, standby))
            if args.stalls:
                rows.append(measure_faults(worker, args.slots, "stall", args.stalls, standby))
        if args.frozen:
            rows.append(measure_faults(worker, args.slots, "frozen", args.frozen, True))
    finally:
        worker.stop()
    report(idle, rows, worker_rows(args) if args.workers > 1 else [], args.json)
    return 0


def worker_rows(args: argparse.Namespace) -> list[dict]:
    from ..demo.fleet import WorkerFleet
    from ..demo.harness import worker_limits
    from . import failover_workers as fw

    # (no --chaos: the workers serve on their default path; the faults are signals)
    fleet = WorkerFleet(args.workers, extra=worker_limits(args.slots, 64), chaos=False)
    try:
        rows = [fw.measure_worker_faults(fleet, args.slots, "kill", args.worker_kills, args.rate)]
        if args.worker_stalls:
            rows.append(fw.measure_worker_faults(fleet, args.slots, "stall", args.worker_stalls, args.rate))
        rows.append(fw.measure_spread(fleet, args.slots))
    finally:
        fleet.stop()
    return rows


def _engine(worker, slots: int, standby: bool):
    from ..config.api import RemoteConfig
    from ..demo.harness import DemoEngine
    from ..demo.sim import SimEngine
    from ..engine import Mode, RemoteDSpark

    env = worker.env(
        Mode.PROCESS,
        VLLM_DSPARK_REMOTE_ASYNC_RESPAWNS="1000000",
        VLLM_DSPARK_REMOTE_ASYNC_STANDBY="1" if standby else "0",
    )
    rd = RemoteDSpark(RemoteConfig.from_env(env), num_spec=5, max_slots=slots, row_bytes=64, environ=env).start()
    return rd, DemoEngine(rd, SimEngine(slots, 5, seed=1))


def measure_idle(worker, slots: int, idle_s: float) -> dict:
    import psutil

    rd, engine = _engine(worker, slots, True)
    try:
        for _ in range(20):
            engine.step()
        _settle(rd, engine, standby=True)
        proxy, me = psutil.Process(rd.supervisor.up.pid), psutil.Process()
        p0, e0, t0 = proxy.cpu_times(), me.cpu_times(), time.monotonic()
        time.sleep(idle_s)
        p1, e1, dt = proxy.cpu_times(), me.cpu_times(), time.monotonic() - t0
        t1 = time.perf_counter()
        out = engine.step()
        first_ms = (time.perf_counter() - t1) * 1e3
        return {
            "seconds": dt,
            "watchdog_ms": rd.cfg.watchdog_ms,
            "proxy_core": (p1.user + p1.system - p0.user - p0.system) / dt,
            "engine_core": (e1.user + e1.system - e0.user - e0.system) / dt,
            "first_round_ms": first_ms,
            "first_round_outcome": out.outcome.label,
        }
    finally:
        rd.close()


def measure_faults(worker, slots: int, kind: str, count: int, standby: bool) -> FailoverRow:
    from ..outcome import Outcome

    rd, engine = _engine(worker, slots, standby)
    row = FailoverRow(kind, standby, [])
    sup = rd.supervisor
    try:
        for _ in range(count):
            _settle(rd, engine, standby)
            pid, left = sup.up.pid, sup.stats().budget_left
            stopped = [pid] if kind == "stall" else []
            if kind == "frozen":
                stopped.append(sup.standby.proc.pid)
                os.kill(stopped[-1], signal.SIGSTOP)
            t0 = time.perf_counter()
            os.kill(pid, signal.SIGSTOP if kind == "stall" else signal.SIGKILL)
            try:
                while engine.step().outcome is not Outcome.OK and time.perf_counter() - t0 < ROUND_LIMIT_S:
                    pass
                row.samples_ms.append((time.perf_counter() - t0) * 1e3)
                row.respawns.append(left - sup.stats().budget_left)
            finally:
                for stopped_pid in stopped:
                    _resume(stopped_pid)
    finally:
        rd.close()
    return row


def _settle(rd, engine, standby: bool) -> None:
    """Rounds until a proxy serves them (and a standby is ready), bounded."""
    from ..outcome import Outcome

    sup, end = rd.supervisor, time.monotonic() + SETTLE_S
    while time.monotonic() < end:
        ok = engine.step().outcome is Outcome.OK
        if ok and sup.up is not None and (not standby or sup.stats().standby == "ready"):
            return
        time.sleep(0.002)
    raise RuntimeError(f"no steady engine within {SETTLE_S} s: {sup.stats()}")


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def report(idle: dict, rows: list[FailoverRow], workers: list[dict], as_json: bool) -> None:
    from .failover_workers import goals as worker_goals
    from .failover_workers import report as report_workers

    watchdog_ms = idle["watchdog_ms"]
    goals = [
        ("idle proxy CPU <= 2% of a core", idle["proxy_core"] <= GOAL_IDLE_CORE),
        ("idle engine process CPU <= 2% of a core", idle["engine_core"] <= GOAL_IDLE_CORE),
    ]
    goals.append(("every fault costs at most one respawn", all(n <= 1 for r in rows for n in r.respawns)))
    for r in rows:
        if r.standby and r.name == "kill":
            goals.append((f"SIGKILL -> ok p50 <= {GOAL_KILL_P50_MS:g} ms with the standby", r.p50 <= GOAL_KILL_P50_MS))
        if r.standby and r.name == "stall":
            goals.append(
                (
                    f"SIGSTOP -> ok within the watchdog ({watchdog_ms} ms) + {GOAL_STALL_SLACK_MS:g} ms",
                    r.worst <= watchdog_ms + GOAL_STALL_SLACK_MS,
                )
            )
    if as_json:
        print(
            json.dumps(
                {
                    "idle": idle,
                    "rows": [asdict(r) | {"p50_ms": r.p50, "max_ms": r.worst} for r in rows],
                    "goals": {name: met for name, met in goals}
                    | {name: met for name, _, _, met in worker_goals(workers)},
                    "workers": workers,
                },
                indent=1,
            )
        )
        return
    print(
        f"idle {idle['seconds']:.1f} s: proxy {idle['proxy_core'] * 100:.2f}% of a core, engine process "
        f"{idle['engine_core'] * 100:.2f}%; the first round after it {idle['first_round_ms']:.2f} ms "
        f"({idle['first_round_outcome']})"
    )
    print(
        f"{'fault':<8}{'standby':<9}{'n':>4}{'p50 ms':>10}{'max ms':>10}{'respawns':>10}"
        "   (fault -> first ok round; budget units per fault, at most)"
    )
    for r in rows:
        print(
            f"{r.name:<8}{'on' if r.standby else 'off':<9}{len(r.samples_ms):>4}{r.p50:>10.1f}{r.worst:>10.1f}"
            f"{max(r.respawns, default=0):>10}"
        )
    for name, met in goals:
        print(f"goal {name}: {'met' if met else 'NOT met'}")
    report_workers(workers)

"""``remote-dspark bench failover --workers N``'s worker rows: an engine (process mode)
against a fleet of N reference workers on 127.0.0.1..N, its link keeping an active
connection and a spare. The workers run without ``--chaos`` (which would put each
connection on a thread of its own, in Python): the faults are signals, and the rounds
are served as a deployment serves them.

- **worker kill**: SIGKILL of the active worker, then rounds at a fixed rate
  (``--rate``, 100/s) until one is ok: the time from the kill to that round's return,
  the target-only rounds on the way (the fault lands at a random phase of the rounds'
  period), and the time until 90% of the slots got drafts
  again (after the switch every slot is re-announced: most entries carry ``n_out`` 0
  while their contexts come back). ``--worker-kills`` times; the killed worker is
  started again on its address before the next fault.
- **worker stall**: SIGSTOP of the active worker, the same measures; SIGCONT after.
- **spread**: 8 engines (each its own engine id and proxy) started one after another,
  each doing a round before the next starts, then each worker's engine count; then one
  worker killed: only the engines it served move (each engine's ``link.worker`` before
  and after its first ok round since).

Each fault waits for a steady engine (a round ok, a spare ready) first.
"""

from __future__ import annotations

import random
import signal
import time

GOAL_KILL_P50_MS = 10.0  # worker SIGKILL -> first ok round, a spare ready
GOAL_KILL_TARGET_ONLY = 1  # target-only rounds per worker kill at 100 rounds/s
GOAL_STALL_SLACK_MS = 10.0  # SIGSTOP -> first ok round within TIMEOUT_MS x 2 + this
GOAL_SPREAD = (2, 4)  # engines per worker, 8 engines over 3 workers
DRAFTED_SHARE = 0.9  # "drafts again": this share of the slots got drafts since the fault
SETTLE_S = 10.0  # the most a fault waits for a steady engine
ROUND_LIMIT_S = 10.0  # the most a measure waits for its ok round (and the slots' drafts)


def _engine(fleet, slots: int, engine_id: int | None = None):
    from ..config.api import RemoteConfig
    from ..demo.harness import DemoEngine
    from ..demo.sim import SimEngine
    from ..engine import Mode, RemoteDSpark

    env = fleet.env(Mode.PROCESS, VLLM_DSPARK_REMOTE_ASYNC_RESPAWNS="1000000")
    cfg = RemoteConfig.from_env(env)
    rd = RemoteDSpark(cfg, num_spec=5, max_slots=slots, row_bytes=64, environ=env, engine_id=engine_id).start()
    return rd, DemoEngine(rd, SimEngine(slots, 5, seed=1))


def _settle(rd, engine, spare: bool = True) -> None:
    """Rounds until one is ok (and, ``spare``, a spare is ready), bounded."""
    from ..outcome import Outcome

    end = time.monotonic() + SETTLE_S
    while time.monotonic() < end:
        if engine.step().outcome is Outcome.OK and (not spare or rd.stats().link.spare):
            return
        time.sleep(0.005)
    raise RuntimeError(f"no steady engine within {SETTLE_S:g} s: {rd.stats().link}")


def _paced(engine, rate: float, tick: float):
    """Rounds at ``rate`` a second from ``tick`` on (each at its tick, or at once when
    late): yields (its return time, its Drafts)."""
    period = 1.0 / rate
    while True:
        tick += period
        if (wait := tick - time.perf_counter()) > 0:
            time.sleep(wait)
        out = engine.step()
        yield time.perf_counter(), out


def measure_worker_faults(fleet, slots: int, kind: str, count: int, rate: float) -> dict:
    """The worker ``kind`` row ("kill" or "stall"): ``count`` faults of the active worker."""
    from ..outcome import Outcome

    rd, engine = _engine(fleet, slots)
    phase = random.Random(1)
    row = {"name": f"worker {kind}", "samples_ms": [], "target_only": [], "drafted_ms": [], "timeout_ms": 0}
    row["timeout_ms"] = rd.cfg.timeout_ms
    try:
        for _ in range(count):
            _settle(rd, engine)
            worker = fleet.at(rd.stats().link.worker)
            tick = time.perf_counter()  # the last round's tick: the fault lands at a random phase of the period
            time.sleep(phase.uniform(0.0, 1.0 / rate))
            t0 = time.perf_counter()
            worker.kill() if kind == "kill" else worker.signal(signal.SIGSTOP)
            try:
                seen, misses, ok_at = set(), 0, None
                for t, out in _paced(engine, rate, tick):
                    if ok_at is None and out.outcome is not Outcome.OK:
                        misses += 1
                    elif ok_at is None:
                        ok_at = t
                        row["samples_ms"].append((t - t0) * 1e3)
                        row["target_only"].append(misses)
                    seen.update(engine.sim.arrays().slots[out.counts.numpy() > 0].tolist())
                    if len(seen) >= DRAFTED_SHARE * slots or t - t0 > ROUND_LIMIT_S:
                        row["drafted_ms"].append((t - t0) * 1e3)
                        break
            finally:
                fleet.revive(worker) if kind == "kill" else worker.signal(signal.SIGCONT)
    finally:
        rd.close()
    return _summary(row)


def _summary(row: dict) -> dict:
    row["p50_ms"], row["drafted_p50_ms"] = _p50(row["samples_ms"]), _p50(row["drafted_ms"])
    row["max_ms"] = max(row["samples_ms"], default=None)
    row["max_target_only"] = max(row["target_only"], default=None)
    return row


def _p50(values: list[float]) -> float | None:
    s = sorted(values)
    return s[len(s) // 2] if s else None


def measure_spread(fleet, slots: int, engines: int = 8) -> dict:
    """The spread row: ``engines`` engines, each's worker, then one worker killed."""
    from ..outcome import Outcome

    started = []
    try:
        for e in range(engines):
            rd, engine = _engine(fleet, slots, engine_id=100 + e)
            started.append((rd, engine))
            _settle(rd, engine, spare=False)
        before = [rd.stats().link.worker for rd, _ in started]
        counts = [before.count(f"{w.host}:{w.port}") for w in fleet.workers]
        victim = max(range(len(counts)), key=counts.__getitem__)
        fleet.workers[victim].kill()
        end = time.monotonic() + ROUND_LIMIT_S
        for _, engine in started:
            while engine.step().outcome is not Outcome.OK and time.monotonic() < end:
                time.sleep(0.002)
        after = [rd.stats().link.worker for rd, _ in started]
        fleet.revive(fleet.workers[victim])
    finally:
        for rd, _ in started:
            rd.close()
    gone = f"{fleet.workers[victim].host}:{fleet.workers[victim].port}"
    moved = [e for e in range(engines) if before[e] != after[e]]
    served = [e for e in range(engines) if before[e] == gone]
    return {
        "name": "spread",
        "engines": engines,
        "per_worker": counts,
        "killed": gone,
        "served_by_killed": served,
        "moved": moved,
        "only_its_engines_moved": moved == served and gone not in after,
    }


def goals(rows: list[dict]) -> list[tuple[str, float, float, bool]]:
    """(goal, figure, target, met) for the worker rows."""
    out = []
    for r in rows:
        if r["name"] == "worker kill" and r["samples_ms"]:
            out.append(("worker SIGKILL -> ok p50 ms", r["p50_ms"], GOAL_KILL_P50_MS, r["p50_ms"] <= GOAL_KILL_P50_MS))
            n = r["max_target_only"]
            out.append(("target-only rounds per worker kill", n, GOAL_KILL_TARGET_ONLY, n <= GOAL_KILL_TARGET_ONLY))
        elif r["name"] == "worker stall" and r["samples_ms"]:
            bound = 2 * r["timeout_ms"] + GOAL_STALL_SLACK_MS
            out.append(("worker SIGSTOP -> ok max ms", r["max_ms"], bound, r["max_ms"] <= bound))
        elif r["name"] == "spread":
            lo, hi = GOAL_SPREAD
            most, met = max(r["per_worker"]), all(lo <= n <= hi for n in r["per_worker"])
            out.append((f"engines per worker in {lo}..{hi} (the most)", most, hi, met))
            moved, served = len(r["moved"]), len(r["served_by_killed"])
            out.append(("engines a kill moves (only its own)", moved, served, r["only_its_engines_moved"]))
    return out


def report(rows: list[dict]) -> None:
    """The worker rows as text (the JSON carries the rows whole)."""
    for r in rows:
        if r["name"] == "spread":
            print(
                f"spread: {r['engines']} engines over the workers {r['per_worker']}; killed {r['killed']} "
                f"(served {r['served_by_killed']}), moved {r['moved']}"
            )
            continue
        print(
            f"{r['name']:<13}n {len(r['samples_ms'])}: fault -> ok p50 {r['p50_ms']:.1f} ms, max {r['max_ms']:.1f} ms; "
            f"target-only rounds max {r['max_target_only']}; 90% of slots drafted p50 {r['drafted_p50_ms']:.1f} ms"
        )
    for name, figure, target, met in goals(rows):
        ratio = figure / target if target else float("nan")
        print(f"goal {name}: {figure:g} vs {target:g} (ratio {ratio:.2f}): {'met' if met else 'NOT met'}")

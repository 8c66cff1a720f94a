"""``remote-dspark demo``: a loopback worker and a simulated engine drafting through it.

The engine (torch CPU, :mod:`remote_dspark.harness`) decodes a synthetic language in a
few hundred request slots; its drafts come from the reference worker through the
supervised proxy process (by default) and are verified against the target. At the end:
rounds by outcome, latency percentiles, accepted tokens per position, respawns and the
budget left. ``--kill-proxy-every N`` SIGKILLs the proxy every N rounds to show respawns,
target-only rounds while it is down, and the budget running out.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import tempfile
import time

from ..config.mode import Mode
from ..outcome import Outcome
from ..progress import Progress


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="loopback worker + simulated engine; prints what happened",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rounds", type=positive, default=600, help="rounds to run (default 600)")
    p.add_argument("--slots", type=positive, default=256, help="request slots (default 256)")
    p.add_argument("--num-spec", type=positive, default=5, help="draft tokens per slot (default 5)")
    p.add_argument(
        "--mode",
        choices=("process", "thread", "sync"),
        default="process",
        help="process: supervised proxy process (default); thread: proxy thread; sync: no proxy",
    )
    p.add_argument(
        "--policy",
        choices=("capacity", "resilience", "shadow"),
        default="capacity",
        help="drafting policy (async modes are capacity only)",
    )
    p.add_argument(
        "--drafter",
        choices=("markov", "lm"),
        default="markov",
        help="the worker's drafter: the built-in Markov model (default) or the built-in tiny "
        "causal LM (needs torch in the worker: remote-dspark[lm]; CUDA when present)",
    )
    p.add_argument("--kill-proxy-every", type=positive, metavar="N", help="SIGKILL the proxy every N rounds")
    p.add_argument("--respawns", type=int, default=3, help="respawn budget (VLLM_DSPARK_REMOTE_ASYNC_RESPAWNS)")
    p.add_argument(
        "--timeout-ms",
        type=positive,
        default=None,
        help="per-round deadline (default 50; 1000 with --drafter lm, whose rounds on a small CPU take tens of ms)",
    )
    p.add_argument("--row-bytes", type=positive, default=256, help="row bytes per slot (default 256)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve Prometheus metrics on 127.0.0.1:PORT while the demo runs",
    )
    p.add_argument(
        "--linger",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --metrics-port: keep serving metrics this long after the run",
    )
    p.add_argument("--verbose", action="store_true", help="show the engine's, proxy's and supervisor's log lines")
    p.set_defaults(func=run)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def run(args: argparse.Namespace) -> int:
    mode = Mode(args.mode)
    if mode.handoff and args.policy != "capacity":
        raise ValueError(f"--policy {args.policy} needs --mode sync (async rounds are capacity only)")
    if args.timeout_ms is None:
        args.timeout_ms = 1000 if args.drafter == "lm" else 50
    if args.respawns < 0:
        raise ValueError(f"--respawns {args.respawns}: must be >= 0")
    if not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port {args.metrics_port}: a TCP port is 0..65535 (0 = off)")
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    from ..config.api import RemoteConfig
    from ..engine import RemoteDSpark
    from .harness import DemoEngine, WorkerProcess, worker_limits
    from .sim import SimEngine

    drafter = ("--drafter", "lm") if args.drafter == "lm" else ()
    with (
        WorkerProcess(extra=(*worker_limits(args.slots, args.row_bytes), *drafter), chaos=False) as worker,
        tempfile.TemporaryDirectory() as tmp,
    ):
        env = worker.env(
            mode,
            VLLM_DSPARK_REMOTE_POLICY=args.policy,
            VLLM_DSPARK_REMOTE_TIMEOUT_MS=str(args.timeout_ms),
            VLLM_DSPARK_REMOTE_ASYNC_RESPAWNS=str(args.respawns),
            # A 2-core laptop: let the idle proxy nap after 1 ms of spinning.
            VLLM_DSPARK_REMOTE_ASYNC_NAP_US=os.environ.get("VLLM_DSPARK_REMOTE_ASYNC_NAP_US", "20"),
            VLLM_DSPARK_REMOTE_STATS_FILE=os.path.join(tmp, "stats.json"),
            VLLM_DSPARK_REMOTE_LOG_EVERY="0",
            VLLM_DSPARK_REMOTE_METRICS_PORT=str(args.metrics_port),
        )
        cfg = RemoteConfig.from_env(env)
        print(
            f"worker on {cfg.endpoint} (pid {worker.proc.pid}); engine: {args.slots} slots, "
            f"num_spec {args.num_spec}, mode {args.mode}, policy {args.policy}, drafter {args.drafter}"
        )
        if cfg.metrics_port:
            print(f"metrics on http://{cfg.metrics_addr}:{cfg.metrics_port}/metrics")
        sim = SimEngine(args.slots, args.num_spec)
        local = _local_drafter(args.num_spec) if cfg.keeps_local_drafter else None
        with RemoteDSpark(
            cfg,
            num_spec=args.num_spec,
            max_slots=args.slots,
            row_bytes=args.row_bytes,
            local_drafter=local,
            environ=env,
        ) as rd:
            engine = DemoEngine(rd, sim)
            bar = Progress(args.rounds, "rounds")
            killed = None
            for r in range(1, args.rounds + 1):
                if args.kill_proxy_every and r % args.kill_proxy_every == 0:
                    killed = _kill_proxy(rd, killed)
                engine.step()
                bar.update(r, _note(rd))
            if killed is not None:  # report once the supervisor has seen the last kill
                _supervisor_state(rd, past=killed)
            print_report(rd.stats(), engine)
            if cfg.metrics_port and args.linger:
                print(f"serving metrics for {args.linger:g} s more (Ctrl-C ends)", flush=True)
                time.sleep(args.linger)
    return 0


def _note(rd) -> str:
    sup = rd.supervisor.stats() if rd.supervisor is not None else None
    return f"proxy {sup.state}, budget {sup.budget_left}" if sup else ""


KILL_WAIT_S = 30.0  # how long the demo waits for the supervisor to react to a kill


def _kill_proxy(rd, last: int | None) -> int | None:
    """SIGKILL the live proxy; returns its pid. The proxy killed before may not be
    replaced yet (its death not yet reaped, or the new one still spawning): wait, bounded,
    for its successor, so every due kill lands on a new proxy. Nothing to kill once the
    budget is spent (or in the other modes)."""
    from ..supervisor.restarts import Up

    state = _supervisor_state(rd, past=last)
    if isinstance(state, Up) and state.pid != last:
        os.kill(state.pid, signal.SIGKILL)
        return state.pid
    return last


def _supervisor_state(rd, *, past: int | None):
    """The supervisor's state once it is past proxy ``past`` (a later proxy serves, or
    none will) and not between a loss and a serving successor, or after KILL_WAIT_S;
    None outside process mode."""
    from ..supervisor.restarts import Down, Killing, Starting, Up

    sup = rd.supervisor
    deadline = time.monotonic() + KILL_WAIT_S
    while sup is not None:
        state = sup.state
        settled = not isinstance(state, (Killing, Down, Starting)) and not (isinstance(state, Up) and state.pid == past)
        if settled or time.monotonic() >= deadline:
            return state
        time.sleep(0.005)
    return None


def _local_drafter(num_spec: int):
    """The engine's own drafter for shadow/resilience: the built-in Markov model, locally."""
    import torch

    from ..drafter.markov import builtin_model

    model = builtin_model()

    def draft(batch):
        """From each entry's tokens of this round (the demo's local drafter keeps no
        windows): one batched Markov lookup for all entries."""
        import numpy as np

        def host(x):
            return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)

        n = len(batch)
        toks, counts, _ = model.draft_batch(
            host(batch.tokens).astype(np.int32),
            host(batch.token_offsets).astype(np.int64),
            np.full(n, num_spec, dtype=np.int32),
            num_spec,
        )
        return torch.from_numpy(np.ascontiguousarray(toks)), torch.from_numpy(np.ascontiguousarray(counts))

    return draft


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def print_report(stats, engine) -> None:
    """``stats``: the engine's ``Stats``; ``engine``: the ``DemoEngine`` that ran."""
    total = stats.total_rounds
    print(f"\nrounds by outcome ({total} rounds)")
    for outcome, n in stats.rounds.items():
        if n or outcome is Outcome.OK:
            print(f"  {outcome.label:<14}{n:>8}  {n / max(1, total) * 100:5.1f}%")
    print(f"  {'late replies':<14}{stats.link.late:>8}")
    lat = [s.seconds for s in engine.steps]
    print(
        "round latency (ms, engine side): "
        + "  ".join(f"{name} {percentile(lat, q) * 1e3:.3f}" for name, q in (("p50", 0.5), ("p99", 0.99), ("max", 1.0)))
    )
    print("accepted drafts by position")
    for i, (a, o) in enumerate(zip(stats.accepted_at, stats.offered_at)):
        print(f"  pos {i}: {a:>8} of {o:>8} offered ({a / o * 100 if o else 0:5.1f}%)")
    sim = engine.sim
    print(
        f"tokens decoded: {sim.tokens} in {sim.rounds} rounds ({sim.tokens / max(1, sim.rounds):.1f} per round "
        f"over {sim.n_slots} slots, {sim.tokens / max(1, sim.rounds * sim.n_slots):.2f} per slot)"
    )
    sup = stats.supervisor
    if sup:
        r = sup.restarts
        print(
            f"proxy: {sup.spawns} started, restarts exit={r['exit']} signal={r['signal']} stall={r['stall']}; "
            f"respawn budget left {sup.budget_left} (state: {sup.state})"
        )

"""Benchmarks (``remote-dspark bench ...``). Each module adds its own subcommand and
keeps its heavy imports inside the function that runs it.

    round/           one drafting round end to end, next to its floors
    handoff/         the hand-off's round trip, side by side
    failover         an idle engine's cost and a lost proxy's rounds
    failover_workers its worker rows: a lost or stalled worker, engines over a fleet
    worker_engines   many engines against one worker
    worker_long      its long row: one engine announcing long contexts in chunks
    engine_procs     what worker-engines' rows share: engine processes, flags, memory
    speculation      the speculation cache's rows: a simulated target that can hit, hits
    worker_cpu       the worker's CPU per round and share of its drafter alone, per row
    worker_hostile   the worker under hostile peers
    metrics_hostile  the worker's metrics server under hostile clients
    drafter          the model drafters' rounds, three ways
    acceptance       drafts a target accepts when the drafter is the target
    generate         transformers' generate() four ways (and the speculation cache's)
    hf_models        the transformers models the benchmarks load or build
    attention        the paged attention kernel's read bandwidth (python -m; no subcommand yet)
"""


def add_parsers(sub) -> None:
    """Register every benchmark's subcommand."""
    from . import acceptance, drafter, failover, generate, metrics_hostile, worker_engines, worker_hostile
    from .handoff import run as handoff
    from .round import run as bench_round

    handoff.add_parser(sub)
    bench_round.add_parser(sub)
    failover.add_parser(sub)
    worker_hostile.add_parser(sub)
    metrics_hostile.add_parser(sub)
    drafter.add_parser(sub)
    acceptance.add_parser(sub)
    generate.add_parser(sub)
    worker_engines.add_parser(sub)

"""Benchmarks (``remote-dspark bench ...``). Each module adds its own subcommand and
keeps its heavy imports inside the function that runs it."""


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

"""Benchmarks (``remote-dspark bench ...``). Each module adds its own subcommand."""


def add_parsers(sub) -> None:
    """Register every benchmark's subcommand. Modules are imported when run, not here."""

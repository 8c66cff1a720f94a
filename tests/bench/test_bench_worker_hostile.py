"""``remote-dspark bench worker-hostile``: its arguments and the report's shape, from a tiny
run of the real worker and peers. No timed assertions: the figures are the benchmark's."""

from __future__ import annotations

import argparse
import json

import psutil
import pytest

from remote_dspark.bench import add_parsers
from remote_dspark.bench import worker_hostile as wh
from remote_dspark.cli import main as cli


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="remote-dspark bench")
    add_parsers(parser.add_subparsers(dest="bench", required=True))
    return parser.parse_args(argv)


def test_registered_with_its_defaults():
    args = parse(["worker-hostile"])
    assert args.func is wh.run
    assert (args.header_peers, args.hello_peers, args.silent_peers, args.honest) == (40, 16, 200, 5)


@pytest.mark.parametrize("argv,why", [(["--honest", "0"], "--honest 0"), (["--silent-peers", "-1"], "--silent-peers")])
def test_bad_arguments_are_refused(argv, why, capsys):
    assert cli.main(["bench", "worker-hostile", *argv]) == 2
    assert why in capsys.readouterr().err


def test_tiny_run_reports_its_figures_and_ends_the_worker(capfd):
    rc = cli.main(
        [
            "bench",
            "worker-hostile",
            "--header-peers",
            "2",
            "--hello-peers",
            "1",
            "--silent-peers",
            "3",
            "--honest",
            "2",
            "--interval-ms",
            "50",
            "--settle-ms",
            "100",
            "--json",
        ]
    )
    out, _ = capfd.readouterr()
    assert rc == 0
    r = json.loads(out)
    assert set(r["peers"]) == {"header", "hello", "silent"}
    for p in r["peers"].values():
        assert set(p) == {"want", "opened", "dropped_by_worker", "failed_to_open"}
    assert {"rss_base_mib", "rss_peak_mib", "rss_growth_mib", "honest_max_ms", "worker_alive"} <= set(r)
    assert len(r["honest"]) == 2 and all(set(a) == {"ms", "ok", "error"} for a in r["honest"])
    assert set(r["goals"]) == {"rss_growth_le_256_mib", "honest_hello_le_1000_ms"}
    assert all(isinstance(v, bool) for v in r["goals"].values())
    assert not [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]

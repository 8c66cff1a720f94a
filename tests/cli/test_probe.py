"""``check-config --probe`` against loopback workers: one test per outcome that matters."""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading

import pytest
from helpers import COUNTING, connect, until

from remote_dspark import wire
from remote_dspark.cli import check_config as check_config_cli
from remote_dspark.cli import probe
from remote_dspark.config import RemoteConfig
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.worker import Worker

P = "VLLM_DSPARK_REMOTE_"


@pytest.fixture
def served(monkeypatch):
    """A loopback worker of COUNTING, and the engine environment pointed at it (every
    other VLLM_DSPARK* variable removed). Yields (worker, monkeypatch)."""
    for name in list(os.environ):
        if name.upper().startswith("VLLM_DSPARK"):
            monkeypatch.delenv(name)
    drafter = MarkovDrafter(COUNTING)
    w = Worker(drafter, "127.0.0.1", 0, max_engines=2).start()
    monkeypatch.setenv("VLLM_DSPARK_REMOTE", f"tcp://127.0.0.1:{w.port}")
    monkeypatch.setenv(P + "IDENTITY", drafter.drafter_identity.hex())
    monkeypatch.setenv(P + "MARKOV_IDENTITY", drafter.markov_identity.hex())
    yield w, monkeypatch
    w.stop()


def check_config(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="remote-dspark")
    check_config_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["check-config", *argv])
    return args.func(args)


def probed(capsys, *argv: str) -> tuple[int, dict, str]:
    """check-config --probe --json: its exit status, its probe object, its stderr."""
    code = check_config("--probe", "--json", "--max-slots", "8", "--row-bytes", "4", *argv)
    out = capsys.readouterr()
    return code, json.loads(out.out)["probe"], out.err


def test_green(served, capsys):
    w, _ = served
    engine = connect(w, session=7, engine_id=7)  # one engine served: the ACK tells it
    try:
        code, report, err = probed(capsys, "--vocab-size", "16")
    finally:
        engine.close()
    assert code == 0 and report["ok"] and report["verdict"] == "ok", (report, err)
    fields = report["fields"]
    assert fields["vocab_size"] == {"engine": "16", "worker": "5", "mismatch": False}
    assert fields["max_slots"]["worker"] == "at most 1024" and fields["context_tokens"]["worker"] == "64"
    assert fields["engines served"]["worker"] == "1" and fields["incarnation"]["worker"] == f"{w.incarnation:016x}"
    assert not any(f["mismatch"] for f in fields.values())
    # the table's form says the same
    assert check_config("--probe", "--max-slots", "8") == 0
    assert "probe: ok: 127.0.0.1:" in capsys.readouterr().out


def test_wrong_identity(served, capsys):
    w, env = served
    env.setenv(P + "IDENTITY", "cd" * 32)
    code, report, err = probed(capsys)
    assert code == 3 and report["verdict"] == "identity"
    drafter = report["fields"]["drafter identity"]
    assert drafter == {"engine": "cd" * 32, "worker": w.drafter.drafter_identity.hex(), "mismatch": True}
    assert "drafter identity mismatch" in err and "probe failed (identity)" in err


def test_vocabulary_over(served, capsys):
    code, report, err = probed(capsys, "--vocab-size", "3")
    assert code == 3 and report["verdict"] == "vocabulary"
    assert report["fields"]["vocab_size"] == {"engine": "3", "worker": "5", "mismatch": True}
    assert "the drafter's vocabulary is 5 tokens, over the engine's 3" in err


def test_slots_over(served, capsys):
    code, report, err = probed(capsys, "--max-slots", "2000")
    assert code == 3 and report["verdict"] == "limits"
    assert report["fields"]["max_slots"] == {"engine": "2000", "worker": "at most 1024", "mismatch": True}
    assert "max_slots 2000 over this worker's 1024 (--max-slots)" in err


def test_unreachable(served, capsys):
    w, env = served
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        env.setenv("VLLM_DSPARK_REMOTE", f"tcp://127.0.0.1:{s.getsockname()[1]}")
    code, report, err = probed(capsys)
    assert code == 3 and report["verdict"] == "unreachable" and "connect to 127.0.0.1" in report["reason"]


@pytest.mark.parametrize("host", ["no-such-host.invalid", "bad..host"])
def test_unresolvable_host_is_reported(served, capsys, host):
    """A name that does not resolve, and one the resolver refuses outright (an empty
    label): each reported at once as not resolving, never a thread's traceback."""
    _, env = served
    env.setenv("VLLM_DSPARK_REMOTE", f"tcp://{host}:18620")
    code, report, err = probed(capsys)
    assert code == 3 and report["verdict"] == "unresolvable"
    assert f"'{host}' does not resolve" in report["reason"] and "Traceback" not in err


def test_a_host_that_does_not_resolve_in_time_is_reported():
    """The look-up is bounded by CONNECT_TIMEOUT_MS (the C resolver has no deadline)."""
    release = threading.Event()

    def stuck(*args, **kwargs):
        release.wait(10)
        raise socket.gaierror("released")

    env = {"VLLM_DSPARK_REMOTE": "tcp://slow.example:1", P + "IDENTITY": "ab" * 32, P + "CONNECT_TIMEOUT_MS": "50"}
    try:
        report = probe.probe(RemoteConfig.from_env(env), probe.Sizes(8, 0, 3), env, resolve=stuck)
    finally:
        release.set()
    assert report.verdict == "unresolvable" and "did not resolve within 0.05 s" in report.reason
    assert until(lambda: not any(t.name == "dspark-resolve" for t in threading.enumerate()))


def test_a_probe_never_evicts_a_served_engine(served, capsys):
    """The probe's engine id is its own: the served engine keeps its session and windows,
    and the probe's session leaves with its BYE. With every place held by an engine
    served within a minute, the probe is told busy and takes nothing."""
    w, _ = served
    engines = [connect(w, session=s, engine_id=e) for s, e in ((1, 42), (2, 43))]
    try:
        before = {e: w._sessions.get(e) for e in (42, 43)}
        code, report, err = probed(capsys)
        assert code == 3 and report["verdict"] == "busy" and "busy" in err
        assert {e: w._sessions.get(e) for e in (42, 43)} == before and len(w._sessions) == 2
        assert not any(s.evicted for s in before.values())
        engines.pop().close()
        assert until(lambda: len(w._sessions) == 1)
        code, report, _ = probed(capsys)
        assert code == 0 and report["ok"]
        assert w._sessions.get(42) is before[42] and not before[42].evicted
        assert until(lambda: len(w._sessions) == 1)  # the probe's BYE let its session go
    finally:
        for c in engines:
            c.close()


def test_sizes_out_of_the_wires_range_name_the_flag(served, capsys):
    assert check_config("--probe", "--max-slots", "0") == 2
    assert "--max-slots 0" in capsys.readouterr().err


def test_probe_engine_id_is_fresh(served, monkeypatch, capsys):
    """Every probe draws its ids from wire.random_id: never a configured engine's id."""
    drawn = []
    real = wire.random_id
    monkeypatch.setattr(wire, "random_id", lambda: drawn.append(real()) or drawn[-1])
    assert probed(capsys)[0] == 0
    assert len(drawn) == 2 and drawn[0] != drawn[1]

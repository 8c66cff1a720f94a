"""``remote-dspark check-config`` through its own parser (no dependence on cli.py's siblings)."""

from __future__ import annotations

import argparse
import json
import os
import socket

import pytest

from remote_dspark.cli import check_config as check_config_cli

P = "VLLM_DSPARK_REMOTE_"
IDENT = "ab" * 32


@pytest.fixture
def env(monkeypatch):
    """A clean contract environment: every VLLM_DSPARK* variable removed, then the two required set."""
    for name in list(os.environ):
        if name.startswith("VLLM_DSPARK"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_DSPARK_REMOTE", "tcp://127.0.0.1:18620")
    monkeypatch.setenv(P + "IDENTITY", IDENT)
    return monkeypatch


def check_config(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="remote-dspark")
    check_config_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["check-config", *argv])
    return args.func(args)


def test_table(env, capsys):
    env.setenv(P + "TIMEOUT_MS", "80")
    assert check_config() == 0
    lines = capsys.readouterr().out.split("\n\n")[0].splitlines()  # the table, then the fleet
    assert lines[0].split() == ["VARIABLE", "VALUE", "SOURCE"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows["VLLM_DSPARK_REMOTE"] == ["tcp://127.0.0.1:18620", "env"]
    assert rows[P + "TIMEOUT_MS"] == ["80", "env"]
    assert rows[P + "POLICY"] == ["shadow", "default"]
    assert rows[P + "IDENTITY"] == [IDENT, "env"]
    assert rows[P + "DRAFT_MS"] == ["-", "default"]
    assert rows["watchdog_ms"] == ["320", "derived"]
    # aligned: the VALUE column starts at the same offset on every line
    starts = {line.index(line.split()[1], len(line.split()[0])) for line in lines}
    assert len(starts) == 1


def test_json(env, capsys):
    env.setenv(P + "POLICY", "capacity")
    env.setenv(P + "ROUND_MS", "1,2,3")
    assert check_config("--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["VLLM_DSPARK_REMOTE"] == "tcp://127.0.0.1:18620"
    assert out[P + "POLICY"] == "capacity"
    assert out[P + "WANT_MARGIN"] == "0"
    assert out[P + "ROUND_MS"] == "1,2,3"
    assert out[P + "MARKOV_IDENTITY"] == "00" * 32
    assert out[P + "DRAFT_MS"] == ""
    assert out["derived"] == {"watchdog_ms": "200", "keeps_local_drafter": "0", "bind": ""}


def test_bad_value_returns_2_and_names_variable(env, capsys):
    env.setenv(P + "TIMEOUT_MS", "0")
    assert check_config() == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"check-config: {P}TIMEOUT_MS='0'")


def test_missing_endpoint_returns_2(env, capsys):
    env.delenv("VLLM_DSPARK_REMOTE")
    assert check_config("--json") == 2
    assert "VLLM_DSPARK_REMOTE is required" in capsys.readouterr().err


def test_ofl_endpoint_without_ofl_dir_returns_2(env, capsys):
    env.setenv("VLLM_DSPARK_REMOTE", "o1tcp://10.202.28.1:18620")
    assert check_config() == 2
    assert f"{P}OFL_DIR" in capsys.readouterr().err


def test_ofl_endpoint_with_library_dir(env, capsys, tmp_path):
    (tmp_path / "ofl.py").write_text("def connect(*args, **kwargs):\n    raise OSError('stub')\n")
    (tmp_path / "libofl.so").write_bytes(b"")
    env.setenv("VLLM_DSPARK_REMOTE", "o1rdma://10.202.28.1:18620")
    env.setenv(P + "BIND", "10.202.28.2")
    env.setenv(P + "OFL_DIR", str(tmp_path))
    assert check_config("--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["VLLM_DSPARK_REMOTE"] == "o1rdma://10.202.28.1:18620?bind=10.202.28.2"
    assert out[P + "OFL_DIR"] == str(tmp_path)
    assert out["derived"]["bind"] == "10.202.28.2"


def test_help_explains(capsys):
    with pytest.raises(SystemExit) as e:
        check_config("--help")
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "engine startup" in text and "VLLM_DSPARK_REMOTE_OFL_DIR" in text and "--json" in text


@pytest.mark.parametrize(
    "settings,names",
    [
        ({"ASYNC_NAP_US": "2147483647"}, ("ASYNC_NAP_US=2147483647", "ASYNC_WATCHDOG_MS")),
        ({"ASYNC_NAP_US": "200000"}, ("ASYNC_NAP_US=200000", "200 ms")),  # the derived 200 ms deadline
        ({"ASYNC_WATCHDOG_MS": "50"}, ("ASYNC_WATCHDOG_MS=50", "TIMEOUT_MS=50")),
        ({"ASYNC_WATCHDOG_MS": "30", "TIMEOUT_MS": "80"}, ("ASYNC_WATCHDOG_MS=30", "TIMEOUT_MS=80")),
    ],
)
def test_settings_that_cannot_work_are_named_but_accepted(env, capsys, settings, names):
    """The contract parses them (no upper bounds); check-config still succeeds, with a
    warning naming the variables."""
    env.setenv(P + "ASYNC", "1")
    env.setenv(P + "POLICY", "capacity")
    for k, v in settings.items():
        env.setenv(P + k, v)
    assert check_config() == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and all(
        P + n.split("=")[0] in warnings[0] and n in warnings[0] for n in names if n[0].isupper()
    ), warnings


@pytest.mark.parametrize(
    "settings",
    [{}, {"ASYNC_NAP_US": "199999"}, {"ASYNC_WATCHDOG_MS": "51"}, {"ASYNC": "0", "ASYNC_NAP_US": "2147483647"}],
)
def test_settings_that_work_have_no_warning(env, capsys, settings):
    env.setenv(P + "ASYNC", "1")
    env.setenv(P + "POLICY", "capacity")
    for k, v in settings.items():
        env.setenv(P + k, v)
    assert check_config() == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "settings,names",
    [
        # the contract's largest TIMEOUT_MS: the derived watchdog is kept exactly (4 x it, days)
        (
            {"ASYNC": "1", "TIMEOUT_MS": "2147483647"},
            (("TIMEOUT_MS=2147483647", "round deadline"), ("8589934588 ms", "TIMEOUT_MS=2147483647")),
        ),
        ({"ASYNC": "1", "TIMEOUT_MS": "15001"}, (("60004 ms", "TIMEOUT_MS=15001", "ASYNC_WATCHDOG_MS=0"),)),
        ({"ASYNC": "1", "ASYNC_WATCHDOG_MS": "60001"}, (("60001 ms", "ASYNC_WATCHDOG_MS=60001"),)),
        ({"ASYNC": "0", "TIMEOUT_MS": "60001"}, (("TIMEOUT_MS=60001", "round deadline"),)),
    ],
)
def test_a_deadline_over_a_minute_is_named_and_kept(env, capsys, settings, names):
    """A round deadline or an effective watchdog over a minute (the contract accepts
    them; the watchdog is max(4 x TIMEOUT_MS, 200) exactly) is a warning naming the
    values, one per deadline."""
    env.setenv(P + "POLICY", "capacity")
    for k, v in settings.items():
        env.setenv(P + k, v)
    assert check_config("--json") == 0
    out = capsys.readouterr()
    warnings = [line for line in out.err.splitlines() if "warning" in line]
    assert len(warnings) == len(names), warnings
    for warning, parts in zip(warnings, names):
        assert all(part in warning for part in parts), (warning, parts)
    timeout = int(settings.get("TIMEOUT_MS", "50"))
    expected = int(settings.get("ASYNC_WATCHDOG_MS", 0)) or max(4 * timeout, 200)
    assert json.loads(out.out)["derived"]["watchdog_ms"] == str(expected)


@pytest.mark.parametrize("settings", [{"TIMEOUT_MS": "15000"}, {"ASYNC_WATCHDOG_MS": "60000"}])
def test_a_deadline_of_a_minute_has_no_warning(env, capsys, settings):
    env.setenv(P + "ASYNC", "1")
    env.setenv(P + "POLICY", "capacity")
    for k, v in settings.items():
        env.setenv(P + k, v)
    assert check_config() == 0
    assert "warning" not in capsys.readouterr().err


def test_depth_policy_facts_show_n_out_and_the_cost_overrides_without_writing(env, capsys):
    env.setenv(P + "POLICY", "capacity")
    env.setenv(P + "DRAFT_MS", "1.5")
    env.setenv(P + "ROUND_MS", "1,2,3,4,5,6")
    assert check_config("--json", "--depth-policy", "conf", "--dense-cap", "0,5,5,3") == 0
    derived = json.loads(capsys.readouterr().out)["derived"]
    assert derived["n_out"] == "by request count 0,5,5,3" and derived["n_out_reason"] == "cap by request count"
    assert derived["cost_overrides"] == "VLLM_DSPARK_ROUND_MS=1,2,3,4,5,6 VLLM_DSPARK_DRAFT_MS=1.5"
    assert "VLLM_DSPARK_ROUND_MS" not in os.environ and "VLLM_DSPARK_DRAFT_MS" not in os.environ  # a dry run


def test_depth_policy_that_needs_the_remote_costs_is_refused(env, capsys):
    env.setenv(P + "POLICY", "capacity")
    assert check_config("--depth-policy", "conf") == 2
    assert "needs both VLLM_DSPARK_REMOTE_DRAFT_MS" in capsys.readouterr().err


def test_no_depth_policy_sends_every_position(env, capsys):
    assert check_config("--json", "--num-spec", "5") == 0
    derived = json.loads(capsys.readouterr().out)["derived"]
    assert derived["n_out"] == "all 5" and derived["cost_overrides"] == "none"


@pytest.fixture
def dns(monkeypatch):
    """DNS the test controls, in place of the C library's look-up: ``workers.example``
    resolves to two addresses, ``gone.example`` to nothing."""

    def getaddrinfo(host, port, type=0):
        if host != "workers.example":
            raise socket.gaierror(f"no such host {host}")
        return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in ("10.0.0.7", "10.0.0.8")]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_the_fleet_is_printed_target_by_target_and_dns_failure_is_no_failure(env, dns, capsys):
    env.setenv("VLLM_DSPARK_REMOTE", "tcp://workers.example:18620,127.0.0.2:18621,gone.example:18622")
    assert check_config() == 0
    out, err = capsys.readouterr()
    fleet = out.split("\n\n")[1].splitlines()
    assert fleet[0].startswith("FLEET  3 target(s), resolved within 1000 ms")
    assert fleet[1].split() == ["workers.example:18620", "->", "10.0.0.7:18620", "10.0.0.8:18620"]
    assert fleet[2].split() == ["127.0.0.2:18621", "->", "127.0.0.2:18621"]
    assert fleet[3].split()[:4] == ["gone.example:18622", "->", "not", "resolved:"]
    assert "'gone.example' does not resolve (no such host gone.example)" in fleet[3]
    assert "warning: gone.example:18622 does not resolve now" in err
    rows = {line.split()[0]: line.split()[1] for line in out.split("\n\n")[0].splitlines()}
    assert rows["VLLM_DSPARK_REMOTE"] == "tcp://workers.example:18620,127.0.0.2:18621,gone.example:18622"


def test_the_fleet_in_json(env, dns, capsys):
    env.setenv("VLLM_DSPARK_REMOTE", "tcp://workers.example:18620,[::1]:18621")
    assert check_config("--json") == 0
    assert json.loads(capsys.readouterr().out)["fleet"] == [
        {"target": "workers.example:18620", "addresses": ["10.0.0.7:18620", "10.0.0.8:18620"], "error": ""},
        {"target": "[::1]:18621", "addresses": ["[::1]:18621"], "error": ""},
    ]


def test_an_ofl_host_is_left_to_its_library(env, dns, capsys, tmp_path):
    (tmp_path / "ofl.py").write_text("def connect(*args, **kwargs):\n    raise OSError('stub')\n")
    (tmp_path / "libofl.so").write_bytes(b"")
    env.setenv("VLLM_DSPARK_REMOTE", "o1tcp://gone.example:18620")
    env.setenv(P + "OFL_DIR", str(tmp_path))
    assert check_config() == 0
    out, err = capsys.readouterr()
    assert out.split("\n\n")[1].splitlines() == [
        "FLEET  one worker; o1tcp:// hosts are resolved by the ofl library",
        "  gone.example:18620  -> gone.example:18620",
    ]
    assert "warning" not in err


def test_a_list_for_an_ofl_scheme_is_refused(env, capsys):
    env.setenv("VLLM_DSPARK_REMOTE", "o1tcp://a:1,b:2")
    assert check_config() == 2
    assert "a list of targets is for tcp:// only, not o1tcp://" in capsys.readouterr().err

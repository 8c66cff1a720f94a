"""The command line: the first demo, the Markov cache builder, exit codes."""

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from remote_dspark.cli.main import main
from remote_dspark.drafter.markov import MarkovModel, builtin_model


def run_cli(*args, timeout=120):
    """The installed command in its own process (it starts workers and proxies)."""
    return subprocess.run(
        [sys.executable, "-m", "remote_dspark", *args], capture_output=True, text=True, timeout=timeout
    )


def outcome_counts(out: str) -> dict[str, int]:
    section = out.split("rounds by outcome", 1)[1].split("round latency", 1)[0]
    return {
        line.split()[0]: int(line.split()[1])
        for line in section.splitlines()[1:]
        if line.strip() and not line.strip().startswith("late")
    }


@pytest.mark.slow
def test_demo_drafts_through_the_proxy_process():
    out = run_cli("demo", "--rounds", "60", "--slots", "16")
    assert out.returncode == 0, out.stderr
    assert outcome_counts(out.stdout) == {"ok": 60}
    # The built-in model drafts the synthetic language well: most first drafts are accepted.
    pos0 = next(line for line in out.stdout.splitlines() if "pos 0:" in line).split()
    assert int(pos0[4]) > 0 and int(pos0[2]) / int(pos0[4]) > 0.5
    assert "proxy: 1 started" in out.stdout and "respawn budget left 3" in out.stdout


@pytest.mark.slow
def test_demo_kill_proxy_every_spends_the_budget():
    out = run_cli("demo", "--rounds", "150", "--slots", "8", "--kill-proxy-every", "30", "--respawns", "2")
    assert out.returncode == 0, out.stderr
    counts = outcome_counts(out.stdout)
    # Kills at rounds 30, 60 and 90: two respawns, then target-only to the end (rounds 90..150).
    assert counts["no_proxy"] >= 150 - 90 and counts["ok"] + counts["no_proxy"] == 150
    assert "restarts exit=0 signal=3 stall=0; respawn budget left 0 (state: spent)" in out.stdout
    assert "respawn budget (2) is spent" in out.stderr


def test_a_due_kill_waits_for_the_killed_proxys_successor(monkeypatch):
    """The supervisor may still show the proxy killed last (not reaped yet), then none
    (respawning), then its successor starting: the kill lands on the next proxy once it
    serves, never on a corpse or a proxy still starting."""
    from types import SimpleNamespace

    from remote_dspark.demo import demo
    from remote_dspark.supervisor.restarts import Cause, Down, Spent, Starting, Up

    def child(pid):
        return SimpleNamespace(pid=pid)

    states = iter(
        [
            Up(child(11), 1, 0.0),
            Up(child(11), 1, 0.0),
            Down(Cause.SIGNAL, 0.0),
            Starting(child(12), 2, 0.0),
            Up(child(12), 2, 0.0),
        ]
    )

    class Sup:
        @property
        def state(self):
            return next(states)

    rd = SimpleNamespace(mode="process", supervisor=Sup())
    killed = []
    monkeypatch.setattr(demo.os, "kill", lambda pid, sig: killed.append(pid))
    assert demo._kill_proxy(rd, 11) == 12 and killed == [12]
    states = iter([Spent(0.0)])
    assert demo._kill_proxy(rd, 12) == 12 and killed == [12]  # budget spent: nothing to kill


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "thread"])
def test_demo_other_modes(mode):
    out = run_cli("demo", "--rounds", "30", "--slots", "8", "--mode", mode)
    assert out.returncode == 0, out.stderr
    assert outcome_counts(out.stdout) == {"ok": 30}


@pytest.mark.slow
def test_chaos_short_run_passes_every_check():
    out = run_cli("chaos", "--seconds", "6", "--seed", "3", "--slots", "16", "--reset-s", "1", "--json", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout[out.stdout.index("{") :])
    assert report["ok"] and len(report["checks"]) == 7
    assert all(n >= 1 for n in report["faults"].values()), report["faults"]


def test_markov_build_writes_a_cache_whose_sha256_is_printed(tmp_path, capsys):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(" ".join(str(t) for t in [1, 2, 3] * 10))
    out_file = tmp_path / "m.bin"
    assert main(["markov", "build", str(tokens), "-o", str(out_file), "--order", "1"]) == 0
    model = MarkovModel.load(str(out_file))
    assert f"VLLM_DSPARK_REMOTE_MARKOV_IDENTITY={model.identity.hex()}" in capsys.readouterr().out
    assert model.draft([1], 4) == ([2, 3, 1, 2], [1.0, 1.0, 1.0, 1.0])


def test_markov_binary_tokens_and_round_trip(tmp_path):
    import struct

    path = tmp_path / "tokens.bin"
    path.write_bytes(struct.pack("<8i", 5, 6, 7, 5, 6, 7, 5, 6))
    assert main(["markov", "build", str(path), "-o", str(tmp_path / "m.bin")]) == 0
    m = MarkovModel.load(str(tmp_path / "m.bin"))
    assert MarkovModel.from_bytes(m.to_bytes()).identity == m.identity
    assert m.draft([5, 6], 2)[0] == [7, 5]


@pytest.mark.parametrize(
    "content,why",
    [
        (b"1 2 x", "not whitespace-separated integers"),
        (b"\x01\x02\x03", "not a whole number of int32"),
        (b"1", "need more than --order 2"),
    ],
)
def test_markov_build_bad_input_exits_2_naming_the_file(tmp_path, capsys, content, why):
    path = tmp_path / ("t.txt" if b" " in content or content == b"1" else "t.bin")
    path.write_bytes(content)
    assert main(["markov", "build", str(path), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and why in err


@pytest.mark.parametrize(
    "mutate,why",
    [
        (lambda b: b"XXXX" + b[4:], "bad magic"),
        (lambda b: b[:-1], "header says"),
        (lambda b: b[:6] + b"\x00\x00" + b[8:], "order 0"),
    ],
)
def test_corrupt_markov_cache_is_refused(mutate, why):
    with pytest.raises(ValueError, match=why):
        MarkovModel.from_bytes(mutate(builtin_model().to_bytes()), "cache")


def test_bad_arguments_exit_2_with_usage():
    out = run_cli("demo", "--rounds", "0")
    assert out.returncode == 2 and "--rounds: 0 must be >= 1" in out.stderr
    out = run_cli("demo", "--mode", "thread", "--policy", "shadow")
    assert out.returncode == 2 and "--policy shadow needs --mode sync" in out.stderr


def test_help_lists_every_command():
    out = subprocess.run(
        [sys.executable, "-m", "remote_dspark", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for command in ("worker", "demo", "chaos", "check-config", "markov", "bench"):
        assert command in out


def test_markov_build_refuses_out_of_range_tokens_and_bad_output(tmp_path, capsys):
    tokens = tmp_path / "t.txt"
    tokens.write_text(f"1 2 {2**31} 4")
    assert main(["markov", "build", str(tokens), "-o", str(tmp_path / "m.bin")]) == 2
    assert "does not fit a 32-bit token id" in capsys.readouterr().err
    tokens.write_text("1 2 3 4")
    assert main(["markov", "build", str(tokens), "-o", str(tmp_path / "missing" / "m.bin")]) == 2
    assert "--output" in capsys.readouterr().err


def test_an_idle_model_worker_is_gone_promptly_after_sigterm(tmp_path):
    """The LM drafter's worker (torch imported): SIGTERM stops it cleanly (its last line
    printed, exit 0), and the process ends there, skipping the interpreter's teardown of
    torch's modules (0.3 s idle, 1 to 2 s on a loaded host, after the work is done): an
    exit hook, which only that teardown runs, never runs."""
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, sys\natexit.register(lambda: sys.stderr.write('interpreter teardown\\n'))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-m", "remote_dspark", "worker", "--listen", "127.0.0.1:0", "--drafter", "lm"]
    proc = subprocess.Popen([*argv, "--lm-device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        seen, give_up = b"", time.monotonic() + 120
        while b"drafting calls" not in seen and time.monotonic() < give_up and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1)[0]:
                seen += os.read(proc.stdout.fileno(), 65536)
        assert b"drafting calls" in seen, seen  # serving, idle
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        took = time.monotonic() - t0
        err = proc.stderr.read().decode()
    finally:
        proc.kill()  # a no-op once it has exited
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    assert code == 0 and "worker stopped: 0 connections" in err, err
    assert "interpreter teardown" not in err, f"the interpreter's teardown ran ({took:.3f} s from SIGTERM to the end)"

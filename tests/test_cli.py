"""The command line: the first demo, the Markov cache builder, exit codes."""

import subprocess
import sys

import pytest

from remote_dspark.cli import main
from remote_dspark.markov import MarkovModel, builtin_model


def test_demo_runs_rounds_through_the_worker(capsys):
    assert main(["demo", "--rounds", "40", "--slots", "8"]) == 0
    out = capsys.readouterr().out
    assert "ok              40" in out and "timeout          0" in out
    # The built-in model drafts the synthetic language well: most first drafts are accepted.
    pos0 = next(line for line in out.splitlines() if "pos 0:" in line)
    accepted, offered = int(pos0.split()[2]), int(pos0.split()[4])
    assert offered > 0 and accepted / offered > 0.5


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


@pytest.mark.parametrize("content,why", [(b"1 2 x", "not whitespace-separated integers"),
                                         (b"\x01\x02\x03", "not a whole number of int32"),
                                         (b"1", "need more than --order 2")])
def test_markov_build_bad_input_exits_2_naming_the_file(tmp_path, capsys, content, why):
    path = tmp_path / ("t.txt" if b" " in content or content == b"1" else "t.bin")
    path.write_bytes(content)
    assert main(["markov", "build", str(path), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and why in err


@pytest.mark.parametrize("mutate,why", [(lambda b: b"XXXX" + b[4:], "bad magic"),
                                        (lambda b: b[:-1], "header says"),
                                        (lambda b: b[:6] + b"\x00\x00" + b[8:], "order 0")])
def test_corrupt_markov_cache_is_refused(mutate, why):
    with pytest.raises(ValueError, match=why):
        MarkovModel.from_bytes(mutate(builtin_model().to_bytes()), "cache")


def test_bad_arguments_exit_2_with_usage():
    out = subprocess.run([sys.executable, "-m", "remote_dspark", "demo", "--rounds", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--rounds: 0 must be >= 1" in out.stderr


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "remote_dspark", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    for command in ("worker", "demo", "check-config", "markov", "bench"):
        assert command in out

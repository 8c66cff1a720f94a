"""``remote-dspark bench acceptance``: its arguments, and a tiny real run on the CPU where
the drafter is the target: a worker keeping whole streams accepts (nearly) every draft
along a sequence ten windows long, through a loopback worker. No timed assertions."""

from __future__ import annotations

import json

import pytest

from remote_dspark.cli import main as cli


def test_bad_arguments_name_the_flag(capsys):
    for argv, culprit in (
        (["--window", "0"], "--window 0"),
        (["--tokens", "0"], "--tokens 0"),
        (["--max-context", "most"], "'most' is not 'default' or a number >= 2"),
        (["--max-context", "1"], "'1' is not"),
        (["--hf-random", "gpt2:1x65"], "--hf-random 'gpt2:1x65'"),
    ):
        assert cli.main(["bench", "acceptance", *argv]) == 2
        assert culprit in capsys.readouterr().err


@pytest.mark.slow
def test_the_target_as_drafter_is_accepted_along_the_whole_sequence(capsys):
    pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
    argv = ["--hf-random", "gpt2:2x64", "--window", "8", "--tokens", "80", "--sequences", "2", "--device", "cpu"]
    assert cli.main(["bench", "acceptance", *argv, "--max-context", "default,16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    whole, short = report["rows"]
    assert (whole["max_context"], short["max_context"]) == (2048, 16)
    assert whole["acceptance"] >= 0.95 and whole["past_window"] >= 0.95 and whole["offered"] > 0
    assert short["past_window"] < whole["past_window"]  # 16 tokens of a stream: less history than the target's
    assert [g["value"] for g in report["goals"]] == [whole["acceptance"]]  # a goal where the whole sequence is kept

"""``remote-dspark bench acceptance``: its arguments, and a tiny real run on the CPU where
the drafter is the target: rows holding the whole sequence accept (nearly) every draft,
through a loopback worker. No timed assertions."""

from __future__ import annotations

import json

import pytest

from remote_dspark.cli import main as cli


def test_bad_arguments_name_the_flag(capsys):
    for argv, culprit in (
        (["--window", "0"], "--window 0"),
        (["--contexts", "0"], "--contexts 0"),
        (["--row-tokens", "most"], "'most' is not 'default', 'whole' or a number over --window"),
        (["--row-tokens", "64"], "'64' is not"),
        (["--hf-random", "gpt2:1x65"], "--hf-random 'gpt2:1x65'"),
    ):
        assert cli.main(["bench", "acceptance", *argv]) == 2
        assert culprit in capsys.readouterr().err


@pytest.mark.slow
def test_the_target_as_drafter_is_accepted_along_the_whole_sequence(capsys):
    pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
    argv = ["--hf-random", "gpt2:2x64", "--window", "8", "--contexts", "3", "--sequences", "2", "--device", "cpu"]
    assert cli.main(["bench", "acceptance", *argv, "--row-tokens", "default,whole,40", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    default, whole, forty = report["rows"]
    assert (default["row_tokens"], whole["row_tokens"], forty["row_tokens"]) == (32, 8 + 3 * 8 + 5 + 1, 40)
    assert whole["acceptance"] >= 0.95 and len(whole["by_window"]) == 3 and whole["offered"] > 0
    # a goal for each row size that holds the whole sequence and its drafts
    assert [g["value"] for g in report["goals"]] == [whole["acceptance"], forty["acceptance"]]

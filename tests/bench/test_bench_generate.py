"""``remote-dspark bench generate``: its arguments, and a tiny real run on the CPU: a
random target and its first layer as the draft, the four modes on the same prompts. Every
mode generates the target's own tokens; the in-process assistant and the remote drafter
draft the same (equal acceptance, equal target forwards). No timed assertions."""

from __future__ import annotations

import json

import pytest

from remote_dspark.cli import main as cli


def test_bad_arguments_name_the_flag(capsys):
    for argv, culprit in (
        (["--target", "/nowhere"], "--target and --draft go together"),
        (["--prompts", "0"], "--prompts 0: must be in 1..1000"),
        (["--new-tokens", "100000"], "--new-tokens 100000"),
        (["--modes", "plain,fast"], "--modes 'plain,fast': choose from plain, assistant, sync, process"),
        (["--random", "gpt2:2x64", "--draft-layers", "2"], "--draft-layers 2: the target gpt2:2x64 has 2 layers"),
    ):
        assert cli.main(["bench", "generate", "--device", "cpu", *argv]) == 2
        assert culprit in capsys.readouterr().err


@pytest.mark.slow
def test_every_mode_generates_the_targets_tokens_and_both_assistants_draft_alike(capsys):
    pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
    argv = ["--random", "gpt2:2x64", "--draft-layers", "1", "--prompts", "2", "--new-tokens", "24", "--device", "cpu"]
    assert cli.main(["bench", "generate", *argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["plain", "assistant", "sync", "process"]
    assert all(r["same_tokens_as_plain"] and r["tokens"] == 48 for r in rows.values())
    assert rows["plain"]["target_forwards_per_token"] == 1.0 and rows["plain"]["acceptance"] is None
    remote = rows["sync"], rows["process"]
    assert all(r["round_ms"] > 0 and r["acceptance"] == rows["assistant"]["acceptance"] for r in remote)
    assert all(r["target_forwards_per_token"] == rows["assistant"]["target_forwards_per_token"] for r in remote)
    assert rows["assistant"]["target_forwards_per_token"] < 1.0  # the draft was of use
    assert [g["goal"] for g in report["goals"]] == ["process wall time / assistant's <= 1.1x"]

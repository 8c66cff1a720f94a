"""``remote-dspark bench generate``: its arguments, and a tiny real run on the CPU: a
random target and its first layer as the draft, the four modes on the same prompts. Every
mode generates the target's own tokens; the in-process assistant and the remote drafter
draft the same (equal acceptance, equal target forwards). ``--sample``'s rows on tiny
models of peaked distributions: every sampled path accepts drafts, and the report gives
their ratio. No timed assertions."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_llama

from remote_dspark.cli import main as cli


def test_bad_arguments_name_the_flag(capsys):
    for argv, culprit in (
        (["--target", "/nowhere"], "--target and --draft go together"),
        (["--prompts", "0"], "--prompts 0: must be in 1..1000"),
        (["--new-tokens", "100000"], "--new-tokens 100000"),
        (["--modes", "plain,fast"], "--modes 'plain,fast': choose from plain, assistant, sync, process, assistant-"),
        (["--sample", "--num-spec", "17"], "--num-spec 17: sampled drafts take at most 16 a round"),
        (["--redraw", "--num-spec", "17"], "--num-spec 17: sampled drafts take at most 16 a round"),
        (["--redraw", "--temperature", "0"], "--temperature 0.0: must be a finite number > 0"),
        (["--random", "gpt2:2x64", "--draft-layers", "3"], "--draft-layers 3: the target gpt2:2x64 has 2 layers"),
    ):
        assert cli.main(["bench", "generate", "--device", "cpu", *argv]) == 2
        assert culprit in capsys.readouterr().err


@pytest.mark.slow
def test_every_mode_generates_the_targets_tokens_and_both_assistants_draft_alike(capsys):
    pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
    argv = ["--random", "gpt2:2x64", "--draft-layers", "1", "--prompts", "2", "--new-tokens", "24", "--device", "cpu"]
    argv += ["--modes", "plain,assistant,sync,process,process-spec", "--speculate", "4"]
    assert cli.main(["bench", "generate", *argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["plain", "assistant", "sync", "process", "process-spec"]
    assert all(r["same_tokens_as_plain"] and r["tokens"] == 48 for r in rows.values())
    # process-spec: process against a worker that pre-drafts, in the same run: the same
    # tokens, its round and hit share (None until the worker exports its hits), its goals.
    spec = rows.pop("process-spec")
    assert spec["same_tokens_as_process"] is True and spec["round_ms"] > 0 and rows["process"]["hit_share"] is None
    assert spec["hit_share"] is None or 0 <= spec["hit_share"] <= 1
    assert [g["goal"] for g in report["goals"][1:]] == [
        "process-spec: rounds that hit >= 60%",
        "process-spec: process's mean round / its own >= 2x",
        "process-spec: the same tokens as process",
    ]
    assert rows["plain"]["target_forwards_per_token"] == 1.0 and rows["plain"]["acceptance"] is None
    remote = rows["sync"], rows["process"]
    assert all(r["round_ms"] > 0 and r["acceptance"] == rows["assistant"]["acceptance"] for r in remote)
    assert all(r["target_forwards_per_token"] == rows["assistant"]["target_forwards_per_token"] for r in remote)
    assert rows["assistant"]["target_forwards_per_token"] < 1.0  # the draft was of use
    assert report["goals"][0]["goal"] == "process wall time / assistant's <= 1.1x"
    assert report["ratios"] == []
    assert all(r["tokens_per_forward"] == round(1 + r["accepted_per_round"], 3) for r in rows.values())


@pytest.mark.slow
def test_the_target_itself_as_the_draft_accepts_every_draft_past_the_window_and_the_goal_says_so(capsys):
    """``--draft-layers`` as many as the target's: the draft is the target. Its tokens run
    past the worker's 64-token window (32 + 80), the worker at its default flags keeps
    whole streams: every draft accepted, plain's tokens, and the goal line computed from
    the row."""
    pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
    argv = ["--random", "gpt2:2x64", "--draft-layers", "2", "--prompts", "1", "--new-tokens", "80"]
    assert cli.main(["bench", "generate", *argv, "--modes", "plain,sync", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["models"] == "gpt2:2x64 / the target itself"
    sync = {r["mode"]: r for r in report["rows"]}["sync"]
    assert sync["same_tokens_as_plain"] and sync["acceptance"] >= 0.95
    (goal,) = report["goals"]
    assert goal == {
        "goal": "sync: acceptance >= 0.95 and the same tokens as plain (the draft is the target)",
        "value": sync["acceptance"],
        "met": True,
    }


def saved_llama(path, seed: int) -> str:
    """A tiny Llama of 64 ids saved in ``path`` (wide weights: peaked next-token
    distributions, so a draft's top 32 ids hold nearly all of its mass)."""
    tiny_llama(seed, 64).save_pretrained(path)
    return str(path)


@pytest.mark.slow
def test_sample_rows_compare_the_remote_sampled_drafts_with_transformers_own_assistant(capsys, tmp_path):
    pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
    target, draft = saved_llama(tmp_path / "target", 0), saved_llama(tmp_path / "draft", 0)
    argv = ["--target", target, "--draft", draft, "--modes", "plain,sync", "--sample", "--prompts", "2"]
    assert cli.main(["bench", "generate", *argv, "--new-tokens", "24", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["plain", "sync", "assistant-sample", "sync-sample", "process-sample"]
    assert rows["sync"]["same_tokens_as_plain"] and all(r["tokens"] == 48 for r in rows.values())
    sampled = rows["assistant-sample"], rows["sync-sample"], rows["process-sample"]
    assert all(r["same_tokens_as_plain"] is None and r["accepted_per_round"] > 1 for r in sampled)  # its own weights
    assert rows["sync-sample"]["round_ms"] > 0 and rows["process-sample"]["round_ms"] > 0
    assert rows["assistant-sample"]["round_ms"] is None
    (ratio,) = report["ratios"]
    assert ratio["value"] == round(sampled[1]["accepted_per_round"] / sampled[0]["accepted_per_round"], 3)


@pytest.mark.slow
def test_redraw_adds_the_row_of_an_engine_that_redraws_and_its_cost(capsys, tmp_path):
    """``--redraw``: ``sync-sample-redraw`` beside ``sync-sample`` at ``--temperature``,
    and the ratio of their accepted drafts per round. The draft is the target itself, so
    drafts are accepted either way."""
    pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
    target = saved_llama(tmp_path / "target", 0)
    argv = ["--target", target, "--draft", target, "--modes", "sync-sample", "--redraw", "--temperature", "0.5"]
    assert cli.main(["bench", "generate", *argv, "--prompts", "2", "--new-tokens", "24", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["sync-sample", "sync-sample-redraw"] and report["config"]["temperature"] == 0.5
    assert all(r["tokens"] == 48 and r["accepted_per_round"] > 0 for r in rows.values())
    (ratio,) = report["ratios"]
    ours, theirs = rows["sync-sample-redraw"]["accepted_per_round"], rows["sync-sample"]["accepted_per_round"]
    assert ratio["value"] == round(ours / theirs, 3)

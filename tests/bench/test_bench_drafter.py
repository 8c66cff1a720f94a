"""``remote-dspark bench drafter``: its arguments, the worker's rounds it drafts, and its
JSON from a tiny real run on the CPU. No timed assertions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from remote_dspark.bench import drafter as bd
from remote_dspark.cli import main as cli


def test_rounds_are_the_workers_own_streams():
    rounds = bd.worker_rounds(3, 30, num_spec=4)
    first, last = rounds[0], rounds[-1]
    # The first announces every slot with a prompt; later ones append STEP_TOKENS each.
    assert first.lengths.tolist() == [bd.PROMPT_TOKENS] * 3 and first.gens.tolist() == [1, 1, 1]
    assert last.lengths.tolist() == [bd.PROMPT_TOKENS + 29 * bd.STEP_TOKENS] * 3
    assert last.gens.tolist() == [1, 1, 1] and last.slots.tolist() == [0, 1, 2]
    # Contexts grow to the window, then slide.
    assert np.diff(rounds[5].offsets).tolist() == [bd.PROMPT_TOKENS + 5 * bd.STEP_TOKENS] * 3
    assert np.diff(last.offsets).tolist() == [bd.WINDOW] * 3
    assert len({r.session for r in rounds}) == 1 and last.width == 4


def test_bad_arguments_name_the_flag(capsys):
    for argv, culprit in (
        (["--entries", "0"], "--entries 0"),
        (["--entries", "a"], "--entries 'a'"),
        (["--devices", "tpu"], "unknown device 'tpu'"),
        (["--rounds", "0"], "--rounds 0"),
        (["--num-spec", "0"], "--num-spec 0"),
    ):
        assert cli.main(["bench", "drafter", *argv]) == 2
        assert culprit in capsys.readouterr().err


def test_a_tiny_run_reports_every_row_and_its_ratios(capsys):
    rc = cli.main(
        [
            "bench",
            "drafter",
            "--entries",
            "1,4",
            "--devices",
            "cpu",
            "--rounds",
            "2",
            "--warmup",
            "0",
            "--num-spec",
            "3",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out)
    rows = {(r["device"], r["entries"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {("cpu", n, m) for n in (1, 4) for m in bd.MODES}
    for (_, n, _), r in rows.items():
        assert r["rounds"] == 2 and 0 < r["p50_ms"] <= r["p99_ms"]
        # tokens_per_s is rounded to a whole token
        assert r["tokens_per_s"] == pytest.approx(n * 3 / (r["p50_ms"] / 1e3), rel=0.01, abs=0.5)
    for ratio in report["ratios"]:
        key = ("cpu", ratio["entries"])
        assert ratio["batched_x_per_entry"] == round(
            rows[key + ("per-entry",)]["p50_ms"] / rows[key + ("batched",)]["p50_ms"], 2
        )
    assert report["goals"] == []  # the goal is a CUDA one


def test_a_random_transformers_model_is_named_by_its_shape_and_bad_shapes_are_refused(capsys):
    from remote_dspark.bench.hf_models import parse_random

    assert parse_random("gpt2:12x768") == ("gpt2", 12, 768)
    for spec, culprit in (
        ("gpt2", "expected KIND:LAYERSxWIDTH"),
        ("bert:2x128", "unknown kind 'bert'"),
        ("llama:2x100", "a multiple of 64"),
        ("gpt2:0x128", "layers 1..64"),
    ):
        with pytest.raises(ValueError, match=culprit):
            parse_random(spec)
    assert cli.main(["bench", "drafter", "--hf-random", "gpt2:x"]) == 2
    assert "--hf-random 'gpt2:x'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_transformers_model_gets_its_rows_beside_the_built_in_models(capsys):
    pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
    argv = ["--entries", "2", "--devices", "cpu", "--rounds", "2", "--warmup", "0", "--num-spec", "2"]
    assert cli.main(["bench", "drafter", *argv, "--hf-random", "llama:1x64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(r["drafter"], r["mode"]) for r in report["rows"]}
    assert rows == {(d, m) for d in ("lm", "llama:1x64") for m in bd.MODES}
    assert all(r["device"] == "cpu" and r["entries"] == 2 and r["p50_ms"] > 0 for r in report["rows"])
    assert {r["drafter"] for r in report["ratios"]} == {"lm", "llama:1x64"}
    assert report["goals"] == []  # the transformers goals are at 64 (CPU) and 256 (CUDA) entries

"""Names meant for this package that it does not read: each is named once, with the
closest known name; the host engine's own VLLM_DSPARK_* names are left alone."""

from __future__ import annotations

import logging

import pytest

from remote_dspark.config import RemoteConfig
from remote_dspark.config.names import unknown_variables

P = "VLLM_DSPARK_REMOTE_"
BASE = {"VLLM_DSPARK_REMOTE": "tcp://127.0.0.1:18620", P + "IDENTITY": "ab" * 32}


@pytest.mark.parametrize(
    "name,suggested",
    [
        (P + "TIMEOUT", P + "TIMEOUT_MS"),  # the issue's: ignored in silence before
        (P + "CONECT_TIMEOUT_MS", P + "CONNECT_TIMEOUT_MS"),
        (P + "ASYNC_PROXI", P + "ASYNC_PROXY"),
        ("VLLM_DSPARK_MARKOV_CACHES", "VLLM_DSPARK_MARKOV_CACHE"),
        ("VLLM_DSPARK_SAMPLED_TOP_32", "VLLM_DSPARK_SAMPLED_TOP32"),
        ("VLLM_DSPARK_REMOT_TIMEOUT_MS", P + "TIMEOUT_MS"),
        ("VLLM_DSPARK_REMOT", "VLLM_DSPARK_REMOTE"),
        ("vllm_dspark_remote_policy", P + "POLICY"),  # names are case-sensitive
    ],
)
def test_a_misspelling_is_named_with_the_closest_known_name(name, suggested):
    warnings = unknown_variables({**BASE, name: "50"})
    assert len(warnings) == 1 and warnings[0].startswith(name + " ") and f"did you mean {suggested}?" in warnings[0]


def test_an_unknown_remote_name_is_named_even_with_nothing_close():
    (warning,) = unknown_variables({**BASE, P + "ZZZZZZZZ": "1"})
    assert warning.startswith(P + "ZZZZZZZZ is not a variable") and "did you mean" not in warning


@pytest.mark.parametrize(
    "name",
    [
        "VLLM_DSPARK_DEPTH_POLICY",  # the host engine's, which this package knows of
        "VLLM_DSPARK_DRAFT_MS",  # close to REMOTE_DRAFT_MS, but the host engine's
        "VLLM_DSPARK_ROUND_MS",
        "VLLM_DSPARK_DEPTH_FILE",
        "VLLM_DSPARK_SAMPLED_TOP16",  # another host name, not close enough to ours
        "VLLM_DSPARK_SOMETHING_ELSE",
        P + "ASYNC_NAP_US",  # known
        "VLLM_DSPARK_SAMPLED_TOP32",
        "OTHER_REMOTE_TIMEOUT",
    ],
)
def test_the_host_engines_names_and_known_ones_are_left_alone(name):
    assert unknown_variables({**BASE, name: "1"}) == []


def test_log_warnings_names_each_once_on_the_config_logger(caplog):
    env = {**BASE, P + "TIMEOUT": "50", "VLLM_DSPARK_DEPTH_POLICY": "conf"}
    with caplog.at_level(logging.WARNING, logger="remote_dspark.config"):
        RemoteConfig.from_env(env).log_warnings(env)
    lines = [r.getMessage() for r in caplog.records if r.name == "remote_dspark.config"]
    assert len(lines) == 1 and P + "TIMEOUT is not" in lines[0] and P + "TIMEOUT_MS" in lines[0], lines

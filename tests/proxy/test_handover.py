"""The hand-over from the engine to a proxy it spawns: what one half writes the other
reads back whole, and both hold the document to one cap."""

import os

import pytest

from remote_dspark.config import RemoteConfig
from remote_dspark.proxy import handover

ENV = {
    "VLLM_DSPARK_REMOTE": "tcp://127.0.0.1:9",
    "VLLM_DSPARK_REMOTE_IDENTITY": "ab" * 32,
    "VLLM_DSPARK_REMOTE_POLICY": "capacity",
}


def test_what_the_engine_writes_the_proxy_reads():
    cfg = RemoteConfig.from_env(ENV)
    fd = handover.write(cfg, engine_id=7, vocab_size=32000)
    got = handover.read(fd)
    assert got == handover.Handover(cfg, 7, 32000)
    with pytest.raises(OSError):
        os.fstat(fd)  # read() closed it: the proxy keeps no fd of the engine's


def test_a_document_over_the_cap_is_refused_by_either_half(monkeypatch):
    cfg = RemoteConfig.from_env(ENV)
    monkeypatch.setattr(handover, "CAP", 64)
    with pytest.raises(OSError, match=r"bytes, over the cap"):
        handover.write(cfg, engine_id=7)
    r, w = os.pipe()
    os.write(w, b"{" + b" " * 100 + b"}")
    os.close(w)
    with pytest.raises(ValueError, match=rf"hand-over fd {r}: over 64 bytes"):
        handover.read(r)


def test_a_vocabulary_beyond_the_wire_is_not_the_engines_document():
    r, w = os.pipe()
    cfg = RemoteConfig.from_env(ENV)
    os.write(w, b'{"engine_id": 1, "vocab_size": -1, "config": ' + cfg.to_json().encode() + b"}")
    os.close(w)
    with pytest.raises(ValueError, match="not the engine's document.*vocab_size -1"):
        handover.read(r)

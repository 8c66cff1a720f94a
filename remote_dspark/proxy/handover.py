"""The hand-over: what the engine gives a proxy it spawns, through a pipe rather than
argv or the environment, so the proxy runs on the engine's validated configuration and
never re-parses it. Both halves live here: :func:`write` in the engine,
:func:`read` in the proxy.

The document is JSON: ``{"engine_id": int, "vocab_size": int, "config": {...}}``, the
configuration as :meth:`RemoteConfig.to_json` writes it. With
``VLLM_DSPARK_REMOTE_KEY_FILE`` set, the configuration holds the pre-shared key itself:
this pipe is how the key reaches the proxy and the standby, so it is never on a command
line (any local user reads it in ``/proc``) or in an environment (every child inherits
it), and the proxy never opens the key file.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

from .. import wire
from ..config.api import RemoteConfig

# The document is written whole before the proxy starts, so it must fit a pipe's buffer
# (64 KiB on Linux); the reader holds the writer to the same cap.
CAP = 65535


class Handover(NamedTuple):
    """What the engine hands its proxy (:func:`write` makes it, :func:`read` takes it)."""

    cfg: RemoteConfig
    engine_id: int
    vocab_size: int  # the engine's vocabulary, for HELLO and the reply checks; 0: unknown


def read(fd: int) -> Handover:
    """The engine's validated configuration, its engine id and its vocabulary size, from
    the pipe it wrote them into before the spawn (and closed): never re-parsed from the
    environment, so the proxy cannot disagree with its engine.

    Raises:
        ValueError: not the engine's document (too long, not JSON, fields missing).
    """
    chunks, size = [], 0
    with os.fdopen(fd, "rb", closefd=True) as f:
        while chunk := f.read(65536):
            size += len(chunk)
            if size > CAP:
                raise ValueError(f"hand-over fd {fd}: over {CAP} bytes")
            chunks.append(chunk)
    try:
        doc = json.loads(b"".join(chunks))
        vocab_size = int(doc["vocab_size"])
        if not 0 <= vocab_size <= wire.MAX_VOCAB:
            raise ValueError(f"vocab_size {vocab_size} not in 0..{wire.MAX_VOCAB}")
        return Handover(RemoteConfig.from_json(json.dumps(doc["config"])), int(doc["engine_id"]), vocab_size)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"hand-over fd {fd}: not the engine's document ({e})") from e


def write(cfg: RemoteConfig, engine_id: int, vocab_size: int = 0) -> int:
    """A pipe holding the engine's validated configuration (``RemoteConfig``), its id and
    its vocabulary size (0: unknown), its write end closed: the read end, for the proxy to
    inherit (``--handover``; :func:`read`). The document is written whole
    before the proxy starts (it fits the pipe's buffer), so neither side ever waits on the
    other.

    Raises:
        OSError: no pipe, or a document too large for one.
    """
    doc = json.dumps({"engine_id": engine_id, "vocab_size": vocab_size, "config": json.loads(cfg.to_json())}).encode()
    if len(doc) > CAP:
        raise OSError(f"the proxy's hand-over document is {len(doc)} bytes, over the cap a pipe's buffer holds")
    r, w = os.pipe()
    try:
        os.write(w, doc)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r

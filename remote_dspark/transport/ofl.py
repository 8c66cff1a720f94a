"""The ofl adapter: ``o1tcp://`` and ``o1rdma://`` through the ofl library
(a Python adapter module and ``libofl.so``, provided beside the engine).

``VLLM_DSPARK_REMOTE_OFL_DIR`` names a directory holding ``ofl.py`` and ``libofl.so``.
The adapter loads ``ofl.py`` as a module (under a private name, so it never shadows
anything) and expects this interface of it::

    connect(host: str, port: int, *, mode: str, bind: str | None, timeout_s: float,
            lib: str) -> conn
        mode is "tcp" (o1tcp) or "rdma" (o1rdma); lib is the path of libofl.so.
        Raises OSError (or a subclass) when no connection is made in time.
    conn.sendmsg(buffers) -> None
        sends every byte of the buffers, in order (buffers may be memoryviews of
        shared memory; the adapter never copies them first).
    conn.recv_into(view, timeout_s) -> int
        reads at least one byte into view within timeout_s, returns the count;
        0 = the peer closed; raises TimeoutError at the deadline, OSError on failure.
    conn.close() -> None

That is the same :class:`~remote_dspark.transport.ByteStream` the TCP transport gives,
so frames, caps and deadlines are handled once, above both.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from types import ModuleType

from ..trust import untrusted_because
from .endpoint import ENV_OFL_DIR, Endpoint
from .errors import TransportError

_loaded: dict[str, ModuleType] = {}


def load_ofl(directory: str) -> ModuleType:
    """Load ``ofl.py`` from ``directory`` (once per directory).

    Raises:
        ValueError: naming VLLM_DSPARK_REMOTE_OFL_DIR when it is unset, not a
            directory, lacks ofl.py or libofl.so, or ofl.py fails to import or lacks
            ``connect``.
    """
    directory = directory.strip()
    if not directory:
        raise ValueError(
            f"{ENV_OFL_DIR} is not set: o1tcp:// and o1rdma:// endpoints need "
            "the directory holding ofl.py and libofl.so"
        )
    if not os.path.isdir(directory):
        raise ValueError(f"{ENV_OFL_DIR}={directory!r}: not a directory")
    missing = [f for f in ("ofl.py", "libofl.so") if not os.path.isfile(os.path.join(directory, f))]
    if missing:
        raise ValueError(f"{ENV_OFL_DIR}={directory!r}: missing {' and '.join(missing)}")
    for f in ("ofl.py", "libofl.so"):
        why = untrusted_because(os.path.join(directory, f))
        if why:
            raise ValueError(f"{ENV_OFL_DIR}={directory!r}: refusing to load {f}: {why}")
    key = os.path.realpath(directory)
    if key in _loaded:
        return _loaded[key]
    spec = importlib.util.spec_from_file_location(
        f"_remote_dspark_ofl_{len(_loaded)}", os.path.join(directory, "ofl.py")
    )
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"{ENV_OFL_DIR}={directory!r}: ofl.py failed to import: {e!r}") from e
    if not callable(getattr(module, "connect", None)):
        raise ValueError(f"{ENV_OFL_DIR}={directory!r}: ofl.py has no connect()")
    module.LIB_PATH = os.path.join(directory, "libofl.so")
    _loaded[key] = module
    return module


class OflStream:
    """A :class:`~remote_dspark.transport.ByteStream` over an ofl connection."""

    def __init__(self, conn):
        self.conn = conn

    @classmethod
    def connect(cls, module: ModuleType, endpoint: Endpoint, timeout_s: float) -> OflStream:
        mode = {"o1tcp": "tcp", "o1rdma": "rdma"}[endpoint.scheme]
        try:
            conn = module.connect(
                endpoint.host, endpoint.port, mode=mode, bind=endpoint.bind, timeout_s=timeout_s, lib=module.LIB_PATH
            )
        except OSError as e:
            raise TransportError(f"ofl connect to {endpoint} failed: {e}") from e
        return cls(conn)

    def sendmsg(self, buffers: Sequence, deadline: float | None = None) -> None:
        # The ofl interface has no send timeout: its own flow control bounds a send.
        # Empty buffers (the rows of an engine without rows) are not handed to it.
        self.conn.sendmsg([b for b in buffers if memoryview(b).nbytes])

    def recv_into(self, view: memoryview, timeout_s: float) -> int:
        return self.conn.recv_into(view, timeout_s)

    def close(self) -> None:
        self.conn.close()

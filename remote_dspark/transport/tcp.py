"""The contract's TCP stub transport: one stream socket, TCP_NODELAY, TCP keepalive, a
connect timeout, an optional bind address, per-call receive deadlines.

Keepalive on both ends (the engine's connecting socket here, the worker's accepted ones
in :mod:`remote_dspark.worker.admission`): a connection may idle for minutes between
rounds and is never closed for that, so a peer that died without a FIN (power, a cable,
a frozen VM) is found by the kernel's probes: after ``KEEPALIVE_IDLE_S`` of silence,
``KEEPALIVE_COUNT`` probes ``KEEPALIVE_INTERVAL_S`` apart, so about a minute.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Sequence

from .errors import TransportError

KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 30, 10, 3


def enable_keepalive(sock: socket.socket) -> None:
    """SO_KEEPALIVE with this module's timing, where the platform has the knobs (probed,
    not version-checked: Linux names the idle time TCP_KEEPIDLE, macOS TCP_KEEPALIVE)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))
    for opt, value in (
        (idle, KEEPALIVE_IDLE_S),
        (getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_S),
        (getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_COUNT),
    ):
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


SEND_TIMEOUT_S = 1.0  # TcpStream's default: a send's longest wait for room in the peer's window


class TcpStream:
    """A :class:`~remote_dspark.transport.ByteStream` over TCP."""

    def __init__(self, sock: socket.socket, send_timeout_s: float = SEND_TIMEOUT_S):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        # A send blocks only while the peer's window is full; past this the connection
        # is broken (a frame sent in part cannot be taken back) and the caller drops it.
        self.send_timeout_s = send_timeout_s

    @classmethod
    def connect(cls, host: str, port: int, timeout_s: float, bind: str | None = None) -> TcpStream:
        """Raises: TransportError when the connection is not made within ``timeout_s``."""
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s, source_address=(bind, 0) if bind else None)
        except OSError as e:
            raise TransportError(f"connect to {host}:{port} failed: {e}") from e
        enable_keepalive(sock)
        return cls(sock, send_timeout_s=timeout_s)

    def sendmsg(self, buffers: Sequence, deadline: float | None = None) -> None:
        """Send the buffers whole, even if the kernel takes them in pieces. ``deadline``
        (a ``time.monotonic()`` instant) bounds the whole send, not each call: a peer that
        reads a little at a time cannot hold the caller past it.

        Raises:
            TimeoutError: the send did not finish by ``deadline`` (or a call waited
                ``send_timeout_s``): part of the frame may be on the wire.
            OSError: the connection broke.
        """
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        while views:
            timeout = self.send_timeout_s
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("the send did not finish by its deadline")
                timeout = min(timeout, left)
            self.sock.settimeout(timeout)
            sent = self.sock.sendmsg(views)
            while sent and views:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def recv_into(self, view: memoryview, timeout_s: float) -> int:
        self.sock.settimeout(None if math.isinf(timeout_s) else timeout_s)
        return self.sock.recv_into(view)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

"""Transports between the proxy and the remote drafter.

Endpoints (``tcp://``, ``o1tcp://``, ``o1rdma://``) are parsed in :mod:`.endpoint`; the
errors every transport raises are in :mod:`.errors`; both are re-exported here, the
package being their public path. Every transport gives the same small byte interface
(:class:`ByteStream`); :class:`FrameChannel` turns it into whole frames with the wire
contract's caps and a per-round deadline. The transports: :mod:`.tcp` and the ofl
adapter (:mod:`.ofl`); over them, the engine's connection (:mod:`.client`), the proxy's
link (:mod:`.link`: an active connection and a spare, each a :mod:`.conn`, failover in
one round), its keeper thread (:mod:`.keeper`: spares, PINGs, reconnects with back-off)
and breaker (:mod:`.breaker`), the fleet of worker addresses an endpoint resolves to and
their rendezvous order (:mod:`.fleet`), and the pre-shared key (:mod:`.auth`). Nothing
here imports torch.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from .. import wire
from .endpoint import ENV_OFL_DIR, SCHEMES, Endpoint, check_bind, parse_endpoint  # noqa: F401 (re-exported)
from .errors import DeadlineExceeded, Disconnected, TransportError  # noqa: F401 (re-exported)


class ByteStream(Protocol):
    """What every transport provides (the ofl adapter wraps its module to this).

    ``sendmsg`` sends all bytes of ``buffers`` in order (buffers may be memoryviews of
    shared memory: they are not copied), by ``deadline`` (a ``time.monotonic()``
    instant, or None) where the transport can bound a send. ``recv_into`` reads at least one byte into
    ``view`` within ``timeout_s`` and returns how many; 0 means the peer closed. It
    raises ``TimeoutError`` at the deadline and ``OSError`` when the link breaks.
    """

    def sendmsg(self, buffers: Sequence, deadline: float | None = None) -> None: ...

    def recv_into(self, view: memoryview, timeout_s: float) -> int: ...

    def close(self) -> None: ...


class FrameChannel:
    """Whole frames over a :class:`ByteStream`, with caps checked before allocation.

    A header is checked against its type's cap and this channel's ``max_payload`` (a
    receiver's own, smaller cap: the worker sets its session's) before a byte of payload
    is read. Payloads are read into one receive buffer kept for the channel's life,
    which grows as the payload's bytes arrive (never ahead of them: a peer that
    announces a large frame and stalls costs nothing) up to the largest frame seen; the
    returned payload view is valid until the next ``recv_frame``. A deadline that passes
    mid-frame keeps what was read: the next ``recv_frame`` resumes the same frame, so a
    reply that comes late stays in step (and is then dropped as late by its round id)
    instead of breaking the stream.
    """

    GROW_MIN = 64 << 10  # the receive buffer's first growth past its 4 KiB

    def __init__(self, stream: ByteStream, max_payload: int = wire.MAX_PAYLOAD):
        self.stream = stream
        self.max_payload = max_payload
        self._hdr = bytearray(wire.HEADER.size)
        self._buf = bytearray(4096)
        self._got = 0  # bytes of the current header, then payload, read so far
        self._header: wire.Header | None = None  # the current frame's header, once whole
        self._frame_deadline = math.inf  # the current frame's own deadline (frame_timeout_s)

    def send(self, *buffers, deadline: float | None = None) -> None:
        """Send one frame given as buffers, whole, by ``deadline``.

        Raises:
            Disconnected: the send failed or missed its deadline; part of the frame may
                be on the wire, so the connection must be dropped.
        """
        try:
            self.stream.sendmsg(buffers, deadline)
        except OSError as e:
            raise Disconnected(f"send failed: {e}") from e

    def recv_frame(self, deadline: float, frame_timeout_s: float | None = None) -> tuple[wire.Header, memoryview]:
        """Read one frame by ``deadline`` (a ``time.monotonic()`` instant; ``math.inf``:
        no limit). With ``frame_timeout_s`` a frame, once its header is in, must be whole
        within that many seconds whatever ``deadline`` says.

        Raises:
            DeadlineExceeded, Disconnected, wire.ProtocolError.
        """
        if self._header is None:
            self._fill(memoryview(self._hdr), deadline)
            self._got = 0
            self._header = self.check_header(self._hdr)
            self._frame_deadline = math.inf if frame_timeout_s is None else time.monotonic() + frame_timeout_s
        header = self._header
        size = header.payload_len
        deadline = min(deadline, self._frame_deadline)
        while self._got < size:
            if self._got == len(self._buf):
                self._grow(min(size, max(2 * len(self._buf), self.GROW_MIN)))
            self._fill(memoryview(self._buf)[: min(size, len(self._buf))], deadline)
        self._header, self._got = None, 0
        return header, memoryview(self._buf)[:size]

    def check_header(self, raw) -> wire.Header:
        """A received header (``wire.HEADER.size`` bytes) held to its type's cap and this
        channel's ``max_payload``. Raises: wire.ProtocolError naming what it breaks."""
        header = wire.decode_header(raw)
        if header.payload_len > self.max_payload:
            raise wire.ProtocolError(
                f"{header.name} payload of {header.payload_len} bytes exceeds this connection's cap {self.max_payload}"
            )
        return header

    def _grow(self, size: int) -> None:
        """A larger receive buffer holding what the current payload has so far."""
        buf = bytearray(size)
        buf[: self._got] = memoryview(self._buf)[: self._got]
        self._buf = buf

    def _fill(self, view: memoryview, deadline: float) -> None:
        """Read into ``view`` from ``self._got`` until it is full."""
        want = len(view)
        while self._got < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"deadline passed with {self._got} of {want} bytes read")
            try:
                n = self.stream.recv_into(view[self._got :], left)
            except TimeoutError as e:
                raise DeadlineExceeded(f"deadline passed with {self._got} of {want} bytes read") from e
            except OSError as e:
                raise Disconnected(f"receive failed: {e}") from e
            if n == 0:
                raise Disconnected("peer closed the connection")
            self._got += n

    @property
    def mid_frame(self) -> bool:
        """Part of a frame was read (a deadline passed in it): another reader of the
        socket would start in its middle."""
        return self._got > 0 or self._header is not None

    def close(self) -> None:
        self.stream.close()


def connect(
    endpoint: Endpoint, timeout_s: float, environ: Mapping[str, str] | None = None, address=None
) -> FrameChannel:
    """Open a :class:`FrameChannel` to ``endpoint`` within ``timeout_s``; on TCP, to
    ``address`` (a :class:`~remote_dspark.transport.fleet.Address`: a literal IP, so no
    name is resolved here) when given.

    Raises:
        ValueError: an ofl endpoint without a usable ``VLLM_DSPARK_REMOTE_OFL_DIR``.
        TransportError: the connection could not be made in time.
    """
    if endpoint.scheme == "tcp":
        from .tcp import TcpStream

        host, port = (endpoint.host, endpoint.port) if address is None else (address.host, address.port)
        return FrameChannel(TcpStream.connect(host, port, timeout_s, endpoint.bind))
    from .ofl import OflStream, load_ofl

    env = os.environ if environ is None else environ
    module = load_ofl(env.get(ENV_OFL_DIR, ""))
    return FrameChannel(OflStream.connect(module, endpoint, timeout_s))


def check_ready(endpoint: Endpoint, environ: Mapping[str, str] | None = None) -> None:
    """Fail at start, not at the first round: an ofl endpoint needs its library.

    Raises:
        ValueError: naming ``VLLM_DSPARK_REMOTE_OFL_DIR`` and what is missing.
    """
    if endpoint.scheme != "tcp":
        from .ofl import load_ofl

        env = os.environ if environ is None else environ
        load_ofl(env.get(ENV_OFL_DIR, ""))

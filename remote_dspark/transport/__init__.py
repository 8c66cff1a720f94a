"""Transports between the proxy and the remote drafter.

An endpoint is ``tcp://HOST:PORT`` (the contract's TCP stub, :mod:`.tcp`) or
``o1tcp://`` / ``o1rdma://`` (lane O1's ofl library, :mod:`.ofl`), each with an optional
``?bind=IPV4`` naming this side's address. Every transport gives the same small byte
interface (:class:`ByteStream`); :class:`FrameChannel` turns it into whole frames with
the wire contract's caps and a per-round deadline. Nothing here imports torch.
"""

from __future__ import annotations

import ipaddress
import os
import time
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence
from urllib.parse import parse_qsl

from .. import wire

SCHEMES = ("tcp", "o1tcp", "o1rdma")
ENV_OFL_DIR = "VLLM_DSPARK_REMOTE_OFL_DIR"


class TransportError(Exception):
    """The connection failed; the caller reconnects (with back-off)."""


class DeadlineExceeded(TransportError):
    """No (complete) answer before the deadline."""


class Disconnected(TransportError):
    """The peer closed the connection or it broke."""


@dataclass
class Endpoint:
    scheme: str
    host: str
    port: int
    options: dict[str, str] = field(default_factory=dict)

    @property
    def bind(self) -> str | None:
        return self.options.get("bind") or None

    def __str__(self) -> str:
        q = "&".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}" + (f"?{q}" if q else "")


def parse_endpoint(raw: str, name: str = "VLLM_DSPARK_REMOTE") -> Endpoint:
    """Parse ``SCHEME://HOST:PORT[?bind=IPV4]``.

    Raises:
        ValueError: naming ``name`` and the value, and what is wrong (scheme, host,
            port, option).
    """
    text = raw.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise ValueError(f"{name}={raw!r}: expected SCHEME://HOST:PORT with SCHEME one of {SCHEMES}")
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{name}={raw!r}: unknown scheme {scheme!r}, expected one of {SCHEMES}")
    hostport, _, query = rest.partition("?")
    hostport = hostport.rstrip("/")
    if hostport.startswith("["):
        host, bracket, port_s = hostport[1:].partition("]")
        if not bracket or not port_s.startswith(":"):
            raise ValueError(f"{name}={raw!r}: bad bracketed IPv6 host")
        port_s = port_s[1:]
    else:
        host, colon, port_s = hostport.rpartition(":")
        if not colon:
            raise ValueError(f"{name}={raw!r}: missing :PORT")
    if not host or any(c in host for c in "/@ "):
        raise ValueError(f"{name}={raw!r}: missing or malformed host {host!r}")
    if not port_s.isdigit():
        raise ValueError(f"{name}={raw!r}: port {port_s!r} is not a number")
    port = int(port_s)
    if not 1 <= port <= 65535:
        raise ValueError(f"{name}={raw!r}: port {port} outside 1..65535")
    options: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key != "bind":
            raise ValueError(f"{name}={raw!r}: unknown option {key!r} (only 'bind' is known)")
        try:
            options["bind"] = check_bind(value, "?bind")
        except ValueError as e:
            raise ValueError(f"{name}={raw!r}: {e}") from None
    return Endpoint(scheme, host, port, options)


def check_bind(value: str, name: str) -> str:
    """A bind address is a literal IPv4 address of this host's direct link."""
    try:
        return str(ipaddress.IPv4Address(value.strip()))
    except ValueError as e:
        raise ValueError(f"{name}={value!r}: not an IPv4 address") from e


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

    Frames are read into one receive buffer that grows to the largest frame seen (never
    beyond ``wire.MAX_PAYLOAD``); the returned payload view is valid until the next
    ``recv_frame``. A deadline that passes mid-frame keeps what was read: the next
    ``recv_frame`` resumes the same frame, so a reply that comes late stays in step
    (and is then dropped as late by its round id) instead of breaking the stream.
    """

    def __init__(self, stream: ByteStream):
        self.stream = stream
        self._hdr = bytearray(wire.HEADER.size)
        self._buf = bytearray(4096)
        self._got = 0                          # bytes of the current frame read so far
        self._header: wire.Header | None = None  # the current frame's header, once whole

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

    def recv_frame(self, deadline: float) -> tuple[wire.Header, memoryview]:
        """Read one frame by ``deadline`` (a ``time.monotonic()`` instant).

        Raises:
            DeadlineExceeded, Disconnected, wire.ProtocolError.
        """
        if self._header is None:
            self._fill(memoryview(self._hdr), deadline)
            header = wire.decode_header(self._hdr)
            if header.payload_len > len(self._buf):
                self._buf = bytearray(header.payload_len)
            self._header, self._got = header, 0
        header = self._header
        view = memoryview(self._buf)[:header.payload_len]
        self._fill(view, deadline)
        self._header, self._got = None, 0
        return header, view

    def _fill(self, view: memoryview, deadline: float) -> None:
        want = len(view)
        while self._got < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"deadline passed with {self._got} of {want} bytes read")
            try:
                n = self.stream.recv_into(view[self._got:], left)
            except TimeoutError as e:
                raise DeadlineExceeded(f"deadline passed with {self._got} of {want} bytes read") from e
            except OSError as e:
                raise Disconnected(f"receive failed: {e}") from e
            if n == 0:
                raise Disconnected("peer closed the connection")
            self._got += n
        self._got = 0

    def close(self) -> None:
        self.stream.close()


def connect(endpoint: Endpoint, timeout_s: float, environ: Mapping[str, str] | None = None) -> FrameChannel:
    """Open a :class:`FrameChannel` to ``endpoint`` within ``timeout_s``.

    Raises:
        ValueError: an ofl endpoint without a usable ``VLLM_DSPARK_REMOTE_OFL_DIR``.
        TransportError: the connection could not be made in time.
    """
    if endpoint.scheme == "tcp":
        from .tcp import TcpStream
        return FrameChannel(TcpStream.connect(endpoint.host, endpoint.port, timeout_s, endpoint.bind))
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

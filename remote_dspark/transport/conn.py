"""One connection of a link (:class:`Conn`: a HELLO'd client and what the link knows of
it) and why a link leaves its active one (:class:`Failover`)."""

from __future__ import annotations

import enum
import socket
import time
from dataclasses import dataclass, field

from .client import DraftClient
from .fleet import Address
from .tcp import TcpStream


class Failover(enum.Enum):
    """Why the link left its active connection (``failovers`` by cause)."""

    LOST = "lost"  # the connection broke, closed, or the worker said BYE
    STALL = "stall"  # STALL_ROUNDS deadlines in a row, a spare ready
    PROTOCOL = "protocol"  # a frame that broke the contract


@dataclass(eq=False)
class Conn:
    """One HELLO'd connection of the link and what the link knows of it."""

    client: DraftClient
    epoch: int = 0  # the link epoch it became the active at (0: never active, a spare)
    timeouts: int = 0  # rounds past their deadline in a row, as the active
    since: float = field(default_factory=time.monotonic)

    @property
    def address(self) -> Address | None:
        return self.client.address

    @property
    def incarnation(self) -> int:
        return self.client.ack.incarnation

    @property
    def sock(self) -> socket.socket | None:
        stream = self.client.chan.stream
        return stream.sock if isinstance(stream, TcpStream) else None

    def shutdown(self) -> None:
        """End the connection for its peer and for a round blocked on it; the descriptor
        stays valid until :meth:`close`."""
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already down

    def close(self) -> None:
        self.client.chan.close()

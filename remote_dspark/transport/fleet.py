"""A stand-in of the fleet module (replaced by the resolver's branch): addresses, ranking."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

Resolve = Callable[[str, int, float], Sequence[str]]
REFRESH_S, RETRY_S, MAX_ADDRESSES = 30.0, 1.0, 64


@dataclass(frozen=True, order=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class Fleet:
    def __init__(self, endpoint, *, timeout_s: float, resolve: Resolve | None = None, refresh_s=REFRESH_S,
                 retry_s=RETRY_S, clock=time.monotonic):  # fmt: skip
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.resolve = resolve
        self.clock = clock
        self.last_error = ""
        self._at = -1e18
        self._addresses: tuple[Address, ...] = ()

    def addresses(self) -> tuple[Address, ...]:
        return self._addresses

    def refresh(self, force: bool = False) -> tuple[Address, ...]:
        targets = getattr(self.endpoint, "targets", ((self.endpoint.host, self.endpoint.port),))
        out = set()
        for host, port in targets:
            ips = self.resolve(host, port, self.timeout_s) if self.resolve else [host]
            out.update(Address(ip, port) for ip in ips)
        self._addresses = tuple(sorted(out))[:MAX_ADDRESSES]
        self._at = self.clock()
        return self._addresses

    def due_in(self) -> float:
        return max(0.0, self._at + REFRESH_S - self.clock())


def rank(engine_id: int, addresses: Iterable[Address]) -> list[Address]:
    def score(a: Address) -> bytes:
        return hashlib.blake2b(engine_id.to_bytes(8, "little") + str(a).encode(), digest_size=8).digest()

    return sorted(addresses, key=score, reverse=True)

"""The fleet: the worker addresses an endpoint stands for, resolved off the round path.

An endpoint's targets (:class:`~remote_dspark.transport.endpoint.Endpoint`: one
``HOST:PORT``, or the ``tcp://`` list form) name a fleet of workers: a name may resolve
to many addresses (a Kubernetes headless Service resolves to one address per pod). The
engine dials literal addresses (:class:`Address`) only, so a connect never resolves a
name on the round's path, where the C library's look-up has no deadline.

:class:`Fleet` owns the resolved set:

- **Resolved with a deadline, never on the round's path.** :func:`system_resolve` runs
  ``getaddrinfo`` on a daemon thread and waits at most ``timeout_s``; a look-up still
  running then is left to end on its own, its answer unread. :meth:`Fleet.refresh` is
  called by whoever keeps the connections (never by a round); :meth:`Fleet.addresses`
  is a read of the last good set, no I/O.
- **Re-resolved on a schedule, and soon after a failure**: every ``REFRESH_S`` (workers
  come and go), ``RETRY_S`` after a failed look-up, and on demand (``force``: a lost
  worker) but never more often than ``RETRY_S``, so a dead resolver is not hammered.
- **A failure keeps what was known**: a target whose name fails keeps its last good
  addresses; an empty answer counts as a failure.
- **Bounded whatever DNS says**: each target's answer is read until ``MAX_ADDRESSES``
  distinct addresses (or ``MAX_RECORDS`` records), and the set is capped at ``MAX_ADDRESSES`` (the lowest, sorted)
  before it is built: an answer of thousands of records costs a loop that stops early.
  A fleet of more workers than that is not supported (which ones are kept then depends
  on the answers' order).

:func:`rank` orders a fleet for one engine by rendezvous (highest random weight) hashing:
each engine's first choice follows from its id, engines spread evenly, and a worker
that joins takes only the engines that now rank it first.

Standard library only: the proxy imports it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .endpoint import Endpoint
from .errors import TransportError

MAX_ADDRESSES = 64  # distinct addresses kept for one target, and for the whole fleet
MAX_RECORDS = 4 * MAX_ADDRESSES  # records of one answer read at most (duplicates included)
REFRESH_S = 30.0  # a good set is resolved again this long after its look-up
RETRY_S = 1.0  # after a failed look-up, and the shortest gap between two look-ups


class ResolveError(TransportError):
    """A name did not resolve, or not in time (``timed_out``); the message names the host."""

    timed_out = False


@dataclass(frozen=True, order=True)
class Address:
    """One worker's address as dialled: a literal IP (v4 or v6) and a port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


Resolve = Callable[[str, int, float], Sequence[str]]  # (host, port, timeout_s) -> literal IPs


def literal_ip(host: str) -> str | None:
    """``host`` as a canonical literal IP (an IPv6 scope kept), or None for a name."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def system_resolve(host: str, port: int, timeout_s: float, *, getaddrinfo: Callable | None = None) -> list[str]:
    """``host``'s addresses by ``getaddrinfo`` (``SOCK_STREAM``; ``getaddrinfo``: a stand-in,
    default ``socket.getaddrinfo``) off the caller's thread: a daemon thread, the caller
    waits at most ``timeout_s`` (the C library's look-up has no deadline of its own). A
    literal IP is returned as is. At most ``MAX_ADDRESSES`` distinct addresses, in the
    answer's order.

    Raises:
        ResolveError: naming the host, when it does not resolve or not within ``timeout_s``.
    """
    if literal_ip(host) is not None:
        return [host]
    look_up = socket.getaddrinfo if getaddrinfo is None else getaddrinfo
    answer: list[list[str] | BaseException] = []

    def run() -> None:
        try:
            infos = look_up(host, port, type=socket.SOCK_STREAM)
            answer.append(_distinct(info[4][0] for info in infos))
        except (OSError, ValueError) as e:  # ValueError: an empty or over-long label (UnicodeError)
            answer.append(e)

    thread = threading.Thread(target=run, name="dspark-resolve", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not answer:
        late = ResolveError(f"the host {host!r} did not resolve within {timeout_s:g} s")
        late.timed_out = True
        raise late
    if isinstance(answer[0], BaseException):
        raise ResolveError(f"the host {host!r} does not resolve ({answer[0]})")
    if not answer[0]:
        raise ResolveError(f"the host {host!r} resolved to no address")
    return answer[0]


def _distinct(ips: Iterable[str]) -> list[str]:
    """The first ``MAX_ADDRESSES`` distinct items of ``ips`` (of its first ``MAX_RECORDS``),
    in order; reads no further."""
    seen: dict[str, None] = {}
    for ip in itertools.islice(ips, MAX_RECORDS):
        seen[ip] = None
        if len(seen) == MAX_ADDRESSES:
            break
    return list(seen)


class Fleet:
    """The addresses of an endpoint's workers: the last good set, refreshed on a schedule.

    ``resolve`` (default :func:`system_resolve`) is called with ``timeout_s`` for each
    target in turn when a look-up is due, so a refresh takes at most ``timeout_s`` per
    named target (a literal IP costs nothing). An ofl endpoint (``o1tcp``, ``o1rdma``) is a fleet of
    one ``Address(host, port)``, never resolved: its library resolves the name itself.

    Invariants: ``addresses()`` is sorted, distinct and at most ``MAX_ADDRESSES`` long;
    it changes only by a :meth:`refresh`, which one thread at a time runs (another caller
    meanwhile gets the current set at once).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        timeout_s: float,
        resolve: Resolve | None = None,
        refresh_s: float = REFRESH_S,
        retry_s: float = RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.refresh_s, self.retry_s = refresh_s, retry_s
        self._resolve: Resolve = system_resolve if resolve is None else resolve
        self._clock = clock
        self._lock = threading.Lock()  # held by the one refresh under way
        self.fixed = endpoint.scheme != "tcp"  # ofl: never resolved here
        # target -> its last good addresses (a target never resolved has none)
        self._known: dict[tuple[str, int], tuple[Address, ...]] = {}
        one = (Address(endpoint.host, endpoint.port),)
        self._addresses: tuple[Address, ...] = one if self.fixed else ()
        self._due_at = math.inf if self.fixed else -math.inf  # the next scheduled look-up
        self._tried_at = -math.inf  # the last look-up's start
        self.last_error = ""  # the last look-up's failures, "" when it had none

    def addresses(self) -> tuple[Address, ...]:
        """The last good set, sorted (no I/O; empty until a look-up has succeeded)."""
        return self._addresses

    def due_in(self) -> float:
        """Seconds until the next scheduled look-up (0 when due; inf for an ofl endpoint)."""
        return max(0.0, self._due_at - self._clock())

    def refresh(self, force: bool = False) -> tuple[Address, ...]:
        """Resolve every target when due (``force``: now, unless the last look-up began
        less than ``retry_s`` ago) and return the set; never raises. A failure of any
        target is written to ``last_error`` and brings the next look-up ``retry_s`` closer."""
        if self.fixed or not self._lock.acquire(blocking=False):
            return self._addresses
        try:
            now = self._clock()
            due = now - self._tried_at >= self.retry_s if force else now >= self._due_at
            if due:
                self._tried_at = now
                errors = [e for e in map(self._look_up, self.endpoint.targets) if e]
                self._addresses = self._build()
                self.last_error = "; ".join(errors)
                self._due_at = now + (self.retry_s if errors else self.refresh_s)
            return self._addresses
        finally:
            self._lock.release()

    def _look_up(self, target: tuple[str, int]) -> str:
        """Resolve one target into ``_known``; why it failed, or ""."""
        host, port = target
        try:
            answer = self._resolve(host, port, self.timeout_s)
            found: dict[Address, None] = {}
            for ip in itertools.islice(answer, MAX_RECORDS):  # read no further than the caps
                canonical = literal_ip(ip) if isinstance(ip, str) else None
                if canonical is None:
                    return f"{host}: the resolver answered {ip!r}, not an IP address"
                found[Address(canonical, port)] = None
                if len(found) == MAX_ADDRESSES:
                    break
        except Exception as e:  # noqa: BLE001 (a stand-in may raise anything; refresh never raises)
            return str(e) if host in str(e) else f"{host}: {e}"
        if not found:
            return f"{host}: resolved to no address"
        self._known[target] = tuple(found)
        return ""

    def _build(self) -> tuple[Address, ...]:
        """Every target's last good addresses, distinct, the lowest ``MAX_ADDRESSES``, sorted."""
        union = {a for target in self.endpoint.targets for a in self._known.get(target, ())}
        return tuple(sorted(union)[:MAX_ADDRESSES])


def rank(engine_id: int, addresses: Iterable[Address]) -> list[Address]:
    """``addresses`` in rendezvous (highest random weight) order for ``engine_id``, best
    first: each scores ``blake2b(engine_id as 8 bytes little-endian + str(address),
    digest_size=8)``, ties (never in practice) broken by the address. An engine's first
    choice follows from its id alone; a worker that joins becomes the first choice only
    of the engines that now rank it first (about 1/n of them), and one that leaves moves
    only the engines that ranked it first.

    Raises:
        ValueError: ``engine_id`` outside 0..2**64-1, naming it.
    """
    if not 0 <= engine_id < 1 << 64:
        raise ValueError(f"engine id {engine_id} outside 0..2**64-1")
    key = engine_id.to_bytes(8, "little")

    def score(a: Address) -> tuple[int, Address]:
        digest = hashlib.blake2b(key + str(a).encode(), digest_size=8).digest()
        return -int.from_bytes(digest, "big"), a

    return sorted(addresses, key=score)

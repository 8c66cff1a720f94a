"""Endpoints: ``SCHEME://HOST:PORT[,HOST:PORT...][?bind=IPV4]``, parsed and checked.

An endpoint is ``tcp://HOST:PORT`` (the contract's TCP stub, :mod:`.tcp`) or
``o1tcp://`` / ``o1rdma://`` (the ofl library, :mod:`.ofl`, loaded from the
directory ``ENV_OFL_DIR`` names), each with an optional ``?bind=IPV4`` naming this
side's address.

A ``tcp://`` endpoint may list up to :data:`MAX_TARGETS` targets, comma-separated: a
fleet of workers on hosts without a name that resolves to them all (a name may stand
for many workers by itself: :mod:`.fleet` resolves every target to its addresses). The
first target is also the endpoint's ``host`` and ``port``, so a caller that knows only
one worker keeps working. The ofl library resolves its one host itself: a list is
refused there.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

SCHEMES = ("tcp", "o1tcp", "o1rdma")
MAX_TARGETS = 16  # HOST:PORT items of one endpoint's list form
# The ofl directory: ``ofl.py`` and ``libofl.so`` for the ofl endpoints (:mod:`.ofl`),
# and the contract's default place of a built ``libdsv41_hostflag.so`` (``native.build``).
ENV_OFL_DIR = "VLLM_DSPARK_REMOTE_OFL_DIR"


@dataclass
class Endpoint:
    """A parsed endpoint. Invariant: ``targets[0] == (host, port)``; ``targets`` holds
    every listed ``(host, port)``, distinct (one for the single form; more only for
    ``tcp``). Left out, ``targets`` is the one target ``(host, port)``."""

    scheme: str
    host: str
    port: int
    options: dict[str, str] = field(default_factory=dict)
    targets: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        # A document (RemoteConfig.to_json) carries the targets as lists: made tuples again.
        self.targets = tuple((str(h), int(p)) for h, p in self.targets) or ((self.host, self.port),)
        if self.targets[0] != (self.host, self.port):
            raise ValueError(f"endpoint {self.host}:{self.port}: its first target is {self.targets[0]}")

    @property
    def bind(self) -> str | None:
        return self.options.get("bind") or None

    def __str__(self) -> str:
        q = "&".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.targets)
        return f"{self.scheme}://{hosts}" + (f"?{q}" if q else "")


def parse_endpoint(raw: str, name: str = "VLLM_DSPARK_REMOTE") -> Endpoint:
    """Parse ``SCHEME://HOST:PORT[,HOST:PORT...][?bind=IPV4]`` (the list: ``tcp`` only,
    at most :data:`MAX_TARGETS` distinct targets).

    Raises:
        ValueError: naming ``name`` and the value, and what is wrong (scheme, host,
            port, the list, option).
    """
    text = raw.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise ValueError(f"{name}={raw!r}: expected SCHEME://HOST:PORT with SCHEME one of {SCHEMES}")
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"{name}={raw!r}: unknown scheme {scheme!r}, expected one of {SCHEMES}")
    hostports, _, query = rest.partition("?")
    items = hostports.rstrip("/").split(",", MAX_TARGETS)  # at most MAX_TARGETS + 1 pieces
    if len(items) > MAX_TARGETS:
        raise ValueError(f"{name}={raw!r}: more than {MAX_TARGETS} HOST:PORT targets")
    if len(items) > 1 and scheme != "tcp":
        raise ValueError(f"{name}={raw!r}: a list of targets is for tcp:// only, not {scheme}://")
    targets: list[tuple[str, int]] = []
    for item in items:
        try:
            target = _host_port(item)
        except ValueError as e:
            raise ValueError(f"{name}={raw!r}: {e}") from None
        if target in targets:
            raise ValueError(f"{name}={raw!r}: the target {item!r} is listed twice")
        targets.append(target)
    options: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key != "bind":
            raise ValueError(f"{name}={raw!r}: unknown option {key!r} (only 'bind' is known)")
        try:
            options["bind"] = check_bind(value, "?bind")
        except ValueError as e:
            raise ValueError(f"{name}={raw!r}: {e}") from None
    return Endpoint(scheme, *targets[0], options, tuple(targets))


def _host_port(hostport: str) -> tuple[str, int]:
    """One ``HOST:PORT`` (an IPv6 host in brackets). Raises: ValueError saying what is wrong."""
    if hostport.startswith("["):
        host, bracket, port_s = hostport[1:].partition("]")
        if not bracket or not port_s.startswith(":"):
            raise ValueError(f"bad bracketed IPv6 host {hostport!r}")
        port_s = port_s[1:]
    else:
        host, colon, port_s = hostport.rpartition(":")
        if not colon:
            raise ValueError(f"missing :PORT in {hostport!r}")
    if not host or any(c in host for c in "/@ ,[]"):
        raise ValueError(f"missing or malformed host {host!r}")
    if not port_s.isdigit():
        raise ValueError(f"port {port_s!r} is not a number")
    port = int(port_s)
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} outside 1..65535")
    return host, port


def check_bind(value: str, name: str) -> str:
    """A bind address is a literal IPv4 address of this host's direct link."""
    try:
        return str(ipaddress.IPv4Address(value.strip()))
    except ValueError as e:
        raise ValueError(f"{name}={value!r}: not an IPv4 address") from e

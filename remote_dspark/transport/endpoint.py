"""Endpoints: ``SCHEME://HOST:PORT[?bind=IPV4]``, parsed and checked.

An endpoint is ``tcp://HOST:PORT`` (the contract's TCP stub, :mod:`.tcp`) or
``o1tcp://`` / ``o1rdma://`` (the ofl library, :mod:`.ofl`, loaded from the
directory ``ENV_OFL_DIR`` names), each with an optional ``?bind=IPV4`` naming this
side's address.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

SCHEMES = ("tcp", "o1tcp", "o1rdma")
# The ofl directory: ``ofl.py`` and ``libofl.so`` for the ofl endpoints (:mod:`.ofl`),
# and the contract's default place of a built ``libdsv41_hostflag.so`` (``native.build``).
ENV_OFL_DIR = "VLLM_DSPARK_REMOTE_OFL_DIR"


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

"""The environment contract of the remote drafter, engine side: its variables and
their parsing.

Nothing is active unless ``VLLM_DSPARK_REMOTE`` is set (:func:`remote_requested`); then
:meth:`RemoteConfig.from_env <remote_dspark.config.RemoteConfig.from_env>` reads every
variable below at startup, and a bad value raises ``ValueError`` naming the variable and
the value. A blank value counts as unset. ``REMOTE_`` stands for ``VLLM_DSPARK_REMOTE_``.

=============================  ================  ==============================================
variable                       default           meaning
=============================  ================  ==============================================
VLLM_DSPARK_REMOTE             (required)        rank 0's endpoint: ``tcp://HOST:PORT`` (TCP stub),
                                                 ``o1tcp://`` or ``o1rdma://`` (ofl), ``?bind=IPV4``;
                                                 a fleet of workers: a HOST that resolves to
                                                 several addresses, or (tcp only) a list,
                                                 ``tcp://HOST:PORT,HOST:PORT`` (up to 16)
REMOTE_BIND                    (none)            this side's direct-link IPv4; same as ``?bind=``
                                                 but without a ``?`` a launcher shell could glob
REMOTE_OFL_DIR                 (none)            directory of ``ofl.py`` + ``libofl.so``; needed by
                                                 ``o1tcp``/``o1rdma`` (checked by transport)
REMOTE_POLICY                  shadow            shadow | resilience | capacity
REMOTE_IDENTITY                (required)        64-hex drafter identity (CONTRACT 6.7)
REMOTE_MARKOV_IDENTITY         from cache file   64-hex; default sha256 of the
                                                 ``VLLM_DSPARK_MARKOV_CACHE`` file, zeros if unset
VLLM_DSPARK_MARKOV_CACHE       (none)            the Markov cache file the identity is taken from
REMOTE_TIMEOUT_MS              50                per-round deadline (>= 1)
REMOTE_CONNECT_TIMEOUT_MS      1000              connect + HELLO deadline (>= 1)
REMOTE_BACKOFF_MS              1000              first reconnect delay after a failure; doubles
REMOTE_BACKOFF_MAX_MS          30000             ... up to this (>= BACKOFF_MS)
REMOTE_ON_FAIL                 target_only       target_only | raise (capacity policy)
REMOTE_TRIP                    3                 breaker: consecutive failures before the remote
                                                 is skipped (0 = breaker off)
REMOTE_COOLDOWN                256               breaker: rounds without network after a trip,
                                                 then one probe (>= 1)
REMOTE_STRICT_START            0                 1: raise at startup if connect + HELLO fails
REMOTE_SHADOW_USE              local             local | remote: whose drafts shadow serves
REMOTE_WANT_MARGIN             1 in shadow,      1: ask the worker for top1-top2 margins
                               else 0
REMOTE_DRAFT_MS                (none)            remote draft round cost for the depth policy:
                                                 one number, ms, finite >= 0
REMOTE_ROUND_MS                (none)            verify-only ms for depth 0..k (k+1 values > 0,
                                                 non-decreasing); see apply_cost_overrides
REMOTE_ASYNC                   0                 1: capacity only; rank 0 never blocks its CPU on
                                                 a round (streamsync hand-off); needs
                                                 ON_FAIL=target_only
REMOTE_ASYNC_PROXY             thread            thread | process: where the async proxy runs
REMOTE_HOSTFLAG_LIB            (none)            a built ``libdsv41_hostflag.so``; default:
                                                 OFL_DIR's copy, else compiled at startup
REMOTE_ASYNC_NAP_US            0                 > 0: sleep this long between checks after
                                                 ASYNC_SPIN_US of spinning; 0 = spin (the
                                                 engine's CPU wait: sleep on a futex); an
                                                 idle proxy sleeps on a futex either way
REMOTE_ASYNC_SPIN_US           1000              spin time before napping (or sleeping)
REMOTE_ASYNC_WATCHDOG_MS       0 (auto)          release an unreleased gathered round after this
                                                 long; 0 = max(4 x TIMEOUT_MS, 200)
REMOTE_ASYNC_RESPAWNS          3                 process mode: new proxies after a death or stall
                                                 (0 = none, target-only rounds from then on)
REMOTE_ASYNC_RESPAWN_RESET_S   3600              a proxy serving this long restores the full
                                                 respawn budget (0 = never)
REMOTE_SWITCH_INTERVAL_US      500               thread mode: GIL switch interval while the proxy
                                                 thread runs (0 = unchanged)
REMOTE_FUSED_GATHER            auto              auto | 0 | 1: the one-launch Triton row gather
                                                 (auto: on CUDA, after a startup self-check)
REMOTE_N_OUT                   auto              auto | 0: ReqEntry.n_out, see :func:`n_out_table`
REMOTE_LOG_EVERY               1024              rounds between stats log lines (0 = off)
REMOTE_STATS_FILE              /tmp/dsv41-       JSON stats written by rank 0
                               remote-dspark.json
VLLM_DSPARK_SAMPLED_TOP32      0                 1: ask the worker for sampled drafts (HELLO's
                                                 sampled option): each batch carries a
                                                 temperature and a seed per entry, and each
                                                 drafted position comes with the top-32
                                                 distribution it was drawn from (``Drafts.q_*``,
                                                 for ``engine.sampler.rejection_sample``); caps
                                                 num_spec at 16 and max_slots at 1024
REMOTE_SAMPLED_REDRAW          0                 1 (needs SAMPLED_TOP32=1): the engine redraws
                                                 each sampled draft from its q with its own
                                                 randomness and keeps drafts while its draw
                                                 equals the worker's: exact whatever the
                                                 worker sends, fewer drafts accepted
                                                 (``engine.sampler.redraw``)
REMOTE_METRICS_PORT            0 (off)           serve /metrics on this port (an engine with its
                                                 own /metrics registers the collector instead)
REMOTE_METRICS_ADDR            127.0.0.1         the exporter's address; loopback unless set
REMOTE_ASYNC_STANDBY           1                 process mode: keep a warm standby proxy that
                                                 takes over in milliseconds (0 = none)
REMOTE_KEY_FILE                (none: no         a pre-shared key (mode 0600 or stricter, this
                               authentication)   user's or root's, not a link, its directory
                                                 writable by its owner only): engine and worker
                                                 authenticate each other at HELLO; the worker's
                                                 ``--key-file``. Beyond the reference contract
=============================  ================  ==============================================

Each variable is one ``Var`` of ``TABLE`` (its parser and default); :mod:`.api` builds
``RemoteConfig`` from them. A ``VLLM_DSPARK_REMOTE_*`` name not in the table, or a near
misspelling of another name here, is warned about with the closest known name
(:mod:`.names`), at the engine's start and by ``check-config``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .. import wire
from ..native.build import ENV_LIB
from ..transport.auth import load_key
from ..transport.endpoint import ENV_OFL_DIR, check_bind, parse_endpoint

POLICIES = ("shadow", "resilience", "capacity")
ENV_ENDPOINT = "VLLM_DSPARK_REMOTE"
ENV_MARKOV_CACHE = "VLLM_DSPARK_MARKOV_CACHE"
PREFIX = "VLLM_DSPARK_REMOTE_"


def remote_requested(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``VLLM_DSPARK_REMOTE`` is set: the remote drafter is wanted."""
    return bool(raw_value(os.environ if environ is None else environ, ENV_ENDPOINT))


def raw_value(env: Mapping[str, str], name: str) -> str:
    return (env.get(name) or "").strip()


# --- the parsing layer: parse(text, variable), text stripped and non-blank, the same
# --- argument order as wire.parse_hex32, check_bind and parse_endpoint -----------------

INT_MAX = 2**31 - 1  # every count and duration fits a signed 32-bit word (wire, C library)


def _int(lo: int, hi: int = INT_MAX) -> Callable[[str, str], int]:
    def parse(raw: str, name: str) -> int:
        try:
            value = int(raw)
        except ValueError as e:
            raise ValueError(f"{name}={raw!r}: not an integer") from e
        if value < lo:
            raise ValueError(f"{name}={raw!r}: must be >= {lo}")
        if value > hi:
            raise ValueError(f"{name}={raw!r}: must be <= {hi}")
        return value

    return parse


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(raw: str, name: str) -> str:
        value = raw.lower()
        if value not in choices:
            raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
        return value

    return parse


_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _flag(raw: str, name: str) -> bool:
    value = raw.lower()
    if value in _TRUE + _FALSE:
        return value in _TRUE
    raise ValueError(f"{name}={raw!r}: expected 0 or 1")


def _ms_list(raw: str, name: str) -> list[float]:
    """Comma-separated finite numbers >= 0 (ms)."""
    try:
        values = [float(x) for x in raw.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"{name}={raw!r}: expected comma-separated numbers (ms)") from e
    if not values:
        raise ValueError(f"{name}={raw!r}: expected at least one number (ms)")
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"{name}={raw!r}: expected finite numbers >= 0 (ms)")
    return values


def _one_ms(raw: str, name: str) -> float:
    values = _ms_list(raw, name)
    if len(values) != 1:
        raise ValueError(f"{name}={raw!r}: expected one number (ms), got {len(values)}")
    return values[0]


def _port(raw: str, name: str) -> int:
    value = _int(0)(raw, name)
    if value > 65535:
        raise ValueError(f"{name}={raw!r}: a TCP port is 0..65535 (0 = off)")
    return value


def _ip(raw: str, name: str) -> str:
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError as e:
        raise ValueError(f"{name}={raw!r}: not an IP address") from e


def _text(raw: str, name: str) -> str:
    return raw


def _required(what: str) -> Callable[..., Any]:
    def default(name: str, env: Mapping[str, str], values: dict[str, Any]) -> Any:
        raise ValueError(f"{name} is required: {what}")

    return default


def spell(value: Any) -> str:
    """A resolved value as the environment would spell it ("" = unset)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ",".join(spell(v) for v in value)
    return str(value)


@dataclass(frozen=True)
class Var:
    name: str
    field: str | None  # the RemoteConfig field it sets; None: read by another module
    parse: Callable[[str, str], Any]
    # The value when unset; a callable (name, environ, values parsed so far) computes a
    # default that depends on them, or raises for a required variable.
    default: Any = None
    show: Callable[[Any], str] = spell
    # The reference's choices take the default only when unset or empty: a value of
    # blanks is a value, and not one of the choices (it raises).
    blank_is_value: bool = False


_GATHER = {"auto": None, "1": True, "0": False}
_gather_word = _choice(*_GATHER)

# In the order of the module docstring; a default callable may only read variables above it.
TABLE: tuple[Var, ...] = (
    Var(
        ENV_ENDPOINT, "endpoint", parse_endpoint, _required("the drafter's endpoint, SCHEME://HOST:PORT[,HOST:PORT...]")
    ),
    Var(PREFIX + "BIND", None, check_bind),
    Var(ENV_OFL_DIR, None, _text),
    Var(PREFIX + "POLICY", "policy", _choice(*POLICIES), "shadow", blank_is_value=True),
    Var(
        PREFIX + "IDENTITY",
        "drafter_identity",
        wire.parse_hex32,
        _required("the drafter's 64-hex identity, as its worker prints it when it starts"),
    ),
    Var(ENV_MARKOV_CACHE, None, _text),
    Var(
        PREFIX + "MARKOV_IDENTITY",
        "markov_identity",
        wire.parse_hex32,
        lambda name, env, values: markov_identity_from_env(env),
    ),
    Var(PREFIX + "TIMEOUT_MS", "timeout_ms", _int(1), 50),
    Var(PREFIX + "CONNECT_TIMEOUT_MS", "connect_timeout_ms", _int(1), 1000),
    Var(PREFIX + "BACKOFF_MS", "backoff_ms", _int(1), 1000),
    Var(PREFIX + "BACKOFF_MAX_MS", "backoff_max_ms", _int(1), 30000),
    Var(PREFIX + "ON_FAIL", "on_fail", _choice("target_only", "raise"), "target_only", blank_is_value=True),
    Var(PREFIX + "TRIP", "trip", _int(0), 3),
    Var(PREFIX + "COOLDOWN", "cooldown", _int(1), 256),
    Var(PREFIX + "STRICT_START", "strict_start", _flag, False),
    Var(PREFIX + "SHADOW_USE", "shadow_use", _choice("local", "remote"), "local", blank_is_value=True),
    Var(PREFIX + "WANT_MARGIN", "want_margin", _flag, lambda name, env, values: values[PREFIX + "POLICY"] == "shadow"),
    Var(PREFIX + "DRAFT_MS", "remote_draft_ms", _one_ms),
    Var(PREFIX + "ROUND_MS", "remote_round_ms", _ms_list),
    Var(PREFIX + "ASYNC", "async_mode", _flag, False),
    Var(PREFIX + "ASYNC_PROXY", "async_proxy", _choice("thread", "process"), "thread", blank_is_value=True),
    Var(ENV_LIB, "hostflag_lib", _text, ""),
    Var(PREFIX + "ASYNC_NAP_US", "async_nap_us", _int(0), 0),
    Var(PREFIX + "ASYNC_SPIN_US", "async_spin_us", _int(0), 1000),
    Var(PREFIX + "ASYNC_WATCHDOG_MS", "async_watchdog_ms", _int(0), 0),
    Var(PREFIX + "ASYNC_RESPAWNS", "async_respawns", _int(0), 3),
    Var(PREFIX + "ASYNC_RESPAWN_RESET_S", "async_respawn_reset_s", _int(0), 3600),
    Var(PREFIX + "SWITCH_INTERVAL_US", "switch_interval_us", _int(0), 500),
    Var(
        PREFIX + "FUSED_GATHER",
        "fused_gather",
        lambda raw, name: _GATHER[_gather_word(raw, name)],
        None,
        show=lambda v: next(k for k, g in _GATHER.items() if g is v),
        blank_is_value=True,
    ),
    Var(PREFIX + "N_OUT", "n_out", _choice("auto", "0"), "auto", blank_is_value=True),
    Var(PREFIX + "LOG_EVERY", "log_every", _int(0), 1024),
    Var(PREFIX + "STATS_FILE", "stats_file", _text, "/tmp/dsv41-remote-dspark.json"),
    Var("VLLM_DSPARK_SAMPLED_TOP32", "sampled_top32", _flag, False),
    Var(PREFIX + "SAMPLED_REDRAW", "sampled_redraw", _flag, False),
    Var(PREFIX + "METRICS_PORT", "metrics_port", _port, 0),
    Var(PREFIX + "METRICS_ADDR", "metrics_addr", _ip, "127.0.0.1"),
    Var(PREFIX + "ASYNC_STANDBY", "async_standby", _flag, True),
    Var(PREFIX + "KEY_FILE", "key", load_key, None, show=lambda key: key.path if key else ""),
)

VARIABLES: tuple[str, ...] = tuple(v.name for v in TABLE)


def markov_identity_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """sha256 of the ``VLLM_DSPARK_MARKOV_CACHE`` file; 32 zero bytes when it is unset.

    Raises:
        ValueError: naming the variable and the path when the file cannot be read.
    """
    env = os.environ if environ is None else environ
    path = raw_value(env, ENV_MARKOV_CACHE)
    if not path:
        return bytes(32)
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).digest()
    except OSError as e:
        raise ValueError(f"{ENV_MARKOV_CACHE}={path!r} unreadable ({e}); set {PREFIX}MARKOV_IDENTITY explicitly") from e

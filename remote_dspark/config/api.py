"""``RemoteConfig``: the validated environment contract, engine side.

:meth:`RemoteConfig.from_env` reads and checks every variable of the contract (the
variables, their defaults and their parsing are :mod:`~remote_dspark.config.env`'s);
``to_json`` / ``from_json`` hand it to the proxy; :func:`describe` spells it out for
``check-config``; :func:`apply_cost_overrides` and :func:`n_out_table` turn it into the
depth policy's inputs.

Cross-field rules: ASYNC=1 needs POLICY=capacity and ON_FAIL=target_only; BACKOFF_MAX_MS
>= BACKOFF_MS; REMOTE_BIND and the endpoint's ``?bind=`` must agree; SAMPLED_REDRAW=1 needs
``VLLM_DSPARK_SAMPLED_TOP32=1``. The cost rules that
need the depth policy's settings live in :func:`apply_cost_overrides`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from .. import wire
from ..transport.auth import Key
from ..transport.endpoint import Endpoint
from .env import ENV_ENDPOINT, PREFIX, TABLE, raw_value, spell
from .names import unknown_variables

log = logging.getLogger("remote_dspark.config")

CAP_MASKING_DEPTH_MODES = ("conf", "confb", "confr")
LONG_WAIT_MS = 60_000  # a round deadline or watchdog past a minute is warned about (never capped)


@dataclass
class RemoteConfig:
    """The validated contract (see config.env's docstring for each variable)."""

    endpoint: Endpoint  # with REMOTE_BIND merged into options["bind"]
    policy: str
    drafter_identity: bytes
    markov_identity: bytes
    timeout_ms: int
    connect_timeout_ms: int
    backoff_ms: int
    backoff_max_ms: int
    on_fail: str
    strict_start: bool
    shadow_use: str
    want_margin: bool
    remote_draft_ms: float | None
    remote_round_ms: list[float] | None
    log_every: int
    stats_file: str
    async_mode: bool = False
    switch_interval_us: int = 500
    hostflag_lib: str = ""
    async_nap_us: int = 0
    async_spin_us: int = 1000
    async_watchdog_ms: int = 0
    async_proxy: str = "thread"
    async_respawns: int = 3
    async_respawn_reset_s: int = 3600
    fused_gather: bool | None = None  # None = auto
    n_out: str = "auto"
    trip: int = 3
    cooldown: int = 256
    sampled_top32: bool = False
    # Beyond the reference contract: the standalone Prometheus exporter.
    metrics_port: int = 0
    metrics_addr: str = "127.0.0.1"
    async_standby: bool = True
    key: Key | None = None  # KEY_FILE's key: authentication at HELLO; None: none
    sampled_redraw: bool = False  # the engine redraws sampled drafts (engine.sampler.redraw)

    @property
    def watchdog_ms(self) -> int:
        """The async watchdog deadline actually used (0 = auto)."""
        return self.async_watchdog_ms or max(4 * self.timeout_ms, 200)

    @property
    def keeps_local_drafter(self) -> bool:
        """shadow and resilience run the local drafter beside the remote one."""
        return self.policy in ("shadow", "resilience")

    def warnings(self) -> list[str]:
        """Settings the contract accepts but that cannot work as meant, each naming its
        variables (logged at start by :meth:`log_warnings`, shown by ``check-config``).
        Parsing itself stays the contract's: no upper bounds, and the watchdog's rule is
        kept exactly, so a deadline past :data:`LONG_WAIT_MS` is only named here."""
        out = []
        if self.timeout_ms > LONG_WAIT_MS:
            out.append(
                f"{PREFIX}TIMEOUT_MS={self.timeout_ms}: the round deadline is over a minute "
                f"({self.timeout_ms / 1000:g} s); a round against a stopped worker holds its wait that long"
            )
        if not self.async_mode:
            return out
        if self.watchdog_ms > LONG_WAIT_MS:
            source = (
                f"{PREFIX}ASYNC_WATCHDOG_MS={self.async_watchdog_ms}"
                if self.async_watchdog_ms
                else f"max(4 x {PREFIX}TIMEOUT_MS={self.timeout_ms}, 200), {PREFIX}ASYNC_WATCHDOG_MS=0"
            )
            out.append(
                f"the watchdog deadline is {self.watchdog_ms} ms ({source}), over a minute: a round "
                "nobody answers (a stopped worker or proxy) is released target-only only after that long"
            )
        if self.async_nap_us >= self.watchdog_ms * 1000:
            out.append(
                f"{PREFIX}ASYNC_NAP_US={self.async_nap_us} is at or above the watchdog deadline "
                f"({self.watchdog_ms} ms, {PREFIX}ASYNC_WATCHDOG_MS): an idle proxy naps through whole "
                "rounds, which the watchdog then answers target-only"
            )
        if self.async_watchdog_ms and self.async_watchdog_ms <= self.timeout_ms:
            out.append(
                f"{PREFIX}ASYNC_WATCHDOG_MS={self.async_watchdog_ms} is at or below {PREFIX}TIMEOUT_MS="
                f"{self.timeout_ms}: the watchdog answers rounds the worker would still answer in "
                "time, and three in a row read as a stalled proxy"
            )
        return out

    def log_warnings(self, environ: Mapping[str, str] | None = None) -> None:
        """Log each of :meth:`warnings`, and each name of ``environ`` (default
        ``os.environ``) meant for this package that it does not read
        (:func:`~remote_dspark.config.names.unknown_variables`), on logger
        ``remote_dspark.config``: the engine's start calls it once, so an operator sees
        them where the engine logs."""
        for warning in unknown_variables(environ) + self.warnings():
            log.warning("remote DSpark: %s", warning)

    def hello(
        self, engine_id: int, *, max_slots: int, row_bytes: int, num_spec: int, vocab_size: int = 0
    ) -> wire.Hello:
        """The HELLO of a session of this configuration: its identities, margins and
        sampled drafts (``sampled_top32``), the engine's id and vocabulary, the region's
        sizes."""
        return wire.Hello(
            self.drafter_identity,
            self.markov_identity,
            engine_id,
            max_slots,
            row_bytes,
            num_spec,
            want_margin=self.want_margin,
            vocab_size=vocab_size,
            want_sampled=self.sampled_top32,
        )

    def to_json(self) -> str:
        """This configuration, as the engine hands it to its proxy (never re-parsed from
        the environment there, so the two cannot differ). It holds the key itself: the
        document goes only through the hand-over pipe (``proxy.handover``), never to a
        file, argv or the environment, and the proxy never reads the key file."""
        d = dataclasses.asdict(self)
        d["drafter_identity"] = self.drafter_identity.hex()
        d["markov_identity"] = self.markov_identity.hex()
        d["key"] = None if self.key is None else {"path": self.key.path, "secret": self.key.secret.hex()}
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> RemoteConfig:
        """The configuration ``to_json`` wrote (the engine's, already validated).

        Raises:
            ValueError: not such a document (a missing or unknown field, bad JSON).
        """
        try:
            d = json.loads(text)
            d["endpoint"] = Endpoint(**d["endpoint"])
            d["drafter_identity"] = bytes.fromhex(d["drafter_identity"])
            d["markov_identity"] = bytes.fromhex(d["markov_identity"])
            if d["key"] is not None:
                d["key"] = Key(d["key"]["path"], bytes.fromhex(d["key"]["secret"]))
            return cls(**d)
        except (TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"not a RemoteConfig document: {e}") from e

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RemoteConfig:
        """Read and check the whole contract.

        Raises:
            ValueError: naming the variable (or both variables of a cross-field rule)
                and the offending value.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for var in TABLE:
            raw = raw_value(env, var.name)
            if raw:
                values[var.name] = var.parse(raw, var.name)
            elif var.blank_is_value and env.get(var.name):
                values[var.name] = var.parse(env[var.name], var.name)  # raises: blanks are no choice
            elif callable(var.default):
                values[var.name] = var.default(var.name, env, values)
            else:
                values[var.name] = var.default
        cfg = cls(**{v.field: values[v.name] for v in TABLE if v.field})
        _merge_bind(cfg.endpoint, values[PREFIX + "BIND"])
        _check_rules(cfg)
        return cfg


def _merge_bind(endpoint: Endpoint, bind: str | None) -> None:
    if not bind:
        return
    if endpoint.options.get("bind", bind) != bind:
        raise ValueError(f"{PREFIX}BIND={bind!r} conflicts with {ENV_ENDPOINT}'s ?bind={endpoint.options['bind']!r}")
    endpoint.options["bind"] = bind


def _check_rules(cfg: RemoteConfig) -> None:
    if cfg.async_mode and cfg.policy != "capacity":
        raise ValueError(
            f"{PREFIX}ASYNC=1 needs {PREFIX}POLICY=capacity, got {cfg.policy!r} "
            "(resilience and shadow decide on the host every round)"
        )
    if cfg.async_mode and cfg.on_fail == "raise":
        raise ValueError(
            f"{PREFIX}ASYNC=1 cannot raise on a failed round (the host never waits "
            f"for it): {PREFIX}ON_FAIL='raise', use target_only"
        )
    if cfg.sampled_redraw and not cfg.sampled_top32:
        raise ValueError(
            f"{PREFIX}SAMPLED_REDRAW=1 needs VLLM_DSPARK_SAMPLED_TOP32=1: it redraws sampled drafts "
            "from their distributions, which only a sampled engine gets"
        )
    if cfg.backoff_max_ms < cfg.backoff_ms:
        raise ValueError(f"{PREFIX}BACKOFF_MAX_MS={cfg.backoff_max_ms} is below {PREFIX}BACKOFF_MS={cfg.backoff_ms}")


def describe(cfg: RemoteConfig, environ: Mapping[str, str] | None = None) -> list[tuple[str, str, str]]:
    """Rows ``(variable, value, source)`` for every variable, in the order of config.env's table.

    ``value`` is spelled as the environment would ("" = unset, identities in hex);
    ``source`` is ``env`` or ``default``. Derived values follow with source ``derived``.
    """
    env = os.environ if environ is None else environ
    rows = []
    for var in TABLE:
        value = var.show(getattr(cfg, var.field)) if var.field else raw_value(env, var.name)
        rows.append((var.name, value, "env" if raw_value(env, var.name) else "default"))
    rows += [
        ("watchdog_ms", str(cfg.watchdog_ms), "derived"),
        ("keeps_local_drafter", spell(cfg.keeps_local_drafter), "derived"),
        ("bind", cfg.endpoint.bind or "", "derived"),
    ]
    return rows


def apply_cost_overrides(
    cfg: RemoteConfig,
    environ: MutableMapping[str, str] | None = None,
    depth_policy_on: bool = False,
    depth_mode: str | None = None,
    num_spec: int = 5,
    depth_file: str | None = None,
) -> dict[str, str]:
    """Make the remote round cost an explicit input of the depth policy (CONTRACT 10).

    Writes ``VLLM_DSPARK_DRAFT_MS`` / ``VLLM_DSPARK_ROUND_MS`` into ``environ`` before the
    model runner builds its depth policy (the same environment on every rank keeps the
    cost tables identical across TP ranks) and returns what it wrote.

    The policy prices depth d as ROUND_MS[d] + DRAFT_MS. The live ROUND_MS includes the
    local drafter, so with the depth policy on, capacity/resilience need both remote
    inputs: a remote DRAFT_MS over the live table counts a drafter twice, a verify-only
    table under the live DRAFT_MS counts the wrong drafter. ``confr``'s table is part of
    the policy string and cannot take them at all. ``fixed`` never prices a depth, so it
    needs them only when a depth file can switch the mode at runtime. Shadow keeps the
    local measurements.

    Raises:
        ValueError: before writing anything.
    """
    env = os.environ if environ is None else environ
    if cfg.policy == "shadow":
        return {}
    if depth_policy_on and not (depth_mode == "fixed" and not depth_file):
        if depth_mode == "confr":
            raise ValueError(
                f"remote DSpark ({cfg.policy}): VLLM_DSPARK_DEPTH_POLICY=confr:<rows ms> carries "
                "its own step table (measured with the local drafter), which the remote cost "
                f"inputs cannot replace; use conf or confb with {PREFIX}DRAFT_MS / {PREFIX}ROUND_MS"
            )
        missing = [
            name
            for name, value in ((PREFIX + "DRAFT_MS", cfg.remote_draft_ms), (PREFIX + "ROUND_MS", cfg.remote_round_ms))
            if value is None
        ]
        if missing:
            raise ValueError(
                f"remote DSpark ({cfg.policy}) with VLLM_DSPARK_DEPTH_POLICY on ({depth_mode}) needs "
                f"both {PREFIX}DRAFT_MS (measured remote round, ms) and {PREFIX}ROUND_MS (verify-only "
                f"table, ms by depth 0..k): missing {' and '.join(missing)}. The live "
                "VLLM_DSPARK_ROUND_MS includes the local drafter, so a partial override "
                "mixes two cost models"
            )
    changed: dict[str, str] = {}
    table = cfg.remote_round_ms
    if table is not None:
        name, text = PREFIX + "ROUND_MS", spell(table)
        if len(table) != num_spec + 1:
            raise ValueError(
                f"{name}={text!r}: {len(table)} values, expected {num_spec + 1} (verify ms for depth 0..{num_spec})"
            )
        if any(v <= 0 for v in table):
            raise ValueError(f"{name}={text!r}: verify times must be > 0 ms")
        if any(b < a for a, b in zip(table, table[1:])):
            raise ValueError(
                f"{name}={text!r}: must be non-decreasing with the depth (more live rows never verify faster)"
            )
        changed["VLLM_DSPARK_ROUND_MS"] = text
    if cfg.remote_draft_ms is not None:
        changed["VLLM_DSPARK_DRAFT_MS"] = spell(cfg.remote_draft_ms)
    env.update(changed)
    if changed:
        log.info("remote DSpark: the depth policy's cost inputs: %s", " ".join(f"{k}={v}" for k, v in changed.items()))
    return changed


def n_out_table(
    cfg: RemoteConfig, num_spec: int, depth_mode: str, depth_file: str | None, dense_cap: list[int] | None
) -> tuple[list[int] | None, str]:
    """ReqEntry.n_out by request count (CONTRACT 6.3), or None (always all N positions),
    with the reason.

    ``dense_cap`` is the dynamic speculation schedule (index = number of requests, index 0
    unused), as the model runner passes it to its depth policy. Positions >= cap[n] are
    only safe to drop when nothing reads them: the depth policy must zero them (a
    cap-masking mode, fixed for the life of the serve, so no depth file that could switch
    it), and shadow compares every position.
    """
    if cfg.policy == "shadow":
        return None, "shadow compares every position"
    if cfg.n_out == "0":
        return None, f"{PREFIX}N_OUT=0"
    if depth_mode not in CAP_MASKING_DEPTH_MODES:
        return None, f"depth policy {depth_mode!r} does not mask positions >= cap"
    if depth_file:
        return None, "VLLM_DSPARK_DEPTH_FILE can switch the depth policy at runtime"
    if not dense_cap:
        return None, "no dynamic speculation schedule"
    table = [0 if i == 0 else min(num_spec, int(c)) for i, c in enumerate(dense_cap)]
    if all(c >= num_spec for c in table[1:]):
        return None, "schedule never caps below N"
    return table, "cap by request count"

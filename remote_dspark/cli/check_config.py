"""``remote-dspark check-config``: validate this process's environment as the engine would.

It runs the same checks as engine startup (:meth:`RemoteConfig.from_env` and the
transport's readiness check, so an ofl endpoint needs its library directory) and prints
every variable of the contract with its resolved value and where it came from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import transport
from ..config.api import RemoteConfig, apply_cost_overrides, describe, n_out_table
from ..config.names import unknown_variables
from ..transport import fleet
from . import probe

_DESCRIPTION = """\
Check the VLLM_DSPARK_REMOTE* environment exactly as engine startup does: every value
is parsed and validated, cross-field rules are applied, and an o1tcp:// or o1rdma://
endpoint must find ofl.py and libofl.so in VLLM_DSPARK_REMOTE_OFL_DIR. Prints each
variable with its resolved value (identities in hex, values spelled as the environment
would; '-' = unset) and its source (env or default), then derived values. Exits 0 when
the configuration would start, 2 with the reason on stderr when it would not.

It prints the fleet the endpoint names: each HOST:PORT target and the addresses it
resolves to now (within CONNECT_TIMEOUT_MS, as the engine resolves), or why it does not
resolve. A target that does not resolve is a warning, not a failure: the engine keeps
the addresses it had and tries again. An o1tcp:// or o1rdma:// host is resolved by the
ofl library, not here.

It also names every VLLM_DSPARK_REMOTE_* variable this package does not read (and
near-misspellings of its other VLLM_DSPARK_* names), with the closest known name: such
a variable is otherwise ignored in silence.

With --probe it then asks the worker the endpoint names (a list's first target): it
resolves the host, connects and says HELLO as the engine would (the configured
identities and key, the sizes given by --max-slots, --row-bytes, --num-spec and
--vocab-size, an engine id of its own: it
never takes the place of an engine served in the last minute, though on a worker whose
every place is held it may take that of one idle longer), reads the answer, says BYE,
and prints each field beside the worker's answer. Exits 3 with the reason when the
host does not resolve, the worker cannot be reached in CONNECT_TIMEOUT_MS, or it
refuses this engine (identity, vocabulary, slots, row bytes, key, busy).

Given the engine's depth-policy facts (--depth-policy, --num-spec, --depth-file,
--dense-cap), it also shows each round's n_out by request count (and why), and the cost
overrides the engine's apply_cost_overrides() call would write into the environment
(nothing is written here), or why that call would refuse."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "check-config",
        help="validate the VLLM_DSPARK_REMOTE* environment and print it",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object {variable: value, ..., "derived": {name: value}}; '
        'values are strings as the environment spells them ("" = unset)',
    )
    p.add_argument(
        "--depth-policy",
        metavar="MODE",
        default=None,
        help="the engine's VLLM_DSPARK_DEPTH_POLICY mode (fixed, conf, confb, confr, ...): "
        "show n_out by request count and the cost overrides it needs (default: off)",
    )
    p.add_argument(
        "--num-spec",
        type=int,
        default=None,
        help="the engine's k, drafts per entry (default 5)",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="also connect to the worker, say HELLO as this engine would (then BYE) and compare "
        "its answer with this configuration; exit 3 on any mismatch or when it cannot be reached",
    )
    p.add_argument("--max-slots", type=int, default=256, help="with --probe: the engine's max_slots (default 256)")
    p.add_argument(
        "--row-bytes", type=int, default=0, help="with --probe: the bytes of the engine's rows (default 0: none)"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help="with --probe: the engine's vocabulary, token ids 0..N-1 (default 0: unknown, not compared)",
    )
    p.add_argument("--depth-file", default=None, help="the engine's VLLM_DSPARK_DEPTH_FILE, if any")
    p.add_argument(
        "--dense-cap",
        default=None,
        metavar="C1,C2,...",
        help="the dynamic speculation schedule by request count (index 0 unused), comma-separated, e.g. 0,5,5,4,3",
    )
    p.set_defaults(func=run)
    return p


def _depth_rows(cfg: RemoteConfig, env, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """Derived rows for the depth policy's facts: n_out, and the cost overrides it would write.

    Raises:
        ValueError: a bad --dense-cap, or a combination apply_cost_overrides refuses.
    """
    if not any(v is not None for v in (args.depth_policy, args.num_spec, args.depth_file, args.dense_cap)):
        return []
    args.num_spec = 5 if args.num_spec is None else args.num_spec
    if args.num_spec < 1:
        raise ValueError(f"--num-spec={args.num_spec}: must be >= 1")
    cap = None
    if args.dense_cap:
        try:
            cap = [int(c) for c in args.dense_cap.split(",")]
        except ValueError:
            raise ValueError(f"--dense-cap={args.dense_cap!r}: not comma-separated integers") from None
    table, why = n_out_table(cfg, args.num_spec, args.depth_policy or "", args.depth_file, cap)
    rows = [
        ("n_out", "by request count " + ",".join(map(str, table)) if table else f"all {args.num_spec}", "derived"),
        ("n_out_reason", why, "derived"),
    ]
    dry = dict(env)
    written = apply_cost_overrides(
        cfg,
        dry,
        depth_policy_on=args.depth_policy is not None,
        depth_mode=args.depth_policy,
        num_spec=args.num_spec,
        depth_file=args.depth_file,
    )
    rows.append(("cost_overrides", " ".join(f"{k}={v}" for k, v in written.items()) or "none", "derived"))
    return rows


def run(args: argparse.Namespace) -> int:
    env = os.environ
    for warning in unknown_variables(env):  # first: a misspelling may be why the rest fails
        print(f"check-config: warning: {warning}", file=sys.stderr)
    try:
        cfg = RemoteConfig.from_env(env)
        transport.check_ready(cfg.endpoint, env)
    except ValueError as e:
        print(f"check-config: {e}", file=sys.stderr)
        return 2
    for warning in cfg.warnings():
        print(f"check-config: warning: {warning}", file=sys.stderr)
    rows = describe(cfg, env)
    targets = _fleet(cfg)
    try:
        rows += _depth_rows(cfg, env, args)
        report = _probe(cfg, env, args) if args.probe else None
    except ValueError as e:
        print(f"check-config: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = {name: value for name, value, source in rows if source != "derived"}
        out["derived"] = {name: value for name, value, source in rows if source == "derived"}
        if report is not None:
            out["probe"] = probe.as_json(report)
        out["fleet"] = [{"target": t, "addresses": a, "error": e} for t, a, e in targets]
        print(json.dumps(out, indent=2))
    else:
        print(
            _table([("VARIABLE", "VALUE", "SOURCE")] + [(name, value or "-", source) for name, value, source in rows])
        )
        print("\n" + _spell_fleet(cfg, targets))
        if report is not None:
            print("\n" + probe.spell(report))
    for target, _, error in targets:
        if error:
            print(
                f"check-config: warning: {target} does not resolve now ({error}); the engine tries again",
                file=sys.stderr,
            )
    if report is not None and not report.ok:
        print(f"check-config: probe failed ({report.verdict}): {report.reason}", file=sys.stderr)
        return 3
    return 0


def _fleet(cfg: RemoteConfig) -> list[tuple[str, list[str], str]]:
    """``(target, addresses, error)`` for each target of the endpoint: what it resolves to
    within CONNECT_TIMEOUT_MS (:func:`~remote_dspark.transport.fleet.system_resolve`, the
    engine's look-up), or why not; an ofl endpoint's host is left to its library."""
    timeout_s = cfg.connect_timeout_ms / 1000
    out = []
    for host, port in cfg.endpoint.targets:
        target = str(fleet.Address(host, port))
        if cfg.endpoint.scheme != "tcp":
            out.append((target, [target], ""))
            continue
        try:
            ips = fleet.system_resolve(host, port, timeout_s)
            out.append((target, [str(fleet.Address(ip, port)) for ip in ips], ""))
        except fleet.ResolveError as e:
            out.append((target, [], str(e)))
    return out


def _spell_fleet(cfg: RemoteConfig, targets: list[tuple[str, list[str], str]]) -> str:
    """The fleet as lines: a heading, then ``target -> addresses`` (or the error)."""
    if cfg.endpoint.scheme != "tcp":
        head = f"FLEET  one worker; {cfg.endpoint.scheme}:// hosts are resolved by the ofl library"
    else:
        head = f"FLEET  {len(targets)} target(s), resolved within {cfg.connect_timeout_ms} ms (CONNECT_TIMEOUT_MS)"
    width = max(len(t) for t, _, _ in targets)
    lines = [f"  {t:<{width}}  -> " + (" ".join(a) if not e else f"not resolved: {e}") for t, a, e in targets]
    return "\n".join([head, *lines])


def _probe(cfg: RemoteConfig, env, args: argparse.Namespace) -> probe.ProbeReport:
    """The worker's answer to this engine (:func:`.probe.probe`) at the sizes of ``args``.

    Raises:
        ValueError: a size out of the wire's range, naming its flag.
    """
    num_spec = 5 if args.num_spec is None else args.num_spec
    sizes = probe.Sizes(args.max_slots, args.row_bytes, num_spec, args.vocab_size)
    try:
        return probe.probe(cfg, sizes, env)
    except ValueError as e:
        raise ValueError(
            f"--probe at --max-slots {args.max_slots} --row-bytes {args.row_bytes} "
            f"--num-spec {num_spec} --vocab-size {args.vocab_size}: {e}"
        ) from e


def _table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows)

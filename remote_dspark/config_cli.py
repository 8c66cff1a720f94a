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

from . import transport
from .config import RemoteConfig, describe

_DESCRIPTION = """\
Check the VLLM_DSPARK_REMOTE* environment exactly as engine startup does: every value
is parsed and validated, cross-field rules are applied, and an o1tcp:// or o1rdma://
endpoint must find ofl.py and libofl.so in VLLM_DSPARK_REMOTE_OFL_DIR. Prints each
variable with its resolved value (identities in hex, values spelled as the environment
would; '-' = unset) and its source (env or default), then derived values. Exits 0 when
the configuration would start, 2 with the reason on stderr when it would not."""


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("check-config", help="validate the VLLM_DSPARK_REMOTE* environment and print it",
                       description=_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true",
                   help='print one JSON object {variable: value, ..., "derived": {name: value}}; '
                        'values are strings as the environment spells them ("" = unset)')
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    env = os.environ
    try:
        cfg = RemoteConfig.from_env(env)
        transport.check_ready(cfg.endpoint, env)
    except ValueError as e:
        print(f"check-config: {e}", file=sys.stderr)
        return 2
    for warning in cfg.warnings():
        print(f"check-config: warning: {warning}", file=sys.stderr)
    rows = describe(cfg, env)
    if args.json:
        out = {name: value for name, value, source in rows if source != "derived"}
        out["derived"] = {name: value for name, value, source in rows if source == "derived"}
        print(json.dumps(out, indent=2))
    else:
        print(_table([("VARIABLE", "VALUE", "SOURCE")]
                     + [(name, value or "-", source) for name, value, source in rows]))
    return 0


def _table(rows: list[tuple[str, str, str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows)

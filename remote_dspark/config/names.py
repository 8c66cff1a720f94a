"""Names in the environment meant for this package that it does not read.

A misspelled variable is otherwise ignored in silence: ``VLLM_DSPARK_REMOTE_TIMEOUT=50``
leaves the deadline at its default. So :func:`unknown_variables` names each one, with
the closest name of :data:`~remote_dspark.config.env.VARIABLES` (difflib), and the engine
logs them once at start (:meth:`RemoteConfig.log_warnings
<remote_dspark.config.RemoteConfig.log_warnings>`) and ``check-config`` prints them.

Which names are looked at:

- every ``VLLM_DSPARK_REMOTE_*`` name: that prefix is this package's, so a name under it
  that the table does not have is a mistake; the closest known name is suggested when
  its part after the prefix is alike (ratio >= :data:`HINT`);
- a name under ``VLLM_DSPARK_`` only belongs to the host engine (its depth policy reads
  several), and is left alone unless its part after ``VLLM_DSPARK_`` is nearly one of
  this package's (ratio >= :data:`CLOSE`: ``VLLM_DSPARK_MARKOV_CACHES``,
  ``VLLM_DSPARK_REMOT_TIMEOUT_MS``). The host engine's names this package knows of
  (:data:`HOST_NAMES`) are never named;
- a known name in other letter case: environment names are case-sensitive.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping

from .env import PREFIX, VARIABLES

FAMILY = "VLLM_DSPARK_"
HINT = 0.6  # a REMOTE_ name's suggestion: difflib's ratio of the parts after the prefix
CLOSE = 0.85  # a VLLM_DSPARK_ name taken for a misspelling of one of ours
# The host engine's own variables that this package mentions (apply_cost_overrides writes
# the last two): never taken for misspellings, however close.
HOST_NAMES = frozenset(
    {"VLLM_DSPARK_DEPTH_POLICY", "VLLM_DSPARK_DEPTH_FILE", "VLLM_DSPARK_DRAFT_MS", "VLLM_DSPARK_ROUND_MS"}
)
_KNOWN = frozenset(VARIABLES)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning for each name of ``environ`` (default ``os.environ``) that looks meant
    for this package but is not one of its variables, naming it and the closest known
    name; in name order."""
    env = os.environ if environ is None else environ
    return [why for why in map(_unknown, sorted(env)) if why is not None]


def _unknown(name: str) -> str | None:
    upper = name.upper()
    if name in _KNOWN or upper in HOST_NAMES or not upper.startswith(FAMILY):
        return None
    if upper in _KNOWN:
        return f"{name} is ignored: variable names are case-sensitive; did you mean {upper}?"
    if upper.startswith(PREFIX):
        near = _closest(upper, PREFIX, HINT)
        hint = f"did you mean {near}?" if near else "`remote-dspark check-config` lists the variables"
        return f"{name} is not a variable of remote-dspark, so it is ignored; {hint}"
    near = _closest(upper, FAMILY, CLOSE)
    return f"{name} is not read by remote-dspark; did you mean {near}?" if near else None


def _closest(upper: str, prefix: str, cutoff: float) -> str | None:
    """The known name under ``prefix`` whose rest is closest to ``upper``'s, if its ratio
    reaches ``cutoff`` (compared without the prefix: a shared prefix would make every
    name look alike)."""
    rests = {known[len(prefix) :]: known for known in VARIABLES if known.startswith(prefix)}
    near = difflib.get_close_matches(upper[len(prefix) :], list(rests), n=1, cutoff=cutoff)
    return rests[near[0]] if near else None

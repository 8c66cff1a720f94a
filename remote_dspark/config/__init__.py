"""The environment contract, engine side: :class:`RemoteConfig` (:mod:`.api`: every
variable read and checked at once, the cross-field rules, the depth policy's inputs)
over the variables' table (:mod:`.env`: each variable's name, default and parsing), the names
meant for this package that it does not read (:mod:`.names`: each with the closest known
name), and :class:`Mode` (:mod:`.mode`: sync, thread or process, decided once from the
configuration)."""

from .api import RemoteConfig, apply_cost_overrides, describe, n_out_table
from .env import ENV_ENDPOINT, ENV_MARKOV_CACHE, POLICIES, VARIABLES, markov_identity_from_env, remote_requested
from .mode import Mode
from .names import unknown_variables

__all__ = [
    "ENV_ENDPOINT",
    "ENV_MARKOV_CACHE",
    "POLICIES",
    "VARIABLES",
    "Mode",
    "RemoteConfig",
    "apply_cost_overrides",
    "describe",
    "markov_identity_from_env",
    "n_out_table",
    "remote_requested",
    "unknown_variables",
]

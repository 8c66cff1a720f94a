"""The engine side: ``RemoteDSpark`` and what a round takes and gives.

    facade      RemoteDSpark: the policies, the lifecycle, rounds and launches, stats()
    mode        Mode: sync, thread or process, decided once from the configuration
    spec        Spec: the configuration and the round's shape, shared by the parts below
    path        the one interface of a round path, whatever the mode
    sync_path   ASYNC=0: the engine thread's own network round
    async_path  ASYNC=1: the hand-off and the proxy host serving it, as one path
    handoff     ASYNC=1: the region, the round hand-off and the engine's own answers
    proxy_host  the proxy as a thread or a supervised process; which one serves
    stats       EngineCounts (the engine thread's counting) and Stats (the one record)
    lifecycle   EngineState, RemoteClosed, Users (when the region may be freed)
    ranks       tensor parallelism: rank 0 opens the path, the others take its broadcast answers

Before it builds its depth policy, on every rank, an engine calls
``apply_cost_overrides(cfg, depth_policy_on=..., depth_mode=..., num_spec=..., depth_file=...)``
(it writes the remote round's costs into ``os.environ``, or the mapping given, and raises
before writing anything on a combination the contract refuses); ``RemoteDSpark`` copies
its environment and could reach no one later.

torch is imported here; nothing the proxy imports imports this package.
"""

from ..config.api import apply_cost_overrides
from ..config.mode import Mode
from .facade import RemoteDSpark
from .lifecycle import EngineState, RemoteClosed, RemoteRoundFailed
from .observe.stats import Stats
from .values.batch import Batch
from .values.drafts import Drafts, Launched

__all__ = [
    "Batch",
    "Drafts",
    "EngineState",
    "apply_cost_overrides",
    "Launched",
    "Mode",
    "RemoteClosed",
    "RemoteDSpark",
    "RemoteRoundFailed",
    "Stats",
]

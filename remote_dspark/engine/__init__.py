"""The engine side: ``RemoteDSpark`` and what a round takes and gives. One round's path
runs down through the parts: ``facade`` chooses a path, a path has a writer put the
round into the region (or onto its own socket), and the answer comes back as values.

    facade      RemoteDSpark: the policies, the lifecycle, rounds and launches, stats()
    spec        Spec: the configuration and the round's shape, shared by the parts below
    policies    which drafts the engine gets (POLICY) and what a round's outcome costs
    lifecycle   EngineState (FORKED in a forked child), RemoteClosed, Users (when the region may be freed)
    sampler     rejection_sample: exact speculative sampling of a round of sampled drafts
    values/     the round's values: Batch, Drafts, the reply's check, a slot's views
    writers/    what writes a round into the region: host (C), device (in stream), the gather
    paths/      what carries it: the sync path, the hand-off and the proxy host serving it
    tp/         tensor parallelism: rank 0 opens the path, the others take its records
    observe/    what counts it: the engine's stats, the stats file, the report, metrics

``docs/design.md``'s ``engine-parts`` block says which of these may import which.

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
from .lifecycle import EngineState, RemoteClosed, RemoteForked, RemoteRoundFailed
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
    "RemoteForked",
    "RemoteRoundFailed",
    "Stats",
]

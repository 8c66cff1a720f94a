"""How an engine runs its rounds: :class:`Mode`, decided once from the configuration.

Its values are the contract's strings: ``stats().mode``, the stats file's ``mode`` and
the metrics' ``mode`` label say "sync", "thread" or "process".
"""

from __future__ import annotations

import enum

from .api import RemoteConfig


class Mode(str, enum.Enum):
    """``SYNC``: the engine thread does the network round (``ASYNC=0``). ``THREAD`` and
    ``PROCESS``: the round is handed over through the shared region to a proxy running
    as a thread of the engine or as a supervised child process (``ASYNC=1``,
    ``ASYNC_PROXY``). An engine whose asynchronous hand-off fails its self-test runs
    ``SYNC`` whatever was asked."""

    SYNC = "sync"
    THREAD = "thread"
    PROCESS = "process"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, cfg: RemoteConfig) -> Mode:
        """The mode ``cfg`` asks for: ``ASYNC=0`` is sync whatever ``ASYNC_PROXY`` says."""
        if not cfg.async_mode:
            return cls.SYNC
        return cls.PROCESS if cfg.async_proxy == "process" else cls.THREAD

    @property
    def handoff(self) -> bool:
        """Rounds go through the shared region to a proxy (thread or process)."""
        return self is not Mode.SYNC

    def variables(self) -> dict[str, str]:
        """The environment variables that ask for this mode (what :meth:`of` reads)."""
        if self is Mode.SYNC:
            return {"VLLM_DSPARK_REMOTE_ASYNC": "0"}
        return {"VLLM_DSPARK_REMOTE_ASYNC": "1", "VLLM_DSPARK_REMOTE_ASYNC_PROXY": self.value}

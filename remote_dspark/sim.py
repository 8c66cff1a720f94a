"""Public path of the simulated engine: :class:`SimEngine` (:mod:`remote_dspark.demo.sim`)."""

from .demo.sim import SimEngine

__all__ = ["SimEngine"]

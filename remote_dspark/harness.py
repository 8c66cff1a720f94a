"""Public path of the demo kit's engine and worker: :class:`DemoEngine` and
:class:`WorkerProcess` (:mod:`remote_dspark.demo.harness`)."""

from .demo.harness import DemoEngine, WorkerProcess

__all__ = ["DemoEngine", "WorkerProcess"]

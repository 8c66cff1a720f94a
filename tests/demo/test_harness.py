"""The demo kit's worker process: the engine environments it gives point at it, and
the stats file of an engine built from one is its own, never the contract's shared
default path."""

from remote_dspark.config import Mode, RemoteConfig
from remote_dspark.demo.harness import WorkerProcess


def test_an_engine_environment_of_the_worker_keeps_its_stats_file_to_itself():
    with WorkerProcess() as worker:
        cfg = RemoteConfig.from_env(worker.env(Mode.PROCESS))
        default = RemoteConfig.from_env(worker.env(stats_file="")).stats_file
        assert cfg.endpoint.port == worker.port and cfg.async_proxy == "process"
        assert cfg.stats_file != default and cfg.stats_file.startswith(worker._files.name)
        assert RemoteConfig.from_env(worker.env(stats_file="/tmp/x.json")).stats_file == "/tmp/x.json"

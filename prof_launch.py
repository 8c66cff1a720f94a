import cProfile, pstats, sys, time
import numpy as np, torch
from remote_dspark.bench.round import Feeder
from remote_dspark.harness import WorkerProcess
from remote_dspark.config import RemoteConfig
from remote_dspark.engine import RemoteDSpark
from remote_dspark import gather
devmeta = len(sys.argv) > 1
with WorkerProcess() as w:
    env = w.env(VLLM_DSPARK_REMOTE_POLICY="capacity", VLLM_DSPARK_REMOTE_ASYNC="1", VLLM_DSPARK_REMOTE_ASYNC_PROXY="process",
                VLLM_DSPARK_REMOTE_STATS_FILE="", VLLM_DSPARK_REMOTE_LOG_EVERY="0", VLLM_DSPARK_REMOTE_TIMEOUT_MS="1000")
    f = Feeder(256, 1024, device="cuda", metadata_device="cuda" if devmeta else "cpu")
    with RemoteDSpark(RemoteConfig.from_env(env), num_spec=5, max_slots=256, row_bytes=1024, device="cuda", environ=env) as rd:
        for _ in range(30):
            b = f.next_batch(); f.after(rd.launch(b)); torch.cuda.synchronize()
        pr = cProfile.Profile(); ts = []
        for _ in range(300):
            b = f.next_batch()
            t = time.perf_counter(); pr.enable(); out = rd.launch(b); pr.disable(); ts.append(time.perf_counter() - t)
            torch.cuda.synchronize(); f.after(out)
        print("launch p50 us (profiled)", np.median(ts) * 1e6)
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        rows = f.rows; idx = torch.arange(256, device="cuda"); out = torch.empty(256, 1024, dtype=torch.uint8, device="cuda")
        for name, fn in [("fused_gather", lambda: gather.fused_gather(rows, idx, out)), ("torch_gather", lambda: gather.torch_gather(rows, idx, out)),
                         ("current_stream", lambda: torch.cuda.current_stream().cuda_stream), ("clone", lambda: out[:256, :5].clone()),
                         ("idx.to host->dev", lambda: torch.arange(256).to("cuda"))]:
            for _ in range(50): fn()
            torch.cuda.synchronize(); t = time.perf_counter()
            for _ in range(1000): fn()
            print(name, (time.perf_counter() - t) * 1e3, "us each (CPU)"); torch.cuda.synchronize()

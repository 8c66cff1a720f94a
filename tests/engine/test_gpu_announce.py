"""Long contexts announced in chunks on the device, on a machine with CUDA: the device's
planner (``engine.values.device_announce``) makes the host's rounds on CUDA tensors, and
launch() with metadata on the GPU brings contexts of every length up to a worker's
window whole and in order, in thread and process modes, every slot re-announced at once
too, the host never reading the metadata. Elsewhere these are skipped (conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import DraftedWindows, drafter_env, until

from remote_dspark.config import Mode
from remote_dspark.config.api import RemoteConfig
from remote_dspark.engine import Batch, RemoteDSpark
from remote_dspark.engine.values.announce import Announcer
from remote_dspark.engine.values.device_announce import DeviceAnnouncer
from remote_dspark.engine.values.meta import host_meta

pytestmark = pytest.mark.gpu

SLOTS, K, WINDOW, BUDGET = 8, 3, 300, 160


def on_cuda(b: Batch) -> Batch:
    fields = ("slots", "tokens", "token_offsets", "positions", "new_gen")
    return Batch(**{f: torch.as_tensor(getattr(b, f)).cuda() for f in fields})


def test_the_device_plans_the_hosts_rounds_on_cuda():
    """Random rounds (new contexts, continuing entries, slots freed) under a 40-token
    budget: the CUDA planner's round equals the host's, token for token."""
    rng = np.random.default_rng(5)
    a, dev = Announcer(SLOTS, 64), DeviceAnnouncer(SLOTS, 64, "cuda")
    nxt, pos = 1000, {}
    for _ in range(200):
        slots = rng.choice(SLOTS, rng.integers(1, SLOTS + 1), replace=False).tolist()
        new = [s not in pos or bool(rng.random() < 0.2) for s in slots]
        toks = [list(range(nxt, nxt + (int(rng.integers(0, 200)) if g else 1))) for g in new]
        nxt += 1000
        positions = [0 if g else pos[s] for s, g in zip(slots, new)]
        for s, t, p in zip(slots, toks, positions):
            pos[s] = p + len(t)
        b = Batch.from_lists(slots, toks, positions, new)
        m = a.plan(
            host_meta(b, max_slots=SLOTS, num_spec=K, max_tokens=1 << 20, n_out_default=K, context_tokens=64), 64, 40
        )
        got, mask = dev.plan(on_cuda(b), 64, 40, K)
        end = int(got.token_offsets[-1])
        assert got.token_offsets.tolist() == m.meta.offsets.tolist()
        assert (
            got.tokens[:end].tolist() == m.meta.tokens.tolist() and got.positions.tolist() == m.meta.positions.tolist()
        )
        assert torch.nonzero(mask).flatten().tolist() == sorted(m.announcing.tolist())
        ended = [s for s in slots if rng.random() < 0.1]
        a.release(ended)
        dev.release(ended)
        for s in ended:
            pos.pop(s)


def launch_until_whole(rd: RemoteDSpark, seq: dict[int, list[int]], nxt: int) -> dict[int, list[int]]:
    """As ``test_announce_rounds.announce``, by launch() of CUDA metadata: the slots still
    announced are read from each launch's mask once the stream is done."""
    slots = sorted(seq)
    whole: dict[int, list[int]] = {}
    b = Batch.from_lists(slots, [seq[s] for s in slots], [0] * len(slots), [True] * len(slots))
    for _ in range(4 * sum(map(len, seq.values())) // BUDGET + 8):
        launched = rd.launch(on_cuda(b))
        torch.cuda.synchronize()
        announcing = set(torch.nonzero(launched.announcing_mask).flatten().tolist())
        assert launched.announcing is None
        whole.update({s: list(seq[s]) for s in slots if s not in announcing and s not in whole})
        if not announcing:
            return whole
        positions = [len(seq[s]) for s in slots]
        for s in slots:
            seq[s].append(nxt)
            nxt += 1
        b = Batch.from_lists(slots, [seq[s][-1:] for s in slots], positions, [False] * len(slots))
    raise AssertionError("slots still announcing")


@pytest.mark.parametrize("mode", [Mode.THREAD, Mode.PROCESS], ids=["thread", "process"])
def test_launch_of_cuda_metadata_brings_every_context_whole(tmp_path, mode):
    from remote_dspark.worker import Worker

    drafter = DraftedWindows()
    with Worker(drafter, "127.0.0.1", 0, max_slots=SLOTS, window=WINDOW, max_round_tokens=BUDGET) as w:
        env = drafter_env(drafter, w.port, mode, stats_file=str(tmp_path / "s.json"))
        env["VLLM_DSPARK_REMOTE_TIMEOUT_MS"] = "5000"
        cfg = RemoteConfig.from_env(env)
        with RemoteDSpark(cfg, environ=env, num_spec=K, max_slots=SLOTS, row_bytes=0, device="cuda") as rd:
            warm = Batch.from_lists([0], [[1, 2]], [0], [True])
            assert until(lambda: bool(rd.round(warm).counts.any()), 20.0, 0.01)
            nxt = 1000
            for first in range(1, WINDOW + 1, 3 * SLOTS):
                seq = {s: list(range(nxt + 1000 * s, nxt + 1000 * s + first + s)) for s in range(SLOTS)}
                nxt += 10_000
                with drafter.lock:
                    drafter.drafted.clear()
                drafter.check_first_drafts(launch_until_whole(rd, seq, nxt + 9000), WINDOW)
            seq = {s: list(range(nxt + 1000 * s, nxt + 1000 * s + WINDOW + 50)) for s in range(SLOTS)}
            with drafter.lock:
                drafter.drafted.clear()
            drafter.check_first_drafts(launch_until_whole(rd, seq, nxt + 9000), WINDOW)

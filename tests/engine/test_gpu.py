"""The GPU path, on a machine with CUDA: the fused gather, the
stream hand-off on the registered region, rounds into device tensors, and a killed proxy
while the stream waits. Elsewhere these are skipped, with the reason (conftest.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from helpers import COUNTING as MODEL
from helpers import drafter_env, until

from remote_dspark import wire
from remote_dspark.config import Mode
from remote_dspark.config.api import RemoteConfig
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.engine import Batch, RemoteDSpark
from remote_dspark.engine.writers import gather
from remote_dspark.outcome import Outcome
from remote_dspark.proxy import ring_end
from remote_dspark.shm import layout, memfd, ring, streamsync
from remote_dspark.worker import Worker

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def no_parked_stream():
    """After every test the device drains within a bound: no stream is left waiting."""
    yield
    done = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
    assert done.wait(20), "the GPU is still busy: a stream was left parked"


def make(worker, tmp_path, *, vocab_size=None, row_bytes=16, **kw):
    env = drafter_env(
        MarkovDrafter(MODEL),
        worker.port,
        Mode.PROCESS,
        stats_file=str(tmp_path / "stats.json"),
        VLLM_DSPARK_REMOTE_TIMEOUT_MS="2000",
        VLLM_DSPARK_REMOTE_ASYNC_WATCHDOG_MS="300",
    )
    env.update(kw)
    return RemoteDSpark(
        RemoteConfig.from_env(env),
        num_spec=3,
        max_slots=8,
        row_bytes=row_bytes,
        device="cuda",
        environ=env,
        vocab_size=vocab_size,
    )


ROWS = torch.arange(32, dtype=torch.float32).reshape(8, 4)


def batch(new=True, tokens=((1,), (3,)), positions=(0, 0)):
    return Batch.from_lists(
        [0, 1], [list(t) for t in tokens], list(positions), [new, new], ROWS.cuda(), torch.tensor([0, 1], device="cuda")
    )


@pytest.fixture
def sampling_worker():
    """A loopback worker of COUNTING whose drafter samples (the gated one does not)."""
    w = Worker(MarkovDrafter(MODEL), "127.0.0.1", 0).start()
    yield w
    w.stop()


# --------------------------------------------------------------------------- gather


def test_fused_gather_equals_the_torch_path_on_every_dtype():
    gather.self_check("cuda")


def test_fused_gather_uses_64_bit_offsets():
    rows = torch.zeros((1 << 19) + 64, 4096, dtype=torch.uint8, device="cuda")  # 2.1 GB: offsets past 2^31
    rows[-64:] = torch.randint(0, 256, (64, 4096), dtype=torch.uint8, device="cuda")
    index = torch.arange(rows.shape[0] - 64, rows.shape[0], device="cuda").flip(0)
    a = torch.zeros(64, 4096, dtype=torch.uint8, device="cuda")
    b = torch.zeros_like(a)
    gather.torch_gather(rows, index, a)
    gather.fused_gather(rows, index, b)
    assert torch.equal(a, b) and torch.equal(b, rows[index])
    del rows


def test_choose_auto_picks_the_fused_path_on_cuda():
    assert gather.choose(None, "cuda") is gather.fused_gather
    assert gather.choose(False, "cuda") is gather.torch_gather


# --------------------------------------------------------------------------- the stream hand-off


def test_the_raw_stream_lookup_is_the_current_streams_handle():
    side = torch.cuda.Stream()
    assert streamsync.current_stream(torch) == torch.cuda.current_stream().cuda_stream
    with torch.cuda.stream(side):
        assert streamsync.current_stream(torch) == side.cuda_stream != 0
    assert streamsync.current_stream(torch) == torch.cuda.current_stream().cuda_stream


def test_stream_hand_off_on_the_registered_region(lib):
    """The stream writes gathered; a CPU peer here answers; the stream's wait ends."""
    with memfd.Region.create(layout.Layout(4, 8, 16, 3, 64)) as region:
        end = ring.EngineEnd(region, lib)
        end.start_watchdog(2000)
        sync = streamsync.HostFlagSync(region, lib, backend="cuda")
        proxy = ring_end.ProxyEnd(region, lib, spin_us=100, nap_us=50)
        staging = sync.backend.device_view(region.layout.staging(1), (8, 16), torch.uint8)
        r = end.reserve(1.0)
        end.write_entries(r, [wire.Entry(0, 3, 0, (1,), True)], deadline_ms=50)
        rows = torch.randint(0, 256, (8, 16), dtype=torch.uint8, device="cuda")
        want = bytes(rows[5].tolist())  # read now: a copy after the wait would wait for it
        gather.fused_gather(rows, torch.tensor([5], device="cuda"), staging)
        sync.signal(r)
        sync.wait(r, 0)
        done = torch.cuda.Event()
        done.record()
        rnd = proxy.next_round(5.0)
        assert rnd is not None and rnd.round == r
        assert bytes(region.staging(1)[:16]) == want  # the rows reached host memory
        assert not done.query()  # the stream still waits for released
        proxy.complete(rnd, wire.DraftsFrame(r, [0], [2], [0], 3, (7, 8, 0)))
        done.synchronize()


# launch()'s stream work by the native launch (auto) and through torch (0).
PATHS = pytest.mark.parametrize("fused", ["auto", "0"], ids=["native launch", "through torch"])


def native(rd) -> bool:
    return rd._path.inner.handoff._launcher is not None


@PATHS
def test_rounds_deliver_the_workers_drafts_into_device_tensors(worker, tmp_path, fused):
    with make(worker, tmp_path, VLLM_DSPARK_REMOTE_FUSED_GATHER=fused) as rd:
        assert native(rd) is (fused == "auto")
        out = rd.launch(batch())
        assert out.tokens.is_cuda and out.counts.is_cuda
        assert out.tokens.tolist() == [[2, 3, 4], [4, 1, 2]] and out.counts.tolist() == [3, 3]
        out = rd.launch(batch(new=False, tokens=((2,), (4,)), positions=(1, 1)))
        assert out.tokens.tolist() == [[3, 4, 1], [1, 2, 3]]
        d = rd.round(batch(new=False, tokens=((3,), (1,)), positions=(2, 2)))
        assert d.outcome is Outcome.OK and d.tokens.tolist() == [[4, 1, 2], [2, 3, 4]]
        rd.launch(batch())
    assert rd.stats().rounds[Outcome.OK] == 4


def on_device(b: Batch) -> Batch:
    """``b`` with every metadata tensor on the GPU (an engine whose tokens never left it)."""

    def cuda(x):
        return torch.as_tensor(x).cuda()

    return Batch(
        cuda(b.slots),
        cuda(b.tokens),
        cuda(b.token_offsets),
        cuda(b.positions),
        cuda(b.new_gen),
        b.rows,
        b.row_index,
        None if b.n_out is None else cuda(b.n_out),
        None if b.temperature is None else cuda(b.temperature),
        None if b.seed is None else cuda(b.seed),
    )


def test_metadata_on_the_device_reaches_the_worker_in_stream_order(worker, tmp_path):
    with make(worker, tmp_path) as rd:
        first = on_device(batch())
        assert first.meta_on_device
        out = rd.launch(first)
        assert out.tokens.tolist() == [[2, 3, 4], [4, 1, 2]] and out.counts.tolist() == [3, 3]
        out = rd.launch(on_device(batch(new=False, tokens=((2,), (4,)), positions=(1, 1))))
        assert out.tokens.tolist() == [[3, 4, 1], [1, 2, 3]]


def test_a_long_new_gen_context_on_the_device_is_cut_as_on_the_host(worker, tmp_path):
    """100 context tokens exceed the region's per-round budget (max_slots x 70) unless
    cut to the last 64 in stream order, as the host path cuts them."""
    long = [1, 2, 3, 4] * 25
    with make(worker, tmp_path) as rd:
        out = rd.launch(on_device(batch(tokens=(long, (3,)))))
        assert out.counts.tolist() == [3, 3] and out.tokens.tolist() == [[1, 2, 3], [4, 1, 2]]
        out = rd.launch(on_device(batch(new=False, tokens=((1,), (4,)), positions=(100, 1))))
        assert out.tokens.tolist() == [[2, 3, 4], [1, 2, 3]]  # the window continued at 100


def sampled_case(rng: np.random.Generator, n: int, seed_form: str) -> Batch:
    """A sampled batch of ``n`` entries: float64 temperatures with -0.0, 0 and values
    float32 rounds; seeds over the whole u64 (as negative int64, or uint64 on the host)."""
    lengths = rng.integers(0, 80, n)
    tokens = [rng.integers(0, 2**31 - 1, int(m)).tolist() for m in lengths]
    temperature = rng.choice([-0.0, 0.0, 0.1, 1 / 3, 2.5, 1e-40, 3e38], n)
    bits = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64, endpoint=True)
    b = Batch.from_lists(
        rng.permutation(8)[:n].tolist(),
        tokens,
        rng.integers(0, 2**31, n).tolist(),
        rng.integers(0, 2, n).astype(bool).tolist(),
        ROWS.cuda(),
        torch.arange(n, device="cuda"),
        temperature=temperature,
        seed=bits.view(np.uint64) if seed_form == "u64" else bits,
    )
    dev = on_device(b)
    if seed_form == "u64":  # a mixed batch: the seeds still on the host, as uint64
        dev.seed = b.seed
    return dev


def on_host(x):
    return x.cpu() if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("seed_form", ["i64", "u64"])
def test_sampled_metadata_written_on_the_device_equals_the_host_path(seed_form):
    """write_meta_in_stream on CUDA (the metadata kernels) writes the bytes host_meta +
    write_meta write, for a sampled round: float32
    temperatures (-0.0 as 0.0), u64 seeds, the tokens after them."""
    from remote_dspark.engine.values.meta import host_meta, write_meta
    from remote_dspark.engine.writers.device_meta import check_meta_shapes, write_meta_in_stream

    rng = np.random.default_rng(7)
    max_tokens = 8 * 90
    for n in (0, 1, 3, 8, 8):
        b = sampled_case(rng, n, seed_form)
        area = torch.zeros((wire.round_meta_bytes(8, True) + 4 * (max_tokens + 1)) // 4, dtype=torch.int32)
        d = area.cuda()
        d[:3] = torch.tensor([77, check_meta_shapes(b, 8, True), 16])
        kw = dict(max_slots=8, num_spec=3, max_tokens=max_tokens, n_out_default=3, context_tokens=64)
        write_meta_in_stream(b, d, **kw, sampled=True)
        got = d.cpu().numpy().view(np.uint8)
        host = Batch(**{f.name: on_host(getattr(b, f.name)) for f in dataclasses.fields(b)})
        meta = host_meta(host, **kw, sampled=True)
        want = np.zeros(got.shape, np.uint8)
        size = write_meta(want, meta, deadline_ms=77, row_bytes=16)
        assert bytes(got[:size]) == bytes(want[:size]), n


@PATHS
def test_a_sampled_launch_with_metadata_on_the_device_draws_as_the_host_path(sampling_worker, tmp_path, fused):
    """The same seeds, contexts and temperatures draw the same drafts and q whether the
    round's metadata was written on the device or on the host, and whether launch()'s
    stream work is native or torch's."""
    b = Batch.from_lists(
        [0, 1],
        [[1, 2], [3]],
        [0, 0],
        [True, True],
        ROWS.cuda(),
        torch.tensor([0, 1], device="cuda"),
        temperature=[0.9, -0.0],
        seed=[2**64 - 3, 12345],
    )
    with make(sampling_worker, tmp_path, VLLM_DSPARK_SAMPLED_TOP32="1", VLLM_DSPARK_REMOTE_FUSED_GATHER=fused) as rd:
        assert native(rd) is (fused == "auto")
        on_dev = rd.launch(on_device(b))
        torch.cuda.synchronize()
        on_host = rd.launch(b)  # NEW_GEN again: the same context
        torch.cuda.synchronize()
        for name in ("tokens", "counts", "q_ids", "q_weights"):
            assert torch.equal(getattr(on_dev, name).cpu(), getattr(on_host, name).cpu()), name
        assert on_dev.counts.tolist() == [3, 3] and on_dev.tokens.tolist() == [[3, 4, 1], [4, 1, 2]]
        assert on_dev.q_weights.to(torch.int64).sum(-1).tolist() == [[65535] * 3] * 2  # each position: all its mass
    assert rd.stats().rounds[Outcome.OK] == 2


def test_without_a_device_writer_metadata_on_the_device_is_written_on_the_host(sampling_worker, tmp_path, monkeypatch):
    """No Triton, or its self-check failed (device_meta.choose says no): launch() copies
    metadata on the GPU to the host and writes it there, drawing as the host path."""
    from remote_dspark.engine.writers import device_meta

    monkeypatch.setattr(device_meta, "choose", lambda device: False)
    b = Batch.from_lists(
        [0, 1], [[1, 2], [3]], [0, 0], [True, True], ROWS.cuda(), torch.tensor([0, 1], device="cuda"),
        temperature=[0.9, -0.0], seed=[2**64 - 3, 12345],
    )  # fmt: skip
    with make(sampling_worker, tmp_path, VLLM_DSPARK_SAMPLED_TOP32="1") as rd:
        assert rd._path.inner.handoff._meta_kernel is False
        on_dev = rd.launch(on_device(b))
        torch.cuda.synchronize()
        on_host = rd.launch(b)
        torch.cuda.synchronize()
        for name in ("tokens", "counts", "q_ids", "q_weights"):
            assert torch.equal(getattr(on_dev, name).cpu(), getattr(on_host, name).cpu()), name
        assert on_dev.counts.tolist() == [3, 3] and on_dev.tokens.tolist() == [[3, 4, 1], [4, 1, 2]]
    assert rd.stats().rounds[Outcome.OK] == 2


def test_a_round_refused_before_its_stream_work_leaves_no_hole(worker, tmp_path):
    """A row index of the wrong shape is refused with its name before anything is
    enqueued; the round is given back, and the next ones are served in sequence."""
    with make(worker, tmp_path) as rd:
        assert native(rd)
        rd.launch(batch())
        bad = batch(new=False, tokens=((2,), (4,)), positions=(1, 1))
        bad.row_index = torch.tensor([[0], [1]], device="cuda")
        with pytest.raises(ValueError, match=r"row_index: shape \(2, 1\), expected \[2\]"):
            rd.launch(bad)
        out = rd.launch(batch(new=False, tokens=((2,), (4,)), positions=(1, 1)))
        torch.cuda.synchronize()
        assert out.tokens.tolist() == [[3, 4, 1], [1, 2, 3]]
    assert rd.stats().rounds[Outcome.OK] == 2


def refused_then_served(rd, bad: Batch) -> None:
    """``bad`` (device metadata the proxy's descriptor check refuses) comes back empty and
    counted (ERROR, rounds_bad_desc), and the next good round is served."""
    assert rd.launch(bad).counts.tolist() == [0, 0]
    good = rd.launch(on_device(batch(new=False, tokens=((2,), (4,)), positions=(1, 1))))
    torch.cuda.synchronize()
    assert good.counts.tolist() == [3, 3]
    rd.launch(batch(new=False, tokens=((3,), (1,)), positions=(2, 2)))  # collects both
    st = rd.stats()
    assert st.handoff.proxy_counters["rounds_bad_desc"] == 1 and st.rounds[Outcome.ERROR] == 1


def test_bad_metadata_on_the_device_is_target_only_and_counted(worker, tmp_path):
    """The host cannot check values it never reads: the proxy does, where they land."""
    with make(worker, tmp_path) as rd:
        rd.launch(batch())
        b = on_device(batch(new=False, tokens=((2,), (4,)), positions=(1, 1)))
        b.slots = torch.tensor([1, 1], device="cuda")  # one slot twice
        refused_then_served(rd, b)


def test_a_token_outside_the_vocabulary_raises_on_the_host_and_is_target_only_on_the_device(worker, tmp_path):
    """``vocab_size`` bounds the engine's token ids: host metadata raises before anything
    is handed over; device metadata, never read on the host, is refused by the proxy's
    descriptor check (ERROR, unsent, rounds_bad_desc)."""
    with make(worker, tmp_path, vocab_size=5) as rd:  # the COUNTING model's ids are 1..4
        rd.launch(batch())
        with pytest.raises(ValueError, match=r"tokens: 5 \(token 1\) outside 0\.\.4"):
            rd.launch(batch(new=False, tokens=((2,), (5,)), positions=(1, 1)))
        refused_then_served(rd, on_device(batch(new=False, tokens=((2,), (5,)), positions=(1, 1))))


def test_killed_proxy_while_the_stream_waits(worker, drafter, tmp_path):
    """The stream resumes within the watchdog deadline (here: at once, released by the
    supervisor as soon as it sees the death), with zero drafts."""
    with make(worker, tmp_path) as rd:
        rd.launch(batch())
        torch.cuda.synchronize()
        sup = rd.supervisor
        drafter.gate.clear()  # the proxy will sit in its network wait
        out = rd.launch(batch(new=False, tokens=((2,), (4,)), positions=(1, 1)))
        done = torch.cuda.Event()
        done.record()
        end = rd._path.inner.handoff.end
        assert until(lambda: end.gathered() == end.last)
        t0 = time.monotonic()
        os.kill(sup.live.pid, signal.SIGKILL)
        assert until(done.query, timeout=rd.cfg.watchdog_ms / 1000 + 0.05)
        waited = time.monotonic() - t0
        assert waited <= rd.cfg.watchdog_ms / 1000 + 0.01
        assert out.counts.tolist() == [0, 0]
        drafter.gate.set()
        assert until(lambda: sup.up is not None)


def test_watchdog_releases_the_stream_when_nobody_answers(worker, drafter, tmp_path):
    with make(worker, tmp_path) as rd:
        rd.launch(batch())
        torch.cuda.synchronize()
        drafter.gate.clear()  # the proxy waits on the worker (TIMEOUT 2 s)
        t0 = time.monotonic()
        out = rd.launch(batch(new=False, tokens=((2,), (4,)), positions=(1, 1)))
        torch.cuda.synchronize()
        waited = time.monotonic() - t0
        assert rd.cfg.watchdog_ms / 1000 - 0.01 <= waited <= rd.cfg.watchdog_ms / 1000 + 0.05
        assert out.counts.tolist() == [0, 0]
        drafter.gate.set()


def test_launch_after_a_failed_self_test_runs_the_round_synchronously(worker, tmp_path, monkeypatch):
    """The async hand-off fails its self-test: the engine falls back to sync rounds, and
    launch() still works: a completed round, same shapes, on the rows' device."""
    from remote_dspark.engine import facade

    def broken(self, *a, **k):
        raise RuntimeError("self-test failed (forced)")

    monkeypatch.setattr(facade.AsyncPath, "__init__", broken)
    with make(worker, tmp_path) as rd:
        assert rd.mode == "sync"
        out = rd.launch(batch())
        assert out.tokens.device.type == "cuda" and out.tokens.shape == (2, 3) and out.counts.shape == (2,)
        assert out.tokens.tolist() == [[2, 3, 4], [4, 1, 2]] and out.counts.tolist() == [3, 3]
        assert out.round == 1 and rd.stats().rounds[Outcome.OK] == 1


@pytest.mark.parametrize("mode", ["process", "sync"])
def test_an_engine_without_rows_launches_with_nothing_gathered(worker, tmp_path, monkeypatch, mode):
    """``row_bytes=0`` on CUDA: no staging view, no gather launched; launch() drafts in
    stream order (metadata on the host or on the device), and synchronously after a failed
    self-test, on the device."""
    from remote_dspark.engine import facade

    def no_gather(*a, **k):
        raise AssertionError("a gather was launched for an engine without rows")

    def broken(self, *a, **k):
        raise RuntimeError("self-test failed (forced)")

    monkeypatch.setattr(gather, "torch_gather", no_gather)
    if mode == "sync":
        monkeypatch.setattr(facade.AsyncPath, "__init__", broken)
    with make(worker, tmp_path, row_bytes=0, VLLM_DSPARK_REMOTE_FUSED_GATHER="0") as rd:
        assert rd.mode == mode
        first = Batch.from_lists([0, 1], [[1], [3]], [0, 0], [True, True])
        out = rd.launch(first if mode == "sync" else on_device(first))
        assert out.tokens.is_cuda and out.tokens.tolist() == [[2, 3, 4], [4, 1, 2]]
        out = rd.launch(Batch.from_lists([0, 1], [[2], [4]], [1, 1], [False, False]))
        assert out.counts.is_cuda and out.tokens.tolist() == [[3, 4, 1], [1, 2, 3]]
        with pytest.raises(ValueError, match="rows: given, but RemoteDSpark was built with row_bytes=0"):
            rd.launch(batch())


def test_launch_writes_the_stats_file_every_log_every_rounds(worker, tmp_path):
    """Stats on every path: launch() alone (no close) keeps a whole stats file."""
    with make(worker, tmp_path, VLLM_DSPARK_REMOTE_LOG_EVERY="4") as rd:
        for i in range(8):
            rd.launch(batch(new=i == 0, tokens=((2,), (4,)) if i else ((1,), (3,)), positions=(i, i)))
        torch.cuda.synchronize()
        doc = json.loads((tmp_path / "stats.json").read_text())
        assert doc["mode"] == "process" and doc["rounds"]["total"] >= 3  # launched rounds count once collected

"""A sampled engine (``VLLM_DSPARK_SAMPLED_TOP32=1``) gets the same sampled drafts in
every mode: through the region and the proxy (thread mode, process mode) as over its own
connection (sync mode), each draft the rule's pick from the distribution that comes with
it (the worker's), at its entry's seed and absolute position."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engines import first_drafted, sampled_engine
from helpers import drafter_env, until

from remote_dspark import wire
from remote_dspark.config import Mode
from remote_dspark.config.api import RemoteConfig
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import SyntheticLanguage, builtin_model
from remote_dspark.drafter.sampling import pick, uniform_u32
from remote_dspark.engine import Batch, RemoteDSpark
from remote_dspark.outcome import Outcome
from remote_dspark.worker import Worker

K, SLOTS, VOCAB = 4, 8, 128  # the synthetic language's vocabulary
TOP, TOTAL = wire.SAMPLED_TOP, wire.SAMPLED_TOTAL
TEMPERATURES = [0.0, 0.5, 1.0, 1.0, 2.0, 0.7, 1.3, 1.0]
SEEDS = [0, 1, 2**64 - 1, 12345, 7, 2**40 + 3, 99, 5]
SIZES = {"num_spec": K, "max_slots": SLOTS, "vocab": VOCAB}  # the engines'


@pytest.fixture(scope="module")
def worker():
    w = Worker(MarkovDrafter(builtin_model()), "127.0.0.1", 0, window=64).start()
    yield w
    w.stop()


def contexts() -> list[list[int]]:
    text = SyntheticLanguage().text(SLOTS * 40, seed=3)
    return [text[40 * i : 40 * i + 3 + 2 * i] for i in range(SLOTS)]  # seen in training: drafts follow


def batch() -> Batch:
    """Every slot anew (NEW_GEN), so each round's drafts are a function of the batch alone."""
    ctx = contexts()
    return Batch.from_lists(
        list(range(SLOTS)),
        ctx,
        [100 * i for i in range(SLOTS)],
        [True] * SLOTS,
        temperature=TEMPERATURES,
        seed=SEEDS,
    )


def sampled_drafts(worker, tmp_path, mode: Mode):
    """The first round with drafts of a sampled engine in ``mode``."""
    with sampled_engine(
        worker,
        tmp_path,
        mode,
        mode.name,
        num_spec=K,
        max_slots=SLOTS,
        vocab=VOCAB,
        VLLM_DSPARK_REMOTE_ASYNC_NAP_US="20",
    ) as rd:
        return first_drafted(lambda: rd.round(batch()))


def launched(rd):
    """The first ``launch()`` with drafts once the stream has them."""

    def step():
        out = rd.launch(batch())
        torch.cuda.synchronize()
        return out

    return first_drafted(step)


def assert_the_worker_s_picks(out) -> None:
    """Sampled drafts: q of every drafted position sums to 65535 and its draft is the
    rule's pick at the entry's seed and absolute position; zeros past counts."""
    ids, w, tokens = out.q_ids.numpy(), out.q_weights.numpy(), out.tokens.numpy()
    assert ids.shape == w.shape == (SLOTS, K, TOP) and ids.dtype == np.int32 and w.dtype == np.uint16
    live = np.arange(K) < out.counts.numpy()[:, None]
    assert live.sum() >= SLOTS * K - 4  # seen contexts: (nearly) all drafted
    assert (w[live].astype(np.int64).sum(axis=1) == TOTAL).all()
    assert not ids[~live].any() and not w[~live].any() and not tokens[~live].any()
    j = np.arange(K)
    p = np.array([100 * i + len(c) for i, c in enumerate(contexts())], np.int64)[:, None] + j
    u = uniform_u32(np.array(SEEDS, np.uint64)[:, None], p, j)
    assert (pick(ids, w, u)[live] == tokens[live]).all()


@pytest.mark.parametrize("mode", [Mode.THREAD, Mode.PROCESS])
def test_a_sampled_engine_gets_the_same_drafts_through_the_proxy_as_in_sync_mode(worker, tmp_path, mode):
    sync = sampled_drafts(worker, tmp_path, Mode.SYNC)
    out = sampled_drafts(worker, tmp_path, mode)
    assert out.source == "remote" and out.margins is None
    assert_the_worker_s_picks(out)
    for field in ("counts", "tokens", "q_ids", "q_weights"):
        assert getattr(out, field).equal(getattr(sync, field)), field


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [Mode.PROCESS, Mode.SYNC])
def test_launch_gives_a_sampled_engine_the_distributions_on_the_device(worker, tmp_path, mode):
    """``launch()`` on CUDA: ``Launched.q_ids`` / ``q_weights`` are device copies of the
    round's q (the drafts slot's blocks in stream order; sync mode: the round's), equal to
    what a sync-mode ``round()`` returns for the same batch."""
    sync = sampled_drafts(worker, tmp_path, Mode.SYNC)
    with sampled_engine(worker, tmp_path, mode, "launch", device="cuda", **SIZES) as rd:
        assert rd.mode == mode
        out = launched(rd)
        assert out.q_ids.is_cuda and out.q_weights.is_cuda and out.q_weights.dtype == torch.uint16
        for field in ("counts", "tokens", "q_ids", "q_weights"):
            assert getattr(out, field).cpu().equal(getattr(sync, field)), field


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [Mode.PROCESS, Mode.SYNC])
def test_launch_redraws_on_the_device_in_stream_order(worker, tmp_path, mode, monkeypatch):
    """``SAMPLED_REDRAW=1`` with ``launch()`` on CUDA: what the stream holds once the launch
    is done is the engine's redraw (with its own generator: on the device in process mode,
    where the drafts reach the stream from the region; sync mode's launch runs its
    round(), redrawn on the host) of the worker's drafts, which are sync mode's for the
    same batch; q past the new counts is zero."""
    from remote_dspark.engine.paths import redraw as redraw_path
    from remote_dspark.engine.sampler import redraw

    states = []

    def spy(tokens, counts, q_ids, q_weights, *, generator):
        states.append((tokens.device, generator.get_state()))
        assert generator.device == tokens.device
        return redraw(tokens, counts, q_ids, q_weights, generator=generator)

    monkeypatch.setattr(redraw_path, "redraw", spy)
    sync = sampled_drafts(worker, tmp_path, Mode.SYNC)
    redrawn = {"VLLM_DSPARK_REMOTE_SAMPLED_REDRAW": "1"}
    with sampled_engine(worker, tmp_path, mode, "redraw", device="cuda", **SIZES, **redrawn) as rd:
        out = launched(rd)
        device, state = states[-1]
        assert device.type == ("cuda" if mode == Mode.PROCESS else "cpu")
        theirs = [getattr(sync, f).to(device) for f in ("tokens", "counts", "q_ids", "q_weights")]
        want = [t.cuda() for t in redraw(*theirs, generator=torch.Generator(device=device).set_state(state))]
        assert out.tokens.equal(want[0].to(out.tokens.dtype)) and out.counts.equal(want[1].to(out.counts.dtype))
        assert (out.counts.cpu() <= sync.counts).all() and (out.counts.cpu() < sync.counts).any()
        live = (torch.arange(K, device="cuda") < out.counts.view(-1, 1)).unsqueeze(-1)
        assert (
            not out.q_ids.masked_select(~live).any() and not out.q_weights.view(torch.int16).masked_select(~live).any()
        )


class GatedSampling(MarkovDrafter):
    """A sampling Markov drafter whose rounds wait for ``gate`` (bounded), saying when
    one is waiting: a round held in flight on purpose."""

    def __init__(self):
        import threading

        super().__init__(builtin_model())
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.gate.set()

    def draft_batch(self, batch):
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait(10.0)
        return super().draft_batch(batch)


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.THREAD, Mode.PROCESS])
def test_a_sampled_round_in_flight_when_close_runs_comes_back_empty_with_zero_q(tmp_path, mode):
    """close() from another thread while a sampled round waits on the worker: that round
    is answered target-only, its q zeros of the round's shape (no stale distribution of
    an earlier round), and close() returns."""
    import threading

    drafter = GatedSampling()
    with Worker(drafter, "127.0.0.1", 0, window=64) as w:
        env = drafter_env(
            drafter,
            w.port,
            mode,
            stats_file=str(tmp_path / "stats.json"),
            VLLM_DSPARK_SAMPLED_TOP32="1",
            VLLM_DSPARK_REMOTE_TIMEOUT_MS="5000",
        )
        rd = RemoteDSpark(RemoteConfig.from_env(env), environ=env, num_spec=K, max_slots=SLOTS, row_bytes=0).start()
        try:
            assert until(lambda: rd.round(batch()).outcome is Outcome.OK, 20.0, 0.01)
            drafter.gate.clear()
            got = []
            t = threading.Thread(target=lambda: got.append(rd.round(batch())))
            t.start()
            assert drafter.waiting.wait(10.0)
            rd.close()
            t.join(10.0)
            assert not t.is_alive()
        finally:
            drafter.gate.set()
            rd.close()
    (out,) = got
    assert out.outcome is not Outcome.OK and not out.counts.any()
    assert out.q_ids.shape == out.q_weights.shape == (SLOTS, K, TOP)
    assert not out.q_ids.any() and not out.q_weights.to(torch.int32).any()


def follow_ups() -> list[Batch]:
    """Rounds after ``batch()``'s NEW_GEN round, over the same slots: even slots continue
    with no new token, then with one; odd slots continue with two new tokens, then start
    anew (NEW_GEN) near the end of the wire's u32 positions, so their drafts are past
    2**32. Each draft is at its entry's last token's position + 1 + j (with no new token:
    the ROUND's position, the slot's next)."""
    ctx, text = contexts(), SyntheticLanguage().text(SLOTS * 40, seed=3)
    at = [100 * i + len(c) for i, c in enumerate(ctx)]  # each slot's next position
    second = [[] if i % 2 == 0 else text[40 * i + len(c) : 40 * i + len(c) + 2] for i, c in enumerate(ctx)]
    after = [at[i] + len(second[i]) for i in range(SLOTS)]
    third = [text[40 * i + len(c) : 40 * i + len(c) + 1] if i % 2 == 0 else ctx[i][:4] for i, c in enumerate(ctx)]
    third_at = [after[i] if i % 2 == 0 else 2**32 - 3 - i for i in range(SLOTS)]
    kw = dict(temperature=TEMPERATURES, seed=SEEDS)
    slots = list(range(SLOTS))
    return [
        Batch.from_lists(slots, second, at, [False] * SLOTS, **kw),
        Batch.from_lists(slots, third, third_at, [i % 2 == 1 for i in range(SLOTS)], **kw),
    ]


def lm_drafter():
    from remote_dspark.drafter.lm.drafter import LMDrafter

    return LMDrafter(device="cpu", cache_slots=SLOTS, window=64)


@pytest.mark.parametrize("make", [lambda: MarkovDrafter(builtin_model()), lm_drafter], ids=["markov", "lm"])
@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.THREAD, Mode.PROCESS])
def test_honest_sampled_drafts_pass_the_pick_check_new_continuing_and_without_new_tokens(tmp_path, mode, make):
    """The engine holds each draft to its pick at the position it computes from the ROUND
    (C in thread and process mode, Python in sync): an honest worker's rounds of NEW_GEN
    entries, continuing entries, entries with no new token and drafts past position 2**32
    all come back OK with drafts."""
    with Worker(make(), "127.0.0.1", 0, window=64) as w:
        with sampled_engine(w, tmp_path, mode, "honest", **SIZES, VLLM_DSPARK_REMOTE_ASYNC_NAP_US="20") as rd:
            first_drafted(lambda: rd.round(batch()))
            for b in follow_ups():
                out = rd.round(b)
                assert out.outcome is Outcome.OK, out.outcome
                assert int(out.counts.sum()) >= SLOTS  # (nearly) every entry drafted

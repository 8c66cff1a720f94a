"""A round carries at most ``round_tokens`` tokens, and at most what the worker's HELLO_ACK
says it takes: the region is sized by ``round_tokens``, a bad value is refused by name,
and longer NEW_GEN contexts reach a worker whole and in order over the next rounds, in
sync, thread and process modes, when every slot is re-announced at once too (what an
engine does after ``resync_all``), and when the engine's ``round_tokens`` is over the
worker's ``--max-round-tokens`` (the smaller holds)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from helpers import DraftedWindows, drafter_env, env_for, until

from remote_dspark import wire
from remote_dspark.config.api import RemoteConfig
from remote_dspark.engine import Batch, Mode, RemoteDSpark
from remote_dspark.engine.observe.stats import AnnounceStats
from remote_dspark.engine.paths.announcing import AnnouncingPath
from remote_dspark.engine.paths.base import NothingOpen
from remote_dspark.engine.spec import default_round_tokens
from remote_dspark.engine.values.batch import meta_to_host
from remote_dspark.engine.values.drafts import Launched, empty_drafts
from remote_dspark.engine.values.meta import host_meta
from remote_dspark.outcome import Outcome
from remote_dspark.worker import Worker
from remote_dspark.worker.windows import Windows

SLOTS, K, CAP, BUDGET = 8, 3, 64, 40


def engine(env, **kw) -> RemoteDSpark:
    kw.setdefault("num_spec", K)
    kw.setdefault("max_slots", SLOTS)
    return RemoteDSpark(RemoteConfig.from_env(env), environ=env, row_bytes=0, **kw)


@pytest.mark.parametrize("bad", [0, -1, wire.MAX_TOKENS + 1, True, 40.0, "40"])
def test_a_bad_round_tokens_is_refused_by_name(tmp_path, bad):
    with pytest.raises(ValueError, match=f"round_tokens={bad!r}: must be None"):
        engine(env_for(1, tmp_path), round_tokens=bad)


def test_the_region_follows_round_tokens_not_the_slots_contexts(tmp_path):
    assert engine(env_for(1, tmp_path), max_slots=256, num_spec=5).round_tokens == 256 * 70  # the default cap's
    assert default_round_tokens(256, 5, 512) == 256 * 70  # not 256 x 518: a raised cap is chunked
    assert default_round_tokens(1, 5, 64) == 70  # at least one whole context
    assert default_round_tokens(64, 63, 64) == 64 * 128  # at most what a batch carries
    with engine(env_for(1, tmp_path, Mode.THREAD), round_tokens=BUDGET) as rd:
        assert rd.round_tokens == BUDGET
        assert rd._path.inner.handoff.region.layout.max_tokens == BUDGET


def test_a_rounds_budget_is_the_smaller_of_round_tokens_and_the_workers_cap(tmp_path):
    spec = engine(env_for(1, tmp_path), round_tokens=10 * BUDGET).spec
    assert (spec.round_budget(BUDGET), spec.round_budget(100 * BUDGET)) == (BUDGET, 10 * BUDGET)
    # Before any HELLO_ACK: what a worker of the default window and limits takes from 8 slots.
    assert spec.round_budget(0) == min(10 * BUDGET, SLOTS * (wire.DEFAULT_CONTEXT + wire.MAX_N_OUT)) == 400
    assert engine(env_for(1, tmp_path), round_tokens=5000).spec.round_budget(0) == SLOTS * 128


def step(rd: RemoteDSpark, slots, tokens, positions, new):
    """One round of ``slots``; every round is answered OK and loses no slot."""
    d = rd.round(Batch.from_lists(list(slots), [list(t) for t in tokens], list(positions), [new] * len(slots)))
    assert d.outcome is Outcome.OK and not d.resync and not d.resync_all
    for i, s in enumerate(slots):  # no drafts for a slot still being announced
        assert s not in d.announcing or int(d.counts[i]) == 0
    return d


def announce(rd: RemoteDSpark, seq: dict[int, list[int]], nxt: int, budget: int = BUDGET) -> dict[int, list[int]]:
    """NEW_GEN every slot of ``seq`` (its tokens at positions from 0), then a token a round
    per slot (the target's, as an engine without drafts accepts) until none is still
    announced; ``seq`` grows by what was sent. Returns each slot's tokens as they were
    in the round its context became whole."""
    slots = sorted(seq)
    whole: dict[int, list[int]] = {}
    d = step(rd, slots, [seq[s] for s in slots], [0] * len(slots), True)
    for _ in range(4 * sum(map(len, seq.values())) // budget + 8):
        whole.update({s: list(seq[s]) for s in slots if s not in d.announcing and s not in whole})
        if not d.announcing:
            return whole
        positions = [len(seq[s]) for s in slots]
        for s in slots:
            seq[s].append(nxt)
            nxt += 1
        d = step(rd, slots, [seq[s][-1:] for s in slots], positions, False)
    raise AssertionError(f"slots {d.announcing} still announcing")


@pytest.mark.parametrize("round_tokens", [BUDGET, 10 * BUDGET], ids=["same", "over-the-workers"])
@pytest.mark.parametrize("mode", [None, Mode.THREAD, Mode.PROCESS], ids=["sync", "thread", "process"])
def test_contexts_of_every_length_reach_the_worker_whole_and_in_order(tmp_path, mode, round_tokens):
    """Every context length 1..64 (the cap and the worker's window), eight slots at once
    under a 40-token round (the worker refuses a longer round: a protocol error, and its
    HELLO_ACK says so: an engine whose own round_tokens is larger chunks to 40), then
    every slot re-announced at once: each slot is first drafted from its whole context."""
    drafter = DraftedWindows()
    with Worker(drafter, "127.0.0.1", 0, max_slots=SLOTS, max_round_tokens=BUDGET) as w:
        env = drafter_env(drafter, w.port, mode, stats_file=str(tmp_path / "s.json"))
        env["VLLM_DSPARK_REMOTE_TIMEOUT_MS"] = "5000"
        with engine(env, round_tokens=round_tokens) as rd:
            warm = Batch.from_lists([0], [[1, 2]], [0], [True])
            assert until(lambda: bool(rd.round(warm).counts.any()), 20.0, 0.01)  # a proxy serves
            assert rd._path.acked_round_tokens == BUDGET and rd.round_tokens == round_tokens
            nxt = 1000
            for first in range(1, CAP + 1, SLOTS):
                seq = {s: list(range(nxt + 100 * s, nxt + 100 * s + first + s)) for s in range(SLOTS)}
                nxt += 1000
                with drafter.lock:
                    drafter.drafted.clear()
                drafter.check_first_drafts(announce(rd, seq, nxt + 500), CAP)
            # Every slot re-announced at once (as after resync_all): 8 x 64 tokens, 40 a round.
            seq = {s: [t for t in range(nxt + 100 * s, nxt + 100 * s + CAP)] for s in range(SLOTS)}
            with drafter.lock:
                drafter.drafted.clear()
            before = rd._path.announcer.rounds
            drafter.check_first_drafts(announce(rd, seq, nxt + 1000), CAP)
            assert rd._path.announcer.rounds - before >= SLOTS * CAP // BUDGET  # chunked: 40 tokens a round
            counted = rd.stats().announce  # the one record: the metrics and the stats file read it
            assert counted.chunks >= 2 * (SLOTS - 1) and counted.announcing == 0


WINDOW, LONG_BUDGET = 300, 160  # a worker keeping 300 tokens a slot, taking 160 a round


@pytest.mark.parametrize("mode", [None, Mode.THREAD, Mode.PROCESS], ids=["sync", "thread", "process"])
def test_contexts_up_to_a_large_window_reach_the_worker_whole_at_the_default_cap(tmp_path, mode):
    """An engine of the default cap (8,192) and a worker of a 300-token window: contexts
    of every length 1..307 (past the window: cut to it), eight slots at once, in rounds
    of at most 160 tokens (the worker's cap), then every slot re-announced at once (as
    after resync_all): each slot is first drafted from its whole context, its last 300."""
    drafter = DraftedWindows()
    with Worker(drafter, "127.0.0.1", 0, max_slots=SLOTS, window=WINDOW, max_round_tokens=LONG_BUDGET) as w:
        env = drafter_env(drafter, w.port, mode, stats_file=str(tmp_path / "s.json"))
        env["VLLM_DSPARK_REMOTE_TIMEOUT_MS"] = "5000"
        with engine(env) as rd:
            assert rd.context_tokens == 8192
            warm = Batch.from_lists([0], [[1, 2]], [0], [True])
            assert until(lambda: bool(rd.round(warm).counts.any()), 20.0, 0.01)  # a proxy serves
            assert (rd._path.acked_context, rd._path.acked_round_tokens) == (WINDOW, LONG_BUDGET)
            nxt = 1000
            for first in range(1, WINDOW + 1, SLOTS):
                seq = {s: list(range(nxt + 1000 * s, nxt + 1000 * s + first + s)) for s in range(SLOTS)}
                nxt += 10_000
                with drafter.lock:
                    drafter.drafted.clear()
                drafter.check_first_drafts(announce(rd, seq, nxt + 9000, LONG_BUDGET), WINDOW)
            seq = {s: list(range(nxt + 1000 * s, nxt + 1000 * s + WINDOW + 50)) for s in range(SLOTS)}
            with drafter.lock:
                drafter.drafted.clear()
            drafter.check_first_drafts(announce(rd, seq, nxt + 9000, LONG_BUDGET), WINDOW)
            assert rd.stats().announce.announcing == 0


def lose_the_worker(mode, w: Worker, rd: RemoteDSpark, drafter) -> Worker:
    """Sync mode: the worker restarted on its port (the new one holds nothing); process
    mode: the proxy SIGKILLed (its supervisor starts another, a new session). Returns the
    worker now serving."""
    if mode is None:
        port = w.port
        w.stop()
        return Worker(drafter, "127.0.0.1", port, max_slots=SLOTS, max_round_tokens=BUDGET).start()
    sup = rd.supervisor
    pid = sup.up.pid
    os.kill(pid, signal.SIGKILL)
    assert until(lambda: sup.up is not None and sup.up.pid != pid, 20.0)
    return w


@pytest.mark.parametrize("mode", [None, Mode.PROCESS], ids=["sync-worker-restarted", "process-proxy-killed"])
def test_after_a_real_resync_every_context_reaches_the_worker_whole_again(tmp_path, mode):
    """Eight long contexts (8 x 57..64 tokens, 40 a round) are being announced when the
    worker's windows are lost (a new worker, or a new proxy: a new session). Rounds go on
    (a token a slot, as an engine without drafts accepts the target's) until an answer
    says resync_all; every slot is then re-announced NEW_GEN (its whole sequence, cut to
    the window), in chunks of at most a round's tokens (the worker refuses more): each is
    first drafted from its whole context, in order, and counted re-announced."""
    drafter = DraftedWindows()
    w = Worker(drafter, "127.0.0.1", 0, max_slots=SLOTS, max_round_tokens=BUDGET).start()
    try:
        env = drafter_env(drafter, w.port, mode, stats_file=str(tmp_path / "s.json"))
        env["VLLM_DSPARK_REMOTE_TIMEOUT_MS"] = "5000"
        with engine(env, round_tokens=BUDGET) as rd:
            warm = Batch.from_lists([0], [[1, 2]], [0], [True])
            assert until(lambda: bool(rd.round(warm).counts.any()), 20.0, 0.01)  # a proxy serves
            slots = list(range(SLOTS))
            seq = {s: list(range(1000 + 100 * s, 1000 + 100 * s + CAP - s)) for s in slots}
            d = step(rd, slots, [seq[s] for s in slots], [0] * SLOTS, True)
            assert len(d.announcing) >= SLOTS - 1 and rd._path.announcer.pending  # held, being announced
            w = lose_the_worker(mode, w, rd, drafter)
            nxt, deadline = 5000, time.monotonic() + 30.0
            while not d.resync_all:
                assert time.monotonic() < deadline, "no resync_all within 30 s"
                positions = [len(seq[s]) for s in slots]
                for s in slots:
                    seq[s].append(nxt)
                    nxt += 1
                d = rd.round(Batch.from_lists(slots, [seq[s][-1:] for s in slots], positions, [False] * SLOTS))
            before = rd.stats().announce.reannounced
            with drafter.lock:
                drafter.drafted.clear()
            drafter.check_first_drafts(announce(rd, seq, nxt), CAP)
            assert rd.stats().announce.reannounced - before == SLOTS and rd.stats().announce.announcing == 0
    finally:
        w.stop()


class Sent(NothingOpen):
    """A path that records the batches it is given to launch (and launches nothing)."""

    def __init__(self):
        super().__init__()
        self.batches: list[Batch] = []

    def launch(self, batch, answer, out=(), status=None):
        self.batches.append(batch)
        return Launched(1, torch.zeros(len(batch), K, dtype=torch.int32), torch.zeros(len(batch)), (), False)


def test_launch_chunks_host_metadata_on_the_host_and_device_metadata_on_the_device(tmp_path, monkeypatch):
    """launch() reads no metadata of the device's on the host: a batch of more tokens than
    a round is planned on the device (here CPU tensors standing for the device's), its
    tokens a buffer of the budget, the slots announcing a mask; while the device may hold
    a slot every round is planned there (a host batch too); once it holds none, a small
    batch goes as it is again. Host metadata is planned on the host."""
    spec = engine(env_for(1, tmp_path), round_tokens=BUDGET).spec
    path = AnnouncingPath(Sent(), spec)
    small = Batch.from_lists([0], [[1, 2, 3]], [0], [True])
    assert path.launch(small, None).announcing == () and path.inner.batches[-1] is small  # as it is
    long = Batch.from_lists([1, 2], [range(30), range(30)], [0, 0], [True, True])
    launched = path.launch(long, None)  # host metadata: planned on the host
    assert launched.announcing == (2,) and path.inner.batches[-1].token_offsets.tolist() == [0, 30, 40]
    monkeypatch.setattr(Batch, "meta_on_device", property(lambda b: isinstance(b.tokens, torch.Tensor)))
    cont = Batch.from_lists([2, 3], [[8], range(40)], [30, 0], [False, True])  # slot 2 goes on, 3 is new
    tensors = Batch(
        **{f: torch.as_tensor(getattr(cont, f)) for f in ("slots", "tokens", "token_offsets", "positions", "new_gen")}
    )
    launched = path.launch(tensors, None)  # slot 2's last 20 taken over from the host, first
    sent = path.inner.batches[-1]
    assert launched.announcing is None and sent.tokens_bounded and sent.tokens.shape == (BUDGET,)
    assert torch.nonzero(launched.announcing_mask).flatten().tolist() == [3]
    assert sent.token_offsets.tolist() == [0, 21, 40] and sent.positions.tolist() == [10, 0]
    assert sent.tokens[:21].tolist() == [*range(10, 30), 8] and sent.n_out.tolist() == [K, 0]
    assert path.announcer.pending == 0 and path.stats().announce.announcing == 1
    path.launch(Batch.from_lists([3], [[9]], [40], [False]), None)  # a host batch: planned on the device
    sent = path.inner.batches[-1]
    assert sent.tokens_bounded and sent.token_offsets.tolist() == [0, 22] and sent.n_out.tolist() == [K]
    assert sent.tokens[:22].tolist() == [*range(19, 40), 9]
    assert not path.on_device.maybe_held()
    assert path.launch(small, None).announcing == () and path.inner.batches[-1] is small  # as it is again


def on_device(batch: Batch) -> Batch:
    """``batch`` with its tokens on torch's "meta" device: metadata the host cannot read."""
    return Batch(**{f: getattr(batch, f) for f in ("slots", "token_offsets", "positions", "new_gen")},
                 tokens=torch.as_tensor(batch.tokens).to("meta"))  # fmt: skip


def test_device_metadata_goes_as_it_is_when_the_budget_holds_any_cut_batch(tmp_path):
    """The default round_tokens holds every slot's whole context at the default cap: a
    burst of new requests longer than the cap, more tokens before the cut than a round,
    is launched as it is (the device cuts it), never refused; its mask of the slots
    announcing (none) is on the metadata's device."""
    spec = engine(env_for(1, tmp_path), max_slots=8).spec
    path = AnnouncingPath(Sent(), spec)
    burst = on_device(Batch.from_lists(list(range(8)), [range(2000)] * 8, [0] * 8, [True] * 8))
    assert int(burst.tokens.shape[0]) > spec.max_tokens  # 16,000 tokens before the cut, 8 x 64 after
    launched = path.launch(burst, None)
    assert path.inner.batches[-1] is burst and launched.announcing is None  # not read: the mask says it
    assert launched.announcing_mask.shape == (8,) and launched.announcing_mask.device == burst.tokens.device


class ToWindows(NothingOpen):
    """A path that takes each launched batch (CPU tensors standing for a device's) into a
    worker's windows of ``WINDOW`` tokens, its NEW_GEN contexts cut as the metadata
    kernels cut them, and records the window each slot is first drafted from."""

    acked_context, acked_round_tokens = WINDOW, LONG_BUDGET  # the worker's HELLO_ACK

    def __init__(self):
        super().__init__()
        self.windows = Windows(SLOTS, WINDOW)
        self.first: dict[int, list[int]] = {}
        self.last: Batch | None = None  # the batch last launched

    def launch(self, batch, answer, out=(), status=None):
        self.last = batch
        m = host_meta(meta_to_host(batch), max_slots=SLOTS, num_spec=K, max_tokens=1 << 20, n_out_default=K,
                      context_tokens=WINDOW)  # fmt: skip
        assert self.windows.advance(m.slots, m.positions, m.new_gen, m.offsets, m.tokens.astype(np.int32)).ok.all()
        for s, n_out in zip(m.slots.tolist(), np.broadcast_to(m.n_out, (m.n,)).tolist()):
            if n_out:
                self.first.setdefault(s, self.windows.window_of(s))
        return Launched(1, torch.zeros(m.n, K, dtype=torch.int32), torch.zeros(m.n, dtype=torch.int32), (), False)


def test_launch_of_device_metadata_always_says_the_slots_announcing_in_a_mask(tmp_path, monkeypatch):
    """The CPU twin of ``test_gpu_announce``'s launch: contexts of every length up to a
    300-token window, eight slots at once, 160 tokens a round, launched as device
    metadata: each launch's ``announcing`` is None and its ``announcing_mask`` names the
    slots still announcing, whether the round was planned on the device or went as it is
    (then none); each slot is first drafted from its whole context."""
    monkeypatch.setattr(Batch, "meta_on_device", property(lambda b: isinstance(b.tokens, torch.Tensor)))
    path = AnnouncingPath(ToWindows(), engine(env_for(1, tmp_path)).spec)
    fields = ("slots", "tokens", "token_offsets", "positions", "new_gen")
    nxt, counted = 1000, {"as is": 0, "planned": 0}
    for first in [*range(1, WINDOW + 1, 3 * SLOTS), WINDOW + 50]:
        seq = {s: list(range(nxt + 1000 * s, nxt + 1000 * s + first + s)) for s in range(SLOTS)}
        nxt += 10_000
        path.inner.first.clear()
        whole: dict[int, list[int]] = {}
        b = Batch.from_lists(list(seq), list(seq.values()), [0] * SLOTS, [True] * SLOTS)
        for _ in range(4 * sum(map(len, seq.values())) // LONG_BUDGET + 8):
            given = Batch(**{f: torch.as_tensor(getattr(b, f)) for f in fields})
            launched = path.launch(given, None)
            assert launched.announcing is None and launched.announcing_mask.shape == (SLOTS,)
            announcing = set(torch.nonzero(launched.announcing_mask).flatten().tolist())
            counted["as is" if path.inner.last is given else "planned"] += 1
            whole.update({s: list(seq[s]) for s in seq if s not in announcing and s not in whole})
            if not announcing:
                break
            positions = [len(seq[s]) for s in seq]
            for s in seq:
                seq[s].append(nxt)
                nxt += 1
            b = Batch.from_lists(list(seq), [seq[s][-1:] for s in seq], positions, [False] * SLOTS)
        assert not announcing and path.inner.first == {s: w[-WINDOW:] for s, w in whole.items()}
    assert counted["as is"] > 0 and counted["planned"] > 0  # both ways of a round


def test_meta_checks_a_batch_as_round_takes_it(tmp_path):
    """``rd.meta`` holds a batch to what a batch may carry (its rounds chunk it), as
    ``round()`` does, not to one round's tokens."""
    with engine(env_for(1, tmp_path), round_tokens=BUDGET) as rd:
        meta = rd.meta(Batch.from_lists([0, 1], [range(30), range(30)], [0, 0], [True, True]))
    assert meta.offsets.tolist() == [0, 30, 60]


class Answering(Sent):
    """Records the batches it is given; answers each OK, losing the slots it is told to."""

    def __init__(self):
        super().__init__()
        self.lose: tuple[tuple[int, ...], bool] = ((), False)

    def round(self, batch):
        self.batches.append(batch)
        d = empty_drafts(len(batch), K, Outcome.OK, False)
        (d.resync, d.resync_all), self.lose = self.lose, ((), False)
        return d


def test_the_path_counts_chunks_slots_announcing_and_slots_reannounced(tmp_path):
    """Chunks: each entry sent short of its context and each sending its last part;
    re-announced: a NEW_GEN entry of a slot an answer lost (RESYNC, resync_all), once,
    whether its batch goes as it is or in chunks; a plain entry pays without counting."""
    path = AnnouncingPath(Answering(), engine(env_for(1, tmp_path), round_tokens=BUDGET).spec)

    def step(slots, lens, positions, new, lose=((), False)):
        path.inner.lose = lose
        n = len(slots)
        new = new if isinstance(new, list) else [new] * n
        path.round(Batch.from_lists(slots, [range(m) for m in lens], positions, new))
        return path.stats().announce

    assert step([0], [3], [0], True) == AnnounceStats(0, 0, 0)  # fits: nothing counted
    assert step([1, 2], [30, 30], [0, 0], True) == AnnounceStats(1, 1, 0)  # slot 2: 10 of 30
    assert step([1, 2], [1, 1], [30, 30], False, lose=((1,), False)) == AnnounceStats(2, 0, 0)  # its last 21
    assert step([1], [5], [0], True) == AnnounceStats(2, 0, 1)  # slot 1 re-announced, as it is
    assert step([1], [5], [0], True, lose=((), True)) == AnnounceStats(2, 0, 1)  # not owed: a new request
    # after resync_all: slots 1 and 2 re-announced (2 in chunks: 60 tokens), 3 continues (no count)
    assert step([1, 2, 3], [3, 60, 1], [0, 0, 9], [True, True, False]) == AnnounceStats(3, 1, 3)
    assert step([2], [1], [60], False) == AnnounceStats(4, 0, 3)  # its last part; no longer owed

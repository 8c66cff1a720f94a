"""``VLLM_DSPARK_REMOTE_SAMPLED_REDRAW=1``: the drafts a sampled engine delivers are its
own redraws of the worker's (``engine.sampler.redraw``), in sync and thread modes: never
more than the worker's, each the engine's pick from the q that comes with it, and a
worker that drafts a token with a ``q`` built around the engine's draw no longer has it
delivered."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engines import first_drafted, sampled_engine
from sampled_attack import adaptive_rows

from remote_dspark.config import Mode
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import SyntheticLanguage, builtin_model
from remote_dspark.engine import Batch
from remote_dspark.engine.paths import redraw as redraw_path
from remote_dspark.engine.sampler import redraw
from remote_dspark.sampled import threshold, uniform_u32
from remote_dspark.worker import Worker

K, SLOTS, VOCAB, BAD = 4, 64, 128, 7


class AdaptiveAttacker(MarkovDrafter):
    """A sampled Markov drafter that drafts token 7 at every position with a ``q`` built
    around the engine's known draw there (``sampled_attack.adaptive_rows``): 7 is the
    rule's pick with the least weight it can have, so every check of the reply passes."""

    def draft_batch(self, batch):
        out = super().draft_batch(batch)
        width = out.tokens.shape[1]
        j = np.arange(width)
        live = j < out.counts[:, None]
        lengths = np.diff(np.asarray(batch.offsets, np.int64))
        position = (batch.starts() + lengths)[:, None] + j  # each draft's absolute position
        r = threshold(uniform_u32(batch.seed[:, None], position, j).astype(np.uint64)).astype(np.int64)
        ids, weights = adaptive_rows(r, BAD, [t for t in range(VOCAB) if t != BAD][:31])
        out.tokens[live] = BAD
        out.q_ids[live] = ids[live]
        out.q_weights[live] = weights[live]
        return out


@pytest.fixture(scope="module", params=["honest", "attacker"])
def worker(request):
    drafter = (MarkovDrafter if request.param == "honest" else AdaptiveAttacker)(builtin_model())
    w = Worker(drafter, "127.0.0.1", 0, window=64).start()
    yield w
    w.stop()


def batch() -> Batch:
    text = SyntheticLanguage().text(SLOTS * 20, seed=4)
    contexts = [text[20 * i : 20 * i + 6] for i in range(SLOTS)]
    return Batch.from_lists(
        list(range(SLOTS)), contexts, [0] * SLOTS, [True] * SLOTS, temperature=[1.0] * SLOTS, seed=range(SLOTS)
    )


def first_ok(worker, tmp_path, mode: Mode, **env):
    """The first round with drafts of a sampled engine in ``mode``, and the engine's count
    of draft tokens then."""
    sizes = {"num_spec": K, "max_slots": SLOTS, "vocab": VOCAB}
    with sampled_engine(worker, tmp_path, mode, "redraw", **sizes, VLLM_DSPARK_REMOTE_ASYNC_NAP_US="20", **env) as rd:
        return first_drafted(lambda: rd.round(batch())), rd.stats().draft_tokens


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.THREAD])
def test_the_engine_delivers_its_own_redraws(worker, tmp_path, monkeypatch, mode):
    calls = []

    def spy(tokens, counts, q_ids, q_weights, *, generator):
        calls.append((generator.get_state(), generator.initial_seed()))
        return redraw(tokens, counts, q_ids, q_weights, generator=generator)

    monkeypatch.setattr(redraw_path, "redraw", spy)
    monkeypatch.setattr(redraw_path.secrets, "randbits", lambda bits: 2**63 + 12345)  # a fixed seed: no flake
    theirs, counted = first_ok(worker, tmp_path, mode)  # the worker's drafts (no redraw: the spy sees nothing)
    drafted = theirs.counts > 0
    assert not calls and int(drafted.sum()) >= SLOTS - 4  # seen contexts: (nearly) all drafted
    ours, counted_redrawn = first_ok(worker, tmp_path, mode, VLLM_DSPARK_REMOTE_SAMPLED_REDRAW="1")
    # The statistics count the worker's drafts either way (as launch() does).
    assert counted == counted_redrawn > 0
    state, seed = calls[-1]
    assert seed == 2**63 + 12345  # from secrets (not torch's fixed default seed)
    want = redraw(
        theirs.tokens, theirs.counts, theirs.q_ids, theirs.q_weights, generator=torch.Generator().set_state(state)
    )
    assert ours.tokens.equal(want[0]) and ours.counts.equal(want[1])
    assert (ours.counts <= theirs.counts).all() and (ours.counts[drafted] >= 1).all()
    live = (torch.arange(K) < ours.counts.unsqueeze(1)).unsqueeze(-1)
    for field in ("q_ids", "q_weights"):  # the same q up to the new counts, zeros after
        mine, worker_s = getattr(ours, field).long(), getattr(theirs, field).long()
        assert mine.equal(worker_s * live), field
    if isinstance(worker.drafter, AdaptiveAttacker):
        assert (theirs.tokens[drafted] == BAD).all()
        # 7 is the engine's draw only as often as q gives it (a few %), and only where it
        # is do the worker's next drafts stay in play.
        first = ours.tokens[drafted, 0]
        assert int((first == BAD).sum()) <= int(drafted.sum()) // 8
        assert torch.equal(ours.counts[drafted] >= 2, first == BAD)
    else:
        assert (ours.counts < theirs.counts).any()  # at temperature 1 some draw differs

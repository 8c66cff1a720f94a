"""A sampled engine's batch and answer (``VLLM_DSPARK_SAMPLED_TOP32=1``): temperatures and
seeds are checked by name and written byte for byte as the wire's sampled ROUND; the
distributions come back widened to num_spec, zero past each count; a local drafter's
deterministic drafts get one-hot q, which keeps the sampler exact; the sampled caps are
the engine's arguments' too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.config import RemoteConfig
from remote_dspark.config.mode import Mode
from remote_dspark.demo.harness import engine_env
from remote_dspark.engine import RemoteDSpark
from remote_dspark.engine.policies import local_drafts
from remote_dspark.engine.sampler import rejection_sample
from remote_dspark.engine.values.batch import Batch
from remote_dspark.engine.values.drafts import empty_drafts, one_hot_q, to_drafts
from remote_dspark.engine.values.meta import host_meta, write_meta
from remote_dspark.outcome import Outcome
from remote_dspark.sampled import violation

MAX_SLOTS, K, TOP = 16, 4, wire.SAMPLED_TOP


def meta(batch: Batch, sampled: bool = True):
    return host_meta(batch, max_slots=MAX_SLOTS, num_spec=K, max_tokens=1000, n_out_default=K, sampled=sampled)


@st.composite
def sampled_batches(draw):
    n = draw(st.integers(0, MAX_SLOTS))
    slots = draw(st.permutations(range(MAX_SLOTS)))[:n]
    tokens = [draw(st.lists(st.integers(0, 1000), max_size=6)) for _ in range(n)]
    positions = draw(st.lists(st.integers(0, 2**31), min_size=n, max_size=n))
    new_gen = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    temps = st.floats(0, 1e30, allow_nan=False) | st.just(-0.0)
    temperature = draw(st.lists(temps, min_size=n, max_size=n))
    seed = draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n))
    batch = Batch.from_lists(slots, tokens, positions, new_gen, temperature=temperature, seed=seed)
    return batch, tokens


@settings(max_examples=100, deadline=None)
@given(sampled_batches(), st.booleans())
def test_a_sampled_round_s_bytes_equal_the_wire_s_reference(case, as_tensors):
    batch, tokens = case
    if as_tensors:  # an engine's own tensors: float32 temperatures, a u64 seed as int64's bits
        batch.temperature = torch.from_numpy(batch.temperature.astype(np.float32))
        batch.seed = torch.from_numpy(batch.seed.view(np.int64))
    m = meta(batch)
    buf = np.zeros(wire.round_meta_bytes(MAX_SLOTS, True) + 4000, dtype=np.uint8)
    size = write_meta(buf, m, deadline_ms=9, row_bytes=0)
    entries = [
        wire.Entry(int(s), K, int(p), t, bool(g), float(np.float32(tm) + np.float32(0)), int(sd))
        for s, p, t, g, tm, sd in zip(
            batch.slots, batch.positions, tokens, batch.new_gen, np.asarray(batch.temperature), m.seed
        )
    ]
    want = wire.encode_round_entries(1, 0, 9, entries, b"", 0, sampled=True)
    assert bytes(buf[:size]) == want[wire.HEADER.size :]
    decoded = wire.decode_round(wire.decode_header(want[: wire.HEADER.size]), want[wire.HEADER.size :], sampled=True)
    assert not np.signbit(np.frombuffer(decoded.temperature, np.float32)).any()  # -0.0 is sent as 0


@pytest.mark.parametrize(
    "kw, sampled, why",
    [
        (dict(), True, r"^temperature: None, but the engine asks for sampled drafts \(VLLM_DSPARK_SAMPLED_TOP32=1\)"),
        (dict(temperature=[1.0, 1.0]), True, r"^seed: None, but the engine asks"),
        (dict(temperature=[1.0, 1.0], seed=[1, 2]), False, r"^temperature: given, but .*SAMPLED_TOP32=0\); pass None"),
        (dict(seed=[1, 2]), False, r"^seed: given, but the engine does not ask"),
        (dict(temperature=[1.0, -0.5], seed=[1, 2]), True, r"^temperature: -0.5 \(entry 1\) not a finite float32 >= 0"),
        (dict(temperature=[float("nan"), 1], seed=[1, 2]), True, r"^temperature: nan \(entry 0\)"),
        (dict(temperature=[1.0, 1e39], seed=[1, 2]), True, r"^temperature: inf \(entry 1\)"),  # past float32
        (dict(temperature=[1.0], seed=[1, 2]), True, r"^temperature: shape \(1,\), expected \[2\]"),
        (dict(temperature=[1.0, 1.0], seed=np.array([1.5, 2.0])), True, r"^seed: dtype float64, expected an integer"),
    ],
)
def test_sampling_fields_are_held_to_the_engine_by_name(kw, sampled, why):
    batch = Batch.from_lists([0, 1], [[1], [2]], [0, 0], [True, True], **kw)
    with pytest.raises(ValueError, match=why):
        meta(batch, sampled)


def test_a_negative_int64_seed_is_its_u64_bits():
    batch = Batch.from_lists([0], [[1]], [0], [True], temperature=[1.0], seed=[2**64 - 3])
    by_tensor = Batch(batch.slots, batch.tokens, batch.token_offsets, batch.positions, batch.new_gen)
    by_tensor.temperature, by_tensor.seed = torch.tensor([1.0]), torch.tensor([-3])
    assert meta(batch).seed.tolist() == meta(by_tensor).seed.tolist() == [2**64 - 3]


def test_distributions_come_back_widened_and_zero_past_each_count():
    n, width = 3, 2
    counts = np.array([2, 1, 0], np.uint16)
    ids = np.arange(n * width * TOP, dtype=np.int32).reshape(n, width, TOP) + 1  # junk past counts too
    weights = np.full((n, width, TOP), 7, np.uint16)
    d = to_drafts(
        K,
        np.arange(n),
        counts,
        np.zeros(n, np.uint16),
        np.ones((n, width), np.int32),
        None,
        Outcome.OK,
        False,
        q=(ids, weights),
    )
    assert d.q_ids.shape == d.q_weights.shape == (n, K, TOP)
    assert d.q_ids.dtype == torch.int32 and d.q_weights.dtype == torch.uint16
    live = torch.arange(K) < torch.from_numpy(counts.astype(np.int64)).unsqueeze(1)
    assert (d.q_ids[live] == torch.from_numpy(ids[:, :width][live[:, :width].numpy()])).all()
    assert not d.q_ids[~live].any() and not d.q_weights[~live].to(torch.int32).any()
    empty = empty_drafts(n, K, Outcome.TIMEOUT, False, sampled=True)
    assert empty.q_ids.shape == (n, K, TOP) and not empty.q_weights.to(torch.int32).any()
    assert empty_drafts(n, K, Outcome.TIMEOUT, False).q_ids is None


def test_a_local_drafter_s_drafts_in_a_sampled_engine_carry_one_hot_q_and_stay_exact():
    tokens = torch.tensor([[0, 5, 31], [40, 2, 0]], dtype=torch.int32)
    counts = torch.tensor([3, 2], dtype=torch.int32)
    remote = empty_drafts(2, 3, Outcome.TIMEOUT, False, sampled=True)
    local = local_drafts((tokens, counts), remote)
    assert local.source == "local" and local.q_ids.shape == (2, 3, TOP)
    live = (torch.arange(3) < counts.unsqueeze(1)).numpy()
    ids, weights = local.q_ids.numpy()[live], local.q_weights.numpy()[live].astype(np.int64)
    assert violation(ids, weights, tokens.numpy()[live], 64) is None
    assert (weights[:, 0] == wire.SAMPLED_TOTAL).all() and not local.q_ids[1, 2].any()
    assert local_drafts((tokens, counts), empty_drafts(2, 3, Outcome.TIMEOUT, False)).q_ids is None
    # one-hot q is exact: with p uniform over 48 tokens, the first token is uniform
    n, vocab = 20_000, 48
    p = torch.full((n, 2, vocab), 1 / vocab)
    draft = torch.full((n, 1), 7, dtype=torch.int32)
    q_ids, q_weights = one_hot_q(draft, torch.ones(n, dtype=torch.int32))
    out, _ = rejection_sample(
        p, draft, torch.ones(n, dtype=torch.int32), q_ids, q_weights, generator=torch.Generator().manual_seed(1)
    )
    share = torch.bincount(out[:, 0], minlength=vocab).double() / n
    assert (share - 1 / vocab).abs().max() < 5 * (1 / vocab / n) ** 0.5


@pytest.mark.parametrize(
    "num_spec, max_slots, why",
    [(17, 8, r"^num_spec=17: over 16, a sampled session's cap"), (4, 1025, r"^max_slots=1025: over 1024")],
)
def test_a_sampled_engine_refuses_sizes_over_the_sampled_caps(num_spec, max_slots, why):
    def config(**kw):
        return RemoteConfig.from_env(engine_env(1, "00" * 32, "00" * 32, Mode.SYNC, **kw))

    with pytest.raises(ValueError, match=why):
        RemoteDSpark(config(VLLM_DSPARK_SAMPLED_TOP32="1"), num_spec=num_spec, max_slots=max_slots, row_bytes=0)
    RemoteDSpark(config(), num_spec=num_spec, max_slots=max_slots, row_bytes=0).close()


def test_a_sampled_engine_refuses_a_vocabulary_smaller_than_its_32_ids():
    cfg = RemoteConfig.from_env(engine_env(1, "00" * 32, "00" * 32, Mode.SYNC, VLLM_DSPARK_SAMPLED_TOP32="1"))
    with pytest.raises(ValueError, match=r"^vocab_size=31: a sampled engine's drafts list 32 distinct ids"):
        RemoteDSpark(cfg, num_spec=4, max_slots=8, row_bytes=0, vocab_size=31)
    RemoteDSpark(cfg, num_spec=4, max_slots=8, row_bytes=0, vocab_size=32).close()

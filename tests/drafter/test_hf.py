"""transformers causal LMs as drafters (``--hf-model DIR``): only files nobody else may
write are loaded, batched drafts equal one entry at a time, a worker serves them, and
their drafts are the model's own continuation of each window at its true positions."""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO
from lm_common import agreeing_prefix, batch_of, connect, hello

from remote_dspark import wire
from remote_dspark.drafter.lm.drafter import LMDrafter
from remote_dspark.transport.client import Refused
from remote_dspark.worker import Worker
from remote_dspark.worker.drafters import load_drafter

ROOT = Path(REPO)
PLAIN = LMDrafter(device="cpu", cache_slots=0, window=16)  # re-encodes every round

# --- transformers models -------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")
    path = tmp_path_factory.mktemp("tiny-gpt2")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=128,
        n_positions=64,
        n_embd=32,
        n_layer=1,
        n_head=2,
        initializer_range=0.5,
        bos_token_id=0,
        eos_token_id=0,
    )  # clear greedy choices
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_drafter(hf_dir):
    return load_drafter(None, hf_model=str(hf_dir), lm_device="cpu", window=16)


@pytest.mark.slow
def test_hf_model_drafts_batched_as_one_entry_at_a_time(hf_dir, hf_drafter):
    from remote_dspark.drafter.lm.hf import dir_identity

    d = hf_drafter
    assert d.vocab_size == 128 and d.markov_identity == bytes(32) and d.max_width == d.columns - 16 == 48
    with pytest.raises(ValueError, match=r"^--hf-model .* \(--lm-device cpu\): the model has 64 positions, fewer"):
        load_drafter(None, hf_model=str(hf_dir), lm_device="cpu", window=64)
    assert d.drafter_identity == dir_identity(hf_dir) and len(d.drafter_identity) == 32
    contexts = [[1], [4, 5, 6, 7, 8, 9, 10], [], [3, 3], list(range(20, 40))]
    n_out = [3, 2, 3, 0, 3]
    got = d.draft_batch(batch_of(contexts, n_out, 3))
    assert got.counts.tolist() == [3, 2, 0, 0, 3]
    compared = 0
    for i, context in enumerate(contexts):  # each entry alone: no padding
        alone = d.draft_batch(batch_of([context], got.counts[i : i + 1], 3))
        a, b = agreeing_prefix(alone.tokens[0].tolist(), alone.margins[0].tolist(), got.tokens[i].tolist())
        assert a == b, f"entry {i}"
        compared += len(a)
    assert compared >= 6


@pytest.mark.slow
def test_hf_model_serves_a_round_through_a_worker(hf_drafter):
    d = hf_drafter
    with Worker(d, "127.0.0.1", 0, window=16) as w:
        c = connect(w.port, hello(d, vocab_size=128))
        try:
            got = c.round(
                1, [wire.encode_round_entries(1, 1, 1000, [wire.Entry(1, 3, 0, (7, 8), True)], b"", 0)], 10000
            )
            assert got.row(0) == d.draft_batch(batch_of([[7, 8]], [3], 3)).tokens[0].tolist()
        finally:
            c.close()


# --- positions: true ones, and the model's table ---------------------------------------------


def hf_greedy(model, tokens, start: int, n: int) -> list[int]:
    """The model's own greedy continuation of ``tokens`` placed at positions ``start...``
    (no padding, no cache: the whole sequence encoded per token)."""
    seq = [int(t) for t in tokens]
    with torch.inference_mode():
        for _ in range(n):
            ids = torch.tensor([seq])
            pos = torch.arange(start, start + len(seq))[None]
            seq.append(int(model(input_ids=ids, position_ids=pos).logits[0, -1].argmax()))
    return seq[len(tokens) :]


@pytest.mark.slow
def test_hf_drafts_through_a_worker_are_the_models_own_continuation_at_true_positions(hf_dir):
    """The tiny GPT-2 as drafter and as target: along a sequence three windows long, the
    worker's drafts are what the model itself continues the window with, the window's
    tokens at their positions in the sequence; numbered from the window's start instead
    (as if the sequence began there), the model continues otherwise."""
    window, k = 8, 3
    d = load_drafter(None, hf_model=str(hf_dir), lm_device="cpu", window=window, lm_cache_slots=0)
    seq = np.random.default_rng(3).integers(0, 128, 3 * window).tolist()
    with Worker(d, "127.0.0.1", 0, window=window) as w:
        c = connect(w.port, hello(d, vocab_size=128, num_spec=k))
        try:
            differ, at = 0, 0
            for rid, end in enumerate(range(window, len(seq) + 1, 2), 1):
                entry = wire.Entry(1, k, at, tuple(seq[at:end]), new_gen=at == 0)
                got = c.round(rid, [wire.encode_round_entries(rid, 1, 1000, [entry], b"", 0)], 10000)
                start = end - window
                assert got.row(0) == hf_greedy(d.model.lm, seq[start:end], start, k), f"at {end}"
                differ += start > 0 and hf_greedy(d.model.lm, seq[start:end], 0, k) != got.row(0)
                at = end
        finally:
            c.close()
    assert start == 2 * window and differ >= 4


@pytest.mark.slow
def test_a_hello_whose_window_and_drafts_pass_the_models_positions_is_refused_naming_both(hf_drafter):
    d = hf_drafter  # a window of 16, 64 positions
    assert d.max_positions == 64
    with Worker(d, "127.0.0.1", 0, window=16) as w:
        why = r"a window of 16 tokens .* num_spec 49 drafts need 65 positions, .*'s 64$"
        with pytest.raises(Refused, match=why) as e:
            connect(w.port, hello(d, vocab_size=128, num_spec=49))
        assert e.value.code == wire.REFUSE_LIMITS and w.statistics().refusals["limits"] == 1
        connect(w.port, hello(d, vocab_size=128, num_spec=d.max_width)).close()

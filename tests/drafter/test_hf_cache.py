"""The transformers drafter's KV cache per stream (remote_dspark.drafter.lm.hf_model drives a
transformers model as the built-in model drafter drives its own):
for a tiny GPT-2 (learned positions) and a tiny Llama (rotary, grouped KV heads), saved
by the test, the cached drafts equal the model's own greedy continuation of the
stream's whole sequence, encoded afresh at the same absolute positions, through the
worker's own windows: appends, NEW_GEN anywhere in a sequence, RESYNC, evictions,
several sessions, streams past the window. CPU float32."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from lm_common import STREAM_ROUNDS, Streams, agreeing_prefix, batch_of

from remote_dspark.drafter.lm.drafter import LMDrafter
from remote_dspark.drafter.lm.hf import load_hf
from remote_dspark.drafter.lm.pool import BLOCK

transformers = pytest.importorskip("transformers", reason="transformers not installed (the hf extra)")

MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=128, n_positions=512, n_embd=32, n_layer=2, n_head=2, initializer_range=0.5)
    ),
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.5,
        )
    ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    torch.manual_seed(0)
    MODELS[request.param]().save_pretrained(path)
    return path


def greedy(model, tokens, start: int, n: int) -> tuple[list[int], list[float]]:
    """The model's own greedy continuation of ``tokens`` at positions ``start...`` and its
    top1 - top2 margins (no padding, no cache: the whole sequence encoded per token)."""
    seq, margins = [int(t) for t in tokens], []
    with torch.inference_mode():
        for _ in range(n):
            pos = torch.arange(start, start + len(seq))[None]
            probs = torch.softmax(model(input_ids=torch.tensor([seq]), position_ids=pos).logits[0, -1], -1)
            top = probs.topk(2)
            seq.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
    return seq[len(tokens) :], margins


def drafter_of(model_dir, window: int, cache_slots: int = 3, graphs=None, kv_blocks: int | None = None) -> LMDrafter:
    """``graphs=True``: the padded shapes of the GPU's graphs, run eagerly; ``kv_blocks``:
    a pool of so many blocks (None: the default)."""
    base = load_hf(str(model_dir), "cpu", window, cache_slots=0)
    block = base.store.block_bytes()
    return LMDrafter(
        base.model,
        identity=base.drafter_identity,
        device="cpu",
        cache_slots=cache_slots,
        window=window,
        max_context=64,
        kv_bytes=None if kv_blocks is None else kv_blocks * block,
        graphs=graphs,
    )


@settings(max_examples=15, deadline=None)
@given(rounds=STREAM_ROUNDS, sessions=STREAM_ROUNDS)
def test_every_draft_equals_a_fresh_encode_of_the_whole_stream_at_its_true_positions(model_dir, rounds, sessions):
    """Through a worker's windows and its whole-stream reader, eager and on the GPU graphs'
    padded shapes, with a pool of a few blocks (streams evicted and re-encoded from the
    worker's tokens): each draft equals the model's own greedy continuation of the
    stream's whole sequence encoded afresh at its true positions. A second session (a
    respawned proxy) on the same drafter shares nothing with the first."""
    window, width = 6, 2
    for d in (drafter_of(model_dir, window, kv_blocks=9), drafter_of(model_dir, window, graphs=True)):
        for script in (rounds, sessions):
            streams = Streams(window, whole=True)  # a new session: the worker's windows are new
            for ops in script:
                batch = streams.round(ops, width)
                got = d.draft_batch(batch)
                for i, slot in enumerate(batch.slots.tolist()):
                    first, tokens = streams.span(slot)
                    want, margins = greedy(d.model.lm, tokens, first, width)
                    a, b = agreeing_prefix(want, margins, got.tokens[i].tolist())
                    assert a == b, f"entry {i}: slot {slot} from position {first}"


def test_only_the_new_tokens_are_encoded_and_the_bound_holds(model_dir):
    """Appends hit (a row's state is reused), NEW_GEN misses, four slots over three rows
    evict the least recently used, and the pool's bytes are its blocks' (what the model
    keeps per token, BLOCK tokens a block)."""
    d = drafter_of(model_dir, 8, kv_blocks=40)
    c = d.model.config
    assert (c.n_layers, c.n_heads) == ((2, 2) if "llama" in model_dir.name else (2, 2))  # Llama: 2 of 4 heads
    assert d.cache_info().bytes == 40 * c.n_layers * 2 * c.n_heads * BLOCK * c.head_dim * 4
    ctx = list(range(10, 18))

    def round_of(slots, lengths, gens):
        n = len(slots)
        before = d.cache_info()
        d.draft_batch(
            batch_of(
                [ctx] * n,
                [2] * n,
                2,
                session=1,
                slots=np.array(slots, np.int64),
                gens=np.array(gens, np.int64),
                lengths=np.array(lengths, np.int64),
            )
        )
        after = d.cache_info()
        assert after.slots <= after.capacity == 3
        return after.hits - before.hits, after.misses - before.misses

    assert round_of([0, 1, 2], [8, 8, 8], [1, 1, 1]) == (0, 3)
    assert round_of([0, 1, 2], [9, 9, 9], [1, 1, 1]) == (3, 0)
    assert round_of([0, 1], [10, 10], [2, 1]) == (1, 1)  # slot 0's NEW_GEN
    assert round_of([3], [8], [1]) == (0, 1)  # takes slot 2's row, the least recently used
    assert round_of([2], [10], [1]) == (0, 1)


def test_an_uncached_drafter_drafts_what_the_cached_one_drafts_within_the_window(model_dir):
    window, width = 8, 3
    plain, cached = drafter_of(model_dir, window, cache_slots=0), drafter_of(model_dir, window)
    assert plain.cache is None and plain.cache_info().capacity == 0
    rng = np.random.default_rng(4)
    streams = Streams(window)
    for rnd in range(4):  # 2 tokens a round: the window (8) full at the last
        ops = [(slot, "append" if rnd else "new_gen", 0, rng.integers(0, 128, 2).tolist()) for slot in range(3)]
        batch = streams.round(ops, width)
        got, want = cached.draft_batch(batch), plain.draft_batch(batch)
        assert want.counts.tolist() == got.counts.tolist() == [width] * 3
        np.testing.assert_array_equal(got.tokens[want.margins > 1e-4], want.tokens[want.margins > 1e-4])
    assert cached.cache_info().hits == 9


@pytest.mark.gpu
def test_on_cuda_in_bf16_cached_rounds_draft_what_re_encoding_drafts(model_dir):
    """The CUDA path (bf16 model and pool): cached rounds through the worker's windows
    draft what re-encoding every window on the same device drafts, within the window,
    wherever the choice is clear (bf16's rounding may flip a close one); the CPU float32
    drafter agrees on nearly every clear choice."""
    window, width = 16, 4
    cuda = load_hf(str(model_dir), "cuda", window, cache_slots=8)
    plain, cpu = cuda.sibling(0), load_hf(str(model_dir), "cpu", window, cache_slots=0)
    assert cuda.dtype == torch.bfloat16 and cuda.store.kv.dtype == torch.bfloat16
    rng = np.random.default_rng(9)
    streams, had = Streams(window, max_slots=6), {}
    agree = compared = 0
    for _ in range(20):
        ops = []
        for slot in range(6):
            fresh = slot not in had or had[slot] + 3 > window
            ops.append((slot, "new_gen" if fresh else "append", 0, rng.integers(0, 128, 8 if fresh else 3).tolist()))
            had[slot] = 8 if fresh else had[slot] + 3
        batch = streams.round(ops, width)
        got, same_device, on_cpu = cuda.draft_batch(batch), plain.draft_batch(batch), cpu.draft_batch(batch)
        assert got.counts.tolist() == same_device.counts.tolist() == on_cpu.counts.tolist()
        for i in range(len(batch)):
            j = next((j for j, m in enumerate(same_device.margins[i]) if m <= 0.02), width)
            assert got.tokens[i, :j].tolist() == same_device.tokens[i, :j].tolist()
            k = next((j for j, m in enumerate(on_cpu.margins[i]) if m <= 0.05), width)
            agree += got.tokens[i, :k].tolist() == on_cpu.tokens[i, :k].tolist()
            compared += 1
    assert cuda.cache_info().hits > 50
    assert agree >= 0.95 * compared


def test_a_head_of_unaligned_rows_is_padded_and_drafts_the_same(tmp_path):
    """A vocabulary of 130 (GPT-2's 50,257 in small): the drafter's head is padded to 192
    rows for the GPU's GEMM kernels; its logits over the vocabulary are the model's own."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=130, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    d = load_hf(str(tmp_path), "cpu", 8, cache_slots=2)
    assert d.model.head.out_features == 192 and d.vocab_size == 130
    tokens = torch.tensor([[3, 129, 7, 64]])
    with torch.inference_mode():
        want = d.model.lm(input_ids=tokens).logits[0, -1]
        h = d.model.base(input_ids=tokens)[0][0, -1]
        assert torch.allclose(d.model.logits(h), want, atol=1e-5)
    assert (
        d.draft_batch(batch_of([[3, 129, 7, 64]], [4], 4)).tokens[0].tolist()
        == greedy(d.model.lm, [3, 129, 7, 64], 0, 4)[0]
    )

"""Batched drafting: ``MarkovModel.draft_batch`` equals per-entry ``draft`` value for
value in every key mode; the per-entry adapter; how ``as_batched`` and ``load_drafter``
pick a path; the result contract the worker enforces."""

import dataclasses
import random
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark.drafter.answer import check_result
from remote_dspark.drafter.contract import DraftBatch, DraftResult, PerEntryDrafter, as_batched
from remote_dspark.drafter.markov import MarkovDrafter, MarkovModel, SyntheticLanguage, builtin_model
from remote_dspark.worker.drafters import load_drafter


def _model(order, top, alphabet, seed, n=400):
    rng = random.Random(seed)
    return MarkovModel.from_tokens([rng.choice(alphabet) for _ in range(n)], order=order, top=top)


# One model per way draft_batch finds a context: a dense key -> row index (small key
# space), a searchsorted over int64 radix keys, and fixed-width byte keys (the token
# range to the power of the order overflows 63 bits).
MODELS = {
    "dense": _model(2, 3, list(range(6)), 1),
    "dense-order1": _model(1, 1, [0, 1, 2, 3], 2),
    "radix": _model(2, 2, [-5, 0, 7, 3000, 99_999], 3),
    "bytes": _model(3, 4, [-(2**31), -7, 0, 5, 2**31 - 1], 4),
    "empty": MarkovModel.from_tokens([1, 2], order=2, top=2),
}


def test_the_models_cover_every_lookup_mode():
    modes = {}
    for name, m in MODELS.items():
        m.draft_batch(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int32), 3)
        modes[name] = (m._arrays.mode, m._arrays.dense is not None)
    assert modes == {
        "dense": ("radix", True),
        "dense-order1": ("radix", True),
        "radix": ("radix", False),
        "bytes": ("bytes", False),
        "empty": ("empty", False),
    }


def _contexts(model):
    """Contexts mostly cut from the model's own table (so drafts happen), with tokens
    outside its vocabulary and short or empty contexts mixed in."""
    known = sorted(model.table) or [(0,) * model.order]
    vocab = sorted({t for ctx in known for t in ctx})
    return st.lists(
        st.one_of(
            st.sampled_from(known).map(list),
            st.sampled_from(vocab).map(lambda t: [t]),
            st.integers(-(2**31), 2**31 - 1).map(lambda t: [t]),
        ),
        max_size=4,
    ).map(lambda parts: [t for p in parts for t in p])


@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(MODELS)), width=st.integers(0, 6))
def test_draft_batch_equals_per_entry_draft(data, name, width):
    model = MODELS[name]
    contexts = data.draw(st.lists(_contexts(model), max_size=12))
    n_out = data.draw(st.lists(st.integers(0, width), min_size=len(contexts), max_size=len(contexts)))
    tokens = np.array([t for c in contexts for t in c], np.int32)
    offsets = np.cumsum([0] + [len(c) for c in contexts])
    got_t, got_c, got_m = model.draft_batch(tokens, offsets, np.array(n_out, np.int32), width)
    assert got_t.shape == got_m.shape == (len(contexts), width) and got_c.shape == (len(contexts),)
    assert got_t.dtype == np.int32 and got_c.dtype == np.int32 and got_m.dtype == np.float32
    for i, ctx in enumerate(contexts):
        want_t, want_m = model.draft(ctx, n_out[i])
        assert got_c[i] == len(want_t) <= n_out[i]
        assert got_t[i].tolist() == want_t + [0] * (width - len(want_t))
        assert got_m[i].tolist() == [float(np.float32(m)) for m in want_m] + [0.0] * (width - len(want_m))


def test_draft_batch_on_the_builtin_model_follows_its_text():
    model = builtin_model()
    rng = np.random.default_rng(0)
    text = np.array(SyntheticLanguage().text(5000), np.int32)
    starts = rng.integers(0, 4000, 64)
    lens = rng.integers(0, 12, 64)
    contexts = [text[s : s + n].tolist() for s, n in zip(starts, lens)]
    offsets = np.cumsum([0] + [len(c) for c in contexts])
    got_t, got_c, _ = model.draft_batch(
        np.array([t for c in contexts for t in c], np.int32), offsets, np.full(64, 5, np.int32), 5
    )
    assert got_c.sum() > 100  # the text's contexts are mostly known
    for i, ctx in enumerate(contexts):
        assert got_t[i, : got_c[i]].tolist() == model.draft(ctx, 5)[0]


def _batch(contexts, n_out, width, want_margin=True, row_bytes=2):
    return DraftBatch(
        np.array([t for c in contexts for t in c], np.int32),
        np.cumsum([0] + [len(c) for c in contexts]).astype(np.int64),
        np.array(n_out, np.int32),
        np.arange(len(contexts) * row_bytes, dtype=np.uint8).reshape(len(contexts), row_bytes),
        want_margin,
        width,
    )


@settings(max_examples=30, deadline=None)
@given(data=st.data(), want_margin=st.booleans())
def test_the_per_entry_adapter_answers_like_the_batched_markov_drafter(data, want_margin):
    model = MODELS["dense"]
    contexts = data.draw(st.lists(_contexts(model), max_size=8))
    n_out = data.draw(st.lists(st.integers(0, 4), min_size=len(contexts), max_size=len(contexts)))
    batch = _batch(contexts, n_out, 4, want_margin)
    fast = MarkovDrafter(model).draft_batch(batch)
    slow = PerEntryDrafter(MarkovDrafter(model)).draft_batch(batch)
    assert np.array_equal(fast.tokens, slow.tokens) and np.array_equal(fast.counts, slow.counts)
    if want_margin:
        assert np.array_equal(fast.margins, slow.margins)
    else:
        assert fast.margins is None and slow.margins is None


def test_the_adapter_passes_context_and_row_and_cuts_to_n_out():
    calls = []

    class Sloppy:
        drafter_identity = markov_identity = b"x" * 32

        def draft(self, context, n_out, row):
            calls.append((context, n_out, bytes(row)))
            return [7, 8, 9, 10], [0.5]  # too many tokens, too few margins

    out = PerEntryDrafter(Sloppy()).draft_batch(_batch([[1, 2], [], [3]], [2, 0, 3], 3))
    assert calls == [([1, 2], 2, b"\x00\x01"), ([], 0, b"\x02\x03"), ([3], 3, b"\x04\x05")]
    assert out.counts.tolist() == [2, 0, 3]
    assert out.tokens.tolist() == [[7, 8, 0], [0, 0, 0], [7, 8, 9]]
    assert out.margins.tolist() == [[0.5, 0, 0], [0, 0, 0], [0.5, 0, 0]]


class _Batched:
    drafter_identity = markov_identity = b"b" * 32

    def draft_batch(self, batch):
        return DraftResult(np.zeros((len(batch), batch.width), np.int32), np.zeros(len(batch), np.int32))


class _Both(MarkovDrafter):
    pass


class _GatedDraft(MarkovDrafter):
    def draft(self, context, n_out, row):
        return [], []


def test_as_batched_picks_the_batched_path_unless_a_subclass_overrides_draft():
    b = _Batched()
    assert as_batched(b) is b
    m = MarkovDrafter(MODELS["dense"])
    assert as_batched(m) is m and isinstance(as_batched(_Both(MODELS["dense"])), _Both)
    gated = as_batched(_GatedDraft(MODELS["dense"]))  # its own draft must not be bypassed
    assert isinstance(gated, PerEntryDrafter) and gated.drafter_identity == m.drafter_identity
    with pytest.raises(TypeError, match="neither draft_batch"):
        as_batched(object())


def test_check_result_clamps_zeroes_and_names_bad_shapes():
    batch = _batch([[1], [2]], [1, 2], 3)
    sloppy = DraftResult(np.full((2, 3), 9, np.int32), np.array([3, -1], np.int32), np.ones((2, 3), np.float32))
    out = check_result(sloppy, batch)
    assert out.counts.tolist() == [1, 0]
    assert out.tokens.tolist() == [[9, 0, 0], [0, 0, 0]] and out.margins.tolist() == [[1, 0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="tokens: shape"):
        check_result(DraftResult(np.zeros((2, 2), np.int32), np.zeros(2, np.int32), None), batch)
    with pytest.raises(ValueError, match="counts: shape"):
        check_result(DraftResult(np.zeros((2, 3), np.int32), np.zeros(3, np.int32), None), batch)
    with pytest.raises(ValueError, match="margins: shape"):
        check_result(DraftResult(np.zeros((2, 3), np.int32), np.zeros(2, np.int32), np.zeros(2)), batch)
    # Asked for margins, a drafter without any gives zeros: the engine refuses a reply
    # whose margins section is not what its HELLO asked for.
    assert check_result(
        DraftResult(np.zeros((2, 3), np.int32), np.zeros(2, np.int32), None), batch
    ).margins.tolist() == [[0, 0, 0], [0, 0, 0]]
    assert check_result(sloppy, _batch([[1], [2]], [1, 2], 3, want_margin=False)).margins is None


def test_a_checked_answer_is_a_copy_even_when_every_entry_drafted_whole():
    """Nothing to zero (every count is the width), the answer is still not the drafter's
    own memory: a drafter may reuse its arrays in its next call, which another
    connection's round can make before this round's reply is written."""
    batch = _batch([[1], [2]], [2, 2], 2)
    mine = DraftResult(np.array([[5, 6], [7, 8]], np.int32), np.array([2, 2], np.int32), np.ones((2, 2), np.float32))
    out = check_result(mine, batch)
    mine.tokens[:] = 0
    mine.margins[:] = 0
    assert out.tokens.tolist() == [[5, 6], [7, 8]] and out.margins.tolist() == [[1, 1], [1, 1]]
    sampled = dataclasses.replace(batch, temperature=np.ones(2, np.float32), seed=np.zeros(2, np.uint64))
    tokens = np.array([[5, 6], [7, 8]], np.int32)
    ids = np.array([[[t] + [i for i in range(33) if i != t][:31] for t in row] for row in tokens], np.int32)
    weights = np.zeros((2, 2, 32), np.uint16)
    weights[..., 0] = 65535  # all of each position's weight on its draft, listed first
    out = check_result(DraftResult(tokens, np.array([2, 2], np.int32), None, ids, weights), sampled)
    ids[:] = 0
    weights[:] = 0
    assert out.q_ids[1, 1, 0] == 8 and out.q_weights[1, 1, 0] == 65535


def test_check_result_holds_a_sampled_rounds_distributions_to_the_rule():
    batch = dataclasses.replace(
        _batch([[1], [2]], [2, 1], 2), temperature=np.ones(2, np.float32), seed=np.zeros(2, np.uint64)
    )
    ids = np.broadcast_to(np.array([3, 0, 1, 2] + list(range(4, 32)), np.int32), (2, 2, 32)).copy()
    weights = np.zeros((2, 2, 32), np.uint16)
    weights[..., 0] = 65535  # token 3, listed first
    tokens = np.array([[3, 3], [3, 9]], np.int32)  # entry 1's second draft is past its count
    out = check_result(DraftResult(tokens, np.array([2, 1], np.int32), None, ids, weights), batch)
    assert out.q_ids[1, 1].tolist() == [0] * 32 and out.q_weights[1, 1].sum() == 0  # zeroed past counts
    assert out.q_weights[0, 1, 0] == 65535
    rising = weights.copy()
    rising[0, 0, :3] = [65000, 0, 535]
    with pytest.raises(ValueError, match=r"position 0: weights rise at index 2 \(0, then 535\)"):
        check_result(DraftResult(tokens, np.array([2, 1], np.int32), None, ids, rising), batch)
    elsewhere = tokens.copy()
    elsewhere[0, 1] = 4  # id 4 has weight 0
    with pytest.raises(ValueError, match="drafted token 4 not among its ids of weight > 0"):
        check_result(DraftResult(elsewhere, np.array([2, 1], np.int32), None, ids, weights), batch)


def test_load_drafter_accepts_batched_and_per_entry_factories(tmp_path, monkeypatch):
    (tmp_path / "batchdrafter.py").write_text(
        "import numpy as np\n"
        "from remote_dspark.drafter import DraftResult\n"
        "class B:\n"
        "    drafter_identity = b'd' * 32\n"
        "    markov_identity = b'm' * 32\n"
        "    def draft_batch(self, batch):\n"
        "        return DraftResult(np.zeros((len(batch), batch.width), np.int32), np.zeros(len(batch), np.int32))\n"
        "class E:\n"
        "    drafter_identity = b'd' * 32\n"
        "    markov_identity = b'm' * 32\n"
        "    def draft(self, context, n_out, row):\n"
        "        return [], []\n"
        "class Neither:\n"
        "    drafter_identity = b'd' * 32\n"
        "    markov_identity = b'm' * 32\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert type(load_drafter("batchdrafter:B")).__name__ == "B"
    assert isinstance(load_drafter("batchdrafter:E"), PerEntryDrafter)
    with pytest.raises(ValueError, match="'batchdrafter:Neither'.*neither draft_batch"):
        load_drafter("batchdrafter:Neither")
    with pytest.raises(ValueError, match="NOT_CALLABLE is not callable"):
        load_drafter("batchdrafter:NOT_CALLABLE")
    assert isinstance(load_drafter(None), MarkovDrafter)


def test_markov_module_does_not_load_numpy_until_draft_batch():
    code = (
        "import sys\nfrom remote_dspark.drafter.markov import builtin_model\nm = builtin_model()\n"
        "m.draft([0, 1], 3)\nassert 'numpy' not in sys.modules\n"
        "import numpy as np\nm.draft_batch(np.zeros(2, np.int32), np.array([0, 2]), np.array([3]), 3)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_cache_record_without_next_tokens_is_refused():
    good = bytearray(MODELS["dense-order1"].to_bytes())
    # First record: context (1 word), top=1 pair (token, count), total. Zero the count.
    good[16 + 8 : 16 + 12] = bytes(4)
    with pytest.raises(ValueError, match="record 0"):
        MarkovModel.from_bytes(bytes(good))

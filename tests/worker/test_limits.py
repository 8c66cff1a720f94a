"""The worker's limits (remote_dspark.worker.limits): the token limit per slot follows
the window, a window outside the wire is refused naming it, and a sampled session's frame
cap holds its temperatures and seeds."""

import pytest

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import MarkovModel, builtin_model
from remote_dspark.worker import Worker
from remote_dspark.worker.limits import Limits, hello_refusal, tokens_per_slot

MODEL = MarkovModel.from_tokens([1, 2, 3, 4] * 10, order=1, top=2)
SLOTS = 4
WINDOW, K = 16, 4
VOCAB = 128  # the synthetic language's


def hello(w, **kw) -> wire.Hello:
    fields = dict(engine_id=42, max_slots=SLOTS, row_bytes=0, num_spec=K, want_sampled=True, vocab_size=VOCAB)
    fields.update(kw)
    return wire.Hello(w.drafter.drafter_identity, w.drafter.markov_identity, **fields)


def test_the_token_limit_per_slot_is_the_window_and_a_rounds_append():
    assert tokens_per_slot(64) == 128  # the default worker's, as before
    assert Limits(max_slots=SLOTS, window=256).max_round_tokens == SLOTS * (256 + wire.MAX_N_OUT)
    assert Limits(max_slots=SLOTS).max_round_tokens == SLOTS * 128
    assert Limits(max_slots=SLOTS, window=256, max_round_tokens=10).max_round_tokens == 10  # an explicit one wins


@pytest.mark.parametrize("window", [0, wire.MAX_CONTEXT + 1])
def test_a_window_outside_the_wire_is_refused_naming_it(window):
    with pytest.raises(ValueError, match=f"window {window}: not in 1..{wire.MAX_CONTEXT}"):
        Limits(window=window)
    with pytest.raises(ValueError, match=f"window {window}"):
        Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, window=window)


def test_the_frame_cap_of_a_sampled_session_holds_its_temperatures_and_seeds():
    limits = Limits(max_slots=1024, window=WINDOW)
    w = type("W", (), {"drafter": MarkovDrafter(builtin_model())})
    h = hello(w, max_slots=1024, row_bytes=8192)
    greedy = limits.frame_cap(hello(w, max_slots=1024, row_bytes=8192, want_sampled=False))
    assert limits.frame_cap(h) == greedy + 12 * 1024 == limits.max_round_bytes
    assert hello_refusal(w.drafter, limits, h, WINDOW)[0] == wire.ACCEPT

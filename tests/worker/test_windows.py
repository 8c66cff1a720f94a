"""The worker's windows (remote_dspark.worker.windows) are the context it negotiates:
HELLO_ACK names the window, and a worker of ``--window 256`` takes 256-token NEW_GEN
contexts whole in every slot. The token limit per slot that follows it: test_limits.py."""

import pytest
from helpers import CYCLE4, ContextsSeen

from remote_dspark import wire
from remote_dspark.transport import parse_endpoint
from remote_dspark.transport.client import DraftClient
from remote_dspark.worker import Worker

MODEL = CYCLE4
SLOTS = 4


def connect(w: Worker, drafter) -> DraftClient:
    hello = wire.Hello(drafter.drafter_identity, drafter.markov_identity, 42, SLOTS, 4, 3)
    return DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{w.port}"), hello, 1, 2.0)


@pytest.mark.parametrize("window", [1, 64, 256])
def test_hello_ack_names_the_workers_window(window):
    drafter = ContextsSeen()
    with Worker(drafter, "127.0.0.1", 0, window=window) as w:
        c = connect(w, drafter)
        try:
            assert c.ack.accepted and c.ack.context_tokens == window
        finally:
            c.close()


def test_a_worker_of_window_256_takes_256_token_contexts_in_every_slot():
    """A full round of NEW_GEN contexts of 256 tokens (over the 128 per slot a worker
    allowed whatever its window): every window holds its context whole."""
    drafter = ContextsSeen()
    with Worker(drafter, "127.0.0.1", 0, window=256, max_slots=SLOTS) as w:
        c = connect(w, drafter)
        try:
            ctx = [[1000 * s + j for j in range(256)] for s in range(SLOTS)]
            entries = [wire.Entry(s, 3, 0, tuple(ctx[s]), new_gen=True) for s in range(SLOTS)]
            frame = wire.encode_round_entries(1, c.session, 1000, entries, bytes(4 * SLOTS), 4)
            d = c.round(1, [frame], 2000)
            assert list(d.statuses) == [wire.STATUS_OK] * SLOTS
        finally:
            c.close()
    assert drafter.contexts == ctx

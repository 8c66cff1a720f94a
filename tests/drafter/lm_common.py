"""What the model drafter tests share: batches of contexts, the drafts' comparison up to
near-ties, a HELLO for a drafter and a client of a loopback worker."""

import numpy as np

from remote_dspark import wire
from remote_dspark.drafter.contract import DraftBatch
from remote_dspark.transport import parse_endpoint
from remote_dspark.transport.client import DraftClient

TIE = 1e-4  # below this top1 - top2 margin, padding's rounding may flip the greedy choice


def batch_of(contexts, n_out, width, want_margin=True, **stream):
    offsets = np.zeros(len(contexts) + 1, np.int64)
    offsets[1:] = np.cumsum([len(c) for c in contexts])
    tokens = np.concatenate([np.asarray(c, np.int32) for c in contexts]) if contexts else np.zeros(0, np.int32)
    return DraftBatch(
        tokens,
        offsets,
        np.asarray(n_out, np.int32),
        np.zeros((len(contexts), 0), np.uint8),
        want_margin,
        width,
        **stream,
    )


def agreeing_prefix(ref_tokens, ref_margins, tokens) -> tuple[list, list]:
    """Both drafts up to the first near-tie of the reference (where a flip is allowed)."""
    k = next((i for i, m in enumerate(ref_margins) if m <= TIE), len(ref_margins))
    return list(ref_tokens[:k]), list(tokens[:k])


def assert_same_drafts(got, want):
    """Two results agree: counts equal, drafts equal up to each entry's first near-tie."""
    assert list(got.counts) == list(want.counts)
    for i, count in enumerate(want.counts.tolist()):
        a, b = agreeing_prefix(
            want.tokens[i, :count].tolist(), want.margins[i, :count].tolist(), got.tokens[i, :count].tolist()
        )
        assert a == b, f"entry {i}"


def hello(drafter, **kw):
    fields = dict(engine_id=7, max_slots=8, row_bytes=0, num_spec=3, want_margin=True)
    fields.update(kw)
    return wire.Hello(drafter.drafter_identity, drafter.markov_identity, **fields)


def connect(port: int, h: wire.Hello, session: int = 1) -> DraftClient:
    return DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{port}"), h, session, 5.0)

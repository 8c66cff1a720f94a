"""The worker serves sampled sessions (protocol 6) over loopback sockets: each draft is
the rule's pick from the distribution the reply carries, at the entry's seed and
absolute position; temperature 0 drafts as a greedy session does; a drafter that cannot
sample is refused at HELLO; a garbled sampled ROUND costs only its connection. The
greedy round logic: test_worker_rounds.py; a sampled session's frame cap: test_limits.py."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from helpers import until

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import SyntheticLanguage, builtin_model
from remote_dspark.drafter.sampling import TOTAL, check_sampled, pick, uniform_u32
from remote_dspark.transport import Disconnected, parse_endpoint
from remote_dspark.transport.client import DraftClient, Refused
from remote_dspark.worker import Worker

WINDOW, SLOTS, K = 16, 8, 4
VOCAB = 128  # the synthetic language's


@pytest.fixture(scope="module")
def worker():
    w = Worker(MarkovDrafter(builtin_model()), "127.0.0.1", 0, window=WINDOW).start()
    yield w
    w.stop()


def hello(w, **kw) -> wire.Hello:
    fields = dict(engine_id=42, max_slots=SLOTS, row_bytes=0, num_spec=K, want_sampled=True, vocab_size=VOCAB)
    fields.update(kw)
    return wire.Hello(w.drafter.drafter_identity, w.drafter.markov_identity, **fields)


def connect(w, session=1, **kw) -> DraftClient:
    return DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{w.port}"), hello(w, **kw), session, 2.0)


def do_round(c, rid, entries, sampled=True) -> wire.DraftsFrame:
    frame = wire.encode_round_entries(rid, c.session, 2000, entries, b"", 0, sampled=sampled)
    return c.round(rid, [frame], 2000)


def contexts(n: int, seed: int) -> list[list[int]]:
    text = SyntheticLanguage().text(n * 40, seed=seed)
    return [text[40 * i : 40 * i + 3 + 2 * i] for i in range(n)]  # seen in training: drafts follow


def check_reply(d: wire.DraftsFrame, entries, positions) -> None:
    """Every counted draft passes the rule's check and is its pick at ``positions[i] + j``;
    zeros past the counts."""
    n = len(entries)
    tokens = np.asarray(d.tokens, np.int32).reshape(n, d.width)
    ids = np.asarray(d.q_ids, np.int32).reshape(n, d.width, 32)
    weights = np.asarray(d.q_weights, np.uint16).reshape(n, d.width, 32)
    live = np.arange(d.width) < np.asarray(d.counts)[:, None]
    assert check_sampled(ids[live], weights[live], tokens[live], VOCAB) is None
    assert not ids[~live].any() and not weights[~live].any()
    seed = np.array([e.seed for e in entries], np.uint64)
    j = np.arange(d.width)
    u = uniform_u32(seed[:, None], np.asarray(positions, np.int64)[:, None] + j, j)
    assert (pick(ids, weights, u)[live] == tokens[live]).all()


def test_a_sampled_session_s_drafts_are_the_rule_s_picks_from_the_distributions_it_carries(worker):
    c = connect(worker)
    try:
        ctx = contexts(SLOTS, seed=3)
        temps = [0.0, 0.5, 1.0, 1.0, 2.0, 0.7, 1.3, 1.0]
        seeds = [0, 1, 2**64 - 1, 12345, 7, 2**40 + 3, 99, 5]
        entries = [wire.Entry(i, K, 100 * i, c_, True, t, s) for i, (c_, t, s) in enumerate(zip(ctx, temps, seeds))]
        d = do_round(c, 1, entries)
        assert d.sampled and d.margins is None and list(d.statuses) == [wire.STATUS_OK] * SLOTS
        assert sum(d.counts) >= SLOTS * K - 4  # seen contexts: (nearly) all drafted
        check_reply(d, entries, [100 * i + len(c_) for i, c_ in enumerate(ctx)])
        spread = (np.asarray(d.q_weights).reshape(SLOTS, d.width, 32) > 0).sum(axis=2)
        assert (spread[0] <= 1).all() and (spread[1:] > 1).any()  # T = 0 greedy; T > 0 a distribution
        # A next round appends the accepted tokens: its position counts on from the window's.
        rows = np.asarray(d.tokens).reshape(SLOTS, d.width)
        nxt = [
            wire.Entry(
                i, K, 100 * i + len(c_), tuple(int(t) for t in rows[i, :2]), False, temps[i], (seeds[i] + 1) % 2**64
            )
            for i, c_ in enumerate(ctx)
        ]
        d2 = do_round(c, 2, nxt)
        check_reply(d2, nxt, [100 * i + len(c_) + 2 for i, c_ in enumerate(ctx)])
    finally:
        c.close()


def test_temperature_0_drafts_as_a_greedy_session_and_resyncs_carry_zeros(worker):
    sampled, greedy = (
        connect(worker, session=2, engine_id=1),
        connect(worker, session=3, engine_id=2, want_sampled=False),
    )
    try:
        ctx = contexts(4, seed=11)
        entries = [wire.Entry(i, K, 10 * i, c_, True, 0.0, 1000 + i) for i, c_ in enumerate(ctx)]
        entries.append(wire.Entry(7, K, 5, (1, 2), False, 1.0, 3))  # unknown slot, no NEW_GEN: RESYNC
        d, g = do_round(sampled, 1, entries), do_round(greedy, 1, entries, sampled=False)
        assert g.q_ids is None and list(d.counts) == list(g.counts) and list(d.tokens) == list(g.tokens)
        assert list(d.statuses) == [wire.STATUS_OK] * 4 + [wire.STATUS_RESYNC]
        weights = np.asarray(d.q_weights).reshape(5, d.width, 32)
        live = np.arange(d.width) < np.asarray(d.counts)[:, None]
        assert (weights[live][:, 0] == TOTAL).all()  # greedy: the whole weight on the draft
        assert not np.asarray(d.q_ids).reshape(5, -1)[4].any() and not weights[4].any()
        check_reply(d, entries, [10 * i + len(c_) for i, c_ in enumerate(ctx)] + [0])
    finally:
        sampled.close()
        greedy.close()


class NoSampling(MarkovDrafter):
    samples = False


def test_a_drafter_that_cannot_sample_refuses_the_sampled_hello_with_the_reason():
    with Worker(NoSampling(builtin_model()), "127.0.0.1", 0, window=WINDOW) as w:
        with pytest.raises(Refused, match="NoSampling does not sample.*") as e:
            connect(w)
        assert e.value.code == wire.REFUSE_LIMITS and "VLLM_DSPARK_SAMPLED_TOP32" in e.value.reason
        assert w.statistics().refusals["limits"] == 1
        c = connect(w, want_sampled=False)  # a greedy session is served
        assert do_round(c, 1, [wire.Entry(0, 2, 0, (1, 2), True)], sampled=False).q_ids is None
        c.close()


def test_a_garbled_sampled_round_drops_only_that_connection(worker):
    bad_before = worker.statistics().bad_frames
    healthy, c = connect(worker, session=4, engine_id=3), connect(worker, session=5, engine_id=4)
    try:
        entries = [wire.Entry(0, K, 0, (1, 2, 3), True, 1.0, 1), wire.Entry(1, K, 0, (4, 5), True, 0.5, 2)]
        frame = bytearray(wire.encode_round_entries(1, c.session, 2000, entries, b"", 0, sampled=True))
        at = wire.HEADER.size + wire.round_sections(2, 5, 0, sampled=True).temperature + 4
        struct.pack_into("<f", frame, at, float("nan"))  # entry 1's temperature
        with pytest.raises(Disconnected):
            c.round(1, [bytes(frame)], 2000)
        assert until(lambda: worker.statistics().bad_frames == bad_before + 1)
        other = connect(worker, session=6, engine_id=5)
        with pytest.raises(Disconnected):  # an unsampled round on a sampled session: its sizes are wrong
            do_round(other, 1, entries, sampled=False)
        other.chan.close()
        d = do_round(healthy, 1, entries)
        check_reply(d, entries, [3, 2])
    finally:
        c.close()
        healthy.close()

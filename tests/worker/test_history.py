"""The stream tokens a worker keeps apart from a drafter's state (worker.windows' ring of
``keep`` tokens a slot, worker.history's reader): what a read returns is the stream's
own tokens, whatever the rounds did to it; a drafter that keeps whole streams gets
batches naming them and HELLO_ACK tells the engine how many it keeps; their memory is
bounded by ``--history-mb``; a piece of a long encode reads its stream's tokens."""

import argparse
import gc
import random

import numpy as np
import pytest
from helpers import CYCLE4, Gated, connect, do_round, submit
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.cli import worker as worker_cli
from remote_dspark.drafter.markov import MarkovDrafter
from remote_dspark.drafter.streams import kept, origins, stream_tokens
from remote_dspark.transport.client import Refused
from remote_dspark.worker import Worker
from remote_dspark.worker.batching import encode_piece
from remote_dspark.worker.drafters import load_drafter
from remote_dspark.worker.history import History
from remote_dspark.worker.limits import Limits
from remote_dspark.worker.round import drafting_batch
from remote_dspark.worker.scheduler import Scheduler
from remote_dspark.worker.sessions import Session
from remote_dspark.worker.windows import Windows


def _advance(rng: random.Random, w: Windows, streams: dict, next_pos: dict) -> None:
    """A random round on ``w`` (NEW_GENs, appends, gaps, entries longer than the ring),
    and what it makes of each slot's stream (``streams``: since its NEW_GEN)."""
    slots = rng.sample(range(w.max_slots), rng.randint(0, w.max_slots))
    positions, new_gen, tokens, offsets = [], [], [], [0]
    for s in slots:
        new = s not in next_pos or rng.random() < 0.15
        gap = not new and rng.random() < 0.1
        pos = rng.randint(0, 40) if new else next_pos[s] + (rng.randint(1, 3) if gap else 0)
        k = rng.choice([0, 1, 2, w.window, w.keep - 1, w.keep + 5, 2 * w.keep + 1])
        toks = [rng.randint(0, 1 << 20) for _ in range(k)]
        if new:
            streams[s] = toks
        elif not gap and s in streams:
            streams[s] = streams[s] + toks
        if gap:  # the slot is forgotten: the engine re-announces it (a NEW_GEN)
            del next_pos[s]
        else:
            next_pos[s] = pos + k
        positions.append(pos)
        new_gen.append(new)
        tokens += toks
        offsets.append(len(tokens))
    w.advance(
        np.array(slots, np.int64),
        np.array(positions, np.int64),
        np.array(new_gen, bool),
        np.array(offsets, np.int64),
        np.array(tokens, np.int32),
    )


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), window=st.integers(1, 6), more=st.integers(0, 20))
def test_a_read_is_the_streams_own_tokens_after_appends_new_gens_gaps_and_long_rounds(seed, window, more):
    rng = random.Random(seed)
    a, b = Windows(5, window, window + more), Windows(3, window, window + 2 * more)
    history = History()
    for w in (a, b):
        history.add(w)
    streams: dict = {a.serial: {}, b.serial: {}}
    next_pos: dict = {a.serial: {}, b.serial: {}}
    for _ in range(10):
        for w in (a, b):
            _advance(rng, w, streams[w.serial], next_pos[w.serial])
            if next_pos[w.serial]:
                s = rng.choice(sorted(next_pos[w.serial]))
                assert w.window_of(s) == streams[w.serial][s][-window:]
        spans = []  # (session, slot, first, stop, the tokens), over both sessions at once
        for w in (a, b):
            for s, stream in streams[w.serial].items():
                low = len(stream) - min(len(stream), w.keep)
                first = rng.randint(low, len(stream))
                stop = rng.randint(first, len(stream))
                spans.append((w.serial, s, first, stop, stream[first:stop]))
                if low:
                    with pytest.raises(ValueError, match=f"slot {s} of session {w.serial}: stream tokens"):
                        history.read(np.array([w.serial]), np.array([s]), np.array([low - 1]), np.array([stop]))
        rng.shuffle(spans)
        tokens, offsets = history.read(*(np.array([x[i] for x in spans], np.int64) for i in range(4)))
        assert [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(len(spans))] == [x[4] for x in spans]


def test_the_reader_holds_no_session_alive_and_names_one_gone():
    history = History()
    w = Windows(2, 4, 16)
    serial = w.serial
    history.add(w)
    assert history.nbytes() == w.nbytes == 2 * (4 * 20 + 25)
    del w
    gc.collect()
    assert history.nbytes() == 0
    with pytest.raises(ValueError, match=f"session {serial}: gone"):
        history.read(np.array([serial]), np.array([0]), np.array([0]), np.array([0]))


class Keeping(Gated):
    """A Markov drafter that says it keeps whole streams (``max_context`` tokens each),
    recording in each call every entry's kept stream as the batch's reader gives it."""

    keeps_streams = True

    def __init__(self, max_context):
        super().__init__(MarkovDrafter(CYCLE4))
        self.max_context, self.kept = max_context, []

    def draft_batch(self, batch):
        if batch.history is not None:
            ends = np.asarray(batch.lengths, np.int64)
            tokens, offsets = stream_tokens(batch, np.arange(len(batch)), kept(batch), ends)
            self.kept += [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(len(batch))]
        return super().draft_batch(batch)


@pytest.mark.parametrize("round_path", ["native", "python"])
def test_a_drafter_that_keeps_streams_gets_them_and_the_engine_is_told_how_many(round_path):
    drafter = Keeping(max_context=100)
    with Worker(drafter, "127.0.0.1", 0, window=8, max_slots=8, round_path=round_path) as w:
        c = connect(w, max_slots=2)
        try:
            assert c.ack.accepted and c.ack.context_tokens == 100  # its keep, not the window
            first = list(range(1000, 1150))  # a NEW_GEN longer than what the worker keeps
            do_round(c, 1, [wire.Entry(0, 3, 5, tuple(first), new_gen=True)])
            do_round(c, 2, [wire.Entry(0, 3, 155, (7, 8, 9))])
        finally:
            c.close()
    one, two = drafter.calls
    assert one.lengths.tolist() == [150] and one.kept_from.tolist() == [50] and one.history is w._sessions.history
    assert one.tokens.tolist() == first[-8:] and two.kept_from.tolist() == [53]
    assert drafter.kept == [first[50:], first[53:] + [7, 8, 9]]
    assert origins(two).tolist() == [5]  # stream index 0 at the NEW_GEN's position


def test_a_drafter_that_keeps_no_streams_gets_contexts_only_and_the_window_is_acked():
    drafter = Gated(MarkovDrafter(CYCLE4))
    drafter.max_context = 100  # said, but meaningless without keeps_streams
    with Worker(drafter, "127.0.0.1", 0, window=8, round_path="python") as w:
        c = connect(w, max_slots=2)
        try:
            assert c.ack.context_tokens == 8
            do_round(c, 1, [wire.Entry(0, 3, 5, tuple(range(20)), new_gen=True)])
        finally:
            c.close()
    (one,) = drafter.calls
    assert one.kept_from is None and one.history is None and one.tokens.tolist() == list(range(12, 20))


def test_a_hello_whose_windows_would_pass_the_history_budget_is_refused_busy():
    """64 slots keeping 4,096 + 8 tokens: 1.003 MiB a session; the second one passes 2 MiB."""
    drafter = Keeping(max_context=4096)
    with Worker(drafter, "127.0.0.1", 0, window=8, history_mb=2) as w:
        c = connect(w, max_slots=64, engine_id=1)
        try:
            assert c.ack.accepted
            with pytest.raises(Refused, match="busy") as refused:
                connect(w, session=2, max_slots=64, engine_id=2)
            reason = str(refused.value)
            assert "64 slots x 4096 kept tokens needs 1.0 MiB" in reason and "hold 1.0 MiB of its 2 MiB" in reason
            assert "(--history-mb)" in reason
            small = connect(w, session=3, max_slots=8, engine_id=3)  # a smaller one fits
            small.close()
            again = connect(w, session=4, max_slots=64, engine_id=1)  # engine 1 anew: its old windows go
            assert again.ack.accepted
            again.close()
        finally:
            c.close()
    with pytest.raises(ValueError, match="history_mb 0: must be >= 1 \\(--history-mb\\)"):
        Worker(drafter, "127.0.0.1", 0, history_mb=0)


def _streams_batch(keep, stream, window=8, position=30):
    """A drafting batch of one NEW_GEN of ``stream`` on a session of ``window`` keeping
    ``keep`` tokens a slot (None: the window, no reader)."""
    history = None if keep is None else History()
    session = Session(7, 2, 3, False, Windows(2, window, keep), row_bytes=0, history=history)
    if history is not None:
        history.add(session.windows)
    frame = wire.encode_round_entries(1, 7, 0, [wire.Entry(0, 3, position, tuple(stream), new_gen=True)], b"", 0)
    hdr = wire.decode_header(frame[: wire.HEADER.size])
    rnd = wire.decode_round(hdr, frame[wire.HEADER.size :], False)
    return session, drafting_batch(session, rnd, Limits(max_slots=2, window=window))[-1]


def test_a_piece_of_an_encode_is_its_stream_cut_short_its_context_the_stream_s_own_tokens():
    stream = list(range(500, 600))
    session, batch = _streams_batch(128, stream)
    piece = encode_piece(batch, 0, 50)  # the stream's first 50 tokens, its context their last 8
    assert piece.tokens.tolist() == stream[42:50] and piece.positions.tolist() == [30 + 42]
    assert (piece.lengths.tolist(), piece.kept_from.tolist(), piece.n_out.tolist()) == ([50], [0], [0])
    short = encode_piece(batch, 0, 97)  # 3 tokens: a context shorter than the window
    assert short.tokens.tolist() == stream[:3] and short.positions.tolist() == [30]
    _, plain = _streams_batch(None, stream)  # no reader: the context's first tokens, as before
    piece = encode_piece(plain, 0, 3)
    assert piece.tokens.tolist() == stream[92:97] and piece.positions.tolist() == [30 + 92]
    assert piece.lengths.tolist() == [97]
    with pytest.raises(ValueError, match="the worker holds 92..100"):
        encode_piece(plain, 0, 9)


class Reencoding(Keeping):
    """Keeps streams and says it re-encodes each whole (as a drafter whose state was
    dropped does): a stream's encode costs every token the worker keeps of it."""

    def encodes(self, batch):
        return np.asarray(batch.lengths, np.int64) - kept(batch)


def test_the_pieces_of_a_whole_stream_s_encode_end_where_the_scheduler_cut_it():
    """An encode of 100 kept tokens (a context of 8) over a call of 32: each piece's
    context is the stream's tokens ending at its cut, the cuts growing to the entry."""
    stream = list(range(500, 600))
    _, batch = _streams_batch(128, stream)
    drafter = Reencoding(max_context=128)
    s = Scheduler(drafter, max_entries=4, max_tokens=32).start()
    try:
        t, box = submit(s, 7, batch)
        t.join(10)
        assert not t.is_alive() and "result" in box
    finally:
        s.stop()
    ends = [int(c.lengths[0]) for c in drafter.calls]
    assert ends == sorted(ends) and ends[-1] == 100 and len(ends) >= 4
    for call, end in zip(drafter.calls, ends, strict=True):
        assert call.tokens.tolist() == stream[max(0, end - 8) : end]
        assert call.positions.tolist() == [30 + max(0, end - 8)]


def test_a_piece_whose_stream_is_gone_fails_its_own_round_and_the_scheduler_drafts_on():
    """A long encode taken in pieces whose session's windows went (its connection gave up):
    reading the piece's tokens raises in the call that drafts it, which fails that round
    alone; the scheduler's queue never wedges and the next round is drafted."""
    stream = list(range(500, 600))
    session, batch = _streams_batch(128, stream)
    session.history._windows.clear()  # the session gone: its tokens with it
    drafter = Reencoding(max_context=128)
    s = Scheduler(drafter, max_entries=4, max_tokens=32).start()
    try:
        t, box = submit(s, 7, batch)
        t.join(10)
        assert not t.is_alive() and "gone" in str(box.get("error"))
        _, fine = _streams_batch(None, [1, 2, 3, 4] * 5)
        t, box = submit(s, 8, fine)
        t.join(10)
        assert not t.is_alive() and box["result"].counts.tolist() == [3]
    finally:
        s.stop()


def test_the_worker_s_flags_refuse_bad_values_naming_them():
    parser = argparse.ArgumentParser()
    worker_cli.add_parser(parser.add_subparsers())
    for flags, message in (
        (["--max-context", "0"], "--max-context 0: must be >= 1"),
        (["--history-mb", "0"], "--history-mb 0: must be >= 1"),
    ):
        args = parser.parse_args(["worker", "--listen", "127.0.0.1:0", *flags])
        with pytest.raises(ValueError, match=message):
            worker_cli.run(args)
    with pytest.raises(ValueError, match=f"--max-context {1 << 23}: not in 1..{wire.MAX_CONTEXT}"):
        load_drafter("lm", lm_device="cpu", max_context=1 << 23)

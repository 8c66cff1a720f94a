"""A worker that breaks the contract gets nothing delivered: the engine holds every
reply to what it asked (its HELLO, its round) before a draft reaches the caller.

The worker here is played by the test (a loopback TCP server speaking the wire): it
answers the engine's HELLO and ROUNDs honestly, except for the scripted bad frames it
sends first. In every mode (sync, thread, process) a bad reply is a round answered
ERROR with zero drafts, the connection is dropped and re-established (except for
BAD_REPLY-class answers, none of them here), and the next honest reply is delivered.
"""

from __future__ import annotations

import math
import socket
import threading
import time

import numpy as np
import pytest
import torch
from helpers import recv_exactly, until

from remote_dspark import wire
from remote_dspark.config import Mode
from remote_dspark.config.api import RemoteConfig
from remote_dspark.demo.harness import engine_env
from remote_dspark.engine import Batch, RemoteDSpark
from remote_dspark.outcome import Outcome

K = 3  # num_spec
VOCAB = 100  # the engine's vocabulary in the cases that give one
HONEST = 7  # every honest draft token
N_OUT = (1, 2)  # what the test's rounds ask of their two entries
DRAFTER_ID, MARKOV_ID = b"d" * 32, b"m" * 32


class ScriptedWorker:
    """The remote drafter, played by the test on loopback: HELLO_ACK then DRAFTS, honest
    unless a scripted bad frame is queued (``acks``, ``replies``: functions of the HELLO
    or ROUND that return a whole frame). One connection at a time (the engine keeps
    one). Every socket and the thread end in ``close()``; every wait is bounded."""

    def __init__(self, acks=(), replies=()):
        self.acks, self.replies = list(acks), list(replies)
        self.connections = 0
        self.hellos: list[wire.Hello] = []
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port = self._listener.getsockname()[1]
        self._conn: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="scripted-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            self._conn = conn
            try:
                self._serve(conn)
            except (OSError, wire.ProtocolError):
                pass
            finally:
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10.0)
        hello = session = None
        while not self._stop.is_set():
            hdr = wire.decode_header(recv_exactly(conn, wire.HEADER.size))
            payload = recv_exactly(conn, hdr.payload_len)
            if hdr.type == wire.HELLO:
                hello, session = wire.decode_hello(payload), hdr.session
                self.hellos.append(hello)
                make = self.acks.pop(0) if self.acks else honest_ack
                conn.sendall(make(hello, session))
            elif hdr.type == wire.ROUND:
                rnd = wire.decode_round(hdr, payload, hello.want_sampled)
                make = self.replies.pop(0) if self.replies else drafts
                conn.sendall(make(rnd, hello, session))
            else:
                return  # BYE

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        conn = self._conn
        if conn is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(10.0)
        assert not self._thread.is_alive()


def honest_ack(hello: wire.Hello, session: int, *, ack_session: int | None = None, **identities) -> bytes:
    """An accepting HELLO_ACK naming the HELLO's identities, unless ``identities`` (or
    ``ack_session``) say otherwise."""
    ack = dict(code=wire.ACCEPT, drafter_identity=hello.drafter_identity, markov_identity=hello.markov_identity)
    ack.update(identities)
    return wire.encode_hello_ack(wire.HelloAck(**ack), session if ack_session is None else ack_session)


def drafts(
    rnd: wire.Round,
    hello: wire.Hello,
    session: int,
    *,
    width=None,
    counts=None,
    statuses=None,
    token=HONEST,
    margin=0.5,
    margins=None,
    round_id=None,
    q_edit=None,
) -> bytes:
    """The DRAFTS for ``rnd``: honest by default (every entry drafts its n_out tokens
    ``HONEST``, margins exactly when the HELLO asked, and distributions when it asked for
    sampled drafts: all the weight on ``HONEST``); each keyword breaks one rule
    (``q_edit(ids, weights)``: the distributions, [n, width, 32], in place)."""
    n_out = list(rnd.n_out)
    n = len(n_out)
    width = max(n_out, default=0) if width is None else width
    counts = n_out if counts is None else counts
    grid = [token if j < counts[i] else 0 for i in range(n) for j in range(width)]
    want = hello.want_margin if margins is None else margins
    marg = [margin if j < counts[i] else 0.0 for i in range(n) for j in range(width)] if want else None
    q = sampled_q(counts, width, q_edit) if hello.want_sampled else (None, None)
    d = wire.DraftsFrame(
        rnd.round_id if round_id is None else round_id,
        list(rnd.slots),
        counts,
        statuses or [wire.STATUS_OK] * n,
        width,
        grid,
        marg,
        *q,
    )
    return wire.encode_drafts(d, session)


def sampled_q(counts, width: int, edit=None) -> tuple[list[int], list[int]]:
    """Honest distributions of ``HONEST`` drafts: ids ``HONEST`` first, then 0.., the whole
    weight on it; zero past counts; then ``edit(ids, weights)`` in place."""
    n, top = len(counts), wire.SAMPLED_TOP
    ids = np.zeros((n, width, top), np.int32)
    weights = np.zeros((n, width, top), np.uint16)
    live = np.arange(width) < np.asarray(counts, np.int64).reshape(n, 1)
    ids[live] = [HONEST] + [t for t in range(top) if t != HONEST]
    weights[live, 0] = wire.SAMPLED_TOTAL
    if edit is not None:
        edit(ids, weights)
    return ids.ravel().tolist(), weights.ravel().tolist()


# name: (bad frames, engine keywords, environment). Each breaks one rule of the contract.
# A refused HELLO_ACK comes before any round: the reconnect after it waits this long, so
# the test's first round finds the engine still without a connection on a loaded host too
# (with 20 ms, a round delayed past the reconnect found the honest one already).
SLOW = {"VLLM_DSPARK_REMOTE_BACKOFF_MS": "500", "VLLM_DSPARK_REMOTE_BACKOFF_MAX_MS": "500"}

CASES = {
    "token over the vocabulary": (
        {"replies": [lambda r, h, s: drafts(r, h, s, token=VOCAB)]},
        {"vocab_size": VOCAB},
        {},
    ),
    "negative token": ({"replies": [lambda r, h, s: drafts(r, h, s, token=-3)]}, {}, {}),
    "count over n_out": ({"replies": [lambda r, h, s: drafts(r, h, s, counts=[2, 2])]}, {}, {}),
    "width over num_spec": ({"replies": [lambda r, h, s: drafts(r, h, s, width=K + 1)]}, {}, {}),
    "RESYNC with drafts": (
        {"replies": [lambda r, h, s: drafts(r, h, s, statuses=[wire.STATUS_RESYNC, wire.STATUS_OK])]},
        {},
        {},
    ),
    "margins missing when asked": (
        {"replies": [lambda r, h, s: drafts(r, h, s, margins=False)]},
        {},
        {"VLLM_DSPARK_REMOTE_WANT_MARGIN": "1"},
    ),
    "margins not asked for": (
        {"replies": [lambda r, h, s: drafts(r, h, s, margins=True)]},
        {},
        {"VLLM_DSPARK_REMOTE_WANT_MARGIN": "0"},
    ),
    "NaN margin": (
        {"replies": [lambda r, h, s: drafts(r, h, s, margin=math.nan)]},
        {},
        {"VLLM_DSPARK_REMOTE_WANT_MARGIN": "1"},
    ),
    "margin over 1": (
        {"replies": [lambda r, h, s: drafts(r, h, s, margin=1.5)]},
        {},
        {"VLLM_DSPARK_REMOTE_WANT_MARGIN": "1"},
    ),
    "negative margin": (
        {"replies": [lambda r, h, s: drafts(r, h, s, margin=-0.25)]},
        {},
        {"VLLM_DSPARK_REMOTE_WANT_MARGIN": "1"},
    ),
    "another session": ({"replies": [lambda r, h, s: drafts(r, h, s ^ 0x5A5A)]}, {}, {}),
    "a round never sent": ({"replies": [lambda r, h, s: drafts(r, h, s, round_id=r.round_id + 7)]}, {}, {}),
    "HELLO_ACK of another drafter": ({"acks": [lambda h, s: honest_ack(h, s, drafter_identity=b"x" * 32)]}, {}, SLOW),
    "HELLO_ACK of another Markov model": (
        {"acks": [lambda h, s: honest_ack(h, s, markov_identity=b"y" * 32)]},
        {},
        SLOW,
    ),
    "HELLO_ACK of another session": ({"acks": [lambda h, s: honest_ack(h, s, ack_session=s + 1)]}, {}, SLOW),
}


def environment(port: int, tmp_path, mode: str, env_extra: dict) -> dict:
    settings = dict(
        VLLM_DSPARK_REMOTE_TIMEOUT_MS="5000",
        VLLM_DSPARK_REMOTE_TRIP="0",
        VLLM_DSPARK_REMOTE_BACKOFF_MS="20",
        VLLM_DSPARK_REMOTE_BACKOFF_MAX_MS="40",
        VLLM_DSPARK_REMOTE_ASYNC_NAP_US="20",
    )
    settings.update(env_extra)
    stats = str(tmp_path / "stats.json")
    return engine_env(port, DRAFTER_ID.hex(), MARKOV_ID.hex(), Mode(mode), stats_file=stats, **settings)


def engine(port: int, tmp_path, mode: str, env_extra: dict, **kw) -> RemoteDSpark:
    env = environment(port, tmp_path, mode, env_extra)
    return RemoteDSpark(RemoteConfig.from_env(env), environ=env, num_spec=K, max_slots=4, row_bytes=8, **kw)


def served_round(eng, sync, loop, entries) -> int:
    """One round of ``entries`` handed over on ``eng`` and served by the proxy ``loop``
    (the ofl path: the loop's own round); its id."""
    r = eng.reserve(1)
    eng.write_entries(r, entries)
    sync.signal(r)
    rnd = loop.end.next_round(2.0)
    assert rnd is not None and rnd.round == r
    loop.serve(rnd)
    return r


def batch(**sampling) -> Batch:
    """The round every case answers (``sampling``: a sampled engine's temperature and seed)."""
    return Batch.from_lists(
        [0, 1],
        [[1], [3]],
        [0, 0],
        [True, True],
        torch.zeros(2, 8, dtype=torch.uint8),
        torch.arange(2),
        n_out=list(N_OUT),
        **sampling,
    )


def first_ok(rd: RemoteDSpark, limit_s: float = 15.0):
    """Rounds until one is answered OK (rounds while the engine reconnects are ERROR at
    once); that round's drafts, or None after ``limit_s``."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        out = rd.round(batch())
        if out.outcome is Outcome.OK:
            return out
        time.sleep(0.01)
    return None


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_reply_that_breaks_the_contract_delivers_nothing_and_the_engine_reconnects(tmp_path, mode, case):
    script, kw, env_extra = CASES[case]
    worker = ScriptedWorker(**script)
    try:
        with engine(worker.port, tmp_path, mode, env_extra, **kw) as rd:
            out = rd.round(batch())
            assert out.outcome is Outcome.ERROR and out.source == "none"
            assert not out.counts.any() and not out.tokens.any()
            assert out.margins is None or not out.margins.any()
            ok = first_ok(rd)  # the engine keeps serving: an honest reply is delivered
            assert ok is not None, f"no round answered OK after the bad {case}"
            assert ok.counts.tolist() == list(N_OUT)
            assert ok.tokens.tolist() == [[HONEST, 0, 0], [HONEST, HONEST, 0]]
            # ... over a new connection: a broken reply (or HELLO_ACK) drops the one it came on
            assert worker.connections >= 2
            assert rd.stats().rounds[Outcome.ERROR] >= 1
    finally:
        worker.close()


@pytest.mark.parametrize("case", list(CASES))
def test_the_python_round_of_the_ofl_transports_refuses_the_same_replies(lib, tmp_path, case):
    """The ofl round (``ProxyLoop.serve``: the network in Python, the reply held to the C
    rule by ``ProxyEnd.check_reply`` inside the link's round) over the same worker."""
    from remote_dspark.proxy.loop import ProxyLoop
    from remote_dspark.shm import layout, memfd, ring, streamsync

    script, kw, env_extra = CASES[case]
    worker = ScriptedWorker(**script)
    env = environment(worker.port, tmp_path, "process", env_extra)
    region = memfd.Region.create(layout.Layout(4, 4, 8, K, 64))
    loop = ProxyLoop(region, lib, RemoteConfig.from_env(env), engine_id=1, environ=env, **kw)
    eng, sync = ring.EngineEnd(region, lib), streamsync.HostFlagSync(region, lib)
    entries = [wire.Entry(0, N_OUT[0], 0, [1], True), wire.Entry(1, N_OUT[1], 0, [3], True)]

    def ofl_round() -> ring.RoundDrafts:
        r = served_round(eng, sync, loop, entries)
        assert eng.released() == r
        return eng.drafts(r)

    try:
        loop.connect()
        d = ofl_round()
        assert (d.outcome, d.counts) == (Outcome.ERROR, ())
        assert until(lambda: loop.link.connected and worker.connections >= 2)  # dropped, then back
        d = ofl_round()
        assert (d.outcome, d.counts, d.tokens) == (Outcome.OK, N_OUT, ((HONEST,), (HONEST, HONEST)))
    finally:
        loop.link.close()
        region.close()
        worker.close()


def test_an_honest_worker_is_served_in_one_connection(tmp_path):
    """The control: the same engine and worker with no bad frame, every mode's rule kept."""
    worker = ScriptedWorker()
    try:
        with engine(worker.port, tmp_path, "sync", {"VLLM_DSPARK_REMOTE_WANT_MARGIN": "1"}, vocab_size=VOCAB) as rd:
            for _ in range(3):
                out = rd.round(batch())
                assert out.outcome is Outcome.OK and out.tokens.tolist() == [[HONEST, 0, 0], [HONEST, HONEST, 0]]
                assert out.margins.tolist() == [[0.5, 0, 0], [0.5, 0.5, 0]]
        assert worker.connections == 1 and worker.hellos[0].vocab_size == VOCAB
    finally:
        worker.close()


@pytest.mark.parametrize("mode", ["sync", "process"])
def test_hello_carries_the_vocabulary_size_in_every_mode(tmp_path, mode):
    worker = ScriptedWorker()
    try:
        with engine(worker.port, tmp_path, mode, {}, vocab_size=VOCAB) as rd:
            assert first_ok(rd) is not None
        with engine(worker.port, tmp_path, mode, {}) as rd:  # unknown: 0 on the wire
            assert first_ok(rd) is not None
        assert [h.vocab_size for h in worker.hellos] == [VOCAB, 0]
    finally:
        worker.close()


def test_host_token_ids_outside_the_vocabulary_raise_naming_tokens_before_anything_is_sent(tmp_path):
    worker = ScriptedWorker()
    try:
        with engine(worker.port, tmp_path, "sync", {}, vocab_size=VOCAB) as rd:
            for bad in (VOCAB, -1):
                b = Batch.from_lists(
                    [0, 1], [[1], [bad]], [0, 0], [True, True], torch.zeros(2, 8, dtype=torch.uint8), torch.arange(2)
                )
                with pytest.raises(ValueError, match=rf"tokens: {bad} \(token 1\) outside 0\.\.{VOCAB - 1}"):
                    rd.round(b)
            assert rd.stats().total_rounds == 0
        assert worker.connections == 1  # HELLO only: no ROUND reached the worker
    finally:
        worker.close()


@pytest.mark.parametrize("bad", [0, -5, (1 << 31) + 1, 1.5])  # ids are i32: at most 2^31 of them
def test_a_vocabulary_size_out_of_range_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match=r"vocab_size=.*must be None \(unknown\) or an int in 1\.\.2147483648"):
        engine(1, tmp_path, "sync", {}, vocab_size=bad)


def test_the_worker_refuses_an_engine_with_a_smaller_vocabulary(tmp_path):
    from remote_dspark.drafter import MarkovDrafter
    from remote_dspark.drafter.markov import MarkovModel
    from remote_dspark.transport import parse_endpoint
    from remote_dspark.transport.client import DraftClient, Refused
    from remote_dspark.worker import Worker

    model = MarkovModel.from_tokens([1, 2, 3, 40] * 10, order=1, top=2)  # ids up to 40
    d = MarkovDrafter(model)
    assert d.vocab_size == 41
    w = Worker(d, "127.0.0.1", 0).start()
    try:
        endpoint = parse_endpoint(f"tcp://127.0.0.1:{w.port}")

        def hello(vocab):
            return wire.Hello(d.drafter_identity, d.markov_identity, 1, 4, 0, 3, vocab_size=vocab)

        with pytest.raises(Refused) as e:
            DraftClient.connect(endpoint, hello(40), 1, 5.0)
        assert e.value.code == wire.REFUSE_DRAFTER and "41" in e.value.reason and "40" in e.value.reason
        # The same tokenizer's larger vocabulary, or one the engine does not know: served.
        for vocab in (41, 50_000, 0):
            DraftClient.connect(endpoint, hello(vocab), 1, 5.0).close()
        assert w.stats.refused == 1
    finally:
        w.stop()


def test_an_engine_that_says_its_vocabulary_is_refused_by_a_larger_drafter_at_start(tmp_path):
    """Through the engine: STRICT_START makes the refusal the start's error, with the reason."""
    from remote_dspark.drafter import MarkovDrafter
    from remote_dspark.drafter.markov import MarkovModel
    from remote_dspark.transport.client import Refused
    from remote_dspark.worker import Worker

    d = MarkovDrafter(MarkovModel.from_tokens([1, 2, 3, 40] * 10, order=1, top=2))
    w = Worker(d, "127.0.0.1", 0).start()
    try:
        env = {
            "VLLM_DSPARK_REMOTE_STRICT_START": "1",
            "VLLM_DSPARK_REMOTE_IDENTITY": d.drafter_identity.hex(),
            "VLLM_DSPARK_REMOTE_MARKOV_IDENTITY": d.markov_identity.hex(),
        }
        rd = engine(w.port, tmp_path, "sync", env, vocab_size=32)
        with pytest.raises(Refused, match="41 tokens, over the engine's 32"):
            rd.start()
        rd.close()
    finally:
        w.stop()


# ------------------------------------------------------------------ sampled sessions

SAMPLED_ENV = {"VLLM_DSPARK_SAMPLED_TOP32": "1", "VLLM_DSPARK_REMOTE_WANT_MARGIN": "1"}


def _token_not_listed(ids, weights):
    ids[1, 1, 0] = 99  # entry 1's draft 1: HONEST's id replaced, its weight kept


def _weights_short(ids, weights):
    weights[0, 0, 0] -= 1


def _sliver_listed_last(ids, weights):
    """The attacker of a sampled session: every draft ``HONEST``, listed last with weight 1
    (the rest spread, non-increasing), so an exact sampler would accept it almost surely;
    it is not the pick at the entry's seed and position."""
    live = weights.sum(axis=2) > 0
    ids[live] = [t for t in range(wire.SAMPLED_TOP + 1) if t != HONEST][: wire.SAMPLED_TOP - 1] + [HONEST]
    spread = [65534 // 31 + (m < 65534 % 31) for m in range(wire.SAMPLED_TOP - 1)]
    weights[live] = spread + [1]


def _weights_rising(ids, weights):
    weights[1, 0, 0], weights[1, 0, 2] = wire.SAMPLED_TOTAL - 5, 5  # HONEST keeps the pick's weight


# name: (bad reply, engine keywords). Each breaks the rule a sampled reply keeps.
SAMPLED_CASES = {
    "a draft that is not the pick (weight 1, listed last)": (
        lambda r, h, s: drafts(r, h, s, q_edit=_sliver_listed_last),
        {},
    ),
    "weights that rise along the ids": (lambda r, h, s: drafts(r, h, s, q_edit=_weights_rising), {}),
    "a drafted token outside its distribution": (lambda r, h, s: drafts(r, h, s, q_edit=_token_not_listed), {}),
    "weights not summing to 65535": (lambda r, h, s: drafts(r, h, s, q_edit=_weights_short), {}),
    "a NaN margin": (lambda r, h, s: drafts(r, h, s, margin=math.nan), {}),
    "an id over the vocabulary": (
        lambda r, h, s: drafts(r, h, s, q_edit=lambda ids, w: ids[0, 0].__setitem__(5, VOCAB)),
        {"vocab_size": VOCAB},
    ),
}


def sampled_batch() -> Batch:
    return batch(temperature=[1.0, 0.5], seed=[3, 2**64 - 1])


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_a_sampled_reply_that_breaks_the_distributions_rule_delivers_nothing(tmp_path, mode, case):
    reply, kw = SAMPLED_CASES[case]
    worker = ScriptedWorker(replies=[reply])
    try:
        with engine(worker.port, tmp_path, mode, SAMPLED_ENV, **kw) as rd:
            out = rd.round(sampled_batch())
            assert out.outcome is Outcome.ERROR and out.source == "none"
            assert not out.counts.any() and not out.tokens.any() and not out.margins.any()
            assert out.q_ids.shape == (2, K, wire.SAMPLED_TOP) and not out.q_ids.any() and not out.q_weights.any()
            got = []
            assert until(lambda: got.append(rd.round(sampled_batch())) or got[-1].outcome is Outcome.OK, 15.0, 0.01)
            ok = got[-1]  # the engine keeps serving, over a new connection: the honest reply
            assert ok.tokens.tolist() == [[HONEST, 0, 0], [HONEST, HONEST, 0]]
            assert ok.q_weights[:, :, 0].tolist() == [[wire.SAMPLED_TOTAL, 0, 0], [wire.SAMPLED_TOTAL] * 2 + [0]]
            assert (ok.q_ids[:, :, 0] == torch.tensor([[HONEST, 0, 0], [HONEST, HONEST, 0]])).all()
            assert worker.connections >= 2 and worker.hellos[0].want_sampled
    finally:
        worker.close()


def test_the_python_round_of_the_ofl_transports_writes_a_sampled_reply_s_q_and_refuses_a_bad_one(lib, tmp_path):
    """The ofl round (``ProxyLoop.serve``) of a sampled session: the descriptor sent with
    its temperatures and seeds (the worker decodes it as a sampled ROUND), a reply whose
    weights are off answered ERROR, the honest one's q in the drafts slot."""
    from remote_dspark.proxy.loop import ProxyLoop
    from remote_dspark.shm import layout, memfd, ring, streamsync

    worker = ScriptedWorker(replies=[lambda r, h, s: drafts(r, h, s, q_edit=_weights_short)])
    env = environment(worker.port, tmp_path, "process", SAMPLED_ENV)
    lay = layout.Layout(4, 4, 8, K, 64, sampled=True)
    region = memfd.Region.create(lay)
    loop = ProxyLoop(region, lib, RemoteConfig.from_env(env), engine_id=1, environ=env)
    eng, sync = ring.EngineEnd(region, lib), streamsync.HostFlagSync(region, lib)
    entries = [wire.Entry(0, N_OUT[0], 0, [1], True, 1.0, 3), wire.Entry(1, N_OUT[1], 0, [3], True, 0.5, 4)]

    def ofl_round() -> tuple[ring.RoundDrafts, np.ndarray, np.ndarray]:
        r = served_round(eng, sync, loop, entries)
        cells = 2 * K * wire.SAMPLED_TOP
        with region.drafts(r & 3) as slot:
            ids = np.frombuffer(slot, np.int32, cells, lay.d_q_ids).reshape(2, K, -1).copy()
            weights = np.frombuffer(slot, np.uint16, cells, lay.d_q_weights).reshape(2, K, -1).copy()
        return eng.drafts(r), ids, weights

    try:
        loop.connect()
        d, ids, weights = ofl_round()
        assert (d.outcome, d.counts) == (Outcome.ERROR, ()) and not ids.any() and not weights.any()
        assert until(lambda: loop.link.connected and worker.connections >= 2)
        d, ids, weights = ofl_round()
        assert (d.outcome, d.counts, d.tokens) == (Outcome.OK, N_OUT, ((HONEST,), (HONEST, HONEST)))
        want_ids, want_weights = sampled_q(N_OUT, K)
        assert ids.ravel().tolist() == want_ids and weights.ravel().tolist() == want_weights
        assert worker.hellos[-1].want_sampled
    finally:
        loop.link.close()
        region.close()
        worker.close()

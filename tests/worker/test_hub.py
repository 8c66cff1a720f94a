"""The hub (``native/worker_hub.c``, ``worker/hub.py``) against the worker's Python path.

Two workers serve the same drafter, one on the ``python`` round path (a thread per
connection: the reference) and one by the hub. The same random rounds of a few sessions
(new generations, appends, gaps that RESYNC, unknown slots, entries past the drafter's
positions, empty rounds, rounds with every slot to re-announce), greedy and sampled,
must get byte-identical DRAFTS and add the same counters, for a Markov subclass (which
the lane does not take), the built-in LM on the CPU and a plug-in drafter. Then the
hub's own paths over loopback sockets: a reply larger than the socket takes at once,
a stalled frame, bad frames, a failing drafter, stop() with a round in flight and
an eviction; each ends its own connection only.
"""

from __future__ import annotations

import ctypes
import logging
import random
import socket
import threading
import time

import numpy as np
import pytest
from helpers import connect, do_round, hello, recv_exactly, until

from remote_dspark import wire
from remote_dspark.drafter.contract import DraftResult
from remote_dspark.drafter.markov import MarkovDrafter, SyntheticLanguage, builtin_model
from remote_dspark.worker import Worker

WAIT_S = 5.0
TEXT = SyntheticLanguage().text(4000, seed=5)
COUNTERS = ("rounds", "entries", "resyncs", "beyond_positions", "draft_tokens", "expired")


class Subclassed(MarkovDrafter):
    """The built-in Markov drafter under another class: the hub's, not the lane's."""


class Plugin:
    """A deterministic plug-in drafter: entry i's drafts follow from its context, its
    absolute position and its slot; a few entries end early; sampled rounds carry a
    distribution per draft. ``margins`` False: it never gives margins (the worker sends
    zeros). ``gate``: it drafts only while set (bounded wait); ``fail``: the next call
    raises once."""

    drafter_identity = bytes(range(32))
    markov_identity = bytes(32)
    samples = True
    max_positions = 90

    def __init__(self, margins: bool = True):
        self.margins = margins
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()
        self.fail = False

    def draft_batch(self, batch):
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        if self.fail:
            self.fail = False
            raise RuntimeError("the plug-in failed on purpose")
        n, width = len(batch), batch.width
        tokens, counts = np.zeros((n, width), np.int32), np.zeros(n, np.int32)
        margins = np.zeros((n, width), np.float32)
        for i in range(n):  # (a test's drafter: a loop over entries is fine)
            ctx = batch.tokens[batch.offsets[i] : batch.offsets[i + 1]].astype(np.int64)
            base = int(ctx.sum()) + 3 * len(ctx) + int(batch.positions[i]) + 7 * int(batch.slots[i])
            c = max(0, int(batch.n_out[i]) - base % 2)
            counts[i] = c
            tokens[i, :c] = (base + 5 * np.arange(c)) % 100
            margins[i, :c] = (base % 10 + 1) / 16
        q_ids = q_weights = None
        if batch.sampled:
            q_ids = (tokens[:, :, None] + np.arange(32, dtype=np.int32)) % 128
            q_weights = np.ones((n, width, 32), np.uint16)
            q_weights[:, :, 0] = 65535 - 31
            dead = np.arange(width) >= counts[:, None]
            q_ids[dead], q_weights[dead] = 0, 0
        keep = self.margins and batch.want_margin
        return DraftResult(tokens, counts, margins if keep else None, q_ids, q_weights)


def _lm():
    from remote_dspark.drafter.lm.drafter import LMDrafter
    from remote_dspark.drafter.lm.model import LMConfig, TinyLM

    return LMDrafter(TinyLM(LMConfig(d_model=32, d_ff=64, max_positions=96)), device="cpu", cache_slots=16, window=16)


DRAFTERS = {
    "markov": lambda: Subclassed(builtin_model()),
    "lm": _lm,
    "plugin": Plugin,
    "plugin without margins": lambda: Plugin(margins=False),
}


@pytest.fixture(scope="module", params=list(DRAFTERS))
def pair(request):
    make = DRAFTERS[request.param]
    # A call of 8 entries at most: a round of 16 slots goes the jobs' way (in pieces), one
    # of 1 or 6 alone is a whole call (both paths, each held to the reference)
    hub = Worker(make(), "127.0.0.1", 0, window=16, max_batch_entries=8)
    python = Worker(make(), "127.0.0.1", 0, window=16, max_batch_entries=8, round_path="python").start()
    try:
        assert hub._hub is not None and hub._lanes is None and python.round_path == "python"
        hub.hub_rounds = hub.job_rounds = 0  # rounds the hub took, and those of them made jobs
        ready, make_job = hub._hub.ready, hub._hub.make_job

        def counting(timeout_s):
            ids = ready(timeout_s)
            hub.hub_rounds += len(ids)
            return ids

        def jobs(conn):
            hub.job_rounds += 1
            return make_job(conn)

        hub._hub.ready, hub._hub.make_job = counting, jobs  # (before its drafter thread looks)
        hub.start()
        yield hub, python
    finally:
        hub.stop()
        python.stop()


class Engine:
    """An engine's side of random rounds: the slots it announced and their next positions."""

    def __init__(self, rng: random.Random, max_slots: int, num_spec: int, sampled: bool):
        self.rng, self.max_slots, self.num_spec, self.sampled = rng, max_slots, num_spec, sampled
        self.next_pos: dict[int, int] = {}

    def _tokens(self, k: int) -> list[int]:
        if self.rng.random() < 0.8:
            at = self.rng.randrange(len(TEXT) - k)
            return TEXT[at : at + k]
        return [self.rng.randint(-3, 140) for _ in range(k)]  # tokens past the vocabulary too

    def _entry(self, s: int, new: bool, reannounce: bool) -> wire.Entry:
        rng = self.rng
        k = rng.choice([0, 1, 2, 5, 16, 40]) if new else rng.choice([0, 1, 2, 3])
        if new:
            pos = rng.choice([0, rng.randint(0, 60), rng.randint(70, 99)])  # past 90 (96): beyond the positions
        elif reannounce:
            pos = rng.randint(0, 99)  # a slot the worker does not know (it forgot it)
        else:
            pos = self.next_pos[s] + (rng.randint(1, 2) if rng.random() < 0.1 else 0)  # a gap: RESYNC
        temperature = rng.choice([0.0, 0.7, 1.0]) if self.sampled else 0.0
        seed = rng.getrandbits(64) if self.sampled else 0
        self.next_pos[s] = pos + k
        return wire.Entry(s, rng.randint(0, self.num_spec + 2), pos, self._tokens(k), new, temperature, seed)

    def frame(self, round_id: int, session: int) -> bytes:
        rng = self.rng
        kind = rng.random()
        if kind < 0.1:  # an empty round
            slots, entries = [], []
        elif kind < 0.2:  # every slot to re-announce: a session's slots the worker does not know
            slots = rng.sample(range(self.max_slots), rng.randint(1, self.max_slots))
            entries = [self._entry(s, False, True) for s in slots]
        else:
            slots = rng.sample(range(self.max_slots), rng.randint(1, self.max_slots))
            entries = [
                self._entry(s, s not in self.next_pos or rng.random() < 0.15, rng.random() < 0.05) for s in slots
            ]
        return wire.encode_round_entries(round_id, session, 60_000, entries, bytes(4 * len(entries)), 4, self.sampled)


def _frame(sock: socket.socket) -> bytes:
    """One whole frame from a blocking socket with a timeout."""
    head = recv_exactly(sock, wire.HEADER.size)
    return head + recv_exactly(sock, wire.decode_header(head).payload_len)


def _counted(w: Worker) -> dict:
    st = w.statistics()
    return {name: getattr(st, name) for name in COUNTERS}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("seed", [1, 2])
def test_the_hub_answers_reply_for_reply_and_counts_as_the_python_path(pair, sampled, seed):
    hub, python = pair
    before, taken, as_jobs = [_counted(w) for w in pair], hub.hub_rounds, hub.job_rounds
    rng = random.Random(seed)
    shapes = [(slots, rng.randint(1, 6), rng.random() < 0.5) for slots in (1, 6, 16)]
    rounds = 8
    clients = {w: [] for w in pair}
    try:
        for w in pair:
            for e, (slots, k, margin) in enumerate(shapes):
                session = 100 * seed + 2 * e + sampled + 1
                terms = dict(max_slots=slots, num_spec=k, want_margin=margin, want_sampled=sampled, vocab_size=128)
                clients[w].append(connect(w, session=session, engine_id=10 * seed + e, **terms))
        engines = {
            w: [Engine(random.Random(seed * 31 + e), *s[:2], sampled) for e, s in enumerate(shapes)] for w in pair
        }
        for rid in range(1, rounds + 1):
            for e in range(len(shapes)):  # the sessions in turn, one round in flight at a time
                replies = []
                for w in pair:
                    c = clients[w][e]
                    c.chan.send(engines[w][e].frame(rid, c.session))
                    c.chan.stream.sock.settimeout(WAIT_S)
                    replies.append(_frame(c.chan.stream.sock))
                assert wire.decode_header(replies[0][: wire.HEADER.size]).type == wire.DRAFTS
                assert replies[0] == replies[1], f"round {rid} of session {e}"
    finally:
        for w in pair:
            for c in clients[w]:
                c.close()
    want = rounds * len(shapes)
    assert until(lambda: all(_counted(w)["rounds"] - b["rounds"] == want for w, b in zip(pair, before)), WAIT_S)
    grown = [{k: v - b[k] for k, v in _counted(w).items()} for w, b in zip(pair, before)]
    assert grown[0] == grown[1] and hub.hub_rounds - taken == want
    assert 0 < hub.job_rounds - as_jobs < want  # some as jobs (the 16 slots' rounds), some in whole calls
    assert grown[0]["resyncs"] > 0 and grown[0]["draft_tokens"] > 0
    assert (grown[0]["beyond_positions"] > 0) == (getattr(hub.drafter, "max_positions", None) is not None)


# ---------------------------------------------------------------------- the hub's own paths


@pytest.fixture(scope="module")
def hub():
    w = Worker(Plugin(), "127.0.0.1", 0, window=16).start()
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture
def plugin(hub):
    d = hub.drafter
    d.gate.set()
    d.fail = False
    yield d
    d.gate.set()


def _entries(n: int) -> list[wire.Entry]:
    return [wire.Entry(s, 3, 0, TEXT[s : s + 3], True) for s in range(n)]


def _served(c, rid: int = 1) -> wire.DraftsFrame:
    d = do_round(c, rid, _entries(2))
    assert list(d.statuses) == [wire.STATUS_OK] * 2 and sum(d.counts) > 0
    return d


def _closed(sock: socket.socket) -> bytes:
    """What ``sock`` reads to its close (bounded), the frames before it."""
    sock.settimeout(WAIT_S)
    got = bytearray()
    while chunk := sock.recv(65536):
        got += chunk
    return bytes(got)


class _Spy:
    """The worker's library, its ``hub_reply`` results kept (1: the reply was sent in part)."""

    def __init__(self, lib):
        self._lib, self.replies = lib, []

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def hub_reply(self, *args):
        got = self._lib.hub_reply(*args)
        self.replies.append(got)
        return got

    def hub_answer(self, *args):  # a call of whole rounds: each round's send written to `sent`
        self._lib.hub_answer(*args)
        k, sent = args[2], args[5]
        self.replies += list((ctypes.c_int32 * k).from_address(sent))


def _narrow(w: Worker, **terms) -> socket.socket:
    """A HELLO'd raw connection to ``w`` whose receive buffer was shrunk before it connected."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(WAIT_S)
    sock.connect(("127.0.0.1", w.port))
    sock.sendall(wire.encode_hello(hello(w, **terms), 1))
    ack = _frame(sock)
    assert wire.decode_hello_ack(ack[wire.HEADER.size :]).code == wire.ACCEPT
    return sock


def test_a_reply_larger_than_the_socket_takes_is_finished_whole_by_the_io_thread():
    """A sampled reply of 256 entries of 8 drafts (400 KB) to a client that shrank its
    receive buffer and reads only once the worker could not send it whole (its own send
    buffer shrunk too, so that whatever the system's sizes): the I/O thread sends the
    rest as room comes (EPOLLOUT); the reply is the Python path's byte for byte, and the
    connection reads its next round after."""
    workers = [Worker(Plugin(), "127.0.0.1", 0, window=16, round_path=p) for p in ("served", "python")]
    spy = workers[0]._hub.lib = _Spy(workers[0]._hub.lib)
    socks = []
    try:
        for w in workers:
            w.start()
            socks.append(_narrow(w, max_slots=256, num_spec=8, want_sampled=True, vocab_size=128, row_bytes=0))
        assert until(lambda: len(workers[0]._hub.connections()) == 1, WAIT_S)
        workers[0]._hub.connections()[0].sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        replies = []
        for rid in (1, 2):
            entries = [wire.Entry(s, 8, 0 if rid == 1 else 3, TEXT[s : s + 3], rid == 1, 1.0, s) for s in range(256)]
            for w, sock in zip(workers, socks):
                sock.sendall(wire.encode_round_entries(rid, 1, 60_000, entries, b"", 0, sampled=True))
                if w is workers[0] and rid == 1:  # sent in part: the rest is the I/O thread's
                    assert until(lambda: spy.replies == [1], WAIT_S), spy.replies
                replies.append(_frame(sock))
            assert len(replies[-1]) > 400_000 and replies[-2] == replies[-1], f"round {rid}"
        assert len(spy.replies) == 2
    finally:
        for sock in socks:
            sock.close()
        for w in workers:
            w.stop()


def test_a_frame_not_whole_in_time_ends_its_connection_only():
    w = Worker(Plugin(), "127.0.0.1", 0, window=16, frame_timeout_s=0.2).start()
    try:
        slow, other = connect(w, session=1, engine_id=1), connect(w, session=2, engine_id=2)
        frame = wire.encode_round_entries(1, 1, 0, _entries(2), bytes(8), 4)
        slow.chan.stream.sock.sendall(frame[:30])
        _served(other)
        assert _closed(slow.chan.stream.sock) == b""  # closed, nothing sent
        assert until(lambda: w.statistics().stalled == 1, WAIT_S)
        _served(other, 2)
        slow.close()
        other.close()
    finally:
        w.stop()


BAD = {
    "bad magic": (lambda: b"XXXX" + wire.encode_header(wire.ROUND, 0, 1)[4:], "bad magic", 1),
    "a second HELLO": (lambda: wire.encode_header(wire.HELLO, 10, 1), "unexpected HELLO", 1),
    "a slot twice": (
        lambda: wire.encode_round_entries(1, 1, 0, [wire.Entry(0, 2, 0, [1], True)] * 2, bytes(8), 4),
        "slot 0 already named by entry 0",
        1,
    ),
    "a BYE": (lambda: wire.encode_header(wire.BYE, 0, 1), "", 0),
}


@pytest.mark.parametrize("why", BAD)
def test_a_bad_frame_or_a_bye_ends_that_connection_only(hub, plugin, caplog, why):
    frame, words, counted = BAD[why]
    before = hub.statistics()
    c, other = connect(hub, session=1, engine_id=1), connect(hub, session=2, engine_id=2)
    try:
        with caplog.at_level(logging.WARNING, logger="remote_dspark.worker"):
            c.chan.stream.sock.sendall(frame())
            assert _closed(c.chan.stream.sock) == b""
            assert until(lambda: hub.statistics().bad_frames == before.bad_frames + counted, WAIT_S)
        assert words in caplog.text
        if not counted:
            assert "closing it" not in caplog.text
        _served(other)
        after = hub.statistics()
        assert (after.stalled, after.round_failures) == (before.stalled, before.round_failures)
    finally:
        c.close()
        other.close()


def test_a_drafter_that_raises_ends_that_connection_and_the_worker_serves_the_next(hub, plugin, caplog):
    before = hub.statistics().round_failures
    c = connect(hub, session=1, engine_id=1)
    plugin.fail = True
    with caplog.at_level(logging.ERROR, logger="remote_dspark.worker"):
        c.chan.send(wire.encode_round_entries(1, 1, 0, _entries(2), bytes(8), 4))
        assert _closed(c.chan.stream.sock) == b""
        assert until(lambda: hub.statistics().round_failures == before + 1, WAIT_S)
    assert "failed serving a round" in caplog.text and "failed on purpose" in caplog.text
    c.close()
    nxt = connect(hub, session=2, engine_id=2)
    _served(nxt)
    nxt.close()


def test_stop_with_a_round_in_flight_answers_or_says_bye_and_leaves_no_thread():
    threads = set(threading.enumerate())
    drafter = Plugin()
    w = Worker(drafter, "127.0.0.1", 0, window=16).start()
    c = connect(w)
    try:
        drafter.gate.clear()
        c.chan.send(wire.encode_round_entries(1, 1, 0, _entries(2), bytes(8), 4))
        assert drafter.entered.wait(WAIT_S)
        stopping = threading.Thread(target=w.stop, kwargs={"timeout_s": WAIT_S})
        t0 = time.monotonic()
        stopping.start()
        assert until(w._stopping.is_set, WAIT_S)
        drafter.gate.set()
        stopping.join(WAIT_S + 1)
        assert not stopping.is_alive() and time.monotonic() - t0 < WAIT_S
        got = _closed(c.chan.stream.sock)
        types = []
        while got:
            hdr = wire.decode_header(got[: wire.HEADER.size])
            types.append(hdr.type)
            got = got[wire.HEADER.size + hdr.payload_len :]
        assert types in ([wire.DRAFTS, wire.BYE], [wire.BYE])
        assert until(lambda: set(threading.enumerate()) <= threads, WAIT_S), threading.enumerate()
    finally:
        drafter.gate.set()
        c.close()
        w.stop()


def test_a_newcomer_displaces_an_idle_hub_connection_at_the_cap():
    now = [0.0]
    w = Worker(Plugin(), "127.0.0.1", 0, window=16, max_connections=1, recent_s=1.0, sessions_clock=lambda: now[0])
    w.start()
    clients = []
    try:
        idle = connect(w, session=1, engine_id=1)
        clients.append(idle)
        now[0] = 0.5
        _served(idle)
        assert until(lambda: w._sessions.get(1).last_served == 0.5, WAIT_S)  # dated once its reply is out
        now[0] = 2.0  # idled past recent_s
        newcomer = connect(w, session=2, engine_id=2)
        clients.append(newcomer)
        hdr, _ = idle.chan.recv_frame(time.monotonic() + WAIT_S)
        assert hdr.type == wire.BYE and w.statistics().evicted == 1
        assert _closed(idle.chan.stream.sock) == b""
        _served(newcomer)
        assert until(lambda: w.served_now() == 1, WAIT_S)
    finally:
        for c in clients:
            c.close()
        w.stop()


class _Mixed(Plugin):
    """The plug-in taking batches of several sessions: the hub gathers whole calls of many rounds."""

    mixed_sessions = True


def test_a_call_of_more_rounds_than_its_entries_stays_within_its_arrays(monkeypatch):
    """Rounds with nothing to draft (empty) gathered into one call: more rounds than the
    call's entries (--max-batch-entries 1). Each round's receipt and deadline are written
    within the call's arrays (a guard past their end stays as it was) and every round is
    answered."""
    from remote_dspark.worker import hub as hub_module

    guards = []

    class Guarded(hub_module.CallArrays):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            for name, field in (("received", "received_ns"), ("_deadlines", "deadline_ns")):
                n = len(getattr(self, name))
                whole = np.full(n + 8, 0xA5A5A5A5, np.uint64)  # 8 guard words past the end
                setattr(self, name, whole[:n])
                setattr(self.c, field, whole.ctypes.data)
                guards.append(whole[n:])

    monkeypatch.setattr(hub_module, "CallArrays", Guarded)
    drafter = _Mixed()
    w = Worker(drafter, "127.0.0.1", 0, window=16, max_batch_entries=1).start()
    clients = []
    try:
        clients = [connect(w, session=s, engine_id=s) for s in (1, 2, 3)]
        drafter.gate.clear()
        first = clients[0]
        first.chan.send(wire.encode_round_entries(1, first.session, 0, _entries(1), bytes(4), 4))
        assert drafter.entered.wait(WAIT_S)  # the drafter busy: the next rounds are taken together
        for c in clients[1:]:
            c.chan.send(wire.encode_round_entries(1, c.session, 0, [], b"", 4))
        assert until(lambda: w._hub.waiting() == 2, WAIT_S)
        drafter.gate.set()
        for c in clients:
            c.chan.stream.sock.settimeout(WAIT_S)
            assert wire.decode_header(_frame(c.chan.stream.sock)[: wire.HEADER.size]).type == wire.DRAFTS
        assert guards and all((g == 0xA5A5A5A5).all() for g in guards)
    finally:
        drafter.gate.set()
        for c in clients:
            c.close()
        w.stop()


def test_a_fault_counting_a_whole_call_never_answers_its_rounds_twice(hub, plugin, caplog, monkeypatch):
    """The statistics of a call of whole rounds raise once its replies are sent: the fault
    is logged, and those rounds are not queued again as jobs (a second DRAFTS for a round
    answered, written while its connection reads its next frame)."""
    w = hub
    counted, calls, lib = w._hub.on_answered, [], w._hub.lib
    written = []  # the round id of each reply the hub writes, before it is written

    class Spy(_Spy):
        def hub_reply(self, state, conn, result):
            written.append(wire.decode_header(bytes(conn._obj.hdr)).round)
            return self._lib.hub_reply(state, conn, result)

        def hub_answer(self, state, ids, k, *rest):
            got = (ctypes.c_uint32 * k).from_address(ids)
            written.extend(wire.decode_header(bytes(w._hub._by_id[i].c.hdr)).round for i in got)
            return self._lib.hub_answer(state, ids, k, *rest)

    def faulty(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("counting failed on purpose")
        return counted(*args)

    c = connect(w, session=1, engine_id=1)
    monkeypatch.setattr(w._scheduler._fair, "alone", lambda *args: True)  # each round a whole call
    w._hub.on_answered, w._hub.lib = faulty, Spy(lib)
    try:
        with caplog.at_level(logging.ERROR, logger="remote_dspark.worker"):
            sock = c.chan.stream.sock
            sock.settimeout(WAIT_S)
            for rid in (1, 2, 3):
                sock.sendall(wire.encode_round_entries(rid, 1, 0, _entries(2), bytes(8), 4))
                hdr = wire.decode_header(_frame(sock)[: wire.HEADER.size])
                assert (hdr.type, hdr.round) == (wire.DRAFTS, rid)
        assert "counting failed on purpose" in caplog.text
        assert until(lambda: 3 in written, WAIT_S) and written == [1, 2, 3]
    finally:
        w._hub.on_answered, w._hub.lib = counted, lib
        c.close()


def test_a_connection_whose_round_failed_ends_though_its_peer_sent_the_next_round(hub, plugin, caplog):
    """A peer that sent its next ROUND before the reply to the last (the kernel keeps it,
    and a socket shut for reading still reads it): the call of its first round raises,
    and the connection ends there, its next round never served."""
    c = connect(hub, session=1, engine_id=1)
    plugin.fail = True
    try:
        with caplog.at_level(logging.ERROR, logger="remote_dspark.worker"):
            frames = [wire.encode_round_entries(rid, 1, 0, _entries(2), bytes(8), 4) for rid in (1, 2)]
            c.chan.stream.sock.sendall(b"".join(frames))
            try:  # (closed with its next round unread: a reset)
                got = _closed(c.chan.stream.sock)
            except ConnectionResetError:
                got = b""
            assert got == b""
        assert "failed on purpose" in caplog.text
    finally:
        c.close()


class _LateSource:
    """A hub stand-in whose rounds become ready only after the drafter thread's last look:
    taken without a wait once stop has poked it."""

    def __init__(self):
        self.poked, self.failed = threading.Event(), []

    def ready(self, timeout_s):
        if timeout_s == 0 and self.poked.is_set():
            ids, self.late = getattr(self, "late", np.array([3, 5], np.uint32)), np.zeros(0, np.uint32)
            return ids
        self.poked.wait(min(timeout_s, WAIT_S))
        return np.zeros(0, np.uint32)

    def poke(self):
        self.poked.set()

    def waiting(self):
        return 0

    def fail(self, ids, error):
        self.failed += [(int(i), str(error)) for i in ids]


def test_rounds_ready_after_the_drafter_threads_last_look_are_failed_at_stop():
    """A stop leaves no round of the hub unanswered: those that became ready after the
    drafter thread looked its last are failed (their connections end, with BYE), not left
    for the worker's stop to wait out its timeout."""
    from remote_dspark.worker.scheduler import Scheduler

    source = _LateSource()
    s = Scheduler(Plugin(), max_entries=64, max_tokens=1024, source=source).start()
    s.stop(WAIT_S)
    assert not s.alive()
    assert source.failed == [(3, "the worker is stopping"), (5, "the worker is stopping")]

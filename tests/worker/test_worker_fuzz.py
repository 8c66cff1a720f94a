"""The worker's server side, fuzzed: random bytes and mutated valid conversations sent to
a live worker on 127.0.0.1, its rounds served on the Markov lane and by the hub (a Markov
drafter of another type: every frame read and applied in C on the hub's I/O thread). The
worker never dies (nor its hub's threads), its connections, threads and pool stay within
its own bounds throughout, and it still serves an honest engine afterwards."""

from __future__ import annotations

import socket
import threading

import pytest
from helpers import until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import MarkovModel
from remote_dspark.transport import parse_endpoint
from remote_dspark.transport.client import DraftClient
from remote_dspark.worker import Worker

MODEL = MarkovModel.from_tokens([1, 2, 3, 4, 5] * 20, order=1, top=2)
MAX_CONNECTIONS, MAX_PENDING = 4, 8
# The last test serves an honest engine on the worker the fuzz hammered: under xdist
# (--dist loadgroup) the module's tests stay on one worker, in file order.
pytestmark = pytest.mark.xdist_group("worker_fuzz")


class HubMarkov(MarkovDrafter):
    """The same drafter, not the lane's (its exact type): its connections are the hub's."""


@pytest.fixture(scope="module", params=["lane", "hub"])
def worker(request):
    w = Worker(
        (MarkovDrafter if request.param == "lane" else HubMarkov)(MODEL),
        "127.0.0.1",
        0,
        window=8,
        max_slots=16,
        max_row_bytes=64,
        max_connections=MAX_CONNECTIONS,
        max_engines=2,
        max_pending=MAX_PENDING,
        hello_timeout_s=0.5,
        frame_timeout_s=0.5,
    ).start()
    assert (w._lanes is None) == (request.param == "hub") and w._hub is not None
    yield w
    w.stop()


def _hello_frame(w, engine_id: int, max_slots: int, row_bytes: int, session: int) -> bytes:
    return wire.encode_hello(
        wire.Hello(w.drafter.drafter_identity, w.drafter.markov_identity, engine_id, max_slots, row_bytes, 3), session
    )


ENTRY = st.tuples(
    st.integers(0, 8), st.integers(0, 4), st.integers(0, 3), st.lists(st.integers(-1, 9), max_size=6), st.booleans()
)


@st.composite
def conversations(draw) -> list[bytes]:
    """What one hostile peer sends: random bytes, or a HELLO and ROUNDs (valid as drawn,
    then mutated: bytes flipped, lengths rewritten, cut short), in chunks."""
    if draw(st.booleans()):
        return [draw(st.binary(min_size=1, max_size=512)) for _ in range(draw(st.integers(1, 3)))]
    session = draw(st.integers(0, 2**64 - 1))
    max_slots, row_bytes = draw(st.integers(1, 32)), draw(st.integers(0, 96))
    parts = [("hello", draw(st.integers(0, 5)), max_slots, row_bytes, session)]
    for rid in range(draw(st.integers(0, 3))):
        entries = draw(st.lists(ENTRY, max_size=6, unique_by=lambda e: e[0]))
        parts.append(("round", rid, entries, row_bytes))
    mutations = draw(
        st.lists(
            st.tuples(st.sampled_from(["flip", "length", "cut", "none"]), st.integers(0, 10**6), st.integers(0, 255)),
            max_size=4,
        )
    )
    return [("plan", parts, mutations)]


def _realise(w, conv) -> list[bytes]:
    if not conv or not isinstance(conv[0], tuple):
        return conv
    _, parts, mutations = conv[0]
    frames = []
    for p in parts:
        if p[0] == "hello":
            frames.append(bytearray(_hello_frame(w, *p[1:])))
        else:
            _, rid, entries, row_bytes = p
            es = [
                wire.Entry(slot, n_out, pos, tuple(t for t in toks if t >= 0), new)
                for slot, n_out, pos, toks, new in entries
            ]
            frames.append(bytearray(wire.encode_round_entries(rid, 0, 100, es, bytes(len(es) * row_bytes), row_bytes)))
    for kind, at, value in mutations:
        f = frames[at % len(frames)]
        if kind == "flip" and f:
            f[at % len(f)] = value
        elif kind == "length" and len(f) >= wire.HEADER.size:
            fields = wire.HEADER.unpack_from(f)
            wire.HEADER.pack_into(f, 0, *fields[:3], value * 4099 + at, *fields[4:])
        elif kind == "cut" and f:
            del f[at % len(f) :]
    return [bytes(f) for f in frames]


def _within_bounds(w) -> bool:
    adm = w.admission()
    hub = len(w._hub.connections()) <= MAX_CONNECTIONS and w._hub.alive() and w._scheduler.alive()
    return len(w._conns) <= MAX_CONNECTIONS and adm.pending <= MAX_PENDING and len(w._sessions) <= 2 and hub


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(convs=st.lists(conversations(), min_size=1, max_size=4))
def test_hostile_bytes_never_kill_the_worker_nor_grow_it(worker, convs):
    socks = []
    try:
        for conv in convs:  # a few peers at once, each its own conversation
            s = socket.create_connection(("127.0.0.1", worker.port), timeout=2)
            socks.append(s)
            for chunk in _realise(worker, conv):
                try:
                    s.sendall(chunk)
                except OSError:
                    break
        for s in socks:  # read what comes back, briefly
            s.settimeout(0.05)
            try:
                while s.recv(65536):
                    pass
            except OSError:
                pass
            assert _within_bounds(worker)
    finally:
        for s in socks:
            s.close()
    assert worker._acceptor.is_alive()


def test_after_the_fuzz_the_worker_still_serves_an_honest_engine(worker):
    # Runs after the fuzz in file order; on its own it is a plain smoke test.
    assert worker._acceptor.is_alive()
    assert until(lambda: not worker._conns and worker.admission().pending == 0, timeout=10)
    assert until(lambda: not worker._hub.connections(), timeout=10)
    assert until(lambda: sum(t.name.startswith("worker-conn") for t in threading.enumerate()) == 0, timeout=10)
    hello = wire.Hello(worker.drafter.drafter_identity, worker.drafter.markov_identity, 7, 4, 4, 3)
    c = DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{worker.port}"), hello, 99, 2.0)
    try:
        d = c.round(1, [wire.encode_round_entries(1, 99, 1000, [wire.Entry(0, 2, 0, (1,), True)], bytes(4), 4)], 2000)
        assert d.row(0) == [2, 3]
    finally:
        c.close()

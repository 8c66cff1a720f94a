"""The reference worker over loopback sockets: HELLO checks, windows per session and
slot, drafts and margins, bad frames (one connection dropped, the rest served), stop.
The round logic against a per-entry reference, property-tested: test_worker_rounds.py."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import readline_within, until

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.markov import MarkovModel, builtin_model
from remote_dspark.transport import Disconnected, parse_endpoint
from remote_dspark.transport.client import DraftClient, Refused
from remote_dspark.worker import Worker
from remote_dspark.worker.drafters import load_drafter
from remote_dspark.worker.limits import parse_listen

# A tiny deterministic model: 1 -> 2 -> 3 -> 4 -> 5 -> 1 ..., with 1 -> 9 as a runner-up.
MODEL = MarkovModel.from_tokens([1, 2, 3, 4, 5] * 20 + [1, 9], order=1, top=2)


@pytest.fixture
def worker():
    w = Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, window=8).start()
    yield w
    w.stop()


def hello(w, **kw):
    fields = dict(
        drafter_identity=w.drafter.drafter_identity,
        markov_identity=w.drafter.markov_identity,
        engine_id=42,
        max_slots=8,
        row_bytes=4,
        num_spec=3,
        want_margin=True,
    )
    fields.update(kw)
    return wire.Hello(**fields)


def connect(w, session=1, **kw):
    return DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{w.port}"), hello(w, **kw), session, 2.0)


def do_round(c, rid, entries, rows=None):
    rows = bytes(4 * len(entries)) if rows is None else rows
    return c.round(rid, [wire.encode_round_entries(rid, c.session, 1000, entries, rows, 4)], 1000)


def test_client_gets_drafts_and_margins(worker):
    c = connect(worker)
    try:
        d = do_round(c, 1, [wire.Entry(0, 3, 0, (4, 5, 1), new_gen=True), wire.Entry(5, 2, 0, (2,), new_gen=True)])
        assert d.round_id == 1 and list(d.slots) == [0, 5]
        assert d.row(0) == [2, 3, 4] and d.row(1) == [3, 4]
        assert d.margins is not None and d.margins[0] == pytest.approx((20 - 1) / 21)
        # Tokens accepted since then extend the slot's window at the next position.
        d = do_round(c, 2, [wire.Entry(0, 3, 3, (2, 3))])
        assert d.row(0) == [4, 5, 1] and list(d.statuses) == [wire.STATUS_OK]
    finally:
        c.close()


def test_gap_in_positions_or_unknown_slot_asks_for_resync(worker):
    c = connect(worker)
    try:
        do_round(c, 1, [wire.Entry(0, 3, 0, (1, 2), new_gen=True)])
        d = do_round(c, 2, [wire.Entry(0, 3, 5, (3,)), wire.Entry(1, 3, 0, (3,))])
        assert list(d.statuses) == [wire.STATUS_RESYNC] * 2 and list(d.counts) == [0, 0]
        # NEW_GEN rebuilds the slot.
        d = do_round(c, 3, [wire.Entry(0, 3, 0, (7, 3), new_gen=True)])
        assert d.row(0) == [4, 5, 1]
    finally:
        c.close()


def test_new_session_of_same_engine_drops_old_windows(worker):
    first = connect(worker, session=1)
    do_round(first, 1, [wire.Entry(0, 3, 0, (1, 2), new_gen=True)])
    first.close()
    second = connect(worker, session=2)  # the respawned proxy of engine 42
    try:
        d = do_round(second, 1, [wire.Entry(0, 3, 2, (3,))])
        assert list(d.statuses) == [wire.STATUS_RESYNC]
        other = connect(worker, session=3, engine_id=43)  # another engine: its own windows
        do_round(other, 1, [wire.Entry(0, 3, 0, (1,), new_gen=True)])
        other.close()
        do_round(second, 2, [wire.Entry(0, 3, 0, (1,), new_gen=True)])
        assert do_round(second, 3, [wire.Entry(0, 3, 1, (2,))]).row(0) == [3, 4, 5]
    finally:
        second.close()


@pytest.mark.parametrize(
    "field,code", [("drafter_identity", wire.REFUSE_DRAFTER), ("markov_identity", wire.REFUSE_MARKOV)]
)
def test_wrong_identity_is_refused_with_reason(worker, field, code):
    with pytest.raises(Refused) as e:
        connect(worker, **{field: b"\x01" * 32})
    assert e.value.code == code
    assert ("01" * 32) in e.value.reason and getattr(worker.drafter, field).hex() in e.value.reason
    assert worker.stats.refused == 1


def test_max_slots_over_worker_limit_refused():
    with Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, max_slots=4) as w:
        with pytest.raises(Refused, match="max_slots 8 over"):
            connect(w, max_slots=8)


def raw_connection(w):
    return socket.create_connection(("127.0.0.1", w.port), timeout=5)


def closed_by_peer(s: socket.socket) -> bool:
    """The worker closed this socket (EOF, or a reset when our bytes were unread)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_random_bytes_close_that_connection_and_the_worker_serves_on(worker):
    healthy = connect(worker, session=10)
    garbage = raw_connection(worker)
    try:
        garbage.sendall(os.urandom(4096))
        assert closed_by_peer(garbage)
        assert until(lambda: worker.stats.bad_frames == 1)
        second = connect(worker, session=11, engine_id=7)  # a second client is served
        assert do_round(second, 1, [wire.Entry(0, 2, 0, (1,), new_gen=True)]).row(0) == [2, 3]
        second.close()
        assert do_round(healthy, 1, [wire.Entry(0, 1, 0, (4,), new_gen=True)]).row(0) == [5]
    finally:
        garbage.close()
        healthy.close()


@pytest.mark.parametrize(
    "frame",
    [
        wire.encode_round_entries(1, 1, 50, [wire.Entry(0, 3, 0, (1,), True)], bytes(4), 4),  # before HELLO
        wire.encode_header(wire.ROUND, wire.MAX_PAYLOAD + 1),  # oversized
    ],
)
def test_bad_first_frames_drop_the_connection(worker, frame):
    s = raw_connection(worker)
    try:
        s.sendall(frame)
        assert closed_by_peer(s)
        assert until(lambda: worker.stats.bad_frames == 1)
    finally:
        s.close()


@pytest.mark.parametrize(
    "entries",
    [
        [wire.Entry(5, 3, 0, (1,), new_gen=True)],  # slot >= max_slots
        [wire.Entry(1, 3, 0, (1,), new_gen=True), wire.Entry(1, 3, 0, (2,), new_gen=True)],  # slot twice
    ],
)
def test_bad_slots_drop_that_connection_and_the_worker_serves_on(worker, entries):
    healthy = connect(worker, session=10, engine_id=7, max_slots=2)
    c = connect(worker, max_slots=2)
    try:
        with pytest.raises(Disconnected):
            do_round(c, 1, entries)
        assert until(lambda: worker.stats.bad_frames == 1)
        assert do_round(healthy, 1, [wire.Entry(1, 2, 0, (3,), new_gen=True)]).row(0) == [4, 5]
    finally:
        c.close()
        healthy.close()


def test_margins_only_when_asked_and_n_out_zero(worker):
    c = connect(worker, want_margin=False)
    try:
        d = do_round(c, 1, [wire.Entry(0, 0, 0, (1,), new_gen=True), wire.Entry(1, 2, 0, (4,), new_gen=True)])
        assert d.margins is None and d.width == 2 and list(d.counts) == [0, 2]
        assert list(d.tokens) == [0, 0, 5, 1]
        d = do_round(c, 2, [wire.Entry(0, 0, 1, (2,))])  # nothing wanted: width 0
        assert d.width == 0 and list(d.counts) == [0] and list(d.statuses) == [wire.STATUS_OK]
        assert do_round(c, 3, []).slots.tolist() == []  # an empty round
    finally:
        c.close()


def test_width_is_capped_by_num_spec_and_windows_wrap(worker):
    c = connect(worker, num_spec=2)  # the worker's window is 8 tokens
    try:
        d = do_round(c, 1, [wire.Entry(3, 5, 100, tuple(range(1, 6)) * 3, new_gen=True)])
        assert d.width == 2 and d.row(0) == [1, 2]  # window ...1 2 3 4 5 -> 1 2
        d = do_round(c, 2, [wire.Entry(3, 2, 115, (1, 2, 3, 4, 5, 1, 2, 3, 4, 9))])
        assert d.row(0) == []  # 9 is never followed: no draft, still OK
        assert list(d.statuses) == [wire.STATUS_OK]
        d = do_round(c, 3, [wire.Entry(3, 2, 125, (1,))])
        assert d.row(0) == [2, 3]
    finally:
        c.close()


def test_batched_plugin_drafter_gets_contexts_and_rows(tmp_path, monkeypatch):
    (tmp_path / "batchplugin.py").write_text(
        "import numpy as np\n"
        "from remote_dspark.drafter import DraftResult\n"
        "class B:\n"
        "    drafter_identity = b'd' * 32\n"
        "    markov_identity = b'm' * 32\n"
        "    def draft_batch(self, batch):\n"
        "        # draft: the context's length, then the row's first byte, every step\n"
        "        n = len(batch)\n"
        "        lens = np.diff(batch.offsets).astype(np.int32)\n"
        "        tokens = np.repeat(lens[:, None] * 100 + batch.rows[:, :1], batch.width, axis=1)\n"
        "        return DraftResult(tokens.astype(np.int32), batch.n_out.copy(),\n"
        "                           np.full((n, batch.width), 0.25, np.float32))\n"
        "def make():\n"
        "    return B()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with Worker(load_drafter("batchplugin:make"), "127.0.0.1", 0, window=3) as w:
        c = connect(w)
        try:
            d = do_round(
                c,
                1,
                [wire.Entry(0, 2, 0, (1, 2, 3, 4), True), wire.Entry(4, 1, 0, (), True)],
                rows=bytes([7, 0, 0, 0, 9, 0, 0, 0]),
            )
            assert d.row(0) == [307, 307] and d.row(1) == [9]
            assert list(d.margins) == [0.25, 0.25, 0.25, 0.0]
        finally:
            c.close()


def test_version_mismatch_gets_a_refusal_then_close(worker):
    s = raw_connection(worker)
    try:
        frame = bytearray(wire.encode_hello(hello(worker), 1))
        frame[4:6] = (99).to_bytes(2, "little")
        s.sendall(frame)
        data = b""
        while len(data) < wire.HEADER.size:
            chunk = s.recv(4096)
            assert chunk
            data += chunk
        hdr = wire.decode_header(data[: wire.HEADER.size])
        assert hdr.type == wire.HELLO_ACK
    finally:
        s.close()


def test_stop_says_bye_to_open_connections():
    w = Worker(MarkovDrafter(MODEL), "127.0.0.1", 0).start()
    c = connect(w)
    w.stop()
    hdr, _ = c.chan.recv_frame(time.monotonic() + 2)
    assert hdr.type == wire.BYE
    c.chan.close()


def test_connection_cap():
    with Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, max_connections=1) as w:
        c = connect(w)
        try:
            with pytest.raises(Refused, match="^busy: "):  # over the cap: a HELLO is refused busy
                connect(w, session=2, engine_id=7)
            assert do_round(c, 1, [wire.Entry(0, 1, 0, (1,), True)]).row(0) == [2]
        finally:
            c.close()


def test_load_drafter_plugin_and_errors(tmp_path, monkeypatch):
    (tmp_path / "mydrafter.py").write_text(
        "class D:\n"
        "    drafter_identity = b'd' * 32\n"
        "    markov_identity = b'm' * 32\n"
        "    def draft(self, context, n_out, row):\n"
        "        return [len(row)] * n_out, [0.5] * n_out\n"
        "def make():\n"
        "    return D()\n"
        "def bad():\n"
        "    return object()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    d = load_drafter("mydrafter:make")
    with Worker(d, "127.0.0.1", 0) as w:
        c = connect(w)
        assert do_round(c, 1, [wire.Entry(0, 2, 0, (1,), True)]).row(0) == [4, 4]  # row_bytes=4
        c.close()
    for spec, why in [
        ("mydrafter", "MODULE:FACTORY"),
        ("nosuchmod:make", "nosuchmod"),
        ("mydrafter:nothing", "nothing"),
        ("mydrafter:bad", "drafter_identity must be 32 bytes"),
    ]:
        with pytest.raises(ValueError, match=why):
            load_drafter(spec)
    with pytest.raises(ValueError, match="--markov"):
        load_drafter(None, str(tmp_path / "missing.bin"))


@pytest.mark.parametrize("raw", ["127.0.0.1", "127.0.0.1:x", ":80", "h:70000"])
def test_parse_listen_errors(raw):
    with pytest.raises(ValueError, match="--listen"):
        parse_listen(raw)


def test_worker_command_prints_identities_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote_dspark", "worker", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [readline_within(proc.stdout, 30, "the worker's address and identities") for _ in range(3)]
        assert lines[0].startswith("remote-dspark worker listening on tcp://127.0.0.1:")
        model = builtin_model()
        assert lines[2].strip() == f"VLLM_DSPARK_REMOTE_MARKOV_IDENTITY={model.identity.hex()}"
        assert lines[1].strip().startswith("VLLM_DSPARK_REMOTE_IDENTITY=")
        port = int(lines[0].rsplit(":", 1)[1])
        ident = bytes.fromhex(lines[1].split("=")[1].strip())
        c = DraftClient.connect(
            parse_endpoint(f"tcp://127.0.0.1:{port}"), wire.Hello(ident, model.identity, 1, 4, 0, 2), 1, 5.0
        )
        proc.send_signal(signal.SIGTERM)
        hdr, _ = c.chan.recv_frame(time.monotonic() + 5)
        assert hdr.type == wire.BYE
        c.chan.close()
        assert proc.wait(timeout=10) == 0
        assert "worker stopped: 1 connections" in proc.communicate(timeout=10)[1]
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def test_new_session_drops_the_old_windows_even_while_the_old_connection_lives(worker):
    old = connect(worker, session=1)
    try:
        do_round(old, 1, [wire.Entry(0, 3, 0, (1, 2), new_gen=True)])
        new = connect(worker, session=2)  # same engine, a respawned proxy
        d = do_round(old, 2, [wire.Entry(0, 3, 2, (3,))])
        assert list(d.statuses) == [wire.STATUS_RESYNC]
        new.close()
    finally:
        old.close()


PLUGIN = """
import numpy as np
from remote_dspark.drafter import DraftResult
class Batched:
    drafter_identity = b"d" * 32
    markov_identity = b"m" * 32
    def draft_batch(self, batch):
        return DraftResult(np.full((len(batch), batch.width), 5, np.int32), batch.n_out.copy())
class PerEntry:
    drafter_identity = b"d" * 32
    markov_identity = b"m" * 32
    def draft(self, context, n_out, row):
        return [5] * n_out, []
"""


@pytest.mark.parametrize("factory", ["Batched", "PerEntry"])
def test_worker_command_serves_either_kind_of_plugin_drafter(tmp_path, factory):
    (tmp_path / "cliplugin.py").write_text(PLUGIN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "remote_dspark",
            "worker",
            "--listen",
            "127.0.0.1:0",
            "--drafter",
            f"cliplugin:{factory}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        lines = [readline_within(proc.stdout, 30, "the worker's address and identities") for _ in range(3)]
        assert lines[1].strip() == f"VLLM_DSPARK_REMOTE_IDENTITY={'64' * 32}"
        port = int(lines[0].rsplit(":", 1)[1])
        c = DraftClient.connect(
            parse_endpoint(f"tcp://127.0.0.1:{port}"),
            wire.Hello(b"d" * 32, b"m" * 32, 1, 4, 0, 3, want_margin=True),
            1,
            5.0,
        )
        d = c.round(1, [wire.encode_round_entries(1, 1, 1000, [wire.Entry(2, 2, 0, (1,), True)], b"", 0)], 5000)
        assert d.row(0) == [5, 5]
        # Margins were asked for: a drafter without any (either kind) sends zeros, since
        # the engine refuses a reply whose margins are not what its HELLO asked for.
        assert list(d.margins) == [0.0, 0.0]
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()

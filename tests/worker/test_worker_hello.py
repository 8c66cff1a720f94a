"""Authentication at HELLO against a real worker (``--key-file``): the right key is
served; no key and a wrong key are refused in both directions; a recorded or reflected
proof never passes; a refusal is counted ``auth`` at the door, before the connection
gets a thread; a loose key file stops the worker from starting. Loopback only; every
wait bounded; every worker stopped by its test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest
from helpers import COUNTING, connect, do_round, hello, recv_exactly, until

from remote_dspark import wire
from remote_dspark.cli.main import main as cli_main
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.transport import parse_endpoint
from remote_dspark.transport.auth import Key
from remote_dspark.transport.client import AuthFailed, DraftClient, Refused
from remote_dspark.worker import Worker

KEY = Key("worker-key", b"the worker's and engine's key 32")
OTHER = Key("other-key", b"another key, just as long, 32 by")
NEW = [wire.Entry(0, 3, 0, (1,), True)]


@pytest.fixture
def keyed():
    w = Worker(MarkovDrafter(COUNTING), "127.0.0.1", 0, key=KEY).start()
    yield w
    w.stop()


@pytest.fixture
def keyless():
    w = Worker(MarkovDrafter(COUNTING), "127.0.0.1", 0).start()
    yield w
    w.stop()


def recv_frame(sock: socket.socket) -> tuple[wire.Header, bytes]:
    """One whole frame from a blocking socket (its timeout set)."""
    hdr = wire.decode_header(recv_exactly(sock, wire.HEADER.size))
    return hdr, recv_exactly(sock, hdr.payload_len)


class RawEngine:
    """An engine side driven by hand: HELLO with a nonce, the worker's AUTH read, then
    whatever AUTH the test chooses to send."""

    def __init__(self, w: Worker, session: int = 7, nonce: bytes | None = None):
        self.sock = socket.create_connection(("127.0.0.1", w.port), timeout=5)
        self.session = session
        frame = wire.encode_hello(hello(w, nonce=nonce or wire.auth.new_nonce()), session)
        self.hello_payload = frame[wire.HEADER.size :]
        self.sock.sendall(frame)
        hdr, payload = recv_frame(self.sock)
        assert (hdr.type, hdr.session) == (wire.AUTH, session)
        self.worker_nonce, self.worker_proof = wire.auth.decode_challenge(payload)

    def answer(self, proof: bytes) -> wire.HelloAck:
        """Send ``proof`` as the engine's; the worker's HELLO_ACK."""
        self.sock.sendall(wire.auth.encode_answer(self.session, proof))
        hdr, payload = recv_frame(self.sock)
        assert hdr.type == wire.HELLO_ACK
        return wire.decode_hello_ack(payload)

    def engine_proof(self, key: Key) -> bytes:
        return wire.auth.proof(key.secret, wire.auth.ENGINE, self.session, self.hello_payload, self.worker_nonce)

    def close(self):
        self.sock.close()


def refused_at_the_door(w: Worker, n: int) -> bool:
    """``n`` refusals counted auth, and no connection was given a thread for them."""
    return until(lambda: w.statistics().refusals["auth"] == n, timeout=5) and w.statistics().connections == 0


# --------------------------------------------------------------------------- served


def test_the_right_key_is_served(keyed):
    c = connect(keyed, key=KEY)
    try:
        d = do_round(c, 1, NEW)
        assert d.row(0) == [2, 3, 4]
    finally:
        c.close()
    assert keyed.statistics().refusals["auth"] == 0 and keyed.statistics().connections == 1


def test_the_worker_proves_it_holds_the_key_over_the_engines_nonce(keyed):
    raw = RawEngine(keyed)
    try:
        assert wire.auth.proof_holds(
            KEY.secret, wire.auth.WORKER, raw.session, raw.hello_payload, raw.worker_nonce, raw.worker_proof
        )
        assert raw.answer(raw.engine_proof(KEY)).accepted
    finally:
        raw.close()


# --------------------------------------------------------------------------- the worker refuses the engine


def test_an_engine_without_the_key_is_refused_auth_before_a_thread(keyed):
    with pytest.raises(Refused) as e:
        connect(keyed)  # no key: a HELLO without a nonce
    assert e.value.code == wire.REFUSE_AUTH and "VLLM_DSPARK_REMOTE_KEY_FILE" in e.value.reason
    assert not isinstance(e.value, AuthFailed)  # the worker said no
    assert refused_at_the_door(keyed, 1)
    assert keyed.admission().handed == 0 and keyed.served_now() == 0


def test_an_engine_with_another_key_is_refused_auth_before_a_thread(keyed):
    raw = RawEngine(keyed)
    try:
        ack = raw.answer(raw.engine_proof(OTHER))
        assert ack.code == wire.REFUSE_AUTH and "proof does not hold" in ack.reason
    finally:
        raw.close()
    assert refused_at_the_door(keyed, 1) and keyed.admission().handed == 0


def test_a_recorded_engine_proof_does_not_replay_on_a_new_connection(keyed):
    """A listener that saw a whole authenticated HELLO (the engine's nonce and proof)
    replays both on a connection of its own: the worker's nonce there is fresh."""
    first = RawEngine(keyed)
    recorded = first.engine_proof(KEY)
    assert first.answer(recorded).accepted
    first.close()
    replay = RawEngine(keyed, nonce=first.hello_payload[-32:])
    try:
        assert replay.worker_nonce != first.worker_nonce
        assert replay.answer(recorded).code == wire.REFUSE_AUTH
    finally:
        replay.close()
    assert until(lambda: keyed.statistics().refusals["auth"] == 1, timeout=5)


def test_the_workers_own_proof_reflected_back_is_refused(keyed):
    raw = RawEngine(keyed)
    try:
        assert raw.answer(raw.worker_proof).code == wire.REFUSE_AUTH
    finally:
        raw.close()
    assert refused_at_the_door(keyed, 1)


def test_another_frame_where_the_engines_auth_belongs_is_a_bad_frame(keyed):
    raw = RawEngine(keyed)
    try:
        raw.sock.sendall(wire.encode_bye(raw.session))
        assert raw.sock.recv(1) == b""  # dropped, no answer
    finally:
        raw.close()
    assert until(lambda: keyed.statistics().bad_frames == 1, timeout=5)
    assert keyed.statistics().connections == 0


def test_peers_without_the_key_cannot_hold_the_served_connections():
    """Without a key, peers that know the identities (they are printed at start) can
    take every served connection and the honest engine is told busy; with one they
    are refused at the door and hold nothing."""
    w = Worker(MarkovDrafter(COUNTING), "127.0.0.1", 0, key=KEY, max_connections=2).start()
    try:
        for session in range(1, 6):
            with pytest.raises(Refused) as e:
                connect(w, session=session, engine_id=100 + session)
            assert e.value.code == wire.REFUSE_AUTH
        assert w.served_now() == 0
        c = connect(w, session=9, key=KEY)
        assert do_round(c, 1, NEW).row(0) == [2, 3, 4]
        c.close()
    finally:
        w.stop()


def test_a_flood_of_silent_sockets_never_displaces_a_connection_mid_auth():
    """The pre-HELLO pool full of silent sockets and one connection mid-AUTH (its HELLO
    whole, the worker's AUTH received): silent newcomers push out silent ones only, and
    the engine's answer, a round trip later, is served."""
    w = Worker(MarkovDrafter(COUNTING), "127.0.0.1", 0, key=KEY, max_pending=4, hello_timeout_s=30).start()
    silent = []
    engine = None
    try:
        for _ in range(3):
            silent.append(socket.create_connection(("127.0.0.1", w.port), timeout=5))
            n = len(silent)
            assert until(lambda n=n: w.admission().accepted == n, timeout=5)
        engine = RawEngine(w)  # mid-AUTH now, the pool full
        for _ in range(6):  # twice the rest of the pool
            silent.append(socket.create_connection(("127.0.0.1", w.port), timeout=5))
            n = len(silent) + 1
            assert until(lambda n=n: w.admission().accepted == n, timeout=5)
        assert until(lambda: w.statistics().displaced == 6, timeout=5) and w.admission().pending == 4
        ack = engine.answer(engine.engine_proof(KEY))
        assert ack.code == wire.ACCEPT and w.statistics().connections == 1
    finally:
        for s in silent:
            s.close()
        if engine is not None:
            engine.close()
        w.stop()


def test_stalled_hellos_mid_auth_never_push_out_a_newcomer():
    """Anyone can reach mid-AUTH (a HELLO costs no key). Four connections that did and then
    stall fill the pool; an honest engine connects, then another stalled one: the oldest
    stalled connection goes, not the newcomer, whose HELLO is read and served."""
    w = Worker(MarkovDrafter(COUNTING), "127.0.0.1", 0, key=KEY, max_pending=4, hello_timeout_s=30).start()
    stalled, honest = [], None
    try:
        for i in range(4):
            stalled.append(RawEngine(w, session=100 + i))
        honest = socket.create_connection(("127.0.0.1", w.port), timeout=5)
        assert until(lambda: w.admission().accepted == 5, timeout=5)
        stalled.append(RawEngine(w, session=200))
        assert until(lambda: w.statistics().displaced == 2, timeout=5)
        for s in stalled[:2]:  # the two oldest stalled ones were dropped
            s.sock.settimeout(5)
            assert s.sock.recv(1) == b""
        frame = wire.encode_hello(hello(w, nonce=wire.auth.new_nonce()), 9)
        honest.sendall(frame)
        hdr, _ = recv_frame(honest)
        assert hdr.type == wire.AUTH  # the newcomer is still there: the worker answers its HELLO
    finally:
        for s in stalled:
            s.close()
        if honest is not None:
            honest.close()
        w.stop()


# --------------------------------------------------------------------------- the engine refuses the worker


def test_an_engine_with_the_key_refuses_a_worker_without_it(keyless):
    with pytest.raises(AuthFailed, match="accepted without proving it holds the key"):
        connect(keyless, key=KEY)


def test_an_engine_refuses_a_worker_with_another_key(keyed):
    with pytest.raises(AuthFailed, match="proof does not hold"):
        connect(keyed, key=OTHER)


def test_a_worker_without_the_key_cannot_impersonate_one_that_has_it():
    """An impostor answers the engine's HELLO with an AUTH it made up (any nonce, any
    proof): the engine refuses it and sends nothing computed under its key."""
    seen: list[bytes] = []
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(5)

    def impostor():
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            hdr, _ = recv_frame(conn)
            conn.sendall(wire.auth.encode_challenge(hdr.session, os.urandom(32), os.urandom(32)))
            while chunk := conn.recv(4096):
                seen.append(chunk)

    t = threading.Thread(target=impostor)
    t.start()
    try:
        ep = parse_endpoint(f"tcp://127.0.0.1:{server.getsockname()[1]}")
        drafter = MarkovDrafter(COUNTING)
        h = wire.Hello(drafter.drafter_identity, drafter.markov_identity, 1, 8, 4, 3)
        with pytest.raises(AuthFailed, match="proof does not hold"):
            DraftClient.connect(ep, h, 3, 2.0, key=KEY)
    finally:
        t.join(10)
        server.close()
    assert not t.is_alive() and seen == []  # closed without an AUTH of the engine's


# --------------------------------------------------------------------------- key files


def test_a_loose_key_file_stops_the_worker_naming_the_flag(tmp_path, capsys):
    path = tmp_path / "key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o640)
    assert cli_main(["worker", "--listen", "127.0.0.1:0", "--key-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--key-file" in err and "mode 0640" in err and "chmod 600" in err


def test_a_directory_as_key_file_stops_the_worker_with_exit_2_and_the_reason(tmp_path):
    """The installed command, in its own process: a clear line naming the flag on stderr,
    no traceback, exit 2 (bad input), before any model loads."""
    (tmp_path / "keys").mkdir(mode=0o700)
    argv = [sys.executable, "-m", "remote_dspark", "worker", "--listen", "127.0.0.1:0", "--key-file"]
    proc = subprocess.Popen([*argv, str(tmp_path / "keys")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # a no-op once it has exited
        proc.wait(10)
    assert proc.returncode == 2, err
    assert "--key-file=" in err and "is a directory, not a regular file" in err
    assert "Traceback" not in err and "listening" not in out

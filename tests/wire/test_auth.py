"""Authentication (wire.auth), the contract's part (protocol 5): the AUTH frames and the
two proofs. A HELLO with or without the engine's nonce: test_hello.py."""

from __future__ import annotations

import pytest

from remote_dspark import wire
from remote_dspark.wire import auth

IDS = (b"\x11" * 32, b"\x22" * 32)
KEY = b"k" * 32


def test_the_auth_frames_round_trip_and_other_lengths_are_refused():
    nonce, proof = bytes(range(32)), bytes(range(32, 64))
    frame = auth.encode_challenge(5, nonce, proof)
    hdr = wire.decode_header(frame[: wire.HEADER.size])
    assert (hdr.type, hdr.session, hdr.payload_len) == (wire.AUTH, 5, 64)
    assert auth.decode_challenge(frame[wire.HEADER.size :]) == (nonce, proof)
    answer = auth.encode_answer(5, proof)
    assert wire.decode_header(answer[: wire.HEADER.size]).payload_len == 32
    assert auth.decode_answer(answer[wire.HEADER.size :]) == proof
    with pytest.raises(wire.ProtocolError, match="AUTH from the worker of 32 bytes"):
        auth.decode_challenge(proof)
    with pytest.raises(wire.ProtocolError, match="AUTH from the engine of 64 bytes"):
        auth.decode_answer(nonce + proof)


def _transcript():
    hello_payload = wire.encode_hello(wire.Hello(*IDS, 7, 8, 4, 3, nonce=b"e" * 32), 9)[wire.HEADER.size :]
    return 9, hello_payload, b"w" * 32


def test_the_roles_proofs_differ_so_neither_reflects_as_the_other():
    session, hello_payload, nonce = _transcript()
    worker = auth.proof(KEY, auth.WORKER, session, hello_payload, nonce)
    engine = auth.proof(KEY, auth.ENGINE, session, hello_payload, nonce)
    assert worker != engine and len(worker) == len(engine) == wire.PROOF_BYTES
    assert auth.proof_holds(KEY, auth.WORKER, session, hello_payload, nonce, worker)
    assert not auth.proof_holds(KEY, auth.ENGINE, session, hello_payload, nonce, worker)
    assert not auth.proof_holds(KEY, auth.WORKER, session, hello_payload, nonce, engine)


def test_a_proof_covers_the_key_the_session_every_hello_byte_and_both_nonces():
    """Change any input (another key, session, engine nonce, HELLO term, worker nonce):
    the proof made over the original no longer holds, so none replays on a new
    connection, whose nonces are fresh."""
    session, hello_payload, nonce = _transcript()
    proof = auth.proof(KEY, auth.ENGINE, session, hello_payload, nonce)
    other_engine_nonce = hello_payload[:-32] + b"f" * 32
    other_engine_id = hello_payload[:64] + b"\x08" + hello_payload[65:]
    for args in (
        (b"K" * 32, session, hello_payload, nonce),
        (KEY, session + 1, hello_payload, nonce),
        (KEY, session, other_engine_nonce, nonce),
        (KEY, session, other_engine_id, nonce),
        (KEY, session, hello_payload, b"x" * 32),
    ):
        key, *rest = args
        assert not auth.proof_holds(key, auth.ENGINE, *rest, proof), args

"""Authentication at HELLO, the contract's part (protocol 5): a HELLO with or without the
engine's nonce, the AUTH frames, and the two proofs (wire.auth)."""

from __future__ import annotations

import struct

import pytest

from remote_dspark import wire
from remote_dspark.wire import auth

IDS = (b"\x11" * 32, b"\x22" * 32)
HELLO = wire.Hello(*IDS, engine_id=7, max_slots=8, row_bytes=4, num_spec=3, vocab_size=100)
KEY = b"k" * 32


def test_the_protocol_is_version_6_and_a_version_5_peer_is_refused():
    assert wire.PROTOCOL_VERSION == 6  # 6: sampled drafts (tests/wire/test_sampled_wire.py)
    frame = bytearray(wire.encode_bye())
    struct.pack_into("<H", frame, 4, 5)
    with pytest.raises(wire.VersionMismatch, match="protocol version 5, this side speaks 6"):
        wire.decode_header(bytes(frame))


def test_a_hello_without_a_key_is_the_88_byte_hello_of_before():
    frame = wire.encode_hello(HELLO, 9)
    hdr = wire.decode_header(frame[: wire.HEADER.size])
    assert hdr.payload_len == wire.HELLO_STRUCT.size == 88
    fields = (*IDS, 7, 8, 4, 3, 0, 0, 100)
    assert frame[wire.HEADER.size :] == wire.HELLO_STRUCT.pack(*fields)
    assert wire.decode_hello(frame[wire.HEADER.size :]).nonce == b""


def test_an_engine_with_a_key_appends_its_nonce_and_it_round_trips():
    nonce = auth.new_nonce()
    frame = wire.encode_hello(wire.Hello(*IDS, 7, 8, 4, 3, vocab_size=100, nonce=nonce), 9)
    assert wire.decode_header(frame[: wire.HEADER.size]).payload_len == 88 + 32 == wire.frame_cap(wire.HELLO)
    assert frame[-32:] == nonce and wire.decode_hello(frame[wire.HEADER.size :]).nonce == nonce
    assert auth.new_nonce() != nonce  # fresh per call


@pytest.mark.parametrize("size", [87, 89, 119, 121])
def test_a_hello_of_another_length_is_a_protocol_error(size):
    payload = (wire.encode_hello(HELLO, 1)[wire.HEADER.size :] + bytes(64))[:size]
    with pytest.raises(wire.ProtocolError, match=f"HELLO payload of {size} bytes"):
        wire.decode_hello(payload)


def test_a_nonce_is_32_bytes_or_none():
    with pytest.raises(ValueError, match="a nonce is 32 bytes"):
        wire.encode_hello(wire.Hello(*IDS, 7, 8, 4, 3, nonce=b"short"), 1)


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


def test_a_hello_ack_may_refuse_auth_and_no_code_past_it():
    ack = wire.encode_hello_ack(wire.HelloAck(wire.REFUSE_AUTH, *IDS, "auth", context_tokens=0), 3)
    assert wire.decode_hello_ack(ack[wire.HEADER.size :]).code == wire.REFUSE_AUTH == 6
    bad = bytearray(ack[wire.HEADER.size :])
    bad[1] = wire.REFUSE_AUTH + 1
    with pytest.raises(wire.ProtocolError, match="reason code 7"):
        wire.decode_hello_ack(bytes(bad))


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

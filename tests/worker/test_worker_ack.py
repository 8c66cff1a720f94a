"""What a worker's HELLO_ACK tells (protocol 7 on): the context it keeps per slot, the most
tokens it takes in a round (its --max-round-tokens), its drafter's vocabulary and its
other limits, accepting and refusing alike; a HELLO of another protocol version gets
REFUSE_VERSION naming both versions. Loopback only; every wait bounded; every worker
stopped by its test."""

from __future__ import annotations

import socket
import struct

import pytest
from helpers import COUNTING, hello, recv_exactly

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.worker import Worker


@pytest.fixture
def worker():
    drafter = MarkovDrafter(COUNTING)
    w = Worker(drafter, "127.0.0.1", 0, window=16, max_slots=8, max_round_tokens=40, max_row_bytes=64).start()
    yield w
    w.stop()


def ack_of(w: Worker, frame: bytes) -> tuple[wire.Header, wire.HelloAck]:
    """The worker's answer to ``frame``, sent on a fresh connection (closed after)."""
    with socket.create_connection(("127.0.0.1", w.port), timeout=5) as s:
        s.sendall(frame)
        hdr = wire.decode_header(recv_exactly(s, wire.HEADER.size))
        return hdr, wire.decode_hello_ack(recv_exactly(s, hdr.payload_len))


@pytest.mark.parametrize("max_slots,code", [(8, wire.ACCEPT), (9, wire.REFUSE_LIMITS)])
def test_the_ack_tells_the_round_cap_vocabulary_and_limits_accepting_or_refusing(worker, max_slots, code):
    _, ack = ack_of(worker, wire.encode_hello(hello(worker, max_slots=max_slots), 3))
    assert ack.code == code
    told = (ack.context_tokens, ack.round_tokens, ack.max_slots, ack.max_row_bytes, ack.max_round_bytes)
    assert told == (16, 40, 8, 64, worker.limits.max_round_bytes)
    assert ack.vocab_size == worker.drafter.vocab_size > 0


def test_a_hello_of_the_previous_version_gets_refuse_version_naming_both(worker):
    frame = bytearray(wire.encode_hello(hello(worker), 3))
    struct.pack_into("<H", frame, 4, wire.PROTOCOL_VERSION - 1)
    hdr, ack = ack_of(worker, bytes(frame))
    assert ack.code == wire.REFUSE_VERSION and hdr.session == 0
    assert ack.reason == f"protocol version {wire.PROTOCOL_VERSION - 1}, this side speaks {wire.PROTOCOL_VERSION}"
    assert ack.round_tokens == 40  # the limits come with a refusal too

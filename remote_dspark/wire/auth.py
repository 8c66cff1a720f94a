"""Authentication at HELLO: the AUTH frame and the two proofs (part of the wire
contract, :mod:`remote_dspark.wire`). Optional: only a pre-shared key on both sides
turns it on, and it costs nothing per round.

The exchange, on a new connection (K the key, ``session`` the HELLO header's)::

    engine -> worker   HELLO   its payload ends with the engine's fresh nonce Ne
    worker -> engine   AUTH    the worker's fresh nonce Nw, then its proof Pw
    engine -> worker   AUTH    the engine's proof Pe   (sent only once Pw is verified)
    worker -> engine   HELLO_ACK                         (as without a key)

AUTH payload: from the worker (``CHALLENGE``, 64 bytes)::

    offset size field
         0   32 nonce   Nw, fresh for this connection (os.urandom)
        32   32 proof   Pw

from the engine (32 bytes): its proof Pe alone. The header's session is the HELLO's.

Both proofs are HMAC-SHA256 under K of one transcript, each behind its own role label::

    Pw = HMAC(K, "remote-dspark worker\\0" || session u64 || HELLO payload || Nw)
    Pe = HMAC(K, "remote-dspark engine\\0" || session u64 || HELLO payload || Nw)

The HELLO payload is the whole 120 bytes as sent (identities, engine id, sizes and Ne),
so each proof covers the other side's fresh nonce, the session and every term the
worker acts on; every field has a fixed length, so the concatenation is unambiguous.
Each side compares a proof with :func:`hmac.compare_digest` (constant time).

- **Replay**: a recorded Pe is over a Nw that the worker never draws again, a recorded Pw
  over a Ne the engine never draws again; neither passes on a new connection.
- **Reflection**: the role labels differ, so a worker's proof is never an engine's:
  whoever connects to a worker, or lets an engine connect to it, obtains only proofs of
  the other role, over nonces they cannot choose for the role they need.
- **No oracle for an impostor**: the engine sends Pe only after Pw verified, so a peer
  posing as a worker gets nothing computed under K; a peer posing as an engine gets Pw,
  which is over a fresh Nw and the worker's role.

What it does not do: protect the frames after HELLO (no per-round MAC, by design: no
per-round cost). A peer that can relay and alter the connection's bytes can still
tamper with rounds; on such a path use a private link or a tunnel.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from .frame import AUTH, NONCE_BYTES, PROOF_BYTES, ProtocolError, encode_header, require

WORKER = b"remote-dspark worker\0"  # the role label of the worker's proof
ENGINE = b"remote-dspark engine\0"  # the role label of the engine's proof
CHALLENGE = struct.Struct(f"<{NONCE_BYTES}s{PROOF_BYTES}s")  # the worker's AUTH payload
_SESSION = struct.Struct("<Q")


def new_nonce() -> bytes:
    """A fresh nonce, for one connection."""
    return os.urandom(NONCE_BYTES)


def proof(key: bytes, role: bytes, session: int, hello_payload, worker_nonce: bytes) -> bytes:
    """The proof of ``role`` (:data:`WORKER` or :data:`ENGINE`) over the connection's
    transcript: ``session``, the HELLO payload as sent (the engine's nonce its last 32
    bytes) and the worker's nonce."""
    require(role in (WORKER, ENGINE), "role is WORKER or ENGINE")
    mac = hmac.new(key, role, hashlib.sha256)
    mac.update(_SESSION.pack(session))
    mac.update(hello_payload)
    mac.update(worker_nonce)
    return mac.digest()


def proof_holds(key: bytes, role: bytes, session: int, hello_payload, worker_nonce: bytes, got: bytes) -> bool:
    """Whether ``got`` is ``role``'s proof over this transcript (constant-time compare)."""
    return hmac.compare_digest(proof(key, role, session, hello_payload, worker_nonce), got)


def encode_challenge(session: int, nonce: bytes, worker_proof: bytes) -> bytes:
    """The worker's AUTH frame: its nonce and its proof."""
    return encode_header(AUTH, CHALLENGE.size, session) + CHALLENGE.pack(nonce, worker_proof)


def decode_challenge(payload) -> tuple[bytes, bytes]:
    """The worker's AUTH payload: ``(nonce, proof)``."""
    if len(payload) != CHALLENGE.size:
        raise ProtocolError(f"AUTH from the worker of {len(payload)} bytes, expected {CHALLENGE.size}")
    nonce, worker_proof = CHALLENGE.unpack(payload)
    return nonce, worker_proof


def encode_answer(session: int, engine_proof: bytes) -> bytes:
    """The engine's AUTH frame: its proof."""
    require(len(engine_proof) == PROOF_BYTES, f"a proof is {PROOF_BYTES} bytes")
    return encode_header(AUTH, PROOF_BYTES, session) + engine_proof


def decode_answer(payload) -> bytes:
    """The engine's AUTH payload: its proof."""
    if len(payload) != PROOF_BYTES:
        raise ProtocolError(f"AUTH from the engine of {len(payload)} bytes, expected {PROOF_BYTES}")
    return bytes(payload)

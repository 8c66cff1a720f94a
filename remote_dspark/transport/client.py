"""The engine side of one connection to the remote drafter: HELLO, then rounds.

Used by the proxy process and by synchronous rounds alike; torch-free. A reply to a
round that is no longer pending (its deadline passed earlier) is counted as late and
dropped; any other surprise is a protocol error, and the caller drops the connection.

What is checked here, before a reply goes further: with a key (:mod:`.auth`), the worker
proves it holds it before the engine proves it does (:mod:`remote_dspark.wire.auth`),
and a worker that accepts without that proof is refused (:class:`AuthFailed`); the
HELLO_ACK answers this HELLO (its session) and, accepting, names the identities the
HELLO asked for (a worker serving another drafter or Markov model is never used); a
DRAFTS is of this session and of the round waited for. Its content is the caller's
``check`` (``engine.reply.check_reply`` in sync mode, ``hf_unpack`` on the proxy's ofl
round); ``hf_round`` makes the same header checks in C (``recv_reply``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

from .. import wire
from . import Disconnected, Endpoint, FrameChannel, connect
from .auth import Key


class Refused(Exception):
    """The worker refused HELLO; ``code`` is a ``wire.REFUSE_*`` and ``reason`` its words;
    ``ack``, its HELLO_ACK (its identities and limits: what a probe reports), or None
    when the engine refused."""

    def __init__(self, code: int, reason: str, ack: wire.HelloAck | None = None):
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.ack = ack


class AuthFailed(Refused):
    """The engine refuses the worker: it did not prove it holds the engine's key (it has
    none, another one, or it is not the worker it claims to be). Handled as any refused
    HELLO (the link backs off); ``code`` is ``wire.REFUSE_AUTH``."""

    def __init__(self, reason: str):
        super().__init__(wire.REFUSE_AUTH, reason)


class DraftClient:
    """One HELLO'd connection. Not thread-safe: one round in flight at a time."""

    def __init__(self, chan: FrameChannel, session: int, ack: wire.HelloAck, address=None):
        self.chan = chan
        self.session = session
        self.ack = ack
        self.address = address  # the fleet.Address dialled (None: the endpoint's own)
        self.late = 0

    @classmethod
    def connect(
        cls,
        endpoint: Endpoint,
        hello: wire.Hello,
        session: int,
        timeout_s: float,
        environ: Mapping[str, str] | None = None,
        key: Key | None = None,
        address=None,
    ) -> DraftClient:
        """Connect (to ``address``, a ``fleet.Address``, when given) and say HELLO, both
        within ``timeout_s``; with ``key``, the two sides authenticate each other first
        (:mod:`remote_dspark.wire.auth`).

        Raises:
            Refused: the worker said no (identity, version, limits, its key);
                AuthFailed: the engine says no (the worker did not prove ``key``).
            TransportError: no connection or no answer in time.
            wire.ProtocolError: the answer was not a HELLO_ACK of this session, or it
                accepted with other identities than the HELLO's.
        """
        deadline = time.monotonic() + timeout_s
        chan = connect(endpoint, timeout_s, environ, address)
        try:
            if key is not None:  # a fresh nonce for every connection
                hello = dataclasses.replace(hello, nonce=wire.auth.new_nonce())
            frame = wire.encode_hello(hello, session)
            chan.send(frame)
            hdr, payload = chan.recv_frame(deadline)
            if hdr.type == wire.AUTH:
                if key is None:
                    raise wire.ProtocolError("AUTH in answer to a HELLO that asked for no authentication")
                chan.send(_answer(key, session, memoryview(frame)[wire.HEADER.size :], hdr, payload))
                hdr, payload = chan.recv_frame(deadline)
            elif key is not None and hdr.type == wire.HELLO_ACK and wire.decode_hello_ack(payload).accepted:
                raise AuthFailed(
                    "the worker accepted without proving it holds the key (VLLM_DSPARK_REMOTE_KEY_FILE): "
                    "a worker without --key-file, or not the worker it claims to be"
                )
            ack = _check_ack(hdr, payload, hello, session)
        except BaseException:
            chan.close()
            raise
        return cls(chan, session, ack, address)

    def send(self, parts: Sequence, deadline: float | None = None) -> None:
        """Send one frame given as buffers (e.g. a ROUND whose rows and tokens are views
        of the shared region: they go out uncopied), by ``deadline``."""
        self.chan.send(*parts, deadline=deadline)

    def recv_drafts(self, round_id: int, deadline: float) -> wire.DraftsFrame:
        """The DRAFTS of ``round_id``, dropping (and counting) late replies of earlier
        rounds and skipping PING answers. Raises: DeadlineExceeded, Disconnected,
        wire.ProtocolError.

        The header rules mirror ``recv_reply`` in ``native/tcp_round.c`` (same order,
        same words for the session)."""
        while True:
            hdr, payload = self.chan.recv_frame(deadline)
            if hdr.type == wire.BYE:
                raise Disconnected("the worker said BYE")
            if hdr.type == wire.PING and hdr.session == self.session:
                continue  # the answer to a PING sent while this connection was a spare
            if hdr.type != wire.DRAFTS:
                raise wire.ProtocolError(f"{hdr.name} where DRAFTS was expected")
            if hdr.session != self.session:
                raise wire.ProtocolError(
                    f"DRAFTS of session {hdr.session:#x} on session {self.session:#x}'s connection"
                )
            if hdr.round == round_id:
                return wire.decode_drafts(hdr, payload)
            if wire.seq_geq(hdr.round, round_id):
                raise wire.ProtocolError(f"DRAFTS for round {hdr.round}, which was never sent")
            self.late += 1

    def round(
        self, round_id: int, parts: Sequence, deadline_ms: int, check: Callable[[wire.DraftsFrame], None] | None = None
    ) -> wire.DraftsFrame:
        """One synchronous round within ``deadline_ms``: send the ROUND frame ``parts``,
        return its DRAFTS once ``check`` (what the round asked) accepts them.

        Raises: DeadlineExceeded, Disconnected, wire.ProtocolError (wire.BadReply from
        ``check``: the drafts do not answer the round)."""
        deadline = time.monotonic() + deadline_ms / 1000.0
        self.send(parts, deadline)  # a send that misses it breaks the connection
        drafts = self.recv_drafts(round_id, deadline)
        if check is not None:
            check(drafts)
        return drafts

    def close(self) -> None:
        try:
            self.chan.send(wire.encode_bye(self.session))
        except Disconnected:
            pass
        self.chan.close()


def _answer(key: Key, session: int, hello_payload, hdr: wire.Header, payload) -> bytes:
    """The engine's AUTH frame, once the worker's AUTH (``hdr``, ``payload``) proved it
    holds ``key`` over this HELLO and its own nonce.

    Raises:
        AuthFailed: the worker's proof does not hold.
        wire.ProtocolError: not an AUTH of this session.
    """
    if hdr.session != session:
        raise wire.ProtocolError(f"AUTH of session {hdr.session:#x} in answer to session {session:#x}")
    nonce, proof = wire.auth.decode_challenge(payload)
    if not wire.auth.proof_holds(key.secret, wire.auth.WORKER, session, hello_payload, nonce, proof):
        raise AuthFailed(
            "the worker's proof does not hold for the key of VLLM_DSPARK_REMOTE_KEY_FILE "
            f"({key.path}): it holds another key, or none"
        )
    return wire.auth.encode_answer(
        session, wire.auth.proof(key.secret, wire.auth.ENGINE, session, hello_payload, nonce)
    )


def _check_ack(hdr: wire.Header, payload, hello: wire.Hello, session: int) -> wire.HelloAck:
    """The worker's HELLO_ACK to ``hello``, accepting with its identities.

    Raises: Refused, wire.ProtocolError."""
    if hdr.type != wire.HELLO_ACK:
        raise wire.ProtocolError(f"{hdr.name} in answer to HELLO")
    ack = wire.decode_hello_ack(payload)
    if not ack.accepted:
        raise Refused(ack.code, ack.reason, ack)
    if hdr.session != session:
        raise wire.ProtocolError(f"HELLO_ACK of session {hdr.session:#x} in answer to session {session:#x}")
    for what, asked, got in (
        ("drafter", hello.drafter_identity, ack.drafter_identity),
        ("Markov", hello.markov_identity, ack.markov_identity),
    ):
        if got != asked:
            raise wire.ProtocolError(
                f"HELLO_ACK accepts with {what} identity {bytes(got).hex()}, the engine asked for {bytes(asked).hex()}"
            )
    return ack

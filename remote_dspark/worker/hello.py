"""A served connection's HELLO: its verdict, and the HELLO_ACK that tells it; and the
answer to a PING on a served connection.

The verdict (:func:`judge_hello`) is the HELLO's checks (identities, vocabulary, this
worker's limits and a drafting call's budget: :func:`~remote_dspark.worker.limits.hello_refusal`),
then a place among the engines (:meth:`~remote_dspark.worker.sessions.Sessions.admit`):
the engine's own (a new session replaces the old one's windows), a free one, or the
least recently served one's if it has idled ``recent_s``; else "busy". The worker
counts it, then sends the ack (:func:`hello_ack`): once the engine side has an ACCEPT,
the old windows are gone.

A PING (:func:`pong`) is answered on every served connection, spare or not, at once by
whoever reads the connection's frames (the hub's I/O thread in C, the connection's own
thread otherwise), never queued behind the drafter: a spare's liveness is the worker
process's and its I/O's. It must be empty (the wire's cap) and name the connection's
session; anything else drops that connection as a bad frame.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from .. import wire
from ..drafter.contract import keeps_streams_of, vocab_size_of
from .limits import Limits, hello_refusal, stream_keep
from .sessions import Session, Sessions

log = logging.getLogger("remote_dspark.worker")


@dataclass(frozen=True)
class Verdict:
    """What a HELLO gets: ``session`` admitted (``code`` ``wire.ACCEPT``), or refused with
    ``code``, ``reason`` (for the engine's log) and ``why`` (the refusal's counter);
    ``evicted``, the session that made room for it, if one did."""

    code: int
    reason: str
    why: str
    session: Session | None = None
    evicted: Session | None = None


def judge_hello(
    hdr: wire.Header,
    hello: wire.Hello,
    conn: socket.socket | None,
    drafter,
    limits: Limits,
    call_tokens: int,
    sessions: Sessions,
) -> Verdict:
    """The verdict on ``hello`` (its header ``hdr``, on ``conn``) for a worker serving
    ``drafter`` under ``limits`` with a drafting call's budget of ``call_tokens``; an
    admitted session holds its place in ``sessions`` from now on."""
    code, reason, why = hello_refusal(drafter, limits, hello, limits.window, call_tokens)
    if code != wire.ACCEPT:
        log.warning("refused HELLO of session %#x: %s", hdr.session, reason)
        return Verdict(code, reason, why)
    keep = stream_keep(drafter, limits.window)
    history = sessions.history if keeps_streams_of(drafter) else None
    session = Session.of_hello(hdr.session, hello, limits.window, conn, keep, history)
    busy, evicted = sessions.admit(session)
    if busy is not None:  # no place ("busy: ..."), or a spare beside its engine's active session (limits)
        log.warning("refused HELLO of session %#x of engine %#x: %s", hdr.session, hello.engine_id, busy)
        return Verdict(wire.REFUSE_LIMITS, busy, "busy" if busy.startswith("busy") else "limits")
    if evicted is not None:
        log.info(
            "engine %#x (session %#x) evicted for engine %#x: %s",
            evicted.engine_id,
            evicted.session,
            hello.engine_id,
            "a spare" if evicted.spare else "served least recently",
        )
    return Verdict(code, reason, why, session, evicted)


def pong(session: Session, hdr: wire.Header) -> bytes:
    """The answer to a PING (``hdr``; the wire holds it empty) on ``session``'s
    connection: the same session and sequence number.

    Raises: wire.ProtocolError for a PING naming another session."""
    if hdr.session != session.session:
        raise wire.ProtocolError(f"PING of session {hdr.session:#x} on the connection of session {session.session:#x}")
    return wire.encode_ping(session.session, hdr.round)


def hello_ack(
    drafter, code: int, reason: str, session: int, limits: Limits, engines: int = 0, incarnation: int = 0
) -> bytes:
    """The HELLO_ACK frame of a worker serving ``drafter`` under ``limits``: the tokens
    it keeps of each stream (:func:`~.limits.stream_keep`: its window, or what a drafter
    that keeps whole streams keeps; the engine sends NEW_GEN contexts up to it), its cap
    on a round's tokens (the engine's rounds fit it), its drafter's vocabulary (0:
    unknown) and its other limits, told with a refusal too (what a probe reports); the
    ``engines`` it serves now (not spare, the newcomer not counted) and its
    ``incarnation``."""
    ack = wire.HelloAck(
        code,
        drafter.drafter_identity,
        drafter.markov_identity,
        reason,
        context_tokens=stream_keep(drafter, limits.window),
        round_tokens=limits.max_round_tokens,
        vocab_size=min(vocab_size_of(drafter), wire.MAX_VOCAB),
        max_slots=limits.max_slots,
        max_row_bytes=limits.max_row_bytes,
        max_round_bytes=limits.max_round_bytes,
        engines=engines,
        incarnation=incarnation,
    )
    return wire.encode_hello_ack(ack, session)

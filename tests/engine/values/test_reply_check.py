"""One rule for a worker's reply, written twice: ``engine.reply.check_reply`` (Python,
sync mode) and ``hf_unpack`` in ``native/reply_check.c`` with ``recv_reply`` in
``native/tcp_round.c`` (the proxy's rounds), sampled sessions' distributions included
(rule 5: ``sampled.violation`` and its twin ``check_distributions``). The same replies,
crafted and fuzzed, go through both; the verdicts must agree, and the engine side's
decoders must never raise anything but ``wire.ProtocolError``."""

from __future__ import annotations

import dataclasses
import math
import socket
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sampled_attack import adaptive_q

from remote_dspark import wire
from remote_dspark.engine.values.reply import Asked, check_reply
from remote_dspark.outcome import RoundEvent
from remote_dspark.proxy import ring_end
from remote_dspark.proxy.tcp_round import TcpRounds
from remote_dspark.sampled import pick, uniform_u32
from remote_dspark.shm import layout, memfd, ring, streamsync
from remote_dspark.transport import FrameChannel
from remote_dspark.transport.client import DraftClient
from remote_dspark.transport.tcp import TcpStream

SESSION = 0x5E55
VOCAB = 100
LAYOUT = layout.Layout(depth=4, max_slots=6, row_bytes=8, num_spec=4, max_tokens=24)
S_LAYOUT = layout.Layout(depth=4, max_slots=6, row_bytes=8, num_spec=4, max_tokens=24, sampled=True)
K = LAYOUT.num_spec
TERMS = [(v, m) for v in (0, VOCAB) for m in (False, True)]  # (vocab_size, want_margin) of a session
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))


class Both:
    """One session's terms, and the round its replies answer, held by both rules: the C
    reader (``ProxyEnd.unpack``, ``hf_unpack``) and the Python one (``decode_drafts`` then
    ``check_reply``). Every call is a (RoundEvent, why) verdict."""

    def __init__(self, lib, vocab_size: int, want_margin: bool, want_sampled: bool = False):
        self.vocab_size, self.want_margin, self.want_sampled = vocab_size, want_margin, want_sampled
        self.region = memfd.Region.create(S_LAYOUT if want_sampled else LAYOUT)
        self.eng = ring.EngineEnd(self.region, lib)
        self.end = ring_end.ProxyEnd(
            self.region, lib, vocab_size=vocab_size, want_margin=want_margin, want_sampled=want_sampled
        )
        self.r = self.eng.reserve(1)  # one round id, its descriptor rewritten per case
        self.entries: list[wire.Entry] = []
        self.decoded = False  # the last py() verdict came from check_reply, past the frame's own rules

    def ask(self, entries) -> Both:
        self.eng.write_entries(self.r, entries)
        self.entries = list(entries)
        return self

    def c(self, payload: bytes) -> tuple[RoundEvent, str]:
        return self.end.unpack(self.r, payload)

    def py(self, payload: bytes) -> tuple[RoundEvent, str]:
        asked = Asked(
            np.array([e.slot for e in self.entries], dtype=np.int64),
            np.array([e.n_out for e in self.entries], dtype=np.int64),
            K,
            self.vocab_size,
            self.want_margin,
            self.want_sampled,
            np.array([e.seed for e in self.entries], np.uint64) if self.want_sampled else None,
            np.array([e.position + len(e.tokens) for e in self.entries], np.int64) if self.want_sampled else None,
        )
        self.decoded = False
        try:
            d = wire.decode_drafts(wire.Header(wire.DRAFTS, len(payload), SESSION, self.r), payload)
            self.decoded = True
            check_reply(d, asked)
        except wire.BadReply as e:
            return RoundEvent.BAD_REPLY, str(e)
        except wire.ProtocolError as e:
            return RoundEvent.PROTOCOL, str(e)
        return RoundEvent.OK, ""

    def close(self) -> None:
        self.region.close()


@pytest.fixture(scope="module")
def both(lib):
    sessions = {terms: Both(lib, *terms) for terms in TERMS}
    yield sessions
    for b in sessions.values():
        b.close()


ENTRIES = [wire.Entry(3, 2, 0, [1]), wire.Entry(1, 3, 5, [2, 4])]  # n_out 2 and 3


def payload(slots=(3, 1), counts=(2, 3), statuses=(0, 0), width=3, tokens=None, margins=None, flags=None) -> bytes:
    """A DRAFTS payload; tokens/margins as {(entry, j): value} over an honest base (token
    7, margin 0.5 at counted positions, zero past them); ``margins=False``: none."""
    n = len(slots)
    tok = [7 if j < counts[i] else 0 for i in range(n) for j in range(width)]
    mar = [0.5 if j < counts[i] else 0.0 for i in range(n) for j in range(width)]
    for (i, j), v in (tokens or {}).items():
        tok[i * width + j] = v
    for (i, j), v in (margins or {}).items():
        mar[i * width + j] = v
    with_margins = margins is not False if flags is None else bool(flags)
    d = wire.DraftsFrame(
        1, list(slots), list(counts), list(statuses), width, tok, mar if with_margins and margins is not False else None
    )
    return wire.encode_drafts(d, SESSION)[wire.HEADER.size :]


def sampled_payload() -> bytes:
    """An honest reply (margins asked) that also carries distributions (DRAFTS_SAMPLED)."""
    body = payload()
    d = wire.decode_drafts(wire.Header(wire.DRAFTS, len(body), SESSION, 1), body)
    grid = 2 * d.width * wire.SAMPLED_TOP
    q = wire.DraftsFrame(1, d.slots, d.counts, d.statuses, d.width, d.tokens, d.margins, [0] * grid, [0] * grid)
    return wire.encode_drafts(q, SESSION)[wire.HEADER.size :]


R = wire.STATUS_RESYNC
NAN = float("nan")
# name: (terms, payload, event, why). Every rule of the reply check, and its edges.
CASES = {
    "honest": ((VOCAB, True), payload(), RoundEvent.OK, ""),
    "honest, no margins asked": ((VOCAB, False), payload(margins=False), RoundEvent.OK, ""),
    "fewer entries": (
        (0, True),
        payload(slots=(3,), counts=(2,), statuses=(0,)),
        RoundEvent.BAD_REPLY,
        "drafts for 1 entries, the round has 2",
    ),
    "another slot": (
        (0, True),
        payload(slots=(3, 2)),
        RoundEvent.BAD_REPLY,
        "entry 1: drafts for slot 2, the round has slot 1",
    ),
    "wider than num_spec": ((0, True), payload(width=5), RoundEvent.PROTOCOL, "drafts width 5 over num_spec=4"),
    "margins missing": (
        (0, True),
        payload(margins=False),
        RoundEvent.PROTOCOL,
        "DRAFTS without margins, the session asked for them",
    ),
    "margins not asked": (
        (0, False),
        payload(),
        RoundEvent.PROTOCOL,
        "DRAFTS with margins, the session did not ask for them",
    ),
    "count over n_out": (
        (0, True),
        payload(counts=(3, 3)),
        RoundEvent.PROTOCOL,
        "entry 0: 3 drafts, the round asked for 2",
    ),
    "RESYNC with drafts": ((0, True), payload(statuses=(0, R)), RoundEvent.PROTOCOL, "entry 1: RESYNC with 3 drafts"),
    "RESYNC without drafts": ((0, True), payload(counts=(2, 0), statuses=(0, R)), RoundEvent.OK, ""),
    "token = vocab_size": (
        (VOCAB, True),
        payload(tokens={(1, 2): VOCAB}),
        RoundEvent.PROTOCOL,
        "entry 1: draft token 100 outside 0..99",
    ),
    "token vocab_size - 1": ((VOCAB, True), payload(tokens={(1, 2): VOCAB - 1}), RoundEvent.OK, ""),
    "negative token, vocabulary unknown": (
        (0, True),
        payload(tokens={(0, 0): -1}),
        RoundEvent.PROTOCOL,
        "entry 0: draft token -1 outside 0..2147483647",
    ),
    "large token, vocabulary unknown": ((0, True), payload(tokens={(0, 0): 2**31 - 1}), RoundEvent.OK, ""),
    "bad token past the count": ((VOCAB, True), payload(counts=(1, 3), tokens={(0, 1): -9}), RoundEvent.OK, ""),
    "NaN margin": ((0, True), payload(margins={(1, 2): NAN}), RoundEvent.PROTOCOL, "entry 1: margin nan not in [0, 1]"),
    "negative NaN margin": (
        (0, True),
        payload(margins={(1, 0): -NAN}),
        RoundEvent.PROTOCOL,
        "entry 1: margin nan not in [0, 1]",
    ),
    "infinite margin": (
        (0, True),
        payload(margins={(0, 1): math.inf}),
        RoundEvent.PROTOCOL,
        "entry 0: margin inf not in [0, 1]",
    ),
    "negative margin": (
        (0, True),
        payload(margins={(0, 0): -0.25}),
        RoundEvent.PROTOCOL,
        "entry 0: margin -0.25 not in [0, 1]",
    ),
    "margin over 1": (
        (0, True),
        payload(margins={(0, 0): 1.5}),
        RoundEvent.PROTOCOL,
        "entry 0: margin 1.5 not in [0, 1]",
    ),
    "margins 0 and 1": ((0, True), payload(margins={(0, 0): 0.0, (0, 1): 1.0}), RoundEvent.OK, ""),
    "NaN past the count": ((0, True), payload(counts=(1, 3), margins={(0, 1): NAN}), RoundEvent.OK, ""),
    "the first entry that breaks a rule": (
        (VOCAB, True),
        payload(counts=(2, 3), statuses=(0, R), margins={(0, 1): 2.0}),
        RoundEvent.PROTOCOL,
        "entry 0: margin 2 not in [0, 1]",
    ),
    "its first rule": (
        (VOCAB, True),
        payload(tokens={(1, 0): VOCAB}, margins={(1, 0): NAN}),
        RoundEvent.PROTOCOL,
        "entry 1: draft token 100 outside 0..99",
    ),
    "a frame rule first": ((0, True), payload(counts=(4, 3), width=3), RoundEvent.PROTOCOL, None),
    "distributions not asked": (
        (0, True),
        sampled_payload(),
        RoundEvent.PROTOCOL,
        "DRAFTS with distributions, the session did not ask for them",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_c_and_the_python_check_give_every_reply_the_same_verdict(both, case):
    terms, body, event, why = CASES[case]
    b = both[terms].ask(ENTRIES)
    c, py = b.c(body), b.py(body)
    assert c[0] == py[0] == event, (c, py)
    if why is not None:  # the frame's own rules are worded by each reader; the reply's, alike
        assert c[1] == py[1] == why


# ------------------------------------------------------------------ the header: session, round


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname(), timeout=5.0)
        b, _ = listener.accept()
    b.settimeout(5.0)
    return a, b


class Wire:
    """A reply frame read by both: the C round (``hf_round`` on a socket pair) and the
    Python client (``DraftClient.recv_drafts`` on another)."""

    def __init__(self, lib):
        self.region = memfd.Region.create(LAYOUT)
        self.eng = ring.EngineEnd(self.region, lib)
        self.sync = streamsync.HostFlagSync(self.region, lib)
        self.end = ring_end.ProxyEnd(self.region, lib, spin_us=50, want_margin=True)
        self.rounds = TcpRounds(self.end, session=SESSION, default_deadline_ms=2000)
        self.c_sock, self.c_peer = socket.socketpair()
        self.c_peer.settimeout(5.0)  # bounds the read of the ROUND the C round sends
        self.rounds.attach(self.c_sock.fileno())
        self.py_sock, self.py_peer = tcp_pair()  # TcpStream wants TCP (TCP_NODELAY)
        self.client = DraftClient(
            FrameChannel(TcpStream(self.py_sock)), SESSION, wire.HelloAck(wire.ACCEPT, b"d" * 32, b"m" * 32)
        )

    def verdicts(self, frames) -> tuple[tuple[RoundEvent, str, int], tuple[RoundEvent, str, int]]:
        """``frames(r)`` (the bytes the worker sends for round r) through both readers:
        (event, why, late replies dropped) of each."""
        r = self.eng.reserve(1)
        self.eng.write_entries(r, ENTRIES)
        self.sync.signal(r)
        data = frames(r)
        self.c_peer.sendall(data)
        s = self.rounds.serve(2.0, send=True, at_once=0)
        self.c_peer.recv(1 << 16)  # the ROUND the C round sent
        self.py_peer.sendall(data)
        late = self.client.late
        try:
            self.client.recv_drafts(r, time.monotonic() + 2.0)
            py = (RoundEvent.OK, "")
        except wire.ProtocolError as e:
            py = (RoundEvent.PROTOCOL, str(e))
        return (s.event, s.why, s.late), py + (self.client.late - late,)

    def close(self) -> None:
        for sock in (self.c_sock, self.c_peer, self.py_sock, self.py_peer):
            sock.close()
        self.region.close()


def _drafts(r, session=SESSION, round_id=None) -> bytes:
    body = payload()
    return wire.encode_header(wire.DRAFTS, len(body), session, r if round_id is None else round_id) + body


HEADER_CASES = {
    "this round": (lambda r: _drafts(r), RoundEvent.OK, "", 0),
    "a late reply first": (lambda r: _drafts(r, round_id=r - 1) + _drafts(r), RoundEvent.OK, "", 1),
    "another session": (
        lambda r: _drafts(r, session=SESSION + 1),
        RoundEvent.PROTOCOL,
        f"DRAFTS of session {SESSION + 1:#x} on session {SESSION:#x}'s connection",
        0,
    ),
    "a round never sent": (
        lambda r: _drafts(r, round_id=r + 3),
        RoundEvent.PROTOCOL,
        "DRAFTS for round {}, which was never sent",
        0,
    ),
    "a late reply of another session": (
        lambda r: _drafts(r, session=7, round_id=r - 1) + _drafts(r),
        RoundEvent.PROTOCOL,
        f"DRAFTS of session 0x7 on session {SESSION:#x}'s connection",
        0,
    ),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_the_c_round_and_the_python_client_read_a_reply_header_alike(lib, case):
    frames, event, why, late = HEADER_CASES[case]
    w = Wire(lib)
    try:
        c, py = w.verdicts(frames)
        r = w.eng.last
        why = why.format(r + 3)
        assert c == py == (event, why, late)
    finally:
        w.close()


# ------------------------------------------------------------------ fuzz: decoders, and agreement


@st.composite
def valid_reply(draw):
    """(terms, entries, fields of a DRAFTS) of a reply that keeps every rule."""
    terms = draw(st.sampled_from(TERMS))
    vocab, want = terms
    n = draw(st.integers(0, 3))
    entries = [wire.Entry(s, draw(st.integers(0, K)), 0, [1]) for s in draw(st.permutations(range(6)))[:n]]
    width = draw(st.integers(0, K))
    statuses = draw(st.lists(st.sampled_from([wire.STATUS_OK, R]), min_size=n, max_size=n))
    counts = [draw(st.integers(0, min(width, e.n_out))) if s == 0 else 0 for e, s in zip(entries, statuses)]
    top = vocab - 1 if vocab else 2**31 - 1
    tokens = [draw(st.integers(0, top)) if j < counts[i] else 0 for i in range(n) for j in range(width)]
    margins = (
        [draw(st.floats(0, 1, width=32)) if j < counts[i] else 0.0 for i in range(n) for j in range(width)]
        if want
        else None
    )
    return (
        terms,
        entries,
        dict(
            slots=[e.slot for e in entries],
            counts=counts,
            statuses=statuses,
            width=width,
            tokens=tokens,
            margins=margins,
        ),
    )


def encoded(f: dict) -> bytes:
    return wire.encode_drafts(
        wire.DraftsFrame(1, f["slots"], f["counts"], f["statuses"], f["width"], f["tokens"], f["margins"]), SESSION
    )[wire.HEADER.size :]


SPECIAL_TOKENS = [-1, -(2**31), VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1]
SPECIAL_MARGINS = [math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0, 1.0, 1.0000001, -1e-30, 2.0]


@st.composite
def perturbed(draw, f: dict) -> dict:
    """``f`` with one field changed, so that the frame stays well-formed and a reply rule
    may break: a count, a status, a token, a margin, the width, the margins section, a
    slot, the entry count."""
    f = {k: list(v) if isinstance(v, list) else v for k, v in f.items()}
    n, width = len(f["counts"]), f["width"]
    how = draw(st.sampled_from(["count", "status", "token", "margin", "width", "margins", "slot", "entries"]))
    if how == "count" and n and width:
        f["counts"][draw(st.integers(0, n - 1))] = draw(st.integers(0, width))
    elif how == "status" and n:
        i = draw(st.integers(0, n - 1))
        f["statuses"][i] ^= 1
    elif how == "token" and f["tokens"]:
        f["tokens"][draw(st.integers(0, len(f["tokens"]) - 1))] = draw(st.sampled_from(SPECIAL_TOKENS))
    elif how == "margin" and f["margins"]:
        f["margins"][draw(st.integers(0, len(f["margins"]) - 1))] = draw(st.sampled_from(SPECIAL_MARGINS))
    elif how == "width":
        w = draw(st.integers(max(f["counts"], default=0), wire.MAX_N_OUT))

        def grow(flat, fill):
            return [flat[i * width + j] if j < width else fill for i in range(n) for j in range(w)]

        f["tokens"] = grow(f["tokens"], 0)
        f["margins"] = None if f["margins"] is None else grow(f["margins"], 0.0)
        f["width"] = w
    elif how == "margins":
        f["margins"] = None if f["margins"] is not None else [0.5] * (n * width)
    elif how == "slot" and n:
        f["slots"][draw(st.integers(0, n - 1))] = draw(st.integers(0, 7))
    elif how == "entries" and n:
        for k in ("slots", "counts", "statuses"):
            f[k] = f[k][:-1]
        f["tokens"] = f["tokens"][: (n - 1) * width]
        f["margins"] = None if f["margins"] is None else f["margins"][: (n - 1) * width]
    return f


@st.composite
def mutated(draw, body: bytes) -> bytes:
    """``body`` with a few bytes changed, cut short or lengthened (mutations of a valid
    reply reach the rules past the frame's own: counts, statuses, tokens, margins)."""
    out = bytearray(body)
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "flip", "flip", "word", "cut", "grow"]))
        if how == "cut" and out:
            del out[draw(st.integers(0, len(out) - 1)) :]
        elif how == "grow":
            out += draw(st.binary(min_size=1, max_size=8))
        elif out:
            i = draw(st.integers(0, len(out) - 1))
            if how == "flip":
                out[i] ^= draw(st.integers(1, 255))
            else:  # a whole 32-bit word: a token, a margin (NaN, inf, ...), a count pair
                out[i : i + 4] = struct.pack(
                    "<I",
                    draw(
                        st.sampled_from(
                            [0xFFFFFFFF, 0x7FC00000, 0x7F800000, 0xFF800000, 0x3F800001, 0x80000000, 100, 5]
                        )
                    ),
                )
    return bytes(out)


@given(data=st.data())
@settings(FUZZ, max_examples=600)
def test_fuzz_replies_get_the_same_verdict_from_c_and_python(both, data):
    terms, entries, fields = data.draw(valid_reply())
    b = both[terms].ask(entries)
    body = encoded(fields)
    assert b.c(body) == b.py(body) == (RoundEvent.OK, "")
    bad = data.draw(
        st.one_of(perturbed(fields).map(encoded), perturbed(fields).map(encoded), mutated(body), st.binary(max_size=96))
    )
    same_verdict(b, bad)


def same_verdict(b: Both, bad: bytes) -> None:
    """C and Python give ``bad`` the same event (Python raising nothing but
    ProtocolError: anything else fails here), and past the frame's own rules (each
    reader words those) the same words."""
    c, py = b.c(bad), b.py(bad)
    assert c[0] in (RoundEvent.OK, RoundEvent.PROTOCOL, RoundEvent.BAD_REPLY)
    assert c[0] == py[0], (c, py)
    event(f"{c[0].name}, {py[1].split(': ')[-1][:20] if b.decoded else 'the frame rules'}")
    if b.decoded:
        assert c[1] == py[1]


def _only_protocol_errors(decode, *args) -> None:
    try:
        decode(*args)
    except wire.ProtocolError:
        pass


@given(head=st.binary(min_size=wire.HEADER.size, max_size=wire.HEADER.size), body=st.binary(max_size=200))
@FUZZ
def test_fuzz_every_engine_side_decoder_raises_only_protocol_errors(head, body):
    _only_protocol_errors(wire.decode_header, head)
    _only_protocol_errors(wire.decode_hello_ack, body)
    hdr = wire.Header(wire.DRAFTS, len(body), SESSION, 1)
    _only_protocol_errors(lambda: check_reply(wire.decode_drafts(hdr, body), Asked(np.arange(3), 2, K, VOCAB, True)))


@given(data=st.data())
@FUZZ
def test_fuzz_mutated_valid_frames_raise_only_protocol_errors(data):
    ack = wire.encode_hello_ack(
        wire.HelloAck(
            data.draw(st.sampled_from([wire.ACCEPT, wire.REFUSE_LIMITS])),
            b"d" * 32,
            b"m" * 32,
            data.draw(st.text(max_size=20)),
        ),
        SESSION,
    )
    frame = data.draw(
        st.sampled_from(
            [ack, wire.encode_bye(SESSION), wire.encode_header(wire.DRAFTS, len(payload()), SESSION, 1) + payload()]
        )
    )
    bad = data.draw(mutated(frame))
    try:
        hdr = wire.decode_header(bad[: wire.HEADER.size])
    except wire.ProtocolError:
        return
    body = bad[wire.HEADER.size :]
    if hdr.type == wire.HELLO_ACK:
        _only_protocol_errors(wire.decode_hello_ack, body)
    elif hdr.type == wire.DRAFTS:
        _only_protocol_errors(
            lambda: check_reply(
                wire.decode_drafts(hdr, body), Asked(np.array([3, 1]), np.array([2, 3]), K, VOCAB, True)
            )
        )


# ------------------------------------------------------------------ sampled sessions (rule 5)

S_ENTRIES = [
    wire.Entry(3, 2, 0, [1], temperature=0.7, seed=5),  # drafts at positions 1, 2
    wire.Entry(1, 3, 2**32 - 2, [2, 4], temperature=0.0, seed=2**64 - 1),  # at 2**32, 2**32 + 1, 2**32 + 2
]
S_TERMS = [(v, m) for v in (0, VOCAB) for m in (False, True)]  # (vocab_size, want_margin) of a sampled session
TOP = wire.SAMPLED_TOP


@pytest.fixture(scope="module")
def both_sampled(lib):
    sessions = {terms: Both(lib, *terms, want_sampled=True) for terms in S_TERMS}
    yield sessions
    for b in sessions.values():
        b.close()


def honest_q(token: int) -> tuple[list[int], list[int]]:
    """A drafted position's honest distribution: all weight on ``token``, listed first,
    then the smallest other ids with weight 0 (``one_hot_q``'s padding)."""
    ids = [token] + [i for i in range(TOP + 1) if i != token][: TOP - 1]
    return ids, [wire.SAMPLED_TOTAL] + [0] * (TOP - 1)


def s_fields(counts=(2, 3), width=3, margins=True) -> dict:
    """An honest sampled reply's fields (token 7, margin 0.5, one-hot q at counted
    positions; zeros past them)."""
    n = len(counts)
    live = [j < counts[i] for i in range(n) for j in range(width)]
    ids, w = honest_q(HONEST_S)
    return dict(
        slots=[3, 1][:n],
        counts=list(counts),
        statuses=[0] * n,
        width=width,
        tokens=[HONEST_S if x else 0 for x in live],
        margins=[0.5 if x else 0.0 for x in live] if margins else None,
        q_ids=[v for x in live for v in (ids if x else [0] * TOP)],
        q_weights=[v for x in live for v in (w if x else [0] * TOP)],
    )


HONEST_S = 7


def the_pick(entry: wire.Entry, j: int, ids, weights) -> int:
    """The rule's pick from (ids, weights) for draft j of ``entry``: at its seed and its
    absolute position (the entry's last token's position + 1 + j) and index j."""
    u = uniform_u32(np.uint64(entry.seed), entry.position + len(entry.tokens) + j, j)
    return int(pick(np.asarray(ids), np.asarray(weights), u))


def picked_q(entry: wire.Entry, j: int, weights: list[int]) -> tuple[dict, dict, int, int]:
    """Edits making entry ``entry``'s draft j's q ``honest_q(HONEST_S)``'s ids with
    ``weights``: (ids, weights, tokens) edits for ``s_payload`` with the token the pick,
    and the pick's id and position."""
    i = S_ENTRIES.index(entry)
    ids, _ = honest_q(HONEST_S)
    token = the_pick(entry, j, ids, weights)
    return (
        {(i, j, m): w for m, w in enumerate(weights)},
        {(i, j): token},
        token,
        entry.position + len(entry.tokens) + j,
    )


# The attacker: token 7 drafted, listed last with weight 1, the rest spread evenly
# (so the weights do not rise): the pick lands on it only when r is 65534.
NAIVE_W = [65534 // 31 + (m < 65534 % 31) for m in range(TOP - 1)] + [1]
NAIVE_IDS = {(1, 1, m): v for m, v in enumerate([i for i in range(1, TOP + 1) if i != HONEST_S] + [HONEST_S])}
NAIVE_PICK = the_pick(S_ENTRIES[1], 1, [i for i in range(1, TOP + 1) if i != HONEST_S] + [HONEST_S], NAIVE_W)
THIRDS_W, THIRDS_TOKEN, THIRDS_PICK, THIRDS_AT = picked_q(S_ENTRIES[0], 1, [21845] * 3 + [0] * (TOP - 3))
ADAPTIVE_IDS, ADAPTIVE_W = adaptive_q(2**64 - 1, 2**32 + 2, 2, HONEST_S)  # entry 1's draft 2: at 2**32 + 2
THIRDS_OTHER = next(t for t in honest_q(HONEST_S)[0][:3] if t != THIRDS_PICK)  # listed, weight > 0, not the pick


def s_encoded(f: dict) -> bytes:
    d = wire.DraftsFrame(
        1,
        f["slots"],
        f["counts"],
        f["statuses"],
        f["width"],
        f["tokens"],
        f["margins"],
        f.get("q_ids"),
        f.get("q_weights"),
    )
    return wire.encode_drafts(d, SESSION)[wire.HEADER.size :]


def s_payload(ids=None, weights=None, tokens=None, margins=None, counts=(2, 3), width=3, with_margins=True) -> bytes:
    """An honest sampled reply with changes: ``ids``/``weights`` as {(entry, j, m): value},
    ``tokens``/``margins`` as {(entry, j): value}."""
    f = s_fields(counts, width, with_margins)
    for (i, j, m), v in (ids or {}).items():
        f["q_ids"][(i * width + j) * TOP + m] = v
    for (i, j, m), v in (weights or {}).items():
        f["q_weights"][(i * width + j) * TOP + m] = v
    for (i, j), v in (tokens or {}).items():
        f["tokens"][i * width + j] = v
    for (i, j), v in (margins or {}).items():
        f["margins"][i * width + j] = v
    return s_encoded(f)


def over_caps(width: int) -> bytes:
    """A sampled reply of two entries, no drafts, ``width`` wide (past the sampled cap:
    ``encode_drafts`` refuses to write one)."""
    sec = wire.drafts_sections(2, width, True, True)
    body = bytearray(sec.size)
    wire.DRAFTS_FIXED.pack_into(body, 0, 2, width, wire.DRAFTS_MARGINS | wire.DRAFTS_SAMPLED)
    struct.pack_into("<II", body, sec.slots, 3, 1)
    return bytes(body)


SAMPLED_CASES = {
    "honest": ((VOCAB, True), s_payload(), RoundEvent.OK, ""),
    "honest, no margins, vocabulary unknown": ((0, False), s_payload(with_margins=False), RoundEvent.OK, ""),
    "distributions missing": (
        (VOCAB, True),
        payload(),
        RoundEvent.PROTOCOL,
        "DRAFTS without distributions, the session asked for them",
    ),
    "id = vocab_size": (
        (VOCAB, True),
        s_payload(ids={(1, 2, 5): VOCAB}),
        RoundEvent.PROTOCOL,
        "entry 1: draft 2: id 100 outside 0..99",
    ),
    "the first id outside is named": (
        (VOCAB, True),
        s_payload(ids={(0, 1, 3): -4, (0, 1, 9): VOCAB + 5}),
        RoundEvent.PROTOCOL,
        "entry 0: draft 1: id -4 outside 0..99",
    ),
    "negative id, vocabulary unknown": (
        (0, True),
        s_payload(ids={(0, 0, 31): -(2**31)}),
        RoundEvent.PROTOCOL,
        "entry 0: draft 0: id -2147483648 outside 0..2147483647",
    ),
    "large id, vocabulary unknown": ((0, True), s_payload(ids={(0, 0, 31): 2**31 - 1}), RoundEvent.OK, ""),
    "id repeated": (
        (VOCAB, True),
        s_payload(ids={(1, 0, 4): 2}),
        RoundEvent.PROTOCOL,
        "entry 1: draft 0: id 2 repeated",
    ),
    "the smallest repeated id is named": (
        (VOCAB, True),
        s_payload(ids={(0, 0, 1): 30, (0, 0, 2): 30, (0, 0, 10): 5, (0, 0, 20): 5}),
        RoundEvent.PROTOCOL,
        "entry 0: draft 0: id 5 repeated",
    ),
    "weights sum under": (
        (VOCAB, True),
        s_payload(weights={(1, 1, 0): wire.SAMPLED_TOTAL - 1}),
        RoundEvent.PROTOCOL,
        "entry 1: draft 1: weights sum to 65534 (each 0..65535), expected exactly 65535",
    ),
    "weights sum over": (
        (VOCAB, True),
        s_payload(weights={(0, 1, 7): 65535}),
        RoundEvent.PROTOCOL,
        "entry 0: draft 1: weights sum to 131070 (each 0..65535), expected exactly 65535",
    ),
    "weights spread": (
        (VOCAB, True),
        s_payload(weights=picked_q(S_ENTRIES[0], 0, [65000, 535] + [0] * (TOP - 2))[0]),
        RoundEvent.OK,
        "",
    ),
    "equal weights, the pick a later id": (
        (VOCAB, True),
        s_payload(weights=THIRDS_W, tokens=THIRDS_TOKEN),
        RoundEvent.OK,
        "",
    ),
    "the adaptive attacker's q passes (what only a redraw stops)": (
        (VOCAB, True),
        s_payload(
            ids={(1, 2, m): int(v) for m, v in enumerate(ADAPTIVE_IDS)},
            weights={(1, 2, m): int(v) for m, v in enumerate(ADAPTIVE_W)},
        ),
        RoundEvent.OK,
        "",
    ),
    "weights that rise": (
        (VOCAB, True),
        s_payload(weights={(0, 1, 0): 65000, (0, 1, 3): 535}),
        RoundEvent.PROTOCOL,
        "entry 0: draft 1: weights rise at index 3 (0, then 535): expected non-increasing",
    ),
    "the token with weight 1, listed last (not the pick)": (
        (VOCAB, True),
        s_payload(ids=NAIVE_IDS, weights={(1, 1, m): w for m, w in enumerate(NAIVE_W)}),
        RoundEvent.PROTOCOL,
        f"entry 1: draft 1: drafted token 7, the pick at its seed and position {2**32 + 1} is {NAIVE_PICK}",
    ),
    "another listed token than the pick": (
        (VOCAB, True),
        s_payload(weights=THIRDS_W, tokens={(0, 1): THIRDS_OTHER}),
        RoundEvent.PROTOCOL,
        f"entry 0: draft 1: drafted token {THIRDS_OTHER}, "
        f"the pick at its seed and position {THIRDS_AT} is {THIRDS_PICK}",
    ),
    "a token of weight 0 is named before weights that rise": (
        (VOCAB, True),
        s_payload(weights={(0, 0, 0): 65000, (0, 0, 3): 535}, tokens={(0, 0): 8}),
        RoundEvent.PROTOCOL,
        "entry 0: draft 0: drafted token 8 not among its ids of weight > 0",
    ),
    "drafted token absent": (
        (VOCAB, True),
        s_payload(ids={(1, 2, 0): 99}),
        RoundEvent.PROTOCOL,
        "entry 1: draft 2: drafted token 7 not among its ids of weight > 0",
    ),
    "drafted token of weight 0": (
        (VOCAB, True),
        s_payload(weights={(0, 0, 0): 0, (0, 0, 1): 65535}),
        RoundEvent.PROTOCOL,
        "entry 0: draft 0: drafted token 7 not among its ids of weight > 0",
    ),
    "NaN margin first (rule 4 before 5)": (
        (VOCAB, True),
        s_payload(ids={(0, 0, 0): VOCAB}, margins={(1, 1): NAN}),
        RoundEvent.PROTOCOL,
        "entry 1: margin nan not in [0, 1]",
    ),
    "a token outside first (rule 4 before 5)": (
        (VOCAB, True),
        s_payload(weights={(0, 0, 0): 1}, tokens={(1, 0): VOCAB}),
        RoundEvent.PROTOCOL,
        "entry 1: draft token 100 outside 0..99",
    ),
    "the first position that breaks the rule": (
        (VOCAB, True),
        s_payload(weights={(1, 0, 0): 1}, ids={(0, 1, 3): 7}),
        RoundEvent.PROTOCOL,
        "entry 0: draft 1: id 7 repeated",
    ),
    "junk past the counts": (
        (VOCAB, True),
        s_payload(counts=(1, 2), ids={(0, 1, 0): -1, (1, 2, 4): 4}, weights={(0, 1, 0): 3, (1, 2, 0): 0}),
        RoundEvent.OK,
        "",
    ),
    "over the sampled caps": (
        (VOCAB, True),
        over_caps(width=wire.MAX_SAMPLED_N_OUT + 1),
        RoundEvent.PROTOCOL,
        f"sampled DRAFTS of 2 entries x 17 over the caps {wire.MAX_SAMPLED_ENTRIES} x {wire.MAX_SAMPLED_N_OUT}",
    ),
}


@pytest.mark.parametrize("case", list(SAMPLED_CASES))
def test_c_and_python_give_a_sampled_sessions_replies_the_same_verdict(both_sampled, case):
    terms, body, event, why = SAMPLED_CASES[case]
    b = both_sampled[terms].ask(S_ENTRIES)
    c, py = b.c(body), b.py(body)
    assert c == py == (event, why)


@pytest.mark.parametrize("vocab", [0, VOCAB])
def test_distributions_a_session_did_not_ask_for_are_refused_alike(both, vocab):
    b = both[(vocab, True)].ask(ENTRIES)
    body = s_payload()
    assert (
        b.c(body) == b.py(body) == (RoundEvent.PROTOCOL, "DRAFTS with distributions, the session did not ask for them")
    )


def test_a_sampled_reply_reaches_the_drafts_slot_widened_to_num_spec_and_zero_past_counts(lib):
    """What the proxy answers (``complete``: hf_unpack into its image, hf_answer into the
    slot): every row of q ``num_spec`` wide, the worker's junk past a count not copied."""
    with memfd.Region.create(S_LAYOUT) as region:
        eng = ring.EngineEnd(region, lib)
        end = ring_end.ProxyEnd(region, lib, vocab_size=VOCAB, want_margin=True, want_sampled=True)
        r = eng.reserve(1)
        eng.write_entries(r, S_ENTRIES)
        f = s_fields(counts=(1, 3))
        f["q_ids"][TOP : 2 * TOP] = [-1] * TOP  # junk past entry 0's count
        f["q_weights"][TOP : 2 * TOP] = [9] * TOP
        d = wire.decode_drafts(wire.Header(wire.DRAFTS, 0, SESSION, r), s_encoded(f))
        assert end.complete(ring_end.ProxyRound(end, r, r & 3), d) is True
        lay, cells = S_LAYOUT, 6 * K * TOP
        with region.drafts(r & 3) as slot:
            flags = struct.unpack_from("<I", slot, 12)[0]
            ids = np.frombuffer(slot, np.int32, cells, lay.d_q_ids).reshape(6, K, TOP)[:2].copy()
            w = np.frombuffer(slot, np.uint16, cells, lay.d_q_weights).reshape(6, K, TOP)[:2].copy()
        del end
    assert flags == wire.DRAFTS_SAMPLED | wire.DRAFTS_MARGINS
    one_ids, one_w = honest_q(HONEST_S)
    live = np.array([[1, 0, 0, 0], [1, 1, 1, 0]], bool)
    assert (ids[live] == one_ids).all() and (w[live] == one_w).all()
    assert not ids[~live].any() and not w[~live].any()


@st.composite
def valid_sampled_reply(draw):
    """(terms, entries, fields) of a sampled reply that keeps every rule: each counted
    position's distribution a random valid one (weights non-increasing), its token the
    pick at the entry's seed and the draft's position."""
    terms = draw(st.sampled_from(S_TERMS))
    vocab, want = terms
    n = draw(st.integers(0, 3))
    entries = [  # NEW_GEN or continuing, with 0 to 3 new tokens, positions up to the u32's end
        wire.Entry(
            s,
            draw(st.integers(0, K)),
            draw(st.one_of(st.integers(0, 64), st.integers(2**32 - 8, 2**32 - 1))),
            draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
            new_gen=draw(st.booleans()),
            temperature=1.0,
            seed=draw(st.integers(0, 2**64 - 1)),
        )
        for s in draw(st.permutations(range(6)))[:n]
    ]
    width = draw(st.integers(0, K))
    statuses = draw(st.lists(st.sampled_from([wire.STATUS_OK, R]), min_size=n, max_size=n))
    counts = [draw(st.integers(0, min(width, e.n_out))) if s == 0 else 0 for e, s in zip(entries, statuses)]
    top = vocab - 1 if vocab else 2**31 - 1
    tokens, q_ids, q_weights = [], [], []
    for i in range(n):
        for j in range(width):
            if j >= counts[i]:
                tokens.append(0), q_ids.extend([0] * TOP), q_weights.extend([0] * TOP)
                continue
            ids = draw(st.lists(st.integers(0, top), min_size=TOP, max_size=TOP, unique=True))
            cuts = sorted(draw(st.lists(st.integers(0, wire.SAMPLED_TOTAL), min_size=TOP - 1, max_size=TOP - 1)))
            w = sorted((b - a for a, b in zip([0] + cuts, cuts + [wire.SAMPLED_TOTAL])), reverse=True)
            tokens.append(the_pick(entries[i], j, ids, w)), q_ids.extend(ids), q_weights.extend(w)
    margins = [0.25 if j < counts[i] else 0.0 for i in range(n) for j in range(width)] if want else None
    fields = dict(
        slots=[e.slot for e in entries],
        counts=counts,
        statuses=statuses,
        width=width,
        tokens=tokens,
        margins=margins,
        q_ids=q_ids,
        q_weights=q_weights,
    )
    return terms, entries, fields


SPECIAL_IDS = [-1, -(2**31), VOCAB - 1, VOCAB, 2**31 - 1, 0, 7]


@st.composite
def q_perturbed(draw, f: dict) -> dict:
    """``f`` with one distribution cell changed (an id to a special value or to another
    id of its position, a weight, two weights swapped), or one token (to a special value
    or another listed id: not the pick) or margin (rule 4 against rule 5)."""
    f = {k: list(v) if isinstance(v, list) else v for k, v in f.items()}
    how = draw(st.sampled_from(["id", "copy", "weight", "token", "margin", "swap", "listed"]))
    cells = len(f["q_ids"])
    if how == "id" and cells:
        f["q_ids"][draw(st.integers(0, cells - 1))] = draw(st.sampled_from(SPECIAL_IDS))
    elif how == "copy" and cells:
        at = draw(st.integers(0, cells - 1))
        f["q_ids"][at] = f["q_ids"][at // TOP * TOP + draw(st.integers(0, TOP - 1))]
    elif how == "weight" and cells:
        f["q_weights"][draw(st.integers(0, cells - 1))] = draw(st.sampled_from([0, 1, 65535, 40000]))
    elif how == "token" and f["tokens"]:
        f["tokens"][draw(st.integers(0, len(f["tokens"]) - 1))] = draw(st.sampled_from(SPECIAL_TOKENS))
    elif how == "swap" and cells:  # two weights of a position swapped: out of order, or another pick
        at, m = divmod(draw(st.integers(0, cells - 1)), TOP)
        k = draw(st.integers(0, TOP - 1))
        row = f["q_weights"][at * TOP : (at + 1) * TOP]
        row[m], row[k] = row[k], row[m]
        f["q_weights"][at * TOP : (at + 1) * TOP] = row
    elif how == "listed" and f["tokens"]:  # the drafted token another id of its position
        at = draw(st.integers(0, len(f["tokens"]) - 1))
        if f["q_ids"]:
            f["tokens"][at] = f["q_ids"][at * TOP + draw(st.integers(0, TOP - 1))]
    elif how == "margin" and f["margins"]:
        f["margins"][draw(st.integers(0, len(f["margins"]) - 1))] = draw(st.sampled_from(SPECIAL_MARGINS))
    return f


@given(data=st.data())
@settings(FUZZ, max_examples=400)
def test_fuzz_sampled_replies_get_the_same_verdict_and_words_from_c_and_python(both_sampled, data):
    terms, entries, fields = data.draw(valid_sampled_reply())
    b = both_sampled[terms].ask(entries)
    body = s_encoded(fields)
    assert b.c(body) == b.py(body) == (RoundEvent.OK, "")
    bad = data.draw(st.one_of(q_perturbed(fields).map(s_encoded), q_perturbed(fields).map(s_encoded), mutated(body)))
    same_verdict(b, bad)


def test_c_holds_every_position_of_a_256_by_5_sampled_reply_to_the_rule(lib):
    """A whole round's distributions (1,280 positions of 32 random distinct ids of a
    131,072-id vocabulary, each draft its pick): accepted, and one id repeated at the very
    last position is found and named. (Its cost is ``bench round --sampled``'s to show,
    not this test's.)"""
    lay = layout.Layout(depth=2, max_slots=256, row_bytes=0, num_spec=5, max_tokens=256, sampled=True)
    with memfd.Region.create(lay) as region:
        eng = ring.EngineEnd(region, lib)
        end = ring_end.ProxyEnd(region, lib, vocab_size=1 << 17, want_sampled=True)
        r = eng.reserve(1)
        eng.write_entries(r, [wire.Entry(s, 5, 0, [1], temperature=1.0, seed=s) for s in range(256)])
        rng = np.random.default_rng(0)
        ids = rng.permutation(1 << 17)[: 256 * 5 * TOP].reshape(256 * 5, TOP).astype(np.int32)
        w = np.full((256 * 5, TOP), wire.SAMPLED_TOTAL // TOP, np.uint16)
        w[:, 0] += wire.SAMPLED_TOTAL - int(w[0].sum())
        j = np.tile(np.arange(5), 256)  # draft j of entry s: at position 1 + j
        tokens = pick(ids, w, uniform_u32(np.repeat(np.arange(256, dtype=np.uint64), 5), 1 + j, j))
        d = wire.DraftsFrame(
            1,
            list(range(256)),
            [5] * 256,
            [0] * 256,
            5,
            tokens.tolist(),
            None,
            ids.ravel().tolist(),
            w.ravel().tolist(),
        )
        body = wire.encode_drafts(d, SESSION)[wire.HEADER.size :]
        assert end.unpack(r, body) == (RoundEvent.OK, "")
        ids[-1, 7] = ids[-1, 3]
        d = dataclasses.replace(d, q_ids=ids.ravel().tolist())
        bad = wire.encode_drafts(d, SESSION)[wire.HEADER.size :]
        assert end.unpack(r, bad) == (RoundEvent.PROTOCOL, f"entry 255: draft 4: id {ids[-1, 3]} repeated")
        del end

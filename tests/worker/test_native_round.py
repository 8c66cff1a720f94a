"""The worker's per-round path in C (``hf_worker_round``, worker.native_round) against the
Python reference it replaces (wire.decode_round, check_for_session, drafting_batch).

Two sessions of the same terms take the same random rounds, one by each path: good
rounds (NEW_GEN, continuing entries, gaps, unknown slots, windows that wrap, rings that
keep more than the window, entries longer than the ring, contexts past a position
table) and broken ones (every field corrupted, slots out of range or named
twice). Each round must get the same verdict from both (the same ProtocolError, or none)
and, when accepted, the same statuses, width and DraftBatch; the windows must be equal
after every round, refused ones included (a refused round changes nothing).
"""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote_dspark import wire
from remote_dspark.worker import native_round
from remote_dspark.worker.history import History
from remote_dspark.worker.limits import Limits
from remote_dspark.worker.round import drafting_batch
from remote_dspark.worker.sessions import Session
from remote_dspark.worker.windows import Windows

BATCH_FIELDS = ("tokens", "offsets", "n_out", "rows", "slots", "gens", "lengths", "positions", "temperature", "seed")
BATCH_FIELDS += ("kept_from",)
WINDOW_ARRAYS = ("ring", "written", "gen", "next_pos", "known")


@pytest.fixture(scope="module")
def rounds(lib):
    return native_round.NativeRounds(lib)


def _session(terms, keep=None, history=None) -> Session:
    max_slots, window, num_spec, row_bytes, sampled = terms
    windows = Windows(max_slots, window, keep)
    return Session(7, max_slots, num_spec, False, windows, row_bytes=row_bytes, want_sampled=sampled, history=history)


def _round(rng: random.Random, session: Session, next_pos: dict, round_id: int) -> tuple[wire.Header, bytes]:
    """A random ROUND for ``session``, honest or broken (a field corrupted)."""
    w = session.windows
    n = rng.randint(0, w.max_slots)
    slots = rng.sample(range(w.max_slots), n)
    if n and rng.random() < 0.08:
        slots[-1] = slots[0] if n > 1 else w.max_slots + rng.randint(0, 3)  # twice, or outside the session
    positions, flags, tokens, offsets = [], [], [], [0]
    for s in slots:
        new = s not in next_pos or rng.random() < 0.2
        k = rng.choice([0, 1, 3, w.window - 1, w.window + 2, 2 * w.window + 1, w.keep - 1, w.keep + 3])
        pos = rng.randint(0, 50) if new else next_pos[s] + (rng.randint(1, 3) if rng.random() < 0.1 else 0)
        positions.append(pos)
        flags.append(wire.FLAG_NEW_GEN if new else 0)
        tokens += [rng.randint(-2, 99) for _ in range(k)]
        offsets.append(len(tokens))
        next_pos[s] = pos + k
    n_out = [rng.randint(0, session.num_spec + 3) for _ in slots]
    sampled = {}
    if session.want_sampled:
        temperature = [rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in slots]
        sampled = dict(temperature=temperature, seed=[rng.getrandbits(64) for _ in slots])
    frame = wire.encode_round(
        round_id,
        session.session,
        rng.randint(0, 100),
        slots=[s % (1 << 32) for s in slots],
        positions=positions,
        n_out=n_out,
        flags=flags,
        offsets=offsets,
        tokens=tokens,
        rows=rng.randbytes(n * session.row_bytes),
        row_bytes=session.row_bytes,
        **sampled,
    )
    hdr, payload = wire.decode_header(frame[: wire.HEADER.size]), bytearray(frame[wire.HEADER.size :])
    if rng.random() < 0.2:
        _break(rng, payload, n, session.want_sampled)
    return hdr, payload


def _break(rng: random.Random, payload: bytearray, n: int, sampled: bool) -> None:
    """One field of the payload made wrong (or the payload cut or grown)."""
    how = rng.randrange(5)
    if how == 0 or not n:
        if rng.random() < 0.5:
            del payload[rng.randrange(len(payload) + 1) :]
        else:
            payload.extend(b"\0" * 4)
        return
    meta = wire.round_meta_bytes(n, sampled) // 4
    word = rng.randrange(meta) if how == 1 else rng.randrange(4 if how == 2 else meta)
    value = rng.choice([0, 1, 2, 3, 65, 4097, 1 << 20, 1 << 31, 0x7FC00000, 0xFF800000, 0xBF800000, 0xFFFFFFFF])
    payload[4 * word : 4 * word + 4] = value.to_bytes(4, "little")


def _python(session, hdr, payload, limits, max_positions):
    rnd = wire.decode_round(hdr, payload, session.want_sampled)
    return (rnd.deadline_ms, *drafting_batch(session, rnd, limits, max_positions))


def _verdict(fn, *args):
    try:
        return fn(*args), None
    except wire.ProtocolError as e:
        return None, str(e)


def _same_windows(a: Windows, b: Windows):
    for name in WINDOW_ARRAYS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    max_slots=st.integers(1, 12),
    window=st.integers(1, 8),
    num_spec=st.integers(1, 6),
    row_bytes=st.integers(0, 6),
    sampled=st.booleans(),
    max_positions=st.one_of(st.none(), st.integers(8, 80)),
    max_round_tokens=st.integers(20, 400),
    more=st.one_of(st.none(), st.integers(0, 12)),
)
def test_the_c_path_takes_every_round_as_the_reference_does(
    rounds, seed, max_slots, window, num_spec, row_bytes, sampled, max_positions, max_round_tokens, more
):
    """``more``: a ring keeping ``window + more`` tokens a slot, for a drafter that keeps
    whole streams (the batch then names what each stream keeps); None: the window only."""
    rng = random.Random(seed)
    terms = (max_slots, window, num_spec, row_bytes, sampled)
    keep = None if more is None else window + more
    ref, nat = (_session(terms, keep, None if more is None else History()) for _ in range(2))
    limits = Limits(max_slots=max_slots, max_round_tokens=max_round_tokens, window=window)
    next_pos: dict[int, int] = {}
    for round_id in range(1, 9):
        hdr, payload = _round(rng, ref, next_pos, round_id)
        want, want_error = _verdict(_python, ref, hdr, bytes(payload), limits, max_positions)
        got, got_error = _verdict(rounds.drafting_batch, nat, hdr, payload, limits, max_positions)
        assert got_error == want_error
        _same_windows(nat.windows, ref.windows)
        if want is None:
            continue
        deadline, slots, ok, drafted, width, batch = got
        w_deadline, w_slots, w_ok, w_drafted, w_width, w_batch = want
        assert (deadline, width) == (w_deadline, w_width)
        np.testing.assert_array_equal(slots, w_slots)
        np.testing.assert_array_equal(ok, w_ok)
        np.testing.assert_array_equal(drafted, w_drafted)
        for name in BATCH_FIELDS:
            a, b = getattr(batch, name), getattr(w_batch, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert np.asarray(a).dtype == np.asarray(b).dtype, name
                np.testing.assert_array_equal(a, b, err_msg=name)
        assert (batch.width, batch.want_margin) == (w_batch.width, w_batch.want_margin)
        assert (batch.session, w_batch.session) == (nat.windows.serial, ref.windows.serial)
        assert (batch.history, w_batch.history) == (nat.history, ref.history)


def _frame(session, *, slots, positions=None, flags=None, tokens=(), offsets=None, n_out=None, **kw):
    n = len(slots)
    frame = wire.encode_round(
        1,
        session.session,
        0,
        slots=slots,
        positions=positions or [0] * n,
        n_out=n_out or [2] * n,
        flags=flags if flags is not None else [wire.FLAG_NEW_GEN] * n,
        offsets=offsets or [0] * (n + 1),
        tokens=list(tokens),
        rows=bytes(n * session.row_bytes),
        row_bytes=session.row_bytes,
        **kw,
    )
    return wire.decode_header(frame[: wire.HEADER.size]), bytearray(frame[wire.HEADER.size :])


@pytest.mark.parametrize(
    "change, rule, message",
    [
        (lambda p: p.__delitem__(slice(8, None)), 1, "under 16"),
        (lambda p: p.__setitem__(slice(4, 8), (5000).to_bytes(4, "little")), 2, "over the cap 4096"),
        (lambda p: p.__setitem__(slice(8, 12), (2 << 20).to_bytes(4, "little")), 3, "row_bytes"),
        (lambda p: p.__setitem__(slice(12, 16), (5 << 20).to_bytes(4, "little")), 4, "tokens over the cap"),
        (lambda p: p.extend(b"\0\0\0\0"), 5, "its fields say"),
        (lambda p: p.__setitem__(slice(16 + 12 * 2, 20 + 12 * 2), (2).to_bytes(4, "little")), 6, "unknown bits"),
        (lambda p: p.__setitem__(slice(16 + 8 * 2, 20 + 8 * 2), (65).to_bytes(4, "little")), 7, "n_out: 65"),
        (lambda p: p.__setitem__(slice(16 + 16 * 2, 20 + 16 * 2), (1).to_bytes(4, "little")), 8, "offsets run"),
    ],
)
def test_each_rule_of_the_contract_is_refused_by_c_and_named_by_the_reference(rounds, lib, change, rule, message):
    session = _session((4, 4, 3, 2, False))
    hdr, payload = _frame(session, slots=[0, 1])
    change(payload)
    view = rounds.view(session, Limits(max_slots=4, window=4), None)
    from remote_dspark.native import BatchOut

    out = BatchOut(n_room=0)
    data = np.frombuffer(payload, np.uint8)
    assert lib.worker_round(view, data.ctypes.data, len(data), out) == rule
    with pytest.raises(wire.ProtocolError, match=message):
        rounds.drafting_batch(session, hdr, payload, Limits(max_slots=4, window=4), None)


@pytest.mark.parametrize(
    "frame_kw, limits_kw, message",
    [
        (dict(slots=[0, 1, 2], offsets=[0, 2, 1, 2], tokens=[5, 6]), {}, "offsets go back"),
        (dict(slots=[0, 7]), {}, r"slots\[1\]: slot 7 outside the session's 4 slots"),
        (dict(slots=[2, 2]), {}, r"slots\[1\]: slot 2 already named by entry 0"),
        (dict(slots=[0], offsets=[0, 9], tokens=range(9)), dict(max_round_tokens=8), "over this worker's 8"),
    ],
)
def test_the_session_s_rules_are_refused_before_any_window_changes(rounds, frame_kw, limits_kw, message):
    session = _session((4, 4, 3, 2, False))
    before = {name: getattr(session.windows, name).copy() for name in WINDOW_ARRAYS}
    hdr, payload = _frame(session, **frame_kw)
    with pytest.raises(wire.ProtocolError, match=message):
        rounds.drafting_batch(session, hdr, payload, Limits(max_slots=4, window=4, **limits_kw), None)
    for name, was in before.items():
        np.testing.assert_array_equal(getattr(session.windows, name), was)


def test_a_sampled_round_s_bad_temperature_and_another_row_size_are_refused(rounds):
    session = _session((4, 4, 3, 2, True))
    hdr, payload = _frame(session, slots=[0, 1], temperature=[1.0, 0.5], seed=[1, 2])
    at = wire.round_sections(2, 0, 2, sampled=True).temperature + 4
    payload[at : at + 4] = np.float32(np.nan).tobytes()
    with pytest.raises(wire.ProtocolError, match="temperature of entry 1: nan"):
        rounds.drafting_batch(session, hdr, payload, Limits(max_slots=4, window=4), None)
    other = Session(7, 4, 3, False, Windows(4, 4), row_bytes=3)
    hdr, payload = _frame(session, slots=[0])
    with pytest.raises(wire.ProtocolError, match="row_bytes 2, the session said 3"):
        rounds.drafting_batch(other, hdr, payload, Limits(max_slots=4, window=4), None)


def test_a_round_announcing_more_entries_than_it_holds_allocates_nothing_for_them(rounds):
    """The batch's buffer is sized by what the payload can hold and the session's slots,
    never by the peer's count: 4,096 entries announced in 36 bytes, to a session of a
    256 Ki-token window, is refused without a 4 GiB buffer for their contexts."""
    import tracemalloc

    session = Session(7, 4, 3, False, Windows(4, 1 << 18), row_bytes=0)
    payload = bytearray(wire.ROUND_FIXED.pack(0, 4096, 0, 0) + bytes(20))
    hdr = wire.Header(wire.ROUND, len(payload), 7, 1)
    tracemalloc.start()
    try:
        with pytest.raises(wire.ProtocolError, match="its fields say"):
            rounds.drafting_batch(session, hdr, payload, Limits(max_slots=4, window=1 << 18), None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_the_worker_s_terms_are_each_call_s_as_the_reference_takes_them(rounds):
    """max_round_tokens and max_positions as given to this call, not as the session's first
    call had them; a position table past what 64 bits hold is no table at all."""
    ref, nat = _session((2, 4, 4, 0, False)), _session((2, 4, 4, 0, False))
    roomy = Limits(max_slots=2, window=4)
    hdr, payload = _frame(nat, slots=[0], n_out=[4], offsets=[0, 3], tokens=[1, 2, 3])
    _python(ref, hdr, bytes(payload), roomy, None)
    rounds.drafting_batch(nat, hdr, payload, roomy, None)

    def step(position):  # three more tokens of slot 0, continuing its window
        return _frame(nat, slots=[0], positions=[position], flags=[0], n_out=[4], offsets=[0, 3], tokens=[4, 5, 6])

    hdr, payload = step(3)
    with pytest.raises(wire.ProtocolError, match="ROUND of 3 tokens, over this worker's 2"):
        rounds.drafting_batch(nat, hdr, payload, Limits(max_slots=2, window=4, max_round_tokens=2), None)
    for i, table in enumerate((8, 1 << 64, (1 << 64) + 3)):  # 8: the context ends at 6, its drafts pass it
        hdr, payload = step(3 + 3 * i)
        want = _python(ref, hdr, bytes(payload), roomy, table)
        got = rounds.drafting_batch(nat, hdr, payload, roomy, table)
        assert got[3].tolist() == want[3].tolist() == [table != 8], table
        _same_windows(nat.windows, ref.windows)


def test_arrays_that_cannot_hold_an_accepted_round_are_refused_not_overrun(rounds, lib):
    from remote_dspark.native import BatchOut

    session = _session((4, 4, 3, 2, False))
    hdr, payload = _frame(session, slots=[0, 1], offsets=[0, 1, 2], tokens=[3, 4])
    data = np.frombuffer(payload, np.uint8)
    view = rounds.view(session, Limits(max_slots=4, window=4), None)
    assert lib.worker_round(view, data.ctypes.data, len(data), BatchOut(n_room=2)) == 15  # WR_ROOM: no arrays
    assert not session.windows.known.any()  # nothing applied


def test_a_refusal_the_reference_would_accept_is_a_loud_bug_not_a_silent_drop(rounds):
    session = _session((4, 4, 3, 2, False))
    hdr, payload = _frame(session, slots=[0, 1], offsets=[0, 1, 2], tokens=[3, 4])
    wrong = native_round.NativeRounds.__new__(native_round.NativeRounds)
    wrong._views, wrong._call, wrong.lib = rounds._views, lambda *args: 6, rounds.lib
    with pytest.raises(RuntimeError, match=r"rule 6.*disagree"):
        wrong.drafting_batch(session, hdr, payload, Limits(max_slots=4, window=4), None)


def test_a_worker_without_the_library_serves_rounds_by_the_python_path(monkeypatch, caplog):
    from remote_dspark import native
    from remote_dspark.drafter.markov import MarkovDrafter, MarkovModel
    from remote_dspark.worker import Worker

    def unavailable(*args, **kw):
        raise native.NativeError("no C compiler 'cc' on PATH")

    monkeypatch.setattr(native, "load", unavailable)
    w = Worker(MarkovDrafter(MarkovModel.from_tokens([1, 2, 3, 1, 2, 3], order=1)), "127.0.0.1", 0)
    assert w.round_path == "python"
    assert "no C compiler" in caplog.text and "Python path" in caplog.text
    with pytest.raises(ValueError, match="round_path 'rust'"):
        Worker(MarkovDrafter(MarkovModel.from_tokens([1, 2, 3], order=1)), "127.0.0.1", 0, round_path="rust")


def test_rounds_in_c_and_a_concurrent_forget_all_keep_the_windows_whole(rounds):
    """A new session of the engine forgets the old windows from another connection's
    thread while rounds go in by C: each round sees its slots either kept or forgotten
    (RESYNC), never half, and a NEW_GEN after the last forget is served whole."""
    import threading

    session = _session((64, 8, 4, 0, False))
    limits = Limits(max_slots=64, window=8)
    stop, errors = threading.Event(), []  # errors: the round thread's findings, asserted after the join

    def forget():
        while not stop.is_set():
            session.windows.forget_all()

    def announce():
        return _frame(session, slots=list(range(64)), offsets=list(range(0, 65)), tokens=list(range(64)))

    t = threading.Thread(target=forget)
    t.start()
    try:
        position = None
        for _ in range(300):
            if position is None:
                hdr, payload = announce()
                position = 1
            else:
                hdr, payload = _frame(
                    session, slots=list(range(64)), positions=[position] * 64, flags=[0] * 64,
                    offsets=list(range(0, 65)), tokens=[7] * 64,
                )  # fmt: skip
                position += 1
            _, _, ok, _, _, batch = rounds.drafting_batch(session, hdr, payload, limits, None)
            if not (ok.all() or not ok.any()) or len(batch) != ok.sum():  # a forget is never mid-round
                errors.append(f"a round saw {int(ok.sum())} of 64 slots kept and drafted {len(batch)}")
            if not ok.all():
                position = None  # re-announce, as the engine does after RESYNC
    finally:
        stop.set()
        t.join(10)
    assert not errors and not t.is_alive()
    hdr, payload = announce()
    assert rounds.drafting_batch(session, hdr, payload, limits, None)[2].all()
    session.windows.forget_all()  # then the next continuing round finds no window: RESYNC, nothing drafted
    step = dict(slots=list(range(64)), positions=[1] * 64, flags=[0] * 64, offsets=list(range(65)), tokens=[7] * 64)
    _, _, ok, _, _, batch = rounds.drafting_batch(session, *_frame(session, **step), limits, None)
    assert not ok.any() and len(batch) == 0
    hdr, payload = announce()
    _, _, ok, _, _, batch = rounds.drafting_batch(session, hdr, payload, limits, None)
    assert ok.all() and len(batch) == 64 and batch.tokens.tolist() == list(range(64))

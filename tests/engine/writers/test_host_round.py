"""The engine's host round in C (engine.host_round: ``hf_host_round``, ``hf_host_answer``
and ``hf_host_summary``) against the Python steps it replaces: ``write_round_meta`` (its
Python way) and ``gather_rows_host`` into the round's descriptor and staging slot, the
round word and ``gathered``; ``to_drafts`` of the released drafts slot, and the count of
a launched round.

Random batches, honest and broken (test_native_meta's, with rows and a row index of
int32 or int64, as a tensor or an array, now and then naming a row that is not there;
the cut read from the acknowledged-context word): both ways give the same verdict (the
same ValueError, or none) and, when accepted, the same descriptor and staging bytes; a
refused batch hands nothing over. Random answers in a drafts slot come back as the same
``Drafts`` and the same count. And an engine's rounds against a worker are the same,
and counted the same, with the C calls as without them; a round the call handed over
stays handed over whatever is raised after it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading
import time

import numpy as np
import pytest
import torch
from engines import async_env, batch, make
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_meta import NUM_SPEC, ROW_BYTES, _spec, batches

from remote_dspark import wire
from remote_dspark.engine.values.batch import Batch, gather_rows_host
from remote_dspark.engine.values.drafts import to_drafts
from remote_dspark.engine.values.slot_views import SlotViews
from remote_dspark.engine.writers.host_round import HostRound
from remote_dspark.engine.writers.native_meta import NativeMeta, write_round_meta
from remote_dspark.outcome import Outcome
from remote_dspark.shm import memfd
from remote_dspark.shm.layout import OFF_CONTEXT

DEPTH, N_ROWS = 2, 9


class Side:
    """One region and the views of its slot for round ``r``: one way's result."""

    def __init__(self, lib, spec, hold_us: int = 0):
        self.lib, self.spec = lib, spec
        self.region = memfd.Region.create(
            memfd.Layout(DEPTH, spec.max_slots, spec.row_bytes, spec.num_spec, spec.max_tokens)
        )
        self.views = [SlotViews(self.region, i) for i in range(DEPTH)]
        self.acked_at = self.region.addr(OFF_CONTEXT)  # the worker's acknowledged context, as the proxy writes it
        self.host = HostRound(lib, self.region, spec, NativeMeta(lib, spec, self.acked_at), hold_us)

    def word(self, name: str) -> int:
        return self.lib.load32(self.region.addr(getattr(self.region.layout, name)))

    def close(self) -> None:
        self.views = []
        self.region.close()

    def __enter__(self) -> Side:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:  # (a failure's traceback still holds views: the region stays mapped)
            self.close()


@pytest.fixture
def sides(lib):
    made = []

    def make_side(spec, hold_us=0):
        made.append(Side(lib, spec, hold_us))
        return made[-1]

    yield make_side
    for side in made:
        side.close()


@st.composite
def with_rows(draw):
    """test_native_meta's batches with rows, an engine's cap of 4 or 64 context tokens
    and a worker's acknowledged context (0: none yet; past the cap; past the u32's sign):
    ``(batch, acked, spec)``."""
    b, _, _, spec = draw(batches())
    spec = dataclasses.replace(spec, context_tokens=draw(st.sampled_from([4, 64])))
    acked = draw(st.sampled_from([0, 1, 3, 4, 5, 63, 64, 65, 1 << 31, (1 << 32) - 1]))
    n = len(b)
    index = draw(st.lists(st.integers(0, N_ROWS - 1), min_size=n, max_size=n))
    if n and draw(st.integers(0, 5)) == 0:
        index[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, N_ROWS, N_ROWS + 3]))
    index = np.asarray(index, dtype=draw(st.sampled_from([np.int32, np.int64])))
    if draw(st.booleans()):
        index = torch.from_numpy(index)
    seed = draw(st.integers(0, 1 << 16))
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randint(0, 256, (N_ROWS, ROW_BYTES + 9), dtype=torch.uint8, generator=gen)
    rows = draw(st.sampled_from(["packed", "words", "apart"]))
    if rows == "apart":  # rows ROW_BYTES + 9 bytes apart, the first at an odd address
        rows = wide[:, 5 : 5 + ROW_BYTES]
    else:  # packed rows, or the same as four-byte words
        rows = wide[:, :ROW_BYTES].contiguous().view(torch.uint8 if rows == "packed" else torch.int32)
    return Batch(b.slots, b.tokens, b.token_offsets, b.positions, b.new_gen, rows, index, b.n_out), acked, spec


def _python(side: Side, b: Batch, r: int, acked: int):
    """The Python steps' verdict, descriptor and staging bytes."""
    v = side.views[r % DEPTH]
    try:
        size = write_round_meta(side.spec, None, b, v.desc, v.desc_addr, lambda: acked)
        staging = side.region.addr(side.region.layout.staging(r % DEPTH))
        gather_rows_host(b, v.staging, side.spec.row_bytes, side.lib, staging)
    except ValueError as e:
        return str(e), b"", b""
    return None, v.desc[:size].tobytes(), v.staging[: len(b)].tobytes()


def _pending(side: Side, r: int) -> int:
    """Round ``r``'s rows-pending count (the entries whose rows are still to come)."""
    return side.lib.load32(side.region.addr(side.region.layout.desc(r % DEPTH) + memfd.DESC_PENDING))


def _native(side: Side, b: Batch, r: int, acked: int):
    v = side.views[r % DEPTH]
    v.desc[:] = 0xAB
    side.lib.store32(side.region.addr(side.region.layout.desc(r % DEPTH) + memfd.DESC_PENDING), 0xABAB)
    side.lib.store32(side.acked_at, acked)
    try:
        released = side.host.hand_over(b, r)
    except ValueError as e:
        assert side.word("gathered") != r, "a refused batch was handed over"
        return str(e), b"", b""
    assert released is False  # no proxy, no hold
    assert side.word("gathered") == r and int(v.round_word[0]) == r and _pending(side, r) == 0
    size = side.host._meta._m.written
    return None, v.desc[:size].tobytes(), v.staging[: len(b)].tobytes()


@settings(max_examples=200, deadline=None)
@given(case=with_rows(), r=st.integers(1, 50))
def test_the_c_hand_over_and_the_python_steps_agree_verdict_for_verdict_and_byte_for_byte(lib, case, r):
    b, acked, spec = case
    with Side(lib, spec) as python, Side(lib, spec) as c:
        want = _python(python, b, r, acked)
        assert _native(c, b, r, acked) == want


def test_rows_copied_after_the_round_is_published_land_whole_and_are_all_counted_in(lib):
    """Rows of 40,000 bytes: the copy counts the pending entries down a row at a time
    (about 64 KiB a step), after `gathered`; every row lands, and none is left counted."""
    spec = dataclasses.replace(_spec(), row_bytes=40_000)
    gen = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 256, (N_ROWS, spec.row_bytes), dtype=torch.uint8, generator=gen)
    index = torch.tensor([8, 0, 3, 3, 7], dtype=torch.int64)
    n = len(index)
    b = Batch.from_lists(list(range(n)), [[1]] * n, [0] * n, [True] * n, rows, index)
    with Side(lib, spec) as python, Side(lib, spec) as c:
        want = _python(python, b, 3, 0)
        assert _native(c, b, 3, 0) == want and want[2] == rows[index].numpy().tobytes()


def test_the_copys_count_never_runs_ahead_of_the_rows(lib):
    """Rows of 1 MiB, counted in one at a time: an observer that sees the count fall
    (spinning in C, with the GIL released: the hand-over here is called releasing it too)
    finds every row it no longer covers already in staging, which held a marker before.
    A count stored ahead of its row is seen while that row is still being copied: the
    observer reads the row's tail, which a copy writes last, a few microseconds after."""
    spec = dataclasses.replace(_spec(), row_bytes=1 << 20)
    n, r = 6, 1
    rows = torch.randint(0, 256, (n, spec.row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    b = Batch.from_lists(list(range(n)), [[1]] * n, [0] * n, [True] * n, rows, torch.arange(n).flip(0))
    want = rows.flip(0).numpy()
    free = ctypes.CDLL(lib.path)  # the same library's calls, releasing the GIL
    free.hf_host_round.restype, free.hf_host_round.argtypes = ctypes.c_int, (ctypes.c_void_p,)
    free.hf_rows_wait.restype = ctypes.c_uint32
    free.hf_rows_wait.argtypes = (ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64)
    with Side(lib, spec) as side:
        side.host._round = free.hf_host_round
        desc = side.region.addr(side.region.layout.desc(r % DEPTH))
        staging = side.views[r % DEPTH].staging
        for _ in range(5):
            staging[:n] = 0xEE
            side.lib.store32(desc + memfd.DESC_PENDING, n)
            engine = threading.Thread(target=side.host.hand_over, args=(b, r))
            engine.start()
            try:
                seen, deadline = n, time.monotonic_ns() + 5_000_000_000
                while seen and time.monotonic_ns() < deadline:
                    seen = free.hf_rows_wait(desc, seen, deadline)
                    done = n - seen  # the last row counted in first, its tail first: a copy writes it last
                    assert done, "no row counted in within 5 s"
                    late = not (staging[done - 1, -4096:] == want[done - 1, -4096:]).all()
                    assert not late and (staging[:done] == want[:done]).all(), f"{seen} rows counted in uncopied"
                assert seen == 0
            finally:
                engine.join(5.0)
            assert not engine.is_alive()
            r += DEPTH  # the same slot, a later round
        del staging  # (a view of the region: it must go before the region is closed)


def test_rows_never_copied_cost_the_proxy_naps_not_a_core(lib):
    """An engine stopped mid-copy (SIGSTOP) leaves its rows pending: the proxy's wait
    spins and yields for about a millisecond, then naps between looks until the round's
    deadline, returning the count as it is. Its CPU over a 300 ms wait is a few percent
    of it (a spin to the deadline is all of it); the bound is generous."""
    free = ctypes.CDLL(lib.path)  # the call releases the GIL; thread_time counts this thread only
    free.hf_rows_wait.restype = ctypes.c_uint32
    free.hf_rows_wait.argtypes = (ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64)
    desc = np.zeros(64, np.uint8)
    desc[memfd.DESC_PENDING : memfd.DESC_PENDING + 4].view(np.uint32)[0] = 5  # five rows, never copied
    c0, t0 = time.thread_time(), time.monotonic()
    pending = free.hf_rows_wait(desc.ctypes.data, 5, time.monotonic_ns() + 300_000_000)
    wall, cpu = time.monotonic() - t0, time.thread_time() - c0
    assert pending == 5 and wall >= 0.3
    assert cpu < 0.4 * wall, f"{cpu * 1000:.0f} ms of CPU over a {wall * 1000:.0f} ms wait"


def _answer_in(side: Side, r: int, n: int, status: int, rng: np.random.Generator) -> None:
    """A proxy's answer to round ``r`` of ``n`` entries in its drafts slot: random counts
    (tokens zero past each), statuses with some RESYNC, then ``released``."""
    v, k = side.views[r % DEPTH], side.spec.num_spec
    got = n if status == Outcome.OK else 0
    counts = rng.integers(0, k + 1, got).astype(np.int32)
    v.counts[:got] = counts
    v.statuses[:got] = (rng.random(got) < 0.3) * wire.STATUS_RESYNC
    tokens = rng.integers(0, 1000, (got, k)).astype(np.int32)
    v.tokens[:got] = tokens * (np.arange(k) < counts[:, None])
    v.head[:] = (r, status, got, 0)
    side.lib.store32(side.region.addr(side.region.layout.released), r)


@pytest.mark.parametrize("status", [Outcome.OK, Outcome.TIMEOUT, Outcome.WATCHDOG])
def test_the_c_answer_is_the_python_answer(sides, status):
    rng = np.random.default_rng(int(status))
    spec = _spec()
    side = sides(spec)
    for r in range(1, 9):
        n = int(rng.integers(0, spec.max_slots + 1))
        slots = rng.permutation(spec.max_slots)[:n]
        b = Batch(slots, np.zeros(0, np.int64), np.zeros(n + 1, np.int64), np.zeros(n, np.int64), np.zeros(n, bool),
                  torch.zeros(1, ROW_BYTES, dtype=torch.uint8), np.zeros(n, np.int64))  # fmt: skip
        side.host.hand_over(b, r)
        _answer_in(side, r, n, int(status), rng)
        outcome, got = side.host.answer(r, n)
        v = side.views[r % DEPTH]
        m = int(v.head[2])
        answer = v.slots(m), v.counts[:m], v.statuses[:m], v.tokens[:m]
        want = to_drafts(NUM_SPEC, *answer, None, status, False, clean=True)
        assert outcome is status and got.outcome is status and got.source == ("remote" if m else "none")
        assert got.tokens.tolist() == want.tokens.tolist() if m else not got.tokens.any()
        assert got.counts.tolist() == (want.counts.tolist() if m else [0] * n)
        assert got.resync == (want.resync if m else ()) and got.margins is None
        assert got.tokens.shape == (n, NUM_SPEC) and got.tokens.dtype == got.counts.dtype == torch.int32
        counted = (status, int(np.count_nonzero(v.counts[:m])), int(v.counts[:m].sum()), got.resync)
        assert side.host.summary(r) == counted  # a launched round's count: the same answer, summed
        assert got.sums == (counted[1:3] if m else None)  # what the engine counts the round by


def test_an_answer_read_from_a_reused_slot_or_of_another_size_is_refused_loudly(sides):
    side = sides(_spec())
    b = Batch(np.array([1, 2]), np.zeros(0, np.int64), np.zeros(3, np.int64), np.zeros(2, np.int64), np.zeros(2, bool),
              torch.zeros(1, ROW_BYTES, dtype=torch.uint8), np.zeros(2, np.int64))  # fmt: skip
    side.host.hand_over(b, 3)
    side.views[1].head[:] = (5, 0, 2, 0)
    with pytest.raises(RuntimeError, match="drafts slot 1 holds round 5, expected 3"):
        side.host.answer(3, 2)
    side.views[1].head[:] = (3, 0, 1, 0)
    with pytest.raises(RuntimeError, match="1 entries, the round has 2"):
        side.host.answer(3, 2)
    side.views[1].head[:] = (3, 0, 25, 0)  # past the engine's 24 slots: counted as 24, nothing past read
    assert side.host.summary(3)[1:3] == (int(np.count_nonzero(side.views[1].counts)), int(side.views[1].counts.sum()))


def test_the_hold_spins_until_the_release_and_reports_its_cpu(sides):
    side = sides(_spec(), hold_us=2000)
    b = Batch(np.array([1]), np.zeros(0, np.int64), np.zeros(2, np.int64), np.zeros(1, np.int64), np.zeros(1, bool),
              torch.zeros(1, ROW_BYTES, dtype=torch.uint8), np.zeros(1, np.int64))  # fmt: skip
    c0, t0 = time.thread_time(), time.monotonic()
    assert side.host.hand_over(b, 1) is False  # nobody releases: the hold runs out
    spun = time.thread_time() - c0
    assert time.monotonic() - t0 >= 0.002  # the whole hold
    assert 0 < side.host.spin_cpu_s <= spun  # the spin's CPU, within the call's
    side.lib.store32(side.region.addr(side.region.layout.released), 2)  # released ahead (as a proxy would)
    assert side.host.hand_over(b, 2) is True and side.host.spin_cpu_s < spun


@pytest.mark.parametrize(
    "change",
    [
        lambda b: dataclasses.replace(b, rows=torch.zeros(1, 2 * ROW_BYTES, dtype=torch.uint8)[:, ::2]),
        lambda b: dataclasses.replace(b, row_index=np.zeros(1, np.float32)),
        lambda b: dataclasses.replace(b, row_index=b.row_index.to(torch.int16)),
        lambda b: dataclasses.replace(b, rows=b.rows.view(1, 2, -1)),
        lambda b: dataclasses.replace(b, rows=None, row_index=None),
    ],
    ids=["rows strided within", "float index", "int16 index", "three-dimensional rows", "no rows"],
)
def test_rows_the_c_call_does_not_take_go_the_python_way(sides, change):
    """None from hand_over, nothing handed over: the Python steps gather them (or name
    what is missing)."""
    spec = _spec()
    b = change(
        Batch(
            np.array([1]),
            np.zeros(0, np.int64),
            np.zeros(2, np.int64),
            np.zeros(1, np.int64),
            np.zeros(1, bool),
            torch.zeros(ROW_BYTES, ROW_BYTES, dtype=torch.uint8)[:1],
            torch.zeros(1, dtype=torch.int64),
        )  # fmt: skip
    )
    side = sides(spec)
    assert side.host.hand_over(b, 1) is None and side.word("gathered") != 1


# --------------------------------------------------------------------------- an engine


def _counted(call, calls: list, *args):
    calls.append(args)
    return call(*args)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_an_engines_rounds_are_the_same_with_the_c_calls_as_without(worker, tmp_path, mode):
    rounds = [
        batch(),
        batch(new=False, tokens=((2, 3), (4,)), positions=(1, 1)),
        batch(slots=(3, 0, 1), tokens=((5, 6, 7), (4,), (1,)), positions=(0, 3, 2), new=False),
    ]
    got = {}
    # Every round is to come back OK: a deadline a loaded machine (xdist's other worker
    # beside the proxy) cannot pass, not the 50 ms default.
    env = async_env(worker.port, tmp_path, mode, VLLM_DSPARK_REMOTE_TIMEOUT_MS="2000")
    for host in (True, False):
        with make(env) as rd:
            handoff, calls = rd._path.inner.handoff, []
            handoff._host_round._round = functools.partial(_counted, handoff._host_round._round, calls)
            if not host:  # the Python steps
                handoff._host_round.hand_over = lambda *_: None
                handoff._host_round.answer = handoff._answer_python
            got[host] = [(o.outcome, o.tokens.tolist(), o.counts.tolist(), o.resync) for o in map(rd.round, rounds)]
            assert len(calls) == (len(rounds) if host else 0)
            stats = rd.stats()
            got[host].append((stats.drafts, stats.draft_tokens, stats.resyncs))  # counted the same
    assert got[True] == got[False]
    assert all(outcome is Outcome.OK for outcome, *_ in got[True][:-1]) and got[True][-1][1] > 0


def test_a_round_handed_over_is_kept_when_an_exception_comes_after_the_call(worker, tmp_path):
    """A KeyboardInterrupt (a signal handler's exception) raised as the C call returns,
    with gathered stored: the round is the proxy's, so its id is not given back, and the
    next round gets its own answer, not the interrupted one's."""
    with make(async_env(worker.port, tmp_path, "process")) as rd:
        handoff = rd._path.inner.handoff
        assert rd.round(batch()).outcome is Outcome.OK
        call = handoff._host_round._round

        def interrupted(ref):
            call(ref)
            raise KeyboardInterrupt

        handoff._host_round._round = interrupted
        with pytest.raises(KeyboardInterrupt):
            rd.round(batch(new=False, tokens=((2,), (4,)), positions=(1, 1)))
        handoff._host_round._round = call
        assert handoff.end.gathered() == handoff.end.last  # the interrupted round stayed handed over
        out = rd.round(batch(slots=(2, 3), tokens=((1,), (1, 2)), positions=(0, 0)))
        assert out.outcome is Outcome.OK and out.tokens.tolist() == [[2, 3, 4], [3, 4, 1]]


def test_metadata_on_a_device_is_refused_by_a_cpu_engine_leaving_no_hole(worker, tmp_path):
    """Slots on a device (torch's meta device stands in for one) cannot be read by the
    host: named, nothing handed over, and the next round takes the round id back."""
    with make(async_env(worker.port, tmp_path, "process")) as rd:
        handoff = rd._path.inner.handoff
        assert rd.round(batch()).outcome is Outcome.OK
        last = handoff.end.last
        on_device = batch(new=False, tokens=((2,), (4,)), positions=(1, 1))
        on_device.slots = torch.as_tensor(on_device.slots).to("meta")
        with pytest.raises(ValueError, match="batch metadata on a device, but RemoteDSpark runs on the CPU"):
            rd.round(on_device)
        assert handoff.end.last == last and handoff.end.gathered() == last
        assert rd.round(batch(new=False, tokens=((2,), (4,)), positions=(1, 1))).outcome is Outcome.OK

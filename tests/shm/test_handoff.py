"""The hand-off across real processes: the engine here, the proxy a child interpreter
that gets the region's fd through ``pass_fds`` and nothing else.

Every child is ended by the test that started it (``child``: kill + wait in finally);
every wait has a deadline; nothing sleeps hoping another process got somewhere.
"""

from __future__ import annotations

import json
import os
import select
import textwrap
import threading
import time
from collections import deque

import pytest
from helpers import CHILD_TIMEOUT_S, child, finish, until

from remote_dspark import native, wire
from remote_dspark.outcome import Outcome
from remote_dspark.proxy import ring_end
from remote_dspark.shm import layout, memfd, ring, streamsync
from remote_dspark.shm.ring import seq_add


def proxy_code(fd: int, body: str, want_margin: bool = False) -> str:
    """A child's program: attach the region on ``fd``, make a ProxyEnd (of a session that
    asked for margins or not), run ``body``."""
    return textwrap.dedent(f"""
        import json, os, random, sys
        from remote_dspark import native, wire
        from remote_dspark.outcome import Outcome
        from remote_dspark.proxy import ring_end
        from remote_dspark.shm import ring, memfd
        lib = native.load()
        region = memfd.Region.attach({fd})
        end = ring_end.ProxyEnd(region, lib, spin_us=200, nap_us=50, want_margin={want_margin})
    """) + textwrap.dedent(body)


def make_region(depth=4, max_slots=8, row_bytes=16, num_spec=4, max_tokens=64) -> memfd.Region:
    return memfd.Region.create(layout.Layout(depth, max_slots, row_bytes, num_spec, max_tokens))


def test_round_crosses_and_comes_back_with_its_drafts(lib):
    """The child rebuilds the ROUND frame from the region's bytes (wire_parts), decodes it
    with the wire module and answers drafts computed from what it decoded."""
    with make_region(max_slots=16) as region:
        eng = ring.EngineEnd(region, lib)
        sync = streamsync.HostFlagSync(region, lib, spin_us=200, nap_us=50)
        code = proxy_code(
            region.fd,
            """
            rnd = end.next_round(10)
            parts = rnd.wire_parts(session=77)
            frame = b"".join(bytes(p) for p in parts)
            del parts
            hdr = wire.decode_header(frame[:wire.HEADER.size])
            r = wire.decode_round(hdr, frame[wire.HEADER.size:])
            rows = bytes(r.rows)
            k = region.layout.num_spec
            toks = []
            for i, e in enumerate(r.entries()):
                row = rows[i * r.row_bytes:(i + 1) * r.row_bytes]
                toks += [e.slot * 1000 + sum(e.tokens) + row[j] for j in range(k)]
            d = wire.DraftsFrame(rnd.round, [e.slot for e in r.entries()], [r.entries()[0].n_out, 0],
                            [wire.STATUS_OK, wire.STATUS_RESYNC], k, toks, [0.25] * len(toks))
            del r, rows
            print(json.dumps({"session": hdr.session, "round": hdr.round,
                              "ok": end.complete(rnd, d)}))
            region.close()
        """,
            want_margin=True,
        )
        entries = [wire.Entry(5, 4, 10, [1, 2, 3]), wire.Entry(9, 2, 0, [7], new_gen=True)]
        with child(code, lib, (region.fd,)) as proc:
            r = eng.reserve(1)
            eng.write_entries(r, entries, deadline_ms=50)
            with eng.staging(r) as rows:
                rows[:32] = bytes(range(32))
            h = sync.handoff(r, CHILD_TIMEOUT_S)
            assert h.ok and h.latency_ns > 0
            got = json.loads(finish(proc))
        assert got == {"session": 77, "round": r, "ok": True}
        d = eng.drafts(r)
        assert d.outcome is Outcome.OK
        assert d.counts == (4, 0)
        assert d.statuses == (wire.STATUS_OK, wire.STATUS_RESYNC)
        assert d.tokens == (tuple(5000 + 6 + j for j in range(4)), ())
        assert d.margins == ((0.25,) * 4, ())
        snap = region.proxy_counters(lib).snapshot()
        assert snap.counters["rounds_ok"] == 1 and snap.counters["draft_tokens"] == 4
        assert snap.histograms["round_latency"].count == 1


def test_watchdog_releases_an_unanswered_round_once_and_drops_the_late_reply(lib):
    """The child takes the round and answers only after somebody else released it: that
    reply is refused (late) and counted; the watchdog released the round exactly once.
    The watchdog starts only once the child holds the round, so it cannot win a start-up
    race instead."""
    took_r, took_w = os.pipe()
    with make_region() as region, os.fdopen(took_r, "rb", 0) as took:
        eng = ring.EngineEnd(region, lib)
        sync = streamsync.HostFlagSync(region, lib, spin_us=200, nap_us=50)
        code = proxy_code(
            region.fd,
            f"""
            rnd = end.next_round(10)
            os.write({took_w}, b"1")
            rc = lib.wait_geq(region.addr(region.layout.released), rnd.round, 100, 100,
                              native.deadline_ns(10))
            assert rc == native.Status.OK
            d = wire.DraftsFrame(rnd.round, list(rnd.slots()), [1], [0], 4, [42, 0, 0, 0])
            print(json.dumps({{"ok": end.complete(rnd, d),
                              "late": end.counters.snapshot().counters["rounds_late"]}}))
        """,
        )
        try:
            with child(code, lib, (region.fd, took_w)) as proc:
                os.close(took_w)
                took_w = -1
                r = eng.reserve(1)
                eng.write_entries(r, [wire.Entry(3, 4, 0, [1])])
                sync.signal(r)
                assert select.select([took], [], [], CHILD_TIMEOUT_S)[0] and took.read(1) == b"1"
                wd = eng.start_watchdog(30)
                assert sync.wait(r, CHILD_TIMEOUT_S)
                waited_ns = time.monotonic_ns() - region_gathered_ns(region, lib, r)
                assert waited_ns >= 30_000_000  # never before the watchdog's deadline
                assert json.loads(finish(proc)) == {"ok": False, "late": 1}
        finally:
            if took_w >= 0:
                os.close(took_w)
        wd.stop()
        d = eng.drafts(r)
        assert d.outcome is Outcome.WATCHDOG and d.counts == ()  # the late reply wrote nothing
        assert eng.counters.snapshot().counters["watchdog_releases"] == 1
        assert region.proxy_counters(lib).snapshot().counters["rounds_late"] == 1
        assert eng.claimed() == eng.released() == eng.gathered() == r


def region_gathered_ns(region: memfd.Region, lib: native.Native, round_id: int) -> int:
    return lib.load64(region.addr(region.layout.gathered_ns(round_id % region.layout.depth)))


def test_rounds_wrap_around_2_to_the_32(lib):
    start = 2**32 - 6
    n = 12
    with make_region(depth=4) as region:
        eng = ring.EngineEnd(region, lib, start=start)
        sync = streamsync.HostFlagSync(region, lib, spin_us=200, nap_us=50, hold_gil_us=50)
        code = proxy_code(
            region.fd,
            f"""
            for _ in range({n}):
                rnd = end.next_round(10)
                d = wire.DraftsFrame(rnd.round, list(rnd.slots()), [1], [0], 4,
                                [rnd.round & 0x7FFFFFFF, 0, 0, 0])
                assert end.complete(rnd, d)
        """,
        )
        seen = []
        with child(code, lib, (region.fd,)) as proc:
            for _ in range(n):
                r = eng.reserve(1)
                eng.write_entries(r, [wire.Entry(1, 1, 0, [])])
                assert sync.handoff(r, CHILD_TIMEOUT_S).ok
                d = eng.drafts(r)
                assert d.outcome is Outcome.OK and d.tokens == ((r & 0x7FFFFFFF,),)
                seen.append(r)
            finish(proc)
        assert seen == [seq_add(start, i) for i in range(1, n + 1)]
        assert seen[4] == 2**32 - 1 and seen[5] == 0
        assert eng.released() == eng.claimed() == seq_add(start, n)


def test_thousands_of_rounds_with_a_randomly_slow_peer(lib):
    """Pipelined rounds (depth 4) across the wrap; the peer sometimes sleeps past the
    watchdog. Every round is answered exactly once, by the proxy or by the watchdog,
    with that answerer's drafts; replies after the watchdog are counted late."""
    n, depth, wd_ms = 3000, 4, 3
    start = 2**32 - n // 2
    last = seq_add(start, n)
    with make_region(depth=depth) as region:
        eng = ring.EngineEnd(region, lib, start=start)
        sync = streamsync.HostFlagSync(region, lib, spin_us=200, nap_us=50)
        code = proxy_code(
            region.fd,
            f"""
            import time
            rng = random.Random(7)
            ok = late = 0
            while True:
                rnd = end.next_round(0.2)
                if rnd is None:
                    if ring.seq_geq(end.claimed(), {last}):
                        break
                    continue
                try:
                    slots = rnd.slots()  # read at once, as a proxy sending the round would
                except ValueError:   # the watchdog answered it and its slot was reused already
                    assert not rnd.pending() and not end.complete(rnd, None, Outcome.ERROR)
                    late += 1
                    continue
                if rng.random() < 0.03:
                    time.sleep(rng.uniform(0, 2 * {wd_ms} / 1000))  # the slow remote
                toks = [(rnd.round * 7 + s) & 0x7FFFFFFF for s in slots for _ in range(4)]
                if end.complete(rnd, wire.DraftsFrame(rnd.round, list(slots), [4] * len(slots),
                                                 [0] * len(slots), 4, toks)):
                    ok += 1
                else:
                    late += 1
            print(json.dumps({{"ok": ok, "late": late}}))
        """,
        )
        tally = {Outcome.OK: 0, Outcome.WATCHDOG: 0}
        pending: deque = deque()

        def check_oldest():
            r, slots = pending.popleft()
            d = eng.drafts(r)
            tally[d.outcome] += 1
            if d.outcome is Outcome.OK:
                assert d.counts == (4,) * len(slots)
                assert d.tokens == tuple(((r * 7 + s) & 0x7FFFFFFF,) * 4 for s in slots)
            else:
                assert d.outcome is Outcome.WATCHDOG and d.counts == ()

        wd = eng.start_watchdog(wd_ms)
        with child(code, lib, (region.fd,)) as proc:
            for i in range(n):
                r = eng.reserve(CHILD_TIMEOUT_S)
                while pending and ring.seq_geq(eng.released(), pending[0][0]):
                    check_oldest()  # before round r reuses the slot of r - depth
                slots = list(range(i % 3 + 1))
                eng.write_entries(r, [wire.Entry(s, 4, i, [i]) for s in slots])
                sync.signal(r)
                pending.append((r, slots))
            assert sync.wait(last, CHILD_TIMEOUT_S)
            while pending:
                check_oldest()
            got = json.loads(finish(proc))
        wd.stop()
        released_by_wd = eng.counters.snapshot().counters["watchdog_releases"]
        proxy = region.proxy_counters(lib).snapshot().counters
        assert tally[Outcome.OK] + tally[Outcome.WATCHDOG] == n
        assert tally[Outcome.WATCHDOG] == released_by_wd
        assert got["ok"] == proxy["rounds_ok"] == tally[Outcome.OK]
        assert got["late"] == proxy["rounds_late"] <= released_by_wd
        assert eng.gathered() == eng.claimed() == eng.released() == last


def test_orphaned_claim_is_released_by_the_engine_once_the_proxy_is_dead(lib):
    """A proxy killed between its claim and its release: the watchdog leaves a claimed
    round alone; the engine releases it (ORPHAN) once the proxy is known dead."""
    with make_region() as region:
        eng = ring.EngineEnd(region, lib)
        sync = streamsync.HostFlagSync(region, lib, spin_us=200, nap_us=50)
        code = proxy_code(
            region.fd,
            """
            rnd = end.next_round(10)
            assert lib.claim(region.addr(region.layout.claim), rnd.round) == 0
            os._exit(0)  # dies holding the claim
        """,
        )
        with child(code, lib, (region.fd,)) as proc:
            r = eng.reserve(1)
            eng.write_entries(r, [])
            sync.signal(r)
            assert proc.wait(CHILD_TIMEOUT_S) == 0  # the proxy is known dead
        wd = eng.start_watchdog(10)
        assert eng.claimed() == r and eng.released() == seq_add(r, -1)
        assert not sync.wait(r, 0.1)  # nobody else may release a claimed round
        assert eng.release_orphans() == 1
        assert sync.wait(r, 1)
        assert eng.drafts(r).outcome is Outcome.ORPHAN
        r2 = eng.reserve(1)  # with no proxy left the watchdog answers the next one
        assert sync.handoff(r2, CHILD_TIMEOUT_S).ok
        assert eng.drafts(r2).outcome is Outcome.WATCHDOG
        wd.stop()
        c = eng.counters.snapshot().counters
        assert c["orphan_releases"] == 1 and c["watchdog_releases"] == 1


def test_back_pressure_when_depth_rounds_are_in_flight(lib):
    with make_region(depth=2) as region:
        eng = ring.EngineEnd(region, lib)
        r1, r2 = eng.try_reserve(), eng.try_reserve()
        assert (r1, r2) == (1, 2)
        assert eng.try_reserve() is None
        with pytest.raises(ring.RingFull, match="2 rounds in flight"):
            eng.reserve(0.02)
        assert eng.counters.snapshot().counters["ring_full"] == 2
        assert eng.release_no_proxy(r1)
        assert not eng.release_no_proxy(r1)  # answered already
        assert eng.drafts(r1).outcome is Outcome.NO_PROXY
        assert eng.try_reserve() == 3
        assert eng.counters.snapshot().counters["no_proxy_rounds"] == 1


def test_proxy_refuses_drafts_that_do_not_fit_before_claiming(lib):
    with make_region() as region:
        eng = ring.EngineEnd(region, lib)
        end = ring_end.ProxyEnd(region, lib)
        r = eng.reserve(1)
        eng.write_entries(r, [wire.Entry(3, 4, 0, [])])
        streamsync.HostFlagSync(region, lib).signal(r)
        rnd = end.next_round(1)
        with pytest.raises(ValueError, match="entry 0: drafts for slot 4, the round has slot 3"):
            end.complete(rnd, wire.DraftsFrame(r, [4], [1], [0], 4, [1, 0, 0, 0]))
        with pytest.raises(ValueError, match="width 5 over num_spec=4"):
            end.complete(rnd, wire.DraftsFrame(r, [3], [1], [0], 5, [1, 0, 0, 0, 0]))
        assert eng.claimed() == 0  # nothing claimed: the round can still be answered
        assert end.complete(rnd, None, Outcome.ERROR)
        assert eng.drafts(r).outcome is Outcome.ERROR
        assert end.counters.snapshot().counters["rounds_error"] == 1
        with pytest.raises(ValueError, match="not one the proxy writes"):
            end.complete(rnd, None, Outcome.WATCHDOG)


def test_take_and_answer_do_the_proxy_bookkeeping_in_c(lib):
    """One native call takes a round (and beats), one answers it: the claim, the drafts
    of only the round's entries, the release and every proxy counter and histogram."""
    with make_region(depth=2) as region:
        eng = ring.EngineEnd(region, lib)
        end = ring_end.ProxyEnd(region, lib, spin_us=100, nap_us=50, want_margin=True)
        sync = streamsync.HostFlagSync(region, lib)
        assert end.next_round(0.001) is None  # nothing gathered: a timeout, and a beat
        beat = end.header.heartbeat_ns
        assert beat > 0
        answers = {
            1: wire.DraftsFrame(
                1, [3, 4, 5], [2, 0, 4], [0, wire.STATUS_RESYNC, 0], 4, [1, 2, 0, 0, 0, 0, 0, 0, 9, 8, 7, 6], [0.5] * 12
            ),
            2: wire.DraftsFrame(2, [7], [0], [0], 4, [0] * 4, [0.0] * 4),
            3: wire.DraftsFrame(3, [6], [1], [0], 2, [42, 0], [0.75, 0]),
        }  # round 1's slot, fewer entries
        got = {}
        for r, d in answers.items():
            assert eng.reserve(1) == r
            eng.write_entries(r, [wire.Entry(s, 4, 0, []) for s in d.slots])
            sync.signal(r)
            rnd = end.next_round(1)
            assert rnd.round == r and end.next == r + 1
            assert end.complete(rnd, d)
            got[r] = eng.drafts(r)
        assert end.header.heartbeat_ns > beat
        assert (got[1].counts, got[1].statuses, got[1].tokens) == (
            (2, 0, 4),
            (0, wire.STATUS_RESYNC, 0),
            ((1, 2), (), (9, 8, 7, 6)),
        )
        assert got[1].margins == ((0.5, 0.5), (), (0.5,) * 4)
        assert (got[3].counts, got[3].tokens, got[3].margins) == ((1,), ((42,),), ((0.75,),))
        snap = end.counters.snapshot()
        assert snap.counters["rounds_ok"] == 3
        assert (snap.counters["drafts"], snap.counters["draft_tokens"]) == (3, 7)
        for name in ("round_latency", "handoff_latency"):  # CPU signal stamps gathered_ns
            assert snap.histograms[name].count == 3 and snap.histograms[name].sum_ns > 0
        r = eng.reserve(1)
        sync.signal(r)
        rnd = end.next_round(1)
        assert lib.answer(end._state_addr, r, Outcome.WATCHDOG, None) == native.Status.STATE
        assert eng.claimed() == 3  # refused before claiming
        assert end.complete(rnd, None, Outcome.TIMEOUT)
        assert end.counters.snapshot().counters["rounds_timeout"] == 1


def test_a_wait_that_outlasts_its_gil_hold_releases_the_gil(lib):
    """A thread of this process can only answer once the waiting thread lets the GIL go:
    after the hold, both ``handoff`` and ``wait`` go on with it released."""
    with make_region() as region:
        eng = ring.EngineEnd(region, lib)
        sync = streamsync.HostFlagSync(region, lib, spin_us=100, nap_us=50, hold_gil_us=2000)
        peer = ring_end.ProxyEnd(region, lib, spin_us=100, nap_us=50)
        errors = []

        def answer(n):
            try:
                for _ in range(n):
                    peer.complete(peer.next_round(CHILD_TIMEOUT_S))
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=answer, args=(2,))
        t.start()
        try:
            h = sync.handoff(eng.reserve(1), CHILD_TIMEOUT_S)
            assert h.ok and h.released_ns >= h.gathered_ns
            r = eng.reserve(1)
            sync.signal(r)
            assert sync.wait(r, CHILD_TIMEOUT_S)
        finally:
            t.join(CHILD_TIMEOUT_S)
        assert not errors and not t.is_alive()
        assert eng.drafts(r).outcome is Outcome.OK
        with pytest.raises(ValueError, match="hold_gil_us=-1"):
            streamsync.HostFlagSync(region, lib, hold_gil_us=-1)


def test_unknown_sync_backend_is_refused(lib):
    with make_region() as region:
        with pytest.raises(ValueError, match="backend='rocm'"):
            streamsync.HostFlagSync(region, lib, backend="rocm")


# --------------------------------------------------------------------------- sleeping when idle


def _sleeping(region, lib) -> int:
    return lib.load32(region.addr(region.layout.wake) + 4)


@pytest.mark.parametrize("nap_us", [0, 20])
def test_an_idle_proxy_sleeps_and_a_handed_over_round_wakes_it(lib, nap_us):
    """After its spin the proxy sleeps on ``published`` (says so in ``sleeping``), napping
    or not (``nap_us`` shapes only the looks at a round handed over: an idle or stopped
    engine costs its proxy nothing); the engine's announce wakes it, and the round is
    taken at once (far sooner than the wait's own deadline)."""
    with make_region() as region:
        eng = ring.EngineEnd(region, lib)
        end = ring_end.ProxyEnd(region, lib, spin_us=100, nap_us=nap_us)
        sync = streamsync.HostFlagSync(region, lib)
        r = eng.reserve(1)  # reserved, not handed over: the proxy sees nothing of it
        eng.write_entries(r, [wire.Entry(3, 4, 0, [])])
        taken = []
        t = threading.Thread(target=lambda: taken.append(end.next_round(30.0)))
        t.start()
        try:
            assert until(lambda: _sleeping(region, lib) == 1, timeout=5)
            sync.signal(r)
            t.join(20.0)  # woken: a proxy left asleep would wait out its 30 s
            assert not t.is_alive() and taken[0].round == r
            assert _sleeping(region, lib) == 0
        finally:
            sync.signal(r)  # the round gathered and announced: the thread ends, asleep or looking
            t.join(5.0)


@pytest.mark.parametrize("nap_us", [0, 20])
def test_a_round_handed_over_but_not_gathered_keeps_the_proxy_awake(lib, nap_us):
    """The CPU runs ahead of the stream: with ``published`` ahead of ``gathered`` the
    proxy never sleeps (it spins, or naps ``nap_us`` between looks), however long the
    stream takes, and takes the round the moment it is gathered (not at the watchdog)."""
    with make_region() as region:
        eng = ring.EngineEnd(region, lib)
        end = ring_end.ProxyEnd(region, lib, spin_us=50, nap_us=nap_us)
        r = eng.reserve(1)
        eng.write_entries(r, [wire.Entry(3, 4, 0, [])])
        lib.announce(region.addr(region.layout.wake), r)  # the CPU's part; the "stream" is late
        taken = []
        t = threading.Thread(target=lambda: taken.append(end.next_round(30.0)))
        t.start()
        try:
            looks = [_sleeping(region, lib) for _ in range(2000) if not time.sleep(0.0001)]
            assert set(looks) == {0}  # spinning (or napping) all along, never asleep
            lib.signal(region.addr(region.layout.gathered), 0, r, 0)
            t.join(5.0)
            assert not t.is_alive() and taken[0].round == r
        finally:
            lib.signal(region.addr(region.layout.gathered), 0, r, 0)
            t.join(5.0)


def test_release_orphans_beside_a_busy_watchdog_finds_none_and_never_fails(lib):
    """No proxy at all: the watchdog answers every round. release_orphans (a proxy loss, a
    close) runs beside it under the watchdog's own lock, so a watchdog claim in flight is
    never taken for a dead claimer's (which would raise, ending supervision)."""
    with make_region() as region:
        eng = ring.EngineEnd(region, lib)
        wd = eng.start_watchdog(1, poll_us=50)
        gathered, wake = region.addr(region.layout.gathered), region.addr(region.layout.wake)
        stop, found, errors = threading.Event(), [], []

        def engine():
            while not stop.is_set():
                try:
                    r = eng.reserve(1.0)
                except ring.RingFull:
                    continue
                lib.signal(gathered, 0, r, wake)

        t = threading.Thread(target=engine)
        t.start()
        try:
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                try:
                    found.append(eng.release_orphans())
                except RuntimeError as e:
                    errors.append(str(e))
        finally:
            stop.set()
            t.join(5.0)
            wd.stop()
        assert errors == [] and sum(found) == 0 and eng.counters.snapshot().counters["watchdog_releases"] > 10


def test_the_stream_lookup_falls_back_to_the_public_call_without_the_raw_one():
    """A torch without ``torch._C._cuda_getCurrentRawStream`` is asked the public way."""
    from types import SimpleNamespace

    from remote_dspark.shm import streamsync

    public = SimpleNamespace(cuda_stream=77)
    fake = SimpleNamespace(_C=SimpleNamespace(), cuda=SimpleNamespace(current_stream=lambda: public))
    assert streamsync.current_stream(fake) == 77
    fake._C = SimpleNamespace(_cuda_getCurrentRawStream=lambda device: 1000 + device, _cuda_getDevice=lambda: 3)
    assert streamsync.current_stream(fake) == 1003

"""shm: the layout's invariants, the memfd's life (seals, pre-fault, close-on-exec,
idempotent close, clean failure), attach's checks, counters and header words."""

from __future__ import annotations

import mmap
import os
import select
import signal
import struct

import pytest
from helpers import child, finish

from remote_dspark.proxy import ring_end
from remote_dspark.shm import layout, memfd
from remote_dspark.shm import words as region_words
from remote_dspark.shm.layout import Layout
from remote_dspark.shm.memfd import Region

LAYOUT = Layout(depth=4, max_slots=16, row_bytes=300, num_spec=5, max_tokens=100)


def parts(lay: Layout) -> list[tuple[str, int, int]]:
    """(name, offset, size) of every part and hand-off word, for overlap checks."""
    out = [
        ("header", 0, layout.HEADER.size),
        ("session", layout.OFF_SESSION, 8),
        ("engine_pid", layout.OFF_ENGINE_PID, 4),
        ("proxy_pid", layout.OFF_PROXY_PID, 4),
        ("heartbeat", layout.OFF_HEARTBEAT, 8),
        ("breaker", layout.OFF_BREAKER, 32),
        ("gathered", lay.gathered, 4),
        ("released", lay.released, 4),
        ("claim", lay.claim, 4),
        ("gathered_ns", lay.gathered_ns(0), 8 * lay.depth),
    ]
    for i in range(lay.depth):
        out += [
            (f"desc{i}", lay.desc(i), lay.desc_stride),
            (f"staging{i}", lay.staging(i), lay.max_slots * lay.row_bytes),
            (f"drafts{i}", lay.drafts(i), lay.drafts_stride),
        ]
    out += [
        ("proxy_counters", lay.proxy_counters_at, layout.PROXY_COUNTERS.size),
        ("engine_counters", lay.engine_counters_at, layout.ENGINE_COUNTERS.size),
    ]
    return out


@pytest.mark.parametrize("lay", [LAYOUT, Layout(1, 1, 1, 1, 0), Layout(64, 4096, 4096, 64, 1 << 16)])
def test_layout_parts_are_disjoint_aligned_and_inside(lay):
    spans = sorted(parts(lay), key=lambda p: p[1])
    for (a, at, size), (b, bt, _) in zip(spans, spans[1:]):
        assert at + size <= bt, f"{a} overlaps {b}"
    assert spans[-1][1] + spans[-1][2] <= lay.size and lay.size % lay.page_size == 0
    words = [lay.gathered, lay.released, lay.claim, lay.gathered_ns(0)]
    assert len({w // layout.LINE for w in words}) == len(words)  # one 128-byte line each
    for i in range(lay.depth):
        assert lay.staging(i) % lay.page_size == 0  # CUDA registration
        assert lay.drafts(i) % layout.LINE == 0 and lay.desc(i) % layout.LINE == 0
    for off in (layout.D_COUNTS, lay.d_entry_status, lay.d_tokens, lay.d_margins):
        assert off % layout.LINE == 0
    assert lay.proxy_counters_at % layout.LINE == 0 and lay.engine_counters_at % layout.LINE == 0


def test_a_layout_without_rows_has_no_staging_and_its_offsets_line_up():
    lay = Layout(depth=4, max_slots=16, row_bytes=0, num_spec=5, max_tokens=100)
    with_rows = Layout(depth=4, max_slots=16, row_bytes=1, num_spec=5, max_tokens=100)  # one page per slot
    assert lay.staging_stride == 0 and lay.drafts_at == lay.staging_at == with_rows.staging_at
    assert [lay.staging(i) for i in range(lay.depth)] == [lay.staging_at] * lay.depth
    assert lay.size == with_rows.size - lay.depth * lay.page_size
    assert lay.drafts_at - with_rows.drafts_at == lay.proxy_counters_at - with_rows.proxy_counters_at
    spans = sorted((p for p in parts(lay) if p[2]), key=lambda p: p[1])  # staging is empty
    for (a, at, size), (b, bt, _) in zip(spans, spans[1:]):
        assert at + size <= bt, f"{a} overlaps {b}"
    assert spans[-1][1] + spans[-1][2] <= lay.size
    with Region.create(lay) as region, Region.attach(os.dup(region.fd)) as other:
        assert other.layout == lay
        with region.staging(3) as rows:
            assert rows.nbytes == 0


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("depth", 3, "depth=3: must be a power of two"),
        ("depth", 128, r"depth=128: must be an integer in 1\.\.64"),
        ("max_slots", 0, "max_slots=0"),
        ("row_bytes", -1, "row_bytes=-1"),  # 0 is a region without staging
        ("row_bytes", (1 << 20) + 1, "row_bytes=1048577"),
        ("num_spec", 65, "num_spec=65"),
        ("max_tokens", -1, "max_tokens=-1"),
    ],
)
def test_layout_refuses_bad_sizes_naming_them(field, value, match):
    kw = dict(depth=4, max_slots=8, row_bytes=16, num_spec=4, max_tokens=8)
    kw[field] = value
    with pytest.raises(ValueError, match=match):
        Layout(**kw)


def test_create_writes_the_header_and_attach_reads_it_back():
    with Region.create(LAYOUT) as region:
        assert region.layout.size == os.fstat(region.fd).st_size
        with region.view(0, layout.HEADER.size) as head:
            assert bytes(head) == LAYOUT.header_bytes()
        with Region.attach(os.dup(region.fd)) as other:
            assert other.layout == LAYOUT
            with region.staging(2) as mine, other.staging(2) as theirs:
                mine[:3] = b"abc"
                assert bytes(theirs[:3]) == b"abc"  # one memory, two mappings


def test_header_words(lib):
    with Region.create(LAYOUT) as region:
        with region.view(0, layout.OFF_ENGINE_PID + 4) as head:  # the creator's pid
            assert struct.unpack_from("<I", head, layout.OFF_ENGINE_PID)[0] == os.getpid()
        words = region.header_words(lib)
        assert words.proxy_pid == 0 and words.heartbeat_ns == 0
        words.set_session(2**63 + 5)
        state = region_words.BreakerState(1, 3, 250, 7, 2)
        words.set_breaker(state)
        assert (words.session, words.breaker()) == (2**63 + 5, state)
        before = lib.now_ns()
        end = ring_end.ProxyEnd(region, lib, pid=4321)
        assert end.next_round(0.001) is None  # the proxy's wait beats, round or not
        assert words.proxy_pid == 4321 and before <= words.heartbeat_ns <= lib.now_ns()


def test_sealed_memfd_cannot_shrink_or_grow():
    with Region.create(LAYOUT) as region:
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, LAYOUT.size - LAYOUT.page_size)
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, LAYOUT.size + LAYOUT.page_size)
        with pytest.raises(PermissionError):  # F_SEAL_SEAL: no further seals either
            import fcntl

            fcntl.fcntl(region.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)


def test_pages_are_faulted_in_at_create():
    big = Layout(depth=4, max_slots=64, row_bytes=4096, num_spec=5, max_tokens=64)
    with Region.create(big) as region:
        rss_kb = _mapping_rss_kb(region.base)
        assert rss_kb * 1024 == big.size


def _mapping_rss_kb(base: int) -> int:
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{base:x}":
            return next(int(x.split()[1]) for x in lines[i + 1 :] if x.startswith("Rss:"))
    raise AssertionError(f"no mapping at {base:#x}")


def _maps_of(fd_target: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(fd_target in line for line in f)


def test_close_is_idempotent_and_leaves_the_mapping_to_the_last_live_view():
    region = Region.create(LAYOUT)
    fd = region.fd
    target = os.readlink(f"/proc/self/fd/{fd}").split(" (")[0]  # /memfd:remote-dspark
    maps = _maps_of(target)
    hooks = []
    region.add_close_hook(lambda: hooks.append("stopped"))
    view = region.view(0, 8)
    region.close()  # no BufferError: the view keeps the mapping, and only it
    assert hooks == ["stopped"] and region.closed and region.fd == -1 and region.base == 0
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(ValueError, match="closed"):
        region.view(0, 8)
    view[:4] = b"live"  # still mapped: the view's memory is its own now
    assert bytes(view[:4]) == b"live" and _maps_of(target) == maps
    region.close()
    assert hooks == ["stopped"]
    view.release()
    assert _maps_of(target) == maps - 1  # the last view gone: unmapped


def test_a_forked_childs_close_runs_no_hook_of_the_parents():
    region = Region.create(LAYOUT)
    ran = []
    region.add_close_hook(lambda: ran.append(os.getpid()))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a hook there would stop the parent's threads (absent: they were not copied)
        try:
            region.close()
            os.write(w, str(ran).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = os.read(r, 100) if select.select([r], [], [], 10)[0] else b"(nothing: the child hung)"
    finally:
        os.close(r)
        _end(pid)
    assert got == b"[]"
    assert not region.closed  # the parent's region: untouched
    region.close()
    assert ran == [os.getpid()]


def _end(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def test_half_built_region_cleans_up(monkeypatch):
    before = set(os.listdir("/proc/self/fd"))

    def refuse(*a, **k):
        raise OSError(12, "no mapping today")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(OSError, match="no mapping today"):
        Region.create(LAYOUT)
    assert set(os.listdir("/proc/self/fd")) == before


def test_the_fd_does_not_leak_into_other_children():
    with Region.create(LAYOUT):
        code = """
            import os
            for n in os.listdir("/proc/self/fd"):
                try:
                    print(os.readlink(f"/proc/self/fd/{n}"))
                except FileNotFoundError:  # the directory's own fd, gone already
                    pass
        """
        with child(code, close_fds=False) as proc:  # only close-on-exec keeps it out
            links = finish(proc)
        assert "memfd:remote-dspark" not in links
        assert "pipe:" in links  # the check itself sees inherited descriptors


def test_attach_makes_the_passed_fd_close_on_exec_again():
    with Region.create(LAYOUT) as region:
        code = f"""
            import os
            from remote_dspark.shm import memfd
            assert os.get_inheritable({region.fd})  # as pass_fds leaves it
            with memfd.Region.attach({region.fd}):
                print(os.get_inheritable({region.fd}))
        """
        with child(code, fds=(region.fd,)) as proc:
            assert finish(proc).strip() == "False"


ATTACH = """
    import sys
    from remote_dspark.shm import memfd
    try:
        memfd.Region.attach({fd}).close()
    except ValueError as e:
        print(e)
        sys.exit(3)
"""


def _forged(size: int, header: bytes, seal: bool = True) -> int:
    import fcntl

    fd = os.memfd_create("forged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, header, 0)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, memfd.SEALS)
    return fd


@pytest.mark.parametrize(
    "case,match",
    [
        (
            "version",
            f"layout version {layout.LAYOUT_VERSION + 1}, this side reads version {layout.LAYOUT_VERSION}",
        ),
        ("size", f"file size {LAYOUT.size + LAYOUT.page_size} bytes, its header's layout needs {LAYOUT.size}"),
        ("magic", "magic b'NOTAREGN', expected b'DSPKSHM1'"),
        ("total", f"header total_size 4096, its sizes need {LAYOUT.size}"),
        ("unsealed", "seals 0x0, expected shrink, grow and seal"),
    ],
)
def test_attach_in_a_child_refuses_a_region_that_does_not_match(case, match):
    head = bytearray(LAYOUT.header_bytes())
    size = LAYOUT.size
    if case == "version":
        struct.pack_into("<I", head, 8, layout.LAYOUT_VERSION + 1)
    elif case == "size":
        size += LAYOUT.page_size
    elif case == "magic":
        head[:8] = b"NOTAREGN"
    elif case == "total":
        struct.pack_into("<Q", head, 40, 4096)
    fd = _forged(size, bytes(head), seal=case != "unsealed")
    try:
        with child(ATTACH.format(fd=fd), fds=(fd,)) as proc:
            out, err = proc.communicate(timeout=20)
        assert proc.returncode == 3, err
        assert match in out and f"region fd {fd}" in out
    finally:
        os.close(fd)


def test_counters_histograms_and_snapshot(lib):
    with Region.create(LAYOUT) as region:
        c = region.proxy_counters(lib)
        c.add("rounds_ok")
        c.add("draft_tokens", 9)
        # A histogram as proxy_end.c's observe() lays it out: a count per bucket (le each
        # bound, then +Inf), then the sum; here 500, 1000, 1001 and 7e9 ns.
        base, n_buckets = c.addr("handoff_latency"), len(region_words.LATENCY_BOUNDS_NS) + 1
        for bucket, n in ((0, 2), (1, 1), (n_buckets - 1, 1), (n_buckets, 500 + 1_000 + 1_001 + 7_000_000_000)):
            lib.add64(base + 8 * bucket, n)
        snap = c.snapshot()
        assert snap.counters["rounds_ok"] == 1 and snap.counters["draft_tokens"] == 9
        h = snap.histograms["handoff_latency"]
        assert h.buckets[0] == 2 and h.buckets[1] == 1 and h.buckets[-1] == 1  # le=1us, 2us, +Inf
        assert h.count == 4 and h.sum_ns == 500 + 1_000 + 1_001 + 7_000_000_000
        with pytest.raises(TypeError):
            snap.counters["rounds_ok"] = 0  # frozen
        assert region.engine_counters(lib).snapshot().counters["watchdog_releases"] == 0

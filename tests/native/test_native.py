"""native: which library is loaded, how it is built, what it refuses, and the C
primitives' contracts (cyclic comparison, claim, publish, waits) on plain words."""

from __future__ import annotations

import ctypes
import enum
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from helpers import CHILD_TIMEOUT_S, child

from remote_dspark import native, outcome, wire
from remote_dspark.native import NativeError, Status, binding, check
from remote_dspark.outcome import Outcome, RoundEvent
from remote_dspark.transport import ENV_OFL_DIR


def word(value: int) -> ctypes.c_uint32:
    return ctypes.c_uint32(value & 0xFFFFFFFF)


def addr(w) -> int:
    return ctypes.addressof(w)


# --------------------------------------------------------------------------- selection


def test_named_library_that_is_missing_is_an_error_naming_the_variable(tmp_path):
    with pytest.raises(ValueError, match=r"VLLM_DSPARK_REMOTE_HOSTFLAG_LIB='.*nope\.so': no such file"):
        native.locate({native.ENV_LIB: str(tmp_path / "nope.so")}, cache_dir=tmp_path)


def test_named_library_wins_over_the_ofl_dir(lib, tmp_path):
    ofl = tmp_path / "ofl"
    ofl.mkdir()
    shutil.copy(lib.path, ofl / native.OFL_LIB_NAME)
    env = {native.ENV_LIB: lib.path, ENV_OFL_DIR: str(ofl)}
    assert native.locate(env, cache_dir=tmp_path / "cache") == lib.path


def test_ofl_dir_copy_is_used_when_present(lib, tmp_path):
    shutil.copy(lib.path, tmp_path / native.OFL_LIB_NAME)
    loaded = native.load({ENV_OFL_DIR: str(tmp_path)}, cache_dir=tmp_path / "cache")
    assert loaded.path == str(tmp_path / native.OFL_LIB_NAME)
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_without_either_the_source_is_built_once_into_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    env = {"PATH": os.environ["PATH"], ENV_OFL_DIR: str(tmp_path)}  # no .so there
    built = native.locate(env, cache_dir=cache)
    assert os.path.dirname(built) == str(cache) and built.endswith(".so")
    # The library and its recorded sha256, no temporary left; the directory is private.
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(built), os.path.basename(built)[:-3] + ".sha256"])
    assert os.stat(cache).st_mode & 0o777 == 0o700

    def no_compiler(*a, **k):
        raise AssertionError("rebuilt an up-to-date library")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native.locate(env, cache_dir=cache) == built
    assert native.Native(built).lock_free is not None


def test_origin_decides_once_what_locate_and_load_use(lib, tmp_path):
    """Each of the three sources, as ``origin`` reports it; ``locate`` returns its path
    and ``load`` loads that file."""
    ofl, cache = tmp_path / "ofl", tmp_path / "cache"
    ofl.mkdir()
    shutil.copy(lib.path, ofl / native.OFL_LIB_NAME)
    path = os.environ["PATH"]
    named = {native.ENV_LIB: lib.path, ENV_OFL_DIR: str(ofl)}
    in_ofl = {"PATH": path, ENV_OFL_DIR: str(ofl)}
    built = {"PATH": path, ENV_OFL_DIR: str(tmp_path)}  # no .so there
    assert native.origin(named, cache) == native.Origin(lib.path, native.ENV_LIB, lib.path)
    assert native.origin(in_ofl, cache) == native.Origin(str(ofl / native.OFL_LIB_NAME), ENV_OFL_DIR, str(ofl))
    own = native.origin(built, cache)
    assert own.variable is None and os.path.dirname(own.path) == str(cache)
    for env in (named, in_ofl, built):
        assert native.locate(env, cache) == native.load(env, cache).path == native.origin(env, cache).path


def test_cache_dir_follows_xdg_then_home(tmp_path):
    assert native.default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/remote-dspark")
    assert native.default_cache_dir({"HOME": "/h"}) == Path("/h/.cache/remote-dspark")


def test_no_compiler_is_a_clear_error(tmp_path):
    with pytest.raises(NativeError, match=r"no C compiler 'cc' on PATH.*VLLM_DSPARK_REMOTE_HOSTFLAG_LIB"):
        native.locate({"PATH": str(tmp_path)}, cache_dir=tmp_path / "cache")


def test_failed_build_reports_the_compiler_and_leaves_nothing(tmp_path):
    with pytest.raises(NativeError, match="failed to build"):
        native.locate({"PATH": os.environ["PATH"], "CC": "false"}, cache_dir=tmp_path)
    assert os.listdir(tmp_path) == []


def test_concurrent_builds_from_several_processes_agree(tmp_path):
    """Four interpreters build into one empty cache at the same moment (released together
    through their stdin); all load the same complete file, no temporary is left."""
    cache = tmp_path / "cache"
    code = f"""
        import sys
        from remote_dspark import native
        sys.stdin.readline()
        print(native.load(environ={{"PATH": {os.environ["PATH"]!r}}}, cache_dir={str(cache)!r}).path)
    """
    with (
        child(code, stdin=subprocess.PIPE) as a,
        child(code, stdin=subprocess.PIPE) as b,
        child(code, stdin=subprocess.PIPE) as c,
        child(code, stdin=subprocess.PIPE) as d,
    ):
        procs = (a, b, c, d)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=CHILD_TIMEOUT_S)
            assert p.returncode == 0, err
            outs.append(out.strip())
    assert len(set(outs)) == 1
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(outs[0]), os.path.basename(outs[0])[:-3] + ".sha256"])


def _fake_library(tmp_path, abi: int, lock_free: int, proxy_size: int | None = None) -> str:
    sizes = [ctypes.sizeof(m) for m in binding.MIRRORS]
    if proxy_size is not None:
        sizes[1] = proxy_size
    proxy = sizes[1]
    src = tmp_path / "fake.c"
    src.write_text(
        f"int hf_abi_version(void) {{ return {abi}; }}\n"
        f"int hf_lock_free(void) {{ return {lock_free}; }}\n"
        "unsigned long long hf_sizeof(int w) { static const unsigned long long s[] = {"
        + ", ".join(map(str, sizes))
        + f"}}; return w >= 0 && w < {len(sizes)} ? s[w] : 0; }}\n"
    )
    out = tmp_path / f"fake-{abi}-{lock_free}-{proxy}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True, timeout=CHILD_TIMEOUT_S)
    return str(out)


def test_a_library_without_lock_free_words_is_refused(tmp_path):
    path = _fake_library(tmp_path, native.ABI_VERSION, 1)
    with pytest.raises(ValueError, match=rf"{native.ENV_LIB}=.*{path}: 32/64-bit atomics are not lock-free"):
        native.load({native.ENV_LIB: path})


def test_a_library_whose_structs_differ_from_their_mirrors_is_refused(tmp_path):
    size = ctypes.sizeof(native.ProxyState)
    path = _fake_library(tmp_path, native.ABI_VERSION, native.LOCK_FREE_ALL, proxy_size=size + 8)
    with pytest.raises(NativeError, match=f"struct ProxyState is {size + 8} bytes in C, {size} in ctypes"):
        native.Native(path)


def test_a_library_of_another_abi_is_refused(tmp_path):
    path = _fake_library(tmp_path, 99, native.LOCK_FREE_ALL)
    with pytest.raises(NativeError, match=f"hostflag ABI 99, this package binds {native.ABI_VERSION}"):
        native.Native(path)


# A value of each wire constant the C round uses that is not the wire's.
DRIFTED = {
    "HEADER": struct.Struct("<4sHHIQII"),
    "MAGIC": b"DSPX",
    "PROTOCOL_VERSION": wire.PROTOCOL_VERSION + 1,
    "ROUND": 6,
    "DRAFTS": 7,
    "BYE": 8,
    "ROUND_FIXED": struct.Struct("<IIIII"),
    "DRAFTS_FIXED": struct.Struct("<IHHI"),
    "FLAG_NEW_GEN": 2,
    "DRAFTS_MARGINS": 2,
    "STATUS_RESYNC": 2,
    "MAX_PAYLOAD": 32 << 20,
    "SAMPLED_BYTES": 16,
    "DRAFTS_SAMPLED": 4,
    "SAMPLED_TOP": 16,
    "SAMPLED_TOTAL": 65536,
    "MAX_SAMPLED_ENTRIES": 2048,
    "MAX_SAMPLED_N_OUT": 8,
    "MAX_ENTRIES": 2048,
    "MAX_N_OUT": 32,
    "MAX_ROW_BYTES": 1 << 19,
    "MAX_TOKENS": 1 << 21,
    "PING": 9,
}
DRIFTED_IN = {"SAMPLED_BYTES": wire.round}  # where a constant not in wire's namespace lives


def test_the_library_reports_the_wire_constants_of_wire_py(lib):
    assert [name for name, _ in native.WIRE_CONSTANTS] == list(DRIFTED)
    out = (ctypes.c_uint64 * 32)()
    fn = ctypes.CDLL(lib.path).hf_wire_constants
    fn.restype = ctypes.c_uint32
    assert fn(out, 32) == len(native.WIRE_CONSTANTS)
    assert list(out[: len(DRIFTED)]) == [expected() for _, expected in native.WIRE_CONSTANTS]
    assert out[1].to_bytes(4, "little") == wire.MAGIC


@pytest.mark.parametrize("name", list(DRIFTED))
def test_a_wire_constant_that_drifts_from_the_library_refuses_it_naming_both_values(lib, monkeypatch, name):
    """A wire.py whose constant is not the one the C round was built with (a protocol
    change in one language only) is refused at load, naming the constant."""
    before = dict(native.WIRE_CONSTANTS)[name]()
    monkeypatch.setattr(DRIFTED_IN.get(name, wire), name, DRIFTED[name])
    after = dict(native.WIRE_CONSTANTS)[name]()
    assert after != before
    with pytest.raises(NativeError, match=rf"wire constant {name} is {before} in C, {after} in remote_dspark.wire"):
        native.Native(lib.path)


def test_the_library_reports_the_codes_python_mirrors(lib):
    """hf_codes: each table in C's order equals its Python enum; an unknown table is empty."""
    fn = ctypes.CDLL(lib.path).hf_codes
    fn.restype, fn.argtypes = ctypes.c_uint32, (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32)
    out = (ctypes.c_uint64 * 32)()
    tables = {what: [getattr(enum_of(), name) for name in names] for what, _, enum_of, names in native.CODE_TABLES}
    assert tables == {
        "status code": list(Status),
        "outcome": [Outcome.OK, Outcome.TIMEOUT, Outcome.ERROR, Outcome.BREAKER_SKIP],
        "round event": list(RoundEvent),
        "host round code": list(native.HostRoundCode),
    }
    for table, expected in enumerate(tables.values()):
        assert fn(table, out, 32) == len(expected)
        assert list(out[: len(expected)]) == expected
    assert fn(len(tables), out, 32) == 0


def test_the_struct_mirrors_size_their_arrays_by_the_constants_the_loader_checks(lib):
    """structs.HEADER is the wire's header (the C's W_HEADER, which hf_wire_constants
    reports) and structs.PROXY_OUTCOMES the proxy's outcomes (hf_codes' table 1, the C's
    HF_PROXY_OUTCOMES): the arrays of hf_link, hf_serve and hf_proxy are sized by them."""
    from remote_dspark.native import structs

    fn = ctypes.CDLL(lib.path).hf_codes
    fn.restype, fn.argtypes = ctypes.c_uint32, (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32)
    assert structs.HEADER == wire.HEADER.size == dict(native.WIRE_CONSTANTS)["HEADER"]()
    assert structs.PROXY_OUTCOMES == fn(1, (ctypes.c_uint64 * 32)(), 32)
    assert dict(structs.LinkState._fields_)["hdr"]._length_ == structs.HEADER
    assert dict(structs.ServeState._fields_)["hdr"]._length_ == structs.HEADER
    assert dict(structs.ProxyState._fields_)["c_outcome"]._length_ == structs.PROXY_OUTCOMES


def drifted(codes: type[enum.IntEnum], name: str) -> type[enum.IntEnum]:
    """``codes`` with member ``name`` 100 higher: the same enum changed in Python only."""
    values = {m.name: m.value + (100 if m.name == name else 0) for m in codes}
    return enum.IntEnum(codes.__name__, values)


@pytest.mark.parametrize("name", [m.name for m in Status])
def test_a_status_code_that_drifts_from_the_library_refuses_it_naming_both_values(lib, monkeypatch, name):
    monkeypatch.setattr(binding, "Status", drifted(Status, name))
    value = Status[name].value
    with pytest.raises(
        NativeError, match=rf"status code {name} is {value} in C, {value + 100} in remote_dspark.native.Status"
    ):
        native.Native(lib.path)


@pytest.mark.parametrize("name", ["OK", "TIMEOUT", "ERROR", "BREAKER_SKIP"])
def test_an_outcome_that_drifts_from_the_library_refuses_it_naming_both_values(lib, monkeypatch, name):
    monkeypatch.setattr(outcome, "Outcome", drifted(Outcome, name))
    value = Outcome[name].value
    with pytest.raises(
        NativeError, match=rf"outcome {name} is {value} in C, {value + 100} in remote_dspark.outcome.Outcome"
    ):
        native.Native(lib.path)


@pytest.mark.parametrize("name", [m.name for m in RoundEvent])
def test_a_round_event_that_drifts_from_the_library_refuses_it_naming_both_values(lib, monkeypatch, name):
    monkeypatch.setattr(outcome, "RoundEvent", drifted(RoundEvent, name))
    value = RoundEvent[name].value
    with pytest.raises(
        NativeError, match=rf"round event {name} is {value} in C, {value + 100} in remote_dspark.outcome.RoundEvent"
    ):
        native.Native(lib.path)


def test_a_code_python_lacks_or_c_lacks_refuses_the_library(lib, monkeypatch):
    """A member renamed in Python only, and a table of another length (a code added on
    one side only), are refused too."""
    renamed = {m.name if m is not RoundEvent.LOST else "GONE": m.value for m in RoundEvent}
    monkeypatch.setattr(outcome, "RoundEvent", enum.IntEnum("RoundEvent", renamed))
    with pytest.raises(NativeError, match=r"round event LOST is 3 in C, absent from remote_dspark.outcome.RoundEvent"):
        native.Native(lib.path)
    monkeypatch.undo()
    what, where, enum_of, names = native.CODE_TABLES[1]
    monkeypatch.setattr(binding, "CODE_TABLES", (native.CODE_TABLES[0], (what, where, enum_of, names + ("WATCHDOG",))))
    with pytest.raises(NativeError, match=r"reports 4 outcomes, this package checks 5"):
        native.Native(lib.path)


def test_a_named_library_of_another_abi_is_a_configuration_error(tmp_path):
    path = _fake_library(tmp_path, 99, native.LOCK_FREE_ALL)
    with pytest.raises(ValueError, match=rf"{native.ENV_LIB}=.*hostflag ABI 99"):
        native.load({native.ENV_LIB: path}, cache_dir=tmp_path / "cache")


def test_an_ofl_dir_copy_of_another_abi_is_replaced_by_the_own_build(tmp_path, caplog):
    """The contract's default location holds a library built from another source: one
    warning, and this package's build is used (never a fall back to sync rounds)."""
    ofl = tmp_path / "ofl"
    ofl.mkdir()
    shutil.copy(_fake_library(tmp_path, 99, native.LOCK_FREE_ALL), ofl / native.OFL_LIB_NAME)
    env = {"PATH": os.environ["PATH"], ENV_OFL_DIR: str(ofl)}
    loaded = native.load(env, cache_dir=tmp_path / "cache")
    assert os.path.dirname(loaded.path) == str(tmp_path / "cache")
    assert [r.getMessage() for r in caplog.records if "own build" in r.getMessage()] != []


def test_an_ofl_dir_copy_others_may_write_is_never_loaded(lib, tmp_path, caplog):
    """The contract's default location, writable by others: its library could be anyone's
    (its constructor would run at dlopen). One warning, and this package's build."""
    ofl = tmp_path / "ofl"
    ofl.mkdir()
    shutil.copy(lib.path, ofl / native.OFL_LIB_NAME)
    os.chmod(ofl, 0o777)
    env = {"PATH": os.environ["PATH"], ENV_OFL_DIR: str(ofl)}
    loaded = native.load(env, cache_dir=tmp_path / "cache")
    assert os.path.dirname(loaded.path) == str(tmp_path / "cache")
    assert any("written by others" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- the cache, trusted or not


def built_into(cache) -> str:
    return native.locate({"PATH": os.environ["PATH"]}, cache_dir=cache)


def test_a_cache_others_can_write_is_never_used(tmp_path):
    """A library planted under the expected name in a directory others can write is not
    loaded: the build goes into a fresh private directory."""
    name = os.path.basename(built_into(tmp_path / "mine"))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    planted = _fake_library(tmp_path, native.ABI_VERSION, native.LOCK_FREE_ALL)
    shutil.copy(planted, shared / name)
    built = built_into(shared)
    assert os.path.dirname(built) != str(shared)
    assert os.stat(os.path.dirname(built)).st_mode & 0o777 == 0o700
    shutil.rmtree(os.path.dirname(built))


def test_a_cached_build_whose_hash_is_not_the_recorded_one_is_rebuilt(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    built = built_into(cache)
    good = open(built, "rb").read()
    shutil.copy(_fake_library(tmp_path, native.ABI_VERSION, native.LOCK_FREE_ALL), built)  # swapped in place
    assert built_into(cache) == built
    assert open(built, "rb").read() == good


def test_a_cached_build_that_is_a_link_is_not_followed(tmp_path):
    cache = tmp_path / "cache"
    built = built_into(cache)
    elsewhere = tmp_path / "elsewhere.so"
    shutil.move(built, elsewhere)
    os.symlink(elsewhere, built)
    assert built_into(cache) == built and not os.path.islink(built)


def test_a_library_that_is_not_hostflag_is_refused(tmp_path):
    src = tmp_path / "other.c"
    src.write_text("int other(void) { return 0; }\n")
    out = tmp_path / "other.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True, timeout=CHILD_TIMEOUT_S)
    with pytest.raises(NativeError, match="is not a hostflag library"):
        native.Native(str(out))


def test_the_real_library_reports_lock_free_words(lib):
    assert lib.lock_free == native.LOCK_FREE_ALL


# --------------------------------------------------------------------------- primitives


def test_check_maps_codes_in_one_place():
    assert check(0, "x") is Status.OK
    assert check(1, "x") is Status.TIMEOUT
    assert check(2, "x") is Status.LATE
    with pytest.raises(RuntimeError, match="claim round 5: ORDER"):
        check(Status.ORDER, "claim round 5")
    with pytest.raises(RuntimeError, match="STATE"):
        check(Status.STATE, "x")
    with pytest.raises(MemoryError):
        check(Status.NOMEM, "x")
    with pytest.raises(OSError):
        check(Status.SYS, "x")


def test_wait_geq_is_cyclic_and_times_out(lib):
    w = word(2)  # 2 is "after" 2^32 - 3: wrapped
    assert lib.wait_geq(addr(w), 2**32 - 3, 0, 0, native.deadline_ns(1)) == Status.OK
    assert lib.wait_geq(addr(w), 3, 10, 10, native.deadline_ns(0.002)) == Status.TIMEOUT
    assert lib.wait_geq(addr(w), 2**31 + 2, 0, 0, native.deadline_ns(0.001)) == Status.TIMEOUT


def test_wait_released_sleeps_to_its_deadline_and_leaves_no_waiter_counted(lib):
    rel, waiters = word(5), word(0)
    assert lib.wait_released(addr(rel), addr(waiters), 5, 0, 0, native.deadline_ns(1)) == Status.OK  # at once
    # Not released: with spin 0 straight to the futex, back at its deadline, no longer counted.
    assert lib.wait_released(addr(rel), addr(waiters), 6, 0, 0, native.deadline_ns(0.02)) == Status.TIMEOUT
    assert waiters.value == 0
    # A nap (ASYNC_NAP_US > 0) or no waiters word: the spin-then-nap wait, never the futex.
    assert lib.wait_released(addr(rel), addr(waiters), 6, 0, 50, native.deadline_ns(0.02)) == Status.TIMEOUT
    assert lib.wait_released(addr(rel), None, 2**32 - 3, 0, 0, native.deadline_ns(1)) == Status.OK  # cyclic


def test_claim_is_in_order_and_exactly_once_across_the_wrap(lib):
    c = word(2**32 - 1)
    assert lib.claim(addr(c), 1) == Status.ORDER  # round 0 not claimed yet
    assert lib.claim(addr(c), 0) == Status.OK
    assert lib.claim(addr(c), 0) == Status.LATE
    assert lib.claim(addr(c), 2**32 - 1) == Status.LATE
    assert c.value == 0


def test_publish_waits_for_the_previous_round_and_never_goes_back(lib):
    rel = word(2**32 - 2)
    assert lib.publish(addr(rel), None, 0, native.deadline_ns(0.002)) == Status.TIMEOUT  # 2^32-1 pending
    assert rel.value == 2**32 - 2
    assert lib.publish(addr(rel), None, 2**32 - 1, native.deadline_ns(1)) == Status.OK
    assert lib.publish(addr(rel), None, 0, native.deadline_ns(1)) == Status.OK
    assert lib.publish(addr(rel), None, 0, native.deadline_ns(1)) == Status.STATE
    assert rel.value == 0


def test_handoff_times_itself_in_c(lib):
    gathered, released, stamp = word(0), word(5), ctypes.c_uint64(0)
    out = (ctypes.c_uint64 * 2)()
    rc = lib.handoff(
        addr(gathered), addr(stamp), addr(released), None, 5, 0, 0, native.deadline_ns(1), ctypes.addressof(out), None
    )
    assert rc == Status.OK and gathered.value == 5
    assert stamp.value == out[0] <= out[1]


def test_counters_add_and_snapshot(lib):
    words = (ctypes.c_uint64 * 3)(1, 2, 3)
    lib.add64(ctypes.addressof(words) + 8, 40)
    copy = (ctypes.c_uint64 * 3)()
    lib.snapshot64(ctypes.addressof(words), ctypes.addressof(copy), 3)
    assert list(copy) == [1, 42, 3]

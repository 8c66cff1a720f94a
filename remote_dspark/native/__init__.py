"""``native``: the hand-off primitives of ``hostflag.c`` and ``tcp_round.c`` (one library,
with ``hostflag.h`` between them), found or built, then loaded.

Which library is loaded (``load``), first match wins:

1. ``VLLM_DSPARK_REMOTE_HOSTFLAG_LIB``, when set: that file. A missing, unloadable or
   refused file is a ``ValueError`` naming the variable (a configuration error, raised
   at the engine's start);
2. ``libdsv41_hostflag.so`` in ``VLLM_DSPARK_REMOTE_OFL_DIR``, when that file exists and
   passes the probes below; a copy built from another source is refused with one warning
   and this package's own build is used instead;
3. ``hostflag.c`` and ``tcp_round.c`` (next to this file) compiled together with
   ``cc -O2 -shared -fPIC -pthread`` at first use into the cache directory
   (``$XDG_CACHE_HOME/remote-dspark``, else ``~/.cache/remote-dspark``), named by the
   sha256 of the sources, the header and the command, so an edited source is rebuilt
   and an unchanged one never is. Each builder writes a
   temporary file of its own and renames it into place (atomic), so several processes
   may build at once and every one of them loads a complete library.

A cached build is trusted only when this user owns the cache directory and the file,
nobody else can write either, the file is read without following a link, and its sha256
equals the one recorded beside it at build time. A directory that fails this (someone
else's, or writable by others: a library planted there would run its constructor in the
engine) is never used: the library is built into a fresh private directory instead. A
file that fails it is rebuilt. The cache directory is created 0700.

At load the library must report the ABI this module binds (``hf_abi_version``), the
sizes of the structs mirrored here (``hf_sizeof``), the wire constants its TCP round
uses (``hf_wire_constants``, each equal to :mod:`remote_dspark.wire`'s: see
``WIRE_CONSTANTS``) and lock-free 32- and 64-bit atomics (``hf_lock_free``): a word
behind a lock is not safely shared by two processes.

Calls that may wait (``wait_geq``, ``wait_at``, ``handoff``, ``publish``,
``release_empty``, ``take``, ``answer``, ``serve``, ``watchdog_stop``) go through
``ctypes.CDLL``, which releases the GIL for the call. The short ones (loads, stores, claim,
counters, and the proxy's checks of one round: ``check_desc``, ``unpack``) go through
``ctypes.PyDLL`` and keep it: releasing the GIL for 20 ns of work would invite another
thread to take it for a whole switch interval. ``wait_geq_holding`` and
``handoff_holding`` are the same C functions bound to keep the GIL, for waits the caller
bounds to microseconds (``streamsync``'s hold).

The C layer returns status codes; ``check`` is the one place that turns them into
exceptions. This module imports nothing beyond the standard library (the proxy process
is torch-free and numpy-free).
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from .. import wire
from ..trust import untrusted_because
from .structs import LinkState, ProxyState, RingGeom  # noqa: F401  (the package's names)

log = logging.getLogger("remote_dspark.native")

ENV_LIB = "VLLM_DSPARK_REMOTE_HOSTFLAG_LIB"
ENV_OFL_DIR = "VLLM_DSPARK_REMOTE_OFL_DIR"
OFL_LIB_NAME = "libdsv41_hostflag.so"
SOURCE = Path(__file__).with_name("hostflag.c")
SOURCES = (SOURCE, SOURCE.with_name("tcp_round.c"))  # compiled together into one library
HEADERS = (SOURCE.with_name("hostflag.h"),)
CFLAGS = ("-O2", "-shared", "-fPIC", "-pthread")
ABI_VERSION = 11

# The wire constants the C round uses, in hf_wire_constants' order, each with its value
# in remote_dspark.wire (read at load, not at import: a test may change one).
WIRE_CONSTANTS = (
    ("HEADER", lambda: wire.HEADER.size),
    ("MAGIC", lambda: int.from_bytes(wire.MAGIC, "little")),
    ("PROTOCOL_VERSION", lambda: wire.PROTOCOL_VERSION),
    ("ROUND", lambda: wire.ROUND),
    ("DRAFTS", lambda: wire.DRAFTS),
    ("BYE", lambda: wire.BYE),
    ("ROUND_FIXED", lambda: wire.ROUND_FIXED.size),
    ("DRAFTS_FIXED", lambda: wire.DRAFTS_FIXED.size),
    ("FLAG_NEW_GEN", lambda: wire.FLAG_NEW_GEN),
    ("DRAFTS_MARGINS", lambda: wire.DRAFTS_MARGINS),
    ("STATUS_RESYNC", lambda: wire.STATUS_RESYNC),
    ("MAX_PAYLOAD", lambda: wire.MAX_PAYLOAD),
)
LOCK_FREE_ALL = 3  # hf_lock_free(): bit 0 for 32-bit words, bit 1 for 64-bit words


class Status(enum.IntEnum):
    """The C library's status codes (hostflag.c)."""

    OK = 0
    TIMEOUT = 1  # the deadline passed
    LATE = 2  # the round was already claimed by someone else
    ORDER = 3  # the previous round is not claimed yet (a caller bug)
    STATE = 4  # a word holds a value its protocol forbids
    NOMEM = 5
    SYS = 6  # errno is set


class NativeError(RuntimeError):
    """The native library cannot be built or loaded, or broke its protocol."""


_P, _U32, _U64, _I = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int
_RING = ctypes.POINTER(RingGeom)

# name: (C symbol, restype, argtypes, may_wait). may_wait -> CDLL (GIL released for the
# call), else PyDLL (GIL kept). The ``*_holding`` names bind a waiting function with the
# GIL kept, for a wait the caller bounds to a few microseconds (streamsync's hold).
_FUNCS = {
    "now_ns": ("hf_now_ns", _U64, (), False),
    "load32": ("hf_load32", _U32, (_P,), False),
    "store32": ("hf_store32", None, (_P, _U32), False),
    "load64": ("hf_load64", _U64, (_P,), False),
    "store64": ("hf_store64", None, (_P, _U64), False),
    "add64": ("hf_add64", None, (_P, _U64), False),
    "snapshot64": ("hf_snapshot64", None, (_P, _P, _U32), False),
    "signal": ("hf_signal", None, (_P, _P, _U32, _P), False),
    "announce": ("hf_announce", None, (_P, _U32), False),
    "standby_wait": ("hf_standby_wait", _U32, (_P, _U32, _U64), True),
    "wake": ("hf_wake", None, (_P, _U32), False),
    "claim": ("hf_claim", _I, (_P, _U32), False),
    "zero_drafts": ("hf_zero_drafts", None, (_RING, _U32, _U32), False),
    "wait_geq": ("hf_wait_geq", _I, (_P, _U32, _U32, _U32, _U64), True),
    "wait_geq_holding": ("hf_wait_geq", _I, (_P, _U32, _U32, _U32, _U64), False),
    "wait_at": ("hf_wait_at", _I, (_P, _U32, _U32, _U32, _U64, _P), True),
    "handoff": ("hf_handoff", _I, (_P, _P, _P, _U32, _U32, _U32, _U64, _P, _P), True),
    "handoff_holding": ("hf_handoff", _I, (_P, _P, _P, _U32, _U32, _U32, _U64, _P, _P), False),
    "take": ("hf_take", ctypes.c_int64, (_P, _U64), True),
    "answer": ("hf_answer", _I, (_P, _U32, _U32, _P), True),
    "round": ("hf_round", ctypes.c_int64, (_P, _P, _U64), True),
    "check_desc": ("hf_check_desc", _I, (_P, _P, _U32), False),
    "unpack": ("hf_unpack", _I, (_P, _P, _U32, _U32), False),
    "publish": ("hf_publish", _I, (_P, _U32, _U64), True),
    "release_empty": ("hf_release_empty", _I, (_RING, _U32, _U32, _U64), True),
    "serve": ("hf_serve", _I, (_RING, _U32, _U32, _U32, _U32, _U32, _U64), True),
    "watchdog_start": ("hf_watchdog_start", _P, (_RING, _P, _U32, _U64, _U64), False),
    "watchdog_stop": ("hf_watchdog_stop", _I, (_P,), True),
    "watchdog_release_orphans": ("hf_watchdog_release_orphans", _I, (_P, _U32), True),
    "gather_rows": ("hf_gather_rows", _U32, (_P, _P, _U64, _U64, _P, _U32, _U32), False),
}


def check(rc: int, what: str) -> Status:
    """Map a status code to the outcome a caller handles (OK, TIMEOUT, LATE) or raise.

    Raises:
        RuntimeError: ORDER or STATE (a protocol invariant broken), naming ``what``.
        MemoryError: NOMEM.
        OSError: SYS, with the C errno.
    """
    status = Status(rc)
    if status in (Status.OK, Status.TIMEOUT, Status.LATE):
        return status
    if status is Status.NOMEM:
        raise MemoryError(f"{what}: out of memory")
    if status is Status.SYS:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    raise RuntimeError(f"{what}: {status.name} ({_MEANING[status]})")


_MEANING = {
    Status.ORDER: "the previous round is not claimed yet; rounds are answered in order",
    Status.STATE: "a sequence word went backwards or was released by a non-claimer",
}


class Native:
    """The loaded library. Each ``_FUNCS`` entry is an attribute: the ctypes function
    itself (no Python wrapper on the hot path). ``path`` is the file that was loaded,
    ``lock_free`` what its probe reported."""

    def __init__(self, path: str):
        self.path = path
        try:
            waiting = ctypes.CDLL(path, use_errno=True)
            holding = ctypes.PyDLL(path, use_errno=True)
        except OSError as e:
            raise NativeError(f"cannot load {path}: {e}") from e
        self._probe(waiting)
        for name, (symbol, restype, argtypes, may_wait) in _FUNCS.items():
            fn = getattr(waiting if may_wait else holding, symbol)
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)

    def _probe(self, lib) -> None:
        """Refuse a library of another ABI, with structs of other sizes than their ctypes
        mirrors, or without lock-free words (probed, not assumed from the build)."""
        try:
            abi, lock_free, sizeof = lib.hf_abi_version, lib.hf_lock_free, lib.hf_sizeof
        except AttributeError as e:
            raise NativeError(f"{self.path} is not a hostflag library: {e}") from e
        abi.restype = lock_free.restype = ctypes.c_int
        if abi() != ABI_VERSION:
            raise NativeError(
                f"{self.path}: hostflag ABI {abi()}, this package binds {ABI_VERSION}; rebuild it from {SOURCE.parent}"
            )
        sizeof.restype, sizeof.argtypes = ctypes.c_uint64, (ctypes.c_int,)
        for which, mirror in enumerate((RingGeom, ProxyState, LinkState)):
            if sizeof(which) != ctypes.sizeof(mirror):
                raise NativeError(
                    f"{self.path}: struct {mirror.__name__} is {sizeof(which)} bytes "
                    f"in C, {ctypes.sizeof(mirror)} in ctypes; rebuild it from {SOURCE.parent}"
                )
        self.lock_free = lock_free()
        if self.lock_free != LOCK_FREE_ALL:
            raise NativeError(
                f"{self.path}: 32/64-bit atomics are not lock-free on this "
                f"platform (hf_lock_free() = {self.lock_free}); the region's "
                "words cannot be shared between processes"
            )
        self._check_wire(lib)

    def _check_wire(self, lib) -> None:
        """Refuse a library whose wire constants are not :mod:`remote_dspark.wire`'s,
        naming the first that differs and both values."""
        try:
            fn = lib.hf_wire_constants
        except AttributeError as e:
            raise NativeError(f"{self.path} reports no wire constants: {e}") from e
        fn.restype, fn.argtypes = ctypes.c_uint32, (ctypes.c_void_p, ctypes.c_uint32)
        out = (ctypes.c_uint64 * len(WIRE_CONSTANTS))()
        have = fn(out, len(out))
        if have != len(WIRE_CONSTANTS):
            raise NativeError(
                f"{self.path}: reports {have} wire constants, this package checks "
                f"{len(WIRE_CONSTANTS)}; rebuild it from {SOURCE.parent}"
            )
        for (name, expected), value in zip(WIRE_CONSTANTS, out):
            if value != expected():
                raise NativeError(
                    f"{self.path}: wire constant {name} is {value} in C, {expected()} in "
                    f"remote_dspark.wire; rebuild it from {SOURCE.parent}"
                )

    def __repr__(self) -> str:
        return f"Native({self.path!r})"


def deadline_ns(timeout_s: float) -> int:
    """The CLOCK_MONOTONIC deadline (ns) ``timeout_s`` from now, as the waits take it."""
    return time.monotonic_ns() + max(0, int(timeout_s * 1e9))


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    xdg = (environ.get("XDG_CACHE_HOME") or "").strip()
    base = Path(xdg) if xdg else Path(environ.get("HOME") or Path.home()) / ".cache"
    return base / "remote-dspark"


def locate(environ: Mapping[str, str] | None = None, cache_dir: str | os.PathLike | None = None) -> str:
    """The path of the library to load, by the rules in the module docstring; builds it
    into the cache when neither variable names one.

    Raises:
        ValueError: VLLM_DSPARK_REMOTE_HOSTFLAG_LIB names a missing file.
        NativeError: the library has to be built and cannot be (no compiler, a failed
            build, an unwritable cache directory).
    """
    env = os.environ if environ is None else environ
    named = (env.get(ENV_LIB) or "").strip()
    if named:
        if not os.path.isfile(named):
            raise ValueError(f"{ENV_LIB}={named!r}: no such file")
        return os.path.abspath(named)  # a bare name would send dlopen searching elsewhere
    ofl_dir = (env.get(ENV_OFL_DIR) or "").strip()
    if ofl_dir and os.path.isfile(os.path.join(ofl_dir, OFL_LIB_NAME)):
        return os.path.join(ofl_dir, OFL_LIB_NAME)
    return str(build(Path(cache_dir) if cache_dir is not None else default_cache_dir(env), env))


def _owned_privately(st: os.stat_result) -> bool:
    """This user's, and nobody else may write it."""
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def trusted_cache(cache_dir: Path) -> bool:
    """``cache_dir`` is a real directory (not a link) of this user that nobody else can
    write: a build in it can be trusted to be the one this user made."""
    try:
        st = os.lstat(cache_dir)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and _owned_privately(st)


def _digest(path: Path) -> str | None:
    """The sha256 of a regular file this user owns and nobody else can write, read
    without following a link; None for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or not _owned_privately(st):
            return None
        return hashlib.sha256(f.read()).hexdigest()


def _trusted_build(target: Path) -> bool:
    """``target`` is a build this user made: private, and its sha256 is the recorded one."""
    digest, record = _digest(target), _digest(target.with_suffix(".sha256"))
    if digest is None or record is None:
        return False
    return target.with_suffix(".sha256").read_text().strip() == digest


def build(cache_dir: Path, environ: Mapping[str, str]) -> Path:
    """Compile ``SOURCES`` into ``cache_dir`` unless a trusted build of these sources is
    already there (see the module docstring); returns its path. Safe when several
    processes build at once. A ``cache_dir`` that cannot be trusted is not used: the
    build goes into a fresh private directory.

    Raises:
        NativeError: no compiler, a failed build, no directory to build into.
    """
    compiler = (environ.get("CC") or "cc").strip()
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    key = hashlib.sha256(digest.digest() + "\0".join((compiler,) + CFLAGS).encode()).hexdigest()[:16]
    try:
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise NativeError(f"cannot build {SOURCE.name} into {cache_dir}: {e}") from e
    if not trusted_cache(cache_dir):
        log.warning(
            "%s is not a private directory of this user (someone else's, or writable by "
            "others): building %s into a fresh private directory instead",
            cache_dir,
            SOURCE.name,
        )
        cache_dir = Path(tempfile.mkdtemp(prefix="remote-dspark-hostflag-"))
    target = cache_dir / f"hostflag-{key}.so"
    if _trusted_build(target):
        return target
    cc = shutil.which(compiler, path=environ.get("PATH", os.defpath))
    if cc is None:
        raise NativeError(
            f"cannot build {SOURCE.name}: no C compiler {compiler!r} on PATH. Install one "
            f"(e.g. gcc) or set {ENV_LIB} to a built {OFL_LIB_NAME}"
        )
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".hostflag-{key}.", suffix=".so.tmp", dir=cache_dir)
        os.close(fd)
    except OSError as e:
        raise NativeError(f"cannot build {SOURCE.name} into {cache_dir}: {e}") from e
    record = tmp + ".sha256"
    try:
        proc = subprocess.run([cc, *CFLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise NativeError(f"{cc} failed to build {SOURCE.parent} (exit {proc.returncode}):\n{proc.stderr.strip()}")
        os.chmod(tmp, 0o755)
        with open(tmp, "rb") as f, open(record, "w") as r:
            r.write(hashlib.sha256(f.read()).hexdigest() + "\n")
        # Both atomic: a reader sees no file or a whole one. The record goes first, so a
        # library with no record yet (a concurrent reader) is merely rebuilt, never trusted.
        os.replace(record, target.with_suffix(".sha256"))
        os.replace(tmp, target)
    finally:
        for path in (tmp, record):
            if os.path.exists(path):
                os.unlink(path)
    return target


def load(environ: Mapping[str, str] | None = None, cache_dir: str | os.PathLike | None = None) -> Native:
    """Locate (or build) and load the library, by the rules in the module docstring.

    Raises:
        ValueError: VLLM_DSPARK_REMOTE_HOSTFLAG_LIB names a missing, unloadable or
            refused file (naming the variable).
        NativeError: no library can be built, or the one built is refused at load.
    """
    env = os.environ if environ is None else environ
    path = locate(env, cache_dir)
    named = (env.get(ENV_LIB) or "").strip()
    if named:
        try:
            return Native(path)
        except NativeError as e:
            raise ValueError(f"{ENV_LIB}={named!r}: {e}") from e
    ofl_dir = (env.get(ENV_OFL_DIR) or "").strip()
    if ofl_dir and path == os.path.join(ofl_dir, OFL_LIB_NAME):
        why = untrusted_because(path)
        try:
            if why is None:
                return Native(path)
        except NativeError as e:
            why = str(e)
        log.warning("%s: %s; using this package's own build of %s", ENV_OFL_DIR, why, SOURCE.name)
        path = str(build(Path(cache_dir) if cache_dir is not None else default_cache_dir(env), env))
    return Native(path)

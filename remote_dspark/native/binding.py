"""``native.binding``: the loaded library as ctypes functions, its status codes, and the
checks that refuse a library this package does not bind.

At load the library must report the ABI this module binds (``hf_abi_version``), the
sizes of the structs mirrored in :mod:`.structs` (``hf_sizeof``), lock-free 32- and
64-bit atomics (``hf_lock_free``: a word behind a lock is not safely shared by two
processes), and every value it shares with Python equal to Python's: the wire constants
its TCP round uses (``hf_wire_constants``, see ``WIRE_CONSTANTS``) and its codes
(``hf_codes``, see ``CODE_TABLES``: ``Status``, and :mod:`remote_dspark.outcome`'s
``Outcome`` and ``RoundEvent``). A refusal names the value and both sides of it.

Calls that may wait (``wait_geq``, ``wait_released``, ``wait_at``, ``handoff``, ``publish``,
``release_empty``, ``take``, ``answer``, ``serve``, ``watchdog_stop``) go through
``ctypes.CDLL``, which releases the GIL for the call. The short ones (loads, stores, claim,
counters, and the proxy's checks of one round: ``check_desc``, ``unpack``) go through
``ctypes.PyDLL`` and keep it: releasing the GIL for 20 ns of work would invite another
thread to take it for a whole switch interval. ``wait_geq_holding`` and
``handoff_holding`` are the same C functions bound to keep the GIL, for waits the caller
bounds to microseconds (``streamsync``'s hold): they spin, and ``handoff_holding`` is
given no waiters word, so a wait holding the GIL never sleeps. ``host_round`` keeps it
too: the engine's hand-over of one round (its copies are the round's own bytes) and, where
the engine holds the GIL for a wait's first microseconds, that spin, bounded by the caller.

The C layer returns status codes; ``check`` is the one place that turns them into
exceptions. This module imports nothing beyond the standard library and the package's
torch-free vocabulary (the proxy process is torch-free and numpy-free).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import os
import time
from pathlib import Path

from .. import outcome, wire
from .structs import (
    BatchOut,
    CudaIn,
    HostRoundIn,
    HubCall,
    HubConn,
    HubResult,
    HubState,
    LaunchIn,
    LinkState,
    MarkovTable,
    MetaIn,
    ProxyState,
    RingGeom,
    ServeState,
    WindowsView,
)

ABI_VERSION = 27
SOURCE_DIR = Path(__file__).parent  # the library's sources (build.py compiles them)

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
    ("SAMPLED_BYTES", lambda: wire.round.SAMPLED_BYTES),  # a sampled ROUND's bytes per entry (module-level)
    ("DRAFTS_SAMPLED", lambda: wire.DRAFTS_SAMPLED),
    ("SAMPLED_TOP", lambda: wire.SAMPLED_TOP),
    ("SAMPLED_TOTAL", lambda: wire.SAMPLED_TOTAL),
    ("MAX_SAMPLED_ENTRIES", lambda: wire.MAX_SAMPLED_ENTRIES),
    ("MAX_SAMPLED_N_OUT", lambda: wire.MAX_SAMPLED_N_OUT),
    ("MAX_ENTRIES", lambda: wire.MAX_ENTRIES),
    ("MAX_N_OUT", lambda: wire.MAX_N_OUT),
    ("MAX_ROW_BYTES", lambda: wire.MAX_ROW_BYTES),
    ("MAX_TOKENS", lambda: wire.MAX_TOKENS),
    ("PING", lambda: wire.PING),
)
# The structs hf_sizeof reports, in its order (argument 0, 1, ...).
MIRRORS = (
    RingGeom,
    ProxyState,
    LinkState,
    WindowsView,
    BatchOut,
    MetaIn,
    CudaIn,
    LaunchIn,
    MarkovTable,
    ServeState,
    HostRoundIn,
    HubConn,
    HubState,
    HubResult,
    HubCall,
)
LOCK_FREE_ALL = 3  # hf_lock_free(): bit 0 for 32-bit words, bit 1 for 64-bit words


class Status(enum.IntEnum):
    """The C library's status codes (hostflag.h)."""

    OK = 0
    TIMEOUT = 1  # the deadline passed
    LATE = 2  # the round was already claimed by someone else
    ORDER = 3  # the previous round is not claimed yet (a caller bug)
    STATE = 4  # a word holds a value its protocol forbids
    NOMEM = 5
    SYS = 6  # errno is set


class HostRoundCode(enum.IntEnum):
    """``hf_host_round``'s and ``hf_host_answer``'s verdicts (hostflag.h's ``HF_HR_*``)."""

    OK = 0
    META = 1  # the batch's metadata broke a rule of host_meta (nothing handed over)
    ROW = 2  # a row index outside the rows (nothing handed over)
    ARGS = 3  # the caller's bug: no rows or index where the entries need them, entries past max_slots
    OTHER = 4  # the drafts slot holds another round
    GOT = 5  # the drafts slot's entry count is neither 0 nor the round's (a copied answer)


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
    "standby_wait": ("hf_standby_wait", _I, (_P, _U32, _U64), True),
    "standby_offer": ("hf_standby_offer", _I, (_P, _U32, _U64), True),
    "claim": ("hf_claim", _I, (_P, _U32), False),
    "zero_drafts": ("hf_zero_drafts", None, (_RING, _U32, _U32), False),
    "wait_geq": ("hf_wait_geq", _I, (_P, _U32, _U32, _U32, _U64), True),
    "wait_geq_holding": ("hf_wait_geq", _I, (_P, _U32, _U32, _U32, _U64), False),
    "wait_released": ("hf_wait_released", _I, (_P, _P, _U32, _U32, _U32, _U64), True),
    "wait_at": ("hf_wait_at", _I, (_P, _P, _U32, _U32, _U32, _U64, _P), True),
    "handoff": ("hf_handoff", _I, (_P, _P, _P, _P, _U32, _U32, _U32, _U64, _P, _P), True),
    "handoff_holding": ("hf_handoff", _I, (_P, _P, _P, _P, _U32, _U32, _U32, _U64, _P, _P), False),
    "take": ("hf_take", ctypes.c_int64, (_P, _U64), True),
    "answer": ("hf_answer", _I, (_P, _U32, _U32, _P), True),
    "round": ("hf_round", ctypes.c_int64, (_P, _P, _U64), True),
    "check_desc": ("hf_check_desc", _I, (_P, _P, _U32), False),
    "unpack": ("hf_unpack", _I, (_P, _P, _U32, _U32), False),
    "publish": ("hf_publish", _I, (_P, _P, _U32, _U64), True),
    "release_empty": ("hf_release_empty", _I, (_RING, _U32, _U32, _U64), True),
    "serve": ("hf_serve", _I, (_RING, _U32, _U32, _U32, _U32, _U32, _U64), True),
    "watchdog_start": ("hf_watchdog_start", _P, (_RING, _P, _U32, _U64, _U64), False),
    "watchdog_stop": ("hf_watchdog_stop", _I, (_P,), True),
    "watchdog_release_orphans": ("hf_watchdog_release_orphans", _I, (_P, _U32), True),
    "gather_rows": ("hf_gather_rows", _U32, (_P, _P, _U64, _U64, _P, _U32, _U32), False),
    "worker_round": ("hf_worker_round", _I, (ctypes.POINTER(WindowsView), _P, _U64, ctypes.POINTER(BatchOut)), False),
    "windows_forget": ("hf_windows_forget", None, (ctypes.POINTER(WindowsView),), False),
    "markov_draft": (
        "hf_markov_draft",
        None,
        (ctypes.POINTER(MarkovTable), _P, _P, _P, _U32, _U32, _P, _P, _P),
        False,
    ),
    "worker_serve": ("hf_worker_serve", _I, (ctypes.POINTER(ServeState),), True),
    "hub_open": ("hf_hub_open", _I, (ctypes.POINTER(HubState),), False),
    "hub_close": ("hf_hub_close", None, (ctypes.POINTER(HubState),), False),
    "hub_stop": ("hf_hub_stop", None, (ctypes.POINTER(HubState),), False),
    "hub_poke": ("hf_hub_poke", None, (ctypes.POINTER(HubState),), False),
    "hub_add": ("hf_hub_add", _I, (ctypes.POINTER(HubState), ctypes.POINTER(HubConn)), False),
    "hub_remove": ("hf_hub_remove", None, (ctypes.POINTER(HubState), ctypes.POINTER(HubConn)), False),
    "hub_io": ("hf_hub_io", _I, (ctypes.POINTER(HubState), _P), True),
    "hub_take": ("hf_hub_take", _U32, (ctypes.POINTER(HubState), _P, _U32, _U64), True),
    "hub_reply": (
        "hf_hub_reply",
        _I,
        (ctypes.POINTER(HubState), ctypes.POINTER(HubConn), ctypes.POINTER(HubResult)),
        True,
    ),
    "hub_drop": ("hf_hub_drop", None, (ctypes.POINTER(HubState), ctypes.POINTER(HubConn)), False),
    "hub_gather": ("hf_hub_gather", _I, (ctypes.POINTER(HubState), _P, _U32, ctypes.POINTER(HubCall)), True),
    "hub_answer": (
        "hf_hub_answer",
        None,
        (ctypes.POINTER(HubState), _P, _U32, ctypes.POINTER(HubResult), _P, _P),
        True,
    ),
    "host_meta": ("hf_host_meta", _I, (ctypes.POINTER(MetaIn), _P, _U64), False),
    "cuda_launch": ("hf_cuda_launch", _I, (ctypes.POINTER(CudaIn), ctypes.POINTER(LaunchIn)), False),
    "cuda_gather": ("hf_cuda_gather", _I, (ctypes.POINTER(CudaIn), ctypes.POINTER(LaunchIn)), False),
    "drafts_summary": ("hf_drafts_summary", None, (_P, _P, _P, _U32, _P, _P), False),
    "host_round": ("hf_host_round", _I, (ctypes.POINTER(HostRoundIn),), False),
    "host_answer": ("hf_host_answer", _I, (ctypes.POINTER(HostRoundIn), _U32, _U32, _P, _P), False),
    "host_summary": ("hf_host_summary", _I, (ctypes.POINTER(HostRoundIn), _U32), False),
    "sampled_picks": ("hf_sampled_picks", None, (_P, _P, _P, _P, _U32, _P, _P), False),
}


# The codes C and Python share, by hf_codes' table number: what a refusal calls one, where
# Python keeps them, that enum (looked up at load, not at import: a test may stand in
# another) and the members C reports, in its order. C's codes beyond these would be ones
# Python cannot name, so a table of another length is refused too.
CODE_TABLES = (
    ("status code", "remote_dspark.native.Status", lambda: Status, tuple(Status.__members__)),
    ("outcome", "remote_dspark.outcome.Outcome", lambda: outcome.Outcome, ("OK", "TIMEOUT", "ERROR", "BREAKER_SKIP")),
    (
        "round event",
        "remote_dspark.outcome.RoundEvent",
        lambda: outcome.RoundEvent,
        tuple(outcome.RoundEvent.__members__),
    ),
    ("host round code", "remote_dspark.native.HostRoundCode", lambda: HostRoundCode, tuple(HostRoundCode.__members__)),
)


def check(rc: int, what: str) -> Status:
    """Map a status code to the outcome a caller handles (OK, TIMEOUT, LATE) or raise.

    Raises:
        RuntimeError: ORDER or STATE (a protocol invariant broken), naming ``what``.
        MemoryError: NOMEM.
        OSError: SYS, with the C errno.
    """
    if rc == 0:
        return Status.OK  # (the common case, without the enum's lookup)
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
    Status.STATE: "a word holds a value its protocol forbids (a sequence word gone backwards, a release by a "
    "non-claimer, a standby's promotion word changed by another writer)",
}


def deadline_ns(timeout_s: float) -> int:
    """The CLOCK_MONOTONIC deadline (ns) ``timeout_s`` from now, as the waits take it."""
    return time.monotonic_ns() + max(0, int(timeout_s * 1e9))


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
        mirrors, without lock-free words (probed, not assumed from the build), or with
        shared constants or codes that are not Python's."""
        try:
            abi, lock_free, sizeof = lib.hf_abi_version, lib.hf_lock_free, lib.hf_sizeof
        except AttributeError as e:
            raise NativeError(f"{self.path} is not a hostflag library: {e}") from e
        abi.restype = lock_free.restype = ctypes.c_int
        if abi() != ABI_VERSION:
            raise NativeError(
                f"{self.path}: hostflag ABI {abi()}, this package binds {ABI_VERSION}; rebuild it from {SOURCE_DIR}"
            )
        sizeof.restype, sizeof.argtypes = ctypes.c_uint64, (ctypes.c_int,)
        for which, mirror in enumerate(MIRRORS):
            if sizeof(which) != ctypes.sizeof(mirror):
                raise NativeError(
                    f"{self.path}: struct {mirror.__name__} is {sizeof(which)} bytes "
                    f"in C, {ctypes.sizeof(mirror)} in ctypes; rebuild it from {SOURCE_DIR}"
                )
        self.lock_free = lock_free()
        if self.lock_free != LOCK_FREE_ALL:
            raise NativeError(
                f"{self.path}: 32/64-bit atomics are not lock-free on this "
                f"platform (hf_lock_free() = {self.lock_free}); the region's "
                "words cannot be shared between processes"
            )
        self._check_shared(lib)

    def _check_shared(self, lib) -> None:
        """Refuse a library whose wire constants or codes are not Python's, naming the
        first that differs and both values."""
        try:
            wire_constants, codes = lib.hf_wire_constants, lib.hf_codes
        except AttributeError as e:
            raise NativeError(f"{self.path} reports no shared constants: {e}") from e
        wire_constants.restype, wire_constants.argtypes = ctypes.c_uint32, (ctypes.c_void_p, ctypes.c_uint32)
        codes.restype, codes.argtypes = ctypes.c_uint32, (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32)
        expected = [(name, value()) for name, value in WIRE_CONSTANTS]
        self._compare("wire constant", "remote_dspark.wire", expected, wire_constants)
        for table, (what, where, enum_of, names) in enumerate(CODE_TABLES):
            members = enum_of()
            expected = [(name, getattr(members, name, None)) for name in names]
            self._compare(what, where, expected, functools.partial(codes, table))

    def _compare(self, what: str, where: str, expected: list[tuple[str, int | None]], report) -> None:
        """Refuse the library unless ``report(out, n)`` (one of its tables) has exactly
        ``expected``'s values, in order; ``what`` and ``where`` name them in the refusal."""
        out = (ctypes.c_uint64 * len(expected))()
        have = report(out, len(out))
        if have != len(expected):
            raise NativeError(
                f"{self.path}: reports {have} {what}s, this package checks {len(expected)}; "
                f"rebuild it from {SOURCE_DIR}"
            )
        for (name, value), in_c in zip(expected, out):
            if value is None or in_c != value:
                in_python = f"absent from {where}" if value is None else f"{int(value)} in {where}"
                raise NativeError(
                    f"{self.path}: {what} {name} is {in_c} in C, {in_python}; rebuild it from {SOURCE_DIR}"
                )

    def __repr__(self) -> str:
        return f"Native({self.path!r})"

"""``native.build``: where the library comes from, and this package's trusted build of it.

Which library is loaded (``load``), first match wins; ``origin`` decides it, once:

1. ``VLLM_DSPARK_REMOTE_HOSTFLAG_LIB``, when set: that file. A missing, unloadable or
   refused file is a ``ValueError`` naming the variable (a configuration error, raised
   at the engine's start);
2. ``libdsv41_hostflag.so`` in ``VLLM_DSPARK_REMOTE_OFL_DIR``, when that file exists and
   passes the trust rule and the binding's checks; a copy that fails either is refused
   with one warning and this package's own build is used instead;
3. ``hostflag.c`` and the other sources of ``SOURCES`` (next to this file, with the
   headers of ``HEADERS``) compiled together with
   ``cc -O2 -shared -fPIC -pthread`` at first use into the cache directory
   (``$XDG_CACHE_HOME/remote-dspark``, else ``~/.cache/remote-dspark``), named by the
   sha256 of the sources, the header and the command, so an edited source is rebuilt
   and an unchanged one never is. Each builder writes a temporary file of its own and
   renames it into place (atomic), so several processes may build at once and every one
   of them loads a complete library.

A cached build is trusted only when this user owns the cache directory and the file,
nobody else can write either, the file is read without following a link, and its sha256
equals the one recorded beside it at build time. A directory that fails this (someone
else's, or writable by others: a library planted there would run its constructor in the
engine) is never used: the library is built into a fresh private directory instead. A
file that fails it is rebuilt. The cache directory is created 0700.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..transport.endpoint import ENV_OFL_DIR
from ..trust import untrusted_because
from .binding import SOURCE_DIR, Native, NativeError

log = logging.getLogger("remote_dspark.native")

ENV_LIB = "VLLM_DSPARK_REMOTE_HOSTFLAG_LIB"
OFL_LIB_NAME = "libdsv41_hostflag.so"
SOURCE = SOURCE_DIR / "hostflag.c"
# Compiled together into one library.
_OTHERS = (
    "abi.c",
    "proxy_end.c",
    "watchdog.c",
    "tcp_round.c",
    "desc_check.c",
    "reply_check.c",
    "sampled_pick.c",
    "worker_round.c",
    "worker_serve.c",
    "worker_hub.c",
    "engine_meta.c",
    "engine_round.c",
    "cuda_launch.c",
)
SOURCES = (SOURCE, *(SOURCE_DIR / name for name in _OTHERS))
HEADERS = (SOURCE_DIR / "hostflag.h", SOURCE_DIR / "tcp_round.h", SOURCE_DIR / "sampled_pick.h")
CFLAGS = ("-O2", "-shared", "-fPIC", "-pthread")


@dataclass(frozen=True)
class Origin:
    """Where the library comes from: the file ``path``, and ``variable`` (``ENV_LIB`` or
    ``ENV_OFL_DIR``) with its ``value`` when the environment named it; ``variable`` is
    None for this package's own build."""

    path: str
    variable: str | None = None
    value: str = ""


def default_cache_dir(environ: Mapping[str, str]) -> Path:
    xdg = (environ.get("XDG_CACHE_HOME") or "").strip()
    base = Path(xdg) if xdg else Path(environ.get("HOME") or Path.home()) / ".cache"
    return base / "remote-dspark"


def origin(environ: Mapping[str, str], cache_dir: str | os.PathLike | None = None) -> Origin:
    """Where the library comes from, by the rules in the module docstring; builds it
    into the cache when neither variable names one. A copy in ``ENV_OFL_DIR`` is
    returned as found: ``load`` holds it to the trust rule and the binding's checks.

    Raises:
        ValueError: VLLM_DSPARK_REMOTE_HOSTFLAG_LIB names a missing file.
        NativeError: the library has to be built and cannot be (no compiler, a failed
            build, an unwritable cache directory).
    """
    named = (environ.get(ENV_LIB) or "").strip()
    if named:
        if not os.path.isfile(named):
            raise ValueError(f"{ENV_LIB}={named!r}: no such file")
        return Origin(os.path.abspath(named), ENV_LIB, named)  # a bare name would send dlopen searching elsewhere
    ofl_dir = (environ.get(ENV_OFL_DIR) or "").strip()
    if ofl_dir and os.path.isfile(os.path.join(ofl_dir, OFL_LIB_NAME)):
        return Origin(os.path.join(ofl_dir, OFL_LIB_NAME), ENV_OFL_DIR, ofl_dir)
    return Origin(_own_build(environ, cache_dir))


def locate(environ: Mapping[str, str] | None = None, cache_dir: str | os.PathLike | None = None) -> str:
    """The path of the library to load (``origin``'s), built into the cache when
    neither variable names one.

    Raises:
        ValueError, NativeError: as ``origin``.
    """
    return origin(os.environ if environ is None else environ, cache_dir).path


def load(environ: Mapping[str, str] | None = None, cache_dir: str | os.PathLike | None = None) -> Native:
    """Locate (or build) and load the library, by the rules in the module docstring.

    Raises:
        ValueError: VLLM_DSPARK_REMOTE_HOSTFLAG_LIB names a missing, unloadable or
            refused file (naming the variable).
        NativeError: no library can be built, or the one built is refused at load.
    """
    env = os.environ if environ is None else environ
    found = origin(env, cache_dir)
    if found.variable == ENV_LIB:
        try:
            return Native(found.path)
        except NativeError as e:
            raise ValueError(f"{ENV_LIB}={found.value!r}: {e}") from e
    if found.variable == ENV_OFL_DIR:
        why = untrusted_because(found.path)
        try:
            if why is None:
                return Native(found.path)
        except NativeError as e:
            why = str(e)
        log.warning("%s: %s; using this package's own build of %s", ENV_OFL_DIR, why, SOURCE.name)
        return Native(_own_build(env, cache_dir))
    return Native(found.path)


def _own_build(environ: Mapping[str, str], cache_dir: str | os.PathLike | None) -> str:
    """This package's build, in ``cache_dir`` or else the environment's default one."""
    return str(build(Path(cache_dir) if cache_dir is not None else default_cache_dir(environ), environ))


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
            raise NativeError(f"{cc} failed to build {SOURCE_DIR} (exit {proc.returncode}):\n{proc.stderr.strip()}")
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

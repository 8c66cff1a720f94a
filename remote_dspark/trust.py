"""Whether a file may be trusted: the one rule for every file this package imports or
``dlopen``s from a configured directory (``OFL_DIR``'s ``ofl.py``, ``libofl.so`` and
hostflag copy; the native build cache has a stricter rule of its own,
``native.trusted_cache``), and the one rule for a secret it reads (the pre-shared key of
``--key-file`` and ``VLLM_DSPARK_REMOTE_KEY_FILE``).

A file of code is trusted when it is a regular file, not a link, and it and its
directory belong to this user or to root and nobody else may write them: then only
someone who could already change this process could have put code there. A secret is
read only from a regular file, not a link, of this user or root, that nobody else may
read or write (mode 0600 or stricter), checked on the open descriptor it is read from.
Torch-free.
"""

from __future__ import annotations

import errno
import os
import stat


def foreign_owner(what: str, where: str, uid: int) -> str | None:
    """Why ``what`` (a file, a directory) at ``where``, owned by ``uid``, is not ours, or
    None when it belongs to this user or to root: the ownership half of the rule, also
    the stats file's directory check (whose writability rule differs: sticky ``/tmp``)."""
    me = os.getuid()
    if uid in (me, 0):
        return None
    return f"{what} {where} belongs to uid {uid}, not to this user ({me}) or root"


def untrusted_because(path: str) -> str | None:
    """Why the code at ``path`` must not be loaded, or None when it may be."""
    directory = os.path.dirname(os.path.abspath(path))
    for what, where, follow in (("directory", directory, True), ("file", path, False)):
        try:
            st = os.stat(where, follow_symlinks=follow)
        except OSError as e:
            return f"{what} {where}: {e.strerror}"
        if what == "file" and not stat.S_ISREG(st.st_mode):
            return f"{where} is not a regular file (a link or a device)"
        foreign = foreign_owner(what, where, st.st_uid)
        if foreign:
            return foreign
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{what} {where} may be written by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def read_secret(path: str, cap: int) -> bytes:
    """The bytes of the secret file at ``path`` (at most ``cap``), read only when it is a
    regular file, not a link, of this user or root, with no access for group or others
    (0600 or stricter). The checks are made on the descriptor the bytes are read from
    (opened without following a link, without blocking on a FIFO), so the file checked
    is the file read.

    Raises:
        ValueError: why the file is refused or unreadable (the caller names its flag or
            variable).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path} is a symbolic link; name the file itself") from e
        raise ValueError(f"{path}: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if owner := foreign_owner("file", path, st.st_uid):
            raise ValueError(owner)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(
                f"{path} may be read or written by others (mode {stat.S_IMODE(st.st_mode):04o}); "
                "a secret's mode is 0600 or stricter (chmod 600)"
            )
        data = f.read(cap + 1)
    if len(data) > cap:
        raise ValueError(f"{path} is over {cap} bytes")
    return data

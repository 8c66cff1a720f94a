"""Whether a file may be trusted: the one rule for every file this package imports or
``dlopen``s from a configured directory (``OFL_DIR``'s ``ofl.py``, ``libofl.so`` and
hostflag copy; the native build cache has a stricter rule of its own,
``native.trusted_cache``), and the one rule for a secret it reads (the pre-shared key of
``--key-file`` and ``VLLM_DSPARK_REMOTE_KEY_FILE``).

A file of code is trusted when it is a regular file, not a link, and it and its
directory belong to this user or to root and nobody else may write them: then only
someone who could already change this process could have put code there. A secret is
read only from a regular file, not a link, of this user or root, that nobody else may
read or write (mode 0600 or stricter), in a directory, not a link, of this user or root
that nobody else may write, each checked on the open descriptor it is read through.
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
    (0600 or stricter), in a directory, not a link, of this user or root that only its
    owner may write (so nobody else can put another file in its place).

    The checks are made on the descriptors the bytes are read through: the directory is
    opened without following a link, the file opened relative to that descriptor,
    without following a link and without blocking (a FIFO), then ``fstat``; so the
    directory and the file checked are those read. Each descriptor is closed on every
    path.

    Raises:
        ValueError: why the file is refused or unreadable (the caller names its flag or
            variable).
    """
    directory, name = os.path.split(path)
    if not name:
        raise ValueError(f"{path} names a directory; name the key file in it")
    dir_fd = _open_secret_dir(directory or ".")
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(f"{path} is a symbolic link; name the file itself") from e
            raise ValueError(f"{path}: {e.strerror}") from e
        try:
            if why := _secret_refused(path, os.fstat(fd)):
                raise ValueError(why)
            data = _read_at_most(fd, cap + 1)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    if len(data) > cap:
        raise ValueError(f"{path} is over {cap} bytes")
    return data


def _open_secret_dir(directory: str) -> int:
    """A descriptor of ``directory``, opened without following a link, once it is this
    user's or root's and only its owner may write it.

    Raises:
        ValueError: why not (the descriptor closed)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:  # a link is ELOOP or ENOTDIR (O_DIRECTORY): lstat only words the refusal
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(directory):
            raise ValueError(f"directory {directory} is a symbolic link; name the key's real directory") from e
        raise ValueError(f"directory {directory}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise ValueError(f"directory {directory}: {e.strerror}") from e
    why = foreign_owner("directory", directory, st.st_uid)
    if not why and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        why = (
            f"directory {directory} may be written by others (mode {stat.S_IMODE(st.st_mode):04o}); "
            "a secret's directory is writable by its owner only (chmod go-w, or a private directory)"
        )
    if why:
        os.close(fd)
        raise ValueError(why)
    return fd


def _secret_refused(path: str, st: os.stat_result) -> str | None:
    """Why the opened file ``path`` (its ``fstat``) is no secret's, or None."""
    if stat.S_ISDIR(st.st_mode):
        return f"{path} is a directory, not a regular file"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if owner := foreign_owner("file", path, st.st_uid):
        return owner
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return (
            f"{path} may be read or written by others (mode {stat.S_IMODE(st.st_mode):04o}); "
            "a secret's mode is 0600 or stricter (chmod 600)"
        )
    return None


def _read_at_most(fd: int, n: int) -> bytes:
    """Up to ``n`` bytes of ``fd``, to its end."""
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)

"""Whether code in a file may be loaded: the one rule for every file this package
imports or ``dlopen``s from a configured directory (``OFL_DIR``'s ``ofl.py``,
``libofl.so`` and hostflag copy; the native build cache has a stricter rule of its own,
``native.trusted_cache``).

A file is trusted when it is a regular file, not a link, and it and its directory
belong to this user or to root and nobody else may write them: then only someone who
could already change this process could have put code there. Torch-free.
"""

from __future__ import annotations

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

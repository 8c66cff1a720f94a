"""``statsfile``: write a JSON document to a path others may share, atomically and safely.

The stats file's default path is in /tmp (sticky, world-writable), so the writer assumes
the path may have been planted by another user, and:

* never follows a link: a symlink at the path is refused, and the temporary file is
  created ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a name planted there is never opened);
* never replaces a file it does not own: what is at the path must be a regular file
  owned by the effective uid (or nothing);
* refuses a directory that is neither this user's nor root's (``trust.foreign_owner``,
  the package's one ownership rule): its owner may rename or unlink the file just
  checked, or plant one between the check and the replace, whatever its mode says. The
  default's ``/tmp`` is root's;
* refuses a directory that others may write without the sticky bit (mode ``o+w`` or
  ``g+w`` and no ``+t``). There anyone with write access may rename or unlink the file
  just checked, or plant one between the check and the replace, so the two checks above
  would mean nothing. Group-writable counts too: a shared group directory is the place
  for ``chmod +t``. In a sticky directory the kernel refuses a rename over another
  user's entry (EPERM), which closes that race;
* writes to a temporary file in the target's directory (``.<name>.<random>.tmp``), then
  ``os.replace``: readers see the old document or the new one, whole. Every step names
  the directory by one descriptor (``dir_fd``), so a directory swapped under the path
  midway changes nothing. The directory itself is opened following links: it is the
  configured place, and its permissions are checked where it resolves;
* removes its temporary file on any failure, ``KeyboardInterrupt`` included;
* leaves the file mode 0644 (an explicit ``fchmod``: the umask does not matter).

torch is not imported here: the writer is usable from anything.
"""

from __future__ import annotations

import errno
import json
import os
import stat

from ...trust import foreign_owner

__all__ = ["UnsafePath", "write_json_atomic"]

MODE = 0o644
_TRIES = 8  # temporary names tried before giving up (each one random: a clash is a plant)


class UnsafePath(OSError):
    """The path (or its directory) is not one this writer may replace; nothing was written.
    ``errno`` says what kind of refusal, ``filename`` is the path, the message says why."""


def write_json_atomic(
    path: str | os.PathLike, doc, *, indent: int | None = 1, default=None, fsync: bool = False
) -> None:
    """Replace ``path`` with ``doc`` as JSON (``json.dumps(doc, indent=, default=)``),
    mode 0644, atomically; see the module docstring for what is refused.

    The document is serialised before anything is created, so an object JSON cannot
    encode leaves no trace. With ``fsync`` the file and then its directory are synced
    before and after the replace.

    Raises:
        UnsafePath (an OSError): a link, a non-regular file or another user's file at
            ``path``, a directory of another user (not root), or one others may write
            without the sticky bit.
        TypeError, ValueError: ``doc`` cannot be serialised (nothing written).
        OSError: the directory cannot be opened or written.
    """
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    if not name:
        raise UnsafePath(errno.EISDIR, "refusing to write the stats file: the path names a directory", path)
    data = json.dumps(doc, indent=indent, default=default).encode()
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_directory(os.fstat(dfd), directory, path)
        _check_target(dfd, name, path)
        _write_and_replace(dfd, name, data, fsync)
    finally:
        os.close(dfd)


def _check_directory(st: os.stat_result, directory: str, path: str) -> None:
    foreign = foreign_owner("directory", directory, st.st_uid)
    if foreign:
        raise UnsafePath(errno.EPERM, f"refusing to write the stats file: its {foreign}", path)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(
            errno.EPERM,
            f"refusing to write the stats file: its directory {directory} is writable "
            f"by others (mode {stat.S_IMODE(st.st_mode):04o}) without the sticky bit",
            path,
        )


def _check_target(dfd: int, name: str, path: str) -> None:
    """What is at ``name`` now must be nothing, or a regular file of ours (never followed)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(errno.ELOOP, "refusing to write the stats file: the path is a symbolic link", path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(
            errno.EEXIST,
            f"refusing to write the stats file: the path is not a regular file ({stat.filemode(st.st_mode)})",
            path,
        )
    euid = os.geteuid()
    if st.st_uid != euid:
        raise UnsafePath(
            errno.EPERM,
            f"refusing to write the stats file: the path is owned by uid {st.st_uid}, "
            f"not by this process's euid {euid}",
            path,
        )


def _write_and_replace(dfd: int, name: str, data: bytes, fsync: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_TRIES):
        tmp = f".{name[:200]}.{os.urandom(6).hex()}.tmp"  # within NAME_MAX
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, f"no free temporary name after {_TRIES} tries", name)
    try:
        try:
            os.fchmod(fd, MODE)  # explicit: the umask narrowed the creation mode
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        # rename(2) never follows a link at the destination; in a sticky directory it
        # fails (EPERM) over an entry someone else planted after _check_target.
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        raise
    if fsync:
        os.fsync(dfd)

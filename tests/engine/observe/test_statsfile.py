"""The stats file's writer: atomic, mode 0644, never through a link, never over another
user's file, and no temporary file left behind whatever fails."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from remote_dspark.engine.observe import statsfile
from remote_dspark.engine.observe.statsfile import UnsafePath, write_json_atomic


def entries(d) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture
def umask():
    """Set the process umask for one test; the old one comes back after it."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


# --------------------------------------------------------------------------- writes


def test_replaces_the_users_own_file(tmp_path):
    p = tmp_path / "stats.json"
    p.write_text("old")
    write_json_atomic(p, {"rounds": {"ok": 2}})
    assert json.loads(p.read_text()) == {"rounds": {"ok": 2}}
    write_json_atomic(str(p), {"rounds": {"ok": 3}}, fsync=True)
    assert json.loads(p.read_text()) == {"rounds": {"ok": 3}}
    assert entries(tmp_path) == ["stats.json"]


@pytest.mark.parametrize("mask", [0o077, 0o000])
def test_the_file_is_mode_0644_whatever_the_umask(tmp_path, umask, mask):
    umask(mask)
    p = tmp_path / "stats.json"
    write_json_atomic(p, {"a": 1})  # created
    assert mode(p) == 0o644
    p.chmod(0o600)
    write_json_atomic(p, {"a": 2})  # replaced
    assert mode(p) == 0o644 and json.loads(p.read_text()) == {"a": 2}


def test_default_serialises_what_json_cannot(tmp_path):
    p = tmp_path / "stats.json"
    write_json_atomic(p, {"when": object}, default=str)
    assert json.loads(p.read_text()) == {"when": str(object)}


# --------------------------------------------------------------------------- refusals


def test_a_link_at_the_path_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "victim"
    target.write_text("precious")
    target.chmod(0o600)
    link = tmp_path / "stats.json"
    link.symlink_to(target)
    with pytest.raises(UnsafePath, match="symbolic link") as e:
        write_json_atomic(link, {"a": 1})
    assert e.value.errno == errno.ELOOP and e.value.filename == str(link)
    assert target.read_text() == "precious" and mode(target) == 0o600
    assert link.is_symlink() and entries(tmp_path) == ["stats.json", "victim"]


def test_a_dangling_link_is_refused_and_nothing_is_created(tmp_path):
    link = tmp_path / "stats.json"
    link.symlink_to(tmp_path / "would-be-created")
    with pytest.raises(UnsafePath, match="symbolic link"):
        write_json_atomic(link, {"a": 1})
    assert entries(tmp_path) == ["stats.json"] and link.is_symlink()


def test_a_directory_at_the_path_is_refused(tmp_path):
    d = tmp_path / "stats.json"
    d.mkdir()
    with pytest.raises(UnsafePath, match="not a regular file") as e:
        write_json_atomic(d, {"a": 1})
    assert e.value.filename == str(d)
    assert d.is_dir() and entries(d) == [] and entries(tmp_path) == ["stats.json"]


def test_a_fifo_at_the_path_is_refused_without_opening_it(tmp_path):
    f = tmp_path / "stats.json"
    os.mkfifo(f)  # opening it for writing would block: the refusal never opens it
    with pytest.raises(UnsafePath, match="not a regular file"):
        write_json_atomic(f, {"a": 1})
    assert stat.S_ISFIFO(os.lstat(f).st_mode) and entries(tmp_path) == ["stats.json"]


def test_another_users_file_is_refused(tmp_path, monkeypatch):
    """A file of another user cannot be made without root: this process's euid is faked
    instead, so the file (ours) looks like someone else's."""
    p = tmp_path / "stats.json"
    p.write_text("theirs")
    monkeypatch.setattr(os, "geteuid", lambda: os.lstat(p).st_uid + 1)
    with pytest.raises(UnsafePath, match=f"owned by uid {os.lstat(p).st_uid}") as e:
        write_json_atomic(p, {"a": 1})
    assert e.value.errno == errno.EPERM and str(p) in str(e.value)
    assert p.read_text() == "theirs" and entries(tmp_path) == ["stats.json"]


def test_another_users_directory_is_refused_whatever_its_mode(tmp_path, monkeypatch):
    """A 0755 directory of another user: its owner could swap the file between the check
    and the replace. As root the directory is given to another uid; otherwise this
    process's uid is faked, so its own directory looks like someone else's."""
    d = tmp_path / "theirs"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    if os.getuid() == 0:
        os.chown(d, 54321, -1)
        owner = 54321
    else:
        owner = os.stat(d).st_uid
        monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    with pytest.raises(UnsafePath, match=f"directory {d} belongs to uid {owner}, not to this user") as e:
        write_json_atomic(d / "stats.json", {"a": 1})
    assert e.value.errno == errno.EPERM
    assert entries(d) == []


def test_the_defaults_directory_roots_sticky_tmp_is_accepted():
    """The contract's default path is in /tmp: root's, sticky, world-writable."""
    st = os.stat("/tmp")
    assert st.st_uid == 0 and st.st_mode & stat.S_ISVTX
    p = f"/tmp/remote-dspark-test-{os.getpid()}-{os.urandom(4).hex()}.json"
    try:
        write_json_atomic(p, {"a": 1})
        with open(p) as f:
            assert json.load(f) == {"a": 1}
    finally:
        os.unlink(p)


@pytest.mark.parametrize("dir_mode", [0o777, 0o770, 0o1777])
def test_a_directory_others_may_write_needs_the_sticky_bit(tmp_path, dir_mode):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(dir_mode)
    p = d / "stats.json"
    if dir_mode & stat.S_ISVTX:  # like /tmp: allowed
        write_json_atomic(p, {"a": 1})
        assert json.loads(p.read_text()) == {"a": 1} and mode(p) == 0o644
    else:
        with pytest.raises(UnsafePath, match=f"{d} is writable by others .mode {dir_mode:04o}. without the sticky"):
            write_json_atomic(p, {"a": 1})
        assert entries(d) == []


def test_a_path_naming_a_directory_is_refused(tmp_path):
    with pytest.raises(UnsafePath, match="not a regular file"):
        write_json_atomic(str(tmp_path) + "/", {"a": 1})
    with pytest.raises(UnsafePath, match="names a directory"):
        write_json_atomic("/", {"a": 1})


# --------------------------------------------------------------------------- failures leave nothing


def test_a_document_json_cannot_encode_writes_nothing(tmp_path):
    p = tmp_path / "stats.json"
    p.write_text("old")
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json_atomic(p, {"a": object()})
    with pytest.raises(ValueError, match="[Cc]ircular"):
        loop: dict = {}
        loop["self"] = loop
        write_json_atomic(p, loop)
    assert p.read_text() == "old" and entries(tmp_path) == ["stats.json"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError(errno.ENOSPC, "No space left on device")])
def test_the_temporary_file_is_removed_when_writing_fails(tmp_path, monkeypatch, exc):
    """A failure after the temporary file exists (a full disk, a ^C mid-write): it is
    removed, the old file stays, and the exception is the caller's."""
    p = tmp_path / "stats.json"
    p.write_text("old")
    made = []
    real_open = os.open

    def spy_open(name, flags, *a, **kw):
        fd = real_open(name, flags, *a, **kw)
        if flags & os.O_CREAT:
            made.append(name)
        return fd

    def failing_write(fd, data):
        assert entries(tmp_path) == sorted(["stats.json", *made])  # it exists while written
        raise exc

    monkeypatch.setattr(statsfile.os, "open", spy_open)
    monkeypatch.setattr(statsfile.os, "write", failing_write)
    with pytest.raises(type(exc) if isinstance(exc, BaseException) else exc):
        write_json_atomic(p, {"a": 1})
    assert len(made) == 1 and made[0].startswith(".stats.json.") and made[0].endswith(".tmp")
    assert p.read_text() == "old" and entries(tmp_path) == ["stats.json"]


def test_the_temporary_file_is_removed_when_the_replace_fails(tmp_path, monkeypatch):
    p = tmp_path / "stats.json"
    p.write_text("old")

    def failing_replace(*a, **kw):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(statsfile.os, "replace", failing_replace)
    with pytest.raises(PermissionError):
        write_json_atomic(p, {"a": 1})
    assert p.read_text() == "old" and entries(tmp_path) == ["stats.json"]


def test_a_planted_temporary_name_is_never_opened(tmp_path, monkeypatch):
    """A name that exists already (planted, say as a link) is skipped, never written
    through: O_EXCL | O_NOFOLLOW."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    names = iter([b"\x00" * 6, b"\x01" * 6])
    monkeypatch.setattr(statsfile.os, "urandom", lambda n: next(names))
    (tmp_path / f".stats.json.{'00' * 6}.tmp").symlink_to(victim)
    write_json_atomic(tmp_path / "stats.json", {"a": 1})
    assert victim.read_text() == "precious"
    assert json.loads((tmp_path / "stats.json").read_text()) == {"a": 1}
    assert entries(tmp_path) == sorted([".stats.json.000000000000.tmp", "stats.json", "victim"])

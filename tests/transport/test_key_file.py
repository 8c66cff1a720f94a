"""The pre-shared key's file (transport.auth.load_key over trust.read_secret): read only
when it is a regular file, not a link, this user's or root's, mode 0600 or stricter, in a
directory, not a link, only its owner may write; every refusal names the flag or
variable and says why, and leaves no descriptor open; a key of low variety is warned
about."""

from __future__ import annotations

import os

import pytest

from remote_dspark import trust
from remote_dspark.transport.auth import MIN_KEY, load_key

SECRET = b"0123456789abcdef0123456789abcdef"


def key_file(tmp_path, data: bytes = SECRET, mode: int = 0o600):
    path = tmp_path / "key"
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_a_private_key_file_is_read_whitespace_around_it_dropped(tmp_path):
    key = load_key(str(key_file(tmp_path, b"  " + SECRET + b"\n", 0o400)), "--key-file")
    assert key.secret == SECRET and key.path == str(tmp_path / "key")
    assert SECRET.decode() not in repr(key)  # a logged key names its file only


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o610, 0o644, 0o666])
def test_a_key_file_others_may_read_or_write_is_refused(tmp_path, mode):
    with pytest.raises(ValueError, match=rf"^--key-file='.*': .* may be read or written by others \(mode {mode:04o}\)"):
        load_key(str(key_file(tmp_path, mode=mode)), "--key-file")


def test_a_key_file_that_is_a_link_is_refused(tmp_path):
    target = key_file(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="VLLM_DSPARK_REMOTE_KEY_FILE=.*is a symbolic link"):
        load_key(str(link), "VLLM_DSPARK_REMOTE_KEY_FILE")


def test_a_key_file_of_another_user_is_refused(tmp_path, monkeypatch):
    path = key_file(tmp_path)
    if os.getuid() == 0:
        os.chown(path, 12345, -1)  # root may give it away; root's own files are trusted
    else:
        monkeypatch.setattr(trust.os, "getuid", lambda: os.stat(path).st_uid + 1)
    with pytest.raises(ValueError, match=r"--key-file=.*belongs to uid \d+, not to this user"):
        load_key(str(path), "--key-file")


def test_a_key_file_that_is_no_regular_file_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # opened non-blocking: no writer needed to be refused
    with pytest.raises(ValueError, match="is not a regular file"):
        load_key(str(fifo), "--key-file")


def test_a_short_long_or_missing_key_is_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match=f"--key-file=.*a key of 15 bytes, under {MIN_KEY}"):
        load_key(str(key_file(tmp_path, b"x" * 15 + b"\n")), "--key-file")
    with pytest.raises(ValueError, match="--key-file=.*is over 4096 bytes"):
        load_key(str(key_file(tmp_path, b"x" * 4097)), "--key-file")
    with pytest.raises(ValueError, match="--key-file=.*No such file"):
        load_key(str(tmp_path / "absent"), "--key-file")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_directory_as_key_file_is_refused_and_leaks_no_descriptor(tmp_path):
    """Refused on the opened descriptor's fstat, never read; each attempt closes what it
    opened (fifty attempts, not one descriptor more)."""
    (tmp_path / "keys").mkdir(mode=0o700)
    before = open_fds()
    for _ in range(50):
        with pytest.raises(ValueError, match=r"^VLLM_DSPARK_REMOTE_KEY_FILE='.*keys': .*keys is a directory"):
            load_key(str(tmp_path / "keys"), "VLLM_DSPARK_REMOTE_KEY_FILE")
    assert open_fds() == before


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o1777, 0o720], ids=oct)
def test_a_key_in_a_directory_others_may_write_is_refused(tmp_path, mode):
    """Whoever may write the key's directory may put another file in its place."""
    keys = tmp_path / "keys"
    keys.mkdir()
    key_file(keys)
    keys.chmod(mode)
    refusal = rf"^--key-file='.*': directory .*keys may be written by others \(mode {mode:04o}\)"
    with pytest.raises(ValueError, match=refusal):
        load_key(str(keys / "key"), "--key-file")
    keys.chmod(0o750)  # group and others may read and enter it, not write it: the key is read
    assert load_key(str(keys / "key"), "--key-file").secret == SECRET


def test_a_key_in_a_linked_directory_is_refused(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    key_file(keys)
    (tmp_path / "link").symlink_to(keys, target_is_directory=True)
    with pytest.raises(ValueError, match=r"^--key-file='.*link/key': directory .*link is a symbolic link"):
        load_key(str(tmp_path / "link" / "key"), "--key-file")


def test_a_key_file_path_ending_in_a_slash_is_refused(tmp_path):
    with pytest.raises(ValueError, match="names a directory"):
        load_key(f"{tmp_path}/", "--key-file")


def test_a_key_of_low_variety_is_read_with_a_warning_naming_the_file(tmp_path, caplog):
    path = key_file(tmp_path, b"a" * 16)
    with caplog.at_level("WARNING", logger="remote_dspark.auth"):
        assert load_key(str(path), "--key-file").secret == b"a" * 16
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert f"--key-file='{path}'" in caplog.text and "1 distinct byte values" in caplog.text
    assert "aaaa" not in caplog.text  # the key itself is never logged
    caplog.clear()
    with caplog.at_level("WARNING", logger="remote_dspark.auth"):
        load_key(str(key_file(tmp_path, SECRET)), "--key-file")  # 16 distinct: no warning
    assert caplog.records == []

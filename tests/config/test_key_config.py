"""VLLM_DSPARK_REMOTE_KEY_FILE, the engine's pre-shared key (an extension of the contract):
unset means no authentication; a key file is read once, at configuration, under the rule
for a secret, and a loose one raises ValueError naming the variable; the key reaches the
proxy only inside the hand-over document, and a logged configuration names the file only."""

from __future__ import annotations

import os

import pytest

from remote_dspark.config.api import RemoteConfig, describe
from remote_dspark.config.env import ENV_ENDPOINT
from remote_dspark.proxy import handover

VAR = "VLLM_DSPARK_REMOTE_KEY_FILE"
BASE = {ENV_ENDPOINT: "tcp://127.0.0.1:18620", "VLLM_DSPARK_REMOTE_IDENTITY": "ab" * 32}
SECRET = b"an engine's key of 32 bytes, hex"


@pytest.fixture
def key_path(tmp_path):
    path = tmp_path / "key"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    return path


def test_unset_or_blank_means_no_authentication():
    assert RemoteConfig.from_env(BASE).key is None
    assert RemoteConfig.from_env(BASE | {VAR: "  "}).key is None


def test_a_private_key_file_is_the_configurations_key_and_is_never_shown(key_path):
    env = BASE | {VAR: str(key_path)}
    cfg = RemoteConfig.from_env(env)
    assert cfg.key.secret == SECRET and cfg.key.path == str(key_path)
    rows = {name: (value, source) for name, value, source in describe(cfg, env)}
    assert rows[VAR] == (str(key_path), "env")
    shown = repr(cfg) + repr(describe(cfg, env))
    assert SECRET.decode() not in shown and SECRET.hex() not in shown


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_loose_key_file_raises_naming_the_variable(key_path, mode):
    key_path.chmod(mode)
    with pytest.raises(ValueError, match=rf"^{VAR}='.*': .*mode {mode:04o}"):
        RemoteConfig.from_env(BASE | {VAR: str(key_path)})


def test_a_linked_or_missing_key_file_raises_naming_the_variable(key_path, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(key_path)
    with pytest.raises(ValueError, match=f"^{VAR}=.*symbolic link"):
        RemoteConfig.from_env(BASE | {VAR: str(link)})
    with pytest.raises(ValueError, match=f"^{VAR}=.*No such file"):
        RemoteConfig.from_env(BASE | {VAR: str(tmp_path / "absent")})


def test_the_key_reaches_the_proxy_through_the_hand_over_pipe_only(key_path):
    """The proxy never reads the key file (it may be gone, or changed, by then): the key
    is in the document the engine writes into the pipe."""
    cfg = RemoteConfig.from_env(BASE | {VAR: str(key_path)})
    fd = handover.write(cfg, engine_id=7)
    os.unlink(key_path)
    got = handover.read(fd)
    assert got.cfg.key.secret == SECRET and got.cfg == cfg
    assert RemoteConfig.from_json(RemoteConfig.from_env(BASE).to_json()).key is None


def test_a_directory_as_key_file_raises_naming_the_variable(tmp_path):
    (tmp_path / "keys").mkdir(mode=0o700)
    with pytest.raises(ValueError, match=rf"^{VAR}='.*keys': .*is a directory, not a regular file"):
        RemoteConfig.from_env(BASE | {VAR: str(tmp_path / "keys")})

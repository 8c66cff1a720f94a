"""The pre-shared key both sides authenticate with at HELLO (:mod:`remote_dspark.wire.auth`
says how): the worker's ``--key-file``, the engine's ``VLLM_DSPARK_REMOTE_KEY_FILE``.

A key file holds the key's bytes; ASCII whitespace around them is not part of the key
(so ``openssl rand -hex 32`` and ``head -c 32 /dev/urandom`` both make one, written
under ``umask 077``).
It must hold at least :data:`MIN_KEY` bytes, and it is read only under the rule for a
secret (:func:`remote_dspark.trust.read_secret`: a regular file, not a link, this user's
or root's, mode 0600 or stricter, in a directory only its owner may write), so a key
others could read or replace is refused before anything is served or sent. A key of
fewer than :data:`MIN_VARIETY` distinct byte values (sixteen 'a's, a short pattern
repeated) is accepted with a warning: a crude check that catches only the obvious (a
random key of 32 hex digits or more has 14 to 16), never a proof of randomness.
Torch-free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..trust import read_secret

MIN_KEY = 16  # bytes: 128 bits of a random key
MAX_KEY_FILE = 4096  # bytes read at most
MIN_VARIETY = 8  # distinct byte values under which a key is warned about

log = logging.getLogger("remote_dspark.auth")


@dataclass(frozen=True, repr=False)
class Key:
    """A pre-shared key and the file it was read from. Its ``repr`` names the file only,
    so logging a configuration never prints the secret."""

    path: str
    secret: bytes

    def __repr__(self) -> str:
        return f"Key({self.path!r})"


def load_key(path: str, name: str) -> Key:
    """The key in the file at ``path``; ``name`` (the flag or variable that named it) is
    in every error, and in the warning for a key of low variety.

    Raises:
        ValueError: naming ``name`` and the path: the file is refused by the rule for a
            secret (owner, mode, a link), unreadable, too long, or its key too short.
    """
    try:
        secret = read_secret(path, MAX_KEY_FILE).strip()
    except ValueError as e:
        raise ValueError(f"{name}={path!r}: {e}") from e
    if len(secret) < MIN_KEY:
        raise ValueError(
            f"{name}={path!r}: a key of {len(secret)} bytes, under {MIN_KEY} "
            "(make one with: (umask 077; openssl rand -hex 32 > FILE))"
        )
    if (variety := len(set(secret))) < MIN_VARIETY:
        log.warning(
            "%s=%r: a key of only %d distinct byte values, easy to guess; "
            "make one with: (umask 077; openssl rand -hex 32 > FILE)",
            name,
            path,
            variety,
        )
    return Key(path, secret)

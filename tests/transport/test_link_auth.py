"""Authentication on the engine's side of the network: the link with a key (both
transports: TCP and the ofl adapter share the handshake, which sits above the byte
stream), and a refused authentication handled as any refused HELLO (an ERROR round at
once, the connector backing off)."""

from __future__ import annotations

import pytest
from helpers import COUNTING, until
from test_transport import STAND_IN_OFL

from remote_dspark import wire
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.outcome import Outcome, RoundEvent
from remote_dspark.transport import parse_endpoint
from remote_dspark.transport.auth import Key
from remote_dspark.transport.breaker import Breaker
from remote_dspark.transport.client import AuthFailed, Refused
from remote_dspark.transport.link import RemoteLink
from remote_dspark.worker import Worker

KEY = Key("key", b"the link tests' key of 32 bytes!")
NEW = [wire.Entry(0, 3, 0, (1,), new_gen=True)]


@pytest.fixture
def keyed():
    w = Worker(MarkovDrafter(COUNTING), "127.0.0.1", 0, key=KEY).start()
    yield w
    w.stop()


def make_link(endpoint: str, key: Key | None, environ=None, backoff_ms: int = 20) -> RemoteLink:
    drafter = MarkovDrafter(COUNTING)
    return RemoteLink(
        parse_endpoint(endpoint),
        wire.Hello(drafter.drafter_identity, drafter.markov_identity, 1, 4, 0, 3),
        session=5,
        connect_timeout_ms=2000,
        backoff_ms=backoff_ms,
        backoff_max_ms=4 * backoff_ms,
        breaker=Breaker(3, 2),
        environ=environ,
        key=key,
    )


def test_a_link_with_the_key_is_served_over_tcp(keyed):
    link = make_link(f"tcp://127.0.0.1:{keyed.port}", KEY)
    try:
        link.connect()
        r = link.round_entries(1, NEW, b"", 0, 2000)
        assert r.outcome is Outcome.OK and r.drafts.row(0) == [2, 3, 4]
    finally:
        link.close()


def test_a_link_with_the_key_is_served_over_the_ofl_adapter(keyed, tmp_path):
    (tmp_path / "ofl.py").write_text(STAND_IN_OFL)
    (tmp_path / "libofl.so").write_bytes(b"")
    env = {"VLLM_DSPARK_REMOTE_OFL_DIR": str(tmp_path)}
    link = make_link(f"o1tcp://127.0.0.1:{keyed.port}", KEY, env)
    try:
        link.connect()
        r = link.round_entries(1, NEW, b"", 0, 2000)
        assert r.outcome is Outcome.OK and r.drafts.row(0) == [2, 3, 4]
    finally:
        link.close()
    other = make_link(f"o1tcp://127.0.0.1:{keyed.port}", Key("other", b"x" * 32), env)
    with pytest.raises(AuthFailed):
        other.connect()
    other.close()


@pytest.mark.parametrize("key", [None, Key("other", b"another key, but 32 bytes long!!")])
def test_a_refused_authentication_is_an_error_round_and_a_back_off(keyed, key):
    link = make_link(f"tcp://127.0.0.1:{keyed.port}", key)
    try:
        with pytest.raises(Refused) as e:
            link.connect()
        assert e.value.code == wire.REFUSE_AUTH
        link.start_reconnecting()
        r = link.round_entries(1, NEW, b"", 0, 2000)
        assert (r.outcome, r.event, link.connected) == (Outcome.ERROR, RoundEvent.AT_ONCE, False)
        assert link.attempts == 0  # not sent: no connection
        # The connector goes on trying, each failure doubling its delay.
        assert until(lambda: link.keeper._delay_s == 4 * link.backoff_ms / 1000, timeout=10)
        assert "VLLM_DSPARK_REMOTE_KEY_FILE" in link.last_error  # says what to set
        assert link.epoch == 0
    finally:
        link.close()
    if key is None:  # the worker said no: counted at its door
        assert keyed.statistics().refusals["auth"] >= 2

"""The proxy's loop: take rounds from the region, send them to the remote drafter,
answer them. :class:`ProxyLoop` runs in the proxy process (:mod:`remote_dspark.proxy_proc`
starts it) and, in thread mode, as a thread of the engine, for comparison.

The link (:mod:`remote_dspark.transport.link`) keeps an active connection and a spare;
whenever its active changes it publishes the region's link words (the engine re-announces
every slot on a new epoch) and then the native round's connection word, so the next
round takes the new connection without this loop's help, even mid-wait.

Per round, on a TCP connection (and whenever there is none): one native call,
``hf_round`` (:mod:`.tcp_round`), takes the round, sends it straight from the region,
waits for the DRAFTS, checks and writes them and releases the round, so no Python runs
between a round's ``gathered`` and its ``released``; the loop asks the breaker before
the call and does the accounting after it. On an ofl transport the same steps run in
Python, with no loop over entries: wait (in C, GIL released: spin ``ASYNC_SPIN_US``,
then sleep on the engine's ``published`` word while nothing is handed over; a round
handed over but not gathered yet is looked at, napping ``ASYNC_NAP_US`` between looks
or, with 0, spinning), check the descriptor (in C, as ``hf_round``
does; a bad one is answered ERROR unsent and counted ``rounds_bad_desc``), ask the
breaker, send the ROUND from the region, receive DRAFTS within the deadline, check and
unpack them (in C, ``hf_round``'s reader), then claim, write, release and count in one
native call. A round the watchdog answered first is dropped and counted late.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from .. import native
from ..config.api import RemoteConfig
from ..outcome import Outcome, RoundEvent
from ..shm import memfd
from ..transport.breaker import Breaker, BreakerRecord
from ..transport.conn import Conn
from ..transport.link import RemoteLink
from .ring_end import ProxyEnd, ProxyRound
from .tcp_round import Served, TcpRounds

log = logging.getLogger("remote_dspark.proxy")

IDLE_TICK_S = 0.05  # how often an idle proxy beats and checks its parent and stop flag
AT_ONCE_MAX = 1 << 20  # rounds answered target-only in one native call (bounded by the tick)


class RegionBreaker:
    """The breaker, its state kept in the region's breaker block (the proxy is its only
    writer), so a respawned proxy resumes it and the engine exports it."""

    def __init__(self, cfg: RemoteConfig, header: memfd.HeaderWords):
        self._header = header
        s = header.breaker()
        self.breaker = Breaker(
            cfg.trip, cfg.cooldown, BreakerRecord(s.state, s.consecutive_failures, s.cooldown_left, s.trips, s.probes)
        )
        self._written = s

    def flush(self) -> None:
        r = self.breaker.store
        s = memfd.BreakerState(int(r.state), r.failures, r.cooldown_left, r.trips, r.probes)
        if s != self._written:
            self._header.set_breaker(s)
            self._written = s


class ProxyLoop:
    """One proxy over one region. ``run(should_stop)`` until ``should_stop()`` is true;
    it is checked at least every ``IDLE_TICK_S``."""

    def __init__(
        self,
        region: memfd.Region,
        lib: native.Native,
        cfg: RemoteConfig,
        *,
        engine_id: int,
        vocab_size: int = 0,
        environ: Mapping[str, str] | None = None,
    ):
        self.cfg = cfg
        # The session's terms (HELLO) are what every reply is held to, in C (hf_unpack).
        self.end = ProxyEnd(
            region,
            lib,
            spin_us=cfg.async_spin_us,
            nap_us=cfg.async_nap_us,
            vocab_size=vocab_size,
            want_margin=cfg.want_margin,
            want_sampled=cfg.sampled_top32,
        )
        self.session = self.end.header.session
        # The region's context_tokens and round_tokens words (this proxy their one
        # writer): 0 until this proxy's own worker has answered HELLO (words left by a
        # proxy before it name that one's worker), then each connection's HELLO_ACK,
        # stored before a round can go out on it, and 0 again when it is dropped
        # (RemoteLink's on_acked; HeaderWords.set_acked orders the two stores).
        self.end.header.set_acked(0, 0)
        self.breaker = RegionBreaker(cfg, self.end.header)
        lay = region.layout
        hello = cfg.hello(
            engine_id, max_slots=lay.max_slots, row_bytes=lay.row_bytes, num_spec=lay.num_spec, vocab_size=vocab_size
        )
        self.link = RemoteLink(
            cfg.endpoint,
            hello,
            self.session,
            connect_timeout_ms=cfg.connect_timeout_ms,
            backoff_ms=cfg.backoff_ms,
            backoff_max_ms=cfg.backoff_max_ms,
            breaker=self.breaker.breaker,
            environ=environ,
            on_connect=self._connected,
            on_acked=self.end.header.set_acked,
            on_change=self._link_changed,
            on_count=self.end.counters.add,
            key=cfg.key,
        )
        self.rounds = TcpRounds(self.end, session=self.session, default_deadline_ms=cfg.timeout_ms)
        self.end.header.set_link(0, 0, "", 0, False)
        self._allow: bool | None = None  # the breaker's word for the next round, once asked

    def _link_changed(self, active: Conn | None, spare: Conn | None) -> None:
        """The link's hook (under its lock): the region's link words, then the native
        round's connection word, so the engine hears of a new worker session no later
        than the round that takes it."""
        a = active.address if active is not None else None
        self.end.header.set_link(
            self.link.epoch,
            active.incarnation if active is not None else 0,
            a.host if a is not None else "",
            a.port if a is not None else 0,
            spare is not None,
        )
        sock = active.sock if active is not None else None
        self.rounds.publish(self.link.epoch, sock.fileno() if sock is not None else -1)

    def _connected(self) -> None:
        if self.link.epoch > 1:
            self.end.counters.add("reconnects")

    def connect(self) -> None:
        """First connection, within CONNECT_TIMEOUT_MS; on failure, reconnect in the
        background (rounds meanwhile are answered at once, target-only)."""
        try:
            self.link.connect()
        except Exception as e:  # refused, unreachable, no ofl library: keep serving
            log.warning("proxy: first connection to %s failed (%s); retrying with back-off", self.cfg.endpoint, e)
            self.link.start_reconnecting()

    def run(self, should_stop: Callable[[], bool]) -> None:
        # The first beat says "serving": only after the first connection attempt, so the
        # engine answers rounds itself (target-only, at once) while this proxy starts.
        self.connect()
        try:
            while not should_stop():
                self.step(IDLE_TICK_S)
        finally:
            self.rounds.publish(0, -1)
            self.link.close()

    def step(self, timeout_s: float) -> None:
        """Beat, wait up to ``timeout_s`` for the next round and answer it."""
        self.link.reap()  # (no native call holds a descriptor between calls)
        sock = self.link.tcp_socket()
        if sock is None and self.link.connected:  # a transport of its own (ofl)
            rnd = self.end.next_round(timeout_s)
            if rnd is not None:
                self.serve(rnd)
            return
        if sock is not None and self._allow is None:
            # Asked once per round that reaches the network's door, as RemoteLink.round
            # does; kept across idle ticks until a round uses it.
            self._allow = self.link.allow()
        # With no connection every round is answered at once (target-only) and counted in
        # C: the call answers them all until the idle tick, for the reconnect to be seen.
        served = self.rounds.serve(
            timeout_s,
            send=bool(self._allow) and sock is not None,
            at_once=Outcome.ERROR if sock is None else Outcome.BREAKER_SKIP,
            at_once_max=AT_ONCE_MAX if sock is None else 1,
        )
        if served is None:
            return
        if sock is not None and served.event is not RoundEvent.BAD_DESC:
            self._allow = None
        self._account(served)

    def _account(self, s: Served) -> None:
        """After a native round (released already): the breaker, counters and log."""
        ev = s.event
        if s.sent:
            self.link.attempts += 1
            self.end.counters.add("attempts")
        if s.late:  # replies to rounds this proxy had given up on
            self.end.counters.add("rounds_late", s.late)
        self.breaker.breaker.observe(ev)
        if s.sent:  # (leaves the connection the round took, if the event says so)
            self.link.observe(s.epoch, ev, s.why, s.round)
        if ev is RoundEvent.BAD_REPLY:
            log.error("proxy: round %d: worker reply refused: %s", s.round, s.why)
        elif ev is RoundEvent.BAD_DESC and s.released:
            log.error("proxy: round %d: %s", s.round, s.why)
        self.breaker.flush()

    def serve(self, rnd: ProxyRound) -> None:
        try:
            fields = rnd.fields()
            parts = rnd.wire_parts(self.session, fields)
        except ValueError as e:  # a descriptor that breaks a rule: answer it empty, unsent
            # False: the watchdog answered it first (its descriptor may be reused already)
            if self.end.complete(rnd, None, Outcome.ERROR):
                log.error("proxy: round %d: %s", rnd.round, e)
                self.end.counters.add("rounds_bad_desc")
            return
        deadline_ms = fields[0] or self.cfg.timeout_ms
        attempts, late = self.link.attempts, self.link.late
        # The reply is held to hf_round's rules inside the round (hf_unpack), so a broken
        # one is the round's event there: PROTOCOL drops the connection, as on TCP.
        result = self.link.round(rnd.round, parts, deadline_ms, lambda d: self.end.check_reply(rnd, d))
        if self.link.attempts != attempts:
            self.end.counters.add("attempts")
        if self.link.late != late:  # replies to rounds this proxy had given up on
            self.end.counters.add("rounds_late", self.link.late - late)
        self.breaker.flush()
        try:
            self.end.complete(rnd, result.drafts, result.outcome)
        except ValueError as e:  # drafts that do not fit the round (a worker bug)
            log.error("proxy: round %d: worker reply refused: %s", rnd.round, e)
            self.end.complete(rnd, None, Outcome.ERROR)

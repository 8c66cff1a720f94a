"""``ASYNC=0``: the engine thread does the network round itself, within ``TIMEOUT_MS``
(the send included), over a :class:`~remote_dspark.transport.link.RemoteLink`."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from ... import wire
from ...outcome import Outcome
from ...supervisor.restarts import Supervisor
from ...transport.breaker import Breaker
from ...transport.link import RemoteLink
from ..lifecycle import Users, stop_in_caller
from ..observe.stats import BreakerStats, LinkStats, PathStats
from ..spec import Spec
from ..values.batch import Batch, HostMeta, as_bytes, gather_rows_host, has_rows, meta_to_host
from ..values.drafts import Drafts, Launched, empty_drafts, to_drafts
from ..values.meta import write_meta
from ..values.reply import Asked, check_reply, draft_positions

log = logging.getLogger("remote_dspark.engine")


class SyncPath:
    """One connection, one send buffer for every round (header, fixed part, entry
    arrays, tokens) and one rows buffer (the frame's second part). Its users are the
    connection's: the last out closes it."""

    supervisor: Supervisor | None = None  # no proxy
    wait_cpu_s = 0.0  # a round waits on its socket, not spinning on a release

    @property
    def acked_context(self) -> int:
        """The link's: its connection's HELLO_ACK (only this thread drops a connection,
        so the round cut with it goes out on that connection or on none)."""
        return self.link.context_tokens

    @property
    def acked_round_tokens(self) -> int:
        """The link's, as :attr:`acked_context`."""
        return self.link.round_tokens

    def __init__(self, spec: Spec):
        self.spec = spec
        cfg = spec.cfg
        self.link = RemoteLink(
            cfg.endpoint,
            spec.hello(),
            wire.random_id(),
            connect_timeout_ms=cfg.connect_timeout_ms,
            backoff_ms=cfg.backoff_ms,
            backoff_max_ms=cfg.backoff_max_ms,
            breaker=Breaker(cfg.trip, cfg.cooldown),
            environ=spec.environ,
            key=cfg.key,
        )
        self._epoch = 0
        self._round_id = 0
        self._send = np.zeros(
            wire.HEADER.size + wire.round_meta_bytes(spec.max_slots, spec.sampled) + 4 * spec.max_tokens,
            dtype=np.uint8,
        )
        self._rows = np.zeros((spec.max_slots, spec.row_bytes), dtype=np.uint8)
        self.users = Users(self.link.close)

    def start(self) -> None:
        try:
            self.link.connect()
        except Exception as e:
            if self.spec.cfg.strict_start:
                raise
            log.warning(
                "remote DSpark: first connection to %s failed (%s); rounds are target-only until a reconnect succeeds",
                self.spec.cfg.endpoint,
                e,
            )
            self.link.start_reconnecting()
        self._epoch = self.link.epoch

    def round(self, batch: Batch) -> Drafts:
        """One network round: the ROUND written into the send buffer (arrays copied into
        place, rows by one gather), sent as two buffers, DRAFTS read as views."""
        spec = self.spec
        self._round_id = round_id = (self._round_id + 1) & 0xFFFFFFFF
        meta = spec.meta(meta_to_host(batch) if batch.meta_on_device else batch, self.link.context_tokens)
        n = meta.n
        rows = self._rows[:n]
        if not has_rows(batch, spec.row_bytes):
            pass  # an engine without rows: an empty rows part
        elif batch.rows.device.type == "cpu":
            gather_rows_host(batch, self._rows, spec.row_bytes)
        else:  # a blocking round anyway: gather on the device, one copy to the host
            rows[:] = (
                as_bytes(batch.rows, spec.row_bytes)
                .index_select(0, torch.as_tensor(batch.row_index, device=batch.rows.device))
                .cpu()
                .numpy()
            )
        size = write_meta(
            self._send[wire.HEADER.size :], meta, deadline_ms=spec.cfg.timeout_ms, row_bytes=spec.row_bytes
        )
        wire.pack_header_into(self._send, wire.ROUND, size + n * spec.row_bytes, self.link.session, round_id)
        parts = (memoryview(self._send)[: wire.HEADER.size + size], memoryview(rows.reshape(-1)))  # a view
        asked = Asked(
            meta.slots,
            meta.n_out,
            spec.num_spec,
            spec.vocab_size,
            spec.cfg.want_margin,
            spec.sampled,
            meta.seed if spec.sampled else None,  # the ROUND's: each draft is held to its pick
            draft_positions(meta.positions, meta.offsets) if spec.sampled else None,
        )
        # The reply is held to what was asked inside the round, so a broken rule is the
        # round's event (PROTOCOL drops the connection, BAD_REPLY keeps it), never drafts.
        result = self.link.round(round_id, parts, spec.cfg.timeout_ms, lambda d: check_reply(d, asked))
        d = result.drafts
        if d is not None:
            out = self._drafts(meta, d, result.outcome)
        else:
            out = empty_drafts(n, spec.num_spec, result.outcome, spec.cfg.want_margin, spec.sampled)
        if self.link.epoch != self._epoch:
            self._epoch = self.link.epoch
            out.resync_all = self._epoch > 1
        return out

    def _drafts(self, meta: HostMeta, d: wire.DraftsFrame, outcome: Outcome) -> Drafts:
        """The worker's DRAFTS, checked already (``check_reply``), as ``Drafts``."""
        spec, n = self.spec, meta.n
        counts = np.frombuffer(d.counts, dtype=np.uint16)
        tokens = np.frombuffer(d.tokens, dtype=np.int32).reshape(n, d.width)
        margins = None if d.margins is None else np.frombuffer(d.margins, dtype=np.float32).reshape(n, d.width)
        shape = (n, d.width, wire.SAMPLED_TOP)
        q = None
        if d.sampled:
            q = (np.frombuffer(d.q_ids, np.int32).reshape(shape), np.frombuffer(d.q_weights, np.uint16).reshape(shape))
        return to_drafts(
            spec.num_spec,
            meta.slots,
            counts,
            np.frombuffer(d.statuses, dtype=np.uint16),
            tokens,
            margins,
            outcome,
            spec.cfg.want_margin,
            q=q,
        )

    def launch(self, batch: Batch, answer: Callable[[Batch], Drafts], out=(), status=None) -> Launched:
        """``launch()`` in sync mode (``ASYNC=0``, or after a failed self-test): the round
        (``answer``) runs now, blocking, and comes back completed, with the shapes and on
        the device an asynchronous launch gives, under the id of its ROUND (into ``out``
        and ``status`` when given, as ``Handoff.launch``)."""
        d = answer(batch)
        arrays = (d.tokens, d.counts) + ((d.q_ids, d.q_weights) if d.q_ids is not None else ())
        if out:  # (an answer without q leaves a sampled engine's q zero)
            out = tuple(t.copy_(a) if a is not None else t.zero_() for t, a in zip(out, arrays + (None, None)))
        else:
            device = batch.rows.device if batch.rows is not None else torch.device(self.spec.device)
            out = tuple(a.to(device) for a in arrays)
        if status is not None:
            status.fill_(int(d.outcome))
        return Launched(self._round_id, *out[:2], d.resync, d.resync_all, *(out[2:] or (None, None)))

    def stop(self, limit_s: float) -> None:
        """A round in flight on the engine thread ends at once (LOST): its socket is shut
        down under it."""
        stop_in_caller(self.users, self.link.interrupt, limit_s)

    def stats(self) -> PathStats:
        b, k = self.link.breaker.store, self.link
        active = k.active
        link = LinkStats(
            k.attempts,
            k.late,
            k.reconnects,
            BreakerStats(int(b.state), b.trips, b.probes),
            dict(k.failovers),
            k.fenced,
            str(active.address or k.endpoint) if active is not None else "",
            active.incarnation if active is not None else 0,
            k.spare is not None,
        )
        return PathStats(link, connected=self.link.connected)

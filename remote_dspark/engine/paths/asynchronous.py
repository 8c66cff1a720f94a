"""``ASYNC=1`` as one round path: the engine's half of the hand-off through the region
(:class:`~.handoff.Handoff`) and the host that runs the proxy serving it
(:mod:`.proxy_host`, a thread or a supervised process by the mode)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ...supervisor.restarts import Supervisor
from ..observe.stats import EngineCounts, PathStats
from ..spec import Spec
from ..values.batch import Batch
from ..values.drafts import Drafts, Launched
from .handoff import Handoff
from .proxy_host import host_for

log = logging.getLogger("remote_dspark.engine")

FENCE_STEP_S = 0.005  # closing: how often the rounds in flight are answered again while users remain


class AsyncPath:
    """Building it is the hand-off's self-test (see :mod:`.handoff`); ``start()`` starts
    the proxy. Its users are the region's: the last out unmaps it."""

    def __init__(self, spec: Spec, counts: EngineCounts):
        self.handoff = Handoff(spec, counts)
        self.host = host_for(spec, self.handoff)
        self.users = self.handoff.users

    @property
    def supervisor(self) -> Supervisor | None:
        return self.host.supervisor

    @property
    def wait_cpu_s(self) -> float:
        return self.handoff.wait_cpu_s

    @property
    def acked_context(self) -> int:
        return self.handoff.acked_context()

    @property
    def acked_round_tokens(self) -> int:
        return self.handoff.acked_round_tokens()

    def start(self) -> None:
        self.host.start()

    def round(self, batch: Batch) -> Drafts:
        return self.handoff.round(batch)

    def launch(self, batch: Batch, answer: Callable[[Batch], Drafts], out=(), status=None) -> Launched:
        """On the stream, at once: ``answer`` is not needed (the policy is capacity)."""
        return self.handoff.launch(batch, out, status)

    def stop(self, limit_s: float) -> None:
        """Stop the proxy first, so no round is claimed any more, then answer what is in
        flight (with the proxy known gone, its claimed rounds too) until the users are
        out; on CUDA the stream is then finished and the region unpinned here."""
        users, handoff, deadline = self.users, self.handoff, time.monotonic() + limit_s
        users.shut()
        proxy_gone = self.host.stop()
        while True:
            handoff.end.fence(proxy_gone)
            if users.wait_alone(min(deadline, time.monotonic() + FENCE_STEP_S)):
                handoff.finish()  # nobody inside: the stream may be finished and the region unpinned
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "remote DSpark: close: %d users of the region still inside after %.1f s; the "
                    "last one out unmaps it",
                    users.inside,
                    limit_s,
                )
                return

    def stats(self) -> PathStats:
        handoff, host = self.handoff, self.host
        return PathStats(
            handoff.link_stats(),
            handoff=handoff.handoff_stats(host.thread_alive),
            supervisor=host.supervisor_stats(),
        )

"""The proxy process: ``python -m remote_dspark.proxy_proc --fd N --handover M --parent
PID``, as :func:`remote_dspark.proxy.spawn.spawn_proxy` starts it. It reads the
engine's hand-over (:mod:`remote_dspark.proxy.handover`), maps the region, and runs
:class:`~remote_dspark.proxy.loop.ProxyLoop` until told to stop; a standby first waits,
ready and asleep, for its promotion.

Torch-, numpy- and prometheus_client-free (a test reads the child's loaded modules), so
it starts in tens of milliseconds.

The process exits when the engine dies (PR_SET_PDEATHSIG, and the parent pid checked
every idle tick in case the engine died before the request took effect), on SIGTERM
(saying BYE), and when the region cannot be attached (exit status 3, reason on stderr).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable

from . import native
from .proxy import handover
from .proxy.loop import IDLE_TICK_S, ProxyLoop
from .proxy.spawn import die_with_parent
from .shm import memfd

log = logging.getLogger("remote_dspark.proxy")

EXIT_ATTACH = 3  # the region could not be attached (or the library loaded)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m remote_dspark.proxy_proc",
        description="The remote drafter's proxy process, spawned by the engine's "
        "supervisor: the region's fd, and a pipe holding the engine's "
        "configuration, id and vocabulary size.",
    )
    p.add_argument("--fd", type=int, required=True, help="the region's memfd, inherited")
    p.add_argument(
        "--handover",
        type=int,
        required=True,
        help="a pipe's read end, inherited: the engine's configuration, id and vocabulary size (JSON)",
    )
    p.add_argument("--parent", type=int, required=True, help="the engine's pid")
    p.add_argument(
        "--standby",
        action="store_true",
        help="start as the warm standby: ready, asleep, until the supervisor promotes it",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s proxy[{os.getpid()}] %(levelname)s %(message)s")
    if not die_with_parent(args.parent):  # the engine died before the request took effect
        return 0
    # A plain flag: the handler takes no lock. (An Event's set() would: a second SIGTERM,
    # e.g. the parent-death one right behind the supervisor's own, arriving while the
    # first handler holds it, deadlocks the proxy until its SIGKILL.)
    stopping = [False]
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__(0, True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    try:
        given = handover.read(args.handover)
        lib = native.load()
        region = memfd.Region.attach(args.fd)
    except (ValueError, OSError, native.NativeError) as e:
        print(f"proxy: cannot start: {e}", file=sys.stderr)
        return EXIT_ATTACH

    def should_stop() -> bool:
        return stopping[0] or os.getppid() != args.parent

    if args.standby and not wait_for_promotion(region, lib, should_stop):
        return 0
    loop = ProxyLoop(region, lib, given.cfg, engine_id=given.engine_id, vocab_size=given.vocab_size)
    loop.run(should_stop)
    return 0


def wait_for_promotion(region: memfd.Region, lib: native.Native, should_stop: Callable[[], bool]) -> bool:
    """A standby proxy: interpreter started, imports done, library loaded, region mapped.
    Say so (``standby_pid``), then sleep on ``standby_go`` until the supervisor offers this
    process the proxy role and it accepts (promoted: True), or the proxy should stop
    (False). Accepting, in C from this wait, is the standby's proof that it is alive: an
    offer it does not accept within the supervisor's limit is withdrawn, and then it never
    takes the role. Until then it takes no proxy role: it has not attached as the region's
    proxy, connected or said HELLO."""
    me, lay = os.getpid(), region.layout
    lib.store32(region.addr(lay.standby_pid), me)
    go = region.addr(lay.standby_go)
    while not should_stop():
        if lib.standby_wait(go, me, native.deadline_ns(IDLE_TICK_S)) == native.Status.OK:
            return True
    return False


if __name__ == "__main__":
    sys.exit(main())

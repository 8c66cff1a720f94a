"""The answering side of ``remote-dspark bench handoff``, run as its own interpreter::

    python -m remote_dspark.bench.handoff.peer MODE --fd FD --rounds N --parent PID [--spin-us U] [--nap-us U]

MODE is one of:

``loop``    the project's proxy round (``tcp_round.TcpRounds.serve``: ``hf_round``) on
            the region passed as FD, answering each round at once as the proxy does
            with no connection: what a proxy process adds to the hand-off, the
            network aside;
``c``       the C peer (``hf_serve``): the same protocol without Python, the floor;
``pipe``    a ``multiprocessing`` connection on FD, echoing each message;
``pyflag``  a pure-Python shared-memory flag on the small memfd FD: waits for the ping
            word to reach the round, polling with ``os.sched_yield()``, answers in the
            pong word (the design of vLLM's shm_broadcast).

Each mode answers exactly N rounds and exits 0; a round that does not come within
``--timeout-s`` exits 1 with the reason on stderr. The peer dies with the benchmark
(PID, its parent): SIGKILL as its parent-death signal, since a peer that spins for a
round that never comes would burn a core until its timeout. ``serve_loop`` is also what the
benchmark runs as a thread of the engine (thread mode).
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import struct
import sys
import time

PING, PONG = 0, 64  # pyflag words, on separate lines
FLAG = struct.Struct("<I")
FLAG_BYTES = 128


def serve_loop(end, count: int, timeout_s: float) -> None:
    """Answer ``count`` rounds with the proxy loop's call, at once (empty drafts, OK).

    Raises:
        TimeoutError: no round came within ``timeout_s``.
    """
    from ...outcome import Outcome
    from ...proxy.tcp_round import TcpRounds

    rounds = TcpRounds(end, session=0, default_deadline_ms=1)
    left = count
    while left:
        served = rounds.serve(timeout_s, send=False, at_once=Outcome.OK, at_once_max=left)
        if served is None:
            raise TimeoutError(f"no round after {end.next - 1} within {timeout_s}s")
        left -= served.count


def _region_peer(args) -> None:
    from ... import native
    from ...outcome import Outcome
    from ...proxy import ring_end
    from ...shm import memfd, ring

    lib = native.load()
    with memfd.Region.attach(args.fd) as region:
        end = ring_end.ProxyEnd(region, lib, spin_us=args.spin_us, nap_us=args.nap_us)
        if args.mode == "loop":
            serve_loop(end, args.rounds, args.timeout_s)
            return
        geom = ring.geometry(region)
        rc = lib.serve(geom, end.next, args.rounds, Outcome.OK, args.spin_us, args.nap_us, int(args.timeout_s * 1e9))
        if native.check(rc, "C peer") is not native.Status.OK:
            raise TimeoutError(f"C peer: no round within {args.timeout_s}s")


def _pipe_peer(args) -> None:
    from multiprocessing.connection import Connection

    conn = Connection(args.fd)
    for _ in range(args.rounds):
        if not conn.poll(args.timeout_s):
            raise TimeoutError(f"pipe peer: no message within {args.timeout_s}s")
        conn.send_bytes(conn.recv_bytes())
    conn.close()


def _pyflag_peer(args) -> None:
    mm = mmap.mmap(args.fd, FLAG_BYTES)
    try:
        for r in range(1, args.rounds + 1):
            pyflag_wait(mm, PING, r, time.monotonic() + args.timeout_s)
            FLAG.pack_into(mm, PONG, r)
    finally:
        mm.close()


def pyflag_wait(mm, at: int, value: int, deadline: float) -> None:
    """Poll the word at ``at`` until it equals ``value``, yielding the CPU between looks.

    Raises:
        TimeoutError: past ``deadline`` (time.monotonic()).
    """
    n = 0
    while FLAG.unpack_from(mm, at)[0] != value:
        os.sched_yield()
        n += 1
        if n % 1024 == 0 and time.monotonic() > deadline:
            raise TimeoutError(f"pyflag: word at {at} never reached {value}")


MODES = {"loop": _region_peer, "c": _region_peer, "pipe": _pipe_peer, "pyflag": _pyflag_peer}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m remote_dspark.bench.handoff.peer")
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--spin-us", type=int, default=1000)
    p.add_argument("--nap-us", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--parent", type=int, required=True, help="the benchmark's pid: the peer dies with it")
    args = p.parse_args(argv)
    from ...proxy.spawn import die_with_parent

    if not die_with_parent(args.parent, signal.SIGKILL):
        print(f"bench handoff peer {args.mode}: the benchmark (pid {args.parent}) is gone", file=sys.stderr)
        return 1
    try:
        MODES[args.mode](args)
    except TimeoutError as e:
        print(f"bench handoff peer {args.mode}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

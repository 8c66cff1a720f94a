"""``bench round``'s floor row: the byte counts of a steady ROUND and of its DRAFTS
ping-ponged over one loopback TCP connection with a stdlib-only child (see
:mod:`.run`): nothing encoded, decoded or drafted, what no round can beat."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

from ..handoff.peers import reap
from .options import ROUND_TIMEOUT_S, START_TIMEOUT_S, STEP_TOKENS, RoundOptions
from .report import RoundRow


def round_bytes(slots: int, row_bytes: int, sampled: bool = False) -> int:
    """A steady-state ROUND frame's bytes: header, sections, STEP_TOKENS tokens per entry
    (``sampled``: a sampled session's, with temperatures and seeds)."""
    from ... import wire

    return wire.HEADER.size + wire.round_sections(slots, STEP_TOKENS * slots, row_bytes, sampled).size


def drafts_bytes(slots: int, num_spec: int, sampled: bool = False) -> int:
    """A DRAFTS frame's bytes for ``slots`` entries of ``num_spec`` drafts, no margins
    (``sampled``: with each position's top-32 distribution)."""
    from ... import wire

    return wire.HEADER.size + wire.drafts_sections(slots, num_spec, margins=False, sampled=sampled).size


# The floor's peer: stdlib only, started as ``python -c FLOOR_PEER PORT IN OUT COUNT``.
# It connects to the bench, then COUNT times reads exactly IN bytes and writes OUT bytes.
FLOOR_PEER = r"""
import socket, sys
port, n_in, n_out, count = map(int, sys.argv[1:5])
timeout_s = float(sys.argv[5])
s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = memoryview(bytearray(n_in))
out = bytes(n_out)
for r in range(count):
    got = 0
    while got < n_in:
        k = s.recv_into(buf[got:], n_in - got)
        if not k:
            sys.exit(f"floor peer: the bench closed the connection at round {r} of {count}")
        got += k
    s.sendall(out)
s.close()
"""


class FloorPeer:
    """The floor's answering process and its one connection (``conn``), ended on exit:
    waited for (it answers exactly ``count`` rounds), killed if it outstays that."""

    def __init__(self, n_in: int, n_out: int, count: int):
        self.args = (n_in, n_out, count)
        self.proc: subprocess.Popen | None = None
        self.conn: socket.socket | None = None

    def __enter__(self) -> FloorPeer:
        n_in, n_out, count = self.args
        lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            lsock.bind(("127.0.0.1", 0))
            lsock.listen(1)
            lsock.settimeout(START_TIMEOUT_S)
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    FLOOR_PEER,
                    str(lsock.getsockname()[1]),
                    str(n_in),
                    str(n_out),
                    str(count),
                    str(ROUND_TIMEOUT_S),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                raise RuntimeError(
                    f"the floor peer did not connect within {START_TIMEOUT_S:g} s: {self._end(0.0)}"
                ) from None
            conn.settimeout(ROUND_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.conn = conn
        except BaseException:
            self._end(0.0)
            raise
        finally:
            lsock.close()
        return self

    def _end(self, wait_s: float) -> str:
        """Close the connection, wait for the peer up to ``wait_s``, kill it if still
        there; its stderr (why it stopped, when it failed)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        proc, self.proc = self.proc, None
        if proc is None:
            return ""
        _, err = reap(proc, wait_s)
        return f"exit {proc.returncode}: {err.strip()}" if proc.returncode else ""

    def __exit__(self, exc_type, *_) -> None:
        why = self._end(ROUND_TIMEOUT_S if exc_type is None else 0.5)
        if exc_type is None and why:
            raise RuntimeError(f"floor peer {why}")


def _recv_exactly(conn: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if not k:
            raise RuntimeError(f"floor: the peer closed the connection ({got} of {n} bytes)")
        got += k


def floor_row(opts: RoundOptions, slots: int, sampled: bool = False) -> RoundRow:
    n_in, n_out = round_bytes(slots, opts.row_bytes, sampled), drafts_bytes(slots, opts.num_spec, sampled)
    rounds = opts.rounds_for(slots)
    out = bytes(n_in)
    back = memoryview(bytearray(n_out))
    lat = []
    with FloorPeer(n_in, n_out, opts.warmup + rounds) as peer:
        conn = peer.conn
        for i in range(opts.warmup + rounds):
            t0 = time.perf_counter_ns()
            conn.sendall(out)
            _recv_exactly(conn, back)
            t1 = time.perf_counter_ns()
            if i >= opts.warmup:
                lat.append(t1 - t0)
    return RoundRow("floor", slots, rounds, lat, extra={"round_bytes": n_in, "drafts_bytes": n_out}, sampled=sampled)

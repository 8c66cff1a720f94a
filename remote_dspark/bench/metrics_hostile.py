"""``remote-dspark bench metrics-hostile``: the worker's metrics server under hostile clients.

Starts ``remote-dspark worker --metrics-port PORT`` (built-in Markov drafter) on 127.0.0.1
as a child process and attacks its HTTP server in two phases, each attacker reopened as
soon as the server drops it, as a persistent attacker would:

``trickle``  ``--tricklers`` clients (24) each send a request head one byte every
             ``--trickle-interval-ms`` (1000), never finishing it. Meanwhile
             ``--requests`` honest requests (96, ``/metrics`` and ``/healthz`` in turn)
             are spread over ``--seconds`` (15), each given 2 s; counted: answered 200.
``headers``  ``--header-clients`` clients (16) each send a request of ``--header-lines``
             (99) header lines of 64 KiB, then stall without the blank line. Meanwhile
             ten honest ``/metrics`` requests; the worker's RSS (psutil, every 20 ms): its
             growth is the peak during the phase minus the RSS before it.

Goals (met / NOT met; never asserted): every honest request answered in both phases;
RSS growth under the header attack <= 16 MiB.

Progress goes to stderr; ``--json`` prints one JSON object, and nothing else, on stdout.
Every socket, thread and the worker process are ended before the run returns. The
attackers (:class:`Tricklers`, :class:`GiantHeads`) are the tests' too.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from dataclasses import dataclass

from .worker_hostile import RssSampler

GOAL_RSS_MIB = 16
HONEST_TIMEOUT_S = 2.0
SWEEP_S = 0.05
TRICKLE_HEAD = b"GET /metrics HTTP/1.1\r\nHost: bench\r\nX-Slow: "


class Tricklers:
    """``n`` connections to ``port``, each sending :data:`TRICKLE_HEAD` and then one byte
    every ``interval_s``, never finishing its request; one the server drops is reopened
    at the next sweep. A context: every socket and the thread are ended on exit."""

    def __init__(self, port: int, n: int, interval_s: float):
        self.port, self.n, self.interval_s = port, n, interval_s
        self.opened = 0  # connections made
        self.bytes_sent = 0
        self._socks: list[socket.socket | None] = [None] * n
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-tricklers", daemon=True)

    def open_now(self) -> int:
        return sum(s is not None for s in self._socks)

    def _run(self) -> None:
        next_byte = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            due = now >= next_byte
            if due:
                next_byte = now + self.interval_s
            for i, s in enumerate(self._socks):
                if s is None:
                    self._socks[i] = self._open()
                elif due:
                    try:
                        s.send(b"a")
                        self.bytes_sent += 1
                    except OSError:  # dropped by the server: reopened at the next sweep
                        s.close()
                        self._socks[i] = None
            self._stop.wait(SWEEP_S)

    def _open(self) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=1.0)
            s.sendall(TRICKLE_HEAD)
        except OSError:
            return None
        self.opened += 1
        self.bytes_sent += len(TRICKLE_HEAD)
        return s

    def __enter__(self) -> Tricklers:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self._socks:
            if s is not None:
                s.close()


class GiantHeads:
    """``n`` clients of ``port``, each sending a request head of ``lines`` header lines
    of ``line_bytes`` without its blank line, then holding the connection; reopened
    (every :data:`SWEEP_S` at most) when the server drops it. ``refused`` counts the heads
    the server stopped reading before they were whole, ``held`` those it took whole."""

    def __init__(self, port: int, n: int, lines: int = 99, line_bytes: int = 64 * 1024):
        self.port, self.n = port, n
        line = b"X-Big: " + b"a" * (line_bytes - 9) + b"\r\n"
        self.head = b"GET /metrics HTTP/1.1\r\n" + line * lines
        self.refused = 0
        self.held = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"bench-heads-{i}", daemon=True) for i in range(n)]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=10.0)
            except OSError:
                self._stop.wait(SWEEP_S)
                continue
            with s:
                try:
                    s.sendall(self.head)
                except OSError:  # the server closed it before the head was whole
                    self._count("refused")
                    self._stop.wait(SWEEP_S)
                    continue
                self._count("held")
                while not self._stop.wait(SWEEP_S):  # held until the server drops it, or the end
                    try:
                        s.settimeout(0.0)
                        if s.recv(4096) == b"":
                            break
                    except BlockingIOError:
                        continue
                    except OSError:
                        break

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)

    def __enter__(self) -> GiantHeads:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(15)


def honest_get(port: int, path: str, timeout_s: float = HONEST_TIMEOUT_S) -> int:
    """The status of GET ``path`` (0: no answer within ``timeout_s``, or the connection
    closed unanswered)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as c:
            c.sendall(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
            first = c.recv(64)
            # read to the end: the answer is whole before it counts
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and c.recv(65536):
                pass
    except OSError:
        return 0
    parts = first.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


@dataclass
class HostilePhase:
    name: str
    honest: int = 0
    answered: int = 0
    attackers_opened: int = 0
    rss_growth_mib: float | None = None
    heads_refused: int | None = None
    heads_held: int | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "metrics-hostile",
        help="the worker's metrics server under slow and oversized requests: honest scrapes answered, RSS growth",
        description=__doc__.split("\n\n")[0] + " Phases: trickle, headers (docs/benchmarks.md says what each does).",
    )
    p.add_argument("--tricklers", type=int, default=24, help="clients trickling a request (default 24)")
    p.add_argument("--trickle-interval-ms", type=int, default=1000, help="between their bytes (default 1000)")
    p.add_argument("--requests", type=int, default=96, help="honest requests during the trickle (default 96)")
    p.add_argument("--seconds", type=float, default=15.0, help="the trickle phase's length (default 15)")
    p.add_argument("--header-clients", type=int, default=16, help="clients sending huge heads (default 16)")
    p.add_argument("--header-lines", type=int, default=99, help="64 KiB header lines per head (default 99)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=run)


def _trickle(port: int, args) -> HostilePhase:
    phase = HostilePhase("trickle", honest=args.requests)
    with Tricklers(port, args.tricklers, args.trickle_interval_ms / 1000) as t:
        time.sleep(1.0)  # every trickler connected and started
        start = time.monotonic()
        for i in range(args.requests):
            time.sleep(max(0.0, start + i * args.seconds / args.requests - time.monotonic()))
            phase.answered += honest_get(port, ("/metrics", "/healthz")[i % 2]) == 200
        phase.attackers_opened = t.opened
    return phase


def _headers(port: int, pid: int, args) -> HostilePhase:
    phase = HostilePhase("headers", honest=10)
    sampler = RssSampler(pid)
    base = sampler.now()
    with sampler, GiantHeads(port, args.header_clients, args.header_lines) as g:
        time.sleep(2.0)  # the heads sent (or refused)
        for _ in range(phase.honest):
            phase.answered += honest_get(port, "/metrics") == 200
            time.sleep(0.3)
        phase.heads_refused, phase.heads_held = g.refused, g.held
        phase.attackers_opened = g.refused + g.held
    phase.rss_growth_mib = round((sampler.peak - base) / (1 << 20), 1)
    return phase


def measure(args) -> list[HostilePhase]:
    from ..demo.harness import WorkerProcess

    port = free_port()
    with WorkerProcess(extra=("--metrics-port", str(port))) as worker:
        print(f"metrics-hostile: trickle phase, {args.tricklers} clients", file=sys.stderr, flush=True)
        phases = [_trickle(port, args)]
        print(f"metrics-hostile: headers phase, {args.header_clients} clients", file=sys.stderr, flush=True)
        phases.append(_headers(port, worker.proc.pid, args))
    return phases


def run(args) -> int:
    if min(args.tricklers, args.requests, args.header_clients, args.header_lines, args.trickle_interval_ms) < 1:
        raise ValueError("--tricklers, --requests, --header-clients, --header-lines and --trickle-interval-ms: >= 1")
    if not args.seconds > 0:
        raise ValueError(f"--seconds {args.seconds}: must be > 0")
    phases = measure(args)
    goals = {
        "every_honest_request_answered": all(p.answered == p.honest for p in phases),
        f"rss_growth_le_{GOAL_RSS_MIB}_mib": phases[1].rss_growth_mib <= GOAL_RSS_MIB,
    }
    if args.json:
        print(json.dumps({"phases": [vars(p) for p in phases], "goals": goals}, indent=2))
        return 0
    for p in phases:
        line = f"{p.name:<8} honest answered {p.answered}/{p.honest}, attackers opened {p.attackers_opened}"
        if p.rss_growth_mib is not None:
            line += f", heads refused {p.heads_refused} / held {p.heads_held}, worker RSS growth {p.rss_growth_mib} MiB"
        print(line)
    for goal, met in goals.items():
        print(f"goal {goal}: {'met' if met else 'NOT met'}")
    return 0

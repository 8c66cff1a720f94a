"""``remote-dspark bench worker-hostile``: the reference worker under hostile peers.

Starts ``remote-dspark worker`` (built-in Markov drafter) on 127.0.0.1 as a child process
and, after a warm-up round of an honest engine, keeps three kinds of hostile peer open
for the whole run. A peer the worker drops is opened again at the next sweep (every
50 ms), as a persistent attacker would:

``header``  connects and sends one ROUND header announcing ``wire.MAX_PAYLOAD`` bytes
            (64 MiB) before any HELLO, then stalls.
``hello``   says a valid HELLO (the worker's identities, a fresh engine id, 1024 slots of
            8192-byte rows, the worker's default limits), then a ROUND header announcing
            the largest round such a session may send (its rows and 128 tokens per
            slot, about 8.5 MiB), then stalls. It needs the identities, which are no
            secret; what it can hold is one served connection each.
``silent``  connects and says nothing.

While they are open an honest engine connects ``--honest`` times, one every
``--interval-ms``: connect + HELLO + HELLO_ACK through ``DraftClient.connect`` (5 s
limit), timed from before the connect to the ACK. The worker's RSS (psutil) is sampled
every 20 ms: its growth is the peak during the hostile phase minus the RSS after the
warm-up round, before any hostile peer.

Goals (met / NOT met; never asserted): RSS growth <= 256 MiB; every honest HELLO
answered, and accepted, within 1 s.

Progress goes to stderr; ``--json`` prints one JSON object, and nothing else, on stdout.
Every socket, thread and the worker process are ended before the run returns.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from .. import wire

GOAL_RSS_MIB = 256
GOAL_HELLO_MS = 1000
HOSTILE_SLOTS, HOSTILE_ROW_BYTES, HOSTILE_TOKENS = 1024, 8192, 128 * 1024
SWEEP_S = 0.05
SAMPLE_S = 0.02
CONNECT_S = 1.0
HONEST_TIMEOUT_S = 5.0
HONEST_ENGINE_ID = 0xC0FFEE


def add_parser(sub) -> None:
    p = sub.add_parser(
        "worker-hostile",
        help="the reference worker under hostile peers: its RSS growth and an honest engine's HELLO latency",
        description=__doc__.split("\n\n")[0]
        + " Kinds of peer: header, hello, silent (docs/benchmarks.md says what each does).",
    )
    p.add_argument(
        "--header-peers",
        type=int,
        default=40,
        help="peers that send a 64 MiB ROUND header before HELLO, then stall (default 40)",
    )
    p.add_argument(
        "--hello-peers",
        type=int,
        default=16,
        help="peers that say HELLO, then a header of the largest round their session may send, then stall (default 16)",
    )
    p.add_argument("--silent-peers", type=int, default=200, help="peers that connect and say nothing (default 200)")
    p.add_argument("--honest", type=int, default=5, help="honest HELLOs timed while they are open (default 5)")
    p.add_argument("--interval-ms", type=int, default=500, help="between honest HELLOs (default 500)")
    p.add_argument(
        "--settle-ms",
        type=int,
        default=1000,
        help="after the hostile peers are first opened, before the first honest HELLO (default 1000)",
    )
    p.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra argument for the worker (remote-dspark worker; repeatable), e.g. --worker-arg=--max-pending=64",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (and nothing else) on stdout; progress stays on stderr",
    )
    p.set_defaults(func=run)


def _check(args) -> None:
    for name in ("header_peers", "hello_peers", "silent_peers", "honest", "interval_ms", "settle_ms"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 0")
    if args.honest < 1:
        raise ValueError(f"--honest {args.honest}: must be >= 1")


# --------------------------------------------------------------------------- hostile peers


@dataclass
class Kind:
    """One kind of hostile peer, kept at ``want`` open sockets."""

    name: str
    want: int
    socks: list = field(default_factory=list)
    opened: int = 0  # connections made (the first ones and the re-openings)
    dropped: int = 0  # of them, closed by the worker
    failed: int = 0  # openings that failed (connect, or the HELLO refused / unanswered)


class Hostiles:
    """The hostile peers, kept open by one thread that sweeps every ``SWEEP_S``."""

    def __init__(self, port: int, identities: tuple[bytes, bytes], counts: dict[str, int]):
        self.addr = ("127.0.0.1", port)
        self.identities = identities
        self.kinds = {name: Kind(name, n) for name, n in counts.items()}
        self.refusals: dict[str, int] = {}
        self._next_engine = 1 << 40
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-hostiles", daemon=True)

    def start(self) -> Hostiles:
        self.sweep()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        for kind in self.kinds.values():
            for s in kind.socks:
                s.close()
            kind.socks.clear()

    def open_now(self) -> dict[str, int]:
        return {k.name: len(k.socks) for k in self.kinds.values()}

    def _run(self) -> None:
        while not self._stop.wait(SWEEP_S):
            self.sweep()

    def sweep(self) -> None:
        """Close and count the peers the worker dropped, then open the missing ones."""
        for kind in self.kinds.values():
            if kind.socks:
                readable, _, _ = select.select(kind.socks, [], [], 0)
                for s in readable:
                    if _closed(s):
                        s.close()
                        kind.socks.remove(s)
                        kind.dropped += 1
            while len(kind.socks) < kind.want and not self._stop.is_set():
                s = self._open(kind.name)
                kind.opened += 1
                if s is None:
                    kind.failed += 1
                    break  # the worker does not take more now: try at the next sweep
                kind.socks.append(s)

    def _open(self, kind: str) -> socket.socket | None:
        try:
            s = socket.create_connection(self.addr, timeout=CONNECT_S)
        except OSError:
            return None
        try:
            if kind == "header":
                s.sendall(wire.encode_header(wire.ROUND, wire.MAX_PAYLOAD, 1, 1))
            elif kind == "hello":
                self._next_engine += 1
                session = self._next_engine
                s.sendall(
                    wire.encode_hello(
                        wire.Hello(*self.identities, self._next_engine, HOSTILE_SLOTS, HOSTILE_ROW_BYTES, 5), session
                    )
                )
                ack = _read_ack(s)
                if ack is None or not ack.accepted:
                    why = "no answer" if ack is None else ack.reason.split(":")[0][:60]
                    self.refusals[why] = self.refusals.get(why, 0) + 1
                    s.close()
                    return None
                size = wire.round_sections(HOSTILE_SLOTS, HOSTILE_TOKENS, HOSTILE_ROW_BYTES).size
                s.sendall(wire.encode_header(wire.ROUND, size, session, 1))
            s.setblocking(False)
            return s
        except OSError:
            s.close()
            return None


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _read_ack(s: socket.socket) -> wire.HelloAck | None:
    """The HELLO_ACK on ``s`` (blocking, within CONNECT_S), or None."""
    data = b""
    need = wire.HEADER.size
    try:
        while len(data) < need:
            chunk = s.recv(need - len(data))
            if not chunk:
                return None
            data += chunk
            if len(data) == wire.HEADER.size:
                hdr = wire.decode_header(data)
                if hdr.type != wire.HELLO_ACK:
                    return None
                need += hdr.payload_len
        return wire.decode_hello_ack(data[wire.HEADER.size :])
    except (OSError, wire.ProtocolError):
        return None


# --------------------------------------------------------------------------- measurement


class RssSampler:
    """The peak RSS of process ``pid``, sampled every ``SAMPLE_S`` by one thread."""

    def __init__(self, pid: int):
        import psutil

        self.proc = psutil.Process(pid)
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)

    def now(self) -> int:
        return self.proc.memory_info().rss

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(SAMPLE_S):
            try:
                self.peak = max(self.peak, self.now())
            except psutil.Error:
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def honest(identities: tuple[bytes, bytes]) -> wire.Hello:
    """The HELLO of an honest engine (256 slots of 1 KB rows, 5 drafts)."""
    return wire.Hello(*identities, HONEST_ENGINE_ID, 256, 1024, 5)


def honest_hello(port: int, identities: tuple[bytes, bytes], session: int) -> dict:
    """One honest connect + HELLO + HELLO_ACK, timed; the connection is closed after."""
    from ..transport import TransportError, parse_endpoint
    from ..transport.client import DraftClient, Refused

    hello = honest(identities)
    t0 = time.perf_counter()
    try:
        c = DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{port}"), hello, session, HONEST_TIMEOUT_S)
    except Refused as e:
        return {"ms": _ms(t0), "ok": False, "error": f"refused: {e.reason}"}
    except (TransportError, wire.ProtocolError, OSError) as e:
        return {"ms": _ms(t0), "ok": False, "error": f"{type(e).__name__}: {e}"}
    ms = _ms(t0)
    c.close()
    return {"ms": ms, "ok": True, "error": None}


def warm_up(port: int, identities: tuple[bytes, bytes]) -> None:
    """One honest connection with one round: the worker's round path is loaded before
    the baseline RSS is taken. Raises RuntimeError when it is not served."""
    from ..transport import parse_endpoint
    from ..transport.client import DraftClient

    c = DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{port}"), honest(identities), 1, HONEST_TIMEOUT_S)
    try:
        entries = [wire.Entry(i, 5, 0, (1, 2, 3), new_gen=True) for i in range(256)]
        c.round(1, [wire.encode_round_entries(1, 1, 5000, entries, bytes(256 * 1024), 1024)], 5000)
    finally:
        c.close()


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 2)


def measure(args) -> dict:
    from ..demo.harness import WorkerProcess

    counts = {"header": args.header_peers, "hello": args.hello_peers, "silent": args.silent_peers}
    with WorkerProcess(extra=tuple(args.worker_arg)) as worker:
        identities = (bytes.fromhex(worker.identity), bytes.fromhex(worker.markov_identity))
        warm_up(worker.port, identities)
        time.sleep(0.2)
        sampler = RssSampler(worker.proc.pid)
        base = sampler.now()
        sampler.peak = base
        hostiles = Hostiles(worker.port, identities, counts)
        attempts = []
        print(f"worker-hostile: opening {counts} hostile peers", file=sys.stderr, flush=True)
        with sampler:
            try:
                hostiles.start()
                time.sleep(args.settle_ms / 1000)
                open_at = []
                for i in range(args.honest):
                    open_at.append(sum(hostiles.open_now().values()))
                    attempts.append(honest_hello(worker.port, identities, 100 + i))
                    print(
                        f"worker-hostile: honest HELLO {i + 1}/{args.honest}: {attempts[-1]['ms']} ms "
                        f"{'ok' if attempts[-1]['ok'] else attempts[-1]['error']}",
                        file=sys.stderr,
                        flush=True,
                    )
                    time.sleep(args.interval_ms / 1000)
            finally:
                hostiles.stop()
        alive = worker.proc.poll() is None
    return make_report(args, counts, hostiles, base, sampler.peak, attempts, open_at, alive)


def make_report(
    args, counts, hostiles: Hostiles, base: int, peak: int, attempts: list[dict], open_at: list[int], alive: bool
) -> dict:
    mib = 1 << 20
    growth = (peak - base) / mib
    served = [a["ms"] for a in attempts if a["ok"]]
    worst = max(a["ms"] for a in attempts)
    return {
        "peers": {
            k.name: {"want": k.want, "opened": k.opened, "dropped_by_worker": k.dropped, "failed_to_open": k.failed}
            for k in hostiles.kinds.values()
        },
        "hello_refusals": hostiles.refusals,
        "hostile_open_at_honest_hello": open_at,
        "rss_base_mib": round(base / mib, 1),
        "rss_peak_mib": round(peak / mib, 1),
        "rss_growth_mib": round(growth, 1),
        "honest": attempts,
        "honest_served": len(served),
        "honest_max_ms": worst,
        "worker_alive": alive,
        "goals": {
            f"rss_growth_le_{GOAL_RSS_MIB}_mib": growth <= GOAL_RSS_MIB,
            f"honest_hello_le_{GOAL_HELLO_MS}_ms": len(served) == len(attempts) and worst <= GOAL_HELLO_MS,
        },
    }


def format_report(r: dict) -> str:
    lines = ["kind      want  opened  dropped  failed"]
    for name, p in r["peers"].items():
        lines.append(f"{name:<8} {p['want']:>5} {p['opened']:>7} {p['dropped_by_worker']:>8} {p['failed_to_open']:>7}")
    if r["hello_refusals"]:
        lines.append(f"hello peers refused: {r['hello_refusals']}")
    lines.append(f"hostile sockets open at each honest HELLO: {r['hostile_open_at_honest_hello']}")
    lines.append(
        f"worker RSS: {r['rss_base_mib']} MiB before, peak {r['rss_peak_mib']} MiB: growth {r['rss_growth_mib']} MiB"
    )
    for i, a in enumerate(r["honest"], 1):
        lines.append(f"honest HELLO {i}: {a['ms']:>8} ms  {'ok' if a['ok'] else a['error']}")
    lines.append(f"worker alive at the end: {r['worker_alive']}")
    for goal, met in r["goals"].items():
        lines.append(f"goal {goal}: {'met' if met else 'NOT met'}")
    return "\n".join(lines)


def run(args) -> int:
    _check(args)
    report = measure(args)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0

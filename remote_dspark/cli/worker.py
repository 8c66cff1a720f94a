"""``remote-dspark worker``: run the reference remote drafter."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from .. import wire
from ..transport.auth import MIN_KEY, load_key
from ..worker.drafters import DEFAULT_MAX_CONTEXT, load_drafter
from ..worker.fair import DEFAULT_CALL_SHARE
from ..worker.faults import LATE_S, Faults
from ..worker.limits import (
    DEFAULT_LISTEN,
    DEFAULT_MAX_ROW_BYTES,
    DEFAULT_MAX_SLOTS,
    DEFAULT_WINDOW,
    Limits,
    parse_listen,
    tokens_per_slot,
)
from ..worker.options import ROUND_PATHS, WorkerOptions
from ..worker.scheduler import DEFAULT_MAX_ENTRIES, DEFAULT_MAX_TOKENS
from ..worker.server import Worker
from ..worker.sessions import DEFAULT_HISTORY_MB, RECENT_S

_DEFAULT_ROUND_BYTES = Limits().max_round_bytes


def add_parser(sub) -> None:
    p = sub.add_parser(
        "worker",
        help="run the reference remote drafter (tcp://) on loopback",
        description="Serve drafts over the wire contract. Prints the drafter and Markov "
        "identities at start: copy them into the engine's VLLM_DSPARK_REMOTE_IDENTITY "
        "and VLLM_DSPARK_REMOTE_MARKOV_IDENTITY. Stops cleanly on SIGTERM or Ctrl-C (and, "
        "with --parent, when its parent is gone).",
    )
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"address to listen on (default {DEFAULT_LISTEN}; only loopback unless you say otherwise)",
    )
    p.add_argument("--markov", metavar="FILE", help="Markov cache file (default: the built-in model)")
    p.add_argument(
        "--drafter",
        metavar="markov|lm|MODULE:FACTORY",
        help="markov (the default), lm (the built-in torch model, see 'model drafters' below), or "
        "FACTORY() from MODULE (imported by name from sys.path): an object with draft_batch(batch) "
        "(one call per round, remote_dspark/drafter/contract.py) or, the slow path, "
        "draft(context, n_out, row) per entry",
    )
    p.add_argument("--identity", metavar="HEX64", help="drafter identity to require (default: derived from the model)")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens kept per slot (default 64), in HELLO_ACK")
    lim = p.add_argument_group(
        "limits",
        "This worker's own limits: a HELLO beyond them is refused with the reason, and after HELLO "
        "every frame is capped by the smaller of these and what the session's HELLO allows. The "
        "defaults serve a real engine with room to spare; the wire itself allows 4096 slots, 1 MiB "
        "rows and 64 MiB frames, which no peer gets to announce into this worker's memory.",
    )
    lim.add_argument(
        "--max-slots",
        type=int,
        default=DEFAULT_MAX_SLOTS,
        help=f"slots one engine may announce (default {DEFAULT_MAX_SLOTS}: an engine batches "
        f"256-1024 sequences; the wire allows {wire.MAX_ENTRIES})",
    )
    lim.add_argument(
        "--max-row-bytes",
        type=int,
        default=DEFAULT_MAX_ROW_BYTES,
        help=f"bytes of engine row per slot (default {DEFAULT_MAX_ROW_BYTES}: a 4096-wide bf16 hidden state)",
    )
    lim.add_argument(
        "--max-round-tokens",
        type=int,
        default=None,
        help=f"tokens in one ROUND (default --window + {tokens_per_slot(0)} per slot of --max-slots, "
        f"{tokens_per_slot(DEFAULT_WINDOW) * DEFAULT_MAX_SLOTS} at the defaults: an engine sends at most "
        "--window context tokens of a new slot (HELLO_ACK tells it), or num_spec + 1 accepted ones)",
    )
    lim.add_argument(
        "--max-round-bytes",
        type=int,
        default=None,
        help="bytes of one ROUND payload (default: the largest round of the three limits above, "
        f"{_DEFAULT_ROUND_BYTES} bytes (8.5 MiB) at their defaults); also each served "
        "connection's receive buffer at most",
    )
    lim.add_argument(
        "--history-mb",
        type=int,
        default=DEFAULT_HISTORY_MB,
        metavar="MIB",
        help=f"memory for every session's windows, the stream tokens this worker keeps (4 bytes a "
        f"token: --max-slots x (kept tokens + --window) a session), in MiB (default {DEFAULT_HISTORY_MB}: "
        "63 sessions of 1,024 slots keeping 8,192 tokens, 32.3 MiB each; a session keeping --window "
        "tokens takes 0.5 MiB). A HELLO whose windows would pass it is refused busy",
    )
    adm = p.add_argument_group(
        "admission",
        "Until it says HELLO a connection holds no thread, only a place in a pool of its own; "
        "the oldest makes room for a newcomer, so silent sockets never keep a HELLO out. "
        "Served connections are never closed for idling; TCP keepalive finds dead peers.",
    )
    adm.add_argument(
        "--key-file",
        metavar="PATH",
        help="authenticate at HELLO with the pre-shared key in PATH: an engine is served only "
        "once it proves it holds the same key (its VLLM_DSPARK_REMOTE_KEY_FILE), this worker "
        "proves it too, and a failure is refused 'auth'; no cost per round. The file holds at "
        f"least {MIN_KEY} bytes (whitespace around them ignored) and must be this user's or root's, "
        "mode 0600 or stricter, not a link, in a directory (not a link) only its owner may write "
        "(else the worker does not start, exit 2): (umask 077; openssl "
        "rand -hex 32 > PATH). Default: none, every peer that reaches the port is served",
    )
    adm.add_argument(
        "--hello-timeout-ms",
        type=int,
        default=2000,
        help="a connection that has not said HELLO by then is dropped (default 2000)",
    )
    adm.add_argument(
        "--max-batch-entries",
        type=int,
        default=None,
        help="entries of all engines drafted in one drafter call at most; engines share a call by deficit "
        f"round robin. Default: {DEFAULT_MAX_ENTRIES} for a model drafter (the rows it reserves for a call), "
        f"{wire.MAX_ENTRIES} (the wire's cap: a round is never split by its entries alone) for any other",
    )
    adm.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="tokens (contexts and drafts) in one drafter call at most; a larger round is drafted in "
        "pieces, and a HELLO whose one entry (a whole --window and num_spec drafts) is over it is refused. "
        f"Default: {DEFAULT_MAX_TOKENS}, or for a model drafter the most tokens (a power of two up to that) "
        "whose call's working memory fits in half the memory free on its device once its KV store is "
        "allocated",
    )
    adm.add_argument(
        "--call-deadline-share",
        type=float,
        default=DEFAULT_CALL_SHARE,
        metavar="SHARE",
        help="the longest drafter call, as a share (0 to 1] of the tightest deadline of a round queued: "
        "calls are sized in the drafter's measured seconds, about as long as the rounds ready to draft take, "
        "and never longer than this. A round waits for the call in flight and is drafted in the next, so "
        f"two calls at most: the default {DEFAULT_CALL_SHARE} keeps both within half its deadline, the "
        "other half left for the network, the engine and a call that overran its prediction",
    )
    adm.add_argument(
        "--no-batching",
        action="store_true",
        help="draft each round in a call of its own, never several engines' together (for comparison)",
    )
    adm.add_argument(
        "--round-path",
        choices=ROUND_PATHS,
        default="served",
        help="how each round is served: served (default), in the C library from its bytes in to its reply "
        "sent, the interpreter working once per drafting call (the built-in Markov drafter's greedy rounds "
        "one C call each on their connection's thread; every other connection on one I/O thread, the hub); "
        "native, a thread per connection, the C library's one call for the checks, the windows and the "
        "drafter's batch, the rest in Python (also what --chaos uses); python, the reference path the "
        "others are tested against (for comparison). A library that cannot be built leaves the python path, "
        "with a warning",
    )
    adm.add_argument(
        "--max-pending",
        type=int,
        default=128,
        help="connections waiting for their HELLO (default 128); when full, the oldest is dropped",
    )
    adm.add_argument(
        "--max-connections",
        type=int,
        default=32,
        help="connections served at once, a thread each (default 32); a HELLO beyond them is refused busy",
    )
    adm.add_argument(
        "--max-engines",
        type=int,
        default=32,
        help="engines with windows (default 32); a newcomer evicts the least recently served "
        f"one, unless that one was served within the last {RECENT_S:g} s: then it is "
        "refused busy",
    )
    adm.add_argument(
        "--frame-timeout-ms",
        type=int,
        default=10000,
        help="a frame, once its header is in, must be whole by then (default 10000)",
    )
    lm = p.add_argument_group(
        "model drafters",
        "Greedy drafts from a causal LM in torch (the lm extra; transformers for --hf-model: the "
        "hf extra). Their Markov identity is zeros; the drafter identity is the model's sha256.",
    )
    lm.add_argument(
        "--hf-model",
        metavar="DIR",
        help="draft with the transformers causal LM saved in this local directory (never downloaded; "
        "safetensors only, this user's or root's; refused when it does not fit in memory)",
    )
    lm.add_argument(
        "--lm-device",
        default="auto",
        metavar="{auto,cpu,cuda}",
        help="where the model runs (default auto: CUDA in bf16 when present, else CPU in float32)",
    )
    lm.add_argument(
        "--lm-cache-slots",
        type=int,
        default=1024,
        metavar="N",
        help="streams whose KV is kept across rounds (default 1024; the least recently used is "
        "dropped beyond; 0: none, every round re-encodes every stream)",
    )
    lm.add_argument(
        "--lm-speculate",
        type=int,
        default=0,
        metavar="N",
        help="outcomes of each stream's next round pre-drafted while the engine verifies (default 0: "
        "none). After answering a stream the drafter ranks what the engine may append (the drafts it "
        "accepts, then the target's token) by its own probabilities and, when no round is queued, "
        "drafts the N likeliest in its stream's forked KV; a round that appends one is answered "
        "from them at once (the same drafts a fresh round would give). Needs --lm-cache-slots",
    )
    lm.add_argument(
        "--max-context",
        type=int,
        default=DEFAULT_MAX_CONTEXT,
        metavar="N",
        help=f"tokens of each stream the model drafter keeps (default {DEFAULT_MAX_CONTEXT}, at most the "
        "model's positions): the worker keeps as many of each stream's tokens (within --history-mb) "
        "and tells the engine, which sends a new sequence's context up to them",
    )
    lm.add_argument(
        "--lm-kv-mb",
        type=int,
        default=None,
        metavar="MIB",
        help="memory of the model drafter's KV pool, in MiB (default: half the device's memory free "
        "after the weights, at most 256 MiB on the CPU, at most what --lm-cache-slots whole streams "
        "take). Blocks of 16 tokens, taken as streams grow and given back when they end or are "
        "evicted (least recently used, fair between engines); allocated at start, refused when it "
        "does not fit or cannot hold one whole stream",
    )
    p.add_argument(
        "--chaos",
        action="store_true",
        help="fault injection for chaos runs: SIGUSR1 toggles answering every round "
        "--late-ms late, SIGUSR2 garbles the next reply",
    )
    late_ms = round(LATE_S * 1000)
    p.add_argument("--late-ms", type=int, default=late_ms, help=f"the delay SIGUSR1 switches on (default {late_ms})")
    mon = p.add_argument_group(
        "metrics",
        "/metrics (Prometheus), /healthz and /readyz on a small HTTP server of their own; needs "
        "prometheus_client (the worker extra). Off unless --metrics-port is given.",
    )
    mon.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve them on PORT (0: any free port; the address is printed at start)",
    )
    mon.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address to serve them on (default 127.0.0.1: only loopback unless you say otherwise)",
    )
    p.add_argument(
        "--parent",
        type=int,
        default=None,
        metavar="PID",
        help="stop (as on SIGTERM) when process PID, this worker's parent, is gone: for a "
        "worker a tool starts as its child (the demo, chaos and the benchmarks pass their own pid), "
        "so a killed tool leaves no worker behind",
    )
    p.set_defaults(func=run, ends_at_once=True)  # stop() releases all: no interpreter teardown (cli.main.entry)


# The flags that must be >= 1 (ValueError naming the flag otherwise).
_AT_LEAST_ONE = ("window", "max_slots", "max_connections", "max_engines", "max_pending", "hello_timeout_ms")
_AT_LEAST_ONE += ("frame_timeout_ms", "max_batch_entries", "max_batch_tokens", "max_context", "history_mb", "lm_kv_mb")
PARENT_POLL_S = 0.25  # how often a --parent worker looks at its parent


def _wait_for_stop(done: threading.Event, parent: int | None) -> None:
    """Return when SIGTERM or SIGINT set ``done``, or, with ``parent``, when this process's
    parent is no longer ``parent`` (it died: the orphan was reparented). A poll of
    ``getppid`` rather than ``PR_SET_PDEATHSIG``: the kernel ties that signal to the
    thread that forked the child, and a tool may restart its worker from a short-lived
    thread (chaos's timers), whose end would then kill a worker in use."""
    while not done.wait(None if parent is None else PARENT_POLL_S):
        if os.getppid() != parent:
            logging.getLogger("remote_dspark.worker").warning("parent %d is gone: stopping", parent)
            return


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    host, port = parse_listen(args.listen)
    for name in _AT_LEAST_ONE:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if not 0 < args.call_deadline_share <= 1:
        raise ValueError(f"--call-deadline-share {args.call_deadline_share}: must be in (0, 1]")
    if args.parent is not None and args.parent != os.getppid():
        raise ValueError(f"--parent {args.parent}: not this worker's parent (pid {os.getppid()}), or it is gone")
    key = load_key(args.key_file, "--key-file") if args.key_file else None  # before any model loads
    identity = wire.parse_hex32(args.identity, "--identity") if args.identity else None
    drafter = load_drafter(
        args.drafter,
        args.markov,
        identity,
        hf_model=args.hf_model,
        lm_device=args.lm_device,
        lm_cache_slots=args.lm_cache_slots,
        lm_kv_mb=args.lm_kv_mb,
        window=args.window,
        max_context=args.max_context,
        lm_speculate=args.lm_speculate,
    )
    faults = Faults(late_s=args.late_ms / 1000) if args.chaos else None
    options = WorkerOptions(
        window=args.window,
        max_slots=args.max_slots,
        max_row_bytes=args.max_row_bytes,
        max_round_tokens=args.max_round_tokens,
        max_round_bytes=args.max_round_bytes,
        max_connections=args.max_connections,
        max_engines=args.max_engines,
        history_mb=args.history_mb,
        max_pending=args.max_pending,
        hello_timeout_s=args.hello_timeout_ms / 1000,
        frame_timeout_s=args.frame_timeout_ms / 1000,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        faults=faults,
        key=key,
        max_batch_entries=args.max_batch_entries,
        max_batch_tokens=args.max_batch_tokens,
        batching=not args.no_batching,
        call_deadline_share=args.call_deadline_share,
        round_path=args.round_path,
    )
    worker = Worker(drafter, host, port, options)
    if faults is not None:  # before the first line: a chaos driver signals as soon as it reads it
        # Faults' changes take no lock, so they are safe in a signal handler (faults.py).
        signal.signal(signal.SIGUSR1, lambda *_: faults.toggle_late())
        signal.signal(signal.SIGUSR2, lambda *_: faults.garble_next())
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    worker.start()
    print(f"remote-dspark worker listening on tcp://{host}:{worker.port}", flush=True)
    print(f"  VLLM_DSPARK_REMOTE_IDENTITY={drafter.drafter_identity.hex()}", flush=True)
    print(f"  VLLM_DSPARK_REMOTE_MARKOV_IDENTITY={drafter.markov_identity.hex()}", flush=True)
    if args.metrics_port is not None:  # after the identities: harness.WorkerProcess reads those three lines first
        mhost = f"[{args.metrics_host}]" if ":" in args.metrics_host else args.metrics_host
        print(f"  metrics on http://{mhost}:{worker.metrics_port}/metrics (and /healthz, /readyz)", flush=True)
    entries, tokens = worker.budget
    print(f"  drafting calls of at most {entries} entries and {tokens} tokens", flush=True)
    _wait_for_stop(done, args.parent)
    worker.stop()
    s = worker.stats
    print(
        f"worker stopped: {s.connections} connections, {s.rounds} rounds, {s.draft_tokens} draft tokens, "
        f"{s.refused} refused, {s.busy} busy, {s.evicted} evicted, {s.bad_frames} bad frames, "
        f"{s.stalled} stalled, {s.hello_timeouts} without HELLO, {s.displaced} displaced",
        file=sys.stderr,
    )
    return 0

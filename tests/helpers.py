"""Small helpers the tests import by name."""

import contextlib
import io
import json
import math
import os
import select
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

from remote_dspark import native, wire
from remote_dspark.drafter.contract import DraftBatch
from remote_dspark.drafter.markov import MarkovDrafter, MarkovModel
from remote_dspark.transport import parse_endpoint
from remote_dspark.transport.client import DraftClient

# The repository (the package's root) and the tests' own folder (helpers.py, conftest.py).
REPO = str(Path(__file__).resolve().parents[1])
TESTS = Path(__file__).resolve().parent
CHILD_TIMEOUT_S = 20


def tiny_llama(seed: int, vocab: int, *, init: float = 0.5, positions: int = 256):
    """A tiny Llama (2 layers, 32 wide) of ``vocab`` ids in eval mode, its weights seeded
    ``seed`` (``init``, the initializer range: 0.5 gives peaked next-token distributions,
    0.1 flat ones), with no begin, end or pad token (every generation runs its tokens)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


P_VALUE_MIN = 1e-4
"""A chi-square test passes above this p-value: a correct sampler fails one such test with
probability 1e-4 over seeds; under a test's fixed seeds its outcome is fixed."""


def chi2_sf(x: float, k: int) -> float:
    """P(chi-square with k degrees of freedom > x): 1 - P(k/2, x/2), the regularized lower
    incomplete gamma by its series (exact to ~1e-12 for x below 2000)."""
    a, y = k / 2, x / 2
    term = total = 1 / a
    for n in range(1, 100_000):
        term *= y / (a + n)
        total += term
        if term <= 1e-17 * total:
            break
    return max(0.0, 1 - total * math.exp(-y + a * math.log(y) - math.lgamma(a))) if y else 1.0


def chi2_p(observed, expected) -> float:
    """Pearson's chi-square p-value of counts ``observed`` against expected counts
    ``expected`` (same shape, the same total), the bins expected under 5 pooled into one
    so the statistic's distribution holds. An outcome of probability 0 must not happen.
    """
    observed, expected = np.asarray(observed, np.float64).ravel(), np.asarray(expected, np.float64).ravel()
    assert observed[expected == 0].sum() == 0, (
        f"outcomes of probability 0 happened: {np.flatnonzero(observed * (expected == 0))}"
    )
    small = expected < 5
    o = np.append(observed[~small], observed[small].sum())
    e = np.append(expected[~small], expected[small].sum())
    keep = e > 0
    return chi2_sf(float(((o[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1)


@contextlib.contextmanager
def child(code: str, lib: native.Native | None = None, fds: tuple[int, ...] = (), **popen):
    """Run ``code`` in a fresh interpreter (``-c``) with ``fds`` passed; yields the Popen.
    The child is killed and reaped on the way out, whatever happened."""
    env = {"PATH": os.environ.get("PATH", os.defpath), "PYTHONPATH": REPO}
    if lib is not None:
        env[native.ENV_LIB] = lib.path
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], pass_fds=fds, env=env, text=True, **popen)
    try:
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=CHILD_TIMEOUT_S)


def finish(proc: subprocess.Popen) -> str:
    """Wait (bounded) for the child to exit 0; its stdout."""
    out, err = proc.communicate(timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, f"child exited {proc.returncode}: {err}"
    return out


def readline_within(stream, timeout_s: float, what: str = "a line"):
    """One line from a child's pipe ``stream`` (text or binary, as the stream is), waited
    for at most ``timeout_s`` seconds in all; at end of file, what came before it (as
    ``readline``). An AssertionError names ``what`` when no whole line comes in time.
    It reads the pipe's descriptor a byte at a time, so the stream's own buffer stays
    empty: read that stream only this way or with ``communicate``, which reads the
    descriptor too."""
    fd = stream.fileno()
    end = time.monotonic() + timeout_s
    got = bytearray()
    while not got.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"waited {timeout_s} s for {what}; got {bytes(got)!r} and no end of line")
        byte = os.read(fd, 1)
        if not byte:
            break
        got += byte
    if isinstance(stream, io.TextIOBase):
        return got.decode(stream.encoding, stream.errors)
    return bytes(got)


def recv_exactly(sock, n: int) -> bytes:
    """``n`` bytes from ``sock``, however the peer's sends split them (each receive bounded
    by the socket's timeout; with a timeout set, Python's socket is non-blocking inside,
    so ``MSG_WAITALL`` may return fewer). Raises ConnectionError if the peer closes first."""
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"the peer closed the connection after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def until(cond, timeout: float = 10.0, step: float = 0.005) -> bool:
    """Poll ``cond`` until it is true or ``timeout`` seconds pass; its last value.
    For conditions another process or thread makes true: bounded, never sleep-and-hope."""
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(step)
    return bool(cond())


def gated_drafter(model, wait_s: float = 10.0):
    """A Markov drafter that drafts only while its ``gate`` is set (bounded wait): clear
    the gate to make the worker answer late on purpose."""
    import threading

    from remote_dspark.drafter import MarkovDrafter

    class GatedDrafter(MarkovDrafter):
        def __init__(self):
            super().__init__(model)
            self.gate = threading.Event()
            self.gate.set()

        def draft(self, context, n_out, row):
            self.gate.wait(wait_s)
            return super().draft(context, n_out, row)

    return GatedDrafter()


# 1 -> 2 -> 3 -> 4 -> 1 ...: drafts a test can predict.
COUNTING = MarkovModel.from_tokens([1, 2, 3, 4] * 10, order=1, top=2)


def drafter_env(drafter, port: int, mode=None, *, stats_file: str = "", **kw) -> dict:
    """``harness.engine_env`` for a loopback worker of ``drafter`` on ``port``: its
    identities, capacity, no log line, ``mode``'s switches (a ``Mode``, or None), ``kw``
    last."""
    from remote_dspark.demo.harness import engine_env

    hexes = drafter.drafter_identity.hex(), drafter.markov_identity.hex()
    return engine_env(port, *hexes, mode, stats_file=stats_file, **kw)


def env_for(port: int, tmp_path, mode=None, **kw) -> dict:
    """An engine's environment for a loopback worker of COUNTING on ``port``
    (:func:`drafter_env`): stats into ``tmp_path``, a short nap and short back-offs; ``kw``
    overrides or adds variables."""
    from remote_dspark.drafter import MarkovDrafter

    settings = {
        "VLLM_DSPARK_REMOTE_ASYNC_NAP_US": "20",
        "VLLM_DSPARK_REMOTE_BACKOFF_MS": "20",
        "VLLM_DSPARK_REMOTE_BACKOFF_MAX_MS": "40",
    }
    settings.update(kw)
    return drafter_env(MarkovDrafter(COUNTING), port, mode, stats_file=str(tmp_path / "stats.json"), **settings)


PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
NEED_TOOLS = "promtool and prometheus come with Debian's 'prometheus' package (scripts/ensure-prometheus)"


@contextlib.contextmanager
def prometheus(tmp_path, job: str, target_port: int, *more_ports: int):
    """A real Prometheus on loopback scraping ``127.0.0.1:target_port`` (and each of
    ``more_ports``, the same job's other instances) every 200 ms;
    yields ``query(expr) -> result list`` (OSError while it is not up yet). Ended (and
    its log closed) on exit."""
    assert PROMETHEUS, NEED_TOOLS
    ports = (target_port, *more_ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = {
        "global": {"scrape_interval": "200ms", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def query(expr: str) -> list:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    try:
        yield query
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


# A HELLO'd client of a Worker ``w`` (4-byte rows, 8 slots, num_spec 3), and one round on it.


def hello(w, **kw) -> wire.Hello:
    """A HELLO for worker ``w``'s drafter; ``kw`` overrides fields."""
    fields = dict(
        drafter_identity=w.drafter.drafter_identity,
        markov_identity=w.drafter.markov_identity,
        engine_id=42,
        max_slots=8,
        row_bytes=4,
        num_spec=3,
    )
    fields.update(kw)
    return wire.Hello(**fields)


def connect(w, session=1, key=None, **kw) -> DraftClient:
    """A client of worker ``w`` after its HELLO (authenticated with ``key``, a
    ``transport.auth.Key``, when given)."""
    return DraftClient.connect(parse_endpoint(f"tcp://127.0.0.1:{w.port}"), hello(w, **kw), session, 2.0, key=key)


def do_round(c, rid, entries):
    return c.round(rid, [wire.encode_round_entries(rid, c.session, 1000, entries, bytes(4 * len(entries)), 4)], 2000)


# What a scrape shows of a metric table (remote_dspark.metrics.families), family by family.


def families_in(text: str) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """Each family of an exposition as ``(name, type, help, label names)``, in order, the
    name as its ``# TYPE`` line writes it (a counter's with ``_total``); ``le`` is a
    histogram's own and left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels = {k for s in fam.samples for k in s.labels} - ({"le"} if fam.type == "histogram" else set())
        out.append((name, fam.type, fam.documentation, tuple(sorted(labels))))
    return out


def families_of(table, record=None) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """What :func:`families_in` should find in a scrape of ``record``: ``table``'s rows
    whose ``when`` holds for it (every row when ``record`` is None). An info family is a
    gauge in the text format."""
    out = []
    for row in table.rows:
        if record is None or row.when is None or row.when(record):
            name = table.prefix + row.name + ("_total" if row.kind == "counter" else "")
            out.append((name, "gauge" if row.kind == "info" else row.kind, row.help, tuple(sorted(row.labels))))
    return out


# An exposition's samples, by (name, sorted labels).


def samples(text: str) -> dict[tuple, float]:
    """Every sample of a Prometheus text exposition: ``(name, sorted label items) -> value``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels) -> float:
    """One sample's value; KeyError when the exposition lacks it."""
    return samples(text)[(name, tuple(sorted(labels.items())))]


# A four-token cycle: every context the drafter sees is easy to name in an assertion.
CYCLE4 = MarkovModel.from_tokens([1, 2, 3, 4] * 10, order=1, top=2)


class DraftedWindows(MarkovDrafter):
    """A Markov drafter (CYCLE4's unless told) that records, under a lock, each drafted
    entry's slot and context (the worker's window of it): what a long context brought
    once whole. Entries of ``n_out`` 0 (encodes only) are not drafted."""

    def __init__(self, model=CYCLE4):
        super().__init__(model)
        self.lock = threading.Lock()
        self.drafted: list[tuple[int, list[int]]] = []

    def draft_batch(self, batch):
        with self.lock:
            for i in range(len(batch)):
                if batch.n_out[i] > 0:
                    self.drafted.append((int(batch.slots[i]), batch.context(i).tolist()))
        return super().draft_batch(batch)

    def check_first_drafts(self, whole: dict[int, list[int]], cap: int) -> None:
        """Each slot of ``whole`` (and no other) first drafted from its whole context's last
        ``cap`` tokens (the worker's window of it)."""
        with self.lock:
            first: dict[int, list[int]] = {}
            for slot, context in self.drafted:
                first.setdefault(slot, context)
        assert sorted(first) == sorted(whole)
        for s, context in first.items():
            assert context == whole[s][-cap:], f"slot {s}: first drafted from {context[:8]}..., not its last {cap}"


class ContextsSeen(MarkovDrafter):
    """A Markov drafter of CYCLE4 that records each entry's context as it got it (the
    worker's window of it)."""

    def __init__(self):
        super().__init__(CYCLE4)
        self.contexts: list[list[int]] = []

    def draft(self, context, n_out, row):
        self.contexts.append([int(t) for t in context])
        return super().draft(context, n_out, row)


# --------------------------------------------------------------------------- the worker's scheduler


class Clock:
    """A clock a test moves by hand (a scheduler's ``clock``)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def stream_batch(session: int, slots, contexts, width=3, want_margin=False) -> DraftBatch:
    """A worker-built batch of ``session``: ``contexts`` of ``slots``, ``width`` drafts each."""
    n = len(contexts)
    offsets = np.zeros(n + 1, np.int64)
    offsets[1:] = np.cumsum([len(c) for c in contexts])
    return DraftBatch(
        np.concatenate([np.asarray(c, np.int32) for c in contexts]),
        offsets,
        np.full(n, width, np.int32),
        np.zeros((n, 0), np.uint8),
        want_margin,
        width,
        session=session,
        slots=np.asarray(slots, np.int64),
        gens=np.ones(n, np.int64),
        lengths=np.asarray([len(c) for c in contexts], np.int64),
        positions=np.zeros(n, np.int64),
    )


def submit(scheduler, session, batch, deadline=float("inf")):
    """``scheduler.draft`` on a thread of its own (a connection's); returns (thread, box)."""
    box = {}

    def run():
        try:
            box["result"] = scheduler.draft(session, batch, deadline)
        except BaseException as e:  # checked by the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


class Gated:
    """``drafter`` behind a gate: every call is recorded; while ``hold`` is set a call
    waits (bounded) for ``release``. ``cost_s`` per token moves ``clock``, if given: a
    call's tokens are ``tokens(batch)``, its contexts and an entry each by default."""

    def __init__(self, drafter, clock=None, cost_s: float = 0.0, tokens=lambda b: len(b.tokens) + len(b)):
        self.drafter, self.clock, self.cost_s, self.tokens = drafter, clock, cost_s, tokens
        self.drafter_identity, self.markov_identity = drafter.drafter_identity, drafter.markov_identity
        self.mixed_sessions = getattr(drafter, "mixed_sessions", False)
        self.calls: list[DraftBatch] = []
        self.hold, self.release, self.entered = threading.Event(), threading.Event(), threading.Event()

    def draft_batch(self, batch):
        self.calls.append(batch)
        self.entered.set()
        if self.hold.is_set():
            assert self.release.wait(10), "the test never released the gate"
        if self.clock is not None:
            self.clock.now += self.cost_s * self.tokens(batch)
        return self.drafter.draft_batch(batch)


class WorkerStandIn:
    """A worker stand-in thread at ``ip``:``port`` (0: any) for the link's tests. With
    ``ack`` it answers every HELLO (accepting, naming ``engines`` served, the identities
    of ``drafter``) and then does ``after(conn)`` (nothing: a worker that never answers a
    PING; close: one that hangs up; bytes a hostile worker would send); without, it
    accepts and never answers (a mute host). ``close()`` ends the thread and every socket."""

    def __init__(self, ip: str, port: int, drafter, *, ack: bool = True, after=None, engines: int = 9):
        self.server = socket.create_server((ip, port))
        self.server.settimeout(0.05)
        self.port = self.server.getsockname()[1]
        self.drafter, self.ack, self.after, self.engines = drafter, ack, after, engines
        self.hellos = 0
        self.conns: list[socket.socket] = []
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop_flag.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            self.conns.append(conn)
            if not self.ack:
                continue
            conn.settimeout(2)
            try:
                hdr = wire.decode_header(recv_exactly(conn, wire.HEADER.size))
                recv_exactly(conn, hdr.payload_len)
                d = self.drafter
                ack = wire.HelloAck(wire.ACCEPT, d.drafter_identity, d.markov_identity, engines=self.engines)
                conn.sendall(wire.encode_hello_ack(ack, hdr.session))
            except OSError:
                conn.close()
                continue
            self.hellos += 1
            if self.after is not None:
                self.after(conn)

    def close(self) -> None:
        self.stop_flag.set()
        self.thread.join(2)
        for c in self.conns:
            c.close()
        self.server.close()

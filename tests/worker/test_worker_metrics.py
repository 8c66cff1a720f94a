"""The watchable worker: ``--metrics-port`` serves /metrics, /healthz and /readyz; the
exposition counts exactly what happened and is the table of families walked over the
worker's record; promtool accepts it; the dashboard's worker row names only exposed
metrics and, scraped by a real Prometheus, every one of its queries returns data.
Loopback only; every wait bounded; every worker and process stopped by its test."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest
from helpers import (
    NEED_TOOLS,
    PROMTOOL,
    connect,
    do_round,
    families_in,
    families_of,
    gated_drafter,
    hello,
    prometheus,
    samples,
    until,
    value,
)

from remote_dspark import wire
from remote_dspark.bench.metrics_hostile import TRICKLE_HEAD, GiantHeads, Tricklers
from remote_dspark.cli import dashboard
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.drafter.contract import CacheInfo, SpecInfo
from remote_dspark.drafter.markov import MarkovModel
from remote_dspark.transport.auth import Key
from remote_dspark.transport.client import Refused
from remote_dspark.worker import Worker
from remote_dspark.worker.metrics import MAX_RANK_LABELS, TABLE, read
from remote_dspark.worker.stats import REFUSAL_REASONS

KEY = Key("test-key", b"a key of the metrics tests, 32 b")

# 1 -> 2 -> 3 -> 4 -> 5 -> 1 ...; its vocabulary is 6 (ids 0..5).
MODEL = MarkovModel.from_tokens([1, 2, 3, 4, 5] * 20, order=1, top=2)


class CachedDrafter(MarkovDrafter):
    """A Markov drafter that reports a (made-up) per-slot cache and speculation cache, as a
    KV-cache drafter that pre-drafts would."""

    info = CacheInfo(slots=3, capacity=16, bytes=4096, hits=7, misses=2)
    spec = SpecInfo(outcomes=40, hits=(9, 4, 1), misses=6, dropped=25, seconds=0.75, held=5, blocks=12)

    def cache_info(self) -> CacheInfo:
        return self.info

    def spec_info(self) -> SpecInfo | None:
        return self.spec


def make(drafter=None, **kw) -> Worker:
    return Worker(drafter or MarkovDrafter(MODEL), "127.0.0.1", 0, window=8, metrics_port=0, **kw).start()


def get(w, path: str) -> tuple[int, str]:
    """(status, body) of GET ``path`` on the worker's metrics server."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(w) -> str:
    status, body = get(w, "/metrics")
    assert status == 200
    return body


def refused(w, served: int = 0, **kw) -> int:
    """Say HELLO with ``kw`` (with the worker's key unless ``kw`` names one); the
    refusal's code. Waits until the worker serves ``served`` connections again (the
    refused one gone: the test's worker serves one at a time)."""
    kw.setdefault("key", w.options.key)
    with pytest.raises(Refused) as e:
        connect(w, **kw)
    assert until(lambda: w.served_now() == served, timeout=5)
    return e.value.code


def version_refused(w) -> int:
    """A HELLO of another protocol version: the ack's type (the worker then closes)."""
    frame = bytearray(wire.encode_hello(hello(w), 1))
    frame[4:6] = (99).to_bytes(2, "little")
    with socket.create_connection(("127.0.0.1", w.port), timeout=5) as s:
        s.sendall(frame)
        data = b""
        while len(data) < wire.HEADER.size:
            chunk = s.recv(4096)
            assert chunk
            data += chunk
    return wire.decode_header(data[: wire.HEADER.size]).type


# --------------------------------------------------------------------------- the exposition


@pytest.fixture(scope="module")
def known():
    """One worker (one served connection at most), after known HELLOs and N rounds:
    (worker, N, entries, resyncs, draft tokens, the scrape)."""
    w = make(max_slots=8, max_connections=1, key=KEY)
    try:
        assert refused(w, key=None) == wire.REFUSE_AUTH  # refused at the door
        assert refused(w, drafter_identity=b"\x01" * 32) == wire.REFUSE_DRAFTER
        assert refused(w, markov_identity=b"\x02" * 32) == wire.REFUSE_MARKOV
        assert refused(w, vocab_size=3) == wire.REFUSE_DRAFTER  # the model's vocabulary is 6
        assert refused(w, max_slots=16) == wire.REFUSE_LIMITS  # over --max-slots 8
        assert version_refused(w) == wire.HELLO_ACK
        c = connect(w, key=KEY)
        assert refused(w, served=1, session=2, engine_id=43) == wire.REFUSE_LIMITS  # busy: the one place is taken
        n, entries, resyncs, tokens = 5, 0, 0, 0
        for rid in range(1, n + 1):
            # Slots 0 and 1 re-announced every round; slot 5 never: RESYNC every time.
            d = do_round(
                c,
                rid,
                [wire.Entry(0, 2, 0, (1,), True), wire.Entry(1, 3, 0, (2, 3), True), wire.Entry(5, 2, 4, (4,), False)],
            )
            assert list(d.statuses) == [wire.STATUS_OK, wire.STATUS_OK, wire.STATUS_RESYNC]
            entries, resyncs, tokens = entries + 3, resyncs + 1, tokens + int(np.asarray(d.counts).sum())
        assert tokens == 5 * (2 + 3)
        # The round histogram is observed just after the DRAFTS is sent: wait for it.
        assert until(lambda: value(scrape(w), "dspark_worker_round_duration_seconds_count") == n, timeout=5)
        yield w, n, entries, resyncs, tokens, scrape(w)
        c.close()
    finally:
        w.stop()


def test_a_scrape_shows_exactly_the_hellos_refusals_and_rounds(known):
    w, n, entries, resyncs, tokens, text = known
    for reason in REFUSAL_REASONS:  # one of each, each counted once under its own reason
        assert value(text, "dspark_worker_hello_refusals_total", reason=reason) == 1, reason
    assert w.stats.refused == 6 and w.stats.busy == 1  # the derived fields, from the same counts
    # Given a thread: the accepted one and the four refused there (identities, vocab, limits);
    # the auth, version and busy refusals are answered at the door.
    assert value(text, "dspark_worker_served_connections_total") == 5
    assert value(text, "dspark_worker_accepted_connections_total") == 8
    assert value(text, "dspark_worker_connections", state="served") == 1
    assert value(text, "dspark_worker_connections", state="pending") == 0
    assert value(text, "dspark_worker_connections_limit", state="served") == 1
    assert value(text, "dspark_worker_bad_frames_total") == 0  # a version refusal is no bad frame
    for name in ("stalled_connections", "hello_timeouts", "displaced_connections", "evicted_sessions"):
        assert value(text, f"dspark_worker_{name}_total") == 0, name
    assert value(text, "dspark_worker_rounds_total") == n
    assert value(text, "dspark_worker_entries_total") == entries == 15
    assert value(text, "dspark_worker_resyncs_total") == resyncs == 5
    assert value(text, "dspark_worker_draft_tokens_total") == tokens
    for hist in ("round_duration_seconds", "drafting_duration_seconds"):
        assert value(text, f"dspark_worker_{hist}_count") == n
        assert value(text, f"dspark_worker_{hist}_bucket", le="+Inf") == n
        assert value(text, f"dspark_worker_{hist}_sum") > 0
    # Drafted in C on the connection's thread: the drafter's CPU is its drafting time.
    cpu = value(text, "dspark_worker_drafter_cpu_seconds_total")
    assert cpu == value(text, "dspark_worker_drafting_duration_seconds_sum") > 0
    info = [dict(k[1]) for k in samples(text) if k[0] == "dspark_worker_info"]
    assert info == [
        {
            "drafter": "MarkovDrafter",
            "drafter_identity": w.drafter.drafter_identity.hex(),
            "markov_identity": w.drafter.markov_identity.hex(),
            "vocab_size": "6",
            "incarnation": f"{w.incarnation:016x}",
        }
    ]
    # The Markov drafter keeps no per-slot state and does not pre-draft: no cache or
    # speculation metrics at all (not zeros).
    assert not [k for k in samples(text) if k[0].startswith(("dspark_worker_cache_", "dspark_worker_spec_"))]


def test_promtool_accepts_the_worker_exposition(known):
    assert PROMTOOL, NEED_TOOLS
    w = make(CachedDrafter(MODEL))
    try:
        for text in (known[-1], scrape(w)):  # with and without the cache's families
            out = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0 and out.stdout.strip() == "" and out.stderr.strip() == "", (
                out.stdout + out.stderr
            )
    finally:
        w.stop()


def test_cache_occupancy_comes_from_the_drafters_cache_info():
    d = CachedDrafter(MODEL)
    w = make(d)
    try:
        text = scrape(w)
        assert value(text, "dspark_worker_cache_slots") == 3
        assert value(text, "dspark_worker_cache_capacity_slots") == 16
        assert value(text, "dspark_worker_cache_bytes") == 4096
        assert value(text, "dspark_worker_cache_hits_total") == 7
        assert value(text, "dspark_worker_cache_misses_total") == 2
        d.info = CacheInfo(4, 16, 8192, 9, 3, blocks_used=40, blocks_free=24, evicted=5)  # read at scrape time
        text = scrape(w)
        assert value(text, "dspark_worker_cache_slots") == 4 and value(text, "dspark_worker_cache_hits_total") == 9
        assert (
            value(text, "dspark_worker_cache_blocks_used") == 40
            and value(text, "dspark_worker_cache_blocks_free") == 24
        )
        assert value(text, "dspark_worker_cache_evicted_streams_total") == 5
    finally:
        w.stop()


def spec_samples(text: str) -> dict:
    return {(name, dict(labels).get("rank")): v for (name, labels), v in samples(text).items() if "_spec_" in name}


def test_speculation_comes_from_the_drafters_spec_info():
    d = CachedDrafter(MODEL)
    w = make(d)
    try:
        assert spec_samples(scrape(w)) == {
            ("dspark_worker_spec_hits_total", "0"): 9,
            ("dspark_worker_spec_hits_total", "1"): 4,
            ("dspark_worker_spec_hits_total", "2"): 1,
            ("dspark_worker_spec_misses_total", None): 6,
            ("dspark_worker_spec_outcomes_total", None): 40,
            ("dspark_worker_spec_dropped_total", None): 25,
            ("dspark_worker_spec_seconds_total", None): 0.75,
            ("dspark_worker_spec_held", None): 5,
            ("dspark_worker_spec_blocks", None): 12,
        }
        # Read at scrape time; a fan-out past the label cap: ranks 0..62 each, the rest one "63+".
        d.spec = SpecInfo(outcomes=1, hits=tuple(range(100)), misses=0, dropped=0, seconds=0.0, held=0, blocks=0)
        hits = {r: v for (name, r), v in spec_samples(scrape(w)).items() if name == "dspark_worker_spec_hits_total"}
        assert len(hits) == MAX_RANK_LABELS == 64
        assert hits == {str(r): r for r in range(63)} | {"63+": sum(range(63, 100))}
        d.spec = None  # a drafter with pre-drafting off: absent, not zeros
        assert spec_samples(scrape(w)) == {}
    finally:
        w.stop()


# --------------------------------------------------------------------------- the table

# Every family a worker exposes (its drafter with a cache), in order: its name as its
# "# TYPE" line writes it, its type and its label names, which the dashboard's worker row
# queries. A row dropped from metrics.TABLE, renamed, retyped or relabelled fails here.
CONTRACT = [
    ("dspark_worker_info", "gauge", ("drafter", "drafter_identity", "incarnation", "markov_identity", "vocab_size")),
    ("dspark_worker_start_time_seconds", "gauge", ()),
    ("dspark_worker_connections", "gauge", ("state",)),
    ("dspark_worker_connections_limit", "gauge", ("state",)),
    ("dspark_worker_spare_sessions", "gauge", ()),
    ("dspark_worker_pings_total", "counter", ()),
    ("dspark_worker_accepted_connections_total", "counter", ()),
    ("dspark_worker_served_connections_total", "counter", ()),
    ("dspark_worker_hello_refusals_total", "counter", ("reason",)),
    ("dspark_worker_bad_frames_total", "counter", ()),
    ("dspark_worker_round_failures_total", "counter", ()),
    ("dspark_worker_stalled_connections_total", "counter", ()),
    ("dspark_worker_hello_timeouts_total", "counter", ()),
    ("dspark_worker_displaced_connections_total", "counter", ()),
    ("dspark_worker_evicted_sessions_total", "counter", ()),
    ("dspark_worker_rounds_total", "counter", ()),
    ("dspark_worker_entries_total", "counter", ()),
    ("dspark_worker_resyncs_total", "counter", ()),
    ("dspark_worker_entries_beyond_positions_total", "counter", ()),
    ("dspark_worker_draft_tokens_total", "counter", ()),
    ("dspark_worker_rounds_expired_total", "counter", ()),
    ("dspark_worker_drafter_calls_total", "counter", ()),
    ("dspark_worker_drafter_cpu_seconds_total", "counter", ()),
    ("dspark_worker_encode_pieces_total", "counter", ()),
    ("dspark_worker_encode_piece_tokens_total", "counter", ()),
    ("dspark_worker_round_duration_seconds", "histogram", ()),
    ("dspark_worker_drafting_duration_seconds", "histogram", ()),
    ("dspark_worker_queue_wait_seconds", "histogram", ()),
    ("dspark_worker_call_rounds", "histogram", ()),
    ("dspark_worker_call_entries", "histogram", ()),
    ("dspark_worker_call_tokens", "histogram", ()),
    ("dspark_worker_call_budget_entries", "gauge", ()),
    ("dspark_worker_call_budget_tokens", "gauge", ()),
    ("dspark_worker_cache_slots", "gauge", ()),
    ("dspark_worker_cache_capacity_slots", "gauge", ()),
    ("dspark_worker_cache_bytes", "gauge", ()),
    ("dspark_worker_cache_hits_total", "counter", ()),
    ("dspark_worker_cache_misses_total", "counter", ()),
    ("dspark_worker_cache_blocks_used", "gauge", ()),
    ("dspark_worker_cache_blocks_free", "gauge", ()),
    ("dspark_worker_cache_evicted_streams_total", "counter", ()),
    ("dspark_worker_spec_hits_total", "counter", ("rank",)),
    ("dspark_worker_spec_misses_total", "counter", ()),
    ("dspark_worker_spec_outcomes_total", "counter", ()),
    ("dspark_worker_spec_dropped_total", "counter", ()),
    ("dspark_worker_spec_seconds_total", "counter", ()),
    ("dspark_worker_spec_held", "gauge", ()),
    ("dspark_worker_spec_blocks", "gauge", ()),
]


def test_the_table_is_the_contract():
    assert [(name, kind, labels) for name, kind, _, labels in families_of(TABLE)] == CONTRACT


class BrokenCacheDrafter(MarkovDrafter):
    def cache_info(self) -> CacheInfo:
        raise RuntimeError("a plug-in's bug")

    def spec_info(self) -> SpecInfo:
        raise RuntimeError("a plug-in's bug")


@pytest.mark.parametrize("drafter_class", [MarkovDrafter, CachedDrafter, BrokenCacheDrafter])
def test_a_scrape_is_the_table_walked_over_the_workers_record(drafter_class):
    """Every row whose family the record has is in the scrape, with its type, help and
    labels, in the table's order, and nothing else is: the cache's and the speculation
    cache's rows only for a drafter whose cache_info() and spec_info() answer."""
    w = make(drafter_class(MODEL))
    try:
        text = scrape(w)
        assert families_in(text) == families_of(TABLE, read(w, 0.0))
        cached = drafter_class is CachedDrafter
        own = ("_cache_", "_spec_")  # the drafter's rows
        assert [f[0] for f in families_in(text)] == [
            c[0] for c in CONTRACT if cached or not any(o in c[0] for o in own)
        ]
    finally:
        w.stop()


# --------------------------------------------------------------------------- health


def test_healthz_and_readyz_while_serving_and_404_for_anything_else():
    w = make(max_connections=1)
    try:
        status, body = get(w, "/healthz")
        doc = json.loads(body)
        assert status == 200 and doc["state"] == "serving" and doc["ready"] is True
        assert doc["connections_total"] == doc["connections_now"] == doc["rounds_total"] == 0 and doc["uptime_s"] >= 0
        assert get(w, "/readyz")[0] == 200
        c = connect(w)
        try:
            do_round(c, 1, [wire.Entry(0, 2, 0, (1,), True)])
            # Every served connection in use: alive (healthz) but not ready for another engine.
            # (The round is counted once its DRAFTS went out: the client may read it first.)
            assert until(lambda: json.loads(get(w, "/healthz")[1])["rounds_total"] == 1, timeout=5)
            status, body = get(w, "/healthz")
            doc = json.loads(body)
            assert status == 200 and doc["connections_now"] == 1 and doc["connections_total"] == 1
            assert get(w, "/readyz")[0] == 503
        finally:
            c.close()
        assert until(lambda: get(w, "/readyz")[0] == 200, timeout=5)
        # The lifetime count stays; the present one goes back to none.
        doc = json.loads(get(w, "/healthz")[1])
        assert (doc["connections_total"], doc["connections_now"], doc["rounds_total"]) == (1, 0, 1)
        for path in ("/", "/metric", "/metrics/x", "/healthz/more"):
            assert get(w, path)[0] == 404, path
    finally:
        w.stop()


def test_healthz_is_503_once_stop_begins_and_refused_after_it():
    d = gated_drafter(MODEL)
    w = Worker(d, "127.0.0.1", 0, window=8, metrics_port=0).start()
    c = connect(w)
    stopper = threading.Thread(target=w.stop, daemon=True)
    rounder = threading.Thread(target=lambda: _quietly(do_round, c, 1, [wire.Entry(0, 2, 0, (1,), True)]), daemon=True)
    try:
        assert get(w, "/healthz")[0] == 200
        d.gate.clear()  # the round waits in the drafter, so stop() waits for it
        rounder.start()
        assert until(lambda: w.served_now() == 1 and w.stats.rounds == 0, timeout=5)
        stopper.start()
        assert until(lambda: get(w, "/healthz")[0] == 503, timeout=5)
        status, body = get(w, "/healthz")
        assert json.loads(body)["state"] == "stopping" and get(w, "/readyz")[0] == 503
    finally:
        d.gate.set()
        if stopper.ident is None:  # failed before stop began
            w.stop()
        stopper.join(15)
        rounder.join(15)
        c.close()
    assert not stopper.is_alive()
    with pytest.raises(urllib.error.URLError):
        get(w, "/healthz")


def _quietly(fn, *args):
    try:
        fn(*args)
    except Exception:
        pass


def test_a_metrics_port_in_use_is_a_clear_error_and_nothing_is_left_listening():
    w = make()
    try:
        with pytest.raises(ValueError, match=f"--metrics-port {w.metrics_port} on 127.0.0.1"):
            Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, metrics_port=w.metrics_port).start()
        with pytest.raises(ValueError, match="--metrics-port 70000: expected 0..65535"):
            Worker(MarkovDrafter(MODEL), "127.0.0.1", 0, metrics_port=70000).start()
    finally:
        w.stop()


def test_the_plain_worker_never_imports_prometheus_client():
    code = (
        "import sys\nfrom remote_dspark.worker import Worker\nfrom remote_dspark.drafter.markov import "
        "MarkovDrafter, builtin_model\nw = Worker(MarkovDrafter(builtin_model()), '127.0.0.1', 0).start()\nw.stop()\n"
        "print('prometheus_client' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


# --------------------------------------------------------------------------- the command


def test_worker_command_prints_its_metrics_address_and_serves_it():
    proc = subprocess.Popen(
        [sys.executable, "-m", "remote_dspark", "worker", "--listen", "127.0.0.1:0", "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    lines: list[str] = []  # read by a thread (a buffered pipe and select() do not mix); bounded waits
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        assert until(lambda: len(lines) >= 4 or proc.poll() is not None, timeout=30), lines
        assert len(lines) >= 4, f"the worker exited after {lines}"
        assert lines[0].startswith("remote-dspark worker listening on tcp://127.0.0.1:")
        m = re.match(r"  metrics on http://127\.0\.0\.1:(\d+)/metrics \(and /healthz, /readyz\)$", lines[3])
        assert m, lines
        with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/healthz", timeout=5) as r:
            assert r.status == 200 and json.loads(r.read())["state"] == "serving"
        with urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/metrics", timeout=5) as r:
            assert "dspark_worker_rounds_total 0.0" in r.read().decode()
    finally:
        proc.terminate()
        try:
            assert proc.wait(15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            reader.join(5)
            proc.stdout.close()


# --------------------------------------------------------------------------- the dashboard's worker row


def worker_queries() -> list[str]:
    return [e for e in dashboard.queries() if "dspark_worker_" in e]


def test_the_dashboard_has_a_worker_row_of_worker_panels():
    panels = json.loads(dashboard.text())["panels"]
    rows = [i for i, p in enumerate(panels) if p["type"] == "row"]
    assert [panels[i]["title"] for i in rows] == ["Worker"]
    below = panels[rows[0] + 1 :]
    assert below and all("dspark_worker_" in t["expr"] for p in below for t in p["targets"])
    assert all("dspark_worker_" not in t["expr"] for p in panels[: rows[0]] for t in p["targets"])
    exprs = " ".join(worker_queries())
    sel = '{job=~"$worker_job", instance=~"$worker_instance"}'
    for q in ("0.5", "0.99"):
        for hist in ("round_duration_seconds", "drafting_duration_seconds"):
            assert (
                f"histogram_quantile({q}, sum by (job, instance, le) "
                f"(rate(dspark_worker_{hist}_bucket{sel}[$__rate_interval])))" in exprs
            )

    # Pre-drafting's share of idle time: its seconds over the time outside the calls of rounds.
    def rate(name: str) -> str:
        return f"sum by (job, instance) (rate(dspark_worker_{name}{sel}[$__rate_interval]))"

    idle = f"{rate('spec_seconds_total')} / (1 - {rate('drafting_duration_seconds_sum')})"
    assert idle in worker_queries()


def test_every_worker_metric_the_dashboard_names_is_exposed():
    w = make(CachedDrafter(MODEL))
    try:
        exposed = {k[0] for k in samples(scrape(w))}
    finally:
        w.stop()
    named = {m for e in worker_queries() for m in re.findall(r"dspark_worker_[a-z_]+", e)}
    assert len(named) >= 10 and sorted(named - exposed) == []


@pytest.mark.slow
def test_real_prometheus_scrapes_the_worker_and_every_worker_query_has_data(tmp_path):
    """Two workers of one job: every worker query has a line for each (its instance
    kept), never one sum of both."""
    w, w2 = make(CachedDrafter(MODEL)), make(CachedDrafter(MODEL))
    c, c2 = connect(w), connect(w2)
    queries = [dashboard.as_sent(e, "5s") for e in worker_queries()]
    try:
        with prometheus(tmp_path, "worker", w.metrics_port, w2.metrics_port) as query:

            def instances(expr: str) -> set[str]:
                try:
                    return {r["metric"].get("instance", "") for r in query(expr)}
                except OSError:
                    return set()

            def rounds_and_data() -> bool:  # rounds keep coming, so every rate has two samples in its window
                for client in (c, c2):
                    do_round(client, rounds_and_data.rid, [wire.Entry(0, 2, 0, (1,), True)])
                rounds_and_data.rid += 1
                return all(instances(e) == both for e in queries)

            both = {f"127.0.0.1:{w.metrics_port}", f"127.0.0.1:{w2.metrics_port}"}
            rounds_and_data.rid = 1
            assert until(rounds_and_data, timeout=30, step=0.1), (
                [(e, instances(e)) for e in queries if instances(e) != both],
                (tmp_path / "prometheus.log").read_text()[-2000:],
            )
    finally:
        c.close()
        c2.close()
        w.stop()
        w2.stop()


def test_trickling_clients_never_hold_the_metrics_server():
    """The attack: 24 clients each trickling a request a byte at a time (every byte well
    within any per-read timeout). /metrics and /healthz are answered all along."""
    w = make()
    try:
        with Tricklers(w.metrics_port, 24, interval_s=0.05) as t:
            assert until(lambda: t.open_now() == 24 and t.bytes_sent > 24 * (len(TRICKLE_HEAD) + 2), timeout=10)
            answers = [get(w, path)[0] for path in ("/metrics", "/healthz") * 10]
        assert answers == [200] * 20
    finally:
        w.stop()


def test_huge_request_heads_are_refused_before_they_are_read_and_scrapes_go_on():
    """The attack: 16 requests of 99 header lines of 64 KiB (6.3 MiB each). The server
    stops reading each at its head cap (the client cannot even send it whole) and keeps
    answering /metrics."""
    w = make()
    try:
        with GiantHeads(w.metrics_port, 16) as g:
            assert until(lambda: g.refused >= 16, timeout=30)
            assert get(w, "/metrics")[0] == 200
        assert g.held == 0
    finally:
        w.stop()

"""Metrics: the exposition after known rounds and respawns, the table of families it is
walked from, promtool, the dashboard's queries, and a real Prometheus server scraping
the demo engine on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.parse
import urllib.request

import pytest
import torch
from helpers import NEED_TOOLS, PROMTOOL, families_in, families_of, prometheus, samples, until, value
from prometheus_client.parser import text_string_to_metric_families

from remote_dspark.bench.metrics_hostile import GiantHeads
from remote_dspark.cli import dashboard
from remote_dspark.config import Mode
from remote_dspark.config.api import RemoteConfig
from remote_dspark.demo.harness import DemoEngine, WorkerProcess
from remote_dspark.demo.sim import SimEngine
from remote_dspark.engine import RemoteDSpark
from remote_dspark.engine.observe.metrics import TABLE, Exporter, read
from remote_dspark.outcome import Outcome


@pytest.fixture(scope="module")
def worker():
    with WorkerProcess() as w:
        yield w


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(worker, **kw):
    """A process-mode engine of ``worker`` exporting metrics on a free port; ``kw`` last."""
    settings = dict(VLLM_DSPARK_REMOTE_ASYNC_NAP_US="20", VLLM_DSPARK_REMOTE_METRICS_PORT=str(free_port()))
    settings.update(kw)
    return worker.env(Mode.PROCESS, **settings)


def scrape(rd) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{rd.exporter.port}/metrics", timeout=10) as r:
        return r.read().decode()


def kill_proxy(rd):
    sup = rd.supervisor
    pid = sup.up.pid
    os.kill(pid, signal.SIGKILL)
    assert until(lambda: sup.up is not None and sup.up.pid != pid)


@pytest.fixture(scope="module")
def run(worker):
    """One engine: 40 rounds, a proxy SIGKILLed, 40 more; scrapes before and after."""
    env = engine_env(worker)
    rd = RemoteDSpark(RemoteConfig.from_env(env), num_spec=4, max_slots=8, row_bytes=16, environ=env).start()
    engine = DemoEngine(rd, SimEngine(8, 4))
    try:
        for _ in range(40):
            engine.step()
        before = scrape(rd)
        kill_proxy(rd)
        for _ in range(40):
            engine.step()
        assert until(lambda: engine.step().outcome is Outcome.OK)
        yield rd, before, scrape(rd)
    finally:
        rd.close()


def test_exposition_counts_the_rounds_and_the_respawn(run):
    rd, before, after = run
    st = rd.stats()
    for outcome in ("ok", "no_proxy", "watchdog", "timeout", "error"):
        assert value(after, "dspark_remote_rounds_total", outcome=outcome) == st.rounds[Outcome[outcome.upper()]]
    assert value(before, "dspark_remote_rounds_total", outcome="ok") == 40
    assert value(after, "dspark_remote_proxy_restarts_total", cause="signal") == 1
    assert value(after, "dspark_remote_proxy_restarts_total", cause="stall") == 0
    assert value(after, "dspark_remote_respawn_budget_left") == 2
    assert value(after, "dspark_remote_proxy_up") == 1
    assert value(after, "dspark_remote_breaker_state", state="closed") == 1
    assert value(after, "dspark_remote_breaker_state", state="open") == 0
    assert value(after, "dspark_remote_round_latency_seconds_count") == st.total_rounds
    assert value(after, "dspark_remote_draft_tokens_total") == st.draft_tokens > 0
    assert value(after, "dspark_remote_accepted_tokens_total") == sum(st.accepted_at) > 0
    info = [k for k in samples(after) if k[0] == "dspark_remote_info"][0]
    assert dict(info[1])["mode"] == "process" and dict(info[1])["policy"] == "capacity"
    states = {x: value(after, "dspark_remote_standby_state", state=x) for x in ("off", "none", "starting", "ready")}
    assert sorted(states.values()) == [0.0, 0.0, 0.0, 1.0] and states["off"] == 0.0  # one state, a standby kept
    assert value(after, "dspark_remote_standby_failures_total") == 0


def test_counters_stay_monotonic_across_the_respawn(run):
    _, before, after = run
    b, a = samples(before), samples(after)
    counters = [k for k in b if k[0].endswith(("_total", "_count", "_bucket", "_sum"))]
    assert len(counters) > 30
    assert [k for k in counters if a[k] < b[k]] == []
    assert a[("dspark_remote_attempts_total", ())] > b[("dspark_remote_attempts_total", ())]
    # The dead proxy's CPU time is carried: the total never drops with the new process.
    assert a[("dspark_remote_proxy_cpu_seconds_total", ())] >= b[("dspark_remote_proxy_cpu_seconds_total", ())] > 0


def test_exporter_listens_on_loopback_only(run):
    rd = run[0]
    assert rd.exporter.addr == "127.0.0.1"


def test_exporter_port_in_use_is_a_clear_error(run):
    rd = run[0]
    with pytest.raises(ValueError, match=f"VLLM_DSPARK_REMOTE_METRICS_PORT={rd.exporter.port}"):
        Exporter(rd, rd.exporter.port)


def test_the_exporter_refuses_huge_request_heads_before_reading_them(run):
    """99 header lines of 64 KiB: prometheus_client's server read them all into memory;
    the exporter stops at its head cap (the client cannot send them whole), and scrapes."""
    rd = run[0]
    with GiantHeads(rd.exporter.port, 4) as g:
        assert until(lambda: g.refused >= 4, timeout=30)
        assert "dspark_remote_rounds_total" in scrape(rd)
    assert g.held == 0


def test_stats_file_and_exposition_show_the_same_numbers(worker, tmp_path):
    env = engine_env(worker, VLLM_DSPARK_REMOTE_STATS_FILE=str(tmp_path / "s.json"))
    with RemoteDSpark(RemoteConfig.from_env(env), num_spec=4, max_slots=8, row_bytes=16, environ=env) as rd:
        engine = DemoEngine(rd, SimEngine(8, 4))
        for _ in range(10):
            engine.step()
        text = scrape(rd)
        rd._report.write(rd.stats())
        on_disk = json.loads((tmp_path / "s.json").read_text())
        assert value(text, "dspark_remote_rounds_total", outcome="ok") == on_disk["rounds"]["ok"] == 10
        assert value(text, "dspark_remote_draft_tokens_total") == on_disk["draft_tokens"]


def test_promtool_accepts_the_exposition(run, tmp_path):
    assert PROMTOOL, NEED_TOOLS
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=run[2], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "" and out.stderr.strip() == "", out.stdout + out.stderr


# --------------------------------------------------------------------------- the table

# Every family an engine exposes (process mode, margins asked for), in order: its name
# as its "# TYPE" line writes it, its type and its label names, which the dashboard
# queries. A row dropped from metrics.TABLE, renamed, retyped or relabelled fails here.
CONTRACT = [
    ("dspark_remote_info", "gauge", ("drafter_identity", "endpoint", "markov_identity", "mode", "policy")),
    ("dspark_remote_rounds_total", "counter", ("outcome",)),
    ("dspark_remote_attempts_total", "counter", ()),
    ("dspark_remote_rounds_bad_desc_total", "counter", ()),
    ("dspark_remote_round_latency_seconds", "histogram", ()),
    ("dspark_remote_handoff_latency_seconds", "histogram", ()),
    ("dspark_remote_drafts_total", "counter", ()),
    ("dspark_remote_draft_tokens_total", "counter", ()),
    ("dspark_remote_resyncs_total", "counter", ()),
    ("dspark_remote_announce_chunks_total", "counter", ()),
    ("dspark_remote_announcing_slots", "gauge", ()),
    ("dspark_remote_reannounced_slots_total", "counter", ()),
    ("dspark_remote_accepted_tokens_total", "counter", ()),
    ("dspark_remote_accepted_tokens_by_position_total", "counter", ("position",)),
    ("dspark_remote_offered_tokens_by_position_total", "counter", ("position",)),
    ("dspark_remote_shadow_agree_total", "counter", ("position",)),
    ("dspark_remote_shadow_compared_total", "counter", ("position",)),
    ("dspark_remote_margin_ratio", "histogram", ()),
    ("dspark_remote_breaker_state", "gauge", ("state",)),
    ("dspark_remote_breaker_trips_total", "counter", ()),
    ("dspark_remote_breaker_probes_total", "counter", ()),
    ("dspark_remote_reconnects_total", "counter", ()),
    ("dspark_remote_failovers_total", "counter", ("cause",)),
    ("dspark_remote_fenced_replies_total", "counter", ()),
    ("dspark_remote_worker_info", "gauge", ("address", "incarnation")),
    ("dspark_remote_spare_ready", "gauge", ()),
    ("dspark_remote_session_id", "gauge", ()),
    ("dspark_remote_proxy_up", "gauge", ()),
    ("dspark_remote_proxy_restarts_total", "counter", ("cause",)),
    ("dspark_remote_respawn_budget_left", "gauge", ()),
    ("dspark_remote_respawn_budget_restores_total", "counter", ()),
    ("dspark_remote_proxy_resident_memory_bytes", "gauge", ()),
    ("dspark_remote_proxy_cpu_seconds_total", "counter", ()),
    ("dspark_remote_standby_state", "gauge", ("state",)),
    ("dspark_remote_standby_failures_total", "counter", ()),
]


def test_the_table_is_the_contract():
    assert [(name, kind, labels) for name, kind, _, labels in families_of(TABLE)] == CONTRACT


def test_a_scrape_is_the_table_walked_over_the_engines_record(run):
    """Every row whose family the record has is in the scrape, with its type, help and
    labels, in the table's order, and nothing else is: process mode without margins
    asked for is every row but the margin histogram."""
    rd, _, after = run
    assert families_in(after) == families_of(TABLE, read(rd))
    assert [f[0] for f in families_in(after)] == [c[0] for c in CONTRACT if c[0] != "dspark_remote_margin_ratio"]


def test_a_thread_mode_scrape_has_the_hand_offs_rows_and_not_the_supervisors(worker):
    env = engine_env(worker, VLLM_DSPARK_REMOTE_ASYNC_PROXY="thread", VLLM_DSPARK_REMOTE_WANT_MARGIN="1")
    with RemoteDSpark(RemoteConfig.from_env(env), num_spec=4, max_slots=8, row_bytes=16, environ=env) as rd:
        engine = DemoEngine(rd, SimEngine(8, 4))
        assert until(lambda: engine.step().outcome is Outcome.OK)
        text = scrape(rd)
        assert families_in(text) == families_of(TABLE, read(rd))
        supervisors = ("proxy_restarts", "respawn_", "proxy_resident", "proxy_cpu", "standby_")
        want = [c[0] for c in CONTRACT if not c[0].removeprefix("dspark_remote_").startswith(supervisors)]
        assert [f[0] for f in families_in(text)] == want
        assert value(text, "dspark_remote_proxy_up") == 1  # the proxy thread is alive


# --------------------------------------------------------------------------- dashboard
# Its JSON, its queries' syntax and units, and the tables' families on it:
# tests/cli/test_dashboard.py.


def test_every_metric_the_dashboard_names_is_exposed(run):
    import re

    exposed = {k[0] for k in samples(run[2])}
    named = {m for e in dashboard.queries() for m in re.findall(r"dspark_remote_[a-z_]+", e)}
    named.discard("dspark_remote_margin_ratio_bucket")  # margins asked for only: the run fixture asks for none
    assert named and sorted(named - exposed) == []


# --------------------------------------------------------------------------- real Prometheus


@pytest.mark.slow
def test_real_prometheus_scrapes_the_engine(worker, tmp_path):
    env = engine_env(worker, VLLM_DSPARK_REMOTE_WANT_MARGIN="1")  # the margin panel's family too
    rd = RemoteDSpark(RemoteConfig.from_env(env), num_spec=4, max_slots=8, row_bytes=16, environ=env).start()
    engine = DemoEngine(rd, SimEngine(8, 4))
    try:
        with prometheus(tmp_path, "engine", rd.exporter.port) as query:

            def scraped(expr, want):
                try:
                    r = query(expr)
                except OSError:
                    return False
                return bool(r) and float(r[0]["value"][1]) >= want

            for _ in range(30):
                engine.step()
            assert until(lambda: scraped('dspark_remote_rounds_total{outcome="ok"}', 30), timeout=30), (
                tmp_path / "prometheus.log"
            ).read_text()[-2000:]
            kill_proxy(rd)
            for _ in range(30):
                engine.step()
            ok = rd.stats().rounds[Outcome.OK]
            assert until(lambda: scraped('dspark_remote_rounds_total{outcome="ok"}', ok), timeout=30)
            assert until(lambda: scraped('dspark_remote_proxy_restarts_total{cause="signal"}', 1), timeout=30)
            # Every engine query of the dashboard returns data from this run (the worker's
            # row: tests/worker/test_worker_metrics.py).
            # Each result is one engine's (its instance kept: never a sum of several).
            engine_queries = [dashboard.as_sent(e, "5s") for e in dashboard.queries() if "dspark_worker_" not in e]
            assert until(lambda: all(query(e) for e in engine_queries), timeout=30), [
                e for e in engine_queries if not query(e)
            ]
            assert all(r["metric"]["instance"] for e in engine_queries for r in query(e))
    finally:
        rd.close()


@pytest.mark.parametrize("want", ["0", "1"])
def test_margins_on_request_only(worker, tmp_path, want):
    """WANT_MARGIN=0: the worker sends DRAFTS without margins, Drafts.margins is None and
    the margin metric is absent (not zero); WANT_MARGIN=1: margins, and the metric."""
    from remote_dspark.engine import Batch

    env = dict(
        engine_env(worker),
        VLLM_DSPARK_REMOTE_WANT_MARGIN=want,
        VLLM_DSPARK_REMOTE_ASYNC="0",
        VLLM_DSPARK_REMOTE_STATS_FILE=str(tmp_path / "s.json"),
    )
    rd = RemoteDSpark(RemoteConfig.from_env(env), num_spec=4, max_slots=8, row_bytes=16, environ=env).start()
    try:
        b = Batch.from_lists([0], [[1]], [0], [True], torch.zeros(1, 4), torch.tensor([0]))
        out = rd.round(b)
        assert out.outcome is Outcome.OK and (out.margins is None) == (want == "0")
        text = scrape(rd)
        names = {fam.name for fam in text_string_to_metric_families(text)}
        assert ("dspark_remote_margin_ratio" in names) == (want == "1")
        # Sync mode: the hand-off's and the supervisor's rows are left out, every other is there.
        assert families_in(text) == families_of(TABLE, read(rd))
        assert "dspark_remote_proxy_up" not in names and "dspark_remote_proxy_restarts" not in names
    finally:
        rd.close()

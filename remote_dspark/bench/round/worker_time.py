"""``bench round``'s view of the worker's own time: what its ``/metrics`` say a round
took inside the worker (a ROUND in to its DRAFTS sent: decode, windows, the drafter,
the reply; not a served round's wait for its rows) and how much of that the drafter's
calls took, read before and after a row's measured rounds. Means over the row (the
histograms' sums over their counts), beside the engine's end-to-end p50."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

ROUND = "dspark_worker_round_duration_seconds"
DRAFTING = "dspark_worker_drafting_duration_seconds"
SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Totals:
    """The worker's running totals at one scrape."""

    round_s: float  # seconds inside the worker, over every round answered
    rounds: float
    drafting_s: float  # seconds inside draft_batch, over every call


def read(url: str) -> Totals:
    """The worker's totals from its ``/metrics`` at ``url`` (loopback, within
    ``SCRAPE_TIMEOUT_S``).

    Raises:
        RuntimeError: the scrape failed or lacks the families, naming the URL.
    """
    values = scrape(url)
    try:
        return Totals(values[ROUND + "_sum"], values[ROUND + "_count"], values[DRAFTING + "_sum"])
    except KeyError as e:
        raise RuntimeError(f"the worker's metrics at {url} lack {e.args[0]}") from None


def scrape(url: str) -> dict[str, float]:
    """The samples of the worker's ``/metrics`` at ``url`` (loopback, within
    ``SCRAPE_TIMEOUT_S``) by name (a name of several labelled samples: its last).

    Raises:
        RuntimeError: the scrape failed, naming the URL.
    """
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as r:
            text = r.read().decode()
    except OSError as e:
        raise RuntimeError(f"the worker's metrics at {url}: {e}") from e
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def per_round(before: Totals, after: Totals) -> dict:
    """The row's ``worker_ms`` (mean time inside the worker per round) and
    ``worker_drafting_ms`` (the drafter's calls, per round), None when no round was
    answered between the scrapes."""
    rounds = after.rounds - before.rounds
    if rounds <= 0:
        return {"worker_ms": None, "worker_drafting_ms": None}
    return {
        "worker_ms": round((after.round_s - before.round_s) / rounds * 1e3, 4),
        "worker_drafting_ms": round((after.drafting_s - before.drafting_s) / rounds * 1e3, 4),
    }

"""What the benchmarks of the worker's speculation cache share (``bench worker-engines
--speculate N``, ``bench generate``'s ``process-spec``): a simulated target whose rounds
can hit, and the worker's counters read around a row.

**The simulated target** (:class:`SampledTarget`). Its session is sampled (HELLO asks for
sampled drafts with their distributions ``q``); each slot keeps one seed and temperature
1.0 across rounds. Per slot and round it accepts ``j`` of the ``count`` drafts it got
(``j`` uniform in ``0..count-1``, from a generator seeded by the engine: the same run,
the same rounds) and appends the target's token ``t``: the likeliest id of ``q`` at
position ``j`` other than the draft there (:func:`outcomes`). A target whose correction
is always the drafter's own second choice: the drafter ranks exactly such outcomes among
its likeliest, so rounds can hit. It simulates what the hit path costs (the worker
answering from its cache), not the hit rate a real target gives. A slot whose stream
would pass ``wrap`` tokens, or that got no drafts, is announced again (NEW_GEN of its
prompt).

**The counters** (:class:`SpecCounters`): one scrape of the worker's ``/metrics`` gives its
hits (``dspark_worker_spec_hits_total``, summed over its ``rank`` label), misses
(``dspark_worker_spec_misses_total``), rounds and the time inside it
(``dspark_worker_round_duration_seconds``), and its drafter calls and their time
(``dspark_worker_drafting_duration_seconds``). A worker without a speculation cache has
no spec families: its hits and misses read None.
"""

from __future__ import annotations

from dataclasses import dataclass

HITS = "dspark_worker_spec_hits_total"
MISSES = "dspark_worker_spec_misses_total"
ROUND = "dspark_worker_round_duration_seconds"
DRAFTING = "dspark_worker_drafting_duration_seconds"


def outcomes(drafts, counts, q_ids, q_weights, j) -> list[tuple[int, ...]]:
    """The tokens the simulated target appends to each entry: its first ``j[i]`` drafts,
    then the likeliest id of ``q`` at position ``j[i]`` other than the draft there (the
    first of equal weights, in ``q``'s order). ``drafts`` [n, w], ``counts`` [n],
    ``q_ids`` and ``q_weights`` [n, w, top], ``j`` [n] (array-likes). A pure function.

    Raises:
        ValueError: a ``j[i]`` outside ``0..counts[i]-1`` (an entry without drafts has no
        outcome), naming the entry.
    """
    import numpy as np

    drafts, counts, j = np.asarray(drafts), np.asarray(counts), np.asarray(j, np.int64)
    bad = np.flatnonzero((j < 0) | (j >= counts))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"entry {i}: j={int(j[i])} outside 0..{int(counts[i]) - 1} (its {int(counts[i])} drafts)")
    rows = np.arange(len(j))
    ids, weights = np.asarray(q_ids)[rows, j], np.asarray(q_weights)[rows, j].astype(np.int64)
    weights = np.where(ids == drafts[rows, j][:, None], -1, weights)  # never the draft itself
    t = ids[rows, np.argmax(weights, axis=1)]
    return [(*map(int, drafts[i, : j[i]]), int(t[i])) for i in rows]


class SampledTarget:
    """One simulated engine's slots (see the module's docstring): the entries of its next
    round (:meth:`entries`) and what it appends from a reply (:meth:`took`)."""

    def __init__(self, engine_id: int, prompts: list, k: int, wrap: int):
        import numpy as np

        self.k, self.wrap = k, wrap
        self.prompts = [tuple(int(t) for t in p) for p in prompts]  # each slot's NEW_GEN
        self.seeds = [(engine_id << 32) | s for s in range(len(prompts))]
        self.rng = np.random.default_rng(engine_id)
        self.had = [0] * len(prompts)  # each stream's tokens at the worker
        self.pending: list[tuple[int, ...]] = [()] * len(prompts)  # appended since its last round; (): NEW_GEN

    def entries(self, new_gen: bool = False) -> list:
        """The next round's entries (every slot, sampled at temperature 1.0 with its seed)."""
        from .. import wire

        out = []
        for s, pending in enumerate(self.pending):
            new = new_gen or not pending or self.had[s] + len(pending) > self.wrap
            tokens = self.prompts[s] if new else pending
            self.had[s] = 0 if new else self.had[s]
            out.append(wire.Entry(s, self.k, self.had[s], tokens, new, temperature=1.0, seed=self.seeds[s]))
            self.had[s] += len(tokens)
        return out

    def took(self, d) -> int:
        """What each slot appends next from ``d`` (the DRAFTS of :meth:`entries`' round, in
        slot order): :func:`outcomes`. Returns the drafts ``d`` holds."""
        import numpy as np

        from ..wire import SAMPLED_TOP

        n, w = len(d.slots), d.width
        counts = np.asarray(d.counts, np.int64)
        has = np.flatnonzero(counts > 0)
        self.pending = [()] * n
        if has.size and d.sampled:
            j = (self.rng.random(n) * np.maximum(counts, 1)).astype(np.int64)[has]
            drafts = np.asarray(d.tokens).reshape(n, w)[has]
            q_ids = np.asarray(d.q_ids).reshape(n, w, SAMPLED_TOP)[has]
            q_weights = np.asarray(d.q_weights).reshape(n, w, SAMPLED_TOP)[has]
            for i, tokens in zip(has, outcomes(drafts, counts[has], q_ids, q_weights, j)):
                self.pending[int(i)] = tokens
        return int(counts.sum())


@dataclass(frozen=True)
class SpecCounters:
    """The worker's running totals at one scrape (hits and misses None: no cache)."""

    hits: float | None
    misses: float | None
    rounds: float
    round_s: float
    calls: float
    drafting_s: float

    @classmethod
    def read(cls, url: str) -> SpecCounters:
        """One scrape of the worker's ``/metrics`` at ``url`` (:meth:`parse`).

        Raises:
            RuntimeError: the scrape failed or lacks a round or drafting family, naming the URL.
        """
        import urllib.request

        from .round.worker_time import SCRAPE_TIMEOUT_S

        try:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as r:
                return cls.parse(r.read().decode(), url)
        except OSError as e:
            raise RuntimeError(f"the worker's metrics at {url}: {e}") from e

    @classmethod
    def parse(cls, text: str, url: str = "the text") -> SpecCounters:
        """The totals in a Prometheus exposition ``text`` (a labelled family's samples
        summed: the hits over their ``rank``).

        Raises:
            RuntimeError: a round or drafting family missing, naming ``url``.
        """
        from prometheus_client.parser import text_string_to_metric_families

        sums: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
        try:
            totals = (sums[ROUND + "_count"], sums[ROUND + "_sum"], sums[DRAFTING + "_count"], sums[DRAFTING + "_sum"])
        except KeyError as e:
            raise RuntimeError(f"the worker's metrics at {url} lack {e.args[0]}") from None
        return cls(sums.get(HITS), sums.get(MISSES), *totals)


def figures(before: SpecCounters, after: SpecCounters, entries: int) -> dict:
    """A row's figures between two scrapes: its hits and misses, the hit share (hits over
    the row's ``entries``; None without a cache), the worker's mean time on a round and
    its mean drafter call (ms; None without one)."""
    rounds, calls = after.rounds - before.rounds, after.calls - before.calls
    cached = before.hits is not None and after.hits is not None
    hits = after.hits - before.hits if cached else None
    misses = after.misses - before.misses if cached and after.misses is not None else None
    return {
        "spec_hits": None if hits is None else int(hits),
        "spec_misses": None if misses is None else int(misses),
        "hit_share": round(hits / entries, 4) if cached and entries else None,
        "worker_round_ms": round((after.round_s - before.round_s) / rounds * 1e3, 4) if rounds > 0 else None,
        "call_ms": round((after.drafting_s - before.drafting_s) / calls * 1e3, 4) if calls > 0 else None,
    }


GOAL_HIT_MS = 0.2  # worker-engines: a hit round, ms at most
GOAL_SHARE, GOAL_X = 0.6, 2.0  # generate: rounds that hit, at least; the mean round over process's, at least x lower


def engine_goals(by: dict) -> list[dict]:
    """``bench worker-engines``' goals for ``batched-spec`` against ``batched``: its p50 (a
    hit round's time where the hit share is near 1: the engine cannot tell a hit round)
    and its p99 over ``batched``'s, in drafter calls (``batched``'s mean: a pre-draft call
    is bounded by the same budget)."""
    spec, off = by.get("batched-spec"), by.get("batched")
    if spec is None:
        return []
    goal = f"batched-spec p50 round (hit share {spec['hit_share']}) <= {GOAL_HIT_MS} ms"
    goals = [{"goal": goal, "value": spec["p50_ms"], "unit": " ms", "met": spec["p50_ms"] <= GOAL_HIT_MS}]
    if off is not None and off.get("call_ms"):
        calls = (spec["p99_ms"] - off["p99_ms"]) / off["call_ms"]
        goal = f"batched-spec p99 over batched's <= one drafter call ({off['call_ms']} ms)"
        goals.append({"goal": goal, "value": round(calls, 2), "unit": " calls", "met": calls <= 1.0})
    return goals


def generate_goals(by: dict) -> list[dict]:
    """``bench generate``'s goals for ``process-spec``: its hit share, ``process``'s mean
    round over its own, and its tokens ``process``'s (the cache changes no output)."""
    spec = by.get("process-spec")
    if spec is None:
        return []
    share = spec["hit_share"]
    goals = [
        {
            "goal": f"process-spec: rounds that hit >= {GOAL_SHARE:.0%}",
            "value": share,
            "unit": "",
            "met": share is not None and share >= GOAL_SHARE,
        }
    ]
    process = by.get("process")
    if process is not None and process["round_ms"] and spec["round_ms"]:
        x = process["round_ms"] / spec["round_ms"]
        goal = f"process-spec: process's mean round / its own >= {GOAL_X:g}x"
        goals.append({"goal": goal, "value": round(x, 2), "unit": "x", "met": x >= GOAL_X})
    if spec.get("same_tokens_as_process") is not None:
        goal = "process-spec: the same tokens as process"
        goals.append({"goal": goal, "value": None, "met": spec["same_tokens_as_process"]})
    return goals


def spec_line(r: dict) -> str:
    """A row's speculation figures, as a line under the table."""
    share = "-" if r["hit_share"] is None else f"{r['hit_share']:.1%}"
    return (
        f"{r['mode']}: entries hit {share} ({r['spec_hits']} hits, {r['spec_misses']} misses), "
        f"the worker's mean round {r['worker_round_ms']} ms, its mean drafter call {r['call_ms']} ms"
    )

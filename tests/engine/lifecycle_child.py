"""The child process of tests/engine/test_lifecycle.py: one lifecycle scenario of ``RemoteDSpark``
against its own loopback worker, in its own process, so a crash (SIGSEGV) is the test's
failure and not the test run's end.

    python lifecycle_child.py SCENARIO MODE CYCLES SEED TMPDIR

SCENARIO is ``close_round``, ``stats_close`` or ``closed``; MODE ``sync``, ``thread`` or
``process``. The last line of stdout is ``SUMMARY {json}``; the exit status is 0 only when
every cycle passed. Every wait is bounded; a cycle that hangs past CYCLE_LIMIT_S dumps
every thread's stack (faulthandler) and exits 1. A crash dumps them too.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

faulthandler.enable()  # a SIGSEGV prints every thread's Python stack to stderr

import torch
from helpers import COUNTING, env_for  # tests/ is on PYTHONPATH

from remote_dspark.config.api import RemoteConfig
from remote_dspark.drafter import MarkovDrafter
from remote_dspark.engine import Batch, Drafts, Mode, RemoteClosed, RemoteDSpark
from remote_dspark.worker import Worker

CYCLE_LIMIT_S = 20.0  # one cycle, start to end: past this the child dumps its stacks and exits
JOIN_S = 5.0  # a thread's end after close() (close itself is allowed CLOSE_DEADLINE_S)
FIRST_ROUND_S = 5.0  # the round thread's first answer after start()
MAX_DELAY_S = 0.005  # close() comes this long at most after the first answer (uniform)
ROWS = torch.arange(8, dtype=torch.float32).reshape(4, 2)


def make(env: dict[str, str]) -> RemoteDSpark:
    return RemoteDSpark(RemoteConfig.from_env(env), environ=env, num_spec=3, max_slots=4, row_bytes=8)


def batch() -> Batch:
    return Batch.from_lists([0, 1], [[1], [3]], [0, 0], [True, True], ROWS, torch.arange(2))


def text(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)).strip()


def attempt(fn, *args):
    """``fn(*args)`` as (its result, None) or (None, the exception it raised): the child
    reports every exception, it never dies of one."""
    try:
        return fn(*args), None
    except BaseException as e:  # noqa: BLE001
        return None, e


class Rounds(threading.Thread):
    """Calls ``rd.round`` in a loop until it raises. Ends well with RemoteClosed; any
    other exception, or something that is not Drafts, is an error."""

    def __init__(self, rd: RemoteDSpark):
        super().__init__(name="rounds", daemon=True)
        self.rd = rd
        self.outcomes: Counter = Counter()  # Drafts.outcome, or "RemoteClosed"
        self.errors: list[str] = []
        self.answered = threading.Event()  # a first round came back (or the thread ended)
        self.inside = False  # between the call of round() and its return

    def run(self) -> None:
        while True:
            self.inside = True
            out, e = attempt(self.rd.round, batch())
            self.inside = False
            if isinstance(e, RemoteClosed):
                self.outcomes["RemoteClosed"] += 1
                break
            if e is not None:
                self.errors.append("the round thread raised: " + text(e))
                break
            if not isinstance(out, Drafts):
                self.errors.append(f"round() returned {type(out).__name__}, not Drafts")
                break
            self.outcomes[out.outcome.label] += 1
            self.answered.set()
        self.answered.set()


class Scraper(threading.Thread):
    """Reads ``rd.stats()`` in a loop until told to stop: (read began, read ended, total)."""

    def __init__(self, rd: RemoteDSpark):
        super().__init__(name="scraper", daemon=True)
        self.rd = rd
        self.reads: list[tuple[float, float, int]] = []
        self.errors: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            st, e = attempt(self.rd.stats)
            if e is not None:
                self.errors.append("stats() raised: " + text(e))
                return
            self.reads.append((t0, time.monotonic(), st.total_rounds))


def expect_closed(rd: RemoteDSpark, errors: list[str]) -> None:
    """round() on a closed engine raises RemoteClosed (nothing else)."""
    _, e = attempt(rd.round, batch())
    if e is None:
        errors.append("round() after close() returned")
    elif not isinstance(e, RemoteClosed):
        errors.append("round() after close() raised other than RemoteClosed: " + text(e))


def timed_close(rd: RemoteDSpark, errors: list[str]) -> float:
    t0 = time.monotonic()
    _, e = attempt(rd.close)
    took = time.monotonic() - t0
    if e is not None:
        errors.append("close() raised: " + text(e))
    return took


def close_round(rd: RemoteDSpark, rng: random.Random, summary: dict, tmp: str) -> list[str]:
    """close() from this thread while another is in a loop of round()."""
    errors: list[str] = []
    rounds = Rounds(rd)
    rounds.start()
    if not rounds.answered.wait(FIRST_ROUND_S):
        errors.append(f"no first round within {FIRST_ROUND_S} s")
    time.sleep(rng.uniform(0, MAX_DELAY_S))
    summary["in_flight_at_close"] += rounds.inside  # counted, never required: timing
    close_s = timed_close(rd, errors)
    summary["close_s"].append(round(close_s, 4))
    rounds.join(JOIN_S)
    if rounds.is_alive():
        errors.append(f"the round thread did not end within {JOIN_S} s of close()")
    errors += rounds.errors
    summary["outcomes"].update(rounds.outcomes)
    expect_closed(rd, errors)
    return errors


def stats_close(rd: RemoteDSpark, rng: random.Random, summary: dict, tmp: str) -> list[str]:
    """close() while one thread runs rounds and another scrapes stats(): no exception;
    the total read after close() returns never changes again, is >= every total read
    before, and the stats after close are the final ones (the file close() wrote)."""
    errors: list[str] = []
    rounds, scraper = Rounds(rd), Scraper(rd)
    rounds.start()
    scraper.start()
    if not rounds.answered.wait(FIRST_ROUND_S):
        errors.append(f"no first round within {FIRST_ROUND_S} s")
    time.sleep(rng.uniform(0, MAX_DELAY_S))
    summary["in_flight_at_close"] += rounds.inside
    close_s = timed_close(rd, errors)
    closed_at = time.monotonic()
    summary["close_s"].append(round(close_s, 4))
    after, e = attempt(rd.stats)
    if e is not None:
        errors.append("stats() after close() raised: " + text(e))
    rounds.join(JOIN_S)
    if rounds.is_alive():
        errors.append(f"the round thread did not end within {JOIN_S} s of close()")
    time.sleep(0.01)  # a few more scrapes after the round thread's end
    scraper.stop.set()
    scraper.join(JOIN_S)
    if scraper.is_alive():
        errors.append(f"the scraper did not end within {JOIN_S} s")
    errors += rounds.errors + scraper.errors
    summary["outcomes"].update(rounds.outcomes)
    summary["scrapes"] += len(scraper.reads)
    if after is None:
        return errors
    total = after.total_rounds
    later = [t for began, _, t in scraper.reads if began >= closed_at]
    before = [t for _, _, t in scraper.reads]
    if any(t != total for t in later):
        errors.append(f"the rounds total changed after close() returned: {total} then {sorted(set(later))}")
    if before and max(before) > total:
        errors.append(f"a total read during close() ({max(before)}) is past the one after it ({total})")
    end, e = attempt(rd.stats)
    if e is not None:
        errors.append("stats() after the round thread's end raised: " + text(e))
        return errors
    if end.rounds != after.rounds:
        errors.append(f"the rounds after close() changed: {after.rounds} then {end.rounds}")
    with open(os.path.join(tmp, "stats.json")) as f:
        final = json.load(f)
    if json.loads(json.dumps(end.to_json())) != final:
        errors.append(
            f"stats() after close() is not the final stats file: rounds {end.to_json()['rounds']} "
            f"vs the file's {final.get('rounds')}"
        )
    return errors


def closed(rd: RemoteDSpark, rng: random.Random, summary: dict, tmp: str) -> list[str]:
    """A closed engine: close() twice; round() and launch() raise RemoteClosed; start()
    raises RuntimeError naming the state. Also for an engine closed before its start."""
    errors: list[str] = []
    _, e = attempt(rd.round, batch())
    if e is not None:
        errors.append("round() on the started engine raised: " + text(e))
    for engine, name in ((rd, "started"), (make(rd.spec.environ), "never started")):
        for _ in (1, 2):
            summary["close_s"].append(round(timed_close(engine, errors), 4))
        expect_closed(engine, errors)
        _, e = attempt(engine.launch, batch())
        if e is None:
            errors.append(f"launch() after close() ({name}) returned")
        elif not isinstance(e, RemoteClosed):
            errors.append(f"launch() after close() ({name}) raised other than RemoteClosed: " + text(e))
        _, e = attempt(engine.start)
        if e is None:
            errors.append(f"start() after close() ({name}) returned")
        elif not isinstance(e, RuntimeError) or "closed" not in str(e):
            errors.append(
                f"start() after close() ({name}) did not raise RuntimeError naming the state 'closed': " + text(e)
            )
    return errors


SCENARIOS = {"close_round": close_round, "stats_close": stats_close, "closed": closed}


def main() -> int:
    scenario, mode, cycles, seed, tmp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    run = SCENARIOS[scenario]
    rng = random.Random(seed)
    summary = {
        "scenario": scenario,
        "mode": mode,
        "seed": seed,
        "cycles": 0,
        "failed_cycles": 0,
        "close_s": [],
        "close_max_s": 0.0,
        "outcomes": Counter(),
        "in_flight_at_close": 0,
        "scrapes": 0,
        "failures": [],
    }
    w = Worker(MarkovDrafter(COUNTING), "127.0.0.1", 0).start()
    try:
        env = env_for(w.port, Path(tmp), Mode(mode))  # as the tests in the parent build it
        for i in range(cycles):
            faulthandler.dump_traceback_later(CYCLE_LIMIT_S, exit=True)
            rd = make(env)
            _, e = attempt(rd.start)
            errors = ["start() raised: " + text(e)] if e is not None else run(rd, rng, summary, tmp)
            attempt(rd.close)  # a cycle that failed half-way: nothing left running
            faulthandler.cancel_dump_traceback_later()
            summary["cycles"] += 1
            if errors:
                summary["failed_cycles"] += 1
                if len(summary["failures"]) < 3:
                    summary["failures"].append({"cycle": i, "errors": errors})
                for e in errors:
                    print(f"cycle {i}: {e}", file=sys.stderr, flush=True)
    finally:
        w.stop()
        summary["close_max_s"] = max(summary["close_s"], default=0.0)
        print("SUMMARY " + json.dumps(summary), flush=True)
    return 1 if summary["failed_cycles"] or summary["cycles"] != cycles else 0


if __name__ == "__main__":
    sys.exit(main())

"""The standby's promotion on the region's ``standby_go`` word: the supervisor's offer
(``standby_offer``) and the standby's answer from its wait loop (``standby_wait``, run
by ``proxy_proc.wait_for_promotion``) have exactly one winner, so a standby that cannot
answer (stopped) is never promoted, even once it runs again."""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest
from helpers import CHILD_TIMEOUT_S, child, finish, until

from remote_dspark import native
from remote_dspark.shm import layout, memfd

ACCEPTED = 0x80000000  # beside the pid in standby_go once the standby accepted


def make_region() -> memfd.Region:
    return memfd.Region.create(layout.Layout(4, 8, 16, 4, 64))


def standby_code(fd: int) -> str:
    """A child that is a standby on the region at ``fd``: the proxy process's own wait
    (``wait_for_promotion``), with no end until it has been stopped and resumed (SIGCONT),
    and then three more looks (an idle tick each); it prints whether it was promoted."""
    return f"""
        import signal
        from remote_dspark import native
        from remote_dspark.proxy_proc import wait_for_promotion
        from remote_dspark.shm import memfd
        lib = native.load()
        region = memfd.Region.attach({fd})
        looks_after_resume = []
        signal.signal(signal.SIGCONT, lambda *_: looks_after_resume.append(0))

        def should_stop():
            if looks_after_resume:
                looks_after_resume.append(1)
            return len(looks_after_resume) > 3

        print("promoted" if wait_for_promotion(region, lib, should_stop) else "not promoted", flush=True)
    """


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def offer(lib, region, pid: int, within_s: float) -> native.Status:
    return native.check(
        lib.standby_offer(region.addr(region.layout.standby_go), pid, native.deadline_ns(within_s)), "offer"
    )


def test_a_waiting_standby_accepts_its_promotion(lib):
    with make_region() as region, child(standby_code(region.fd), lib, (region.fd,)) as proc:
        ready = region.addr(region.layout.standby_pid)
        assert until(lambda: lib.load32(ready) == proc.pid, timeout=CHILD_TIMEOUT_S)
        assert offer(lib, region, proc.pid, CHILD_TIMEOUT_S) is native.Status.OK
        assert finish(proc) == "promoted\n"
        assert lib.load32(region.addr(region.layout.standby_go)) == proc.pid | ACCEPTED


def test_a_stopped_standby_is_not_promoted_and_never_takes_the_role_once_resumed(lib):
    """Its offer is withdrawn at the deadline; resumed, it looks again (a few idle ticks)
    and finds no offer: the withdrawal won the one swap."""
    with make_region() as region, child(standby_code(region.fd), lib, (region.fd,)) as proc:
        ready = region.addr(region.layout.standby_pid)
        assert until(lambda: lib.load32(ready) == proc.pid, timeout=CHILD_TIMEOUT_S)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            assert until(lambda: state_of(proc.pid) == "T")
            assert offer(lib, region, proc.pid, 0.02) is native.Status.TIMEOUT
            assert lib.load32(region.addr(region.layout.standby_go)) == 0
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert finish(proc) == "not promoted\n"


def test_an_offer_nobody_answers_is_withdrawn_and_a_bad_pid_refused(lib):
    with make_region() as region:
        go = region.addr(region.layout.standby_go)
        assert offer(lib, region, 4242, 0.001) is native.Status.TIMEOUT and lib.load32(go) == 0
        # A standby looking later finds nothing to accept.
        assert lib.standby_wait(go, 4242, native.deadline_ns(0.001)) == native.Status.TIMEOUT
        for bad in (0, ACCEPTED | 4242):
            with pytest.raises(RuntimeError, match="offer: STATE"):
                offer(lib, region, bad, 0.001)


def test_offer_and_answer_racing_have_exactly_one_winner(lib):
    """A standby thread answering offers whose deadlines (none, or up to 40 us) race its wake-up: an
    offer reported accepted is exactly one the standby accepted, every time."""
    with make_region() as region:
        go = region.addr(region.layout.standby_go)
        accepted: set[int] = set()
        current = [0]  # the id the standby waits to be offered; 0: stop
        done = threading.Event()

        def standby() -> None:  # an id it accepted stays accepted: the word then holds id | ACCEPTED
            while (me := current[0]) != 0:
                if lib.standby_wait(go, me, native.deadline_ns(0.0005)) == native.Status.OK:
                    accepted.add(me)
            done.set()

        rng = random.Random(7)
        results: dict[int, bool] = {}
        current[0] = 1
        thread = threading.Thread(target=standby, daemon=True)
        thread.start()
        try:
            for me in range(1, 301):
                current[0] = me
                results[me] = offer(lib, region, me, rng.choice((0.0, rng.uniform(0, 40e-6)))) is native.Status.OK
        finally:
            current[0] = 0
            assert done.wait(CHILD_TIMEOUT_S)
            thread.join(CHILD_TIMEOUT_S)
        assert {me for me, ok in results.items() if ok} == accepted

"""Fault injection for chaos runs and tests: answer rounds late, garble replies.

A :class:`Faults` is given to a :class:`~remote_dspark.worker.server.Worker` (none by
default: a worker without one answers every round as soon as it is drafted). Who
changes the faults and who reads them are different threads: ``remote-dspark worker
--chaos`` changes them from signal handlers (SIGUSR1, SIGUSR2), a test from its own
thread, and every served connection's thread reads them once per round.

Changing them never takes a lock, so it is safe in a signal handler. In CPython a signal
handler runs in the main thread between two bytecodes of whatever that thread was doing;
a handler that took a lock could interrupt the main thread while it holds that very
lock, and wait for itself forever. So each change is an order put on a
:class:`queue.SimpleQueue`, whose ``put`` is reentrant (documented so: it may interrupt
another ``put`` or ``get`` of the same queue in the same thread without deadlock or
damage). The state has one owner, the lock, taken only by readers: a reader applies the
orders queued so far, in their order, and takes its :class:`Fault` in the same hold. So
two rounds never both spend one garbled reply, no garbled reply is lost, and a round's
delay and garbling are read at the same moment.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass

LATE_S = 0.2  # the delay toggle_late switches on (remote-dspark worker --late-ms)


@dataclass(frozen=True)
class Fault:
    """What one round's reply gets: sent ``delay_s`` late, and garbled (random bytes of
    the DRAFTS frame's length) or not."""

    delay_s: float = 0.0
    garble: bool = False


class Faults:
    """The faults a worker injects into its replies: a delay for every reply, and a
    number of replies still to garble.

    ``set_delay``, ``toggle_late`` and ``garble_next`` may be called from any thread or a
    signal handler and never block; ``take`` and ``apply`` are for the threads that send
    replies (never a signal handler: they take the lock).
    """

    def __init__(self, late_s: float = LATE_S):
        if not late_s >= 0:
            raise ValueError(f"late_s {late_s}: must be >= 0")
        self.late_s = late_s
        self._orders: queue.SimpleQueue[tuple[str, float]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._delay_s = 0.0  # under _lock
        self._garbles = 0  # replies still to garble; under _lock

    # ------------------------------------------------------------------ changing them: any thread, signal handlers

    def set_delay(self, seconds: float) -> None:
        """Answer every round ``seconds`` late (0: on time)."""
        if not seconds >= 0:
            raise ValueError(f"delay {seconds}: must be >= 0")
        self._orders.put(("delay", seconds))

    def toggle_late(self) -> None:
        """Answer every round ``late_s`` late if rounds are answered on time, else on time."""
        self._orders.put(("toggle", 0))

    def garble_next(self, n: int = 1) -> None:
        """Garble the next ``n`` replies, over all connections, on top of any still owed."""
        if n < 0:
            raise ValueError(f"garble_next {n}: must be >= 0")
        self._orders.put(("garble", n))

    # ------------------------------------------------------------------ reading them: the reply's thread

    def take(self) -> Fault:
        """This reply's fault: the delay as of now, and one of the garbled replies owed,
        if any (spent by this call)."""
        with self._lock:
            while True:
                try:
                    kind, value = self._orders.get_nowait()
                except queue.Empty:
                    break
                if kind == "delay":
                    self._delay_s = value
                elif kind == "toggle":
                    self._delay_s = 0.0 if self._delay_s else self.late_s
                else:
                    self._garbles += int(value)
            garble = self._garbles > 0
            self._garbles -= garble
            return Fault(self._delay_s, garble)

    def apply(self, reply: bytes) -> bytes:
        """``reply`` as this round's fault makes it, returned after the fault's delay (the
        calling thread sleeps through it: it stands for a slow worker)."""
        fault = self.take()
        if fault.delay_s:
            time.sleep(fault.delay_s)
        return os.urandom(len(reply)) if fault.garble else reply

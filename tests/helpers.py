"""Small helpers the tests import by name."""

import time


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

    from remote_dspark.worker import MarkovDrafter

    class GatedDrafter(MarkovDrafter):
        def __init__(self):
            super().__init__(model)
            self.gate = threading.Event()
            self.gate.set()

        def draft(self, context, n_out, row):
            self.gate.wait(wait_s)
            return super().draft(context, n_out, row)
    return GatedDrafter()

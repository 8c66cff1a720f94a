"""Small helpers the tests import by name."""

import time


def until(cond, timeout: float = 10.0, step: float = 0.005) -> bool:
    """Poll ``cond`` until it is true or ``timeout`` seconds pass; its last value.
    For conditions another process or thread makes true: bounded, never sleep-and-hope."""
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(step)
    return bool(cond())

"""A one-line progress bar on stderr for long commands (demo, bench, chaos).

On a terminal it redraws in place at most ten times a second; elsewhere (CI logs, pipes)
it prints one line at each tenth of the way, so logs stay short.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, stream=None, width: int = 30):
        self.total = max(1, total)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_draw = 0.0
        self._last_tenth = -1

    def update(self, done: int, note: str = "") -> None:
        done = min(done, self.total)
        if self.tty:
            now = time.monotonic()
            if done < self.total and now - self._last_draw < 0.1:
                return
            self._last_draw = now
            bar = "#" * (self.width * done // self.total)
            end = "\n" if done == self.total else ""
            print(
                f"\r{self.label} [{bar:<{self.width}}] {done}/{self.total} {note}",
                end=end,
                file=self.stream,
                flush=True,
            )
        else:
            tenth = 10 * done // self.total
            if tenth != self._last_tenth:
                self._last_tenth = tenth
                print(f"{self.label}: {done}/{self.total} {note}".rstrip(), file=self.stream, flush=True)
